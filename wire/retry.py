"""Retry delays: one exponential backoff with one jitter formula, for every retry loop of both
sides (the daemon's origin requests and fills, the loader's daemon and S3 reads, the master
client, the master's own recovery).

A :class:`Backoff` is the policy; :meth:`Backoff.delays` yields the pause before each retry, and
:func:`retry_sync` / :func:`retry_async` run a plain call under it. A small module rather than
tenacity: the loops' special cases stay in the loops, where they are visible (a stream resumes at
the byte it reached, the master client follows ``NotLeader`` hints without waiting and stops at
a deadline, the daemon counts every failed attempt in its metrics), and the trainer side keeps
no dependency beyond the stdlib.

The jitter is *full jitter*: each delay is drawn uniformly from ``[0, bound]``, the bound doubling
from ``initial_s`` up to ``max_s``. The clients that retry after one fault are many and alike (every
trainer of a job against the master, every daemon of a cluster against S3), and full jitter
spreads them over the whole window, where equal jitter (``bound/2 + uniform(0, bound/2)``) keeps
them bunched in its upper half; it is also the variant that costs the fewest calls in total
(the AWS analysis of backoff with jitter). A lone client loses little: its mean delay is half
the bound instead of three quarters.
"""

from __future__ import annotations

import random
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

__all__ = ["Backoff", "retry_sync", "retry_async"]

T = TypeVar("T")


@dataclass(frozen=True)
class Backoff:
    """Exponential backoff with full jitter.

    ``initial_s``: bound of the first retry's delay, doubled for each further retry; ``max_s``:
    upper bound of any one delay; ``attempts``: attempts in all, the first included (``None``:
    unbounded, for loops that stop at a deadline or on a condition of their own).
    """

    initial_s: float
    max_s: float
    attempts: int | None = None

    def __post_init__(self) -> None:
        if not self.initial_s >= 0 or not self.max_s >= 0:  # also refuses NaN
            raise ValueError(f"backoff delays must be non-negative, not {self.initial_s} and {self.max_s}")
        if self.attempts is not None and self.attempts < 1:
            raise ValueError(f"backoff attempts must be at least 1, not {self.attempts}")

    def bound(self, retry: int) -> float:
        """Upper bound of the delay before retry number ``retry`` (1 for the first retry)."""
        if retry < 1:
            raise ValueError("retries are numbered from 1")
        # The exponent is capped so a long-running loop cannot overflow; the float then saturates.
        return min(self.max_s, self.initial_s * 2.0 ** min(retry - 1, 1000))

    def delay(self, retry: int, rng: random.Random | None = None) -> float:
        """A delay before retry number ``retry``: uniform in ``[0, bound(retry)]``."""
        uniform = random.uniform if rng is None else rng.uniform
        return uniform(0.0, self.bound(retry))

    def delays(self, rng: random.Random | None = None) -> Iterator[float]:
        """The delay before each retry, in order: ``attempts - 1`` of them (endless when
        ``attempts`` is ``None``). A loop that runs out of delays has run out of attempts."""
        retry = 1
        while self.attempts is None or retry < self.attempts:
            yield self.delay(retry, rng)
            retry += 1


def retry_sync(
    call: Callable[[], T],
    backoff: Backoff,
    retryable: Callable[[BaseException], bool],
    *,
    on_retry: Callable[[BaseException, float], None] | None = None,
    sleep: Callable[[float], None] = time.sleep,
) -> T:
    """``call()`` until it returns, retrying the exceptions ``retryable`` accepts after a delay
    of ``backoff``; the last one is raised once the attempts are spent. ``on_retry(exc, delay)``
    runs before each wait."""
    delays = backoff.delays()
    while True:
        try:
            return call()
        except Exception as exc:
            if not retryable(exc):
                raise
            delay = next(delays, None)
            if delay is None:
                raise
            if on_retry is not None:
                on_retry(exc, delay)
        sleep(delay)


async def retry_async(
    call: Callable[[], Awaitable[T]],
    backoff: Backoff,
    retryable: Callable[[BaseException], bool],
    *,
    on_retry: Callable[[BaseException, float], None] | None = None,
) -> T:
    """:func:`retry_sync` for a coroutine function; the waits do not block the event loop."""
    import asyncio  # here: the trainer side only retries synchronously, and asyncio costs ~10 ms to import

    delays = backoff.delays()
    while True:
        try:
            return await call()
        except Exception as exc:
            if not retryable(exc):
                raise
            delay = next(delays, None)
            if delay is None:
                raise
            if on_retry is not None:
                on_retry(exc, delay)
        await asyncio.sleep(delay)
