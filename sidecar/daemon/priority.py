"""Priorities of origin work and a semaphore that serves them in order.

Demand reads (a trainer waiting now) go before lease prefetches (the trainer's next shards), which
go before warm-ups. Origin request slots are handed to the best waiter first, and a few slots are
kept for demand alone, so a queue of thousands of warm-up parts never delays a trainer's read.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools

__all__ = ["PRIORITIES", "DEMAND", "LEASE", "WARMUP", "priority_value", "PriorityLimiter"]

DEMAND, LEASE, WARMUP = 0, 1, 2
PRIORITIES = {"demand": DEMAND, "lease": LEASE, "warmup": WARMUP}


def priority_value(name: str) -> int:
    try:
        return PRIORITIES[name]
    except KeyError:
        raise ValueError(f"priority must be one of {', '.join(PRIORITIES)}, not {name!r}") from None


class PriorityLimiter:
    """At most ``limit`` holders; ``reserved`` of the slots only ever go to ``DEMAND``."""

    def __init__(self, limit: int, reserved: int = 0) -> None:
        if limit < 1 or not 0 <= reserved < limit:
            raise ValueError("need limit >= 1 and 0 <= reserved < limit")
        self._limit = limit
        self._reserved = reserved
        self._held = 0
        self._waiters: list[tuple[int, int, asyncio.Future[None]]] = []
        self._seq = itertools.count()

    def _allowed(self, priority: int) -> bool:
        cap = self._limit if priority == DEMAND else self._limit - self._reserved
        return self._held < cap

    async def acquire(self, priority: int) -> None:
        # Waiters of a better (or equal) priority go first; worse ones never block us.
        if self._allowed(priority) and not (self._waiters and self._waiters[0][0] <= priority):
            self._held += 1
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._waiters, (priority, next(self._seq), fut))
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.release()  # granted just as we were cancelled: hand the slot on
            raise

    def release(self) -> None:
        self._held -= 1
        self._wake()

    def _wake(self) -> None:
        while self._waiters:
            priority, _, fut = self._waiters[0]
            if fut.done():
                heapq.heappop(self._waiters)
                continue
            if not self._allowed(priority):
                return
            heapq.heappop(self._waiters)
            self._held += 1
            fut.set_result(None)

    @property
    def held(self) -> int:
        return self._held

    def slot(self, priority: int) -> _Slot:
        return _Slot(self, priority)


class _Slot:
    def __init__(self, limiter: PriorityLimiter, priority: int) -> None:
        self._limiter = limiter
        self._priority = priority

    async def __aenter__(self) -> None:
        await self._limiter.acquire(self._priority)

    async def __aexit__(self, *exc: object) -> None:
        self._limiter.release()
