"""Fixtures every test area shares: a real S3 endpoint (moto server in its own process),
AWS test credentials, and the guard that fails a test which blocks an event loop."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests.support.s3 import S3Server

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


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    with S3Server(tmp_path_factory.mktemp("moto")) as server:
        yield server


@pytest.fixture(scope="session")
def second_s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """Another S3 endpoint, with buckets and objects of its own (tests of a cache reused with
    another origin)."""
    with S3Server(tmp_path_factory.mktemp("moto2")) as server:
        yield server


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


def pytest_configure(config: pytest.Config) -> None:
    # Texts tests put in the terminal summary (the benchmark smoke test's table), from any
    # pytest-xdist worker: tests/support/summary.py.
    from tests.support.summary import register

    register(config)
