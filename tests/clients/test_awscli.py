"""aws-cli (v1, ``python -m awscli``, its own process as users run it) through the cache: what it
prints, the files it writes and its exit codes must equal what it does against the origin."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.support.client_dataset import MANY, Dataset, sha256
from tests.support.compare import assert_same, scrub
from tests.support.processes import PYTHON

pytestmark = pytest.mark.slow

CONFIG = "[default]\nregion = us-east-1\ns3 =\n  addressing_style = path\n"


@dataclass(frozen=True)
class Run:
    rc: int
    stdout: Any  # parsed JSON where the command prints JSON
    stderr: str


@pytest.fixture(scope="module")
def aws(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Run]:
    home = tmp_path_factory.mktemp("awscli")
    (home / "config").write_text(CONFIG)
    env = {**os.environ, "AWS_CONFIG_FILE": str(home / "config"), "AWS_SHARED_CREDENTIALS_FILE": str(home / "none"),
           "AWS_PAGER": "", "AWS_MAX_ATTEMPTS": "1", "AWS_RETRY_MODE": "standard", "TZ": "UTC"}

    def run(url: str, *args: str) -> Run:
        proc = subprocess.run([PYTHON, "-m", "awscli", "--endpoint-url", url, "--output", "json", *args],
                              capture_output=True, text=True, env=env, timeout=120, cwd=home)
        try:
            out: Any = json.loads(proc.stdout) if proc.stdout.strip().startswith("{") else proc.stdout
        except ValueError:
            out = proc.stdout
        return Run(proc.returncode, out, scrub(proc.stderr, url))

    return run


ORIGIN_RUNS: dict[tuple[str, ...], Run] = {}  # the origin's answers, run once for both cache endpoints


def same_run(aws: Callable[..., Run], origin_url: str, cache_url: str, *args: str) -> Run:
    key = (origin_url, *args)
    if key not in ORIGIN_RUNS:
        ORIGIN_RUNS[key] = aws(origin_url, *args)
    direct = ORIGIN_RUNS[key]
    assert_same(direct.__dict__, aws(cache_url, *args).__dict__)
    return direct


COMMANDS = {
    "ls top": ["s3", "ls", "s3://{b}/"],
    "ls odd recursive": ["s3", "ls", "--recursive", "s3://{b}/odd/"],
    "ls nested": ["s3", "ls", "s3://{b}/nested/"],
    "list-objects v1": ["s3api", "list-objects", "--bucket", "{b}", "--prefix", "odd/"],
    "list-objects-v2 delimiter": ["s3api", "list-objects-v2", "--bucket", "{b}", "--prefix", "nested/", "--delimiter", "/"],
    "head-object space": ["s3api", "head-object", "--bucket", "{b}", "--key", "odd/with space.txt"],
    "head-object unicode": ["s3api", "head-object", "--bucket", "{b}", "--key", "odd/ünïcödé-日本語.txt"],
    "head-object big": ["s3api", "head-object", "--bucket", "{b}", "--key", "big/seventeen.bin"],
    "head-bucket": ["s3api", "head-bucket", "--bucket", "{b}"],
    "head-bucket missing": ["s3api", "head-bucket", "--bucket", "{missing}"],
    "get-object missing key": ["s3api", "get-object", "--bucket", "{b}", "--key", "no/such key", "out"],
    "get-object range": ["s3api", "get-object", "--bucket", "{b}", "--key", "big/six.bin", "--range", "bytes=10-99", "out"],
    "cp missing key": ["s3", "cp", "s3://{b}/no/such key", "-"],
    "ls missing bucket": ["s3", "ls", "s3://{missing}/"],
}


@pytest.mark.parametrize("name", COMMANDS)
def test_command_matches_origin(aws: Callable[..., Run], dataset: Dataset, origin_url: str, cache_url: str, name: str) -> None:
    args = [a.format(b=dataset.bucket, missing=dataset.missing_bucket) for a in COMMANDS[name]]
    direct = same_run(aws, origin_url, cache_url, *args)
    assert direct.rc == (0 if "missing" not in name else direct.rc)


def test_listing_of_more_than_a_page(aws: Callable[..., Run], dataset: Dataset, origin_url: str, cache_url: str) -> None:
    direct = same_run(aws, origin_url, cache_url, "s3", "ls", "--recursive", f"s3://{dataset.bucket}/many/")
    assert len(direct.stdout.splitlines()) == MANY
    v1 = same_run(aws, origin_url, cache_url, "s3api", "list-objects", "--bucket", dataset.bucket, "--prefix", "many/")
    assert len(v1.stdout["Contents"]) == MANY


def test_cp_downloads_the_same_files(aws: Callable[..., Run], dataset: Dataset, origin_url: str, cache_url: str, tmp_path: Path) -> None:
    """``s3 cp`` of a 17 MiB object (multipart ranged GETs past aws-cli's 8 MiB threshold) and a
    recursive copy of the odd keys write the same files as from the origin."""
    trees = {}
    for name, url in (("direct", origin_url), ("cached", cache_url)):
        root = tmp_path / name
        big = aws(url, "s3", "cp", "--only-show-errors", f"s3://{dataset.bucket}/big/seventeen.bin", str(root / "big.bin"))
        odd = aws(url, "s3", "cp", "--only-show-errors", "--recursive", f"s3://{dataset.bucket}/odd/", str(root / "odd"))
        assert (big.rc, big.stderr, odd.rc, odd.stderr) == (0, "", 0, ""), name
        trees[name] = {str(p.relative_to(root)): sha256(p.read_bytes()) for p in sorted(root.rglob("*")) if p.is_file()}
    assert trees["direct"]["big.bin"] == dataset.objects["big/seventeen.bin"].sha
    assert {f"odd/{k}" for k in trees["direct"] if k.startswith("odd")} == {f"odd/{o.key}" for o in dataset.under("odd/")}
    assert_same(trees["direct"], trees["cached"])
