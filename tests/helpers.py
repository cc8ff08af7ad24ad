"""Utilities shared by the tests: free ports, waiting for servers, real processes."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import socketserver
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Self

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextmanager
def serving(server: socketserver.BaseServer) -> Iterator[None]:
    """Run a stdlib server (``http.server``) on a daemon thread for the ``with`` block."""
    # A short poll interval: shutdown() waits for the loop to look, 0.5 s by default.
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


def wait_until(predicate: Callable[[], bool], timeout: float = 20.0, interval: float = 0.05, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if predicate():
                return
        except Exception:
            pass
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout}s waiting for {what}")


def http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return 200 <= resp.status < 300
    except Exception:
        return False


def wait_port(port: int, host: str = "127.0.0.1", timeout: float = 20.0) -> None:
    def connectable() -> bool:
        with socket.create_connection((host, port), timeout=1):
            return True

    wait_until(connectable, timeout=timeout, what=f"{host}:{port} to accept connections")


def spawn(args: Sequence[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    """Start a process in its own session, output to ``log`` (read it when a test fails)."""
    full_env = dict(os.environ)
    full_env.update(env or {})
    full_env.setdefault("PYTHONPATH", str(REPO))
    with open(log, "ab") as handle:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(
            list(args), stdout=handle, stderr=subprocess.STDOUT, env=full_env, cwd=str(REPO), start_new_session=True
        )


def stop(proc: subprocess.Popen[bytes], sig: int = signal.SIGTERM, timeout: float = 10.0) -> None:
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        return
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=timeout)


def kill9(proc: subprocess.Popen[bytes]) -> None:
    stop(proc, signal.SIGKILL)


PYTHON = sys.executable


class ServerThread:
    """A server coroutine on a thread of this process with its own event loop, so the autouse
    blocking-call guard watches that loop. ``serve(stop, on_ready)`` runs until ``stop`` is set
    and calls ``on_ready()`` once it listens."""

    def __init__(self, name: str) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._error: BaseException | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    async def serve(self, stop: asyncio.Event, on_ready: Callable[[], None]) -> None:
        raise NotImplementedError

    def _run(self) -> None:
        async def main() -> None:
            self._loop = asyncio.get_running_loop()
            self._stop = asyncio.Event()
            await self.serve(self._stop, self._ready.set)

        try:
            asyncio.run(main())
        except BaseException as exc:  # surfaced by start()/stop()
            self._error = exc
        finally:
            self._ready.set()

    def start(self) -> Self:
        self._thread.start()
        self._ready.wait(30)
        if self._error:
            raise self._error
        return self

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)
        if self._error:
            raise self._error


class DaemonThread(ServerThread):
    """``shardcache serve`` (its aiohttp app) running in this process; see :class:`ServerThread`."""

    def __init__(self, settings: Any) -> None:
        super().__init__("daemon")
        self.settings = settings
        self.port = int(settings.listen[0].rsplit(":", 1)[1]) if settings.listen[0].startswith("tcp") else 0
        self.url = f"http://127.0.0.1:{self.port}"

    async def serve(self, stop: asyncio.Event, on_ready: Callable[[], None]) -> None:
        from sidecar.daemon.server import serve_forever

        ready = asyncio.Event()
        notify = asyncio.create_task(ready.wait())
        notify.add_done_callback(lambda _: on_ready())
        try:
            await serve_forever(self.settings, ready, stop)
        finally:
            notify.cancel()
