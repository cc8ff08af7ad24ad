"""One exception root per package, and one class per error: every exception class that cache,
wire, sidecar and loader define derives from its package's root (but the few below, each for its
reason), and no two share a name unless one is the other's rule under another package's root
(``sidecar.errors.BadRequest`` is ``wire.errors.BadRequest`` with ``SidecarError`` as well).

The classes are found by importing every module of the four packages (in a fresh interpreter, so
that the frameworks the adapters load stay out of the test process); a class defined inside a
function or another class is not seen."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import defaultdict
from functools import cache
from typing import Any

from tests.support.processes import REPO

ROOTS = {
    "cache": "cache.errors.CacheError",
    "wire": "wire.errors.WireError",
    "sidecar": "sidecar.errors.SidecarError",
    "loader": "loader.errors.LoaderError",
}

# Deliberately outside their package's root. Each is a signal or a third party's kind of error that
# handlers elsewhere must see as that, never as one of our errors.
OUTSIDE_ROOT = {
    # A PyYAML error, so that load_documents' `except yaml.YAMLError` takes it with PyYAML's own
    # (and reads its line and column); it never leaves the module.
    "sidecar.k8s.yamldocs._Refused",
    # Ends a reader thread's scan once `shardcache index` is leaving: a signal that no handler of
    # errors may take for an error.
    "sidecar.cli.commands.index._Stopped",
    # The daemon's S3 error answer inside the loader's daemon client, until it is mapped to the
    # loader's error: its retry policy treats every LoaderError as final, this one by its kind.
    "loader.daemon._DaemonHTTPError",
    # A transport error like http.client's own (its base), for the callers' retry policies, which
    # all catch `(OSError, http.client.HTTPException)` (wire.httpclient.exchange's contract).
    "wire.httpclient.AnswerTooLarge",
}

# Adapters whose framework may be missing: their modules are skipped then (they define no exception).
_OPTIONAL = ("torch", "tensorflow")

_PROBE = r"""
import importlib, inspect, json, pkgutil, sys

classes, skipped = [], []
for package in sys.argv[2:]:
    top = importlib.import_module(package)
    for name in [package] + [m.name for m in pkgutil.walk_packages(top.__path__, package + ".")]:
        if name.rsplit(".", 1)[-1] == "__main__":
            continue  # runs its command when imported
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name in sys.argv[1].split(","):
                skipped.append(name)
                continue
            raise
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if cls.__module__ == name and issubclass(cls, BaseException):
                classes.append({
                    "name": f"{name}.{cls.__qualname__}",
                    "package": package,
                    "short": cls.__name__,
                    "mro": [f"{k.__module__}.{k.__qualname__}" for k in cls.__mro__],
                })
print(json.dumps({"classes": classes, "skipped": skipped}))
"""


@cache
def _found() -> dict[str, Any]:
    result = subprocess.run(
        [sys.executable, "-c", _PROBE, ",".join(_OPTIONAL), *ROOTS],
        cwd=REPO, check=True, capture_output=True, text=True, timeout=300,
    )
    found: dict[str, Any] = json.loads(result.stdout.splitlines()[-1])
    return found


def _classes() -> list[dict[str, Any]]:
    return list(_found()["classes"])


def test_every_package_has_one_root_on_exception() -> None:
    by_name = {c["name"]: c for c in _classes()}
    for root in ROOTS.values():
        assert by_name[root]["mro"][1] == "builtins.Exception", root


def test_every_exception_derives_from_its_package_root() -> None:
    outside = [
        c["name"] for c in _classes()
        if ROOTS[c["package"]] not in c["mro"] and c["name"] not in OUTSIDE_ROOT
    ]
    assert outside == [], f"derive these from their package's root, or list them in OUTSIDE_ROOT with the reason: {outside}"


def test_the_exceptions_outside_a_root_are_still_there_and_still_outside() -> None:
    by_name = {c["name"]: c for c in _classes()}
    for name in OUTSIDE_ROOT:
        assert name in by_name, f"{name} is gone: drop it from OUTSIDE_ROOT"
        assert ROOTS[by_name[name]["package"]] not in by_name[name]["mro"], f"{name} has its root now: drop it from OUTSIDE_ROOT"


def test_no_two_exceptions_share_a_name_but_one_rule_under_two_roots() -> None:
    groups: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for c in _classes():
        groups[c["short"]].append(c)
    for short, same in groups.items():
        if len(same) == 1:
            continue
        names = sorted(c["name"] for c in same)
        packages = [c["package"] for c in same]
        assert len(set(packages)) == len(packages), f"one package defines {short} twice: {names}"
        # One of them is the rule; each other one is that class under its own package's root.
        homes = [home for home in same if all(home["name"] in c["mro"] for c in same)]
        assert homes, f"{names} share a name but none derives from another: rename one, or derive it"


def test_the_probe_sees_every_package_and_the_known_pairs() -> None:
    classes = _classes()
    assert {c["package"] for c in classes} == set(ROOTS)
    assert not [name for name in _found()["skipped"] if not name.startswith(("loader.torch", "loader.tf"))]
    by_name = {c["name"]: c for c in classes}
    # The rules both sides mean alike, each defined once in wire and re-rooted where it is caught.
    for derived, home in (
        ("sidecar.errors.BadRequest", "wire.errors.BadRequest"),
        ("loader.master.errors.BadRequest", "wire.errors.BadRequest"),
        ("loader.master.errors.BodyTooLarge", "wire.errors.BodyTooLarge"),
        ("sidecar.errors.AccessDenied", "wire.errors.AccessDenied"),
        ("loader.errors.AccessDenied", "wire.errors.AccessDenied"),
        ("loader.master.errors.MasterError", "loader.errors.LoaderError"),
    ):
        assert home in by_name[derived]["mro"], (derived, home)
