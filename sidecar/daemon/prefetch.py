"""Background prefetch: a priority queue drained by a few guarded worker tasks.

Lease prefetches (a trainer's next shards) run before warm-ups; demand reads never queue here at
all, they start their fill directly and their origin requests outrank every prefetch's
(:mod:`sidecar.daemon.priority`).

A prefetch taken from the queue first waits while readers' fills run (:meth:`Prefetcher._yield_to_demand`),
still queued, so a later plan may withdraw it; then it is dropped if a reader asked for its object
since it was queued (:meth:`ReadService.read_since`): that reader has it, and a fill now would
fetch again what the cache may have let go already.

The lease master's plan (:mod:`sidecar.daemon.masterlink`) prefetches at lease priority too
(:meth:`Prefetcher.submit_plan`), in the plan's order; each new plan withdraws what the last one
queued and this one no longer lists. A plan's fill never evicts an entry the plan keeps: it starts
only when the store has room counting what the plan does not keep as free
(:meth:`cache.Store.plan_room`, for an object of the cache's mean size) and begins under
:meth:`cache.Store.spare_kept` (under ``lru`` it evicts by LRU, under ``hold`` it fills free room
only). The bytes it brings in count as the job's ``prefetch_bytes`` (:mod:`sidecar.daemon.jobstats`).

A reader's hint and a plan's prefetch fill under :meth:`cache.Store.awaited`: under ``planned`` an
entry the current plan does not rank is kept like one it ranks until it is read, since the plan
cannot rank it before the master has heard of it (:class:`cache.eviction.PlannedPolicy`). A plan's
prefetch is ranked by the plan that asked for it, but a plan answered while it fills may not list
it: its shard was leased meanwhile, and the master ranks a leased shard only once the node holds it.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from cache import Entry, Store
from sidecar.daemon.fills import Fill
from sidecar.daemon.metrics import Metrics
from sidecar.daemon.priority import LEASE, PRIORITIES
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
    job: str = ""
    """The job the lease master's plan prefetches it for ("" for a hint's or a warm-up's)."""
    plan: bool = False
    """Asked for by the lease master's plan: its fill evicts nothing the plan keeps."""


class Prefetcher:
    DEMAND_YIELD_MAX_S = 5.0

    def __init__(self, reads: ReadService, metrics: Metrics, workers: int, max_queued: int) -> None:
        self.reads = reads
        self.fetcher = reads.fetcher
        self.metrics = metrics
        self.max_queued = max_queued
        self._queue: asyncio.PriorityQueue[tuple[int, int, float, PrefetchItem]] = asyncio.PriorityQueue()
        self._queued: dict[tuple[str, str], int] = {}
        self._planned: set[tuple[str, str]] = set()  # queued by the last plan
        self._seq = itertools.count()
        self._workers = workers
        self._tasks: list[asyncio.Task[None]] = []
        self.done = 0
        self.failed = 0
        self.read_first = 0
        """Prefetches (hints' and the plan's) dropped because a reader asked for the object after
        they were queued: whoever they were for has read it, or is reading it."""
        self.plan_counts = {"queued": 0, "withdrawn": 0, "filled": 0, "filled_bytes": 0, "no_room": 0, "joined": 0,
                            "read_first": 0}
        """What became of the plan's prefetches: queued, withdrawn by a later plan before they ran,
        filled (and their bytes), not started for lack of room the plan does not keep, joined to
        a fill already running, dropped as read since they were queued."""

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

    def submit(self, items: Sequence[PrefetchItem], priority: int) -> int:
        """Queue what is neither cached nor queued at this or a better priority; returns how many."""
        if len(self._queued) + len(items) > self.max_queued:
            raise QueueFull(f"prefetch queue holds {len(self._queued)} objects (max {self.max_queued})")
        accepted = len(self._enqueue(items, priority))
        self._update_gauge()
        return accepted

    def _enqueue(self, items: Sequence[PrefetchItem], priority: int) -> list[tuple[str, str]]:
        accepted: list[tuple[str, str]] = []
        for item in items:
            name = (item.bucket, item.key)
            if self.reads.cached(item.bucket, item.key):
                continue
            if name in self.fetcher.inflight:
                self.fetcher.inflight[name].priority = min(self.fetcher.inflight[name].priority, priority)
                continue
            queued = self._queued.get(name)
            if queued is not None and queued <= priority:
                if not item.plan:
                    self._planned.discard(name)  # a reader's hint too: no later plan withdraws it
                continue
            self._queued[name] = priority
            self._queue.put_nowait((priority, next(self._seq), time.monotonic(), item))
            accepted.append(name)
        return accepted

    def submit_plan(self, items: Sequence[PrefetchItem]) -> int:
        """The lease master's prefetch list (``plan=True`` items), in the order they will be read:
        queued at lease priority, skipping what is cached, filling or queued; what the last plan
        queued and this one no longer lists is withdrawn. As many as the queue has room for (a
        plan is a hint: never :class:`QueueFull`). Returns how many were queued."""
        wanted = {(item.bucket, item.key) for item in items}
        for name in self._planned - wanted:
            if self._queued.get(name) == LEASE:
                del self._queued[name]  # its worker skips it
                self.plan_counts["withdrawn"] += 1
        self._planned &= wanted
        room = max(0, self.max_queued - len(self._queued))
        accepted = self._enqueue(items[:room], LEASE)
        self._planned.update(accepted)
        self.plan_counts["queued"] += len(accepted)
        self._update_gauge()
        return len(accepted)

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
            priority, _, queued_at, item = await self._queue.get()
            name = (item.bucket, item.key)
            if self._queued.get(name) != priority:
                continue  # superseded by a better-priority submission
            try:
                # Still queued while it yields (up to DEMAND_YIELD_MAX_S on a busy node), so that a
                # later plan can withdraw it; and looked at again after: the capacity bed's daemon
                # logs showed prefetches that had waited out a reader's whole read, and then
                # fetched its object again from the origin, evicted already.
                await self._yield_to_demand()
                if self._queued.get(name) != priority:
                    continue  # withdrawn by a later plan meanwhile, or superseded
                del self._queued[name]
                self._planned.discard(name)
                self._update_gauge()
                if self.reads.read_since(item.bucket, item.key, queued_at):
                    self.read_first += 1
                    if item.plan:
                        self.plan_counts["read_first"] += 1
                    continue
                ctx = ReadContext(item.bucket, item.key, tenant=item.tenant, priority=priority)
                store = self.reads.store
                if item.plan and store is not None:
                    await self._plan_fill(store, item, ctx)
                    continue
                if store is None:
                    continue
                await self._hint_fill(store, item, ctx)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self.failed += 1
                log.warning("prefetch of %s/%s failed: %s", item.bucket, item.key, exc)

    async def _filled(self, fill: Fill, item: PrefetchItem) -> Entry | None:
        """The entry a prefetch's fill published; a fill that ended without one (refused, never
        cached, failed) drops the prefetch's unread mark, which no eviction would ever clear."""
        entry = None
        try:
            entry = await fill.wait_done()
        finally:
            if entry is None:
                self.reads.unread.forget(item.bucket, item.key)
        return entry

    async def _hint_fill(self, store: Store, item: PrefetchItem, ctx: ReadContext) -> None:
        """A reader's hint: its entry is awaited (:meth:`cache.Store.awaited`) until read."""
        name = (item.bucket, item.key)
        if name in self.fetcher.inflight:
            # A running fill (a reader's, the plan's): promoted; its entry is not awaited.
            if (fill := self.reads.prefetch(ctx)) is not None:
                await fill.wait_done()
                self.done += 1
            return
        with self._prefetching(name), store.awaited(item.bucket, item.key):
            fill = self.reads.prefetch(ctx, cause="hint")
            if fill is None:
                return  # cached meanwhile, or never cached
            await self._filled(fill, item)
        self.done += 1

    @contextlib.contextmanager
    def _prefetching(self, name: tuple[str, str]) -> Iterator[None]:
        """``name``'s fill is a prefetch's while in the block (:attr:`ReadService.prefetching`)."""
        self.reads.prefetching.add(name)
        try:
            yield
        finally:
            self.reads.prefetching.discard(name)

    def _starting(self) -> int:
        """Prefetches (the plan's, the hints') whose fills have not been admitted by the store yet."""
        inflight = self.fetcher.inflight
        return sum(1 for name in self.reads.prefetching if (fill := inflight.get(name)) is not None and fill.info is None)

    async def _plan_fill(self, store: Store, item: PrefetchItem, ctx: ReadContext) -> None:
        """A fill the plan asked for: only with room that evicts nothing the plan keeps."""
        name = (item.bucket, item.key)
        if name in self.fetcher.inflight or self.reads.cached(item.bucket, item.key):
            if self.reads.prefetch(ctx) is not None:  # promotes a running fill; the reader counts its bytes
                self.plan_counts["joined"] += 1
            return
        if not await asyncio.to_thread(_room_for_plan, store, self._starting()):
            self.plan_counts["no_room"] += 1
            return
        if name in self.fetcher.inflight or self.reads.cached(item.bucket, item.key):
            return  # started or cached while the room was looked at: a reader's, not the plan's
        # Awaited too: the plan that asked for it ranked it, but the plans answered while it
        # fills may not (its shard leased meanwhile is not listed while the node does not hold it).
        with self._prefetching(name), store.spare_kept(item.bucket, item.key), store.awaited(item.bucket, item.key):
            fill = self.reads.prefetch(ctx, cause="plan")
            if fill is None:
                return  # never cached
            entry = await self._filled(fill, item)
        self.done += 1
        if entry is None:
            self.plan_counts["no_room"] += 1  # the store refused it at its begin: no room the plan does not keep
            return
        self.plan_counts["filled"] += 1
        self.plan_counts["filled_bytes"] += entry.size
        if item.job:
            self.reads.jobs.count(item.job, "prefetch_bytes", entry.size)


def _room_for_plan(store: Store, starting: int) -> bool:
    """Whether a plan's fill of an object of the cache's mean size could start (a worker thread),
    after the ``starting`` prefetches' fills that have not taken their room yet (:meth:`cache.Store.begin`
    comes with the origin's first answer): the room one saw is not counted twice. Counted twice,
    two of them started on the room of one and the later was refused at its begin, its first
    bytes fetched in vain and its object fetched again when read (the capacity bed's daemon logs:
    6-21 plan fills refused a warm epoch)."""
    _, used, items = store.usage()
    return store.plan_room((used // items if items else 0) * (starting + 1))
