"""Fixtures for the torchrun tests: a real ``shardcache master`` process.

``train.py`` is the script torchrun runs; its name keeps pytest from collecting it, and
``collect_ignore`` says so explicitly (it imports torch and reads torchrun's environment)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import free_port
from tests.loader.procs import Proc, master_args

__all__ = ["collect_ignore", "master"]

collect_ignore = ["train.py", "harness.py"]


@pytest.fixture
def master(tmp_path: Path) -> Iterator[str]:
    """``shardcache master`` with SQLite state; yields its URL."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = Proc("master", master_args(port, tmp_path / "master.db"), tmp_path / "master.log", url + "/healthz")
    try:
        yield url
    finally:
        proc.stop()
