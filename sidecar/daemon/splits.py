"""Whether splitting a fill into parallel ranged GETs pays on this origin, learned from the fills.

A fill starts on one stream and is split when that stream's first MiBs arrive slower than
``split_below_bytes_per_s`` (:mod:`sidecar.daemon.fills`). The first MiBs are a noisy sample: TCP
slow start, a scheduling hiccup on a busy node, or three other fills sharing the CPU make a fast
origin look slow for a few milliseconds. Splitting then costs what it was meant to save wherever
a ranged GET is dear: moto copies the whole object for each range, a gateway may re-read it from
its own backend, and every part pays the origin's latency again. Measured on the suite's default
scenario (moto behind a 20 ms proxy, 64 MiB shards, two cores): fills left on one stream
delivered 300-1,200 MB/s from the first byte, the few split on a slow start 44-49 MB/s, taking
1.5 s each where 0.15-0.45 s was the rule; the cold epoch moved between 161 and 465 MB/s with
how many fills happened to split.

So whole fills decide. :class:`SplitJudge` keeps a moving average of the rate whole fills
reached from the first byte, for fills left on one stream and for split ones:

- while fills on one stream reach the threshold over their whole body, a slow start is noise and
  stays one stream (an origin that slows down shows in the average after a few fills, and
  splitting resumes);
- otherwise a slow start is split while there is no evidence against it (a far S3 whose
  connections are capped at 85-90 MB/s starts every fill slow, so every fill is split), or while
  split fills have been the faster kind;
- once split fills are measured slower than single-stream ones, a slow start stays one stream,
  except for a probe now and then (every ``probe_every`` such decisions, doubling each time the
  probe loses, back to the start when one wins), so that a change is noticed.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

__all__ = ["SplitJudge", "SplitStats"]

_ALPHA = 0.3  # weight of the newest fill in the moving averages: a few fills change the verdict
_PROBE_MIN = 8
_PROBE_MAX = 256


@dataclass(frozen=True)
class SplitStats:
    """What the judge knows now (``/_shardcache/stats``, tests)."""

    single_bytes_per_s: float | None
    split_bytes_per_s: float | None
    probe_every: int


class SplitJudge:
    """Learns whether split fills beat single-stream ones on this origin (module docstring).
    Thread-safe: a fill's first stream asks from its pump thread."""

    def __init__(self, threshold_bytes_per_s: float) -> None:
        self.threshold = threshold_bytes_per_s
        self._single: float | None = None
        self._split: float | None = None
        self._probe_every = _PROBE_MIN
        self._held_back = 0
        self._probing = False
        self._lock = threading.Lock()

    def should_split(self, early_bytes_per_s: float) -> bool:
        """Whether a first stream that delivered ``early_bytes_per_s`` so far is to be split."""
        if early_bytes_per_s >= self.threshold:
            return False
        if self.threshold == float("inf"):
            return True  # configured to split every fill (tests, experiments)
        with self._lock:
            if self._single is not None and self._single >= self.threshold:
                return False  # whole fills on one stream reach the threshold: this start is noise
            if self._single is None or self._split is None or self._split > self._single:
                return True
            self._held_back += 1
            if self._held_back < self._probe_every:
                return False
            self._held_back = 0
            self._probing = True
            return True

    def record(self, split: bool, size: int, body_s: float) -> None:
        """A fill of ``size`` bytes took ``body_s`` from its first byte to its last."""
        if body_s <= 0 or size <= 0:
            return
        rate = size / body_s
        with self._lock:
            if split:
                self._split = rate if self._split is None else (1 - _ALPHA) * self._split + _ALPHA * rate
            else:
                self._single = rate if self._single is None else (1 - _ALPHA) * self._single + _ALPHA * rate
            if split and self._probing:
                self._probing = False
                won = self._single is None or rate > self._single
                self._probe_every = _PROBE_MIN if won else min(_PROBE_MAX, self._probe_every * 2)

    def stats(self) -> SplitStats:
        with self._lock:
            return SplitStats(self._single, self._split, self._probe_every)
