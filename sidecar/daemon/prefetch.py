"""Background prefetch: a priority queue drained by a few guarded worker tasks.

Lease prefetches (a trainer's next shards) run before warm-ups; demand reads never queue here at
all, they start their fill directly and their origin requests outrank every prefetch's
(:mod:`sidecar.daemon.priority`).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from dataclasses import dataclass

from sidecar.daemon.metrics import Metrics
from sidecar.daemon.priority import PRIORITIES
from sidecar.daemon.reads import ReadContext, ReadService
from sidecar.errors import SidecarError

__all__ = ["Prefetcher", "PrefetchItem", "QueueFull"]

log = logging.getLogger(__name__)
_NAMES = {value: name for name, value in PRIORITIES.items()}


class QueueFull(SidecarError):
    pass


@dataclass(frozen=True)
class PrefetchItem:
    """One object to fetch ahead. A cached copy of it is enough: callers' checksums are judged
    when they read (:mod:`sidecar.daemon.claims`), so no hint can make the daemon fetch again."""

    bucket: str
    key: str
    tenant: str = ""
    """Whose request asked for it ("" without auth): the fill's entry counts against that
    tenant's quota. Last, so ``PrefetchItem(bucket, key)`` still reads as before."""


class Prefetcher:
    DEMAND_YIELD_MAX_S = 5.0

    def __init__(self, reads: ReadService, metrics: Metrics, workers: int, max_queued: int) -> None:
        self.reads = reads
        self.fetcher = reads.fetcher
        self.metrics = metrics
        self.max_queued = max_queued
        self._queue: asyncio.PriorityQueue[tuple[int, int, PrefetchItem]] = asyncio.PriorityQueue()
        self._queued: dict[tuple[str, str], int] = {}
        self._seq = itertools.count()
        self._workers = workers
        self._tasks: list[asyncio.Task[None]] = []
        self.done = 0
        self.failed = 0

    def start(self) -> None:
        self._tasks = [
            asyncio.create_task(self._guarded(i), name=f"prefetch-worker-{i}") for i in range(self._workers)
        ]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []

    def submit(self, items: list[PrefetchItem], priority: int) -> int:
        """Queue what is neither cached nor queued at this or a better priority; returns how many."""
        if len(self._queued) + len(items) > self.max_queued:
            raise QueueFull(f"prefetch queue holds {len(self._queued)} objects (max {self.max_queued})")
        accepted = 0
        for item in items:
            name = (item.bucket, item.key)
            if self.reads.cached(item.bucket, item.key):
                continue
            if name in self.fetcher.inflight:
                self.fetcher.inflight[name].priority = min(self.fetcher.inflight[name].priority, priority)
                continue
            queued = self._queued.get(name)
            if queued is not None and queued <= priority:
                continue
            self._queued[name] = priority
            self._queue.put_nowait((priority, next(self._seq), item))
            accepted += 1
        self._update_gauge()
        return accepted

    def queued(self) -> dict[str, int]:
        counts = {name: 0 for name in PRIORITIES}
        for priority in self._queued.values():
            counts[_NAMES[priority]] += 1
        return counts

    def _update_gauge(self) -> None:
        for name, count in self.queued().items():
            self.metrics.prefetch_queued.labels(priority=name).set(count)

    async def _yield_to_demand(self) -> None:
        """Start no new prefetch while a trainer waits on a fill, for up to ``DEMAND_YIELD_MAX_S``.

        Priorities order who gets an origin connection, but once fills run they share the
        origin's bandwidth: at a trainer's start its first shard (demand) and the hinted next ones
        (lease) would split a bandwidth-capped origin evenly and the first batch would wait for
        all of them. Measured by bench/stall_bench.py as nearly all of the cold-epoch stall."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.DEMAND_YIELD_MAX_S
        while self.fetcher.demand_in_flight() and loop.time() < deadline:
            await asyncio.sleep(0.02)

    async def _guarded(self, index: int) -> None:
        # A crash of one prefetch must never kill the worker: log it and take the next.
        while True:
            priority, _, item = await self._queue.get()
            name = (item.bucket, item.key)
            if self._queued.get(name) != priority:
                continue  # superseded by a better-priority submission
            del self._queued[name]
            self._update_gauge()
            try:
                await self._yield_to_demand()
                fill = self.reads.prefetch(ReadContext(item.bucket, item.key, tenant=item.tenant, priority=priority))
                if fill is None:
                    continue  # cached meanwhile, or never cached
                await fill.wait_done()
                self.done += 1
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self.failed += 1
                log.warning("prefetch of %s/%s failed: %s", item.bucket, item.key, exc)
