"""The next shard opened on a thread of its own while the current one is read.

Opening a shard is a request to the daemon: 0.7 ms when both processes are busy, 1.5-2 ms after
the 10-20 ms a warm 64 MiB shard takes to read, because the daemon's threads have gone idle and
the machine takes that long to wake them (measured on a 2-core VM: 16% of a warm epoch). Made
while the previous shard is read, it costs the loop nothing. The loader opens ahead only after an
open answered from bytes in place (a cache hit, a local file): a cold shard's open would only wait
for the fill its prefetch hint started (and cold epochs measured the same with and without).

One thread per loader (per process) makes every open ahead, so what a source keeps per thread
(the handle socket's kept-alive connection) is made once, not once a shard.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

__all__ = ["OpenAhead", "Opener"]


class OpenAhead:
    """One open made by an :class:`Opener`: :meth:`take` waits for it and returns its reader (or
    raises its error); :meth:`abandon` closes a reader nobody will take, now or when the open
    ends."""

    def __init__(self, shard: Any, open_shard: Callable[[], Any]) -> None:
        self.shard = shard
        self._open = open_shard
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._reader: Any = None
        self._error: BaseException | None = None
        self._abandoned = False

    def run(self) -> None:
        """The open itself, on the opener's thread (skipped when abandoned before it began)."""
        try:
            if self._abandoned:
                return
            reader = self._open()
        except BaseException as exc:  # noqa: BLE001 - raised by take(), on the loop's thread
            self._error = exc
        else:
            with self._lock:
                if self._abandoned:
                    reader.close()
                else:
                    self._reader = reader
        finally:
            self._done.set()

    def take(self) -> Any:
        """The reader, once the open has ended; its error, raised here, if it failed."""
        self._done.wait()
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        with self._lock:
            reader, self._reader = self._reader, None
            self._abandoned = True  # taken: nothing left to close
        return reader

    def abandon(self) -> None:
        with self._lock:
            self._abandoned = True
            reader, self._reader = self._reader, None
        if reader is not None:
            reader.close()


class Opener:
    """A daemon thread making the opens :meth:`submit` asks for, one at a time, in order. Started
    on first use; :meth:`close` lets it end after the open under way."""

    def __init__(self, name: str = "shardcache-open-ahead") -> None:
        self._name = name
        self._cond = threading.Condition()
        self._queue: list[OpenAhead] = []
        self._closed = False
        self._thread: threading.Thread | None = None

    def submit(self, shard: Any, open_shard: Callable[[], Any]) -> OpenAhead:
        pending = OpenAhead(shard, open_shard)
        with self._cond:
            if self._closed:
                pending.abandon()
                pending.run()  # abandoned: only marks it done
                return pending
            self._queue.append(pending)
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, name=self._name, daemon=True)
                self._thread.start()
            self._cond.notify()
        return pending

    def _work(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue:
                    return
                pending = self._queue.pop(0)
            pending.run()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            queued, self._queue = self._queue, []
            self._cond.notify_all()
        for pending in queued:
            pending.abandon()
            pending.run()
