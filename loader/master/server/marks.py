"""Checkpoint marks: what a job's training loops had received at each of its recent checkpoints,
so that a job resumed from one is handed exactly what its model has not trained on.

Every trainer keeps a **clock**: how many items (batches under ``loader.torch.DataLoader``,
samples under a bare ``ShardLoader``) its training loop has received, restored from the
checkpoint it resumed from. Lock-step data-parallel ranks share it: at the same step every rank's
clock is the same. Each delivery a trainer reports (a renew or release at the offset received, a
completion) carries the clock at which its loop had received it, and the master keeps these
changes as a history (:class:`Change`: which shard of which epoch, and its state before).

A checkpoint is a **mark**: a trainer's ``state_dict()`` reports its exact positions at clock ``S``
and the master records the mark (every rank calling at the same ``S`` joins the same mark). A
rewind to the mark undoes, newest first, every change stamped with a clock past ``S``: what the
loops received after the checkpoint is handed out again, what they received up to it is not.
Changes reach the master late (a rank reports every third of the lease TTL) or early (a rank one
step ahead of the one that checkpoints): neither matters, since the rule reads the clock, not
the arrival. A shard's changes are undone from the earliest one past ``S``, so when clocks are
not in step (ranks that do not checkpoint at the same step) a rewind hands out more again, never
less: at least once.

Bounded: at most :data:`MAX_MARKS` marks per job (older ones are refused on load, clearly); a
change is kept while some kept mark may undo it (its clock is past the oldest mark's) or it is
younger than :data:`RETAIN_S`, and at most :data:`MAX_HISTORY` of them (past that the oldest go,
and the marks that would need them with them). A closed epoch is kept while a kept change
belongs to it, so that a rewind can reopen it.

Pure, like the rest of the state machine: no clock but the ``now`` of the events, no I/O.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, NamedTuple

__all__ = ["MAX_MARKS", "RETAIN_S", "MAX_HISTORY", "Change", "MarkRec", "JobMarks"]

MAX_MARKS = 32
"""Marks a job keeps: a state saved more than this many checkpoints ago is refused on load."""
RETAIN_S = 300.0
"""Changes younger than this are kept even with no mark to undo them: the first checkpoint's
mark may arrive after a faster rank's first changes past it."""
MAX_HISTORY = 500_000
"""Most changes a job keeps (about 124 bytes each in memory: 62 MB at the most; a 64-rank job
checkpointing every minute keeps about 57,000, bench/marks_memory.py); past it, the oldest go
with the marks that would need them."""
_TRIM_MIN = 4096


class Change(NamedTuple):
    """A delivery the master applied: shard ``shard`` of epoch ``epoch`` went from offset
    ``before`` (not done) to further, or to done (``done``), at a trainer's clock ``clock``; ``at``
    is the master's time (for :data:`RETAIN_S`)."""

    clock: int
    epoch: int
    shard: int
    before: int
    done: bool
    at: float


@dataclass(slots=True)
class MarkRec:
    """A checkpoint: the job as its loops had received it at clock ``clock``."""

    id: int
    clock: int
    epoch: int
    """The job's current epoch when the mark was made (shown, not used)."""
    created: float
    trainers: int = 1
    """How many trainers reported their positions at it (every rank, the DCP way; one, the
    rank-0 way)."""

    def to_json(self) -> list[Any]:
        return [self.id, self.clock, self.epoch, self.created, self.trainers]

    def answer(self) -> dict[str, Any]:
        return {"mark": self.id, "clock": self.clock, "epoch": self.epoch, "created": self.created, "trainers": self.trainers}


class JobMarks:
    """A job's marks, the history of changes that rewinds undo, and the closed epochs they may
    reopen (``EpochState`` objects, held opaquely here)."""

    __slots__ = ("history", "marks", "seq", "closed", "_trim_at", "dropped_below")

    def __init__(self) -> None:
        self.history: list[Change] = []
        self.marks: OrderedDict[int, MarkRec] = OrderedDict()
        """Kept marks, oldest first."""
        self.seq = 0
        """The last mark id handed out (ids only grow: a mark undone by a rewind is never reused)."""
        self.closed: dict[int, Any] = {}
        """Closed epochs some kept change belongs to (epoch -> EpochState)."""
        self._trim_at = _TRIM_MIN
        self.dropped_below = 1
        """Marks with a smaller id were dropped as too old (or their changes were)."""

    # -- recording --

    def record(self, clock: int | None, epoch: int, shard: int, before: int, done: bool, now: float) -> None:
        """Note a delivery. Without a clock (a client that keeps none) it is never undone."""
        if clock is None:
            return
        self.history.append(Change(clock, epoch, shard, before, done, now))
        if len(self.history) >= self._trim_at:
            self.trim(now)

    def keep_closed(self, epoch: int, state: Any) -> None:
        """``epoch`` just closed: keep it while a change of it may be undone."""
        if any(c.epoch == epoch for c in self.history):
            self.closed[epoch] = state

    def mark(self, clock: int, epoch: int, now: float) -> tuple[MarkRec, bool]:
        """The kept mark at ``clock`` (another rank's report at the same step joins it) or a new
        one; and whether it is new."""
        for rec in self.marks.values():
            if rec.clock == clock:
                rec.trainers += 1
                return rec, False
        self.seq += 1
        rec = MarkRec(self.seq, clock, epoch, now)
        self.marks[rec.id] = rec
        while len(self.marks) > MAX_MARKS:
            oldest, _ = self.marks.popitem(last=False)
            self.dropped_below = max(self.dropped_below, oldest + 1)
        self.trim(now)
        return rec, True

    # -- rewinding --

    def undo(self, clock: int) -> dict[tuple[int, int], Change]:
        """Remove every change past ``clock`` from the history; per (epoch, shard) the earliest
        one removed, whose ``before`` is the shard's state to go back to (not done)."""
        undone: dict[tuple[int, int], Change] = {}
        kept: list[Change] = []
        for change in self.history:
            if change.clock > clock:
                undone.setdefault((change.epoch, change.shard), change)
            else:
                kept.append(change)
        self.history = kept
        # Later marks describe a past that the rewind just replaced: a state naming one is refused.
        for mid in [m for m, rec in self.marks.items() if rec.clock > clock]:
            del self.marks[mid]
        return undone

    def forget(self) -> None:
        """The job starts over (a rewind to mark 0): no change, mark or closed epoch is kept, and
        the ids handed out stay refused (ids only grow)."""
        self.history, self.closed = [], {}
        self.marks.clear()
        self.dropped_below = self.seq + 1
        self._trim_at = _TRIM_MIN

    # -- bounds --

    def trim(self, now: float) -> None:
        floor = min((rec.clock for rec in self.marks.values()), default=None)
        young = now - RETAIN_S
        kept = [c for c in self.history if c.at >= young or (floor is not None and c.clock > floor)]
        if len(kept) > MAX_HISTORY:
            cut = len(kept) - MAX_HISTORY
            lost_clock = max(c.clock for c in kept[:cut])
            kept = kept[cut:]
            for mid in [m for m, rec in self.marks.items() if rec.clock < lost_clock]:
                del self.marks[mid]
                self.dropped_below = max(self.dropped_below, mid + 1)
        self.history = kept
        self._trim_at = max(_TRIM_MIN, 2 * len(kept))
        if self.closed:
            live = {c.epoch for c in kept}
            for epoch in [e for e in self.closed if e not in live]:
                del self.closed[epoch]

    def report(self, rewinds: int) -> dict[str, Any]:
        """For the job status: the kept marks (the last one in full), the rewinds, the history."""
        last = next(reversed(self.marks.values())).answer() if self.marks else None
        return {"marks": len(self.marks), "last": last, "oldest": next(iter(self.marks), None), "rewinds": rewinds,
                "history": len(self.history)}

    def refusal(self, mark: int) -> str:
        """Why ``mark`` is not kept, for the error message."""
        kept = f"the marks kept are {min(self.marks)}..{max(self.marks)}" if self.marks else "it keeps no mark now"
        if mark < self.dropped_below:
            why = (f"it is older than the last {MAX_MARKS} checkpoints the master keeps per job (or the job was "
                   "restarted from its beginning since)")
        elif mark <= self.seq:
            why = "a rewind to an earlier checkpoint undid it (the job went on from there since)"
        else:
            why = "this job never made it (the job was deleted and created again, or the state is from another master)"
        return f"checkpoint mark {mark} is gone: {why}; {kept}"

    # -- persistence --

    def empty(self) -> bool:
        return not self.history and not self.marks and not self.closed and self.seq == 0

    def to_json(self, closed_to_json: Any) -> dict[str, Any]:
        return {
            "history": [[c.clock, c.epoch, c.shard, c.before, int(c.done), c.at] for c in self.history],
            "marks": [rec.to_json() for rec in self.marks.values()],
            "seq": self.seq,
            "dropped_below": self.dropped_below,
            "closed": [closed_to_json(ep) for ep in self.closed.values()],
        }

    @classmethod
    def from_json(cls, raw: dict[str, Any], closed_from_json: Any) -> JobMarks:
        marks = cls()
        marks.history = [Change(int(c), int(e), int(s), int(b), bool(d), float(a)) for c, e, s, b, d, a in raw["history"]]
        for mid, clock, epoch, created, trainers in raw["marks"]:
            marks.marks[int(mid)] = MarkRec(int(mid), int(clock), int(epoch), float(created), int(trainers))
        marks.seq = int(raw["seq"])
        marks.dropped_below = int(raw.get("dropped_below", 1))
        for item in raw["closed"]:
            ep = closed_from_json(item)
            marks.closed[ep.epoch] = ep
        marks._trim_at = max(_TRIM_MIN, 2 * len(marks.history))
        return marks
