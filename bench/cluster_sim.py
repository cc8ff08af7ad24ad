"""A model of one cache per cluster at a thousand nodes (issue 18): origin egress, peer traffic and
hit rates per epoch for per-node caches, the cluster cache, and the cluster cache with cache-aware
leases, with nodes replaced as the job runs. A model, not a load test: no daemon, no network, no
bytes; what it runs for real is the lease master's state machine.

- **The lease order is the master's.** Every lease, completion and release is an event applied to
  :class:`loader.master.server.state.MasterState` with an injected clock, and the cluster's ring
  reaches it as ``Placement`` events, as ``shardcache master --cluster`` logs them: the order the
  model measures is the one that ships (:func:`lease`, the one place the order comes from).
- **The caches are modelled** on the daemon's rules (``sidecar/daemon/peers/``, ``cache/store.py``):
  a node's hit is local; a miss on the object's owner (rendezvous over the live members, the
  daemons' own ``bucket/key`` naming) fills from the origin; a miss elsewhere reads the owner,
  which fills from the origin once if it lacks the object; the reader keeps a *borrowed* copy,
  evicted before any owned entry, LRU otherwise. A replaced node comes back empty under a new
  member id and node name; the ring changes, and only the shards that moved are re-placed.
- **Time:** one data-parallel job, one trainer stream per node (the bed's: two), each reading its
  shard at the node's stated rate (+/-10% per shard, seeded, so the trainers drift apart as real
  ones do); an epoch is ``dataset / (nodes x rate)`` and replacements (``--churn-per-hour``) land
  at their times in it. Reads are consumption-bound: no link or origin cap slows a read.
- **The master's plan** (issue 32; ``per_node_planned``, ``cluster_planned``: bench/cluster_plan.py):
  every daemon reports what it holds every ``interval_s`` the master answers (``plan_interval``:
  1 s at 4 nodes, 10 s at 1,000), through the master's own report path (``NodeBook``,
  ``resolve_report``, a ``Holdings`` event on the same ``MasterState``, ``Planner.plan``), and
  applies the plan: its ranks to the real ``PlannedPolicy``, its prefetches in order into room
  that evicts nothing the plan keeps. A prefetch completes at once (consumption-bound, as reads):
  on bytes the model is the policy's best case, and its origin figure what the policy itself costs,
  apart from timing. Each epoch's origin bytes stand beside the bound, ``max(0, 1 - the caches'
  total / dataset)``; planned rows run only where their reports fit ``--plan-reports``.

    python -m bench.cluster_sim               # ImageNet-1k, 10 TB and 2x the cluster cache at 1,000 nodes, the bed (minutes)
    python -m bench.cluster_sim --quick       # the CI smoke: smaller sweep, two epochs (< 20 s)
    python -m bench.cluster_sim --nodes 4     # the test bed's configurations only, and the model vs their figures

Results: ``bench/results/cluster_sim.json`` (machine facts, every figure, the assumptions) and
``cluster_sim.png``; with ``--quick`` none unless ``--out`` is given. ``compare`` sets the 4-node
model against ``bench/results/locality.json`` (``python -m bench.locality_bench``) and
``compare_capacity`` against ``bench/results/capacity.json`` (``python -m bench.capacity_bench``:
its sizes, the ``capacity`` scenario) when they exist.
"""

from __future__ import annotations

import argparse
import dataclasses
import heapq
import json
import math
import random
import statistics
import sys
import time
import zlib
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.capacity_bench import MODES as CAPACITY_MODES
from bench.cluster_plan import DaemonLink, PlannedCache, PlanService, plan_reports
from bench.common import REPO, RESULTS_DIR, machine_facts, write_results
from bench.locality_bench import MODES as BED_MODES
from loader.master.server.events import Complete, CreateJob, Lease, Placement, Release
from loader.master.server.holdings import plan_interval
from loader.master.server.spec import JobSpec
from loader.master.server.state import MasterState
from wire.nodeplan import NodePlan, name_hash
from wire.rendezvous import best, prefixed, score

__all__ = [
    "Scenario",
    "Policy",
    "Ring",
    "NodeCache",
    "Simulation",
    "lease",
    "policies_for",
    "planned_policies",
    "scenarios",
    "over_scenario",
    "bed_scenario",
    "capacity_scenario",
    "simulate",
    "run",
    "compare",
    "compare_capacity",
    "markdown",
    "plot",
    "main",
]

GB = 10**9
MB = 10**6
MIB = 2**20
JOB = "sim"
BUCKET = "sim-data"
DEFAULT_LOCALITY = RESULTS_DIR / "locality.json"
DEFAULT_CAPACITY = RESULTS_DIR / "capacity.json"
BED_READ_MB_S = 2 * 4.48
"""The bed's read rate per node, MB/s: two trainers of 4.48 MB/s each (batch x mean sample / compute
step: ``trainer_demand_mb_per_s`` of locality.json; capacity.json's 35.82 MB/s over 4 nodes)."""
PLAN_REPORTS_BUDGET = 100_000
"""Most node reports a planned policy may take in one scenario (:func:`plan_reports`'s estimate):
each costs the real master's report path and plan, ~1 ms here; past it the planned rows are left out."""
COMPARE_SEEDS = 8
"""The 4-node model is one random draw of orders; the figures set against the bed average this many seeds."""


# -- configuration ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Scenario:
    """A cluster, a dataset and a job."""

    name: str
    title: str
    nodes: int
    shards: int
    shard_bytes: int
    cache_bytes: int
    """Per node."""
    epochs: int
    read_mb_s: float
    """Per node: what its trainers consume, 10^6 bytes/s (an epoch is dataset / (nodes x rate))."""
    why_rate: str
    windows: tuple[int, ...]
    """The cache-aware windows swept (cluster cache); the last is also the per-node row's."""
    churn_per_hour: float = 0.01
    """Share of the nodes replaced per hour."""
    replace_per_epoch: float | None = None
    """Replacements per epoch, overriding ``churn_per_hour`` (tests; a stress run)."""
    trainers_per_node: int = 1
    seed: int = 0
    timed: bool = True
    """Whether the rate means anything (per-hour figures); False for the bed, whose epochs are short."""

    @property
    def dataset_bytes(self) -> int:
        return self.shards * self.shard_bytes

    @property
    def epoch_s(self) -> float:
        """The nominal epoch: every node reading its share at its rate."""
        return self.dataset_bytes / (self.nodes * self.read_mb_s * MB)

    @property
    def bound(self) -> float:
        """The least origin bytes an epoch can cost, over the dataset: what the caches together cannot
        hold (``bench.capacity_bench.bound``). The cluster cache holds ``nodes x cache``; per-node
        caches of one job count together too, since each shard is read once an epoch across the
        nodes and leases may go where it is cached. Whole shards, as the model caches them."""
        held = self.nodes * (self.cache_bytes // self.shard_bytes) * self.shard_bytes
        return max(0.0, 1.0 - held / self.dataset_bytes)

    @property
    def replacements_per_s(self) -> float:
        if self.replace_per_epoch is not None:
            return self.replace_per_epoch / self.epoch_s
        return self.churn_per_hour * self.nodes / 3600.0

    def setup(self) -> dict[str, Any]:
        return {
            "title": self.title, "nodes": self.nodes, "trainers_per_node": self.trainers_per_node,
            "shards": self.shards, "shard_bytes": self.shard_bytes, "dataset_bytes": self.dataset_bytes,
            "cache_bytes_per_node": self.cache_bytes, "cache_shards_per_node": self.cache_bytes // self.shard_bytes,
            "dataset_over_node_cache": round(self.dataset_bytes / self.cache_bytes, 4),
            "dataset_over_cluster_cache": round(self.dataset_bytes / (self.cache_bytes * self.nodes), 6),
            "epochs": self.epochs, "read_mb_s_per_node": self.read_mb_s, "why_this_rate": self.why_rate,
            "epoch_s_nominal": round(self.epoch_s, 4), "epochs_per_hour": round(3600 / self.epoch_s, 2),
            "churn_per_hour": self.churn_per_hour, "replace_per_epoch_override": self.replace_per_epoch,
            "replacements_per_epoch_expected": round(self.replacements_per_s * self.epoch_s, 5),
            # A replacement costs the cluster cache about 1/nodes of the dataset from the origin: the
            # removed member's shards (their next owners lack them, unless a copy was borrowed); the
            # ones the new, empty member takes over come from the member ranked next (a hand-off).
            "cluster_churn_origin_over_dataset_per_epoch_expected": round(
                self.replacements_per_s * self.epoch_s / self.nodes, 6),
            "windows": list(self.windows), "seed": self.seed,
            "bound_over_dataset": round(self.bound, 4),
            "plan_interval_s": plan_interval(self.nodes),
            "plan_reports_expected": plan_reports(self.nodes, self.epochs, self.epoch_s),
        }


@dataclass(frozen=True)
class Policy:
    name: str
    peers: bool
    """The cluster cache (daemons with peers); False: per-node caches, each an island."""
    window: int
    """The job's ``locality_window``; 0: the plain seeded order."""
    label: str
    planned: bool = False
    """The master's plan (issue 32): daemons report their holdings and take its plan, prefetching
    and evicting by it (``--eviction planned --master``); needs a window (the plan is for windowed jobs)."""


def policies_for(scenario: Scenario, plan_budget: int = PLAN_REPORTS_BUDGET) -> list[Policy]:
    """Per-node caches, the cluster cache, the cluster cache with each window of the sweep,
    per-node caches with the widest window (the "cached on" preference alone), and both with the
    master's plan when the reports they take fit ``plan_budget``."""
    out = [Policy("per_node", False, 0, "per-node caches (no peers)"),
           Policy("cluster", True, 0, "cluster cache")]
    out += [Policy(f"cluster_aware_w{w}", True, w, f"cluster cache, cache-aware leases W={w}") for w in scenario.windows]
    w = scenario.windows[-1]
    out.append(Policy(f"per_node_aware_w{w}", False, w, f"per-node caches, cache-aware leases W={w}"))
    if plan_reports(scenario.nodes, scenario.epochs, scenario.epoch_s) <= plan_budget:
        out += planned_policies(scenario)
    return out


def planned_policies(scenario: Scenario) -> list[Policy]:
    """Per-node caches and the cluster cache with the master's plan, at the widest window of the
    sweep (the one the per-node row uses; the bed's 16)."""
    w = scenario.windows[-1]
    return [Policy("per_node_planned", False, w, f"per-node caches, the master's plan W={w}", planned=True),
            Policy("cluster_planned", True, w, f"cluster cache, the master's plan W={w}", planned=True)]


def scenarios(nodes: int = 1000, quick: bool = False) -> list[Scenario]:
    """ImageNet-1k and a 10 TB dataset on ``nodes`` nodes with 2 TB of cache each; without
    ``quick``, also a dataset twice the cluster cache (:func:`over_scenario`)."""
    epochs = 2 if quick else 4
    return [
        Scenario(
            "imagenet", "ImageNet-1k", nodes, 1500, 100 * MB, 2000 * GB, epochs, 1000.0,
            "a vision model on 8 GPUs per node: ~9,000 JPEGs of ~110 KB per second",
            (16, 256) if quick else (16, 256, 1024, 4096),
        ),
        Scenario(
            "10tb", "10 TB dataset", nodes, 2000 if quick else 10_000, 5 * GB if quick else GB, 2000 * GB, epochs, 10.0,
            "a large multimodal model whose step time, not I/O, sets the pace: ~100 samples of 100 KB per second "
            "per node",
            (256,) if quick else (16, 256, 1024, 4096),
        ),
        *([] if quick else [over_scenario(nodes)]),
    ]


def over_scenario(nodes: int = 1000, epochs: int = 3) -> Scenario:
    """The capacity bench's ratios at ``nodes`` nodes: 12 shards of cache a node, a dataset twice
    the cluster cache, two trainers a node, each reading a shard in half the master's report
    interval (at 1,000 nodes 10 s: 5 s a 1 GB shard), as on the bed (0.47 s a shard, 1 s)."""
    shard = GB
    read_s = plan_interval(nodes) / 2
    return Scenario(
        "over", "dataset 2x the cluster cache", nodes, 24 * nodes, shard, 12 * shard, epochs,
        round(2 * shard / MB / read_s, 3),
        "the bed's pace against the master's reports (two shard reads a trainer per report interval); the "
        "shard and cache sizes stand for their ratio only (12 shards a node, as the capacity bench's)",
        # A cache-aware lease finds a local shard when its window spans several shards of every node:
        # W/nodes as on the bed (16/4) needs the sweep's widest window here.
        (256, 4096), trainers_per_node=2,
    )


def bed_scenario(epochs: int = 3, window: int = 16, trainers_per_node: int = 2, shards: int = 96,
                 shard_bytes: int = 2 * MIB, cache_bytes: int = 96 * MIB, nodes: int = 4, seed: int = 0,
                 read_mb_s: float = BED_READ_MB_S) -> Scenario:
    """The multi-host test bed (``bench.locality_bench``): 4 nodes, 2 trainers each, a dataset
    twice one node's cache and half the cluster's, no churn."""
    return Scenario(
        "bed", "4-node test bed", nodes, shards, shard_bytes, cache_bytes, epochs, read_mb_s,
        "the bed's trainers; only the planned rows depend on it (shards read per report), the others "
        "on no rate",
        tuple(sorted({4, window})), churn_per_hour=0.0, trainers_per_node=trainers_per_node, seed=seed, timed=False,
    )


def capacity_scenario(epochs: int = 3, window: int = 16, trainers_per_node: int = 2, shards: int = 101,
                      dataset_bytes: int = 205_271_040, over: float = 2.0, nodes: int = 4, peers: bool = True,
                      read_mb_s: float = BED_READ_MB_S, seed: int = 0) -> Scenario:
    """The bed as ``bench.capacity_bench`` sizes it: 101 shards of ~2 MB, the dataset ``over`` x
    the cluster's cache (``peers``: 12 shards a node) or x one node's (per-node caches: 50)."""
    # capacity_bench._cache_bytes: the dataset over `over`, split across the nodes with peers.
    cache = int(dataset_bytes / over / nodes) if peers else int(dataset_bytes / over)
    return Scenario(
        "capacity" if peers else "capacity_per_node", "4-node bed, capacity bench sizes", nodes, shards,
        dataset_bytes // shards, cache, epochs, read_mb_s,
        "the bed's trainers; only the planned rows depend on it (shards read per report)",
        (window,), churn_per_hour=0.0, trainers_per_node=trainers_per_node, seed=seed, timed=False,
    )


# -- the ring and the caches (the daemons' rules) ------------------------------------------------


class Ring:
    """The owner of each shard under a set of members, by :mod:`wire.rendezvous` (its ``best`` and
    ``score``: the daemons' rule), kept per shard and updated incrementally: a member leaving
    re-ranks only its own shards, one joining takes a shard only where its score beats the owner's.
    Building costs shards x members hashes; a change, shards."""

    __slots__ = ("_names", "members", "owner", "score", "owned")

    def __init__(self, names: Sequence[str], members: Iterable[str]) -> None:
        self._names = list(names)
        self.members: list[str] = list(dict.fromkeys(members))
        self.owned: dict[str, set[int]] = {m: set() for m in self.members}
        self.owner: list[str] = []
        self.score: list[int] = []
        prefixes = prefixed(self.members)
        for shard, name in enumerate(self._names):
            top, member = best(prefixes, name) if prefixes else (0, "")
            self.owner.append(member)
            self.score.append(top)
            if member:
                self.owned[member].add(shard)

    def runner_up(self, shard: int) -> str:
        """The member ranked after the owner for ``shard`` ("" when there is none)."""
        others = [m for m in self.members if m != self.owner[shard]]
        return best(prefixed(others), self._names[shard])[1] if others else ""

    def copy(self) -> Ring:
        other = Ring.__new__(Ring)
        other._names = self._names
        other.members = list(self.members)
        other.owner = list(self.owner)
        other.score = list(self.score)
        other.owned = {m: set(s) for m, s in self.owned.items()}
        return other

    def remove(self, member: str) -> int:
        """Drop ``member``; its shards go to the next in their ranking. Returns how many moved."""
        moved = self.owned.pop(member)
        self.members.remove(member)
        prefixes = prefixed(self.members)
        for shard in moved:
            top, owner = best(prefixes, self._names[shard])
            self.owner[shard] = owner
            self.score[shard] = top
            self.owned[owner].add(shard)
        return len(moved)

    def add(self, member: str) -> int:
        """Add ``member``; it takes each shard whose owner it outranks. Returns how many moved."""
        if member in self.owned:
            raise ValueError(f"{member} is in the ring already")
        mine: set[int] = set()
        for shard, name in enumerate(self._names):
            weight = score(member, name)
            if (weight, member) > (self.score[shard], self.owner[shard]):
                if self.owner[shard]:
                    self.owned[self.owner[shard]].discard(shard)
                self.owner[shard] = member
                self.score[shard] = weight
                mine.add(shard)
        self.members.append(member)
        self.owned[member] = mine
        return len(mine)


class NodeCache:
    """One daemon's store, in shards of one size: LRU, borrowed copies (objects another member
    owns) evicted before any owned entry (``cache/store.py``)."""

    __slots__ = ("capacity", "entries", "borrowed", "evictions")

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError("a node's cache must hold at least one shard: raise --cache-bytes or lower the shard size")
        self.capacity = capacity
        self.entries: OrderedDict[int, bool] = OrderedDict()
        """shard -> borrowed, least recently used first."""
        self.borrowed: OrderedDict[int, None] = OrderedDict()
        self.evictions = 0

    def __contains__(self, shard: int) -> bool:
        return shard in self.entries

    def hit(self, shard: int) -> bool:
        """A read of ``shard``: True (and it becomes the most recent) when it is here."""
        borrowed = self.entries.get(shard)
        if borrowed is None:
            return False
        self.entries.move_to_end(shard)
        if borrowed:
            self.borrowed.move_to_end(shard)
        return True

    def put(self, shard: int, borrowed: bool) -> None:
        """A fill; the flag is set at fill time and kept (the store's meta), as the daemon does."""
        if self.hit(shard):
            return
        while len(self.entries) >= self.capacity:
            if self.borrowed:
                victim, _ = self.borrowed.popitem(last=False)
                del self.entries[victim]
            else:
                self.entries.popitem(last=False)
            self.evictions += 1
        self.entries[shard] = borrowed
        if borrowed:
            self.borrowed[shard] = None


# -- the master (the one lease source) ------------------------------------------------------------


class Master:
    """The real lease state machine with an injected clock, and what its events cost."""

    def __init__(self, scenario: Scenario, policy: Policy, ttl_s: float) -> None:
        self.state = MasterState()
        raw: dict[str, Any] = {
            "name": JOB, "dataset": f"s3://{BUCKET}/{scenario.name}/",
            "shards": [{"key": key, "size": scenario.shard_bytes} for key in shard_keys(scenario.shards)],
            "epochs": scenario.epochs, "seed": scenario.seed, "shuffle": True, "lease_ttl_s": ttl_s,
        }
        if policy.window:
            raw["locality_window"] = policy.window
        self.state.apply(CreateJob(JobSpec.from_json(raw)), 0.0)
        self.job = self.state.job(JOB)
        self.granted_ns: list[tuple[int, int]] = []
        """(ns, epoch) of every lease event that granted a shard."""
        self.other_ns: list[int] = []
        """Lease events answered wait / epoch_done / finished."""
        self.after_placement_ns: list[int] = []
        """The first granted lease after each ring change (the window's index is rebuilt there)."""
        self.placement_ns: list[int] = []
        self._ids = 0
        self._placed = False

    def placement(self, members: Sequence[tuple[str, str]], now: float) -> None:
        event = Placement(members=tuple(members))
        started = time.perf_counter_ns()
        changed = self.state.apply(event, now).answer.get("changed", True)
        self.placement_ns.append(time.perf_counter_ns() - started)
        self._placed = self._placed or bool(changed) and len(self.placement_ns) > 1

    def lease(self, trainer: str, node: str, epoch: int, now: float) -> dict[str, Any]:
        self._ids += 1
        event = Lease(JOB, trainer, node, 1, epoch, (f"lease{self._ids:010d}",))
        started = time.perf_counter_ns()
        answer = self.state.apply(event, now).answer
        spent = time.perf_counter_ns() - started
        if answer.get("status") == "ok":
            self.granted_ns.append((spent, int(answer["leases"][0]["epoch"])))
            if self._placed:
                self.after_placement_ns.append(spent)
                self._placed = False
        else:
            self.other_ns.append(spent)
        return answer

    def costs(self) -> dict[str, Any]:
        """What the master's events cost, microseconds (this machine, one thread)."""
        granted = [ns / 1000 for ns, _ in self.granted_ns]
        return {
            "lease_us": _summary(granted),
            "first_lease_us": round(granted[0], 1) if granted else None,
            "lease_us_epoch1": _summary([ns / 1000 for ns, e in self.granted_ns if e == 0]),
            "lease_us_later_epochs": _summary([ns / 1000 for ns, e in self.granted_ns if e > 0]),
            "lease_us_first_after_ring_change": _summary([ns / 1000 for ns in self.after_placement_ns]),
            "lease_us_not_granted": _summary([ns / 1000 for ns in self.other_ns]),
            "placement_us": _summary([ns / 1000 for ns in self.placement_ns]),
        }

    def complete(self, lease_id: str, trainer: str, now: float) -> None:
        self.state.apply(Complete(JOB, lease_id, trainer), now)

    def release(self, lease_id: str, trainer: str, now: float) -> None:
        self.state.apply(Release(JOB, lease_id, trainer, 0), now)

    def status(self, now: float) -> dict[str, Any]:
        return self.state.status(JOB, now)


def lease(master: Master, trainer: str, node: str, epoch: int, now: float) -> dict[str, Any]:
    """THE lease source of the model: the master's answer to one trainer's request for one shard
    of ``epoch`` (the loader's default, non-continuous mode). Everything the model says about
    order and locality comes through here."""
    return master.lease(trainer, node, epoch, now)


def shard_keys(n: int) -> list[str]:
    return [f"train-{i:06d}.tar" for i in range(n)]


def object_names(scenario: Scenario) -> list[str]:
    """What the daemons hash for the ring: ``bucket/key`` (the job's prefix + the shard key)."""
    return [f"{BUCKET}/{scenario.name}/{key}" for key in shard_keys(scenario.shards)]


def member_of(i: int) -> str:
    """Node ``i``'s daemon (a normalized ``--advertise-url``); a replacement gets a fresh ``i``."""
    return f"http://10.{i >> 16 & 255}.{i >> 8 & 255}.{i & 255}:8600"


# -- the simulation ---------------------------------------------------------------------------------


@dataclass(slots=True)
class Node:
    name: str
    member: str
    cache: NodeCache | PlannedCache
    alive: bool = True
    link: DaemonLink | None = None
    """Its reports to the master (planned policies only)."""


@dataclass(slots=True)
class Trainer:
    name: str
    node: Node
    rng: random.Random
    epoch: int = 0
    lease: tuple[str, int, int] | None = None
    """(lease id, shard, epoch) being read."""
    alive: bool = True


@dataclass
class EpochStats:
    reads: int = 0
    local: int = 0
    peer_hit: int = 0
    origin: int = 0
    origin_bytes: int = 0
    peer_bytes: int = 0
    completions: int = 0
    replacements: int = 0
    reports: int = 0
    prefetches: int = 0
    prefetch_bytes: int = 0
    no_room: int = 0
    """Plan items not fetched: no room but what the plan keeps."""
    prefetch_read: int = 0
    """Plan fills read (by a trainer, or a peer from the owner) since the last epoch closed."""
    prefetch_wasted: int = 0
    """Plan fills evicted unread (or lost with a replaced node) since the last epoch closed."""
    displaced: int = 0
    """Entries already read that plan fills evicted since the last epoch closed."""
    started: float | None = None
    ended: float | None = None
    master: dict[str, Any] = field(default_factory=dict)


class Simulation:
    """One scenario under one policy: trainers lease, read and complete through the master;
    nodes are replaced at their times; every read is classified local / peer / origin. Under a
    planned policy each node also reports to the master every ``interval_s`` its plan says, and
    applies the plan it gets (:meth:`_report`)."""

    def __init__(self, scenario: Scenario, policy: Policy, ring: Ring | None = None) -> None:
        if policy.planned and not policy.window:
            raise ValueError("the master plans only for a job with a locality_window")
        self.sc = scenario
        self.policy = policy
        rate = scenario.read_mb_s * MB / scenario.trainers_per_node
        self.read_s = scenario.shard_bytes / rate
        ttl = min(86400.0, max(30.0, math.ceil(4 * self.read_s)))
        self.master = Master(scenario, policy, ttl)
        capacity = scenario.cache_bytes // scenario.shard_bytes
        self.keys = [f"{scenario.name}/{key}" for key in shard_keys(scenario.shards)]
        """Each shard's object key in BUCKET: the names daemons hash and plans list."""
        self.shard_of_key = {key: i for i, key in enumerate(self.keys)}
        self.plans = PlanService(self.master.state) if policy.planned else None
        self.on_node: dict[str, set[str]] = {}
        """node -> its live trainers: the service's ``_trainer_nodes`` for the one job."""
        self.nodes: list[Node] = []
        self.by_member: dict[str, Node] = {}
        self.trainers: list[Trainer] = []
        for i in range(scenario.nodes):
            self._new_node(i, capacity)
        self.capacity = capacity
        members = [n.member for n in self.nodes]
        self.ring = (ring.copy() if ring is not None else Ring(object_names(scenario), members)) if policy.peers else None
        if self.ring is not None and sorted(self.ring.members) != sorted(members):
            raise ValueError("the ring given is not over this scenario's members")
        self.churn = random.Random(f"churn:{scenario.seed}")
        self.heap: list[tuple[float, int, int]] = []
        self._seq = 0
        self._wakes = 0
        """Trainer wake-ups in the heap (reports and replacements never end)."""
        self._plan_seen = (0, 0, 0)
        """(read, wasted, displaced) summed over the planned caches at the last epoch close."""
        self.parked: list[int] = []
        self.epochs = [EpochStats() for _ in range(scenario.epochs)]
        self.completed: list[bytearray] = [bytearray(scenario.shards) for _ in range(scenario.epochs)]
        self.handed: list[list[int]] = [[] for _ in range(scenario.epochs)]
        """Each epoch's shards in the order the master handed them out (re-issues included)."""
        self.replacements: list[dict[str, Any]] = []
        self.now = 0.0
        self._kinds_before: dict[str, int] = {}

    # -- setup and churn --

    def _new_node(self, i: int, capacity: int) -> Node:
        name = f"node-{i:04d}"
        if self.plans is not None:
            cache = PlannedCache(capacity, BUCKET, self.keys, self.sc.shard_bytes)
            node = Node(name, member_of(i), cache, link=DaemonLink(name, f"daemon{i}", cache))
        else:
            node = Node(name, member_of(i), NodeCache(capacity))
        self.nodes.append(node)
        self.by_member[node.member] = node
        on = self.on_node[node.name] = set()
        for k in range(self.sc.trainers_per_node):
            name = f"{node.name}.t{k}"
            seed = zlib.crc32(name.encode()) ^ (self.sc.seed * 0x9E3779B1 & 0xFFFFFFFF)
            self.trainers.append(Trainer(name, node, random.Random(seed)))
            on.add(name)
        return node

    def _placement(self) -> None:
        if self.policy.peers and self.policy.window:
            self.master.placement([(n.member, n.name) for n in self.nodes if n.alive], self.now)

    def _push(self, at: float, what: int) -> None:
        """``what`` >= 0: a trainer's index wakes; -1: the next replacement; -2 - i: node ``i`` reports."""
        self._seq += 1
        self._wakes += what >= 0
        heapq.heappush(self.heap, (at, self._seq, what))

    def _replace(self) -> None:
        live = [n for n in self.nodes if n.alive]
        victim = live[self.churn.randrange(len(live))]
        victim.alive = False
        self.on_node.pop(victim.name, None)
        if isinstance(victim.cache, PlannedCache):  # its plan fills not read yet go with it
            victim.cache.wasted += len(victim.cache.unread)
            victim.cache.unread.clear()
        epoch = min(self.master.job.epoch, self.sc.epochs - 1)
        self.epochs[epoch].replacements += 1
        for t in self.trainers:
            if t.node is victim and t.alive:
                t.alive = False
                if t.lease is not None:
                    # The trainer goes with its node: its shard is handed out again at once (the
                    # loader releases on a clean exit; a crash waits for the lease's TTL instead).
                    self.master.release(t.lease[0], t.name, self.now)
                    t.lease = None
        first = len(self.trainers)
        fresh = self._new_node(len(self.nodes), self.capacity)
        moved = 0
        if self.ring is not None:
            moved = self.ring.remove(victim.member)
            moved += self.ring.add(fresh.member)
        self._placement()
        self.replacements.append({"at_s": round(self.now, 3), "epoch": epoch + 1, "removed": victim.name,
                                  "added": fresh.name, "shards_moved": moved})
        for i in range(first, len(self.trainers)):
            self.trainers[i].epoch = self.master.job.epoch
            self._push(self.now, i)
        if fresh.link is not None:
            self._push(self.now, -1 - len(self.nodes))  # its daemon reports as it starts
        self._unpark()

    def _unpark(self) -> None:
        for i in self.parked:
            self._push(self.now, i)
        self.parked.clear()

    # -- reads --

    def _read(self, node: Node, shard: int, stats: EpochStats) -> None:
        size = self.sc.shard_bytes
        stats.reads += 1
        if node.cache.hit(shard):
            stats.local += 1
            return
        if self.ring is None:
            stats.origin += 1
            stats.origin_bytes += size
            node.cache.put(shard, False)
            return
        owner = self.by_member[self.ring.owner[shard]]
        if owner is node:
            self._owner_fill(owner, shard, stats)
            return
        stats.peer_bytes += size
        if owner.cache.hit(shard):
            stats.peer_hit += 1
        else:
            # The owner fills it once, for every member that asks.
            self._owner_fill(owner, shard, stats)
        node.cache.put(shard, True)

    def _owner_fill(self, owner: Node, shard: int, stats: EpochStats, read: bool = True) -> None:
        """The owner's miss, filled: a demand fill (a trainer's read, or a peer's plan fill, waits on it)."""
        self._owner_source(owner, shard, stats, read)
        owner.cache.put(shard, False)

    def _owner_source(self, owner: Node, shard: int, stats: EpochStats, read: bool) -> None:
        """Where the owner's miss comes from, counted: a hand-off (sidecar/daemon/peers/origin.py)
        from the member ranked next when that one holds it (it owned it before this owner joined),
        else the origin. ``read``: a trainer's read waits on it (classified peer or origin)."""
        size = self.sc.shard_bytes
        if any(shard in other.cache for other in self.by_member.values() if other is not owner):
            second = self.by_member.get(self.ring.runner_up(shard)) if self.ring is not None else None
            if second is not None and second.cache.hit(shard):
                stats.peer_bytes += size
                stats.peer_hit += read
                return
        stats.origin += read
        stats.origin_bytes += size

    # -- the master's plan (planned policies) --

    def _report(self, index: int) -> None:
        """Node ``index``'s daemon reports (a full report first, then deltas) and applies the
        plan the master answers; its next report comes when the plan says."""
        node = self.nodes[index]
        if not node.alive or node.link is None or self.plans is None:
            return
        report = node.link.build()
        plan = self.plans.report(node.name, report, {JOB: self.on_node}, self.now)
        self._stats_now().reports += 1
        delay = node.link.answered(report, plan)
        if plan.resend is None:
            self._apply_plan(node, plan)
        self._push(self.now + delay, -2 - index)

    def _stats_now(self) -> EpochStats:
        """The epoch bytes moved now count in: the oldest one not complete."""
        return self.epochs[min(self.master.job.epoch, self.sc.epochs - 1)]

    def _apply_plan(self, node: Node, plan: NodePlan) -> None:
        """``MasterLink.apply`` and the prefetcher (sidecar/daemon/masterlink.py, prefetch.py): the
        plan's keep, then its prefetches, ranked for eviction; then each prefetch in order, skipped
        when cached, fetched only while ``plan_room`` holds, filled under ``spare_kept`` (evicting
        nothing the plan ranks). Fills complete at once (the model is consumption-bound)."""
        cache = node.cache
        assert isinstance(cache, PlannedCache)
        cache.set_plan([*plan.keep, *(name_hash(item.bucket, item.key) for item in plan.prefetch)])
        stats = self._stats_now()
        for item in plan.prefetch:
            shard = self.shard_of_key.get(item.key)
            if shard is None or shard in cache:
                continue
            if not cache.plan_room():
                stats.no_room += 1
                continue
            borrowed = self._plan_source(node, shard, stats)
            if not cache.plan_fill(shard, borrowed):  # plan_room held and nothing is pinned: it fits
                raise RuntimeError(f"{node.name}: a plan fill of shard {shard} was refused after plan_room")
            stats.prefetches += 1
            stats.prefetch_bytes += self.sc.shard_bytes

    def _plan_source(self, node: Node, shard: int, stats: EpochStats) -> bool:
        """Where a plan fill of ``shard`` on ``node`` comes from, counted as a read's would be (a
        prefetch goes through the daemon's read path, peers included); whether the copy is borrowed."""
        if self.ring is None:
            stats.origin_bytes += self.sc.shard_bytes
            return False
        owner = self.by_member[self.ring.owner[shard]]
        if owner is node:
            self._owner_source(owner, shard, stats, read=False)
            return False
        stats.peer_bytes += self.sc.shard_bytes
        if not owner.cache.hit(shard):
            self._owner_fill(owner, shard, stats, read=False)
        return True

    def _plan_tally(self, stats: EpochStats) -> None:
        """What became of plan fills since the last epoch close: read, or evicted unread."""
        caches = [n.cache for n in self.nodes if isinstance(n.cache, PlannedCache)]
        now = (sum(c.used for c in caches), sum(c.wasted for c in caches), sum(c.displaced for c in caches))
        stats.prefetch_read += now[0] - self._plan_seen[0]
        stats.prefetch_wasted += now[1] - self._plan_seen[1]
        stats.displaced += now[2] - self._plan_seen[2]
        self._plan_seen = now

    # -- the event loop --

    def _epoch_closed(self, epoch: int) -> None:
        stats = self.epochs[epoch]
        stats.ended = self.now
        if self.plans is not None:
            self._plan_tally(stats)
        loc = self.master.status(self.now).get("locality")
        if loc:
            kinds = dict(loc.get("leases") or {})
            delta = {k: v - self._kinds_before.get(k, 0) for k, v in kinds.items()}
            self._kinds_before = kinds
            placed = sum(v for k, v in delta.items() if k != "unplaced")
            order: dict[str, Any] = next((e for e in loc.get("epochs") or [] if e.get("epoch") == epoch), {})
            stats.master = {
                "leases": delta,
                "local_share": round((delta.get("owner", 0) + delta.get("cached", 0)) / placed, 4) if placed else None,
                "mean_displacement": order.get("mean_displacement"), "max_displacement": order.get("max_displacement"),
                "spearman": order.get("spearman"),
            }

    def _wake(self, index: int) -> None:
        t = self.trainers[index]
        if not t.alive:
            return
        if t.lease is not None:
            lid, shard, epoch = t.lease
            before = self.master.job.epoch
            self.master.complete(lid, t.name, self.now)
            t.lease = None
            self.completed[epoch][shard] += 1
            self.epochs[epoch].completions += 1
            if self.master.job.epoch != before or self.master.job.finished:
                self._epoch_closed(epoch)
                self._unpark()
        while True:
            answer = lease(self.master, t.name, t.node.name, t.epoch, self.now)
            status = answer["status"]
            if status == "ok":
                grant = answer["leases"][0]
                epoch = int(grant["epoch"])
                stats = self.epochs[epoch]
                if stats.started is None:
                    stats.started = self.now
                shard = int(grant["shard"])
                t.lease = (grant["lease"], shard, epoch)
                self.handed[epoch].append(shard)
                self._read(t.node, shard, stats)
                self._push(self.now + self.read_s * t.rng.uniform(0.9, 1.1), index)
                return
            if status == "epoch_done":
                t.epoch += 1
                continue
            if status == "wait":
                # Parked until an epoch closes or a shard comes back (the real trainer polls).
                self.parked.append(index)
                return
            if status == "finished":
                return
            raise RuntimeError(f"the master answered a lease with {answer!r}: the model does not know that status")

    def run(self) -> dict[str, Any]:
        self._placement()
        for i in range(len(self.trainers)):
            self._push(0.0, i)
        if self.plans is not None:
            # Daemons start independently: each one's first report at a seeded point of the first
            # interval, then every interval_s its plans say (plan_interval: 1 s at the bed's size,
            # 10 s at 1,000 nodes).
            phase = random.Random(f"reports:{self.sc.seed}")
            first = plan_interval(len(self.nodes))
            for i in range(len(self.nodes)):
                self._push(phase.uniform(0.0, first), -2 - i)
        rate = self.sc.replacements_per_s
        if rate > 0:
            self._push(1.0 / rate, -1)
        while self.heap and not self.master.job.finished and (self._wakes or rate > 0):
            self.now, _, what = heapq.heappop(self.heap)
            if what == -1:
                self._replace()
                self._push(self.now + 1.0 / rate, -1)
            elif what <= -2:
                self._report(-2 - what)
            else:
                self._wakes -= 1
                self._wake(what)
        if not self.master.job.finished:
            raise RuntimeError(f"{self.sc.name}/{self.policy.name}: every trainer waits and nothing is in flight "
                               f"at t={self.now:.1f} s (epoch {self.master.job.epoch}): a lease leaked in the model")
        return self.result()

    # -- results --

    def result(self) -> dict[str, Any]:
        data = self.sc.dataset_bytes
        epochs = []
        for i, s in enumerate(self.epochs):
            reads = s.reads or 1
            epochs.append({
                "epoch": i + 1,
                "seconds": round((s.ended or 0.0) - (s.started or 0.0), 3),
                "reads": s.reads, "completions": s.completions, "replacements": s.replacements,
                "origin_bytes": s.origin_bytes, "origin_over_dataset": round(s.origin_bytes / data, 4),
                "peer_bytes": s.peer_bytes, "peer_over_dataset": round(s.peer_bytes / data, 4),
                "local_hit_rate": round(s.local / reads, 4), "peer_hit_rate": round(s.peer_hit / reads, 4),
                "origin_rate": round(s.origin / reads, 4),
                "bound_over_dataset": round(self.sc.bound, 4),
                "every_shard_once": all(c == 1 for c in self.completed[i]),
                **({"master": s.master} if s.master else {}),
                **({"plan": {"reports": s.reports, "prefetches": s.prefetches,
                             "prefetch_over_dataset": round(s.prefetch_bytes / data, 4), "no_room": s.no_room,
                             "prefetches_read": s.prefetch_read, "prefetches_evicted_unread": s.prefetch_wasted,
                             "read_entries_evicted_by_plan_fills": s.displaced}}
                   if self.plans is not None else {}),
            })
        loc = self.master.status(self.now).get("locality")
        steady = self.epochs[1:] or self.epochs
        per_hour = statistics.fmean(s.origin_bytes for s in steady) * 3600 / self.sc.epoch_s
        return {
            "label": self.policy.label, "peers": self.policy.peers, "window": self.policy.window,
            "planned": self.policy.planned,
            "epochs": epochs,
            **({"plan": self._plan_summary()} if self.plans is not None else {}),
            "origin_bytes_per_hour_after_epoch1": round(per_hour) if self.sc.timed else None,
            "replacements": self.replacements,
            "evictions": sum(n.cache.evictions for n in self.nodes),
            "master_cost": self.master.costs(),
            **({"locality": {k: loc[k] for k in ("leases", "local_share") if k in loc}} if loc else {}),
        }


    def _plan_summary(self) -> dict[str, Any]:
        assert self.plans is not None
        links = [n.link for n in self.nodes if n.link is not None]
        caches = [n.cache for n in self.nodes if isinstance(n.cache, PlannedCache) and n.alive]
        return {
            "reports": sum(link.reports for link in links), "resends": sum(link.resends for link in links),
            "holdings_events": self.plans.holdings,
            "prefetches_unread_at_end": sum(len(c.unread) for c in caches),
            "interval_s_last": plan_interval(self.plans.book.reporting(self.now)),
        }


def _summary(values: list[float]) -> dict[str, Any]:
    if not values:
        return {"count": 0}
    ordered = sorted(values)
    return {
        "count": len(values), "mean": round(statistics.fmean(values), 2), "p50": round(ordered[len(ordered) // 2], 2),
        "p99": round(ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))], 2), "max": round(ordered[-1], 2),
    }


def simulate(scenario: Scenario, policy: Policy, ring: Ring | None = None) -> dict[str, Any]:
    """Run one scenario under one policy; ``ring``: the scenario's initial ring, built once and
    shared by its policies (copied)."""
    started = time.perf_counter()
    out = Simulation(scenario, policy, ring).run()
    out["wall_s"] = round(time.perf_counter() - started, 3)
    return out


def run_scenario(scenario: Scenario, policies: Sequence[Policy], log: bool = True) -> dict[str, Any]:
    started = time.perf_counter()
    ring = Ring(object_names(scenario), [member_of(i) for i in range(scenario.nodes)])
    ring_s = time.perf_counter() - started
    rows: dict[str, Any] = {}
    for policy in policies:
        rows[policy.name] = row = simulate(scenario, policy, ring)
        if log:
            figures = ", ".join(f"e{e['epoch']} origin {e['origin_over_dataset']:.3f} peer {e['peer_over_dataset']:.3f} "
                                f"local {e['local_hit_rate']:.2f}" for e in row["epochs"])
            print(f"{scenario.name:9s} {policy.name:22s} {figures} ({row['wall_s']:.1f} s, "
                  f"{row['master_cost']['lease_us'].get('mean', 0):.0f} us/lease)", file=sys.stderr, flush=True)
    return {"setup": {**scenario.setup(), "ring_build_s": round(ring_s, 3)}, "policies": rows}


# -- the model against the bed ---------------------------------------------------------------------

def compare(path: Path = DEFAULT_LOCALITY, seeds: int = COMPARE_SEEDS) -> dict[str, Any]:
    """The 4-node model next to the bed's measured figures (``bench/results/locality.json``, per
    mode and epoch ``origin_over_dataset`` and ``peer_over_dataset``): both, and their absolute
    difference, the model averaged over ``seeds`` seeds. ``{"skipped": why}`` without the file."""
    if not path.exists():
        return {"skipped": f"{_shown(path)} not found: run the bed (sudo python -m bench.locality_bench) first"}
    measured = json.loads(path.read_text())
    setup = measured.get("setup") or {}
    modes = measured.get("modes") or {}
    window = int(setup.get("window") or 16)
    base = bed_scenario(
        epochs=int(setup.get("epochs") or 3), window=window,
        trainers_per_node=int(setup.get("trainers_per_node") or 2),
        shards=int(setup.get("shards") or 96),
        shard_bytes=(int(setup["dataset_bytes"]) // int(setup["shards"])
                     if setup.get("dataset_bytes") and setup.get("shards") else 2 * MIB),
        cache_bytes=int(setup.get("cache_bytes") or 96 * MIB), nodes=int(setup.get("nodes") or 4),
        read_mb_s=_bed_rate(setup),
    )
    out: dict[str, Any] = {"source": _shown(path), "model_seeds": seeds, "window": window, "setup": base.setup(), "modes": {}}
    worst = 0.0
    for mode, row in modes.items():
        bed = BED_MODES.get(mode)  # the bed's own modes: one definition for both
        if bed is None or not row.get("epochs"):
            continue
        w = int(row.get("locality_window") if row.get("locality_window") is not None else (window if bed.aware else 0))
        policy = Policy(bed.name, bed.peers, w, bed.name)
        runs = [simulate(dataclasses.replace(base, seed=s), policy)["epochs"] for s in range(seeds)]
        epochs, diff = _beside(runs, row["epochs"], base.epochs)
        worst = max(worst, diff)
        out["modes"][mode] = {"epochs": epochs}
    out["max_abs_diff"] = round(worst, 4)
    return out


def compare_capacity(path: Path = DEFAULT_CAPACITY, seeds: int = COMPARE_SEEDS) -> dict[str, Any]:
    """The model at ``bench.capacity_bench``'s sizes next to its measured figures
    (``bench/results/capacity.json``), as :func:`compare` does, per mode the model has: ``lru``
    (the daemons' LRU, borrowed copies first) and ``planned`` (the master's plan), each with the
    bed's cache-aware leases; ``hold`` is not modelled. Each epoch also carries the bound, the
    model's (whole shards) and the bed's."""
    if not path.exists():
        return {"skipped": f"{_shown(path)} not found: run the bed (sudo python -m bench.capacity_bench) first"}
    measured = json.loads(path.read_text())
    setup = measured.get("setup") or {}
    window = int(setup.get("window") or 16)
    sizes: dict[str, Any] = {
        "epochs": int(setup.get("epochs") or 3), "window": window,
        "trainers_per_node": int(setup.get("trainers_per_node") or 2), "shards": int(setup.get("shards") or 101),
        "dataset_bytes": int(setup.get("dataset_bytes") or 205_271_040), "over": float(setup.get("dataset_over_cache") or 2.0),
        "nodes": int(setup.get("nodes") or 4), "read_mb_s": _bed_rate(setup),
    }
    out: dict[str, Any] = {"source": _shown(path), "model_seeds": seeds, "window": window, "modes": {}}
    worst = 0.0
    for mode, row in (measured.get("modes") or {}).items():
        bed = CAPACITY_MODES.get(mode)
        if bed is None or not row.get("epochs"):
            continue
        if bed.policy not in ("lru", "planned"):
            out["modes"][mode] = {"skipped": f"{bed.policy} is not modelled"}
            continue
        base = capacity_scenario(**sizes, peers=bed.peers)
        policy = Policy(mode, bed.peers, window, bed.label, planned=bed.policy == "planned")
        runs = [simulate(dataclasses.replace(base, seed=s), policy)["epochs"] for s in range(seeds)]
        epochs, diff = _beside(runs, row["epochs"], base.epochs)
        for entry, m in zip(epochs, row["epochs"], strict=False):
            entry["bound"] = {"model": round(base.bound, 4), "measured": m.get("bound")}
            entry["local_hit_rate_model"] = round(statistics.fmean(r[entry["epoch"] - 1]["local_hit_rate"] for r in runs), 4)
        worst = max(worst, diff)
        out["modes"][mode] = {"setup": base.setup(), "epochs": epochs}
    out["max_abs_diff"] = round(worst, 4)
    return out


def _beside(runs: list[list[dict[str, Any]]], rows: list[dict[str, Any]], epochs: int) -> tuple[list[dict[str, Any]], float]:
    """Per measured epoch (up to ``epochs``): origin and peer bytes over the dataset, the model's
    mean and sd over ``runs`` (one per seed), the measured figure and their difference; and the
    largest difference."""
    out: list[dict[str, Any]] = []
    worst = 0.0
    for m in rows:
        e = int(m.get("epoch") or len(out) + 1)
        if e > epochs:
            break
        entry: dict[str, Any] = {"epoch": e}
        for key in ("origin_over_dataset", "peer_over_dataset"):
            values = [r[e - 1][key] for r in runs]
            model = round(statistics.fmean(values), 4)
            got = m.get(key)
            entry[key] = {"model": model, "model_sd": round(statistics.pstdev(values), 4), "measured": got,
                          "abs_diff": round(abs(model - float(got)), 4) if got is not None else None}
            if got is not None:
                worst = max(worst, abs(model - float(got)))
        out.append(entry)
    return out, worst


def _bed_rate(setup: dict[str, Any]) -> float:
    """A node's read rate on the bed, MB/s, from its results' setup (either bench's way of saying it)."""
    if setup.get("trainer_demand_mb_per_s") and setup.get("trainers_per_node"):
        return float(setup["trainer_demand_mb_per_s"]) * int(setup["trainers_per_node"])
    if setup.get("demand_mb_per_s") and setup.get("nodes"):
        return float(setup["demand_mb_per_s"]) / int(setup["nodes"])
    return BED_READ_MB_S


def _shown(path: Path) -> str:
    """``path`` relative to the checkout when it is in it (results travel between machines)."""
    try:
        return str(path.resolve().relative_to(REPO))
    except ValueError:
        return str(path)


# -- reporting --------------------------------------------------------------------------------------

ASSUMPTIONS = [
    "One data-parallel job, one trainer stream per node (the bed: two), each epoch every shard read once across the "
    "cluster; the lease order is the real master's (MasterState driven with Lease/Complete/Release/Placement events, "
    "non-continuous epochs as the loader's default), one shard per lease.",
    "Reads are consumption-bound: a shard takes shard_bytes / (node rate / trainers per node), +/-10% per shard "
    "(seeded); no link, owner or origin cap slows a read, so an epoch is dataset / (nodes x rate) for every policy.",
    "Caches follow the daemons' rules: hit local; miss on the owner -> origin; miss elsewhere -> the owner (which "
    "fills from the origin once when it lacks the shard) and a borrowed copy kept, evicted before owned entries, "
    "LRU otherwise. A fill is whole-shard and instantaneous for the cache state. Uniform shard sizes.",
    "Churn: replacements at evenly spaced times (churn_per_hour x nodes per hour), a random live node each; the "
    "replaced node's trainer releases its lease, the node comes back at once, empty, under a new member id and node "
    "name; the master learns the new ring at once (the real one polls every few seconds).",
    "Peer bytes: every byte a node reads from another node (including those the owner streams while filling). "
    "Hit rates are shares of reads (equal sizes: of bytes too): local + peer + origin = 1.",
    "Planned rows (issue 32): every daemon reports to the master every interval_s its plan says (plan_interval: "
    "1 s at 4 nodes, 10 s at 1,000), first at a seeded point of the first interval, a full report and then deltas "
    "(the real HeldNames); the master takes each as Service.node_report does (NodeBook, resolve_report, a Holdings "
    "event on the same MasterState, Planner.plan without its time budget) and the daemon applies the plan as "
    "MasterLink.apply does: keep + prefetch ranked in the real PlannedPolicy, prefetches in order into room that "
    "evicts nothing the plan ranks. Prefetches complete at once and count as origin (and peer) bytes of the epoch "
    "open then: the policy's best case on bytes, apart from timing. Skipped where the reports would pass the "
    "report budget (plan_reports_expected in the setup).",
    "Bound: max(0, 1 - nodes x cache / dataset) in whole shards, for the cluster cache and for per-node caches "
    "(one job reads each shard once an epoch across its nodes).",
]


def _fmt_list(values: Iterable[float], spec: str = ".2f") -> str:
    return ", ".join(f"{v:{spec}}" for v in values)


def markdown(result: dict[str, Any]) -> str:
    """README-ready tables: per scenario, a row per policy."""
    lines: list[str] = []
    for sc in result["scenarios"].values():
        s = sc["setup"]
        timing = (f"{s['read_mb_s_per_node']:g} MB/s per node -> {s['epoch_s_nominal']:g} s an epoch; "
                  f"{s['churn_per_hour'] * 100:g}% of the nodes replaced per hour = "
                  f"{s['replacements_per_epoch_expected']:g} per epoch" if s["churn_per_hour"] or s["replace_per_epoch_override"]
                  else "no churn")
        lines += [
            f"**{s['title']}**: {s['shards']:,} shards x {_size(s['shard_bytes'])} = {_size(s['dataset_bytes'])} "
            f"on {s['nodes']:,} nodes x {s['trainers_per_node']} trainer(s), {_size(s['cache_bytes_per_node'])} of cache "
            f"each; {timing}; bound {s['bound_over_dataset']:.3f} of the dataset an epoch.",
            "",
            "| policy | origin / dataset, per epoch | peer / dataset, per epoch | local hit rate, last epoch "
            "| local leases (master) | mean displacement / spearman | origin per hour after epoch 1 "
            "| master us per lease: mean, p99, first |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for row in sc["policies"].values():
            epochs = row["epochs"]
            last = epochs[-1]
            masters = [e.get("master") or {} for e in epochs]
            share = masters[-1].get("local_share")
            disp = [float(m["mean_displacement"]) for m in masters if m.get("mean_displacement") is not None]
            rho = [float(m["spearman"]) for m in masters if m.get("spearman") is not None]
            order = f"{statistics.fmean(disp):.1f} / {statistics.fmean(rho):.3f}" if disp and rho else "0 / 1 (plain)"
            cost = row["master_cost"]["lease_us"]
            lines.append(
                f"| {row['label']} | {_fmt_list(e['origin_over_dataset'] for e in epochs)} "
                f"| {_fmt_list(e['peer_over_dataset'] for e in epochs)} | {last['local_hit_rate'] * 100:.1f}% "
                f"| {'–' if share is None else f'{share * 100:.1f}%'} | {order} | {_per_hour(row['origin_bytes_per_hour_after_epoch1'])} "
                f"| {cost.get('mean', 0):.0f}, {cost.get('p99', 0):.0f}, {row['master_cost']['first_lease_us'] or 0:,.0f} |")
        lines.append("")
        lines += _plan_lines(sc)
    lines += [
        "Origin and peer bytes over the dataset's size, per epoch; hit rates are shares of reads; local leases: the "
        "master's count of leases whose shard's owner or last reader was the trainer's node (last epoch; – for the "
        "plain order, which counts none); displacement and spearman: how far the handed-out order moved from the "
        "seeded one (mean over epochs); origin per hour: epochs 2+ at the stated read rate (consumption-bound: "
        "per-node caches would need an origin that delivers it). Master cost: MasterState.apply of a granted "
        "Lease on this machine; first: the job's first lease (it places at most 16 positions of its window: O(members) hashes each).",
        "",
    ]
    cmp_ = result.get("compare") or {}
    if cmp_.get("modes"):
        lines += ["**Model vs the bed** (4 nodes; model: mean of "
                  f"{cmp_['model_seeds']} seeds; measured: `{cmp_['source']}`):", "",
                  "| mode | epoch | origin / dataset: model (sd), measured, diff | peer / dataset: model (sd), measured, diff |",
                  "|---|---|---|---|"]
        for mode, row in cmp_["modes"].items():
            for e in row.get("epochs", []):
                o, p = e["origin_over_dataset"], e["peer_over_dataset"]
                lines.append(f"| {mode} | {e['epoch']} | {o['model']:.3f} ({o['model_sd']:.3f}), {_opt(o['measured'])}, "
                             f"{_opt(o['abs_diff'])} | {p['model']:.3f} ({p['model_sd']:.3f}), {_opt(p['measured'])}, "
                             f"{_opt(p['abs_diff'])} |")
        lines += ["", f"Largest absolute difference: {cmp_['max_abs_diff']:.3f} of the dataset.", ""]
    elif cmp_.get("skipped"):
        lines += [f"Model vs the bed: skipped ({cmp_['skipped']}).", ""]
    lines += _capacity_lines(result.get("compare_capacity") or {})
    return "\n".join(lines)


def _plan_lines(sc: dict[str, Any]) -> list[str]:
    """What the plan did, per planned row and epoch (none when the scenario ran no planned row)."""
    rows = {name: row for name, row in sc["policies"].items() if row.get("planned")}
    if not rows:
        why = sc["setup"].get("plan_reports_expected")
        return [f"Planned rows: not run (~{why:,} reports expected, past the budget).", ""] if why is not None else []
    lines = ["| planned row | prefetched / dataset | prefetches read | evicted unread | read entries evicted by plan "
             "fills | reports |", "|---|---|---|---|---|---|"]
    for row in rows.values():
        plans = [e["plan"] for e in row["epochs"]]
        lines.append(f"| {row['label']} | {_fmt_list(p['prefetch_over_dataset'] for p in plans)} "
                     f"| {_fmt_list((p['prefetches_read'] for p in plans), 'd')} "
                     f"| {_fmt_list((p['prefetches_evicted_unread'] for p in plans), 'd')} "
                     f"| {_fmt_list((p['read_entries_evicted_by_plan_fills'] for p in plans), 'd')} "
                     f"| {_fmt_list((p['reports'] for p in plans), 'd')} |")
    return [*lines, ""]


def _capacity_lines(cmp_: dict[str, Any]) -> list[str]:
    if cmp_.get("skipped"):
        return [f"Model vs the capacity bench: skipped ({cmp_['skipped']}).", ""]
    if not cmp_.get("modes"):
        return []
    lines = [f"**Model vs the capacity bench** (4 nodes, its sizes; model: mean of {cmp_['model_seeds']} seeds; "
             f"measured: `{cmp_['source']}`):", "",
             "| mode | epoch | origin / dataset: model (sd), measured | bound: model, bed | peer / dataset: model, "
             "measured | local hit rate (model) |", "|---|---|---|---|---|---|"]
    for mode, row in cmp_["modes"].items():
        if row.get("skipped"):
            lines.append(f"| {mode} | – | {row['skipped']} | | | |")
            continue
        for e in row["epochs"]:
            o, p, b = e["origin_over_dataset"], e["peer_over_dataset"], e["bound"]
            lines.append(f"| {mode} | {e['epoch']} | {o['model']:.3f} ({o['model_sd']:.3f}), {_opt(o['measured'])} "
                         f"| {b['model']:.3f}, {_opt(b['measured'])} | {p['model']:.3f}, {_opt(p['measured'])} "
                         f"| {e['local_hit_rate_model'] * 100:.1f}% |")
    return [*lines, "", f"Largest absolute difference: {cmp_['max_abs_diff']:.3f} of the dataset.", ""]


def _size(n: int) -> str:
    """Decimal units as the datasets are stated (150 GB, 10 TB); the bed's MiB as it states them."""
    if n >= 10**12:
        return f"{n / 10**12:,.3g} TB"
    if n >= GB:
        return f"{n / GB:,.4g} GB"
    return f"{n / MIB:,.4g} MiB" if n % MIB == 0 else f"{n / MB:,.4g} MB"


def _per_hour(n: float | None) -> str:
    if n is None:
        return "–"
    for unit, size in (("PB", 10**15), ("TB", 10**12), ("GB", GB)):
        if n >= size:
            return f"{n / size:,.1f} {unit}"
    return f"{n / GB:,.2f} GB" if n else "0"


def _opt(value: Any) -> str:
    return "–" if value is None else f"{float(value):.3f}"


def plot(result: dict[str, Any], path: Path) -> Path | None:
    """Origin and peer bytes over the dataset per epoch, a panel per scenario; None without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scs = list(result["scenarios"].values())
    fig, axes = plt.subplots(2, len(scs), figsize=(5.2 * len(scs), 6.4), squeeze=False)
    for col, sc in enumerate(scs):
        for row, key, title in ((0, "origin_over_dataset", "origin bytes / dataset"), (1, "peer_over_dataset", "peer bytes / dataset")):
            ax = axes[row][col]
            for name, pol in sc["policies"].items():
                xs = [e["epoch"] for e in pol["epochs"]]
                ax.plot(xs, [e[key] for e in pol["epochs"]], marker="o", linewidth=1.2, label=name)
            ax.set_title(f"{sc['setup']['title']}, {sc['setup']['nodes']:,} nodes: {title}", fontsize=9)
            ax.set_xlabel("epoch")
            ax.set_xticks(range(1, sc["setup"]["epochs"] + 1))
            ax.grid(alpha=0.3)
            if key == "origin_over_dataset":
                ax.set_yscale("symlog", linthresh=0.01)
                ax.set_ylim(bottom=0)
        axes[0][col].legend(fontsize=7)
    fig.suptitle("cluster_sim: a model over the real lease master (not a load test)", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def run(chosen: Sequence[Scenario], locality: Path | None, command: str, capacity: Path | None = None,
        plan_budget: int = PLAN_REPORTS_BUDGET) -> dict[str, Any]:
    """Every scenario under its policies (:func:`policies_for`), and the model set beside the bed's
    figures (``locality``: bench.locality_bench's; ``capacity``: bench.capacity_bench's; None: not)."""
    started = time.perf_counter()
    result: dict[str, Any] = {
        "benchmark": "cluster_sim", "command": command, "machine": machine_facts(("xxhash", "shardcache")),
        "model": "a model, not a load test: the real lease master's state machine, modelled caches and clock",
        "assumptions": ASSUMPTIONS, "scenarios": {},
    }
    for scenario in chosen:
        result["scenarios"][scenario.name] = run_scenario(scenario, policies_for(scenario, plan_budget))
    result["summary"] = {
        name: {pol: {"origin_over_dataset": [e["origin_over_dataset"] for e in row["epochs"]],
                     "peer_over_dataset": [e["peer_over_dataset"] for e in row["epochs"]],
                     "local_hit_rate": [e["local_hit_rate"] for e in row["epochs"]],
                     "master_lease_us_mean": row["master_cost"]["lease_us"].get("mean")}
               for pol, row in sc["policies"].items()}
        for name, sc in result["scenarios"].items()
    }
    result["compare"] = compare(locality) if locality is not None else {"skipped": "not asked (--no-compare)"}
    result["compare_capacity"] = (compare_capacity(capacity) if capacity is not None
                                  else {"skipped": "not asked (--no-compare, or not the bed's size)"})
    result["elapsed_s"] = round(time.perf_counter() - started, 2)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.cluster_sim", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="the CI smoke: two epochs, a smaller sweep and 10 TB as 2,000 x 5 GB")
    parser.add_argument("--nodes", type=int, default=1000,
                        help="nodes of the large scenarios (default 1000); 4: the test bed's configuration only")
    parser.add_argument("--scenarios", default=None, help="comma-separated of imagenet, 10tb, bed (default all)")
    parser.add_argument("--epochs", type=int, default=None, help="epochs of the large scenarios (default 4; quick 2)")
    parser.add_argument("--windows", default=None, help="cache-aware windows to sweep, comma-separated (default per scenario)")
    parser.add_argument("--churn-per-hour", type=float, default=None, help="share of the nodes replaced per hour (default 0.01)")
    parser.add_argument("--replace-per-epoch", type=float, default=None, help="replacements per epoch (overrides --churn-per-hour)")
    parser.add_argument("--read-mb-s", type=float, default=None, help="per-node read rate, MB/s (default per scenario)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--locality", type=Path, default=DEFAULT_LOCALITY, help="the bed's results to compare with")
    parser.add_argument("--capacity", type=Path, default=DEFAULT_CAPACITY,
                        help="the capacity bench's results to compare with (not with --quick)")
    parser.add_argument("--no-compare", action="store_true")
    parser.add_argument("--plan-reports", type=int, default=PLAN_REPORTS_BUDGET,
                        help=f"most node reports a planned row may take (default {PLAN_REPORTS_BUDGET:,}); "
                             "scenarios past it run no planned rows")
    parser.add_argument("--out", type=Path, default=None,
                        help="results JSON (default bench/results/cluster_sim.json; with --quick or --nodes none unless given)")
    args = parser.parse_args(argv)
    if args.nodes < 2 or (args.epochs is not None and args.epochs < 2):
        parser.error("--nodes must be >= 2 and --epochs >= 2")
    if args.nodes == 4:
        chosen = [bed_scenario(), capacity_scenario()]
    else:
        chosen = [*scenarios(args.nodes, args.quick), bed_scenario(epochs=2 if args.quick else 3),
                  *([] if args.quick else [capacity_scenario()])]
    if args.scenarios:
        wanted = {s.strip() for s in args.scenarios.split(",") if s.strip()}
        unknown = wanted - {s.name for s in chosen}
        if unknown:
            parser.error(f"unknown scenario(s) {', '.join(sorted(unknown))}; known: {', '.join(s.name for s in chosen)}")
        chosen = [s for s in chosen if s.name in wanted]
    changes: dict[str, Any] = {"seed": args.seed}
    if args.churn_per_hour is not None:
        changes["churn_per_hour"] = args.churn_per_hour
    if args.replace_per_epoch is not None:
        changes["replace_per_epoch"] = args.replace_per_epoch
    if args.read_mb_s is not None:
        changes["read_mb_s"] = args.read_mb_s
    if args.windows:
        try:
            changes["windows"] = tuple(sorted({int(w) for w in args.windows.split(",")}))
        except ValueError:
            parser.error("--windows takes integers, e.g. 16,256,4096")
    chosen = [dataclasses.replace(s, **changes, **({"epochs": args.epochs} if args.epochs and s.timed else {}))
              for s in chosen]
    command = "python -m bench.cluster_sim" + ("" if not (argv if argv is not None else sys.argv[1:]) else " " + " ".join(
        argv if argv is not None else sys.argv[1:]))
    result = run(chosen, None if args.no_compare else args.locality, command,
                 None if args.no_compare or args.quick else args.capacity, args.plan_reports)
    table = markdown(result)
    out = args.out or (None if args.quick or args.nodes != 1000 or args.scenarios else RESULTS_DIR / "cluster_sim.json")
    if out is not None:
        png = plot(result, out.with_suffix(".png"))
        result["plot"] = png.name if png is not None else None
        write_results(out, result)
        print(f"results: {out}" + (f", {png}" if png is not None else ""), file=sys.stderr)
    print(table)
    print(f"cluster_sim: {result['elapsed_s']:.1f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
