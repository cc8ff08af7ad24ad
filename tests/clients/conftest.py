"""Real S3 clients read through the cache: moto (tests/conftest.py) is the origin, a ``shardcache
serve`` process is the node daemon in front of it, and a sidecar process forwards to that daemon
over a unix socket as in a pod. Each test runs one client for real against the origin directly
and through the cache, and compares what the client reports field by field.

Everything here is module- or package-scoped so the folder stays within a few minutes on two
cores: the data set is uploaded once, and each test file gets fresh daemons (so its first reads
are cache misses and its repeated reads hits)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.client_dataset import Dataset, build_objects, upload
from tests.support.daemons import DaemonProcess


@pytest.fixture(scope="package")
def dataset(s3_server: Any) -> Dataset:
    bucket = s3_server.new_bucket()
    objects = build_objects()
    upload(s3_server.client(), bucket, objects)
    return Dataset(bucket, {o.key: o for o in objects})


@pytest.fixture(scope="module")
def daemon(s3_server: Any, dataset: Dataset, tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    """The node daemon: S3 origin moto, a unix socket for the sidecar, TCP for the clients."""
    work = tmp_path_factory.mktemp("daemon")
    node = DaemonProcess(
        ["--origin", "s3", "--s3-endpoint", s3_server.endpoint, "--cache-dir", str(work / "cache"),
         "--cache-size", "1GiB", "--min-free", "0", "--part-size", "4MiB", "--retries", "1",
         "--listen", f"unix://{socket_path(work)}"],
        work / "daemon.log",
    ).start()
    try:
        yield node
    finally:
        node.stop()


@pytest.fixture(scope="module")
def sidecar(s3_server: Any, daemon: DaemonProcess, tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    """The pod sidecar, forwarding to the node daemon's socket."""
    work = tmp_path_factory.mktemp("sidecar")
    node_work = Path(str(daemon.log)).parent
    pod = DaemonProcess(
        ["--mode", "sidecar", "--upstream", f"unix://{socket_path(node_work)}", "--origin", "s3",
         "--s3-endpoint", s3_server.endpoint, "--cache-dir", str(work / "cache"), "--cache-size", "1GiB",
         "--min-free", "0", "--retries", "1"],
        work / "sidecar.log",
    ).start()
    try:
        yield pod
    finally:
        pod.stop()


def socket_path(work: Path) -> Path:
    return work / "daemon.sock"


@pytest.fixture(scope="module")
def origin_url(s3_server: Any) -> str:
    return str(s3_server.endpoint)


@pytest.fixture(scope="module", params=["daemon", "sidecar"])
def cache_url(request: pytest.FixtureRequest) -> str:
    """The cache endpoint a client is pointed at: the node daemon, then the pod sidecar."""
    return str(request.getfixturevalue(request.param).url)


@pytest.fixture(scope="module")
def daemon_url(daemon: DaemonProcess) -> str:
    """For the clients run only against the node daemon (the sidecar forwards the same answers;
    aws-cli and boto3 cover it)."""
    return str(daemon.url)
