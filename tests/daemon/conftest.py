"""Daemon fixtures: an in-process daemon on its own thread (so the blocking-call guard sees its event
loop), a daemon subprocess for kill -9, and a fault-injecting proxy in front of the S3 origin."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest
from botocore.config import Config

from cache import StoreSettings
from sidecar.daemon.fills import FetchSettings
from sidecar.daemon.origins.s3 import S3Settings
from sidecar.daemon.settings import ServeSettings
from tests.daemon.faultproxy import FaultProxy
from tests.helpers import PYTHON, free_port, http_ok, spawn, stop, wait_until
from tests.helpers import DaemonThread as BaseDaemonThread

FAST_RETRY = FetchSettings(retries=3, backoff_base_s=0.01, backoff_max_s=0.05, part_size=1024 * 1024)


def s3_client(endpoint: str, retries: int = 0) -> Any:
    return boto3.client(
        "s3",
        endpoint_url=endpoint,
        config=Config(retries={"total_max_attempts": retries + 1, "mode": "standard"}, s3={"addressing_style": "path"}),
    )


class DaemonThread(BaseDaemonThread):
    """The in-process daemon, with the S3 client and stats helpers these tests use."""

    def client(self, retries: int = 0) -> Any:
        return s3_client(self.url, retries)

    def stats(self) -> dict[str, Any]:
        with urllib.request.urlopen(self.url + "/_shardcache/stats", timeout=10) as resp:
            return json.loads(resp.read())

    def settle(self) -> None:
        """Wait until no fill is in flight (a reader may finish before the fill is published)."""
        wait_until(lambda: self.stats()["fills_in_flight"] == 0, timeout=20, what="fills to finish")

    def metrics(self) -> str:
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as resp:
            return resp.read().decode()


def make_settings(
    cache_dir: Path,
    origin: str,
    endpoint: str | None = None,
    capacity: int = 1 << 30,
    eviction: str = "lru",
    fetch: FetchSettings = FAST_RETRY,
    extra_listen: tuple[str, ...] = (),
    **kwargs: Any,
) -> ServeSettings:
    return ServeSettings(
        store=StoreSettings(root=cache_dir, capacity_bytes=capacity, min_free_ratio=0.0, eviction=eviction),
        listen=(f"tcp://127.0.0.1:{free_port()}", *extra_listen),
        origin=origin,
        s3=S3Settings(endpoint_url=endpoint, read_timeout_s=5, connect_timeout_s=2),
        fetch=fetch,
        **kwargs,
    )


@pytest.fixture
def start_daemon() -> Iterator[Callable[..., DaemonThread]]:
    started: list[DaemonThread] = []

    def _start(settings: ServeSettings) -> DaemonThread:
        daemon = DaemonThread(settings).start()
        started.append(daemon)
        return daemon

    yield _start
    for daemon in started:
        daemon.stop()


@pytest.fixture
def proxy(s3_server: Any) -> Iterator[FaultProxy]:
    fault_proxy = FaultProxy("127.0.0.1", s3_server.port).start()
    yield fault_proxy
    fault_proxy.close()


@pytest.fixture(params=["http", "boto3"])
def s3_daemon(
    request: pytest.FixtureRequest, tmp_path: Path, proxy: FaultProxy, start_daemon: Callable[..., DaemonThread]
) -> DaemonThread:
    """A daemon whose S3 origin is the moto server, reached through the fault proxy; once with
    each S3 client implementation."""
    settings = make_settings(tmp_path / "cache", "s3", proxy.endpoint)
    settings = dataclasses.replace(settings, s3=dataclasses.replace(settings.s3, client=request.param))
    return start_daemon(settings)


class DaemonProcess:
    """``shardcache serve`` as a real subprocess (for kill -9 and SIGTERM)."""

    def __init__(self, args: list[str], log: Path, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = [PYTHON, "-m", "sidecar.cli", "serve", "--listen", f"tcp://127.0.0.1:{self.port}", *args]
        self.log = log
        self.env = env or {}
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> DaemonProcess:
        self.proc = spawn(self.args, self.log, self.env)
        wait_until(lambda: http_ok(self.url + "/readyz"), timeout=30, what="daemon readiness")
        return self

    def stop(self) -> None:
        if self.proc is not None:
            stop(self.proc)

    def stats(self) -> dict[str, Any]:
        with urllib.request.urlopen(self.url + "/_shardcache/stats", timeout=10) as resp:
            return json.loads(resp.read())


def put_objects(client: Any, bucket: str, objects: dict[str, bytes]) -> None:
    for key, data in objects.items():
        client.put_object(Bucket=bucket, Key=key, Body=data)


def replace_fetch(settings: ServeSettings, **changes: Any) -> ServeSettings:
    return dataclasses.replace(settings, fetch=dataclasses.replace(settings.fetch, **changes))


def cache_files(cache_dir: Path) -> list[Path]:
    return sorted(p for p in cache_dir.rglob("*") if p.is_file() and p.name != "LOCK")


os.environ.setdefault("NO_PROXY", "127.0.0.1,localhost")
