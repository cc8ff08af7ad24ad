"""Group commit: the log of accepted events, made durable in batches before any answer.

The service applies an event to the in-memory state, appends its record here and awaits the
returned future; the journal's writer task takes every record appended while the previous
batch was being written and writes them in one store transaction (one fsync for SQLite, one
txn for etcd). A future resolves only once its batch, and so every earlier batch, is durable.
If a write fails, that batch and everything queued behind it fail with
:class:`~loader.master.errors.StateError` and the journal refuses further appends: the
in-memory state is then ahead of the store, and the service must reload it (or step down).

Snapshots ride on batch boundaries: when the policy says one is due, the state is serialised
on the event loop at the moment the batch is taken (so it covers exactly the records up to the
batch's last sequence number) and the store writes both atomically, then drops the log below.
"""

from __future__ import annotations

import asyncio
import logging
import time
import zlib
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, Protocol

from loader.master.errors import StateError

__all__ = ["Journal", "Store", "LogRecord", "compress_text"]

log = logging.getLogger(__name__)

LogRecord = tuple[int, str]
"""(sequence number, single-line JSON text of {"now": float, "ev": event}). Sequence numbers are
consecutive, so a batch is a contiguous run of them."""


class Store(Protocol):
    """Durable home of the journal: a snapshot of the state plus the log after it."""

    async def open(self) -> None: ...

    async def load_text(self) -> tuple[str | None, int, Iterable[LogRecord]]:
        """(the snapshot's JSON text or None, its sequence number, the records after it in
        order). The text, not its decoded dict: a 1M-shard job's spec is read from it into
        columns (``MasterState.from_text``), where ``json.loads`` made ~600 MB of dicts. The
        records may be produced as they are consumed (iterate once)."""
        ...

    async def load(self) -> tuple[dict[str, Any] | None, int, list[LogRecord]]:
        """:meth:`load_text` with the snapshot decoded and the records in a list."""
        ...

    async def write(self, records: list[LogRecord], snapshot: tuple[int, str] | None) -> None:
        """Make ``records`` durable, atomically; with ``snapshot`` (sequence number of the last
        record, state as JSON text), store it instead and drop the log it covers."""
        ...

    async def close(self) -> None: ...


class Journal:
    def __init__(
        self,
        store: Store,
        *,
        max_batch: int = 512,
        snapshot_due: Callable[[], tuple[int, str] | None] = lambda: None,
        on_failure: Callable[[BaseException], Awaitable[None] | None] | None = None,
        observe: Callable[[int, float], None] | None = None,
    ) -> None:
        self._store = store
        self._max_batch = max(1, max_batch)
        self._snapshot_due = snapshot_due
        self._on_failure = on_failure
        self._observe = observe
        self._pending: list[tuple[LogRecord, asyncio.Future[None]]] = []
        self._wakeup = asyncio.Event()
        self._failed: BaseException | None = None
        self._task: asyncio.Task[None] | None = None

    @property
    def failed(self) -> bool:
        return self._failed is not None

    def start(self, name: str = "master-journal") -> None:
        self._task = asyncio.create_task(self._run(), name=name)

    def append(self, record: LogRecord) -> asyncio.Future[None]:
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if self._failed is not None:
            fut.set_exception(StateError(f"the master's state store failed ({self._failed}); retry shortly"))
        else:
            self._pending.append((record, fut))
            self._wakeup.set()
        return fut

    async def stop(self) -> None:
        """Write what is pending, then stop the writer (cancel-then-await)."""
        if self._task is None:
            return
        deadline = time.monotonic() + 10.0
        while self._pending and not self._failed and time.monotonic() < deadline and not self._task.done():
            await asyncio.sleep(0.01)
        self._task.cancel()
        try:
            await self._task
        except asyncio.CancelledError:
            pass
        self._task = None
        self._fail_all(StateError("the master is shutting down; retry against the new master"))

    def abort(self, reason: BaseException) -> None:
        """Refuse everything pending and everything to come (leadership lost)."""
        if self._failed is None:
            self._failed = reason
        self._fail_all(reason)
        if self._task is not None:
            self._task.cancel()

    def _fail_all(self, reason: BaseException) -> None:
        pending, self._pending = self._pending, []
        for _, fut in pending:
            if not fut.done():
                fut.set_exception(reason if isinstance(reason, StateError) else StateError(str(reason)))

    async def _run(self) -> None:
        try:
            while True:
                await self._wakeup.wait()
                self._wakeup.clear()
                while self._pending:
                    batch = self._pending[: self._max_batch]
                    del self._pending[: len(batch)]
                    # Taken now, after the last record of `batch` was applied and before any
                    # later record could be: the snapshot covers exactly this batch's prefix.
                    snapshot = self._snapshot_due() if not self._pending else None
                    started = time.perf_counter()
                    try:
                        await self._store.write([rec for rec, _ in batch], snapshot)
                    except asyncio.CancelledError:
                        for _, fut in batch:
                            if not fut.done():
                                fut.set_exception(StateError("the master stopped before this change was durable"))
                        raise
                    except Exception as exc:
                        log.error("state store write failed: %s", exc)
                        self._failed = exc
                        err = StateError(f"the master could not make the change durable ({exc}); retry shortly")
                        for _, fut in batch:
                            if not fut.done():
                                fut.set_exception(err)
                        self._fail_all(err)
                        if self._on_failure is not None:
                            maybe = self._on_failure(exc)
                            if maybe is not None:
                                await maybe
                        return
                    if self._observe is not None:
                        self._observe(len(batch), time.perf_counter() - started)
                    futures = [fut for _, fut in batch]
                    # Let go of the batch and the snapshot now (no loop variable left holding a
                    # record either): held until the next batch, the last records written (a
                    # 1M-shard job's create record is ~73 MB of text) and the last snapshot stayed
                    # in memory for as long as the master was idle.
                    del batch, snapshot
                    for fut in futures:
                        if not fut.done():
                            fut.set_result(None)
        except asyncio.CancelledError:
            raise
        except Exception:  # a bug here must not leave callers hanging
            log.exception("journal writer crashed")
            self.abort(StateError("the master's journal writer crashed; retry shortly"))


def compress_text(text: str, level: int = 3) -> bytes:
    """``zlib.compress(text.encode(), level)`` a megabyte at a time: a snapshot's text (~73 MB for
    a 1M-shard job) is never also held whole as bytes."""
    packer = zlib.compressobj(level)
    step = 1 << 20
    out = [packer.compress(text[i : i + step].encode()) for i in range(0, len(text), step)]
    out.append(packer.flush())
    return b"".join(out)
