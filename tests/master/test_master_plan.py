"""The plan a node's report is answered with (loader/master/server/holdings.py): each node is asked
to prefetch the shards of its next few positions (those assigned to it: rendezvous over the job's
trainer nodes, or the ring owner's node) and keep the shards it holds, the soonest needed first,
as many as its capacity holds (Belady's rule with a short lead); checked against a naive
reference that walks the seeded orders itself. Also the cost of a
plan at 1,000 nodes and 100,000 shards (slow tier)."""

from __future__ import annotations

import os
import statistics
import time
from array import array
from typing import Any

import pytest

from loader.master.server import holdings
from loader.master.server.events import Complete, CreateJob, Holdings, Lease, Placement
from loader.master.server.holdings import (
    LEAD_HOLD_S,
    MIN_PLAN_INTERVAL_S,
    NodeBook,
    NodeRecord,
    Planner,
    plan_interval,
    resolve_report,
)
from loader.master.server.spec import JobSpec, ShardSpec
from loader.master.server.state import MasterState
from wire.nodeplan import MAX_KEEP, MAX_PREFETCH, NodePlan, NodeReport, name_hash
from wire.rendezvous import owner
from wire.shuffle import EpochOrder

SIZE = 1000


def key(i: int) -> str:
    return f"train/shard-{i:05d}.tar"


def spec(name: str = "job", n: int = 40, window: int = 8, epochs: int | None = 3, seed: int = 7) -> JobSpec:
    shards = tuple(ShardSpec(f"shard-{i:05d}.tar", SIZE, 10) for i in range(n))
    return JobSpec(name, "s3://bucket/train/", shards, epochs, seed, True, 60.0, 3, window)


class Cluster:
    """A master's state, its node bookkeeping and planner, and trainers that lease on nodes."""

    def __init__(self, *specs: JobSpec, budget_s: float = float("inf")) -> None:
        self.state = MasterState()
        self.now = 100.0
        self.book = NodeBook()
        self.planner = Planner(budget_s=budget_s)
        self.ids = 0
        self.handed: dict[str, dict[int, set[int]]] = {}  # job -> epoch -> shards leased
        self.trainers: dict[str, dict[str, set[str]]] = {}  # job -> node -> trainers
        self.seqs: dict[str, int] = {}
        for s in specs:
            self.state.apply(CreateJob(s), self.now)

    def lease(self, job: str, node: str, trainer: str | None = None, complete: bool = True) -> dict[str, Any]:
        self.ids += 1
        trainer = trainer or f"t-{node}"
        answer = self.state.apply(Lease(job, trainer, node, 1, None, (f"lease{self.ids:08d}",)), self.now).answer
        got: dict[str, Any] = answer["leases"][0]
        self.handed.setdefault(job, {}).setdefault(got["epoch"], set()).add(got["shard"])
        self.trainers.setdefault(job, {}).setdefault(node, set()).add(trainer)
        if complete:
            self.state.apply(Complete(job, got["lease"], trainer), self.now)
        return got

    def report(self, node: str, held: tuple[int, ...] = (), capacity: int = 6 * SIZE,
               waited: dict[str, tuple[float, float]] | None = None) -> NodePlan:
        """A full report of ``node`` holding shards ``held`` (of job "job"), applied as the service
        does; ``waited``: job -> the node's trainers' cumulative (wait, wall) seconds."""
        seq = self.seqs[node] = self.seqs.get(node, 0) + 1
        rep = NodeReport(f"d-{node}", seq, None, array("Q", [name_hash("bucket", key(s)) for s in held]), array("Q"),
                         capacity, 0, SIZE, {})
        rec = self.book.take(node, rep, self.now)
        windowed = [(name, job.spec, job.created_at, job.locality) for name, job in self.state.jobs.items()
                    if job.locality is not None and job.locality.names is not None]
        resolution = resolve_report(windowed, rep)
        self.state.apply(Holdings(node, True, tuple(resolution.held), (), resolution.hint()), self.now)
        self.book.applied(rec, rep, resolution, frozenset((n, c) for n, _, c, _ in windowed), self.now)
        return self.planner.plan(self.state, rec, seq, self.trainers, 2.0, waited)

    def record(self, node: str) -> NodeRecord:
        return self.book.records[node]


def shards_of(plan: NodePlan) -> list[int]:
    return [int(item.key[-9:-4]) for item in plan.prefetch]


def keep_of(plan: NodePlan) -> list[int]:
    by_hash = {name_hash("bucket", key(i)): i for i in range(100_000)}
    return [by_hash[h] for h in plan.keep]


def reference(cluster: Cluster, job: str, node: str, assigned: dict[int, str], slots: int, held: set[int],
              ring: bool = False, lead: int | None = None) -> list[tuple[int, int]]:
    """The rule, naively: (next use, shard) of the ``slots`` soonest among the node's held shards
    and the shards of its next ``lead`` positions it does not hold (default: as the planner sizes
    it, 2 per trainer of the job on the node, at most half the slots); next use = this epoch's
    position if not handed out yet in it, else the next epoch's. The node's positions: those of
    the shards assigned to it not handed out yet this epoch, in order, then the next epoch's of
    the others. Without a ring (per-node caches) a shard another node holds, or one inside the
    window now, is not this node's to fetch (its position still counts)."""
    state = cluster.state.jobs[job]
    n, s = state.n, state.spec
    if lead is None:
        lead = max(1, min(slots // 2, 2 * len(cluster.trainers.get(job, {}).get(node, ()))))
    epoch = state.epoch if state.open and next(iter(state.open.values())).cursor < n else state.next_epoch
    now, after = EpochOrder(n, s.seed, epoch, s.shuffle), EpochOrder(n, s.seed, epoch + 1, s.shuffle)
    handed = cluster.handed.get(job, {}).get(epoch, set())
    open_ep = state.open.get(epoch)
    near = epoch * n + (open_ep.cursor if open_ep is not None else 0) + s.locality_window
    assert state.locality is not None

    def use_of(shard: int) -> int:
        return epoch * n + now.index(shard) if shard not in handed else (epoch + 1) * n + after.index(shard)

    has_next = s.epochs is None or epoch + 1 < s.epochs
    positions = [(epoch * n + p, now[p]) for p in range(n) if assigned.get(now[p]) == node and now[p] not in handed]
    if has_next:
        positions += [((epoch + 1) * n + p, after[p]) for p in range(n) if assigned.get(after[p]) == node and after[p] in handed]
    uses = {shard: use_of(shard) for shard in held if shard not in handed or has_next}
    for use, shard in positions[:lead]:
        holder = state.locality.readers.get(shard)
        if shard in held or not ring and ((holder is not None and holder != node) or use < near):
            continue
        uses[shard] = use
    return sorted((use, shard) for shard, use in uses.items())[:slots]


def rendezvous(n: int, nodes: list[str]) -> dict[int, str]:
    return {i: owner(nodes, f"bucket/{key(i)}") or "" for i in range(n)}


# -- the rules --------------------------------------------------------------------------------


def test_two_nodes_get_disjoint_plans_of_their_assigned_shards_soonest_first_bounded_by_slots() -> None:
    cluster = Cluster(spec(n=40, window=2))
    for _ in range(3):
        for k in range(3):  # three trainers a node: a lead of 3 positions (half of 6 slots)
            cluster.lease("job", "n1", f"t-n1-{k}")
            cluster.lease("job", "n2", f"t-n2-{k}")
    assigned = rendezvous(40, ["n1", "n2"])
    plans = {node: cluster.report(node) for node in ("n1", "n2")}
    for node, plan in plans.items():
        expected = reference(cluster, "job", node, assigned, 6, set())
        assert plan.resend is None and expected
        assert [(i.next_use, int(i.key[-9:-4])) for i in plan.prefetch] == expected
        # Nothing held: what the plan keeps is what it fetches, ranked at its next use.
        assert keep_of(plan) == shards_of(plan)
        assert all(assigned[s] == node for s in shards_of(plan))
        assert all(i.job == "job" and i.bucket == "bucket" for i in plan.prefetch)
        assert cluster.record(node).planned == {"job": (len(expected), 0)}
    assert not set(shards_of(plans["n1"])) & set(shards_of(plans["n2"]))
    # Handed out this epoch: not in the plan for it (leased shards are needed next epoch at the soonest).
    assert not set(shards_of(plans["n1"])) & cluster.handed["job"][0]


def test_the_lead_is_of_positions_so_held_shards_needed_soon_keep_their_place() -> None:
    # Belady's rule with a short lead: the plan fetches only what the node's next positions need,
    # and keeps the held shards needed soonest with the rest of its slots. A plan that fetched the
    # next shards not held, however far ahead, would have displaced every held shard already read
    # (its next use is next epoch) for this epoch's.
    n = 40
    cluster = Cluster(spec(n=n, window=1))
    cluster.lease("job", "n1")  # one trainer: a lead of 2 positions
    assigned = {i: "n1" for i in range(n)}  # the only node: every shard its own
    order = EpochOrder(n, 7, 0)
    handed = cluster.handed["job"][0]
    pending = [order[p] for p in range(n) if order[p] not in handed]
    held = {pending[0], *handed}  # the next shard, and the one read (needed next epoch)
    plan = cluster.report("n1", tuple(held), capacity=10 * SIZE)
    expected = reference(cluster, "job", "n1", assigned, 10, held)
    assert shards_of(plan) == [s for _, s in expected if s not in held] == [pending[1]]
    assert keep_of(plan) == [s for _, s in expected] and set(keep_of(plan)) == held | {pending[1]}


def test_trainers_that_wait_make_the_plan_fetch_through_the_shards_kept_for_the_epoch(monkeypatch: pytest.MonkeyPatch) -> None:
    # A warm epoch on a slow origin: the node kept the shards its next positions need first, so
    # the base lead (2 positions, one trainer) finds nothing to fetch there while the link idles,
    # and the misses behind that run come at once: the trainer waits. Then the plan fetches
    # through: one shard to fetch a trainer, past the kept ones, the fetched-ahead ones bounded.
    # (A node with fewer than ROOM_SLOTS_PER_TRAINER slots a trainer: see the next test for more.)
    monkeypatch.setattr(holdings, "ROOM_SLOTS_PER_TRAINER", 31)
    n = 60
    cluster = Cluster(spec(n=n, window=1))
    cluster.lease("job", "n1")
    order = EpochOrder(n, 7, 0)
    handed = cluster.handed["job"][0]
    pending = [order[p] for p in range(n) if order[p] not in handed]
    kept = tuple(pending[:6])
    capacity = 30 * SIZE  # 30 slots: at most 15 fetched ahead and not read
    assert shards_of(cluster.report("n1", kept, capacity, waited={"job": (0.0, 10.0)})) == []
    # Waiting 20% of the last second: the next shard not held, past the kept run.
    assert shards_of(cluster.report("n1", kept, capacity, waited={"job": (0.2, 11.0)})) == [pending[6]]
    # Without waiting since, it goes on (for LEAD_HOLD_S): each fetched one held, the next.
    fetched: list[int] = []
    for k in range(20):
        plan = cluster.report("n1", kept + tuple(fetched), capacity, waited={"job": (0.2, 12.0 + k)})
        if not plan.prefetch:
            break
        assert shards_of(plan) == [pending[6 + len(fetched)]]
        fetched.append(pending[6 + len(fetched)])
    assert len(fetched) == 15  # then the fetched-ahead ones fill half the slots: it stops
    # LEAD_HOLD_S later without a wait: the base rule again (its 2 positions are held).
    cluster.now += LEAD_HOLD_S + 1
    assert shards_of(cluster.report("n1", kept, capacity, waited={"job": (0.2, 400.0)})) == []


def test_a_roomy_node_fetches_through_two_a_trainer_into_the_room_its_kept_shards_leave() -> None:
    # ROOM_SLOTS_PER_TRAINER slots a trainer or more: fetching through names two shards a trainer,
    # but only into the slots that the held shards the epoch still needs leave: none of those is
    # displaced for a shard fetched ahead (each would be fetched again later in the epoch).
    n = 60
    capacity = 30 * SIZE  # 30 slots, one trainer
    assert 30 >= holdings.ROOM_SLOTS_PER_TRAINER and holdings.ROOMY_LEAD_PER_TRAINER == 2

    def through(positions: list[int], read: bool = False) -> tuple[NodePlan, list[int], int]:
        """A node that entered the epoch holding the shards of its pending ``positions`` (and the
        one its trainer read, needed next epoch), after its trainer waited: (the plan, the epoch's
        shards still to hand out, the one read)."""
        cluster = Cluster(spec(n=n, window=1))
        cluster.lease("job", "n1")  # leased and completed
        order = EpochOrder(n, 7, 0)
        done = next(iter(cluster.handed["job"][0]))
        pending = [order[p] for p in range(n) if order[p] != done]
        held = tuple(pending[p] for p in positions) + ((done,) if read else ())
        cluster.report("n1", held, capacity, waited={"job": (0.0, 10.0)})
        return cluster.report("n1", held, capacity, waited={"job": (0.2, 11.0)}), pending, done

    plan, pending, _ = through(list(range(6)))
    assert shards_of(plan) == pending[6:8]  # two, past the kept run
    # The kept run, a gap of two (needed before the rest of what is kept), then more kept shards
    # filling the slots but for two, one, none: that many of the gap's are fetched, never one in
    # place of a kept shard.
    for room in (2, 1, 0):
        positions = [*range(6), *range(8, 8 + 24 - room)]
        plan, pending, _ = through(positions)
        assert shards_of(plan) == pending[6: 6 + room], room
        assert {pending[p] for p in positions} <= set(keep_of(plan)), room
    # A shard read already (needed next epoch) gives its slot to one to fetch: Belady's rule.
    plan, pending, done = through([*range(6), *range(8, 31)], read=True)
    assert shards_of(plan) == [pending[6]] and done not in keep_of(plan)


def test_waits_in_an_epoch_entered_with_nothing_kept_leave_the_base_lead() -> None:
    # The first epoch: the trainer waits on a busy link, and nothing was kept to fetch through
    # (the shard it reads now was not kept for the epoch: it is handed out already).
    n = 60
    cluster = Cluster(spec(n=n, window=1))
    cluster.state.apply(Placement((("http://10.0.0.1:8600", "n1"),)), cluster.now)  # a cluster cache: all n1's
    first = cluster.lease("job", "n1")["shard"]
    order = EpochOrder(n, 7, 0)
    handed = cluster.handed["job"][0]
    pending = [order[p] for p in range(n) if order[p] not in handed]
    for k in range(1, 6):
        plan = cluster.report("n1", (first,), 30 * SIZE, waited={"job": (0.5 * k, 1.0 * k)})
        assert shards_of(plan) == pending[:2]  # the base lead: 2 positions
    assert cluster.record("n1").leads["job"].until == 0.0


def test_keep_ranks_the_held_shards_the_order_needs_soonest_and_prefetch_skips_them() -> None:
    n = 40
    cluster = Cluster(spec(n=n))
    for _ in range(2):
        cluster.lease("job", "n1")
        cluster.lease("job", "n2")
    assigned = rendezvous(n, ["n1", "n2"])
    order = EpochOrder(n, 7, 0)
    handed = cluster.handed["job"][0]
    pending = [order[p] for p in range(n) if order[p] not in handed]
    # n1 holds: the next shard of the order (whoever it is assigned to), a late one of its own,
    # and one handed out already (needed only next epoch).
    soon, late, done = pending[0], [s for s in pending[::-1] if assigned[s] == "n1"][0], sorted(handed)[0]
    held = {soon, late, done}
    plan = cluster.report("n1", tuple(held))
    expected = reference(cluster, "job", "n1", assigned, 6, held)
    desired = [s for _, s in expected]
    assert keep_of(plan) == desired and set(held) <= set(desired)  # room for all: soonest first
    assert shards_of(plan) == [s for s in desired if s not in held]
    assert keep_of(plan).index(soon) < keep_of(plan).index(late) < keep_of(plan).index(done)
    assert cluster.record("n1").planned["job"] == (len(desired), 2)  # this epoch's held: the lead
    # Room for two: the one needed next epoch gives way (Belady's rule: the farthest next use).
    tight = cluster.report("n1", tuple(held), capacity=2 * SIZE)
    assert keep_of(tight) == [s for _, s in reference(cluster, "job", "n1", assigned, 2, held)] == [soon, late]
    # With room for everything the held ones all rank, soonest first.
    big = cluster.report("n1", tuple(held), capacity=1000 * SIZE)
    expected = reference(cluster, "job", "n1", assigned, 1000, held)
    assert keep_of(big) == [s for _, s in expected if s in held] and set(keep_of(big)) == held


def test_the_next_epoch_follows_when_this_one_runs_out() -> None:
    n = 24
    cluster = Cluster(spec(n=n, window=1))
    k = 0
    while len(cluster.handed.get("job", {}).get(0, ())) < n - 3:
        cluster.lease("job", "n1", f"t-n1-{k % 4}")  # four trainers: a lead of 4 positions
        k += 1
    assigned = {i: "n1" for i in range(n)}  # the job's only node
    plan = cluster.report("n1", capacity=8 * SIZE)
    expected = reference(cluster, "job", "n1", assigned, 8, set())
    assert [(i.next_use, int(i.key[-9:-4])) for i in plan.prefetch] == expected
    assert any(i.next_use >= n for i in plan.prefetch)  # reaches into epoch 1
    # A job's last epoch has no next one: only what is left of it.
    last = Cluster(spec(n=n, window=1, epochs=1))
    while len(last.handed.get("job", {}).get(0, ())) < n - 3:
        last.lease("job", "n1")
    assert all(i.next_use < n for i in last.report("n1", capacity=8 * SIZE).prefetch)


def test_with_a_ring_shards_are_assigned_to_their_owners_node() -> None:
    n = 40
    cluster = Cluster(spec(n=n))
    members = (("http://10.0.0.1:8600", "n1"), ("http://10.0.0.2:8600", "n2"), ("http://10.0.0.3:8600", "n3"))
    cluster.state.apply(Placement(members), cluster.now)
    cluster.lease("job", "n1")
    owners = {i: dict(members)[owner([m for m, _ in members], f"bucket/{key(i)}") or ""] for i in range(n)}
    plan = cluster.report("n1", capacity=5 * SIZE)
    assert [(i.next_use, int(i.key[-9:-4])) for i in plan.prefetch] == reference(cluster, "job", "n1", owners, 5, set(), ring=True)
    assert {owners[s] for s in shards_of(plan)} == {"n1"}


def test_slots_are_split_between_jobs_by_their_trainers_on_the_node() -> None:
    cluster = Cluster(spec("a", n=40, window=1), spec("b", n=40, seed=3, window=1))
    for trainer in ("a0", "a1", "a2"):
        cluster.lease("a", "n1", trainer)
    cluster.lease("b", "n1", "b0")
    # The two jobs read the same dataset: the 20 shards held are both jobs' to rank.
    plan = cluster.report("n1", tuple(range(20)), capacity=8 * SIZE)
    planned = cluster.record("n1").planned
    assert planned["a"][0] == 6 and planned["b"][0] == 2 and len(plan.keep) <= 8
    assert plan.prefetch and {item.job for item in plan.prefetch} <= {"a", "b"}
    # Ranked by how far ahead of each job's own position they are needed.
    leads = [i.next_use - (40 * 0 + cluster.state.jobs[i.job].open[0].cursor) for i in plan.prefetch]
    assert leads == sorted(leads)


def test_no_plan_without_trainers_on_the_node_capacity_or_a_window() -> None:
    cluster = Cluster(spec(n=20, window=1), spec("plain", n=20, window=0))
    cluster.lease("plain", "n1")
    assert cluster.report("n1") == NodePlan(1, interval_s=2.0)  # only a window-less job's trainers there
    cluster.lease("job", "n2")
    assert cluster.report("n3").prefetch == ()  # nobody trains on n3
    assert cluster.report("n2", capacity=0).prefetch == ()
    assert cluster.report("n2").prefetch


def test_a_spent_budget_makes_a_plan_shorter_never_wrong() -> None:
    n = 400
    full = Cluster(spec(n=n, window=16))
    starved = Cluster(spec(n=n, window=16), budget_s=0.0)
    members = (("http://10.0.0.1:8600", "n1"), ("http://10.0.0.2:8600", "n2"), ("http://10.0.0.3:8600", "n3"))
    for cluster in (full, starved):
        cluster.state.apply(Placement(members), cluster.now)  # owners: no position is another node's
        for k in range(13):  # a lead of 25 positions (half of 50 slots)
            cluster.lease("job", "n1", f"t-n1-{k}")
        for node in ("n2", "n3"):
            cluster.lease("job", node)
    whole = full.report("n1", capacity=50 * SIZE)
    short = starved.report("n1", capacity=50 * SIZE)
    assert len(whole.prefetch) == 25 and set(shards_of(short)) <= set(shards_of(whole))


def test_the_report_interval_grows_with_the_reporting_nodes() -> None:
    assert plan_interval(1) == plan_interval(100) == 1.0 and plan_interval(200) == 2.0
    assert plan_interval(1000) == 10.0 and plan_interval(10**9) == 3600.0


def test_the_report_interval_shrinks_for_a_cache_that_turns_over_fast() -> None:
    """About an eighth of a node's cache changes between two plans, down to 0.25 s, and never
    below one second per 100 nodes: the master's budget of ~100 reports a second holds."""
    assert plan_interval(4, turnover_s=3.0) == 0.375
    assert plan_interval(4, turnover_s=0.5) == MIN_PLAN_INTERVAL_S == 0.25
    assert plan_interval(4, turnover_s=600.0) == plan_interval(4) == 1.0  # a slow cache: as before
    assert plan_interval(50, turnover_s=0.1) == 0.5  # 50 nodes at 0.5 s: 100 reports a second
    assert plan_interval(1000, turnover_s=0.1) == 10.0
    for nodes in (1, 4, 25, 30, 50, 100, 1000, 5000):  # every node at its shortest: the budget
        assert nodes / plan_interval(nodes, turnover_s=0.0) <= 100


def test_a_nodes_turnover_is_measured_from_the_bytes_it_fills() -> None:
    book = NodeBook()
    job = {"reads": 0, "hit_bytes": 0, "origin_bytes": 0, "peer_bytes": 0, "prefetch_bytes": 0}

    def take(seq: int, now: float, **filled: int) -> NodeRecord:
        for name, value in filled.items():
            job[name] += value
        rep = NodeReport("d", seq, None if seq == 1 else seq - 1, array("Q"), array("Q"), 24 * SIZE, 12 * SIZE,
                         SIZE, {"j": dict(job)})
        rec = book.take("n", rep, now)
        book.applied(rec, rep, resolve_report([], rep), frozenset(), now)
        return rec

    rec = take(1, 100.0)
    assert rec.turnover_s() is None  # nothing known yet
    rec = take(2, 101.0, origin_bytes=2 * SIZE, peer_bytes=SIZE, prefetch_bytes=SIZE, hit_bytes=50 * SIZE)
    assert rec.turnover_s() == 3.0  # 12 entries' bytes, 4 a second in: 3 s (hits bring nothing in)
    assert plan_interval(1, rec.turnover_s()) == 0.375
    rec = take(3, 101.5, origin_bytes=2 * SIZE)  # the same rate
    assert rec.turnover_s() == 3.0
    for seq in range(4, 14):  # nothing comes in: back to the usual interval
        rec = take(seq, 101.5 + seq)
    assert plan_interval(1, rec.turnover_s()) == 1.0
    rep = NodeReport("d2", 1, None, array("Q"), array("Q"), 24 * SIZE, 12 * SIZE, SIZE, {"j": dict(job, origin_bytes=0)})
    book.take("n", rep, 120.0)  # a restarted daemon counts from 0: no negative rate
    assert book.records["n"].fill_rate is not None and book.records["n"].fill_rate >= 0


def test_prefetch_is_bounded() -> None:
    n = 3000
    cluster = Cluster(spec(n=n, window=4))
    for k in range(600):  # a lead of 1,200 positions
        cluster.lease("job", "n1", f"t-n1-{k}")
    plan = cluster.report("n1", capacity=n * SIZE)
    assert len(plan.prefetch) == MAX_PREFETCH and len(plan.keep) == min(MAX_KEEP, 1200 - 4)
    # the lead's positions but the window's 4 (about to be leased: fetched by whoever gets them)
    assert cluster.record("n1").planned["job"][0] == 1200 - 4


# -- what a plan costs ---------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_plan_cost_at_1000_nodes() -> None:
    """100,000 shards, 1,000 nodes with a trainer each and a ring of their daemons, 100 slots and
    100 held shards a node. Prints the one-time cost of placing the epoch and the per-plan cost
    after (holdings.py's docstring has the figures)."""
    n, nodes = int(os.environ.get("PLAN_BENCH_SHARDS", "100000")), int(os.environ.get("PLAN_BENCH_NODES", "1000"))
    cluster = Cluster(spec(n=n, window=4096, epochs=None))
    members = tuple((f"http://10.{i // 250}.{i % 250}.1:8600", f"node-{i:04d}") for i in range(nodes))
    cluster.state.apply(Placement(members), cluster.now)
    names = [node for _, node in members]
    for node in names:
        cluster.lease("job", node, complete=False)
    started = time.perf_counter()
    for node in names:  # every node's first plan: places the positions the plans reach
        cluster.report(node, capacity=100 * SIZE)
    first = time.perf_counter() - started
    held = {node: tuple((i * 97 + k) % n for k in range(100)) for i, node in enumerate(names)}
    times = []
    for node in names:
        t0 = time.perf_counter()
        plan = cluster.report(node, held[node], capacity=100 * SIZE)
        times.append(time.perf_counter() - t0)
        assert len(plan.keep) == 100 and len(plan.prefetch) <= 50
    print(f"\n{nodes} nodes x {n} shards: first plans {first:.1f} s in all; then a report+plan "
          f"{1000 * statistics.mean(times):.2f} ms mean, p99 {1000 * sorted(times)[int(0.99 * len(times))]:.2f} ms")
    assert statistics.mean(times) < 0.05


def test_a_held_shard_still_being_read_ranks_as_needed_now_not_next_epoch() -> None:
    # Handed out and not back: its trainer reads it now (or opens it next, a lease taken ahead).
    # Ranked at its next epoch's place, it would be the first shard a fill evicted from under it.
    cluster = Cluster(spec(n=40, window=1))
    reading = cluster.lease("job", "n1", "t-a", complete=False)["shard"]
    read = cluster.lease("job", "n1", "t-b")["shard"]
    plan = cluster.report("n1", (reading, read), capacity=10 * SIZE)
    keep = keep_of(plan)
    assert keep.index(reading) < keep.index(read) == len(keep) - 1
    # Once back, it is needed next epoch like the other.
    cluster.state.apply(Complete("job", next(iter(cluster.state.jobs["job"].leases)), "t-a"), cluster.now)
    again = keep_of(cluster.report("n1", (reading, read), capacity=10 * SIZE))
    assert again.index(reading) >= len(again) - 2 and again.index(read) >= len(again) - 2
