"""Loader fixtures: a file:// dataset written by the ``webdataset`` package, and the real
``shardcache serve`` / ``shardcache master`` processes."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.helpers import PYTHON, free_port
from tests.loader.procs import Proc, master_args
from tests.loader.shards import Written, write_manifest, write_shards


@pytest.fixture
def dataset(tmp_path: Path) -> tuple[str, Written]:
    """A file:// dataset (root/bucket/prefix/) with a manifest: 6 shards x 7 samples."""
    written = write_shards(tmp_path / "root" / "bkt" / "ds", shards=6, per_shard=7)
    write_manifest(written)
    return f"file://{tmp_path}/root/bkt/ds/", written


@pytest.fixture
def start_daemon(tmp_path: Path) -> Iterator[Callable[..., str]]:
    """Start ``shardcache serve`` (a real process); returns its http:// URL."""
    procs: list[Proc] = []

    def start(origin: str, env: dict[str, str] | None = None, unix: Path | None = None) -> str:
        port = free_port()
        cache = tmp_path / f"cache-{port}"
        args = [
            PYTHON, "-m", "sidecar.cli", "serve", "--listen", f"tcp://127.0.0.1:{port}",
            "--cache-dir", str(cache), "--cache-size", "1GiB", "--min-free", "0%", "--origin", origin,
        ]
        if unix is not None:
            args += ["--listen", f"unix://{unix}"]
        url = f"http://127.0.0.1:{port}"
        procs.append(Proc("daemon", args, tmp_path / f"daemon-{port}.log", url + "/healthz", env))
        return url

    yield start
    for proc in procs:
        proc.stop()


@pytest.fixture
def master(tmp_path: Path) -> Iterator[str]:
    """``shardcache master`` with SQLite state (a real process); yields its URL."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = Proc("master", master_args(port, tmp_path / "master.db"), tmp_path / "master.log", url + "/healthz")
    try:
        yield url
    finally:
        proc.stop()
