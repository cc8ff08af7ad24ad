"""Servers on a thread of the test process, each with its own event loop, so the autouse
blocking-call guard (tests/conftest.py) watches that loop: a stdlib server (:func:`serving`),
any server coroutine (:class:`ServerThread`), the daemon's app (:class:`DaemonThread`) and the
master's (:class:`MasterThread`)."""

from __future__ import annotations

import asyncio
import json
import socketserver
import threading
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Self

from tests.support.waits import wait_until

__all__ = ["DaemonThread", "MasterThread", "ServerThread", "serving"]


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
    """``shardcache serve`` (its aiohttp app) running in this process, with the S3 client and the
    stats the tests read; see :class:`ServerThread`."""

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

    def client(self, retries: int = 0) -> Any:
        from tests.support.s3 import s3_client

        return s3_client(self.url, retries)

    def stats(self) -> dict[str, Any]:
        with urllib.request.urlopen(self.url + "/_shardcache/stats", timeout=10) as resp:
            answer: dict[str, Any] = json.loads(resp.read())
        return answer

    def settle(self) -> None:
        """Wait until no fill is in flight (a reader may finish before the fill is published)."""
        wait_until(lambda: self.stats()["fills_in_flight"] == 0, timeout=20, what="fills to finish")

    def metrics(self) -> str:
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as resp:
            return resp.read().decode()


class MasterThread(ServerThread):
    """A master serving in this process, on a thread with its own event loop."""

    def __init__(self, settings: Any) -> None:
        super().__init__("master")
        self.settings = settings
        self.port = int(settings.listen[0].rsplit(":", 1)[1])
        self.url = f"http://127.0.0.1:{self.port}"

    async def serve(self, stop: asyncio.Event, on_ready: Callable[[], None]) -> None:
        from loader.master.server.app import serve

        await serve(self.settings, stop=stop, on_ready=on_ready)
