"""The lease state machine of the master: pure, deterministic, no I/O, no clock, no randomness.

``MasterState.apply(event, now)`` validates an event against the state, and either refuses it
(raises a :class:`~loader.master.errors.MasterError` and changes nothing) or applies it and
returns a :class:`Result` whose ``mutated`` flag says whether the state changed. The stores
make the state durable by logging every mutating event (with the ``now`` it was applied at,
``Result.now``) and replaying the log on start: given the same events and times the machine
reaches the same state, so SQLite and etcd share every rule here and the hypothesis tests
drive it directly with an injected clock.

Exactly-once per epoch rests on three rules:

- a lease is valid while it is in ``JobState.leases`` and ``now < expires_at``; renew,
  complete and fail of an invalid lease are refused (``LeaseLost``) and change nothing;
- a shard is handed out only while it is ``todo``: never leased this epoch (the epoch order's
  cursor has not reached it) or returned to ``requeue`` by an expiry or a failure;
- a completion moves the shard to ``done`` and closes the lease, so it cannot count twice;
  repeating the completion of the same lease by its holder is answered as done (a retry after
  a lost answer) without counting again.

Expired leases are swept lazily, in (expiry time, lease id) order, at the start of every
mutating event; refused and read-only events never sweep, so a replay that sees only the
logged events sweeps exactly as the live master did.
"""

from __future__ import annotations

import heapq
import json
import re
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from loader.master.errors import BadRequest, JobConflict, LeaseLost, NoSuchJob, NotLeaseHolder
from loader.master.server.spec import JobSpec, ShardSpec, check_ident, check_int, spec_diff, validate_job_name
from wire.shuffle import EpochOrder

__all__ = [
    "event_to_text",
    "ShardSpec",
    "JobSpec",
    "CreateJob",
    "Lease",
    "Renew",
    "Complete",
    "Fail",
    "Release",
    "Resume",
    "Event",
    "Result",
    "JobState",
    "MasterState",
    "event_to_json",
    "event_from_json",
    "MAX_COUNT",
    "MAX_LEASE_WAIT_S",
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
_WAIT_MAX_S = 1.0
_WAIT_MIN_S = 0.05



def validate_lease_id(lease: Any) -> str:
    if not isinstance(lease, str) or not _LEASE_ID_RE.match(lease):
        raise BadRequest(f"invalid lease id {str(lease)[:80]!r}: use the 'lease' value the master returned")
    return lease


# -- events --------------------------------------------------------------------------------


@dataclass(frozen=True)
class CreateJob:
    spec: JobSpec


@dataclass(frozen=True)
class Lease:
    job: str
    trainer: str
    node: str
    count: int
    epoch: int | None
    lease_ids: tuple[str, ...]
    """Fresh ids for the leases granted, supplied by the caller (the machine has no randomness)."""
    request_id: str | None = None


@dataclass(frozen=True)
class Renew:
    job: str
    lease: str
    trainer: str
    offset: int


@dataclass(frozen=True)
class Complete:
    job: str
    lease: str
    trainer: str


@dataclass(frozen=True)
class Fail:
    job: str
    lease: str
    trainer: str
    error: str


@dataclass(frozen=True)
class Release:
    """A trainer gives a lease back before its end (it is leaving): the shard is handed out again
    at once, from ``offset``, instead of after the lease's TTL. Not a failure."""

    job: str
    lease: str
    trainer: str
    offset: int


@dataclass(frozen=True)
class Resume:
    """A master took over the state (start, restart, election): every live lease gets a full TTL
    from now, since its holder could not renew while no master was serving."""


Event = CreateJob | Lease | Renew | Complete | Fail | Release | Resume


def event_to_json(event: Event) -> dict[str, Any]:
    if isinstance(event, CreateJob):
        return {"t": "create", "spec": event.spec.to_json()}
    if isinstance(event, Lease):
        return {
            "t": "lease", "job": event.job, "trainer": event.trainer, "node": event.node, "count": event.count,
            "epoch": event.epoch, "ids": list(event.lease_ids), "rid": event.request_id,
        }
    if isinstance(event, Renew):
        return {"t": "renew", "job": event.job, "lease": event.lease, "trainer": event.trainer, "offset": event.offset}
    if isinstance(event, Complete):
        return {"t": "complete", "job": event.job, "lease": event.lease, "trainer": event.trainer}
    if isinstance(event, Fail):
        return {"t": "fail", "job": event.job, "lease": event.lease, "trainer": event.trainer, "error": event.error}
    if isinstance(event, Release):
        return {"t": "release", "job": event.job, "lease": event.lease, "trainer": event.trainer, "offset": event.offset}
    if isinstance(event, Resume):
        return {"t": "resume"}
    raise TypeError(f"not an event: {event!r}")


def event_to_text(event: Event) -> str:
    """``event_to_json`` as compact JSON text, reusing the cached text of a job spec."""
    if isinstance(event, CreateJob):
        return '{"t":"create","spec":' + event.spec.json_text + "}"
    return json.dumps(event_to_json(event), separators=(",", ":"))


def event_from_json(raw: dict[str, Any]) -> Event:
    kind = raw["t"]
    if kind == "create":
        return CreateJob(JobSpec.from_log(raw["spec"]))
    if kind == "lease":
        return Lease(raw["job"], raw["trainer"], raw["node"], raw["count"], raw["epoch"], tuple(raw["ids"]), raw["rid"])
    if kind == "renew":
        return Renew(raw["job"], raw["lease"], raw["trainer"], raw["offset"])
    if kind == "complete":
        return Complete(raw["job"], raw["lease"], raw["trainer"])
    if kind == "fail":
        return Fail(raw["job"], raw["lease"], raw["trainer"], raw["error"])
    if kind == "release":
        return Release(raw["job"], raw["lease"], raw["trainer"], raw["offset"])
    if kind == "resume":
        return Resume()
    raise ValueError(f"unknown event type {kind!r}")


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
    trainer: str
    node: str
    expires_at: float


@dataclass(slots=True)
class Progress:
    """What this epoch knows of a shard that has been leased at least once."""

    offset: int = 0
    failures: int = 0
    last_error: str | None = None
    last_failed_by: str | None = None


@dataclass
class JobState:
    spec: JobSpec
    epoch: int = 0
    finished: bool = False
    cursor: int = 0
    """Positions of the epoch order below the cursor have been leased at least once."""
    leases: dict[str, LeaseRec] = field(default_factory=dict)
    progress: dict[int, Progress] = field(default_factory=dict)
    requeue: deque[int] = field(default_factory=deque)
    """Shards returned by an expiry or a failure, handed out again first (resume early)."""
    done: set[int] = field(default_factory=set)
    failed: set[int] = field(default_factory=set)
    closed: dict[str, tuple[str, str]] = field(default_factory=dict)
    """lease id -> (trainer, outcome "done"/"todo"/"failed"/"released") for leases closed this epoch."""
    closed_prev: dict[str, tuple[str, str]] = field(default_factory=dict)
    """The same for the previous epoch (a repeated completion may arrive after the epoch advanced)."""
    last_request: dict[str, tuple[str, tuple[str, ...]]] = field(default_factory=dict)
    """trainer -> (request id, lease ids granted): a retried lease request gets the same leases."""
    prev_failed: list[dict[str, Any]] = field(default_factory=list)
    totals: dict[str, int] = field(
        default_factory=lambda: {
            "leased": 0, "reissued": 0, "completed": 0, "expired": 0, "released": 0, "failures": 0, "epochs": 0,
        }
    )
    _heap: list[tuple[float, str]] = field(default_factory=list, repr=False)
    _order: EpochOrder | None = field(default=None, repr=False)

    @property
    def n(self) -> int:
        return len(self.spec.shards)

    @property
    def order(self) -> EpochOrder:
        if self._order is None or self._order.epoch != self.epoch:
            self._order = EpochOrder(self.n, self.spec.seed, self.epoch, self.spec.shuffle)
        return self._order

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

    def todo_count(self) -> int:
        return self.n - self.cursor + len(self.requeue)

    def counts(self, now: float) -> dict[str, int]:
        leased = sum(1 for rec in self.leases.values() if rec.expires_at > now)
        done, failed = len(self.done), len(self.failed)
        if self.finished:
            return {"total": self.n, "todo": 0, "leased": 0, "done": done, "failed": failed}
        return {"total": self.n, "todo": self.n - leased - done - failed, "leased": leased, "done": done, "failed": failed}

    # -- transitions --

    def expire(self, now: float) -> int:
        heap = self._heap
        expired = 0
        while heap and heap[0][0] <= now:
            exp, lid = heapq.heappop(heap)
            rec = self.leases.get(lid)
            if rec is None or rec.expires_at != exp:
                continue
            del self.leases[lid]
            self.requeue.append(rec.shard)
            expired += 1
        self.totals["expired"] += expired
        return expired

    def _push(self, rec: LeaseRec) -> None:
        heapq.heappush(self._heap, (rec.expires_at, rec.id))

    def _take(self, trainer: str) -> int:
        requeue = self.requeue
        if requeue:
            for i in range(min(_REQUEUE_SCAN, len(requeue))):
                shard = requeue[i]
                prog = self.progress.get(shard)
                if prog is None or prog.last_failed_by != trainer:
                    del requeue[i]
                    return shard
            if self.cursor >= self.n:
                return requeue.popleft()
        if self.cursor < self.n:
            shard = self.order[self.cursor]
            self.cursor += 1
            return shard
        return requeue.popleft()

    def lease_answer(self, rec: LeaseRec, now: float) -> dict[str, Any]:
        spec = self.spec.shards[rec.shard]
        prog = self.progress.get(rec.shard)
        return {
            "lease": rec.id, "key": spec.key, "shard": rec.shard, "epoch": self.epoch,
            "offset": prog.offset if prog else 0, "size": spec.size, "samples": spec.samples,
            "ttl_s": round(max(rec.expires_at - now, 0.0), 3),
        }

    def maybe_advance(self) -> None:
        if len(self.done) + len(self.failed) < self.n:
            return
        self.totals["epochs"] += 1
        last_failed = self.failed_list()
        if self.spec.epochs is not None and self.epoch + 1 >= self.spec.epochs:
            # Keep the last epoch's done/failed sets: the status of a finished job shows them.
            self.finished = True
            self.epoch += 1
            self.closed_prev, self.closed = self.closed, {}
            self.last_request.clear()
            return
        self.epoch += 1
        self.cursor = 0
        self.leases.clear()
        self._heap.clear()
        self.progress = {}
        self.requeue.clear()
        self.done = set()
        self.failed = set()
        self.closed_prev, self.closed = self.closed, {}
        self.last_request.clear()
        self.prev_failed = last_failed

    def failed_list(self) -> list[dict[str, Any]]:
        out = []
        for shard in sorted(self.failed):
            prog = self.progress.get(shard) or Progress()
            out.append(
                {"key": self.spec.shards[shard].key, "shard": shard, "failures": prog.failures, "last_error": prog.last_error}
            )
        return out

    # -- persistence --

    def to_json(self, *, with_spec: bool = True) -> dict[str, Any]:
        out: dict[str, Any] = {"spec": self.spec.to_json()} if with_spec else {}
        out.update({
            "epoch": self.epoch,
            "finished": self.finished,
            "cursor": self.cursor,
            "leases": [[r.id, r.shard, r.trainer, r.node, r.expires_at] for r in self.leases.values()],
            "progress": [[s, p.offset, p.failures, p.last_error, p.last_failed_by] for s, p in self.progress.items()],
            "requeue": list(self.requeue),
            "done": sorted(self.done),
            "failed": sorted(self.failed),
            "closed": [[k, t, o] for k, (t, o) in self.closed.items()],
            "closed_prev": [[k, t, o] for k, (t, o) in self.closed_prev.items()],
            "last_request": [[t, rid, list(ids)] for t, (rid, ids) in self.last_request.items()],
            "prev_failed": self.prev_failed,
            "totals": dict(self.totals),
        })
        return out

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> JobState:
        spec = event_from_json({"t": "create", "spec": raw["spec"]})
        assert isinstance(spec, CreateJob)
        job = cls(spec.spec, epoch=raw["epoch"], finished=raw["finished"], cursor=raw["cursor"])
        for lid, shard, trainer, node, exp in raw["leases"]:
            rec = LeaseRec(lid, shard, trainer, node, float(exp))
            job.leases[lid] = rec
            job._push(rec)
        job.progress = {s: Progress(o, f, e, b) for s, o, f, e, b in raw["progress"]}
        job.requeue = deque(raw["requeue"])
        job.done = set(raw["done"])
        job.failed = set(raw["failed"])
        job.closed = {k: (t, o) for k, t, o in raw["closed"]}
        job.closed_prev = {k: (t, o) for k, t, o in raw["closed_prev"]}
        job.last_request = {t: (rid, tuple(ids)) for t, rid, ids in raw["last_request"]}
        job.prev_failed = list(raw["prev_failed"])
        job.totals.update(raw["totals"])
        return job


class MasterState:
    """Every job of a master, and the rules that move them."""

    def __init__(self) -> None:
        self.jobs: dict[str, JobState] = {}
        self.last_now: float = 0.0

    # -- entry point --

    def apply(self, event: Event, now: float) -> Result:
        """Apply ``event`` at time ``now`` (seconds, wall clock; clamped to never go back)."""
        now = max(float(now), self.last_now)
        if isinstance(event, CreateJob):
            result = self._create(event, now)
        elif isinstance(event, Resume):
            result = self._resume(event, now)
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
            else:
                raise TypeError(f"not an event: {event!r}")
        result.now = now
        if result.mutated:
            self.last_now = now
            if result.record is None:
                result.record = event
        return result

    def job(self, name: str) -> JobState:
        job = self.jobs.get(name)
        if job is None:
            raise NoSuchJob(f"no job named {name!r} on this master: create it first (POST /v1/jobs)", job=name)
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
        self.jobs[event.spec.name] = JobState(event.spec)
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

    def _lease(self, job: JobState, ev: Lease, now: float) -> Result:
        check_ident(ev.trainer, "trainer")
        check_ident(ev.node, "node")
        check_int(ev.count, "count", 1, MAX_COUNT)
        if ev.epoch is not None:
            check_int(ev.epoch, "epoch", 0)
        if ev.request_id is not None:
            check_ident(ev.request_id, "request_id")
            last = job.last_request.get(ev.trainer)
            if last is not None and last[0] == ev.request_id:
                # A retry of a request whose answer was lost: the same leases, nothing new.
                recs = [r for r in (job.valid_lease(lid, now) for lid in last[1]) if r is not None and r.trainer == ev.trainer]
                if recs:
                    return Result(self._lease_ok(job, recs, now), mutated=False)
        if job.finished:
            return Result(_lease_status("finished", job.epoch), mutated=False)
        if ev.epoch is not None and ev.epoch < job.epoch:
            return Result(_lease_status("epoch_done", job.epoch), mutated=False)
        if ev.epoch is not None and ev.epoch > job.epoch:
            # That epoch starts when the current one is drained.
            return Result(_lease_status("wait", job.epoch, _WAIT_MAX_S), mutated=False)
        next_expiry = job.next_expiry()
        if job.todo_count() == 0 and (next_expiry is None or next_expiry > now):
            retry = _WAIT_MAX_S if next_expiry is None else min(max(next_expiry - now, _WAIT_MIN_S), _WAIT_MAX_S)
            return Result(_lease_status("wait", job.epoch, round(retry, 3)), mutated=False)
        # -- mutation from here on --
        job.expire(now)
        ttl = job.spec.lease_ttl_s
        granted: list[LeaseRec] = []
        ids = iter(ev.lease_ids)
        used: list[str] = []
        while len(granted) < ev.count and job.todo_count() > 0:
            lid = next(ids, None)
            if lid is None:
                break
            if lid in job.leases or lid in job.closed or lid in job.closed_prev:
                used.append(lid)  # an id collision (astronomically rare): skip it, deterministically
                continue
            shard = job._take(ev.trainer)
            if shard in job.progress:
                job.totals["reissued"] += 1
            else:
                job.progress[shard] = Progress()
            rec = LeaseRec(lid, shard, ev.trainer, ev.node, now + ttl)
            job.leases[lid] = rec
            job._push(rec)
            granted.append(rec)
            used.append(lid)
        job.totals["leased"] += len(granted)
        if ev.request_id is not None and granted:
            job.last_request[ev.trainer] = (ev.request_id, tuple(r.id for r in granted))
        record = Lease(ev.job, ev.trainer, ev.node, ev.count, ev.epoch, tuple(used), ev.request_id)
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
            raise LeaseLost(
                f"lease {lease} expired, was re-issued or is unknown: drop the shard and lease another", lease=lease
            )
        return rec

    def _renew(self, job: JobState, ev: Renew, now: float) -> Result:
        check_int(ev.offset, "offset")
        rec = self._holder(job, ev.lease, ev.trainer, now)
        samples = job.spec.shards[rec.shard].samples
        if samples is not None and ev.offset > samples:
            raise BadRequest(f"offset {ev.offset} is past the end of shard {rec.shard} ({samples} samples)")
        # -- mutation --
        job.expire(now)
        prog = job.progress[rec.shard]
        gained = max(0, ev.offset - prog.offset)
        prog.offset = max(prog.offset, ev.offset)
        rec.expires_at = now + job.spec.lease_ttl_s
        job._push(rec)
        return Result({"ttl_s": job.spec.lease_ttl_s, "offset": prog.offset}, mutated=True, progress=gained)

    def _closed_outcome(self, job: JobState, lease: str, trainer: str) -> str | None:
        for closed in (job.closed, job.closed_prev):
            hit = closed.get(lease)
            if hit is not None:
                if hit[0] != trainer:
                    raise NotLeaseHolder(f"lease {lease} was held by another trainer, not {trainer!r}", lease=lease)
                return hit[1]
        return None

    def _complete(self, job: JobState, ev: Complete, now: float) -> Result:
        validate_lease_id(ev.lease)
        check_ident(ev.trainer, "trainer")
        if ev.lease not in job.leases:
            if self._closed_outcome(job, ev.lease, ev.trainer) == "done":
                return Result({"status": "done", "epoch": job.epoch, "already": True}, mutated=False)
        rec = self._holder(job, ev.lease, ev.trainer, now)
        # -- mutation --
        job.expire(now)
        del job.leases[rec.id]
        prog = job.progress[rec.shard]
        samples = job.spec.shards[rec.shard].samples
        gained = max(0, samples - prog.offset) if samples is not None else 0
        epoch = job.epoch
        job.done.add(rec.shard)
        job.closed[rec.id] = (ev.trainer, "done")
        job.totals["completed"] += 1
        job.maybe_advance()
        return Result({"status": "done", "epoch": epoch, "already": False}, mutated=True, progress=gained)

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
        del job.leases[rec.id]
        prog = job.progress[rec.shard]
        prog.failures += 1
        prog.last_error = ev.error[:_MAX_ERROR_TEXT]
        prog.last_failed_by = ev.trainer
        job.totals["failures"] += 1
        if prog.failures >= job.spec.max_failures:
            job.failed.add(rec.shard)
            outcome = "failed"
        else:
            job.requeue.append(rec.shard)
            outcome = "todo"
        job.closed[rec.id] = (ev.trainer, outcome)
        job.maybe_advance()
        return Result({"shard_state": outcome, "already": False}, mutated=True)

    def _release(self, job: JobState, ev: Release, now: float) -> Result:
        validate_lease_id(ev.lease)
        check_ident(ev.trainer, "trainer")
        check_int(ev.offset, "offset")
        if ev.lease not in job.leases and self._closed_outcome(job, ev.lease, ev.trainer) == "released":
            return Result({"shard_state": "todo", "already": True}, mutated=False)
        rec = self._holder(job, ev.lease, ev.trainer, now)
        samples = job.spec.shards[rec.shard].samples
        if samples is not None and ev.offset > samples:
            raise BadRequest(f"offset {ev.offset} is past the end of shard {rec.shard} ({samples} samples)")
        # -- mutation --
        job.expire(now)
        del job.leases[rec.id]
        prog = job.progress[rec.shard]
        gained = max(0, ev.offset - prog.offset)
        prog.offset = max(prog.offset, ev.offset)
        job.requeue.append(rec.shard)
        job.closed[rec.id] = (ev.trainer, "released")
        job.totals["released"] += 1
        return Result({"shard_state": "todo", "offset": prog.offset, "already": False}, mutated=True, progress=gained)

    # -- read-only views --

    def status(self, name: str, now: float) -> dict[str, Any]:
        job = self.job(name)
        trainers: dict[str, int] = {}
        for rec in job.leases.values():
            if rec.expires_at > now:
                trainers[rec.trainer] = trainers.get(rec.trainer, 0) + 1
        return {
            "name": name,
            "dataset": job.spec.dataset,
            "epoch": job.epoch,
            "epochs": job.spec.epochs,
            "finished": job.finished,
            "shards": job.counts(now),
            "failed_shards": job.failed_list(),
            "failed_previous_epoch": job.prev_failed,
            "leases_by_trainer": trainers,
            "totals": dict(job.totals),
            "spec": job.spec.summary(),
        }

    def to_json(self) -> dict[str, Any]:
        return {"version": 1, "last_now": self.last_now, "jobs": [job.to_json() for job in self.jobs.values()]}

    def snapshot_text(self) -> str:
        """``to_json()`` as JSON text, spliced from each spec's cached text: the only part that
        grows with the shard count is then the per-epoch progress, not the shard list."""
        jobs = []
        for job in self.jobs.values():
            rest = json.dumps(job.to_json(with_spec=False), separators=(",", ":"))
            jobs.append('{"spec":' + job.spec.json_text + "," + rest[1:])
        return '{"version":1,"last_now":' + json.dumps(self.last_now) + ',"jobs":[' + ",".join(jobs) + "]}"

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> MasterState:
        if raw.get("version") != 1:
            raise ValueError(f"unsupported master state version {raw.get('version')!r}")
        state = cls()
        state.last_now = float(raw["last_now"])
        for item in raw["jobs"]:
            job = JobState.from_json(item)
            state.jobs[job.spec.name] = job
        return state


def _lease_status(status: str, epoch: int, retry_after_s: float | None = None) -> dict[str, Any]:
    return {"status": status, "epoch": epoch, "leases": [], "retry_after_s": retry_after_s}
