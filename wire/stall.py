"""The data stall on the wire: how a trainer reports the time its training loop waited for data.

What is measured (by the loader, per trainer: the process that iterates): from the moment the
loop asks for its next sample or batch (``__next__`` called) until it has it; a *step* is one
item handed out. Time the loop spends elsewhere (compute) is not counted.

The trainer adds to the renew, release and complete bodies it sends an optional field::

    "wait": {"seconds": <float>, "steps": <int>, "elapsed_s": <float>, "buckets": [<int> x 9]}

with what happened *since its last counted report* (a delta: the master adds it up, so a
report is never counted twice; a report whose send failed is folded into the next one). The
master counts the field of a call it answers 2xx, and of a renew/release/complete it refuses
with 409 ``LeaseLost`` or 403 ``NotLeaseHolder`` (the wait happened whatever became of the
lease); any other answer (400, 404, 503, no answer) counted nothing, and the trainer sends the
delta again with its next report. (A call retried after its answer was lost may count twice:
rare, and bounded by one report's delta.)
``buckets[i]`` counts single waits of at most :data:`WAIT_BUCKETS_S` ``[i]`` seconds (and more
than the bound before it); they add up to ``steps``. A trainer with no lease to renew sends
``POST /v1/jobs/{job}/wait`` with ``{"trainer", "epoch"?, "wait": {...}}`` (answer 204), at most
every :data:`WAIT_REPORT_INTERVAL_S` seconds.

A master that predates this rejects unknown body fields (400), so the loader sends ``wait`` only
to a master whose ``GET /v1/version`` answer lists :data:`WAIT_FEATURE` in its ``features``
(:func:`knows_wait`); an old master answers 404 there and gets the bodies it always got.

Both sides use :func:`encode_wait` / :func:`validate_wait`, so the bounds are one rule. Stdlib only.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from typing import Any

from wire.errors import InvalidBody

__all__ = [
    "MAX_ELAPSED_S", "MAX_STEPS", "VERSION_PATH", "WAIT_BUCKETS_S", "WAIT_FEATURE", "WAIT_REPORT_INTERVAL_S",
    "InvalidWait", "WaitReport", "bucket_index", "encode_wait", "knows_wait", "quantile_s", "validate_wait",
    "wait_path",
]

WAIT_BUCKETS_S: tuple[float, ...] = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, math.inf)
"""Upper bounds (seconds, inclusive) of the fixed wait histogram: 9 buckets, the last open."""

WAIT_REPORT_INTERVAL_S = 5.0
"""How often a trainer that sent nothing else reports its wait (``POST .../wait``)."""

WAIT_FEATURE = "wait"
"""The entry of ``GET /v1/version``'s ``features`` list of a master that takes ``wait`` fields."""

VERSION_PATH = "/v1/version"

# Bounds a well-behaved trainer never reaches between two reports (reports go at least every few
# seconds while it trains); they keep one hostile or broken body from skewing a job's totals.
MAX_ELAPSED_S = 7 * 24 * 3600.0
MAX_STEPS = 10**9
_SLACK_S = 1.0  # clocks read at slightly different moments: seconds may exceed elapsed_s by this


class InvalidWait(InvalidBody):
    """A ``wait`` field is malformed or out of bounds (the master answers 400 with this message)."""


@dataclass(frozen=True)
class WaitReport:
    """One validated ``wait`` field: the delta since the trainer's previous report."""

    seconds: float
    steps: int
    elapsed_s: float
    buckets: tuple[int, ...]

    def to_json(self) -> dict[str, Any]:
        return {"seconds": self.seconds, "steps": self.steps, "elapsed_s": self.elapsed_s, "buckets": list(self.buckets)}

    def field(self) -> dict[str, Any]:
        """The ``wait`` field of a request body, rounded and validated as the master will (the
        loader's delta to send: :class:`loader.stall.WaitMeter`)."""
        return encode_wait(self.seconds, self.steps, self.elapsed_s, self.buckets)


def bucket_index(seconds: float) -> int:
    """The bucket a single wait of ``seconds`` falls in (bounds are inclusive upper bounds)."""
    return bisect.bisect_left(WAIT_BUCKETS_S, seconds)


def encode_wait(seconds: float, steps: int, elapsed_s: float, buckets: list[int] | tuple[int, ...]) -> dict[str, Any]:
    """The ``wait`` field for a body, rounded (microseconds) and validated as the master will."""
    raw = {
        "seconds": round(max(0.0, seconds), 6),
        "steps": int(steps),
        "elapsed_s": round(max(0.0, elapsed_s), 6),
        "buckets": [int(b) for b in buckets],
    }
    return validate_wait(raw).to_json()


def _number(raw: dict[str, Any], name: str, limit: float) -> float:
    value = raw.get(name)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or not 0 <= value <= limit:
        raise InvalidWait(f"'wait.{name}' must be a number of seconds in [0, {limit:g}], got {str(value)[:40]!r}")
    return float(value)


def validate_wait(raw: Any) -> WaitReport:
    """Check a ``wait`` field as received; :class:`InvalidWait` says what is wrong with it."""
    if not isinstance(raw, dict):
        raise InvalidWait(f"'wait' must be an object {{seconds, steps, elapsed_s, buckets}}, got {type(raw).__name__}")
    unknown = sorted(set(raw) - {"seconds", "steps", "elapsed_s", "buckets"})
    if unknown:
        raise InvalidWait(f"unknown 'wait' field(s) {[str(u)[:40] for u in unknown[:10]]}: expected seconds, steps, "
                          "elapsed_s, buckets")
    elapsed = _number(raw, "elapsed_s", MAX_ELAPSED_S)
    seconds = _number(raw, "seconds", MAX_ELAPSED_S + _SLACK_S)
    if seconds > elapsed + _SLACK_S:
        raise InvalidWait(f"'wait.seconds' ({seconds:g}) cannot exceed 'wait.elapsed_s' ({elapsed:g}) by more than "
                          f"{_SLACK_S:g} s: report the wait since the last report, not a running total")
    steps = raw.get("steps")
    if isinstance(steps, bool) or not isinstance(steps, int) or not 0 <= steps <= MAX_STEPS:
        raise InvalidWait(f"'wait.steps' must be an integer in [0, {MAX_STEPS}], got {str(steps)[:40]!r}")
    buckets = raw.get("buckets")
    if (not isinstance(buckets, list) or len(buckets) != len(WAIT_BUCKETS_S)
            or any(isinstance(b, bool) or not isinstance(b, int) or b < 0 for b in buckets)):
        raise InvalidWait(f"'wait.buckets' must be a list of {len(WAIT_BUCKETS_S)} non-negative integers (counts per "
                          f"bucket of upper bounds {WAIT_BUCKETS_S[:-1]} s and beyond), got {str(buckets)[:80]}")
    if sum(buckets) != steps:
        raise InvalidWait(f"'wait.buckets' add up to {sum(buckets)}, not to 'wait.steps' ({steps}): each step is "
                          "one wait, counted in one bucket")
    return WaitReport(seconds, steps, elapsed, tuple(buckets))


def quantile_s(buckets: list[int] | tuple[int, ...], q: float) -> float | None:
    """The ``q`` quantile (0..1) of the waits counted in ``buckets``, as the upper bound of the
    bucket it falls in (the open last bucket reports its lower bound, 5 s: "at least");
    None when nothing was counted."""
    total = sum(buckets)
    if total <= 0:
        return None
    rank = max(1, math.ceil(q * total))
    seen = 0
    for i, count in enumerate(buckets):
        seen += count
        if seen >= rank:
            bound = WAIT_BUCKETS_S[i]
            return bound if math.isfinite(bound) else WAIT_BUCKETS_S[i - 1]
    return WAIT_BUCKETS_S[-2]


def knows_wait(version: Any) -> bool:
    """Whether a master's ``GET /v1/version`` answer says it takes ``wait`` fields and the route."""
    features = version.get("features") if isinstance(version, dict) else None
    return isinstance(features, list) and WAIT_FEATURE in features


def wait_path(job: str) -> str:
    """The route of a wait report with no lease to ride on (``job`` already validated)."""
    return f"/v1/jobs/{job}/wait"
