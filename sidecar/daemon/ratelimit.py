"""A token bucket: a rate enforced on average, for warm-up bandwidth and callers' refetch budgets."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

__all__ = ["TokenBucket"]


class TokenBucket:
    """Bytes per second, enforced on average: ``acquire(n)`` waits while the bucket is in debt,
    then takes ``n`` (possibly into debt). A fill cannot be slowed once started, so the limit is
    applied between objects: over any interval the bytes granted are at most
    ``burst + rate * elapsed`` plus the one object granted last."""

    def __init__(
        self,
        rate: float,
        burst: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Any] = asyncio.sleep,
    ) -> None:
        if rate <= 0:
            raise ValueError("rate must be positive")
        self.rate = float(rate)
        self.burst = float(burst if burst is not None else rate)  # one second's worth
        self._clock = clock
        self._sleep = sleep
        self._tokens = self.burst
        self._last = clock()
        self._lock = asyncio.Lock()

    def _refill(self) -> None:
        now = self._clock()
        self._tokens = min(self.burst, self._tokens + (now - self._last) * self.rate)
        self._last = now

    async def acquire(self, amount: int) -> None:
        async with self._lock:  # first come, first served: no waiter starves
            self._refill()
            if self._tokens < 0:
                await self._sleep(-self._tokens / self.rate)
                self._refill()
                # Slept the debt off. Clamp: float rounding must not turn into a loop of
                # ever-smaller sleeps that no longer advance the clock.
                self._tokens = max(self._tokens, 0.0)
            self._tokens -= max(amount, 0)

    def try_take(self, amount: float) -> bool:
        """Take ``amount`` now if the bucket holds that much (never into debt); ``False`` if not."""
        self._refill()
        if self._tokens < amount:
            return False
        self._tokens -= amount
        return True
