"""The lease state machine of the master: pure, deterministic, no I/O, no clock, no randomness.

``MasterState.apply(event, now)`` validates an event against the state, and either refuses it
(raises a :class:`~loader.master.errors.MasterError` and changes nothing) or applies it and
returns a :class:`Result` whose ``mutated`` flag says whether the state changed. The stores
make the state durable by logging every mutating event (with the ``now`` it was applied at,
``Result.now``) and replaying the log on start: given the same events and times the machine
reaches the same state, so SQLite and etcd share every rule here and the hypothesis tests
drive it directly with an injected clock.

Exactly-once per epoch rests on three rules, per (epoch, shard):

- a lease is valid while it is in ``JobState.leases`` and ``now < expires_at``; renew,
  complete and fail of an invalid lease are refused (``LeaseLost``) and change nothing;
- a shard is handed out only while it is ``todo`` in its epoch: never leased in that epoch (the
  epoch order's cursor has not reached it) or returned to its ``requeue`` by an expiry, a
  failure or a release;
- a completion marks the shard done in its epoch and closes the lease, so it cannot count
  twice; repeating the completion of the same lease by its holder is answered as done (a retry
  after a lost answer) without counting again.

Epochs may overlap: a continuous request (no epoch) that finds every open epoch fully leased
opens the next one rather than wait (``MAX_OPEN_EPOCHS`` at most), so that no trainer of a
synchronous job waits at an epoch boundary for shards that a blocked trainer holds. Each
epoch is still completed exactly once, and handed out in its own seeded order; a request for
an explicit epoch only ever gets that epoch's shards, so the non-continuous mode keeps its
epoch barrier. A lease belongs to the trainer that took it; ``stream`` (a DataLoader worker)
only labels which of the trainer's streams asked.

Expired leases are swept lazily, in (expiry time, lease id) order, at the start of every
mutating event; refused and read-only events never sweep, so a replay that sees only the
logged events sweeps exactly as the live master did.
"""

from __future__ import annotations

import base64
import heapq
import json
import math
import re
from array import array
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from loader.master.errors import BadRequest, CheckpointGone, JobConflict, JobInUse, LeaseLost, NoSuchJob, NotLeaseHolder
from loader.master.protocol import LeaseGrant
from loader.master.server.events import (
    Complete,
    CreateJob,
    DeleteJob,
    Event,
    Fail,
    Holdings,
    Lease,
    Mark,
    Placement,
    Release,
    Renew,
    Resume,
    Rewind,
)
from loader.master.server.locality import MAX_MEMBERS, STEP, JobLocality, Readers, Ring, ShardIndex, Window, job_index, s3_location
from loader.master.server.marks import JobMarks
from loader.master.server.snapshots import Snapshot, document, read_document, read_text, write_text
from loader.master.server.spec import JobSpec, check_ident, check_int, spec_diff, validate_job_name
from wire.nodeplan import MAX_HASHES
from wire.shuffle import EpochOrder

__all__ = [
    "Result",
    "EpochState",
    "JobState",
    "MasterState",
    "MAX_COUNT",
    "MAX_LEASE_WAIT_S",
    "MAX_OPEN_EPOCHS",
    "OPEN_SLACK",
    "CLOSED_KEEP",
    "validate_lease_id",
    "validate_job_name",
]

MAX_COUNT = 1024
"""Most shards one lease request may ask for."""
MAX_LEASE_WAIT_S = 30.0
"""Longest long poll a lease request may ask for (``wait_s``)."""

_LEASE_ID_RE = re.compile(r"^[A-Za-z0-9_-]{8,64}$")
_MAX_ERROR_TEXT = 1000
_REQUEUE_SCAN = 16
"""How far into the re-queue a lease looks for a shard the trainer did not just fail."""
MAX_OPEN_EPOCHS = 64
"""Most epochs a continuous job keeps open at once (each costs one bit per shard)."""
OPEN_SLACK = 4096
"""A continuous request opens a new epoch only while the job's live leases number fewer than its
shards or this, whichever is more."""
CLOSED_KEEP = 65_536
"""Closed leases remembered per job, most recent first, so that a repeated complete, fail or
release (a retry after a lost answer) is answered as done instead of refused."""
_REQUEST_KEEP = 4096
"""Lease streams whose last request id is remembered per job (retried lease requests)."""
_STALE_FRACTION = 1 / 3
"""A lease not renewed for this fraction of its TTL (plus a second) looks abandoned: holders renew
every third of it (``LoaderSettings.renew_fraction``)."""
_WAIT_MAX_S = 1.0
_WAIT_MIN_S = 0.05



def validate_lease_id(lease: Any) -> str:
    if not isinstance(lease, str) or not _LEASE_ID_RE.match(lease):
        raise BadRequest(f"invalid lease id {str(lease)[:80]!r}: use the 'lease' value the master returned")
    return lease


@dataclass
class Result:
    answer: dict[str, Any]
    """The JSON answer for the caller."""
    mutated: bool
    """False: nothing changed (idempotent repeat, wait, status); nothing to log."""
    record: Event | None = None
    """The event to log when mutated (may be trimmed, e.g. unused lease ids dropped)."""
    now: float = 0.0
    """The time the event was applied at (clamped monotonic); log it with the event."""
    created: bool = False
    progress: int = 0
    """Samples newly reported processed by this event (for the samples/s rate)."""


# -- state ---------------------------------------------------------------------------------


@dataclass(slots=True)
class LeaseRec:
    id: str
    shard: int
    epoch: int
    trainer: str
    stream: str
    node: str
    expires_at: float


@dataclass(slots=True)
class Progress:
    """What an epoch knows of a shard beyond "leased from its start": kept only for shards with a
    reported offset or a failure, and dropped once done, so that an epoch's memory grows with
    the leases in progress and the failures, not with the shard count."""

    offset: int = 0
    failures: int = 0
    last_error: str | None = None
    last_failed_by: str | None = None


class EpochState:
    """One open epoch: where its seeded order's cursor is, what came back to be handed out again,
    and which shards are done (one bit each) or failed."""

    __slots__ = ("epoch", "n", "order", "cursor", "requeue", "progress", "done_bits", "done_count", "failed", "window")

    def __init__(self, epoch: int, n: int, seed: int, shuffle: bool) -> None:
        self.epoch = epoch
        self.n = n
        self.order = EpochOrder(n, seed, epoch, shuffle)
        self.cursor = 0
        """Positions of the epoch order below the cursor have been leased at least once."""
        self.requeue: deque[int] = deque()
        """Shards returned by an expiry, a failure or a release, handed out again first."""
        self.progress: dict[int, Progress] = {}
        self.done_bits = bytearray((n + 7) // 8)
        self.done_count = 0
        self.failed: set[int] = set()
        self.window: Window | None = None
        """A windowed job's positions taken ahead of the cursor and its index (locality.py)."""

    def todo(self) -> int:
        return self.n - self.cursor + len(self.requeue)

    def offset(self, shard: int) -> int:
        prog = self.progress.get(shard)
        return prog.offset if prog is not None else 0

    def advance(self, shard: int, offset: int) -> int:
        """Record that ``shard`` was read up to ``offset`` (offsets never go back); the gain."""
        prog = self.progress.get(shard)
        current = prog.offset if prog is not None else 0
        if offset <= current:
            return 0
        if prog is None:
            prog = self.progress[shard] = Progress()
        prog.offset = offset
        return offset - current

    def is_done(self, shard: int) -> bool:
        return bool(self.done_bits[shard >> 3] & (1 << (shard & 7)))

    def mark_done(self, shard: int) -> None:
        self.done_bits[shard >> 3] |= 1 << (shard & 7)
        self.done_count += 1
        self.progress.pop(shard, None)

    def complete(self) -> bool:
        return self.done_count + len(self.failed) >= self.n

    def undo(self, shard: int, offset: int) -> None:
        """A rewind: ``shard`` is not done, and was read up to ``offset``."""
        if self.is_done(shard):
            self.done_bits[shard >> 3] &= ~(1 << (shard & 7)) & 0xFF
            self.done_count -= 1
        prog = self.progress.get(shard)
        if prog is None and offset:
            prog = self.progress[shard] = Progress()
        if prog is not None:
            prog.offset = offset
            if not offset and not prog.failures and prog.last_error is None:
                del self.progress[shard]

    def touched(self) -> bool:
        """Whether anything of this epoch was delivered or failed."""
        return bool(self.done_count or self.failed or any(p.offset for p in self.progress.values()))

    def requeue_first(self, shards: list[int]) -> None:
        """A rewind: ``shards`` (handed out, and now neither done nor leased) are handed out
        again before the rest, those read part-way first (they resume at their offset)."""
        fresh = [shard for shard in dict.fromkeys(shards) if not self.is_done(shard) and shard not in self.failed]
        fresh.sort(key=lambda shard: 0 if self.offset(shard) else 1)  # stable: the order within each
        self.requeue.extendleft(reversed(fresh))

    def take(self, trainer: str, node: str = "", loc: JobLocality | None = None, ring: Ring | None = None) -> tuple[int, bool]:
        """The next shard to hand out, and whether it was handed out before in this epoch. With
        ``loc`` (a windowed job) a fresh shard is the first of the window local to ``node``."""
        requeue = self.requeue
        if requeue:
            for i in range(min(_REQUEUE_SCAN, len(requeue))):
                shard = requeue[i]
                prog = self.progress.get(shard)
                if prog is None or prog.last_failed_by != trainer:
                    del requeue[i]
                    return shard, True
            if self.cursor >= self.n:
                return requeue.popleft(), True
        if self.cursor < self.n:
            if loc is None or ring is None:
                shard = self.order[self.cursor]
                self.cursor += 1
                return shard, False
            win = self.window
            if win is None:
                win = self.window = Window(self.cursor)
            position = self._local_position(win, node, loc, ring) if node and loc.window > 1 else self.cursor
            win.note(position)
            if position == self.cursor:
                self.cursor += 1
                while self.cursor in win.ahead:
                    win.ahead.remove(self.cursor)
                    self.cursor += 1
            else:
                win.ahead.add(position)
            return self.order[position], False
        return requeue.popleft(), True

    def _local_position(self, win: Window, node: str, loc: JobLocality, ring: Ring) -> int:
        """The smallest position of the window ``[cursor, cursor + W)`` not handed out whose
        shard is local to ``node``; the cursor when there is none."""
        if win.entries > 4 * loc.window + 64:
            win.reset()  # mostly stale entries (nodes that never ask): rebuild
        if win.frontier < self.cursor:
            win.frontier = self.cursor
        if not win.indexed:
            self.rebuild_index(win, loc, ring)
        limit = min(self.cursor + loc.window, self.n, win.frontier + STEP)
        while win.frontier < limit:
            position = win.frontier
            win.frontier += 1
            self._index(win, position, loc, ring)
        heap = win.heaps.get(node)
        while heap:
            position = heap[0]
            if position >= self.cursor and position not in win.ahead and loc.is_local(self.order[position], node, ring):
                return position
            heapq.heappop(heap)
            win.entries -= 1
        return self.cursor

    def rebuild_index(self, win: Window, loc: JobLocality, ring: Ring) -> None:
        """Index every position of the window not handed out (after a restore, a ring change or
        a compaction): the same index the live master kept, so the same choices."""
        for position in range(self.cursor, win.frontier):
            if position not in win.ahead:
                self._index(win, position, loc, ring)
        win.indexed = True

    def _index(self, win: Window, position: int, loc: JobLocality, ring: Ring) -> None:
        owner, reader = loc.nodes_of(self.order[position], ring)
        if owner:
            win.push(owner, position)
        if reader and reader != owner:
            win.push(reader, position)

    def note_reader(self, shard: int, node: str) -> None:
        """``shard`` is now cached on ``node`` (reported held there, or completed there in another
        epoch): if it waits in this epoch's window, index it for ``node`` too."""
        win = self.window
        if win is None or self.cursor >= self.n:
            return
        position = self.order.index(shard)
        if win.indexed and self.cursor <= position < win.frontier and position not in win.ahead:
            win.push(node, position)

    def failed_list(self, spec: JobSpec) -> list[dict[str, Any]]:
        out = []
        for shard in sorted(self.failed):
            prog = self.progress.get(shard) or Progress()
            out.append({"key": spec.shards[shard].key, "shard": shard, "failures": prog.failures, "last_error": prog.last_error})
        return out

    def to_json(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "cursor": self.cursor,
            "requeue": list(self.requeue),
            "progress": [[s, p.offset, p.failures, p.last_error, p.last_failed_by] for s, p in self.progress.items()],
            "done": base64.b64encode(self.done_bits).decode(),
            "done_count": self.done_count,
            "failed": sorted(self.failed),
            **({"window": self.window.to_json()} if self.window is not None else {}),
        }

    @classmethod
    def from_json(cls, raw: dict[str, Any], spec: JobSpec) -> EpochState:
        ep = cls(raw["epoch"], len(spec.shards), spec.seed, spec.shuffle)
        ep.cursor = raw["cursor"]
        ep.requeue = deque(raw["requeue"])
        ep.progress = {s: Progress(o, f, e, b) for s, o, f, e, b in raw["progress"]}
        ep.done_bits = bytearray(base64.b64decode(raw["done"]))
        ep.done_count = raw["done_count"]
        ep.failed = set(raw["failed"])
        if "window" in raw:
            ep.window = Window.from_json(raw["window"], ep.cursor)
        return ep


@dataclass
class JobState:
    """A job's lease state. Epochs are handed out in order; a continuous request (no epoch) that
    finds every open epoch fully leased opens the next one instead of waiting, so the epochs of a
    continuous job may overlap (each is still completed exactly once); an explicit-epoch request
    only ever gets shards of that epoch."""

    spec: JobSpec
    next_epoch: int = 0
    """The epoch the next opening starts: every epoch below it has been opened."""
    finished: bool = False
    open: dict[int, EpochState] = field(default_factory=dict)
    """Open epochs, oldest first (dicts keep insertion order)."""
    leases: dict[str, LeaseRec] = field(default_factory=dict)
    closed: OrderedDict[str, tuple[str, str]] = field(default_factory=OrderedDict)
    """lease id -> (trainer, outcome "done"/"todo"/"failed"/"released"), the last CLOSED_KEEP."""
    last_request: OrderedDict[tuple[str, str], tuple[str, tuple[str, ...]]] = field(default_factory=OrderedDict)
    """(trainer, stream) -> (request id, lease ids granted): a retried lease request gets the same leases."""
    recent: list[dict[str, Any]] = field(default_factory=list)
    """The last two completed epochs, newest first: {"epoch", "done", "failed": failed_list}."""
    totals: dict[str, int] = field(
        default_factory=lambda: {
            "leased": 0, "reissued": 0, "completed": 0, "expired": 0, "released": 0, "failures": 0, "epochs": 0,
        }
    )
    _heap: list[tuple[float, str]] = field(default_factory=list, repr=False)
    locality: JobLocality | None = field(default=None, repr=False)
    """Where shards are, for a job with a ``locality_window`` (locality.py); None otherwise."""
    marks: JobMarks = field(default_factory=JobMarks, repr=False)
    """Checkpoint marks and the deliveries a rewind to one undoes (marks.py)."""
    created_at: float = 0.0
    """When the job was created (a checkpoint of a deleted job's namesake is refused by it)."""
    owner: str | None = None
    """The tenant the job belongs to (auth.py); None: the operator's."""

    def __post_init__(self) -> None:
        if self.spec.locality_window > 0 and self.locality is None:
            self.locality = JobLocality(self.spec.locality_window, self.n, _object_names(self.spec))

    @property
    def n(self) -> int:
        return len(self.spec.shards)

    @property
    def epoch(self) -> int:
        """The current epoch: the oldest one not complete (after the last, the epoch count)."""
        return next(iter(self.open)) if self.open else self.next_epoch

    # -- queries (no mutation of the logical state) --

    def valid_lease(self, lease: str, now: float) -> LeaseRec | None:
        rec = self.leases.get(lease)
        return rec if rec is not None and rec.expires_at > now else None

    def _clean_heap(self) -> None:
        heap = self._heap
        while heap:
            exp, lid = heap[0]
            rec = self.leases.get(lid)
            if rec is not None and rec.expires_at == exp:
                return
            heapq.heappop(heap)

    def next_expiry(self) -> float | None:
        self._clean_heap()  # drops only stale index entries: the logical state is unchanged
        return self._heap[0][0] if self._heap else None

    def can_open(self) -> bool:
        # Live leases bounded by the shard count (or OPEN_SLACK for a small job): a client leasing
        # without reading cannot make the master open epoch after epoch and hold leases without end.
        return (
            not self.finished
            and len(self.open) < MAX_OPEN_EPOCHS
            and len(self.leases) < max(self.n, OPEN_SLACK)
            and (self.spec.epochs is None or self.next_epoch < self.spec.epochs)
        )

    def todo_count(self, epoch: int | None = None) -> int:
        """Shards ready to hand out: in ``epoch``, or (None) in every open epoch."""
        if epoch is not None:
            ep = self.open.get(epoch)
            return ep.todo() if ep is not None else 0
        return sum(ep.todo() for ep in self.open.values())

    def counts(self, now: float, epoch: int | None = None) -> dict[str, int]:
        ep = self.open.get(self.epoch if epoch is None else epoch)
        if ep is None:
            last: dict[str, Any] = self.recent[0] if self.recent else {"done": 0, "failed": []}
            return {"total": self.n, "todo": 0, "leased": 0, "done": last["done"], "failed": len(last["failed"])}
        leased = sum(1 for rec in self.leases.values() if rec.epoch == ep.epoch and rec.expires_at > now)
        done, failed = ep.done_count, len(ep.failed)
        return {"total": self.n, "todo": self.n - leased - done - failed, "leased": leased, "done": done, "failed": failed}

    # -- transitions --

    def open_next(self) -> EpochState:
        ep = EpochState(self.next_epoch, self.n, self.spec.seed, self.spec.shuffle)
        self.open[ep.epoch] = ep
        self.next_epoch += 1
        return ep

    def expire(self, now: float) -> int:
        heap = self._heap
        expired = 0
        while heap and heap[0][0] <= now:
            exp, lid = heapq.heappop(heap)
            rec = self.leases.get(lid)
            if rec is None or rec.expires_at != exp:
                continue
            del self.leases[lid]
            self.open[rec.epoch].requeue.append(rec.shard)
            expired += 1
        self.totals["expired"] += expired
        return expired

    def _push(self, rec: LeaseRec) -> None:
        heapq.heappush(self._heap, (rec.expires_at, rec.id))
        self._compact_heap()

    def _compact_heap(self) -> None:
        """Closed and renewed leases leave their old entries in the expiry index (dropped lazily as
        they reach its top): rebuilt from the live leases past twice their number, so the index
        stays proportional to the leases held, not to every lease ever granted."""
        if len(self._heap) > 2 * len(self.leases) + 4096:
            self._heap = [(r.expires_at, r.id) for r in self.leases.values()]
            heapq.heapify(self._heap)

    def close(self, rec: LeaseRec, trainer: str, outcome: str) -> None:
        del self.leases[rec.id]
        self.closed[rec.id] = (trainer, outcome)
        if len(self.closed) > CLOSED_KEEP:
            self.closed.popitem(last=False)
        self._compact_heap()

    def revoke_all(self) -> dict[int, list[int]]:
        """A rewind: close every lease as revoked (its holder's next call is told so) and forget
        the retried lease requests; the shards they held, by epoch."""
        held: dict[int, list[int]] = {}
        for rec in list(self.leases.values()):
            self.close(rec, rec.trainer, "revoked")
            held.setdefault(rec.epoch, []).append(rec.shard)
        self.last_request.clear()
        return held

    def remember_request(self, trainer: str, stream: str, request_id: str, ids: tuple[str, ...]) -> None:
        key = (trainer, stream)
        self.last_request[key] = (request_id, ids)
        self.last_request.move_to_end(key)
        if len(self.last_request) > _REQUEST_KEEP:
            self.last_request.popitem(last=False)

    def lease_answer(self, rec: LeaseRec, now: float) -> dict[str, Any]:
        spec = self.spec.shards[rec.shard]
        prog = self.open[rec.epoch].progress.get(rec.shard)
        return LeaseGrant(
            rec.id, spec.key, rec.shard, rec.epoch, prog.offset if prog else 0, spec.size, spec.samples,
            round(max(rec.expires_at - now, 0.0), 3),
        ).to_json()

    def maybe_close_epoch(self, ep: EpochState) -> None:
        """Close ``ep`` once every shard is done or failed; open the next epoch when none is left
        open (or finish the job after its last one)."""
        if not ep.complete():
            return
        del self.open[ep.epoch]
        self.marks.keep_closed(ep.epoch, ep)
        self.totals["epochs"] += 1
        closed: dict[str, Any] = {"epoch": ep.epoch, "done": ep.done_count, "failed": ep.failed_list(self.spec)}
        if ep.window is not None:
            closed["order"] = ep.window.report(ep.epoch)
        self.recent = [closed, *self.recent[:1]]
        if self.open:
            return
        if self.spec.epochs is not None and self.next_epoch >= self.spec.epochs:
            self.finished = True
            self.last_request.clear()
            return
        self.open_next()

    # -- persistence --

    def to_json(self, *, with_spec: bool = True) -> dict[str, Any]:
        out: dict[str, Any] = {"spec": self.spec.to_json()} if with_spec else {}
        out.update({
            "next_epoch": self.next_epoch,
            "finished": self.finished,
            "open": [ep.to_json() for ep in self.open.values()],
            "leases": [[r.id, r.shard, r.epoch, r.trainer, r.stream, r.node, r.expires_at] for r in self.leases.values()],
            "closed": [[k, t, o] for k, (t, o) in self.closed.items()],
            "last_request": [[t, st, rid, list(ids)] for (t, st), (rid, ids) in self.last_request.items()],
            "recent": self.recent,
            "totals": dict(self.totals),
        })
        if self.locality is not None:
            out["locality"] = self.locality.to_json()
        if not self.marks.empty():
            out["marks"] = self.marks.to_json(EpochState.to_json)
        if self.created_at:
            out["created_at"] = self.created_at
        if self.owner is not None:
            out["owner"] = self.owner
        return out

    @classmethod
    def from_json(cls, raw: dict[str, Any], spec: JobSpec | None = None) -> JobState:
        """A job from its snapshot (version 2's members: :mod:`~loader.master.server.snapshots`
        upgrades older ones); ``spec``: its spec, already read (then ``raw`` has none)."""
        if spec is None:
            spec = JobSpec.from_log(raw["spec"])
        job = cls(spec, next_epoch=raw["next_epoch"], finished=raw["finished"])
        for item in raw["open"]:
            ep = EpochState.from_json(item, spec)
            job.open[ep.epoch] = ep
        for lid, shard, epoch, trainer, stream, node, exp in raw["leases"]:
            rec = LeaseRec(lid, shard, epoch, trainer, stream, node, float(exp))
            job.leases[lid] = rec
            job._push(rec)
        job.closed = OrderedDict((k, (t, o)) for k, t, o in raw["closed"])
        job.last_request = OrderedDict(((t, st), (rid, tuple(ids))) for t, st, rid, ids in raw["last_request"])
        job.recent = list(raw["recent"])
        job.totals.update(raw["totals"])
        if job.locality is not None and "locality" in raw:
            job.locality.restore(raw["locality"], job.n)
        if "marks" in raw:
            job.marks = JobMarks.from_json(raw["marks"], lambda item: EpochState.from_json(item, spec))
        job.created_at = float(raw.get("created_at", 0.0))
        job.owner = raw.get("owner")
        return job


class MasterState:
    """Every job of a master, and the rules that move them."""

    def __init__(self) -> None:
        self.jobs: dict[str, JobState] = {}
        self.last_now: float = 0.0
        self.ring = Ring()
        """The cluster cache's live members (Placement events), for jobs with a locality window."""

    # -- entry point --

    def apply(self, event: Event, now: float) -> Result:
        """Apply ``event`` at time ``now`` (seconds, wall clock; clamped to never go back)."""
        now = max(float(now), self.last_now)
        if isinstance(event, CreateJob):
            result = self._create(event, now)
        elif isinstance(event, Resume):
            result = self._resume(event, now)
        elif isinstance(event, Placement):
            result = self._placement(event)
        elif isinstance(event, Holdings):
            result = self._holdings(event)
        else:
            job = self.job(event.job)
            if isinstance(event, Lease):
                result = self._lease(job, event, now)
            elif isinstance(event, Renew):
                result = self._renew(job, event, now)
            elif isinstance(event, Complete):
                result = self._complete(job, event, now)
            elif isinstance(event, Fail):
                result = self._fail(job, event, now)
            elif isinstance(event, Release):
                result = self._release(job, event, now)
            elif isinstance(event, DeleteJob):
                result = self._delete(job, event, now)
            elif isinstance(event, Mark):
                result = self._mark(job, event, now)
            elif isinstance(event, Rewind):
                result = self._rewind(job, event, now)
            else:
                raise TypeError(f"not an event: {event!r}")
        result.now = now
        if result.mutated:
            self.last_now = now
            if result.record is None:
                result.record = event
        return result

    def warm(self) -> None:
        """Rebuild the window indexes of windowed jobs now (placing their shards: O(members) a
        shard the first time), as the first lease of each epoch would: for a master that just
        loaded the state, off the event loop, before it serves. Changes nothing logical."""
        for job in self.jobs.values():
            if job.locality is None:
                continue
            for ep in job.open.values():
                if ep.window is not None and not ep.window.indexed and ep.cursor < ep.n:
                    ep.rebuild_index(ep.window, job.locality, self.ring)

    def job(self, name: str) -> JobState:
        job = self.jobs.get(name)
        if job is None:
            raise NoSuchJob(
                f"no job named {name!r} on this master: it was never created, or it was deleted (DELETE "
                f"/v1/jobs/{name}); create it first (POST /v1/jobs)",
                job=name,
            )
        return job

    # -- handlers: validate everything, then mutate (a refusal leaves the state untouched) --

    def _create(self, event: CreateJob, now: float) -> Result:
        existing = self.jobs.get(event.spec.name)
        if existing is not None:
            if existing.spec != event.spec:
                raise JobConflict(
                    f"job {event.spec.name!r} exists with a different spec: use the same spec to join it, or another name",
                    job=event.spec.name,
                    differs=spec_diff(existing.spec, event.spec),
                )
            return Result(self.status(event.spec.name, now), mutated=False)
        job = self.jobs[event.spec.name] = JobState(event.spec, created_at=now, owner=event.owner)
        job.open_next()
        return Result(self.status(event.spec.name, now), mutated=True, created=True)

    def _resume(self, event: Resume, now: float) -> Result:
        mutated = False
        for job in self.jobs.values():
            # Leases that had expired by the last time the previous master was seen working
            # stay expired; only those it could still have renewed get the grace.
            mutated = job.expire(self.last_now) > 0 or mutated
            ttl = job.spec.lease_ttl_s
            for rec in job.leases.values():
                if rec.expires_at < now + ttl:
                    rec.expires_at = now + ttl
                    job._push(rec)
                    mutated = True
        return Result({}, mutated=mutated)

    def _placement(self, event: Placement) -> Result:
        members = event.members
        if not isinstance(members, tuple) or len(members) > MAX_MEMBERS:
            raise BadRequest(f"a placement lists at most {MAX_MEMBERS} members")
        for item in members:
            if (not isinstance(item, tuple) or len(item) != 2 or not all(isinstance(x, str) and len(x) <= 512 for x in item)
                    or not item[0]):
                raise BadRequest("a placement member is a pair of (member id, node name) strings")
        # -- mutation --
        changed = self.ring.update(members)
        if changed:
            for job in self.jobs.values():
                for ep in job.open.values():
                    if ep.window is not None:
                        ep.window.reset()  # owners moved: the index is rebuilt on the next lease
        answer = {"version": self.ring.version, "members": len(self.ring.node_of), "changed": changed}
        return Result(answer, mutated=changed)

    def _holdings(self, event: Holdings) -> Result:
        """A node's reported holdings (holdings.py): the holder of each shard named, in every
        windowed job. Sweeps nothing, as a placement: it changes no lease."""
        check_ident(event.node, "node")
        if not isinstance(event.full, bool):
            raise BadRequest("'full' must be true or false")
        for what, hashes in (("held", event.held), ("dropped", event.dropped)):
            if not isinstance(hashes, tuple) or len(hashes) > MAX_HASHES:
                raise BadRequest(f"'{what}' lists at most {MAX_HASHES} hashes")
            try:
                array("Q", hashes)  # every one an unsigned 64-bit integer, checked at C speed
            except (TypeError, OverflowError):
                raise BadRequest(f"'{what}' holds 64-bit unsigned integers only") from None
        if event.full and event.dropped:
            raise BadRequest("a full report drops nothing")
        # -- mutation --
        changed = apply_holdings(self.jobs.values(), event)
        return Result({"changed": changed}, mutated=changed > 0)

    @staticmethod
    def _pool(job: JobState, epoch: int | None) -> EpochState | None:
        """The epoch the next shard of a lease request comes from: the requested one while it has
        shards to hand out; for a continuous request the oldest open epoch with any, else a newly
        opened one. None: nothing to hand out now."""
        if epoch is not None:
            ep = job.open.get(epoch)
            return ep if ep is not None and ep.todo() > 0 else None
        for ep in job.open.values():
            if ep.todo() > 0:
                return ep
        return job.open_next() if job.can_open() else None

    def _lease(self, job: JobState, ev: Lease, now: float) -> Result:
        check_ident(ev.trainer, "trainer")
        check_ident(ev.node, "node")
        check_int(ev.count, "count", 1, MAX_COUNT)
        stream = "" if ev.stream is None else check_ident(ev.stream, "stream")
        if ev.epoch is not None:
            check_int(ev.epoch, "epoch", 0)
        if ev.request_id is not None:
            check_ident(ev.request_id, "request_id")
            last = job.last_request.get((ev.trainer, stream))
            if last is not None and last[0] == ev.request_id:
                # A retry of a request whose answer was lost: the same leases, nothing new.
                recs = [r for r in (job.valid_lease(lid, now) for lid in last[1]) if r is not None and r.trainer == ev.trainer]
                if recs:
                    return Result(self._lease_ok(job, recs, now), mutated=False)
        if job.finished:
            return Result(_lease_status("finished", job.epoch), mutated=False)
        if ev.epoch is not None and ev.epoch < job.next_epoch and ev.epoch not in job.open:
            return Result(_lease_status("epoch_done", job.epoch), mutated=False)
        if ev.epoch is not None and ev.epoch >= job.next_epoch:
            # That epoch starts when the current one is drained.
            return Result(_lease_status("wait", job.epoch, _WAIT_MAX_S), mutated=False)
        next_expiry = job.next_expiry()
        can_open = ev.epoch is None and job.can_open()
        if job.todo_count(ev.epoch) == 0 and not can_open and (next_expiry is None or next_expiry > now):
            retry = _WAIT_MAX_S if next_expiry is None else min(max(next_expiry - now, _WAIT_MIN_S), _WAIT_MAX_S)
            answer = _lease_status("wait", job.epoch, round(retry, 3))
            if ev.epoch is None:
                # Continuous mode waits only at the job's end. Whether to wait there is the
                # trainer's call: its peers' last shards may be held by a rank blocked in a
                # collective with it (renewing: do not wait for it) or by a dead one (not renewing:
                # its leases come back at expiry). Say how many look abandoned.
                ttl = job.spec.lease_ttl_s
                after = ttl * _STALE_FRACTION + 1.0
                answer["stale_after_s"] = round(after, 3)
                answer["stale_leases"] = sum(1 for r in job.leases.values() if now - (r.expires_at - ttl) > after)
            return Result(answer, mutated=False)
        # -- mutation from here on --
        job.expire(now)
        ttl = job.spec.lease_ttl_s
        granted: list[LeaseRec] = []
        ids = iter(ev.lease_ids)
        used: list[str] = []
        while len(granted) < ev.count:
            lid = next(ids, None)
            if lid is None:
                break
            if lid in job.leases or lid in job.closed:
                used.append(lid)  # an id collision (astronomically rare): skip it, deterministically
                continue
            ep = self._pool(job, ev.epoch)
            if ep is None:
                break
            shard, again = ep.take(ev.trainer, ev.node, job.locality, self.ring)
            if again:
                job.totals["reissued"] += 1
            if job.locality is not None:
                job.locality.counts[job.locality.kind(shard, ev.node, self.ring)] += 1
            rec = LeaseRec(lid, shard, ep.epoch, ev.trainer, stream, ev.node, now + ttl)
            job.leases[lid] = rec
            job._push(rec)
            granted.append(rec)
            used.append(lid)
        job.totals["leased"] += len(granted)
        if ev.request_id is not None and granted:
            job.remember_request(ev.trainer, stream, ev.request_id, tuple(r.id for r in granted))
        record = Lease(ev.job, ev.trainer, ev.node, ev.count, ev.epoch, tuple(used), ev.request_id, ev.stream)
        if not granted:
            # Only expired leases of another epoch were swept: the requested one has nothing yet.
            expiry = job.next_expiry()
            retry = _WAIT_MAX_S if expiry is None else min(max(expiry - now, _WAIT_MIN_S), _WAIT_MAX_S)
            return Result(_lease_status("wait", job.epoch, round(retry, 3)), mutated=True, record=record)
        return Result(self._lease_ok(job, granted, now), mutated=True, record=record)

    def _lease_ok(self, job: JobState, recs: list[LeaseRec], now: float) -> dict[str, Any]:
        return {
            "status": "ok",
            "epoch": job.epoch,
            "leases": [job.lease_answer(r, now) for r in recs],
            "retry_after_s": None,
        }

    def _holder(self, job: JobState, lease: str, trainer: str, now: float) -> LeaseRec:
        validate_lease_id(lease)
        check_ident(trainer, "trainer")
        rec = job.leases.get(lease)
        if rec is not None and rec.trainer != trainer:
            raise NotLeaseHolder(f"lease {lease} is held by another trainer, not {trainer!r}", lease=lease)
        if rec is None or rec.expires_at <= now:
            closed = job.closed.get(lease)
            if closed is not None and closed[1] == "revoked":
                raise LeaseLost(
                    f"lease {lease} was revoked: the job was resumed from a checkpoint (a rewind); drop the shard "
                    "and lease another", lease=lease, revoked=True,
                )
            raise LeaseLost(
                f"lease {lease} expired, was re-issued or is unknown: drop the shard and lease another", lease=lease
            )
        return rec

    @staticmethod
    def _advance(job: JobState, rec: LeaseRec, offset: int, clock: int | None, now: float) -> int:
        """Record that ``rec``'s shard was received up to ``offset`` at ``clock``; the gain."""
        ep = job.open[rec.epoch]
        before = ep.offset(rec.shard)
        gained = ep.advance(rec.shard, offset)
        if gained:
            job.marks.record(clock, rec.epoch, rec.shard, before, False, now)
        return gained

    def _check_offset(self, job: JobState, rec: LeaseRec, offset: int) -> None:
        """``offset`` (already checked to be an integer >= 0) within the shard's samples."""
        samples = job.spec.shards[rec.shard].samples
        if samples is not None and offset > samples:
            raise BadRequest(f"offset {offset} is past the end of shard {rec.shard} ({samples} samples)")

    def _renew(self, job: JobState, ev: Renew, now: float) -> Result:
        check_int(ev.offset, "offset")
        _check_clock(ev.clock)
        rec = self._holder(job, ev.lease, ev.trainer, now)
        self._check_offset(job, rec, ev.offset)
        # -- mutation --
        job.expire(now)
        gained = self._advance(job, rec, ev.offset, ev.clock, now)
        rec.expires_at = now + job.spec.lease_ttl_s
        job._push(rec)
        return Result({"ttl_s": job.spec.lease_ttl_s, "offset": job.open[rec.epoch].offset(rec.shard)}, mutated=True, progress=gained)

    def _closed_outcome(self, job: JobState, lease: str, trainer: str) -> str | None:
        hit = job.closed.get(lease)
        if hit is None:
            return None
        if hit[0] != trainer:
            raise NotLeaseHolder(f"lease {lease} was held by another trainer, not {trainer!r}", lease=lease)
        return hit[1]

    def _complete(self, job: JobState, ev: Complete, now: float) -> Result:
        validate_lease_id(ev.lease)
        check_ident(ev.trainer, "trainer")
        if ev.lease not in job.leases:
            if self._closed_outcome(job, ev.lease, ev.trainer) == "done":
                return Result({"status": "done", "epoch": job.epoch, "already": True}, mutated=False)
        _check_clock(ev.clock)
        rec = self._holder(job, ev.lease, ev.trainer, now)
        # -- mutation --
        job.expire(now)
        ep = job.open[rec.epoch]
        samples = job.spec.shards[rec.shard].samples
        before = ep.offset(rec.shard)
        gained = max(0, samples - before) if samples is not None else 0
        job.close(rec, ev.trainer, "done")
        job.marks.record(ev.clock, rec.epoch, rec.shard, before, True, now)
        ep.mark_done(rec.shard)
        job.totals["completed"] += 1
        if job.locality is not None and rec.node and job.locality.readers.set(rec.shard, rec.node):
            for other in job.open.values():
                if other is not ep:
                    other.note_reader(rec.shard, rec.node)
        job.maybe_close_epoch(ep)
        return Result({"status": "done", "epoch": rec.epoch, "already": False}, mutated=True, progress=gained)

    def _fail(self, job: JobState, ev: Fail, now: float) -> Result:
        validate_lease_id(ev.lease)
        check_ident(ev.trainer, "trainer")
        if not isinstance(ev.error, str):
            raise BadRequest("'error' must be a string saying what went wrong")
        if ev.lease not in job.leases:
            outcome = self._closed_outcome(job, ev.lease, ev.trainer)
            if outcome in ("todo", "failed"):
                return Result({"shard_state": outcome, "already": True}, mutated=False)
        rec = self._holder(job, ev.lease, ev.trainer, now)
        # -- mutation --
        job.expire(now)
        ep = job.open[rec.epoch]
        prog = ep.progress.setdefault(rec.shard, Progress())
        prog.failures += 1
        prog.last_error = ev.error[:_MAX_ERROR_TEXT]
        prog.last_failed_by = ev.trainer
        job.totals["failures"] += 1
        if prog.failures >= job.spec.max_failures:
            ep.failed.add(rec.shard)
            outcome = "failed"
        else:
            ep.requeue.append(rec.shard)
            outcome = "todo"
        job.close(rec, ev.trainer, outcome)
        job.maybe_close_epoch(ep)
        return Result({"shard_state": outcome, "already": False}, mutated=True)

    def _delete(self, job: JobState, ev: DeleteJob, now: float) -> Result:
        live = [rec for rec in job.leases.values() if rec.expires_at > now]
        if live and not ev.force:
            trainers = sorted({rec.trainer for rec in live})
            shown = ", ".join(repr(t) for t in trainers[:5]) + (f" and {len(trainers) - 5} more" if len(trainers) > 5 else "")
            raise JobInUse(
                f"job {ev.job!r} has {len(live)} live lease(s), held by {shown}: delete it once its trainers are done "
                f"(or stopped and their leases expired, within {job.spec.lease_ttl_s:g}s), or now with ?force=true "
                "(its trainers' next calls then get NoSuchJob)",
                job=ev.job, leases=len(live), trainers=trainers[:20],
            )
        # -- mutation --
        del self.jobs[ev.job]
        return Result({"deleted": True}, mutated=True)

    def _release(self, job: JobState, ev: Release, now: float) -> Result:
        validate_lease_id(ev.lease)
        check_ident(ev.trainer, "trainer")
        check_int(ev.offset, "offset")
        _check_clock(ev.clock)
        if ev.lease not in job.leases and self._closed_outcome(job, ev.lease, ev.trainer) == "released":
            return Result({"shard_state": "todo", "already": True}, mutated=False)
        rec = self._holder(job, ev.lease, ev.trainer, now)
        self._check_offset(job, rec, ev.offset)
        # -- mutation --
        job.expire(now)
        ep = job.open[rec.epoch]
        gained = self._advance(job, rec, ev.offset, ev.clock, now)
        ep.requeue.append(rec.shard)
        job.close(rec, ev.trainer, "released")
        job.totals["released"] += 1
        return Result({"shard_state": "todo", "offset": ep.offset(rec.shard), "already": False}, mutated=True, progress=gained)

    def _mark(self, job: JobState, ev: Mark, now: float) -> Result:
        check_ident(ev.trainer, "trainer")
        check_int(ev.clock, "clock")
        if not isinstance(ev.positions, tuple) or len(ev.positions) > MAX_COUNT:
            raise BadRequest(f"'positions' lists at most {MAX_COUNT} [lease, offset] pairs")
        held: list[tuple[LeaseRec, int]] = []
        lost: list[str] = []
        for item in ev.positions:
            if not isinstance(item, tuple) or len(item) != 2:
                raise BadRequest("a position is a [lease id, offset] pair")
            lease, offset = validate_lease_id(item[0]), check_int(item[1], "offset")
            rec = job.valid_lease(lease, now)
            if rec is None or rec.trainer != ev.trainer:
                lost.append(lease)  # expired and re-issued: its next holder hands those samples out again
                continue
            self._check_offset(job, rec, offset)
            held.append((rec, offset))
        # -- mutation --
        job.expire(now)
        gained = 0
        for rec, offset in held:
            if rec.id in job.leases:  # still held after the sweep
                gained += self._advance(job, rec, offset, ev.clock, now)
        mark, _ = job.marks.mark(ev.clock, job.epoch, now)
        answer = {**mark.answer(), "lost": lost, "job_created": job.created_at}
        return Result(answer, mutated=True, progress=gained)

    def _rewind(self, job: JobState, ev: Rewind, now: float) -> Result:
        check_ident(ev.trainer, "trainer")
        check_int(ev.mark, "mark")
        check_int(ev.clock, "clock")
        if ev.created is not None:
            if isinstance(ev.created, bool) or not isinstance(ev.created, (int, float)) or not math.isfinite(ev.created):
                raise BadRequest("'job_created' must be the number the checkpoint state holds")
            if job.created_at and ev.created and abs(float(ev.created) - job.created_at) > 1e-3:
                raise CheckpointGone(
                    f"the checkpoint is of an earlier job named {job.spec.name!r} (created at {float(ev.created):.3f}; this "
                    f"one was created at {job.created_at:.3f}): its marks are gone with it; start fresh without loading it",
                    job=job.spec.name, mark=ev.mark,
                )
        if ev.mark == 0:
            return self._restart(job, ev, now)
        mark = job.marks.marks.get(ev.mark)
        if mark is None:
            raise CheckpointGone(job.marks.refusal(ev.mark), job=job.spec.name, mark=ev.mark)
        if mark.clock != ev.clock:
            raise BadRequest(f"checkpoint mark {ev.mark} is at clock {mark.clock}, the state says {ev.clock}: "
                             "the state was altered, or is from another job")
        # -- mutation --
        # Every shard handed out is done, failed, queued again or leased: expired leases are
        # queued (the sweep), live ones revoked, and what is undone or revoked is queued first.
        # So a rewind costs what it changes, not the job's size (a repeat: nothing).
        job.expire(now)
        again = job.revoke_all()
        revoked = sum(len(shards) for shards in again.values())
        undone = job.marks.undo(mark.clock)
        for (epoch, shard), change in undone.items():
            ep = job.open.get(epoch)
            if ep is None:
                ep = job.marks.closed.pop(epoch, None)
                if ep is None:  # cannot happen: a change's closed epoch is kept while the change is
                    continue
                job.open[epoch] = ep
                job.recent = [r for r in job.recent if r["epoch"] != epoch]
                job.totals["epochs"] -= 1
            was_done = ep.is_done(shard)
            ep.undo(shard, change.before)
            if was_done:
                again.setdefault(epoch, []).append(shard)
        job.open = dict(sorted(job.open.items()))
        # The newest epochs opened past the mark and left with nothing delivered are as if never
        # opened (only while no epoch above them closed: their numbers are not taken again).
        while len(job.open) > 1 and next(reversed(job.open)) == job.next_epoch - 1:
            last = next(reversed(job.open))
            if job.open[last].touched():
                break
            del job.open[last]
            again.pop(last, None)
            job.next_epoch = last
        if job.open:
            job.finished = False
        elif not job.finished:
            job.open_next()
        for epoch, shards in again.items():
            if epoch in job.open:
                job.open[epoch].requeue_first(shards)
        job.totals["rewinds"] = job.totals.get("rewinds", 0) + 1
        answer = {"mark": mark.id, "clock": mark.clock, "epoch": job.epoch, "revoked": revoked, "undone": len(undone),
                  "finished": job.finished}
        return Result(answer, mutated=True)

    def _restart(self, job: JobState, ev: Rewind, now: float) -> Result:
        """Mark 0 is the job's beginning (a state saved before its loop received anything):
        nothing was trained, so every epoch starts over."""
        if ev.clock != 0:
            raise BadRequest(f"checkpoint mark 0 (the job's beginning) is at clock 0, the state says {ev.clock}")
        # -- mutation --
        revoked = sum(len(shards) for shards in job.revoke_all().values())
        undone = sum(ep.done_count for ep in job.open.values()) + sum(r["done"] for r in job.recent)
        job.open, job.recent, job.finished, job.next_epoch = {}, [], False, 0
        job.totals["epochs"] = 0
        job.marks.forget()
        job.open_next()
        job.totals["rewinds"] = job.totals.get("rewinds", 0) + 1
        answer = {"mark": 0, "clock": 0, "epoch": job.epoch, "revoked": revoked, "undone": undone, "finished": False}
        return Result(answer, mutated=True)

    # -- read-only views --

    def status(self, name: str, now: float) -> dict[str, Any]:
        job = self.job(name)
        streams: dict[str, dict[str, int]] = {}
        for rec in job.leases.values():
            if rec.expires_at > now:
                by_stream = streams.setdefault(rec.trainer, {})
                by_stream[rec.stream] = by_stream.get(rec.stream, 0) + 1
        current = job.open.get(job.epoch)
        recent = job.recent
        if current is not None:
            failed, previous = current.failed_list(job.spec), (recent[0]["failed"] if recent else [])
        else:
            failed = recent[0]["failed"] if recent else []
            previous = recent[1]["failed"] if len(recent) > 1 else []
        return {
            "name": name,
            "owner": job.owner,
            "dataset": job.spec.dataset,
            "epoch": job.epoch,
            "epochs": job.spec.epochs,
            "finished": job.finished,
            "shards": job.counts(now),
            "open_epochs": [{"epoch": e, **job.counts(now, e)} for e in job.open],
            "failed_shards": failed,
            "failed_previous_epoch": previous,
            "leases_by_trainer": streams,
            "totals": dict(job.totals),
            "spec": job.spec.summary(),
            "locality": self._locality_report(job),
            "checkpoints": job.marks.report(job.totals.get("rewinds", 0)),
        }

    def _locality_report(self, job: JobState) -> dict[str, Any] | None:
        if job.locality is None:
            return None
        epochs = [ep.window.report(ep.epoch) for ep in job.open.values() if ep.window is not None]
        epochs += [r["order"] for r in job.recent if "order" in r]
        report = job.locality.report(sorted(epochs, key=lambda e: e["epoch"]))
        report["ring"] = {"version": self.ring.version, "members": len(self.ring.node_of), "nodes": self.ring.nodes}
        return report

    def to_json(self) -> dict[str, Any]:
        """The state as a snapshot document (:func:`~loader.master.server.snapshots.document`)."""
        return document(self.last_now, self._ring_json(), [job.to_json() for job in self.jobs.values()])

    def snapshot_text(self) -> str:
        """``to_json()`` as JSON text, spliced from each spec's cached text
        (:func:`~loader.master.server.snapshots.write_text`)."""
        jobs = ((job.spec.json_text, job.to_json(with_spec=False)) for job in self.jobs.values())
        return write_text(self.last_now, self._ring_json(), jobs)

    def _ring_json(self) -> Any:
        return self.ring.to_json() if self.ring.version else None

    @classmethod
    def from_text(cls, text: str) -> MasterState:
        """A state from its snapshot's JSON text. The text :meth:`snapshot_text` writes is read in
        place (:func:`~loader.master.server.snapshots.read_text`: its specs into columns); any other
        text (an older master's) is decoded whole, as :meth:`from_json` takes it."""
        try:
            snapshot = read_text(text)
            state = cls._from_snapshot(snapshot) if snapshot is not None else None
        except (ValueError, KeyError, TypeError):  # not as snapshot_text writes it: decoded whole below
            state = None
        return state if state is not None else cls.from_json(json.loads(text))

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> MasterState:
        """A state from its decoded snapshot document, of any version read."""
        return cls._from_snapshot(read_document(raw))

    @classmethod
    def _from_snapshot(cls, snapshot: Snapshot) -> MasterState:
        state = cls()
        state.last_now = snapshot.last_now
        if snapshot.ring is not None:
            state.ring = Ring.from_json(snapshot.ring)
        for spec, raw in snapshot.jobs:
            state.jobs[spec.name] = JobState.from_json(raw, spec)
        return state


# -- holdings as state (reported by daemons: holdings.py) ------------------------------------------------------------------------------


_SMALL_HOLDINGS = 64
"""Past this many new holders in one report, an open window's index is rebuilt at its next lease
instead of noted shard by shard (the same choice either way)."""


def _shards(index: ShardIndex, hashes: Iterable[int]) -> list[int]:
    find = index.find
    return [s for s in (find(h) for h in hashes) if s >= 0]


def apply_holdings(jobs: Iterable[JobState], ev: Holdings) -> int:
    """Apply a validated ``Holdings`` event to every windowed job the daemons can name; the
    number of holder entries changed (0: nothing changed, nothing to journal). Per job O(reported)
    binary searches (skipped with the service's ``resolved`` shortcut), plus O(shards) once for a
    full report (its node's old entries)."""
    hint = ev.resolved if isinstance(ev.resolved, dict) else {}
    changed = 0
    for job in jobs:
        loc = job.locality
        if loc is None or loc.names is None:
            continue
        found = hint.get(job.spec.name)
        if found is not None and found[0] is job.spec:
            held, dropped = found[1], found[2]
        else:
            index = job_index(loc, job.spec)
            if index is None:
                continue
            held, dropped = _shards(index, ev.held), _shards(index, ev.dropped)
        changed += _apply_job(job, loc.readers, ev.node, ev.full, held, dropped)
    return changed


def _apply_job(job: JobState, readers: Readers, node: str, full: bool, held: list[int], dropped: list[int]) -> int:
    changed = 0
    if full:
        keep = set(held)
        for shard in readers.shards_of(node):
            if shard not in keep:
                changed += readers.clear(shard)
    else:
        for shard in dropped:
            if readers.get(shard) == node:
                changed += readers.clear(shard)
    noted: list[int] = []
    for shard in held:
        if readers.set(shard, node):
            changed += 1
            noted.append(shard)
    if noted:
        # A shard that now has a holder and waits in an open window must be in the window's
        # index for that node (so the next lease of a trainer there finds it). Each costs a
        # seeded-order inverse per open epoch; past a few, rebuilding the windows' indexes at
        # their next lease is cheaper. Either way the index holds every local position, and a
        # lease takes the smallest of those, so the choice is the same.
        for ep in job.open.values():
            if ep.window is None:
                continue
            if len(noted) <= _SMALL_HOLDINGS:
                for shard in noted:
                    ep.note_reader(shard, node)
            else:
                ep.window.reset()
    return changed


def _object_names(spec: JobSpec) -> Callable[[int], str] | None:
    """How the daemons name a job's shards for the ring (``bucket/prefix+key``); None for a
    dataset they cannot place by name (``file://``)."""
    where = s3_location(spec.dataset)
    if where is None:
        return None
    base, shards = f"{where[0]}/{where[1]}", spec.shards
    return lambda shard: base + shards[shard].key


def _check_clock(clock: Any) -> None:
    if clock is not None:
        check_int(clock, "clock")


def _lease_status(status: str, epoch: int, retry_after_s: float | None = None) -> dict[str, Any]:
    return {"status": status, "epoch": epoch, "leases": [], "retry_after_s": retry_after_s}
