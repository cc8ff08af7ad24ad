"""Fixtures of the CLI tests: real daemon subprocesses, datasets on the moto S3 server and on disk
(helpers: tests/support/cli.py, daemons.py, datasets.py)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.daemons import Daemon
from tests.support.datasets import Dataset, make_shards, put_dataset, write_dataset


@pytest.fixture
def cli_env(s3_server: Any) -> dict[str, str]:
    """Environment of CLI subprocesses: test credentials and the moto endpoint."""
    return {"AWS_ENDPOINT_URL": s3_server.endpoint}


@pytest.fixture
def s3_dataset(s3_server: Any, bucket: str) -> Dataset:
    """Six shards (4 samples each) under s3://bucket/train/."""
    shards = make_shards(6)
    put_dataset(s3_server.client(), bucket, "train/", shards)
    return Dataset(f"s3://{bucket}/train/", bucket, "train/", shards)


@pytest.fixture
def big_s3_dataset(s3_server: Any, bucket: str) -> Dataset:
    """Six shards of ~512 KiB, for warm-ups slowed down with --bandwidth."""
    shards = make_shards(6, samples=4, member_bytes=128 * 1024, seed=7)
    put_dataset(s3_server.client(), bucket, "big/", shards)
    return Dataset(f"s3://{bucket}/big/", bucket, "big/", shards)


@pytest.fixture
def file_dataset(tmp_path: Path) -> Dataset:
    """Five shards under file://{tmp}/root/bkt/train/ (bucket ``bkt``)."""
    shards = make_shards(5, seed=3)
    write_dataset(tmp_path / "root" / "bkt" / "train", shards)
    return Dataset(f"file://{tmp_path}/root/bkt/train/", "bkt", "train/", shards)


@pytest.fixture
def daemon_factory(tmp_path: Path) -> Iterator[Callable[..., Daemon]]:
    started: list[Daemon] = []

    def start(origin: str, s3_endpoint: str | None = None, **kwargs: Any) -> Daemon:
        daemon = Daemon(tmp_path, origin, s3_endpoint, **kwargs).start()
        started.append(daemon)
        return daemon

    try:
        yield start
    finally:
        for daemon in started:
            daemon.stop()


@pytest.fixture
def s3_daemon(daemon_factory: Callable[..., Daemon], s3_server: Any) -> Daemon:
    return daemon_factory("s3", s3_server.endpoint)
