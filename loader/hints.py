"""Prefetch hints, sent to the daemon from a thread of their own.

A hint is one small request (0.3-1 ms on loopback, more on a busy node) whose answer the reader
has no use for. Sent from the loop that reads samples, two per shard (the open and the hint)
were 20% of a warm epoch's time (1 GiB, 64 MiB shards, 2-core VM). The sender keeps their order
(the daemon fills hinted shards in the order they are asked for) and merges hints queued while a
request is in flight into the next one.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Hashable, Sequence
from typing import Generic, TypeVar

__all__ = ["HintSender"]

log = logging.getLogger(__name__)

T = TypeVar("T", bound=Hashable)


class HintSender(Generic[T]):
    """``put(items)`` returns at once; ``send(batch)`` runs on the sender's thread, one batch at a
    time, each item once per batch in first-asked order. A failed send is logged and dropped: a
    hint is never needed for correctness, only for speed."""

    def __init__(self, send: Callable[[list[T]], object], name: str) -> None:
        self._send = send
        self._name = name
        self._cond = threading.Condition()
        self._queue: list[T] = []
        self._busy = False
        self._closed = False
        self._thread: threading.Thread | None = None

    def put(self, items: Sequence[T]) -> None:
        if not items:
            return
        with self._cond:
            if self._closed:
                return
            self._queue.extend(items)
            if self._thread is None:
                # Started on first use: a loader reading files only never has one.
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue:
                    return  # closed, and everything asked for went out
                batch, self._queue = list(dict.fromkeys(self._queue)), []
                self._busy = True
            try:
                self._send(batch)
            except Exception as exc:  # noqa: BLE001 - a hint's failure costs speed, not data
                log.debug("prefetch hint of %d object(s) not sent: %s", len(batch), exc)
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def flush(self, timeout: float) -> bool:
        """Wait until every hint put so far was sent (or failed); False when ``timeout`` passed."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._queue and not self._busy, timeout)

    def close(self, timeout: float = 1.0) -> None:
        """Send what is queued (within ``timeout``), then stop the thread; later hints are dropped."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
