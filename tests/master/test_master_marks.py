"""Checkpoint marks on the lease master (``loader/master/server/marks.py`` and the ``_mark`` /
``_rewind`` handlers of ``state.py``): the guarantee, the refusals, the bounds, the HTTP routes.

The guarantee, checked by a model driven by hypothesis straight against ``MasterState`` (an
injected clock): lock-step trainers each receive one sample a step from their current lease
(leasing when they hold none, sometimes prefetching more, renewing their position with the common
clock at random steps, sometimes late with an older position and its older clock, releasing now
and then, completing at the last sample); checkpoints at random steps (every trainer reports its
positions at the checkpoint's clock, or only one does); crashes at random steps (every trainer of
the attempt vanishes; a new attempt with new trainer ids rewinds to the latest kept mark, or an
older kept one, or to mark 0, the job's beginning, and its clock restarts at the mark's; one or
more of its ranks rewind, the later ones finding nothing to undo); the master restarting from its
snapshot now and then. The samples a model trained on are those
the loops received up to each checkpoint the next attempt resumed from (following the chain of
resumed checkpoints back from the final attempt), plus everything the final attempt received:

- every trainer reporting at each mark: every (epoch, shard, sample) exactly once;
- one trainer reporting: at least once, and a sample more than once only for a sample a
  non-reporting trainer had received by the mark but not reported (by a renew, release or
  complete stamped with a clock up to the mark's).

After every event that changed the state, a snapshot round trip and a replica fed the logged
events (JSON round-tripped, at the logged times: what the journal replays) must give the same
``to_json()``; at the end a fresh replay of the whole log must too. A refused event must change
nothing; the leases of a vanished attempt are refused saying the job was rewound.

Two bugs these found are pinned by tests: a rewind that handed out again an epoch closed before
the mark (reached by the model only where epochs overlap most:
``test_resumed_attempts_at_epoch_boundaries_...``, and by a minimal example), and a NaN
``job_created`` that passed the creation check.
"""

from __future__ import annotations

import json
import random
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loader.master.errors import BadRequest, CheckpointGone, LeaseLost, MasterError
from loader.master.server import marks as marks_mod
from loader.master.server.events import (
    Complete,
    CreateJob,
    DeleteJob,
    Event,
    Fail,
    Lease,
    Mark,
    Release,
    Renew,
    Resume,
    Rewind,
    event_from_json,
    event_to_json,
)
from loader.master.server.marks import MAX_MARKS, RETAIN_S
from loader.master.server.spec import JobSpec, ShardSpec
from loader.master.server.state import MasterState
from tests.support.masters import MasterProcess, http, job_spec
from tests.support.threads import MasterThread

JOB = "job"
T0 = 1000.0
TTL = 3600.0
DT = 30.0
"""Seconds a lock-step step takes: RETAIN_S (300 s) is ten steps, so history is trimmed within a run."""
MAX_STEPS = 3000


def make_spec(samples: list[int], epochs: int | None = 1, *, seed: int = 0, shuffle: bool = False,
              name: str = JOB) -> JobSpec:
    shards = tuple(ShardSpec(f"k{i:03d}", 100, s) for i, s in enumerate(samples))
    return JobSpec(name, "s3://b/p/", shards, epochs, seed, shuffle, TTL, 3, 0)


# -- the model ---------------------------------------------------------------------------------


@dataclass
class Held:
    lease: str
    epoch: int
    shard: int
    samples: int
    offset: int
    """Received up to here: the next sample the loop receives."""
    trail: list[tuple[int, int]] = field(default_factory=list)
    """(offset, clock) after each sample received from this lease: a late renew sends one."""
    renewed: int = 0


@dataclass
class TrainerModel:
    name: str
    epoch: int = 0
    """Explicit epochs: the epoch it asks for."""
    held: list[Held] = field(default_factory=list)
    finished: bool = False


@dataclass
class Attempt:
    index: int
    start: int
    """The clock it started at (the clock of the mark it resumed from; 0 for the first)."""
    parent: int | None
    """The mark id it resumed from (None: the job's beginning)."""
    trainers: list[TrainerModel]
    received: list[tuple[int, int, int, int, str]] = field(default_factory=list)
    """(epoch, shard, sample, clock, trainer) for every sample a loop received."""
    reports: dict[tuple[int, int], list[tuple[int, int]]] = field(default_factory=dict)
    """(epoch, shard) -> (offset, clock) of every delivery reported that advanced the shard."""


@dataclass
class MarkModel:
    id: int
    clock: int
    attempt: int
    reporters: set[str] = field(default_factory=set)
    calls: int = 0


@dataclass(frozen=True)
class Config:
    samples: tuple[int, ...]
    epochs: int
    continuous: bool
    trainers: int
    all_report: bool
    prefetch: int
    shuffle: bool
    seed: int
    p_checkpoint: float
    p_crash: float
    p_renew: float
    p_stale: float
    p_release: float
    p_older: float
    p_restart: float
    max_crashes: int
    rng_seed: int
    check_each_event: bool = True
    """Compare the replica and a snapshot round trip after every change (else at the end only)."""


class MarksRun:
    """One job trained by attempts of lock-step trainers, with checkpoints and crashes."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.rng = random.Random(cfg.rng_seed)
        self.state = MasterState()
        self.replica = MasterState()
        self.log: list[tuple[dict[str, Any], float]] = []
        self.now = T0
        self.clock = 0
        self.ids = 0
        self.marks: dict[int, MarkModel] = {}  # kept marks, oldest first
        self.made: dict[int, MarkModel] = {}  # every mark ever made
        self.crashes = 0
        self.from_beginning = 0
        """Rewinds to mark 0 (the job's beginning)."""
        self.created = 0.0
        self.apply(CreateJob(make_spec(list(cfg.samples), cfg.epochs, seed=cfg.seed, shuffle=cfg.shuffle)))
        self.created = self.state.jobs[JOB].created_at
        assert self.created == T0
        self.attempts = [Attempt(0, 0, None, self.new_trainers(0, 0))]

    @property
    def attempt(self) -> Attempt:
        return self.attempts[-1]

    # -- the master, and its durability checked after every change --

    def apply(self, event: Event) -> dict[str, Any]:
        result = self.state.apply(event, self.now)
        if result.mutated:
            assert result.record is not None
            raw = event_to_json(result.record)
            self.log.append((raw, result.now))
            assert self.replica.apply(event_from_json(json.loads(json.dumps(raw))), result.now).mutated
            if not self.cfg.check_each_event:
                return result.answer
            expected = self.state.to_json()
            assert self.replica.to_json() == expected, f"the journal's replay differs after {raw}"
            restored = MasterState.from_text(self.state.snapshot_text())
            assert restored.to_json() == expected, f"the snapshot round trip differs after {raw}"
        return result.answer

    def refused(self, event: Event) -> MasterError:
        before = self.state.to_json()
        with pytest.raises(MasterError) as info:
            self.state.apply(event, self.now)
        assert self.state.to_json() == before, "a refused event changed the state"
        return info.value

    def restart(self) -> None:
        """The master restarts from its snapshot (and takes the state over: Resume)."""
        self.state = MasterState.from_text(self.state.snapshot_text())
        if self.rng.random() < 0.5:
            self.apply(Resume())

    def new_ids(self, count: int) -> tuple[str, ...]:
        first, self.ids = self.ids + 1, self.ids + count
        return tuple(f"L{i:010d}" for i in range(first, self.ids + 1))

    def new_trainers(self, attempt: int, epoch: int) -> list[TrainerModel]:
        return [TrainerModel(f"a{attempt}t{i}", epoch) for i in range(self.cfg.trainers)]

    def report(self, held: Held, offset: int, clock: int) -> None:
        """A delivery the master accepted. One that does not advance the shard (a late renew
        that arrives after a newer one) changes nothing there, so it covers nothing."""
        reports = self.attempt.reports.setdefault((held.epoch, held.shard), [])
        if not reports or offset > reports[-1][0]:
            reports.append((offset, clock))

    # -- a trainer's step --

    def top_up(self, t: TrainerModel) -> None:
        cfg = self.cfg
        if t.held:
            if len(t.held) >= cfg.prefetch or self.rng.random() > 0.8:
                return
            want = self.rng.randint(1, cfg.prefetch - len(t.held))
        else:
            want = cfg.prefetch if self.rng.random() < 0.5 else self.rng.randint(1, cfg.prefetch)
        for _ in range(cfg.epochs + 2):
            epoch = None if cfg.continuous else t.epoch
            answer = self.apply(Lease(JOB, t.name, "n0", want, epoch, self.new_ids(want)))
            status = answer["status"]
            if status == "ok":
                for grant in answer["leases"]:
                    if epoch is not None:
                        assert grant["epoch"] == epoch
                    assert 0 <= grant["offset"] < grant["samples"], grant
                    t.held.append(Held(grant["lease"], grant["epoch"], grant["shard"], grant["samples"], grant["offset"],
                                       renewed=self.clock))
                return
            if status == "finished":
                t.finished = not t.held
                return
            if status == "wait":
                return
            assert status == "epoch_done" and not cfg.continuous, answer
            t.epoch += 1
        raise AssertionError(f"{t.name} found no epoch to ask for")

    def receive(self, t: TrainerModel) -> None:
        if not t.held:
            return
        held = t.held[0]
        self.attempt.received.append((held.epoch, held.shard, held.offset, self.clock, t.name))
        held.offset += 1
        held.trail.append((held.offset, self.clock))
        if held.offset == held.samples:
            answer = self.apply(Complete(JOB, held.lease, t.name, self.clock))
            assert answer["already"] is False and answer["epoch"] == held.epoch
            self.report(held, held.samples, self.clock)
            t.held.pop(0)

    def renew(self, t: TrainerModel) -> None:
        for held in t.held:
            if self.rng.random() >= self.cfg.p_renew and self.clock - held.renewed < 40:
                continue
            offset, clock = held.offset, self.clock
            if held.trail and self.rng.random() < self.cfg.p_stale:
                # Late: the position and clock of an earlier step (the renewer's last look).
                offset, clock = held.trail[self.rng.randrange(len(held.trail))]
            answer = self.apply(Renew(JOB, held.lease, t.name, offset, clock))
            assert offset <= answer["offset"] <= held.offset
            self.report(held, offset, clock)
            held.renewed = self.clock

    def release(self, t: TrainerModel) -> None:
        if not t.held or self.rng.random() >= self.cfg.p_release:
            return
        held = t.held.pop(self.rng.randrange(len(t.held)))
        answer = self.apply(Release(JOB, held.lease, t.name, held.offset, self.clock))
        assert answer["shard_state"] == "todo" and answer["offset"] == held.offset
        self.report(held, held.offset, self.clock)

    # -- checkpoints and crashes --

    def checkpoint(self) -> None:
        trainers = self.attempt.trainers
        reporters = trainers if self.cfg.all_report else [self.rng.choice(trainers)]
        for t in reporters:
            positions = tuple((h.lease, h.offset) for h in t.held)
            answer = self.apply(Mark(JOB, t.name, self.clock, positions))
            assert answer["lost"] == [] and answer["clock"] == self.clock and answer["job_created"] == self.created
            for held in t.held:
                self.report(held, held.offset, self.clock)
            mid = answer["mark"]
            rec = self.marks.get(mid)
            if rec is None:
                assert mid not in self.made, f"mark id {mid} handed out twice"
                assert mid == max(self.made, default=0) + 1
                assert all(m.clock < self.clock for m in self.marks.values())
                rec = self.marks[mid] = self.made[mid] = MarkModel(mid, self.clock, self.attempt.index)
                while len(self.marks) > MAX_MARKS:
                    del self.marks[next(iter(self.marks))]
            assert rec.clock == self.clock
            rec.reporters.add(t.name)
            rec.calls += 1
            assert answer["trainers"] == rec.calls
        self.check_marks()

    def check_marks(self) -> None:
        assert list(self.state.jobs[JOB].marks.marks) == list(self.marks)
        report = self.state.status(JOB, self.now)["checkpoints"]
        assert report["marks"] == len(self.marks) and report["oldest"] == next(iter(self.marks), None)
        last = next(reversed(self.marks.values()), None)
        assert (report["last"] or {}).get("mark") == (last.id if last else None)

    def crash(self) -> None:
        """Every trainer of the attempt vanishes; a new one resumes from a kept mark (the latest
        or an older one), or from mark 0, the job's beginning (a state saved before its loop
        received anything, or none kept)."""
        self.crashes += 1
        old = [(t.name, h) for t in self.attempt.trainers for h in t.held]
        ids = list(self.marks)
        if not ids or self.rng.random() < 0.05:
            mid, clock = 0, 0
        else:
            mid = ids[-1] if len(ids) == 1 or self.rng.random() >= self.cfg.p_older else self.rng.choice(ids[:-1])
            clock = self.marks[mid].clock
        index = len(self.attempts)
        trainers = self.new_trainers(index, 0)
        answer: dict[str, Any] = {}
        for i, t in enumerate(trainers):
            if i and self.rng.random() < 0.5:
                continue
            # Every rank may load the state: the second load, nobody having read since, is a no-op.
            answer = self.apply(Rewind(JOB, t.name, mid, clock, self.created if mid else None))
            assert answer["mark"] == mid and answer["clock"] == clock
            if i:
                assert answer["revoked"] == 0 and answer["undone"] == 0
        assert answer["finished"] == self.state.jobs[JOB].finished
        for t in trainers:
            t.epoch = answer["epoch"]
        if mid == 0:
            assert answer["epoch"] == 0 and not answer["finished"]
            self.from_beginning += 1
            dropped = list(self.marks)
            self.marks.clear()
            if dropped:
                err = self.refused(Rewind(JOB, "late", dropped[-1], self.made[dropped[-1]].clock, self.created))
                assert isinstance(err, CheckpointGone) and "restarted from its beginning" in str(err), err
        for m in [m for m, rec in self.marks.items() if rec.clock > clock]:
            del self.marks[m]
        self.check_marks()
        if old:
            name, held = self.rng.choice(old)
            event: Event = (Renew(JOB, held.lease, name, held.offset, self.clock) if self.rng.random() < 0.5
                            else Complete(JOB, held.lease, name, self.clock))
            err = self.refused(event)
            assert isinstance(err, LeaseLost) and "rewind" in str(err), err
        self.clock = clock
        self.attempts.append(Attempt(index, clock, mid or None, trainers))

    # -- the run --

    def can_crash(self) -> bool:
        return self.crashes < self.cfg.max_crashes

    def run(self) -> None:
        cfg, rng = self.cfg, self.rng
        for _ in range(MAX_STEPS):
            trainers = self.attempt.trainers
            if all(t.finished for t in trainers):
                assert self.state.jobs[JOB].finished
                if self.can_crash() and rng.random() < 0.3:  # died before its last checkpoint was written
                    self.crash()
                    continue
                return
            self.clock += 1
            self.now += DT
            for t in rng.sample(trainers, len(trainers)):
                if t.finished:
                    continue
                self.top_up(t)
                self.receive(t)
                self.renew(t)
                self.release(t)
            if rng.random() < cfg.p_checkpoint:
                self.checkpoint()
            if rng.random() < cfg.p_restart:
                self.restart()
            if self.can_crash() and rng.random() < cfg.p_crash:
                self.crash()
        raise AssertionError(f"the job did not finish in {MAX_STEPS} steps: {self.state.status(JOB, self.now)}")

    # -- the verdict --

    def trained(self) -> tuple[Counter[tuple[int, int, int]], Counter[tuple[int, int, int]]]:
        """What the final model trained on (sample -> times), and per sample how many times it
        may be there more than once (received by the mark, not reported by its clock)."""
        trained: Counter[tuple[int, int, int]] = Counter()
        slack: Counter[tuple[int, int, int]] = Counter()
        att = self.attempt
        for epoch, shard, sample, _, _ in att.received:
            trained[(epoch, shard, sample)] += 1
        while att.parent is not None:
            mark = self.made[att.parent]
            att = self.attempts[mark.attempt]
            for epoch, shard, sample, clock, trainer in att.received:
                if clock > mark.clock:
                    continue
                key = (epoch, shard, sample)
                trained[key] += 1
                reported = any(o > sample and c <= mark.clock for o, c in att.reports.get((epoch, shard), ()))
                if not reported:
                    assert trainer not in mark.reporters, "a reporting trainer's position was not in its mark"
                    slack[key] += 1
        return trained, slack

    def verdict(self) -> None:
        cfg = self.cfg
        trained, slack = self.trained()
        universe = {(e, s, i) for e in range(cfg.epochs) for s, n in enumerate(cfg.samples) for i in range(n)}
        missing = sorted(universe - set(trained))
        assert not missing, f"samples never trained on (epoch, shard, sample): {missing[:10]}"
        assert set(trained) <= universe
        if cfg.all_report:
            assert not slack
        over = {k: c for k, c in trained.items() if c > 1 + slack[k]}
        assert not over, f"trained more often than the unreported deliveries allow (sample: times): {dict(list(over.items())[:10])}"
        # The journal, replayed whole into a fresh master, rebuilds the very same state.
        assert self.replica.to_json() == self.state.to_json()
        assert MasterState.from_text(self.state.snapshot_text()).to_json() == self.state.to_json()
        fresh = MasterState()
        for raw, at in self.log:
            assert fresh.apply(event_from_json(raw), at).mutated
        assert fresh.to_json() == self.state.to_json()
        status = self.state.status(JOB, self.now)
        assert status["finished"] and status["epoch"] == cfg.epochs
        if not self.from_beginning:  # a restart from the beginning leaves the count of closed epochs as it was
            assert status["totals"]["epochs"] == cfg.epochs, status["totals"]


@st.composite
def configs(draw: st.DrawFn, all_report: bool) -> Config:
    n = draw(st.integers(1, 6), label="shards")
    return Config(
        samples=tuple(draw(st.lists(st.integers(2, 5), min_size=n, max_size=n), label="samples")),
        epochs=draw(st.integers(1, 3), label="epochs"),
        continuous=draw(st.booleans(), label="continuous"),
        trainers=draw(st.integers(1, 3), label="trainers"),
        all_report=all_report,
        prefetch=draw(st.integers(1, 4), label="prefetch"),
        shuffle=draw(st.booleans(), label="shuffle"),
        seed=draw(st.integers(0, 50), label="seed"),
        p_checkpoint=draw(st.sampled_from([0.05, 0.15, 0.3]), label="p_checkpoint"),
        p_crash=draw(st.sampled_from([0.02, 0.05, 0.1, 0.3]), label="p_crash"),
        p_renew=draw(st.sampled_from([0.1, 0.3, 0.6]), label="p_renew"),
        p_stale=draw(st.sampled_from([0.0, 0.3]), label="p_stale"),
        p_release=draw(st.sampled_from([0.0, 0.03]), label="p_release"),
        p_older=draw(st.sampled_from([0.0, 0.3, 0.7]), label="p_older"),
        p_restart=draw(st.sampled_from([0.0, 0.05]), label="p_restart"),
        max_crashes=draw(st.integers(0, 6), label="max_crashes"),
        rng_seed=draw(st.integers(0, 2**32 - 1), label="rng_seed"),
    )


def epoch_boundary_config(seed: int) -> Config:
    """Where epochs overlap most: few short shards, three epochs, three continuous trainers that
    prefetch four leases (a trainer's queue holds the end of one epoch and the next whole while
    the others read the one after), checkpoints and crashes often, rewinds to older marks."""
    rng = random.Random(seed)
    return Config(
        samples=tuple(rng.randint(1, 5) for _ in range(rng.randint(1, 3))),
        epochs=3, continuous=True, trainers=3, all_report=True, prefetch=4,
        shuffle=rng.random() < 0.5, seed=rng.randint(0, 50),
        p_checkpoint=0.3, p_crash=0.3, p_renew=rng.choice([0.1, 0.3, 0.6]), p_stale=0.0, p_release=0.0,
        p_older=rng.choice([0.3, 0.7]), p_restart=0.0, max_crashes=8, rng_seed=rng.getrandbits(32),
        check_each_event=False,  # the other variants do; many runs here, cheaply
    )


EPOCH_BOUNDARY_RUNS = 300
MODEL_SETTINGS = settings(max_examples=100, deadline=None, database=None,
                          suppress_health_check=[HealthCheck.too_slow])


@pytest.mark.parametrize("all_report", [True, False], ids=["every-trainer-reports", "one-trainer-reports"])
@pytest.mark.slow
def test_resumed_attempts_train_every_sample_once_or_at_least_once(all_report: bool) -> None:
    @MODEL_SETTINGS
    @given(cfg=configs(all_report))
    def check(cfg: Config) -> None:
        run = MarksRun(cfg)
        run.run()
        run.verdict()

    check()


@pytest.mark.slow
def test_resumed_attempts_at_epoch_boundaries_train_every_sample_once() -> None:
    """Many short runs of fixed seeds (not hypothesis: the same runs whatever its version)."""
    for seed in range(EPOCH_BOUNDARY_RUNS):
        cfg = epoch_boundary_config(seed)
        try:
            run = MarksRun(cfg)
            run.run()
            run.verdict()
        except AssertionError as exc:
            raise AssertionError(f"seed {seed}: {cfg}") from exc


# -- focused examples ------------------------------------------------------------------------------


class Master:
    """A MasterState with a clock, for the examples."""

    def __init__(self, samples: list[int], epochs: int | None = 1, **kw: Any) -> None:
        self.state = MasterState()
        self.now = T0
        self.ids = 0
        self.state.apply(CreateJob(make_spec(samples, epochs, **kw)), self.now)

    @property
    def job(self) -> Any:
        return self.state.jobs[JOB]

    def apply(self, event: Event, dt: float = 1.0) -> dict[str, Any]:
        self.now += dt
        return self.state.apply(event, self.now).answer

    def lease(self, trainer: str, count: int = 1, epoch: int | None = None) -> list[dict[str, Any]]:
        ids = []
        for _ in range(count):
            self.ids += 1
            ids.append(f"L{self.ids:010d}")
        answer = self.apply(Lease(JOB, trainer, "n", count, epoch, tuple(ids)))
        return list(answer["leases"])

    def mark(self, trainer: str, clock: int, *positions: tuple[str, int]) -> dict[str, Any]:
        return self.apply(Mark(JOB, trainer, clock, tuple(positions)))

    def rewind(self, mark: dict[str, Any], trainer: str = "r0") -> dict[str, Any]:
        return self.apply(Rewind(JOB, trainer, mark["mark"], mark["clock"], mark["job_created"]))

    def handed(self, trainer: str = "next") -> list[tuple[int, int, int]]:
        """Everything the master hands out now, (epoch, shard, offset), one lease at a time, completed."""
        out: list[tuple[int, int, int]] = []
        for _ in range(1000):
            got = self.lease(trainer)
            if not got:
                return out
            g = got[0]
            out.append((g["epoch"], g["shard"], g["offset"]))
            self.apply(Complete(JOB, g["lease"], trainer))
        raise AssertionError("the job never ran out")


def without_rewinds(state: MasterState) -> dict[str, Any]:
    """The state, less what a rewind with nothing to undo still moves: the time and the count."""
    raw = state.to_json()
    raw.pop("last_now")
    for job in raw["jobs"]:
        job["totals"].pop("rewinds", None)
    return raw


def test_a_rewind_undoes_what_came_after_the_mark_and_nothing_before() -> None:
    m = Master([4, 4, 4])
    a, b = m.lease("a", 2)
    m.apply(Renew(JOB, a["lease"], "a", 2, 2))
    mark = m.mark("a", 3, (a["lease"], 3), (b["lease"], 0))
    m.apply(Complete(JOB, a["lease"], "a", 4))
    m.apply(Renew(JOB, b["lease"], "a", 1, 5))
    answer = m.rewind(mark)
    assert answer == {"mark": 1, "clock": 3, "epoch": 0, "revoked": 1, "undone": 2, "finished": False}
    assert sorted(m.handed()) == [(0, a["shard"], 3), (0, b["shard"], 0), (0, 3 - a["shard"] - b["shard"], 0)]


def test_rewind_twice_to_the_same_mark_is_one_rewind() -> None:
    m = Master([4, 4, 4], epochs=2)
    a, b = m.lease("a", 2)
    m.apply(Complete(JOB, a["lease"], "a", 4))
    mark = m.mark("a", 5, (b["lease"], 1))
    m.apply(Renew(JOB, b["lease"], "a", 3, 7))
    c = m.lease("a")[0]
    m.apply(Renew(JOB, c["lease"], "a", 2, 8))
    first = m.rewind(mark, "r0")
    after_first = without_rewinds(m.state)
    second = m.rewind(mark, "r1")
    assert first["undone"] == 2 and first["revoked"] == 2
    assert (second["undone"], second["revoked"]) == (0, 0)
    assert {k: v for k, v in first.items() if k not in ("undone", "revoked")} == \
        {k: v for k, v in second.items() if k not in ("undone", "revoked")}
    assert without_rewinds(m.state) == after_first  # only the count of rewinds moved
    assert m.job.totals["rewinds"] == 2


def test_an_older_mark_rewinds_further_and_the_later_marks_go() -> None:
    m = Master([3, 3], epochs=1)
    a = m.lease("a")[0]
    first = m.mark("a", 1, (a["lease"], 1))
    second = m.mark("a", 2, (a["lease"], 2))
    m.apply(Complete(JOB, a["lease"], "a", 3))
    assert m.rewind(second)["undone"] == 1
    assert m.lease("a")[0]["offset"] == 2
    assert m.rewind(first)["undone"] == 1
    assert [g for g in m.handed() if g[1] == a["shard"]] == [(0, a["shard"], 1)]
    with pytest.raises(CheckpointGone) as info:
        m.rewind(second)
    assert "a rewind to an earlier checkpoint undid it" in str(info.value) and "marks kept are 1..1" in str(info.value)


def test_a_mark_older_than_max_marks_is_refused_saying_so() -> None:
    m = Master([MAX_MARKS + 10])
    a = m.lease("a")[0]
    made = [m.mark("a", clock, (a["lease"], clock)) for clock in range(1, MAX_MARKS + 9)]
    assert [r["mark"] for r in made] == list(range(1, MAX_MARKS + 9))
    assert list(m.job.marks.marks) == list(range(9, MAX_MARKS + 9))
    with pytest.raises(CheckpointGone) as info:
        m.rewind(made[7])
    assert f"older than the last {MAX_MARKS} checkpoints" in str(info.value), info.value
    assert info.value.details["mark"] == 8
    assert m.rewind(made[8])["clock"] == 9
    assert m.lease("b")[0]["offset"] == 9


def test_a_mark_of_a_deleted_and_recreated_job_is_refused() -> None:
    m = Master([3, 3])
    a = m.lease("a")[0]
    mark = m.mark("a", 1, (a["lease"], 1))
    m.apply(DeleteJob(JOB, force=True))
    m.apply(CreateJob(make_spec([3, 3])))
    with pytest.raises(CheckpointGone) as info:
        m.rewind(mark)
    assert "earlier job named 'job'" in str(info.value)
    # A state that does not carry the creation time: this job never made that mark.
    with pytest.raises(CheckpointGone) as info:
        m.apply(Rewind(JOB, "r0", mark["mark"], mark["clock"]))
    assert "this job never made it" in str(info.value)


def test_a_clock_that_does_not_match_the_mark_is_a_bad_request() -> None:
    m = Master([3])
    a = m.lease("a")[0]
    mark = m.mark("a", 2, (a["lease"], 2))
    before = m.state.to_json()
    with pytest.raises(BadRequest) as info:
        m.apply(Rewind(JOB, "r0", mark["mark"], 3, mark["job_created"]))
    assert "is at clock 2, the state says 3" in str(info.value)
    assert m.state.to_json() == before


def test_mark_0_restarts_the_job_from_its_beginning() -> None:
    m = Master([2, 2], epochs=2)
    for clock in (2, 4):
        m.apply(Complete(JOB, m.lease("a")[0]["lease"], "a", clock))
    held = m.lease("a")[0]
    mark = m.mark("a", 5, (held["lease"], 1))
    with pytest.raises(BadRequest) as info:
        m.apply(Rewind(JOB, "r", 0, 5))
    assert "mark 0 (the job's beginning) is at clock 0" in str(info.value)
    first = m.apply(Rewind(JOB, "r", 0, 0))
    assert first == {"mark": 0, "clock": 0, "epoch": 0, "revoked": 1, "undone": 2, "finished": False}
    after = without_rewinds(m.state)
    assert m.apply(Rewind(JOB, "r2", 0, 0)) == {**first, "revoked": 0, "undone": 0}
    assert without_rewinds(m.state) == after
    with pytest.raises(CheckpointGone) as gone:
        m.rewind(mark)
    assert "restarted from its beginning" in str(gone.value)
    assert sorted(m.handed()) == [(0, 0, 0), (0, 1, 0), (1, 0, 0), (1, 1, 0)]
    assert m.job.finished
    assert m.mark("a", 1)["mark"] == 2  # ids only grow


@pytest.mark.parametrize("call", ["renew", "complete", "release", "fail"])
def test_revoked_leases_are_lost_saying_the_job_was_rewound(call: str) -> None:
    m = Master([3, 3])
    a = m.lease("a")[0]
    mark = m.mark("a", 1, (a["lease"], 1))
    assert m.rewind(mark)["revoked"] == 1
    events: dict[str, Event] = {
        "renew": Renew(JOB, a["lease"], "a", 2, 2), "complete": Complete(JOB, a["lease"], "a", 2),
        "release": Release(JOB, a["lease"], "a", 2, 2), "fail": Fail(JOB, a["lease"], "a", "x"),
    }
    event = events[call]
    before = m.state.to_json()
    with pytest.raises(LeaseLost) as info:
        m.apply(event)
    assert "revoked" in str(info.value) and "rewind" in str(info.value)
    assert info.value.details.get("revoked") is True
    assert m.state.to_json() == before


def test_a_finished_job_rewound_before_its_end_reopens_its_epochs() -> None:
    m = Master([2, 2], epochs=2)
    clock = 0
    marks = {}
    for epoch in range(2):
        for _ in range(2):
            g = m.lease("a")[0]
            clock += 2
            m.apply(Complete(JOB, g["lease"], "a", clock))
        marks[epoch] = m.mark("a", clock)
    assert m.job.finished and m.state.status(JOB, m.now)["totals"]["epochs"] == 2
    assert m.rewind(marks[1])["finished"] is True  # at its end: nothing to undo
    answer = m.rewind(marks[0])
    assert answer["finished"] is False and answer["epoch"] == 1 and answer["undone"] == 2
    status = m.state.status(JOB, m.now)
    assert not status["finished"] and status["totals"]["epochs"] == 1
    assert sorted(m.handed()) == [(1, 0, 0), (1, 1, 0)]
    assert m.job.finished and m.state.status(JOB, m.now)["totals"]["epochs"] == 2


def test_explicit_epochs_resume_into_a_reopened_epoch() -> None:
    m = Master([2, 2], epochs=2)
    g0, g1 = m.lease("a", 2, epoch=0)
    m.apply(Complete(JOB, g0["lease"], "a", 2))
    mark = m.mark("a", 3, (g1["lease"], 1))
    m.apply(Complete(JOB, g1["lease"], "a", 4))
    assert m.lease("a", 1, epoch=1)[0]["epoch"] == 1
    answer = m.rewind(mark)
    assert answer["epoch"] == 0 and answer["undone"] == 1
    assert m.apply(Lease(JOB, "b", "n", 1, 1, ("Lxxxxxxxx1",)))["status"] == "wait"
    got = m.lease("b", 2, epoch=0)
    assert [(g["shard"], g["offset"]) for g in got] == [(g1["shard"], 1)]


def test_history_is_trimmed_to_what_kept_marks_and_retain_s_need() -> None:
    m = Master([1000] * 4)
    leases = m.lease("a", 4)
    hist = m.job.marks
    for clock in range(1, 11):  # one change a second of master time, per lease
        for g in leases:
            m.apply(Renew(JOB, g["lease"], "a", clock, clock), dt=0.25)
    assert len(hist.history) == 40
    m.now += RETAIN_S
    mark = m.mark("a", 5)
    # Older than RETAIN_S and not past the only mark's clock: gone; past its clock: kept.
    assert sorted({c.clock for c in hist.history}) == [6, 7, 8, 9, 10]
    for g in leases:
        m.apply(Renew(JOB, g["lease"], "a", 11, 11))
    m.now += RETAIN_S + 1
    m.mark("a", 12)  # the floor is still mark 1's clock
    assert sorted({c.clock for c in hist.history}) == [6, 7, 8, 9, 10, 11]
    assert m.rewind(mark)["undone"] == 4
    assert hist.history == []  # nothing past clock 5 is left; nothing younger than RETAIN_S was kept


def test_a_closed_epoch_is_kept_while_a_change_may_reopen_it_and_no_longer() -> None:
    m = Master([1, 1], epochs=None)
    for clock in (1, 2):
        m.apply(Complete(JOB, m.lease("a")[0]["lease"], "a", clock))
    assert list(m.job.marks.closed) == [0]
    m.now += RETAIN_S + 1
    m.mark("a", 2)  # nothing past clock 2 to undo, all older than RETAIN_S: epoch 0 is dropped
    assert m.job.marks.closed == {} and m.job.marks.history == []


def test_max_marks_and_max_history_bound_a_job(monkeypatch: pytest.MonkeyPatch) -> None:
    m = Master([10_000])
    g = m.lease("a")[0]
    hist = m.job.marks
    last = 3 * MAX_MARKS - 1
    for clock in range(1, last + 1):  # a renew and a checkpoint every 11 s
        m.apply(Renew(JOB, g["lease"], "a", clock, clock), dt=10.0)
        m.mark("a", clock)
        assert len(hist.marks) <= MAX_MARKS
    assert list(hist.marks) == list(range(last - MAX_MARKS + 1, last + 1))
    # Kept: the changes a kept mark may undo (past the oldest's clock); the younger ones are among them.
    assert [c.clock for c in hist.history] == list(range(last - MAX_MARKS + 2, last + 1))
    # At most MAX_HISTORY changes: past it the oldest go, and the marks that needed them.
    monkeypatch.setattr(marks_mod, "MAX_HISTORY", 10)
    m.mark("a", last + 1)
    assert [c.clock for c in hist.history] == list(range(last - 9, last + 1))
    assert list(hist.marks) == list(range(last - 10, last + 2))
    with pytest.raises(CheckpointGone) as info:
        m.apply(Rewind(JOB, "r", last - 11, last - 11, m.job.created_at))
    assert "older than the last" in str(info.value)
    # What is left still rewinds exactly: the oldest kept mark's clock is where the shard resumes.
    assert m.apply(Rewind(JOB, "r", last - 10, last - 10, m.job.created_at))["undone"] == 1
    assert m.lease("b")[0]["offset"] == last - 10


def test_a_rewind_never_hands_out_again_an_epoch_closed_before_the_mark() -> None:
    """Continuous mode with prefetch: trainer ``p`` leases the last shards of epoch 0 and every
    shard of epoch 1 (behind them), so epoch 2 opens and ``q`` and ``r`` read it whole. At the
    checkpoint (clock 3, every trainer reports) epoch 0 is part read, epoch 1 untouched, epoch 2
    done. After it ``p`` finishes epoch 0 and starts epoch 1; the job is rewound to the mark.
    Epoch 2 was received whole before the checkpoint: it must not be handed out again."""
    m = Master([1, 3], epochs=3)
    p = m.lease("p", 4)
    assert [(g["epoch"], g["shard"]) for g in p] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    q, r = m.lease("q")[0], m.lease("r")[0]
    assert (q["epoch"], r["epoch"]) == (2, 2)
    m.apply(Complete(JOB, p[0]["lease"], "p", 1))  # lock step: one sample a trainer a clock
    m.apply(Complete(JOB, q["lease"], "q", 1))
    m.apply(Complete(JOB, r["lease"], "r", 3))
    mark = m.mark("p", 3, (p[1]["lease"], 2), (p[2]["lease"], 0), (p[3]["lease"], 0))
    m.mark("q", 3)
    m.mark("r", 3)
    m.apply(Complete(JOB, p[1]["lease"], "p", 4))
    m.apply(Complete(JOB, p[2]["lease"], "p", 5))
    m.apply(Renew(JOB, p[3]["lease"], "p", 1, 6))
    m.rewind(mark)
    handed = m.handed()
    assert sorted(handed) == [(0, 1, 2), (1, 0, 0), (1, 1, 0)], handed
    assert m.state.status(JOB, m.now)["totals"]["epochs"] == 3


# -- the HTTP routes -------------------------------------------------------------------------------


def new_job(master: MasterThread | MasterProcess, n: int = 4, **extra: Any) -> str:
    name = "marks-" + uuid.uuid4().hex[:10]
    status, body = http("POST", master.url + "/v1/jobs", job_spec(name, n, **extra))
    assert status == 201, body
    return name


def lease(url: str, trainer: str, count: int = 1) -> list[dict[str, Any]]:
    status, body = http("POST", url + "/leases", {"trainer": trainer, "node": "n1", "count": count})
    assert status == 200 and body["status"] == "ok", body
    return list(body["leases"])


def durable(url: str) -> dict[str, Any]:
    status, body = http("GET", url)
    assert status == 200, body
    return {k: body[k] for k in ("epoch", "finished", "shards", "open_epochs", "totals")}


def test_mark_and_rewind_over_http(inproc_master: MasterThread) -> None:
    job = new_job(inproc_master, 3, epochs=1, shuffle=False)
    url = f"{inproc_master.url}/v1/jobs/{job}"
    a, b = lease(url, "t1", 2)
    status, body = http("POST", f"{url}/leases/{a['lease']}/renew", {"trainer": "t1", "offset": 2, "clock": 2})
    assert (status, body["offset"]) == (200, 2)
    status, mark = http("POST", url + "/marks", {"trainer": "t1", "clock": 4, "positions": [[a["lease"], 4], [b["lease"], 0]]})
    assert status == 200, mark
    assert (mark["mark"], mark["clock"], mark["epoch"], mark["trainers"], mark["lost"]) == (1, 4, 0, 1, [])
    assert mark["job_created"] > 0
    status, joined = http("POST", url + "/marks", {"trainer": "t2", "clock": 4, "positions": []})
    assert status == 200 and joined["mark"] == 1 and joined["trainers"] == 2
    assert http("POST", f"{url}/leases/{a['lease']}/complete", {"trainer": "t1", "clock": 6})[0] == 200
    assert http("POST", f"{url}/leases/{b['lease']}/renew", {"trainer": "t1", "offset": 3, "clock": 7})[0] == 200
    body = {"trainer": "t9", "mark": 1, "clock": 4, "job_created": mark["job_created"]}
    status, answer = http("POST", url + "/rewind", body)
    assert status == 200, answer
    assert answer == {"mark": 1, "clock": 4, "epoch": 0, "revoked": 1, "undone": 2, "finished": False}
    assert http("POST", url + "/rewind", body) == (200, {**answer, "revoked": 0, "undone": 0})
    status, lost = http("POST", f"{url}/leases/{b['lease']}/renew", {"trainer": "t1", "offset": 3, "clock": 8})
    assert status == 409 and lost["error"] == "LeaseLost" and "rewind" in lost["message"]
    again = lease(url, "t9", 3)
    assert sorted((g["shard"], g["offset"]) for g in again) == sorted([(a["shard"], 4), (b["shard"], 0), (2, 0)])
    status, gone = http("POST", url + "/rewind", {**body, "mark": 2, "clock": 9})
    assert status == 409 and gone["error"] == "CheckpointGone" and "never made it" in gone["message"], gone


_VALID_MARK = {"trainer": "t1", "clock": 3, "positions": []}
_VALID_REWIND = {"trainer": "t1", "mark": 1, "clock": 3}


@pytest.mark.parametrize(
    ("route", "body", "code", "fragment"),
    [
        ("marks", b"{not json", 400, "not JSON"),
        ("marks", b"", 400, "empty"),
        ("marks", b"[1, 2]", 400, "JSON object"),
        ("marks", b"\xff\xfe garbage", 400, "UTF-8"),
        ("marks", b"[" * 100_000 + b"]" * 100_000, 413, "bytes"),
        ("marks", b'{"trainer": "t1", "clock": 3, "positions": ' + b"[" * 5000 + b"]" * 5000 + b"}", 400, ""),
        ("marks", {**_VALID_MARK, "clock": -1}, 400, "'clock'"),
        ("marks", {**_VALID_MARK, "clock": "3"}, 400, "'clock'"),
        ("marks", {**_VALID_MARK, "clock": 3.5}, 400, "'clock'"),
        ("marks", {**_VALID_MARK, "clock": True}, 400, "'clock'"),
        ("marks", {**_VALID_MARK, "clock": 2**64}, 400, "'clock'"),
        ("marks", {**_VALID_MARK, "clock": None}, 400, "'clock'"),
        ("marks", {"trainer": "t1", "positions": []}, 400, "'clock'"),
        ("marks", {"clock": 3, "positions": []}, 400, "'trainer'"),
        ("marks", {**_VALID_MARK, "trainer": ""}, 400, "'trainer'"),
        ("marks", {**_VALID_MARK, "trainer": ["t1"]}, 400, "'trainer'"),
        ("marks", {**_VALID_MARK, "trainer": "x" * 5000}, 400, "'trainer'"),
        ("marks", {**_VALID_MARK, "positions": "L0000000001"}, 400, "positions"),
        ("marks", {**_VALID_MARK, "positions": {"L0000000001": 1}}, 400, "positions"),
        ("marks", {**_VALID_MARK, "positions": [["L0000000001"]]}, 400, "positions"),
        ("marks", {**_VALID_MARK, "positions": [["L0000000001", 1, 2]]}, 400, "positions"),
        ("marks", {**_VALID_MARK, "positions": [[["L0000000001"], 1]]}, 400, "lease id"),
        ("marks", {**_VALID_MARK, "positions": [[{"a": [1, {"b": None}]}, 1]]}, 400, "lease id"),
        ("marks", {**_VALID_MARK, "positions": [["bad id!", 1]]}, 400, "lease id"),
        ("marks", {**_VALID_MARK, "positions": [["L0000000001", -1]]}, 400, "'offset'"),
        ("marks", {**_VALID_MARK, "positions": [["L0000000001", "1"]]}, 400, "'offset'"),
        ("marks", {**_VALID_MARK, "positions": [["L0000000001", [1]]]}, 400, "'offset'"),
        ("marks", {**_VALID_MARK, "positions": [[f"L{i:010d}", 1] for i in range(1025)]}, 400, "at most 1024"),
        ("marks", {**_VALID_MARK, "positions": [["L0000000001", 1]] * 5000}, 413, "bytes"),
        ("marks", {**_VALID_MARK, "mark": 1}, 400, "unknown field"),
        ("marks", {**_VALID_MARK, "nested": {"a": [[[[]]]]}}, 400, "unknown field"),
        ("rewind", b"{not json", 400, "not JSON"),
        ("rewind", b"null", 400, "JSON object"),
        ("rewind", {**_VALID_REWIND, "mark": 0}, 400, "mark 0 (the job's beginning) is at clock 0, the state says 3"),
        ("rewind", {**_VALID_REWIND, "mark": -1}, 400, "'mark'"),
        ("rewind", {**_VALID_REWIND, "mark": "1"}, 400, "'mark'"),
        ("rewind", {**_VALID_REWIND, "mark": 1.0}, 400, "'mark'"),
        ("rewind", {**_VALID_REWIND, "mark": [1]}, 400, "'mark'"),
        ("rewind", {"trainer": "t1", "clock": 3}, 400, "'mark'"),
        ("rewind", {**_VALID_REWIND, "clock": -1}, 400, "'clock'"),
        ("rewind", {**_VALID_REWIND, "clock": {"n": 3}}, 400, "'clock'"),
        ("rewind", {"trainer": "t1", "mark": 1}, 400, "'clock'"),
        ("rewind", {"mark": 1, "clock": 3}, 400, "'trainer'"),
        ("rewind", {**_VALID_REWIND, "trainer": 7}, 400, "'trainer'"),
        ("rewind", {**_VALID_REWIND, "job_created": "yesterday"}, 400, "job_created"),
        ("rewind", {**_VALID_REWIND, "job_created": True}, 400, "job_created"),
        ("rewind", {**_VALID_REWIND, "job_created": [1.5]}, 400, "job_created"),
        ("rewind", {**_VALID_REWIND, "clock": 4}, 400, "is at clock 3, the state says 4"),
        ("rewind", {**_VALID_REWIND, "positions": []}, 400, "unknown field"),
        ("rewind", {**_VALID_REWIND, "x": "y" * 70_000}, 413, "bytes"),
    ],
)
def test_hostile_mark_and_rewind_bodies(inproc_master: MasterThread, route: str, body: Any, code: int, fragment: str) -> None:
    job = new_job(inproc_master, 4)
    url = f"{inproc_master.url}/v1/jobs/{job}"
    held = lease(url, "t1")[0]
    status, mark = http("POST", url + "/marks", {"trainer": "t1", "clock": 3, "positions": [[held["lease"], 2]]})
    assert status == 200 and mark["mark"] == 1, mark
    before = durable(url)
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    status, answer = http("POST", f"{url}/{route}", raw=raw, timeout=30)
    assert status == code, answer
    assert isinstance(answer, dict) and answer["error"] in ("BadRequest", "BodyTooLarge") and answer["message"], answer
    assert fragment in answer["message"], answer
    assert durable(url) == before
    # Still serving the well-behaved: the lease renews, the mark rewinds.
    assert http("POST", f"{url}/leases/{held['lease']}/renew", {"trainer": "t1", "offset": 3, "clock": 4})[0] == 200
    assert http("POST", url + "/rewind", _VALID_REWIND)[0] == 200


@pytest.mark.parametrize("value", [b"Infinity", b"-Infinity", b"1e999", b"NaN"])
def test_a_creation_time_that_is_not_a_number_is_refused(inproc_master: MasterThread, value: bytes) -> None:
    """``NaN`` and ``Infinity`` are not JSON, but Python's decoder takes them; no job was
    created at such a time, so no rewind may go through with one."""
    job = new_job(inproc_master, 2)
    url = f"{inproc_master.url}/v1/jobs/{job}"
    held = lease(url, "t1")[0]
    assert http("POST", url + "/marks", {"trainer": "t1", "clock": 3, "positions": [[held["lease"], 2]]})[0] == 200
    before = durable(url)
    raw = b'{"trainer": "t1", "mark": 1, "clock": 3, "job_created": ' + value + b"}"
    status, answer = http("POST", url + "/rewind", raw=raw)
    assert status in (400, 409) and answer["error"] in ("BadRequest", "CheckpointGone"), (status, answer)
    assert answer["message"]
    assert durable(url) == before


def test_marks_and_rewind_of_an_unknown_job_are_404(inproc_master: MasterThread) -> None:
    url = f"{inproc_master.url}/v1/jobs/no-such-job"
    for route, body in (("marks", _VALID_MARK), ("rewind", _VALID_REWIND)):
        status, answer = http("POST", f"{url}/{route}", body)
        assert (status, answer["error"]) == (404, "NoSuchJob"), answer
        status, answer = http("POST", f"{inproc_master.url}/v1/jobs/..%2Fx/{route}", body)
        assert (status, answer["error"]) == (400, "BadRequest"), answer
        status, answer = http("GET", f"{url}/{route}")
        assert status == 405, answer


@pytest.fixture
def master_proc(tmp_path: Path) -> Iterator[MasterProcess]:
    proc = MasterProcess(tmp_path, f"sqlite://{tmp_path}/master.db", "--snapshot-events", "5")
    try:
        yield proc.start()
    finally:
        proc.stop()


def test_marks_and_rewinds_survive_a_kill9(master_proc: MasterProcess) -> None:
    """Marks, their history and the closed epochs a rewind reopens are in the journal (and the
    snapshots): a master killed and started again rewinds exactly as the one that saw them."""
    job = new_job(master_proc, 2, epochs=2, shuffle=False)
    url = f"{master_proc.url}/v1/jobs/{job}"
    clock = 0
    for _ in range(2):
        g = lease(url, "t1")[0]
        clock += 10
        assert http("POST", f"{url}/leases/{g['lease']}/complete", {"trainer": "t1", "clock": clock})[0] == 200
    status, mark = http("POST", url + "/marks", {"trainer": "t1", "clock": clock, "positions": []})
    assert status == 200 and mark["epoch"] == 1
    for g in lease(url, "t1", 2):
        clock += 10
        assert http("POST", f"{url}/leases/{g['lease']}/complete", {"trainer": "t1", "clock": clock})[0] == 200
    assert durable(url)["finished"]
    master_proc.kill9()
    master_proc.start()
    before = durable(url)
    assert before["finished"]
    body = {"trainer": "t2", "mark": mark["mark"], "clock": mark["clock"], "job_created": mark["job_created"]}
    status, answer = http("POST", url + "/rewind", body)
    assert status == 200 and answer["undone"] == 2 and answer["finished"] is False and answer["epoch"] == 1, answer
    master_proc.kill9()
    master_proc.start()
    after = durable(url)
    assert not after["finished"] and after["epoch"] == 1 and after["shards"]["todo"] == 2
    assert sorted((g["epoch"], g["shard"], g["offset"]) for g in lease(url, "t2", 4)) == [(1, 0, 0), (1, 1, 0)]
