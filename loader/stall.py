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
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

from wire.stall import WAIT_BUCKETS_S, WAIT_REPORT_INTERVAL_S, WaitReport, bucket_index, quantile_s

__all__ = ["WaitMeter", "WaitReporter"]

log = logging.getLogger("loader.stall")

T = TypeVar("T")

# Below this much wall time with nothing waited, a report says nothing worth a request.
_MIN_ELAPSED_S = 0.5


class WaitMeter:
    """Thread-safe: :meth:`timed` on the loop's thread, :meth:`take` from any sender's."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._open: dict[int, tuple[float, float]] = {}  # token -> (wait began, reported up to)
        self._tokens = 0
        n = len(WAIT_BUCKETS_S)
        # since the last report
        self._seconds = 0.0
        self._steps = 0
        self._buckets = [0] * n
        self._carried_s = 0.0  # elapsed time of reports given back
        self._mark: float | None = None  # when the current delta began (None: no step yet)
        self._sent_at = 0.0
        # since the first step
        self._started: float | None = None
        self._total_s = 0.0
        self._total_steps = 0
        self._total_buckets = [0] * n

    # -- the loop's side ---------------------------------------------------------------------

    # start() and stop() run twice per sample on the loop's thread (a warm epoch hands out
    # 60,000 samples a second): plain comparisons instead of max().

    def start(self) -> int:
        """The loop asked for its next item."""
        now = self._clock()
        with self._lock:
            if self._mark is None:
                self._mark = self._sent_at = now
                if self._started is None:
                    self._started = now
            token = self._tokens
            self._tokens = token + 1
            self._open[token] = (now, now)
        return token

    def stop(self, token: int, step: bool = True) -> None:
        """The loop has its item (``step``), or the iteration ended or raised (no step)."""
        now = self._clock()
        with self._lock:
            began, reported = self._open.pop(token)
            if now > reported:
                self._seconds += now - reported
            waited = now - began
            if waited > 0:
                self._total_s += waited
            if step:
                i = bucket_index(waited)
                self._steps += 1
                self._buckets[i] += 1
                self._total_steps += 1
                self._total_buckets[i] += 1

    def timed(self, items: Iterable[T]) -> Iterator[T]:
        """``items``, each ``__next__`` timed; closing this closes ``items`` (its cleanup runs)."""
        it = iter(items)
        start, stop, pull = self.start, self.stop, it.__next__
        try:
            while True:
                token = start()
                try:
                    item = pull()
                except StopIteration:  # the iteration ended: waited, but no step
                    stop(token, step=False)
                    return
                except BaseException:
                    stop(token, step=False)
                    raise
                stop(token)
                yield item
        finally:
            close = getattr(it, "close", None)
            if close is not None:
                close()

    # -- the senders' side -------------------------------------------------------------------

    def take(self) -> WaitReport | None:
        """The delta since the last report, reset; None when there is nothing to say."""
        now = self._clock()
        with self._lock:
            if self._mark is None:
                return None
            seconds = self._seconds
            for token, (began, reported) in self._open.items():
                seconds += max(0.0, now - reported)
                self._open[token] = (began, now)
            elapsed = self._carried_s + max(0.0, now - self._mark)
            if not self._steps and seconds <= 0 and elapsed < _MIN_ELAPSED_S:
                self._seconds = seconds
                return None
            # Two threads iterating one loader can wait at once; the wire's fraction is per loop.
            taken = WaitReport(min(seconds, elapsed), self._steps, elapsed, tuple(self._buckets))
            self._seconds = 0.0
            self._steps = 0
            self._buckets = [0] * len(self._buckets)
            self._carried_s = 0.0
            self._mark = now
            return taken

    def restore(self, taken: WaitReport) -> None:
        """A send failed: its delta goes into the next report."""
        with self._lock:
            self._seconds += taken.seconds
            self._steps += taken.steps
            self._buckets = [a + b for a, b in zip(self._buckets, taken.buckets, strict=True)]
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
            seconds = self._total_s + sum(now - began for began, _ in self._open.values())
            elapsed = 0.0 if self._started is None else now - self._started
            buckets = list(self._total_buckets)
            steps = self._total_steps
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
