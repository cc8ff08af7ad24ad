"""Daemon fixtures: an in-process daemon on its own thread (so the blocking-call guard sees its event
loop) and a fault-injecting proxy in front of the S3 origin (helpers: tests/support/daemons.py)."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from sidecar.daemon.settings import ServeSettings
from tests.support.daemons import make_settings
from tests.support.proxies import FaultProxy
from tests.support.threads import DaemonThread


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


# Loopback is never reached through a developer's HTTP proxy (boto3 and urllib read these).
os.environ.setdefault("NO_PROXY", "127.0.0.1,localhost")
