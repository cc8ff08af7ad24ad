"""How long the training loop waits for data: :class:`WaitMeter` and its reports to the master.

The meter lives in the process that iterates (the trainer) and times each ``__next__`` of what the
loop iterates: a :class:`~loader.ShardLoader` (one sample a step) or the drop-in
:class:`loader.torch.DataLoader` (one batch a step). It keeps two sets of figures: totals since
the first step (:meth:`WaitMeter.stats`, what ``ShardLoader.wait_stats()`` shows in static mode)
and the delta since the last report the master acknowledged (:meth:`WaitMeter.take`), which the
master client attaches to the renew, release and complete bodies it sends anyway
(``wire.stall``'s ``wait`` field). A send that fails puts its delta back (:meth:`WaitMeter.restore`),
so nothing is lost and nothing is counted twice. :class:`WaitReporter` sends the delta on its own
(``POST /v1/jobs/{job}/wait``) when nothing else carried one for ``WAIT_REPORT_INTERVAL_S``.

A wait still in progress when a report is taken is reported up to that moment (a trainer stalled
for a minute shows it within seconds, not when the sample finally arrives); the step and its
bucket are counted when it ends, with the wait's whole duration. The last ``__next__`` of an
iteration (the one that ends it) counts as waiting but is no step.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

from wire.stall import WAIT_BUCKETS_S, WAIT_REPORT_INTERVAL_S, WaitReport, quantile_s

__all__ = ["WaitMeter", "WaitReporter"]

log = logging.getLogger("loader.stall")

T = TypeVar("T")

# Below this much wall time with nothing waited, a report says nothing worth a request.
_MIN_ELAPSED_S = 0.5


class _Loop:
    """The figures of one timed iteration (or one :meth:`WaitMeter.start`), cumulative, written by
    the thread that iterates only: ``began`` (the wait in progress, None between waits),
    ``seconds`` waited and the ``buckets`` of its steps."""

    __slots__ = ("began", "seconds", "buckets")

    def __init__(self, n: int) -> None:
        self.began: float | None = None
        self.seconds = 0.0
        self.buckets = [0] * n


class WaitMeter:
    """Thread-safe: :meth:`timed` on the loop's thread, :meth:`take` from any sender's.

    A warm epoch hands out 50,000-100,000 samples a second, and a lock taken twice a step cost
    8-15% of it (2 GiB, 2-core VM). So the loop's side takes no lock per step: each iteration
    writes only its own cumulative figures (:class:`_Loop`), and the senders' side takes the
    difference from what it last took. A sender may read an iteration's figures between two of
    its writes; the order of those writes (the wait is closed before its seconds are added) makes
    such a read count less, never more, and the next report has the rest. Steps are the sum of
    the buckets, so every report's buckets add up to its steps."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        n = len(WAIT_BUCKETS_S)
        self._n = n
        self._loops: set[_Loop] = set()  # iterations running (added and removed under the lock)
        self._ended_s = 0.0  # the figures of iterations that ended
        self._ended_buckets = [0] * n
        # what the reports so far took of the cumulative figures
        self._taken_s = 0.0
        self._taken_buckets = [0] * n
        self._carried_s = 0.0  # elapsed time of reports given back
        self._mark: float | None = None  # when the current delta began (None: no step yet)
        self._sent_at = 0.0
        self._started: float | None = None  # the first wait

    # -- the loop's side ---------------------------------------------------------------------

    def _enter(self, now: float) -> _Loop:
        loop = _Loop(self._n)
        with self._lock:
            if self._mark is None:
                self._mark = self._sent_at = now
                if self._started is None:
                    self._started = now
            self._loops.add(loop)
        return loop

    def _leave(self, loop: _Loop) -> None:
        with self._lock:
            if loop in self._loops:
                self._loops.discard(loop)
                self._ended_s += loop.seconds
                self._ended_buckets = [a + b for a, b in zip(self._ended_buckets, loop.buckets, strict=True)]

    def start(self) -> _Loop:
        """A single wait begins (the loop asked for its next item): :meth:`stop` ends it."""
        now = self._clock()
        loop = self._enter(now)
        loop.began = now
        return loop

    def stop(self, token: _Loop, step: bool = True) -> None:
        """The wait :meth:`start` began has its item (``step``), or ended without one."""
        now = self._clock()
        began = token.began
        if began is not None:
            token.began = None  # first: a sender reading between these two writes counts less
            token.seconds += now - began
            if step:
                token.buckets[bisect_left(WAIT_BUCKETS_S, now - began)] += 1
        self._leave(token)

    def timed(self, items: Iterable[T]) -> Iterator[T]:
        """``items``, each ``__next__`` timed; closing this closes ``items`` (its cleanup runs).
        The last ``__next__`` (the one that ends the iteration, or raises) is waited, not a step."""
        it = iter(items)
        clock, pull, bounds = self._clock, it.__next__, WAIT_BUCKETS_S
        loop: _Loop | None = None
        try:
            while True:
                began = clock()
                if loop is None:
                    loop = self._enter(began)
                    buckets = loop.buckets
                loop.began = began
                try:
                    item = pull()
                except BaseException:  # StopIteration included: waited, but no step
                    now = clock()
                    loop.began = None
                    loop.seconds += now - began
                    raise
                now = clock()
                loop.began = None  # first: a sender reading between these two writes counts less
                loop.seconds += now - began
                buckets[bisect_left(bounds, now - began)] += 1
                yield item
        except StopIteration:
            return
        finally:
            if loop is not None:
                self._leave(loop)
            close = getattr(it, "close", None)
            if close is not None:
                close()

    def _figures(self, now: float) -> tuple[float, list[int]]:
        """Cumulative seconds (a wait in progress up to ``now``) and buckets; under the lock."""
        seconds = self._ended_s
        buckets = list(self._ended_buckets)
        for loop in self._loops:
            seconds += loop.seconds  # before began: see stop()
            began = loop.began
            if began is not None and now > began:
                seconds += now - began
            for i, count in enumerate(loop.buckets):
                buckets[i] += count
        return seconds, buckets

    # -- the senders' side -------------------------------------------------------------------

    def take(self) -> WaitReport | None:
        """The delta since the last report; None when there is nothing to say."""
        now = self._clock()
        with self._lock:
            if self._mark is None:
                return None
            seconds, buckets = self._figures(now)
            waited = max(0.0, seconds - self._taken_s)
            steps_by_bucket = [max(0, a - b) for a, b in zip(buckets, self._taken_buckets, strict=True)]
            steps = sum(steps_by_bucket)
            elapsed = self._carried_s + max(0.0, now - self._mark)
            if not steps and waited <= 0 and elapsed < _MIN_ELAPSED_S:
                return None
            # Two threads iterating one loader can wait at once; the wire's fraction is per loop.
            taken = WaitReport(min(waited, elapsed), steps, elapsed, tuple(steps_by_bucket))
            self._taken_s += waited
            self._taken_buckets = [a + b for a, b in zip(self._taken_buckets, steps_by_bucket, strict=True)]
            self._carried_s = 0.0
            self._mark = now
            return taken

    def restore(self, taken: WaitReport) -> None:
        """A send failed: its delta goes into the next report."""
        with self._lock:
            self._taken_s = max(0.0, self._taken_s - taken.seconds)
            self._taken_buckets = [a - b for a, b in zip(self._taken_buckets, taken.buckets, strict=True)]
            self._carried_s += taken.elapsed_s

    def commit(self, taken: WaitReport) -> None:
        """A send succeeded: the periodic reporter waits a whole interval again."""
        now = self._clock()
        with self._lock:
            self._sent_at = now

    def idle_s(self) -> float:
        """Seconds since the last acknowledged report (or the first step); 0 before any step."""
        now = self._clock()
        with self._lock:
            return 0.0 if self._mark is None else now - self._sent_at

    def stats(self) -> dict[str, Any]:
        """Totals since the first step: ``seconds`` waited, ``steps``, ``elapsed_s`` (wall time
        since the first step), ``fraction`` (seconds / elapsed_s), ``buckets`` (counts per
        ``wire.stall.WAIT_BUCKETS_S``), ``p50_s``/``p99_s`` (bucket upper bounds; None before
        any step)."""
        now = self._clock()
        with self._lock:
            seconds, buckets = self._figures(now)
            elapsed = 0.0 if self._started is None else now - self._started
        steps = sum(buckets)
        return {
            "seconds": seconds,
            "steps": steps,
            "elapsed_s": elapsed,
            "fraction": min(1.0, seconds / elapsed) if elapsed > 0 else 0.0,
            "buckets": buckets,
            "bucket_bounds_s": [b if math.isfinite(b) else None for b in WAIT_BUCKETS_S],
            "p50_s": quantile_s(buckets, 0.5),
            "p99_s": quantile_s(buckets, 0.99),
        }


class WaitReporter:
    """Sends the meter's delta with ``send`` (``MasterClient.report_wait``) when no other request
    carried one for ``interval_s``; :meth:`stop` sends what is left."""

    def __init__(self, meter: WaitMeter, send: Callable[[], bool], name: str,
                 interval_s: float = WAIT_REPORT_INTERVAL_S) -> None:
        self._meter = meter
        self._send = send
        self._interval = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> WaitReporter:
        self._thread.start()
        return self

    def _run(self) -> None:
        tick = min(1.0, self._interval / 5)
        while not self._stop.wait(tick):
            if self._meter.idle_s() >= self._interval:
                self._flush()

    def _flush(self) -> None:
        try:
            self._send()
        except Exception:  # a report is worth nothing to training: never let it stop the loop
            log.debug("wait report failed", exc_info=True)

    def stop(self, flush: bool = True) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=30)
        if flush:
            self._flush()
