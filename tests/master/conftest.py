"""Master fixtures: a real etcd server, masters as real processes (for kill -9), and a master
in this process on its own thread (so the blocking-call guard sees its event loop); helpers:
tests/support/masters.py."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from loader.master.client import MasterClient
from loader.master.server.settings import MasterSettings
from tests.support.masters import ETCD, EtcdServer, MasterProcess
from tests.support.processes import free_port
from tests.support.threads import MasterThread


@pytest.fixture(scope="session")
def etcd_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdServer]:
    if not (os.path.exists(ETCD) or shutil.which("etcd")):
        pytest.fail(f"{ETCD} is missing: install it with `apt-get update && apt-get install -y etcd-server` "
                    "(scripts/test.sh does this)")
    server = EtcdServer(tmp_path_factory.mktemp("etcd")).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def master_procs(tmp_path: Path) -> Iterator[list[MasterProcess]]:
    """Registry of master processes started by a test; every one is stopped afterwards."""
    procs: list[MasterProcess] = []
    try:
        yield procs
    finally:
        for proc in procs:
            proc.stop()


@pytest.fixture(scope="module")
def inproc_master(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MasterThread]:
    workdir = tmp_path_factory.mktemp("master")
    settings = MasterSettings(
        listen=(f"tcp://127.0.0.1:{free_port()}", f"unix://{workdir}/master.sock"),
        state=f"sqlite://{workdir}/master.db",
        max_body_bytes=256 * 1024,
        lease_ttl_s=30,
    )
    master = MasterThread(settings).start()
    try:
        yield master
    finally:
        master.stop()


@pytest.fixture
def clients() -> Iterator[Callable[..., MasterClient]]:
    """``clients(urls, **options)`` makes a MasterClient that is closed when the test ends."""
    made: list[MasterClient] = []

    def make(*args: Any, **kwargs: Any) -> MasterClient:
        made.append(MasterClient(*args, **kwargs))
        return made[-1]

    yield make
    for client in made:
        client.close()
