"""Loader fixtures: a file:// dataset written by the ``webdataset`` package, and the real
``shardcache serve`` / ``shardcache master`` processes (helpers: tests/support/)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from loader.members import MEMBER_INDEXES
from tests.support.daemons import DaemonProcess
from tests.support.masters import running_master
from tests.support.shards import Written, write_manifest, write_shards


@pytest.fixture(autouse=True)
def fresh_member_indexes() -> Iterator[None]:
    """Each test reads its own member indexes (the registry is per process, by checksum)."""
    MEMBER_INDEXES.clear()
    yield
    MEMBER_INDEXES.clear()


@pytest.fixture
def dataset(tmp_path: Path) -> tuple[str, Written]:
    """A file:// dataset (root/bucket/prefix/) with a manifest: 6 shards x 7 samples."""
    written = write_shards(tmp_path / "root" / "bkt" / "ds", shards=6, per_shard=7)
    write_manifest(written)
    return f"file://{tmp_path}/root/bkt/ds/", written


@pytest.fixture
def start_daemon(tmp_path: Path) -> Iterator[Callable[..., str]]:
    """Start ``shardcache serve`` (a real process); returns its http:// URL."""
    daemons: list[DaemonProcess] = []

    def start(origin: str, env: dict[str, str] | None = None, unix: Path | None = None) -> str:
        daemon = DaemonProcess([], tmp_path / "daemon.log", env, ready_path="/healthz")
        daemon.log = tmp_path / f"daemon-{daemon.port}.log"
        daemon.args = ["--cache-dir", str(tmp_path / f"cache-{daemon.port}"), "--cache-size", "1GiB", "--min-free", "0%",
                       "--origin", origin]
        if unix is not None:
            daemon.args += ["--listen", f"unix://{unix}"]
        daemons.append(daemon)
        return daemon.start().url

    yield start
    for daemon in daemons:
        daemon.stop()


@pytest.fixture
def master(tmp_path: Path) -> Iterator[str]:
    """``shardcache master`` with SQLite state (a real process); yields its URL."""
    with running_master(tmp_path) as url:
        yield url
