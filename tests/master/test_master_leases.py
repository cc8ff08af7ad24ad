"""The lease state machine against an independent model, driven by hypothesis with an injected
clock: random sequences of lease / renew / complete / fail / release / time passing / master
restarts, cluster ring changes.

The model is a second, naive implementation of the rules in docs/master-api.md; every answer
of the real machine is checked against it, so exactly-once is checked at every step: a
completion is accepted only for a lease the model holds valid (so at most once per shard and
epoch), a shard is handed out only while no valid lease holds it and it is neither done nor
failed, offsets resume where the last renew left them, and the epoch advances exactly when
every shard is done or failed. The log of accepted events, replayed into a fresh machine, must
rebuild the same state (that is how the stores recover), as must a snapshot round trip.

Jobs draw a ``locality_window`` (0: the plain order; >0: cache-aware leases) and trainers sit on
nodes of a ring that changes (Placement events), while node daemons report what they cache (full
or delta Holdings events, from any node, naming shards or nothing): exactly-once must hold with
any window, the order may move by less than the window, and a master that never restarted must
choose exactly as one rebuilt from snapshots (the window's index is derived state, rebuilt on
restore).
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from loader.master.errors import BadRequest, JobConflict, LeaseLost, MasterError, NoSuchJob, NotLeaseHolder
from loader.master.server.events import (
    Complete,
    CreateJob,
    Event,
    Fail,
    Holdings,
    Lease,
    Placement,
    Release,
    Renew,
    Resume,
)
from loader.master.server.spec import JobSpec, ShardSpec
from loader.master.server.state import MAX_COUNT, MAX_OPEN_EPOCHS, OPEN_SLACK, MasterState
from wire.nodeplan import name_hash

TRAINERS = ("t0", "t1", "t2")
NODE_OF = {"t0": "n0", "t1": "n1", "t2": "n0"}
MEMBERS = (("http://m0:8600", "n0"), ("http://m1:8600", "n1"), ("http://m2:8600", ""), ("http://m3:8600", "n2"))
FAKE = "unknownLease0"
JOB = "job"


@dataclass
class EpochModel:
    done: set[int] = field(default_factory=set)
    failed: set[int] = field(default_factory=set)
    failures: Counter[int] = field(default_factory=Counter)
    offsets: dict[int, int] = field(default_factory=dict)


class LeaseMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.state = MasterState()
        self.now = 1000.0
        self.ids = 0
        self.base: dict[str, Any] | None = None
        self.log: list[tuple[Event, float]] = []
        self.all_log: list[tuple[Event, float]] = []
        """Every accepted event since the start: replayed into a master that never restarted."""

    # -- setup --

    @initialize(
        n=st.integers(min_value=1, max_value=7),
        epochs=st.one_of(st.none(), st.integers(min_value=1, max_value=3)),
        max_failures=st.integers(min_value=1, max_value=3),
        samples=st.one_of(st.none(), st.integers(min_value=0, max_value=20)),
        shuffle=st.booleans(),
        seed=st.integers(min_value=0, max_value=1000),
        window=st.sampled_from([0, 0, 1, 2, 3, 8]),
    )
    def create(self, n: int, epochs: int | None, max_failures: int, samples: int | None, shuffle: bool, seed: int,
               window: int) -> None:
        self.n, self.epochs, self.max_failures, self.samples = n, epochs, max_failures, samples
        self.ttl = 10.0
        self.window = window
        spec = JobSpec(JOB, "s3://b/p/", tuple(ShardSpec(f"k{i}", 1, samples) for i in range(n)), epochs, seed, shuffle,
                       self.ttl, max_failures, window)
        self.spec = spec
        self.apply_ok(CreateJob(spec))
        # The model: every open epoch's own done / failed / failures / offsets.
        self.open: dict[int, EpochModel] = {0: EpochModel()}
        self.next_epoch = 1
        self.finished = False
        self.recent: list[EpochModel] = []  # completed epochs, newest first
        self.live: dict[str, list[Any]] = {}  # lease -> [trainer, shard, expires_at, epoch]
        self.closed: dict[str, tuple[str, str]] = {}  # lease -> (trainer, outcome)
        self.completions: Counter[tuple[int, int]] = Counter()
        self.last_mut = self.now
        self.last_request: dict[tuple[str, str], tuple[str, list[str]]] = {}

    # -- helpers --

    @property
    def epoch(self) -> int:
        return min(self.open) if self.open else self.next_epoch

    def apply_ok(self, event: Event) -> dict[str, Any]:
        result = self.state.apply(event, self.now)
        if result.mutated:
            assert result.record is not None
            self.log.append((result.record, result.now))
            self.all_log.append((result.record, result.now))
        return result.answer

    def apply(self, event: Event) -> tuple[dict[str, Any] | None, MasterError | None, bool]:
        try:
            result = self.state.apply(event, self.now)
        except MasterError as exc:
            return None, exc, False
        if result.mutated:
            assert result.record is not None
            self.log.append((result.record, result.now))
            self.all_log.append((result.record, result.now))
            self.last_mut = result.now
        return result.answer, None, result.mutated

    def valid(self, lease: str) -> bool:
        return lease in self.live and self.live[lease][2] > self.now

    def available(self, epoch: int) -> set[int]:
        ep = self.open[epoch]
        held = {self.live[lid][1] for lid in self.live if self.valid(lid) and self.live[lid][3] == epoch}
        return set(range(self.n)) - ep.done - ep.failed - held

    def can_open(self, granting: int = 0) -> bool:
        held = sum(1 for lid in self.live if self.valid(lid)) + granting
        return len(self.open) < MAX_OPEN_EPOCHS and held < max(self.n, OPEN_SLACK) and (self.epochs is None or self.next_epoch < self.epochs)

    def open_next(self) -> int:
        self.open[self.next_epoch] = EpochModel()
        self.next_epoch += 1
        return self.next_epoch - 1

    def new_ids(self, count: int) -> tuple[str, ...]:
        out = []
        for _ in range(count):
            self.ids += 1
            out.append(f"L{self.ids:010d}")
        return tuple(out)

    def maybe_close(self, epoch: int) -> None:
        ep = self.open[epoch]
        if len(ep.done) + len(ep.failed) < self.n:
            return
        del self.open[epoch]
        self.recent.insert(0, ep)
        if self.open:
            return
        if self.epochs is not None and self.next_epoch >= self.epochs:
            self.finished = True
            self.live.clear()
            self.last_request.clear()
            return
        self.open_next()

    def pick_lease(self, data: st.DataObject) -> str:
        known = sorted(self.live) + sorted(self.closed)
        return data.draw(st.sampled_from(known + [FAKE]) if known else st.just(FAKE), label="lease")

    def pick_trainer(self, data: st.DataObject, lease: str) -> str:
        holder = self.live[lease][0] if lease in self.live else self.closed[lease][0] if lease in self.closed else "t0"
        return data.draw(st.sampled_from([holder, holder, *TRAINERS]), label="trainer")

    def holds(self, lease: str, trainer: str, err: MasterError | None) -> bool:
        """For a lease the model has live: a trainer that does not hold it, or holds it expired,
        must have been refused (the check is made here); True when ``trainer`` validly holds it."""
        if self.live[lease][0] != trainer:
            assert isinstance(err, NotLeaseHolder) or (not self.valid(lease) and isinstance(err, LeaseLost)), err
            return False
        if not self.valid(lease):
            assert isinstance(err, LeaseLost), err
            return False
        return True

    def closed_outcome(self, lease: str, trainer: str, err: MasterError | None, outcomes: tuple[str, ...]) -> str | None:
        """For a lease the model does not have live: the machine must refuse another trainer and an
        unknown or differently closed lease; the closed outcome when it is one of ``outcomes``
        (a repeated call, answered with ``already``)."""
        closed = self.closed.get(lease)
        if closed is not None and closed[0] != trainer:
            assert isinstance(err, NotLeaseHolder), err
        elif closed is not None and closed[1] in outcomes:
            assert err is None
            return closed[1]
        else:
            assert isinstance(err, LeaseLost), err
        return None

    # -- rules --

    @rule(dt=st.sampled_from([0.0, 0.5, 3.0, 9.9, 10.0, 25.0]))
    def time_passes(self, dt: float) -> None:
        self.now += dt

    @rule(
        trainer=st.sampled_from(TRAINERS),
        count=st.integers(min_value=1, max_value=4),
        which=st.sampled_from(["none", "none", "current", "previous", "next", "newest"]),
        stream=st.sampled_from([None, "w0", "w1"]),
        retry=st.booleans(),
    )
    def lease(self, trainer: str, count: int, which: str, stream: str | None, retry: bool) -> None:
        newest = self.next_epoch - 1
        epoch = {"none": None, "current": self.epoch, "previous": self.epoch - 1, "next": self.next_epoch, "newest": newest}[which]
        if epoch is not None and epoch < 0:
            epoch = None
        self.ids += 1
        request_id = f"r{self.ids}"
        granted = self.check_lease(trainer, count, epoch, request_id, stream)
        if retry and granted:
            # The same request again (its answer was lost): the same leases, nothing new.
            again, err, mutated = self.apply(Lease(JOB, trainer, NODE_OF[trainer], count, epoch, self.new_ids(count), request_id, stream))
            assert err is None and again is not None and not mutated
            assert [g["lease"] for g in again["leases"]] == granted

    @rule(trainer=st.sampled_from(TRAINERS), count=st.integers(min_value=1, max_value=4), stream=st.sampled_from([None, "w0"]))
    def retry_last_request_later(self, trainer: str, count: int, stream: str | None) -> None:
        """A retry that arrives after time passed gets its still-valid leases, or a normal answer."""
        last = self.last_request.get((trainer, stream or ""))
        assume(last is not None)
        assert last is not None
        request_id, ids = last
        still = [lid for lid in ids if self.valid(lid) and self.live[lid][0] == trainer]
        if still:
            answer, err, mutated = self.apply(Lease(JOB, trainer, NODE_OF[trainer], count, None, self.new_ids(count), request_id, stream))
            assert err is None and answer is not None and not mutated
            assert [g["lease"] for g in answer["leases"]] == still
        else:
            self.check_lease(trainer, count, None, request_id, stream)

    def check_lease(self, trainer: str, count: int, epoch: int | None, request_id: str, stream: str | None) -> list[str]:
        event = Lease(JOB, trainer, NODE_OF[trainer], count, epoch, self.new_ids(count), request_id, stream)
        answer, err, _ = self.apply(event)
        assert err is None, err
        assert answer is not None
        if self.finished:
            assert answer["status"] == "finished"
            return []
        # What the model would hand out, epoch by epoch: the requested epoch only, or (continuous)
        # the oldest open epochs first, then newly opened ones.
        plan: list[tuple[int, int]] = []  # (epoch, how many)
        if epoch is not None:
            if epoch < self.next_epoch and epoch not in self.open:
                assert answer["status"] == "epoch_done" and answer["epoch"] == self.epoch
                return []
            if epoch >= self.next_epoch:
                assert answer["status"] == "wait" and answer["epoch"] == self.epoch
                return []
            take = min(count, len(self.available(epoch)))
            if take:
                plan.append((epoch, take))
        else:
            left = count
            for e in sorted(self.open):
                take = min(left, len(self.available(e)))
                if take:
                    plan.append((e, take))
                    left -= take
            # A new epoch opens for the next shard only while fewer leases are live than shards.
            while left and self.can_open(count - left):
                e = self.open_next()
                take = min(left, self.n)  # once open, an epoch serves until its shards run out
                plan.append((e, take))
                left -= take
        assert answer["epoch"] == self.epoch
        if not plan:
            assert answer["status"] == "wait", (answer, self.open)
            assert 0 < answer["retry_after_s"] <= 1.0
            return []
        assert answer["status"] == "ok", (answer, plan)
        granted = answer["leases"]
        assert [(e, sum(1 for g in granted if g["epoch"] == e)) for e, _ in plan] == plan, (granted, plan)
        assert len(granted) == sum(k for _, k in plan)
        assert all(g["lease"] in event.lease_ids for g in granted), "a new request must get new leases"
        for e, _ in plan:
            shards = [g["shard"] for g in granted if g["epoch"] == e]
            assert len(set(shards)) == len(shards)
            assert set(shards) <= self.available(e), "a shard was handed out while done, failed or validly leased"
        for g in granted:
            ep = self.open[g["epoch"]]
            assert g["offset"] == ep.offsets.get(g["shard"], 0), "a re-issued shard must resume at the last offset"
            assert g["key"] == f"k{g['shard']}"
            self.live[g["lease"]] = [trainer, g["shard"], self.now + self.ttl, g["epoch"]]
        ids = [g["lease"] for g in granted]
        self.last_request[(trainer, stream or "")] = (request_id, ids)
        return ids

    @rule(data=st.data())
    def complete(self, data: st.DataObject) -> None:
        lease = self.pick_lease(data)
        trainer = self.pick_trainer(data, lease)
        answer, err, _ = self.apply(Complete(JOB, lease, trainer))
        if lease in self.live:
            if self.holds(lease, trainer, err):
                _, shard, _, epoch = self.live[lease]
                ep = self.open[epoch]
                assert err is None and answer is not None and answer["already"] is False
                assert answer["epoch"] == epoch
                assert shard not in ep.done
                self.completions[(epoch, shard)] += 1
                ep.done.add(shard)
                del self.live[lease]
                self.closed[lease] = (trainer, "done")
                self.maybe_close(epoch)
        elif self.closed_outcome(lease, trainer, err, ("done",)):
            assert answer is not None and answer["already"] is True

    @rule(data=st.data())
    def fail(self, data: st.DataObject) -> None:
        lease = self.pick_lease(data)
        trainer = self.pick_trainer(data, lease)
        answer, err, _ = self.apply(Fail(JOB, lease, trainer, "boom"))
        if lease in self.live:
            if self.holds(lease, trainer, err):
                _, shard, _, epoch = self.live[lease]
                ep = self.open[epoch]
                assert err is None and answer is not None
                ep.failures[shard] += 1
                outcome = "failed" if ep.failures[shard] >= self.max_failures else "todo"
                assert answer == {"shard_state": outcome, "already": False}
                if outcome == "failed":
                    ep.failed.add(shard)
                del self.live[lease]
                self.closed[lease] = (trainer, outcome)
                self.maybe_close(epoch)
        elif (closed := self.closed_outcome(lease, trainer, err, ("todo", "failed"))) is not None:
            assert answer == {"shard_state": closed, "already": True}

    @rule(data=st.data(), offset=st.integers(min_value=-1, max_value=25), give_back=st.booleans())
    def report_offset(self, data: st.DataObject, offset: int, give_back: bool) -> None:
        """``renew`` (keep the lease another TTL) or ``release`` (give it back: the shard is free
        again at once), both with the offset reached."""
        lease = self.pick_lease(data)
        trainer = self.pick_trainer(data, lease)
        event = Release(JOB, lease, trainer, offset) if give_back else Renew(JOB, lease, trainer, offset)
        answer, err, _ = self.apply(event)
        if offset < 0:
            assert isinstance(err, BadRequest)
            return
        if lease not in self.live:
            if give_back and self.closed_outcome(lease, trainer, err, ("released",)):
                assert answer == {"shard_state": "todo", "already": True}
            elif not give_back:
                assert isinstance(err, LeaseLost), err
            return
        if not self.holds(lease, trainer, err):
            return
        _, shard, _, epoch = self.live[lease]
        if self.samples is not None and offset > self.samples:
            assert isinstance(err, BadRequest)
            return
        assert err is None and answer is not None
        offsets = self.open[epoch].offsets
        offsets[shard] = max(offsets.get(shard, 0), offset)
        if give_back:
            assert answer == {"shard_state": "todo", "offset": offsets[shard], "already": False}
            del self.live[lease]
            self.closed[lease] = (trainer, "released")
        else:
            assert answer["offset"] == offsets[shard]
            self.live[lease][2] = self.now + self.ttl

    @rule(members=st.sets(st.sampled_from(MEMBERS)))
    def ring_changes(self, members: set[tuple[str, str]]) -> None:
        """The cluster cache's membership moves: only where shards are preferred changes."""
        _, err, _ = self.apply(Placement(tuple(sorted(members))))
        assert err is None

    @rule(
        node=st.sampled_from(["n0", "n1", "n2", "n9"]),
        full=st.booleans(),
        held=st.sets(st.integers(min_value=0, max_value=9), max_size=6),
        dropped=st.sets(st.integers(min_value=0, max_value=9), max_size=4),
    )
    def node_reports(self, node: str, full: bool, held: set[int], dropped: set[int]) -> None:
        """A node's daemon reports what it caches (a full report or a delta; numbers past the
        job's shards name no shard of it): only which shard a lease prefers may change."""
        def hashes(shards: set[int]) -> tuple[int, ...]:
            return tuple(name_hash("b", f"p/k{i}") for i in sorted(shards))

        _, err, _ = self.apply(Holdings(node, full, hashes(held), () if full else hashes(dropped)))
        assert err is None, err

    @rule()
    def master_restarts(self) -> None:
        """Resume: leases expired by the last accepted event stay expired, the others get a full TTL."""
        last_accepted = self.last_mut
        _, err, _ = self.apply(Resume())
        assert err is None
        for lease, rec in list(self.live.items()):
            if rec[2] <= last_accepted:
                del self.live[lease]
            else:
                rec[2] = max(rec[2], self.now + self.ttl)

    @precondition(lambda self: len(self.log) > 0)
    @rule()
    def replay_and_snapshot(self) -> None:
        """What a store does on restart: snapshot + log replay must rebuild the very same state."""
        fresh = MasterState.from_json(self.base) if self.base is not None else MasterState()
        for event, at in self.log:
            assert fresh.apply(event, at).mutated
        assert fresh.to_json() == self.state.to_json()
        # And a master that never restarted (every window index kept up incrementally) chose
        # exactly as the restored ones did.
        never = MasterState()
        for event, at in self.all_log:
            assert never.apply(event, at).mutated
        assert never.to_json() == self.state.to_json()
        self.base = json.loads(json.dumps(fresh.to_json()))
        self.state = MasterState.from_json(self.base)
        self.log = []

    # -- invariants --

    @invariant()
    def exactly_once(self) -> None:
        assert all(count == 1 for count in self.completions.values())

    @invariant()
    def order_moves_less_than_the_window(self) -> None:
        if not hasattr(self, "n"):
            return
        locality = self.state.status(JOB, self.now)["locality"]
        if self.window == 0:
            assert locality is None
            return
        for epoch in locality["epochs"]:
            assert epoch["max_displacement"] < self.window, (epoch, self.window)
            if self.window == 1 and epoch["handed"] > 1:
                assert epoch["spearman"] == 1.0

    @invariant()
    def status_matches_model(self) -> None:
        if not hasattr(self, "n"):
            return
        status = self.state.status(JOB, self.now)
        assert status["epoch"] == self.epoch
        assert status["finished"] == self.finished
        assert [e["epoch"] for e in status["open_epochs"]] == sorted(self.open)
        if self.finished:
            last = self.recent[0]
            expected = {"total": self.n, "todo": 0, "leased": 0, "done": len(last.done), "failed": len(last.failed)}
            failed = last.failed
        else:
            ep = self.open[self.epoch]
            leased = sum(1 for lid in self.live if self.valid(lid) and self.live[lid][3] == self.epoch)
            expected = {
                "total": self.n, "done": len(ep.done), "failed": len(ep.failed), "leased": leased,
                "todo": self.n - leased - len(ep.done) - len(ep.failed),
            }
            failed = ep.failed
        assert status["shards"] == expected
        assert sorted(f["shard"] for f in status["failed_shards"]) == sorted(failed)


TestLeaseMachine = LeaseMachine.TestCase
TestLeaseMachine.settings = settings(
    max_examples=150,
    stateful_step_count=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


# -- focused examples the properties rely on ---------------------------------------------------


def spec(name: str = JOB, n: int = 3, **kw: Any) -> JobSpec:
    return JobSpec.from_json({"name": name, "dataset": "s3://b/", "shards": [f"s{i}" for i in range(n)], **kw})


def test_create_is_idempotent_and_conflicts_on_a_different_spec() -> None:
    state = MasterState()
    assert state.apply(CreateJob(spec(epochs=2)), 1.0).created
    again = state.apply(CreateJob(spec(epochs=2)), 2.0)
    assert not again.mutated and not again.created
    with pytest.raises(JobConflict) as info:
        state.apply(CreateJob(spec(epochs=3)), 3.0)
    assert info.value.details["differs"] == ["epochs"]
    with pytest.raises(NoSuchJob):
        state.apply(Lease("other", "t", "n", 1, None, ("abcdefgh1",)), 4.0)


def test_an_expired_lease_is_reissued_at_its_offset_and_its_completion_refused() -> None:
    state = MasterState()
    state.apply(CreateJob(spec(n=1, lease_ttl_s=5)), 0.0)
    first = state.apply(Lease(JOB, "a", "n", 1, 0, ("lease0001",)), 0.0).answer["leases"][0]
    state.apply(Renew(JOB, first["lease"], "a", 2), 4.0)
    # Others wait while the lease is valid, then get the shard at the reported offset.
    assert state.apply(Lease(JOB, "b", "n", 1, 0, ("lease0002",)), 8.9).answer["status"] == "wait"
    second = state.apply(Lease(JOB, "b", "n", 1, 0, ("lease0003",)), 9.0).answer["leases"][0]
    assert (second["shard"], second["offset"]) == (first["shard"], 2)
    before = state.to_json()
    with pytest.raises(LeaseLost):
        state.apply(Complete(JOB, first["lease"], "a"), 9.5)
    assert state.to_json() == before  # refused: changed nothing
    done = state.apply(Complete(JOB, second["lease"], "b"), 9.6)
    assert done.answer["epoch"] == 0
    assert state.status(JOB, 9.6)["epoch"] == 1


def test_poison_shard_is_failed_after_max_failures_and_does_not_block_the_epoch() -> None:
    state = MasterState()
    state.apply(CreateJob(spec(n=2, max_failures=2, shuffle=False, epochs=1)), 0.0)
    good, bad = state.apply(Lease(JOB, "a", "n", 2, None, ("lease0001", "lease0002")), 0.0).answer["leases"]
    state.apply(Complete(JOB, good["lease"], "a"), 1.0)
    assert state.apply(Fail(JOB, bad["lease"], "a", "corrupt tar"), 1.0).answer["shard_state"] == "todo"
    again = state.apply(Lease(JOB, "b", "n", 1, None, ("lease0003",)), 2.0).answer["leases"][0]
    assert state.apply(Fail(JOB, again["lease"], "b", "corrupt tar"), 2.0).answer["shard_state"] == "failed"
    status = state.status(JOB, 3.0)
    assert status["finished"] and status["failed_shards"] == [
        {"key": bad["key"], "shard": bad["shard"], "failures": 2, "last_error": "corrupt tar"}
    ]
    assert state.apply(Lease(JOB, "a", "n", 1, None, ("lease0004",)), 3.0).answer["status"] == "finished"


def test_trainer_is_not_handed_back_the_shard_it_just_failed_while_others_remain() -> None:
    state = MasterState()
    state.apply(CreateJob(spec(n=3, shuffle=False)), 0.0)
    first = state.apply(Lease(JOB, "a", "n", 1, None, ("lease0001",)), 0.0).answer["leases"][0]
    state.apply(Fail(JOB, first["lease"], "a", "read error"), 0.0)
    nxt = state.apply(Lease(JOB, "a", "n", 1, None, ("lease0002",)), 0.0).answer["leases"][0]
    assert nxt["shard"] != first["shard"]
    other = state.apply(Lease(JOB, "b", "n", 1, None, ("lease0003",)), 0.0).answer["leases"][0]
    assert other["shard"] == first["shard"]


def test_epoch_orders_follow_the_seeded_shuffle() -> None:
    from wire.shuffle import permutation

    state = MasterState()
    state.apply(CreateJob(spec(n=6, seed=3)), 0.0)
    for epoch in range(3):
        answer = state.apply(Lease(JOB, "a", "n", 6, None, tuple(f"lease{epoch}{i:04d}" for i in range(6))), 0.0).answer
        assert [g["shard"] for g in answer["leases"]] == permutation(6, 3, epoch)
        for g in answer["leases"]:
            state.apply(Complete(JOB, g["lease"], "a"), 0.0)


def test_a_retried_lease_request_returns_only_leases_still_valid() -> None:
    state = MasterState()
    state.apply(CreateJob(spec(n=2, lease_ttl_s=5, shuffle=False)), 0.0)
    first = state.apply(Lease(JOB, "a", "n", 1, None, ("lease0001",), "req-1"), 0.0)
    assert first.mutated
    retry = state.apply(Lease(JOB, "a", "n", 1, None, ("lease0002",), "req-1"), 1.0)
    assert not retry.mutated and retry.answer["leases"][0]["lease"] == "lease0001"
    # Once that lease expired, the same request id is a new request: it gets a lease of its own.
    late = state.apply(Lease(JOB, "a", "n", 1, None, ("lease0003",), "req-1"), 6.0)
    assert late.mutated and [g["lease"] for g in late.answer["leases"]] == ["lease0003"]


def test_a_continuous_request_opens_the_next_epoch_instead_of_waiting_for_a_blocked_trainer() -> None:
    """The DDP deadlock's shape: rank A holds the last shards of epoch 0 (blocked in a collective,
    it neither reads nor completes them); rank B, continuous, must get epoch 1's shards at once,
    while an explicit epoch-0 request still waits (the non-continuous barrier)."""
    state = MasterState()
    state.apply(CreateJob(spec(n=3, epochs=2, shuffle=False)), 0.0)
    a = state.apply(Lease(JOB, "a", "n", 3, None, ("leaseA001", "leaseA002", "leaseA003")), 0.0).answer["leases"]
    assert [g["epoch"] for g in a] == [0, 0, 0]
    assert state.apply(Lease(JOB, "b", "n", 1, 0, ("leaseB000",)), 1.0).answer["status"] == "wait"
    b = state.apply(Lease(JOB, "b", "n", 2, None, ("leaseB001", "leaseB002")), 1.0).answer
    assert b["status"] == "ok" and [g["epoch"] for g in b["leases"]] == [1, 1] and b["epoch"] == 0
    status = state.status(JOB, 1.0)
    assert [(e["epoch"], e["leased"]) for e in status["open_epochs"]] == [(0, 3), (1, 2)]
    # The last epoch is leased out: nothing beyond it opens; the job waits, then finishes.
    assert state.apply(Lease(JOB, "b", "n", 5, None, ("leaseB003", "leaseB004")), 1.0).answer["leases"][0]["epoch"] == 1
    assert state.apply(Lease(JOB, "c", "n", 1, None, ("leaseC001",)), 1.0).answer["status"] == "wait"
    for g in b["leases"] + a:
        holder = "b" if g["lease"].startswith("leaseB") else "a"
        state.apply(Complete(JOB, g["lease"], holder), 2.0)
    # Epoch 1 cannot complete before its last shard; epoch 0 completing first keeps epoch 1 current.
    assert state.status(JOB, 2.0)["epoch"] == 1
    state.apply(Complete(JOB, "leaseB003", "b"), 3.0)
    assert state.status(JOB, 3.0)["finished"]
    assert state.status(JOB, 3.0)["totals"]["completed"] == 6


def test_a_stream_leases_for_its_trainer_and_the_trainer_completes_it() -> None:
    state = MasterState()
    state.apply(CreateJob(spec(n=2)), 0.0)
    got = state.apply(Lease(JOB, "rank0", "n", 1, None, ("leaseW001",), "r1", "w0"), 0.0).answer["leases"][0]
    status = state.status(JOB, 0.0)
    assert status["leases_by_trainer"] == {"rank0": {"w0": 1}}
    state.apply(Renew(JOB, got["lease"], "rank0", 0), 1.0)
    assert state.apply(Complete(JOB, got["lease"], "rank0"), 1.0).answer["already"] is False
    with pytest.raises(NotLeaseHolder):
        state.apply(Complete(JOB, got["lease"], "rank1"), 1.0)
    # Each stream's retried request is its own.
    again = state.apply(Lease(JOB, "rank0", "n", 1, None, ("leaseW002",), "r1", "w1"), 2.0)
    assert again.mutated and again.answer["leases"][0]["lease"] == "leaseW002"


def test_a_version_1_snapshot_loads_as_one_open_epoch() -> None:
    """A master upgraded over state written before epochs could overlap keeps every lease,
    offset, completion and failure."""
    v1 = {
        "version": 1, "last_now": 10.0,
        "jobs": [{
            "spec": spec(n=4, epochs=3, lease_ttl_s=30).to_json(), "epoch": 1, "finished": False, "cursor": 3,
            "leases": [["leaseOld01", 2, "t1", "n1", 35.0]],
            "progress": [[2, 5, 0, None, None], [1, 0, 1, "boom", "t2"], [0, 0, 0, None, None]],
            "requeue": [1], "done": [0], "failed": [], "closed": [["leaseOld00", "t1", "done"]],
            "closed_prev": [], "last_request": [["t1", "rid", ["leaseOld01"]]],
            "prev_failed": [], "totals": {"leased": 7, "reissued": 1, "completed": 5, "expired": 0, "released": 0, "failures": 1, "epochs": 1},
        }],
    }
    state = MasterState.from_json(v1)
    status = state.status(JOB, 11.0)
    assert status["epoch"] == 1 and status["shards"] == {"total": 4, "todo": 2, "leased": 1, "done": 1, "failed": 0}
    assert state.apply(Renew(JOB, "leaseOld01", "t1", 6), 11.0).answer["offset"] == 6
    nxt = state.apply(Lease(JOB, "t2", "n", 1, 1, ("leaseNew01",)), 11.0).answer["leases"][0]
    assert nxt["shard"] != 1  # t2 just failed shard 1: another first
    assert state.apply(Complete(JOB, "leaseOld00", "t1"), 11.0).answer["already"] is True
    assert MasterState.from_json(json.loads(json.dumps(state.to_json()))).to_json() == state.to_json()


def test_leasing_without_reading_cannot_open_epoch_after_epoch() -> None:
    """Live leases are bounded by the shard count: once every shard of a big job is leased, a
    continuous request waits instead of opening the next epoch (memory stays bounded)."""
    n = OPEN_SLACK + 10
    state = MasterState()
    state.apply(CreateJob(spec(n=n)), 0.0)
    granted, i = 0, 0
    while granted < n:
        ids = tuple(f"lease{i + j:06d}" for j in range(MAX_COUNT))
        i += MAX_COUNT
        answer = state.apply(Lease(JOB, "hog", "n", MAX_COUNT, None, ids), 1.0).answer
        assert {g["epoch"] for g in answer["leases"]} == {0}
        granted += len(answer["leases"])
    assert state.apply(Lease(JOB, "hog", "n", 1, None, ("leaseMore01",)), 1.0).answer["status"] == "wait"
    assert [e["epoch"] for e in state.status(JOB, 1.0)["open_epochs"]] == [0]
