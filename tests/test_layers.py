"""The layering rule of the design, checked: cache knows nothing of HTTP, sidecar or loader;
loader talks to the daemon only over HTTP (never imports sidecar); import loader stays light."""

from __future__ import annotations

import ast
import subprocess
import sys

from tests.helpers import REPO


def imported_modules(package: str) -> set[str]:
    found: set[str] = set()
    for path in (REPO / package).rglob("*.py"):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                found.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found.add(node.module.split(".")[0])
    return found


def test_cache_imports_no_upper_layer_and_no_http():
    assert not imported_modules("cache") & {"sidecar", "loader", "aiohttp", "boto3", "botocore", "prometheus_client"}


def test_loader_never_imports_sidecar():
    if (REPO / "loader").exists():
        assert "sidecar" not in imported_modules("loader")


def test_import_cache_is_light():
    code = "import sys, cache; bad = {'aiohttp', 'sidecar', 'loader', 'boto3'} & set(sys.modules); assert not bad, bad"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)
