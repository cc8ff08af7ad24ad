"""How long each trainer's training loop waited for data, as its reports tell the master.

Trainers add a ``wait`` report (``wire/stall.py``) to their renew, release and complete calls, or
post one on its own (``POST /v1/jobs/{job}/wait``). The master keeps, per job and trainer, totals
(wait seconds, steps, wall time, the bucket counts of single waits), the same per epoch, and a
60 s window in one-second buckets as the samples/s window does. In memory only, never journaled:
it is a measurement, not state, so a restarted master (or a new leader) starts from zero.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from wire.stall import WAIT_BUCKETS_S, WaitReport, quantile_s

__all__ = ["WAIT_WINDOW_S", "WAITING_FRACTION", "MAX_EPOCHS_KEPT", "JobWaits", "WaitTotals"]

WAIT_WINDOW_S = 60.0
WAITING_FRACTION = 0.10
"""A trainer that waited this share of the last 60 s or more counts in ``trainers_waiting`` (the
same 10% ``shardcache status --warn-wait`` warns at by default)."""
MAX_EPOCHS_KEPT = 16
"""Epochs kept per trainer (the newest): a continuous job's epochs are unbounded, memory is not."""

_N = len(WAIT_BUCKETS_S)


@dataclass(slots=True)
class WaitTotals:
    """Sums of reports: wait seconds, steps (items handed out), wall seconds, bucket counts."""

    seconds: float = 0.0
    steps: int = 0
    elapsed_s: float = 0.0
    buckets: list[int] = field(default_factory=lambda: [0] * _N)

    def add(self, seconds: float, steps: int, elapsed_s: float, buckets: list[int] | tuple[int, ...]) -> None:
        self.seconds += seconds
        self.steps += steps
        self.elapsed_s += elapsed_s
        for i, n in enumerate(buckets):
            self.buckets[i] += n

    def fraction(self) -> float | None:
        """Share of the wall time spent waiting; None before any wall time was reported."""
        return _fraction(self.seconds, self.elapsed_s)


def _fraction(seconds: float, elapsed_s: float) -> float | None:
    if elapsed_s <= 0:
        return None
    # A report may say a little more wait than wall time (clocks, rounding): never above 1.
    return round(min(seconds / elapsed_s, 1.0), 4)


class _Window:
    """Wait and wall seconds reported over the last 60 s, one bucket per second: its memory is
    the window's length however often a trainer reports. A report counts whole at the second it
    arrived (reports come every few seconds, each covering the time since the previous one)."""

    __slots__ = ("_points",)

    def __init__(self) -> None:
        self._points: deque[list[float]] = deque()  # [second, wait_s, elapsed_s]

    def _trim(self, now: float) -> None:
        while self._points and self._points[0][0] <= now - WAIT_WINDOW_S:
            self._points.popleft()

    def add(self, now: float, seconds: float, elapsed_s: float) -> None:
        second = float(int(now))
        if self._points and self._points[-1][0] == second:
            self._points[-1][1] += seconds
            self._points[-1][2] += elapsed_s
        else:
            self._points.append([second, seconds, elapsed_s])
        self._trim(now)

    def sums(self, now: float) -> tuple[float, float]:
        self._trim(now)
        return sum(p[1] for p in self._points), sum(p[2] for p in self._points)


class _Trainer:
    __slots__ = ("totals", "epochs", "window", "epoch")

    def __init__(self) -> None:
        self.totals = WaitTotals()
        self.epochs: OrderedDict[int, WaitTotals] = OrderedDict()
        self.window = _Window()
        self.epoch: int | None = None  # the epoch of its latest report


class JobWaits:
    """One job's wait reports, by trainer, and the job's own totals (what the Prometheus
    histogram shows: they never go down when a trainer is forgotten)."""

    def __init__(self) -> None:
        self._trainers: dict[str, _Trainer] = {}
        self.totals = WaitTotals()

    def current_epoch(self, trainer: str) -> int | None:
        """The epoch of the trainer's latest report (what a report without one is counted in)."""
        found = self._trainers.get(trainer)
        return found.epoch if found is not None else None

    def add(self, trainer: str, epoch: int, report: WaitReport, now: float) -> None:
        """Count one validated report (a delta since the trainer's previous one)."""
        seconds, steps, elapsed, buckets = report.seconds, report.steps, report.elapsed_s, report.buckets
        t = self._trainers.get(trainer)
        if t is None:
            t = self._trainers[trainer] = _Trainer()
        t.totals.add(seconds, steps, elapsed, buckets)
        self.totals.add(seconds, steps, elapsed, buckets)
        per = t.epochs.get(epoch)
        if per is None:
            per = t.epochs[epoch] = WaitTotals()
            while len(t.epochs) > MAX_EPOCHS_KEPT:
                t.epochs.pop(min(t.epochs))  # the oldest epoch goes first
        per.add(seconds, steps, elapsed, buckets)
        t.epoch = epoch
        t.window.add(now, seconds, elapsed)

    def forget(self, trainer: str) -> None:
        """Drop a trainer gone from the job's presence (its totals stay in the job's)."""
        self._trainers.pop(trainer, None)

    def waited(self, trainers: Iterable[str]) -> tuple[float, float]:
        """(wait seconds, wall seconds) ``trainers`` reported in all, since each first reported:
        cumulative, so a caller takes differences (the plan's lead, ``holdings.Planner``)."""
        waited = elapsed = 0.0
        for name in trainers:
            t = self._trainers.get(name)
            if t is not None:
                waited += t.totals.seconds
                elapsed += t.totals.elapsed_s
        return waited, elapsed

    def trainer(self, trainer: str, now: float) -> dict[str, Any] | None:
        """``trainers[].wait`` of the status, or None for a trainer that never reported."""
        t = self._trainers.get(trainer)
        if t is None:
            return None
        waited, elapsed = t.window.sums(now)
        return {
            "fraction_60s": _fraction(waited, elapsed),
            "seconds": round(t.totals.seconds, 3),
            "steps": t.totals.steps,
            "p50_s": quantile_s(t.totals.buckets, 0.50),
            "p99_s": quantile_s(t.totals.buckets, 0.99),
            "epochs": {
                str(e): {"seconds": round(w.seconds, 3), "steps": w.steps, "fraction": w.fraction()}
                for e, w in sorted(t.epochs.items())
            },
        }

    def job(self, now: float) -> dict[str, Any]:
        """The job-level ``wait``: the share of all its trainers' wall time of the last 60 s spent
        waiting, and how many trainers waited ``WAITING_FRACTION`` of it or more."""
        waited = elapsed = 0.0
        waiting = 0
        for t in self._trainers.values():
            w, e = t.window.sums(now)
            waited += w
            elapsed += e
            share = _fraction(w, e)
            if share is not None and share >= WAITING_FRACTION:
                waiting += 1
        return {"fraction_60s": _fraction(waited, elapsed), "trainers_waiting": waiting}
