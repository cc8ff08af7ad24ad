"""``/readyz`` answers 200 only once every listener of the server is bound.

A daemon or master listening on a TCP port and a unix socket used to start its listeners one by
one and answer ``/readyz`` on the first while the socket did not exist yet: a probe (the chart's
readiness probe, the injected sidecar's start hook, the tests' own launcher) saw it ready and the
socket's clients then found no file (CI, stop 46: ``FileNotFoundError`` on ``daemon.sock`` right
after ``/readyz`` answered). Here the unix socket's bind is held back, as a slow start would, and
``/readyz`` over TCP must say 503 until the socket is there.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest

from loader.master.server.settings import MasterSettings
from tests.support.daemons import make_settings
from tests.support.masters import http
from tests.support.processes import free_port
from tests.support.threads import DaemonThread, MasterThread, ServerThread
from tests.support.waits import wait_until
from wire.web import GuardedSite


def hold_unix_binds(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Every unix socket listener waits for the returned event before it binds."""
    release = threading.Event()
    original = GuardedSite.start

    async def start(self: GuardedSite) -> None:
        if self._path is not None:
            await asyncio.to_thread(release.wait, 30)
        await original(self)

    monkeypatch.setattr(GuardedSite, "start", start)
    return release


def check_ready_after_socket(server: ServerThread, url: str, sock: Path, release: threading.Event) -> None:
    starter = threading.Thread(target=server.start, daemon=True)
    starter.start()
    try:
        # The TCP listener answers first; while the socket is held back it must not be "ready".
        wait_until(lambda: http("GET", url + "/healthz", timeout=2)[0] == 200, timeout=30, what="the TCP listener")
        for _ in range(5):
            status, _body = http("GET", url + "/readyz", timeout=2)
            assert status == 503 and not sock.exists(), status
        release.set()
        starter.join(30)
        wait_until(lambda: http("GET", url + "/readyz", timeout=2)[0] == 200, timeout=30, what="/readyz")
        assert sock.exists()
    finally:
        release.set()
        starter.join(30)
        server.stop()


def test_daemon_is_ready_only_with_its_socket(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    origin = tmp_path / "origin"
    (origin / "bk").mkdir(parents=True)
    sock = tmp_path / "daemon.sock"
    settings = make_settings(tmp_path / "cache", f"file://{origin}", extra_listen=(f"unix://{sock}",))
    daemon = DaemonThread(settings)
    check_ready_after_socket(daemon, daemon.url, sock, hold_unix_binds(monkeypatch))


def test_master_is_ready_only_with_its_socket(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sock = tmp_path / "master.sock"
    settings = MasterSettings(listen=(f"tcp://127.0.0.1:{free_port()}", f"unix://{sock}"),
                              state=f"sqlite://{tmp_path}/master.db")
    master = MasterThread(settings)
    check_ready_after_socket(master, master.url, sock, hold_unix_binds(monkeypatch))

