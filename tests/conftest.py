"""Fixtures every test area shares: a real S3 endpoint (moto server in its own process),
AWS test credentials, and the guard that fails a test which blocks an event loop."""

from __future__ import annotations

import os
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import PYTHON, free_port, http_ok, spawn, stop, wait_until

# No test may reach a real AWS account, whatever the developer's environment holds.
os.environ["AWS_ACCESS_KEY_ID"] = "testing"
os.environ["AWS_SECRET_ACCESS_KEY"] = "testing"
os.environ["AWS_SESSION_TOKEN"] = "testing"
os.environ["AWS_DEFAULT_REGION"] = "us-east-1"
os.environ.pop("AWS_PROFILE", None)
os.environ.pop("AWS_ENDPOINT_URL", None)
# The test command's own switches (scripts/test.sh) stay; the product's settings do not leak in.
_TEST_SWITCHES = {"SHARDCACHE_BENCH_PEERS", "SHARDCACHE_TEST_KUBE_APISERVER", "SHARDCACHE_TEST_KUBE_CONTROLLER_MANAGER"}
for _name in [n for n in os.environ if n.startswith("SHARDCACHE_") and n not in _TEST_SWITCHES]:
    os.environ.pop(_name)


class S3Server:
    """A moto S3 server in its own process; ``restart`` and ``kill`` make real faults."""

    def __init__(self, log: Path) -> None:
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.log = log
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.proc = spawn([PYTHON, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)], self.log)
        wait_until(lambda: http_ok(self.endpoint + "/moto-api/"), timeout=30, what="moto server")

    def stop(self) -> None:
        if self.proc is not None:
            stop(self.proc)
            self.proc = None

    def client(self):  # type: ignore[no-untyped-def]
        import boto3
        from botocore.config import Config

        return boto3.client(
            "s3", endpoint_url=self.endpoint, config=Config(retries={"max_attempts": 1, "mode": "standard"})
        )

    def new_bucket(self) -> str:
        name = "b-" + uuid.uuid4().hex[:12]
        self.client().create_bucket(Bucket=name)
        return name


def _running_s3(log: Path) -> Iterator[S3Server]:
    server = S3Server(log)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    yield from _running_s3(tmp_path_factory.mktemp("moto") / "moto.log")


@pytest.fixture(scope="session")
def second_s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """Another S3 endpoint, with buckets and objects of its own (tests of a cache reused with
    another origin)."""
    yield from _running_s3(tmp_path_factory.mktemp("moto2") / "moto.log")


@pytest.fixture
def bucket(s3_server: S3Server) -> str:
    """A fresh, empty bucket on the shared S3 server."""
    return s3_server.new_bucket()


@pytest.fixture(autouse=True)
def no_blocking_in_event_loop() -> Iterator[None]:
    """Fail any test in which code running on an asyncio event loop makes a blocking call
    (file I/O, sleeps, sockets in blocking mode), as aiohttp's own suite does."""
    from blockbuster import blockbuster_ctx

    with blockbuster_ctx(scanned_modules=["cache", "sidecar", "loader"]) as bb:
        yield bb  # type: ignore[misc]
