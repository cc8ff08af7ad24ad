"""What node daemons hold, and the plan the master answers their reports with (issue 32).

A daemon started with ``--master URL`` posts ``POST /v1/nodes/{node}/report`` every few seconds
(``wire/nodeplan.py``: everything it caches, or a delta on its previous report). Three things
follow, each here:

- **Holdings, as state.** The service keeps of a report only the hashes that name a shard of a
  job with a ``locality_window`` (:func:`resolve_report`, off the event loop when large) and
  submits them as a journaled ``Holdings`` event when the report changes something. The state
  machine applies it (:func:`loader.master.server.state.apply_holdings`): each shard named held gets the node as its holder
  (``locality.Readers``), a full report first clears the node from the job's table, a dropped one
  is cleared if the node held it. Leases then prefer, inside the window, a shard held by the
  trainer's node (``locality.JobLocality.is_local``): everything a lease consults is state, so a
  replayed or restored master chooses as the live one did.
- **The node's bookkeeping** (:class:`NodeBook`: in memory only, never journaled). Per node: its
  daemon instance, the last report applied (a delta applies only on it; else ``resend: "full"``),
  its capacity, what it holds of each windowed job (:class:`HeldSet`) and the daemon's per-job
  counters, for the job status' ``cache`` view (:meth:`NodeBook.view`). A master restarted or newly
  elected holds none of it, so every node's next delta is answered ``resend: "full"``, as is a
  delta from a node whose last full report predates a windowed job (the job learns what is cached).
- **The plan** (:class:`Planner`: computed per report, read-only on the state; not state). For
  each windowed job with trainers on the node: ``desired`` = the ``slots`` shards with the
  soonest next use among those the node holds and those *assigned* to it (the ring owner's node
  with ``--cluster``, else rendezvous over the job's trainer nodes); ``prefetch`` = desired and
  not held, ``keep`` = desired and held, both soonest first.

What a plan costs. Per report and job O(held + found): the node's held shards ranked by their next
use (two array reads each), plus its assigned positions from the cursor (a per-node list of them:
O(found)). The lists are built once per (job, epoch, assignment) and shared by every node: O(n)
positions an epoch (each one seeded-order lookup, ~10 µs, and its assigned node: memoised per
shard, O(nodes) hashes the first time), in slices of at most :data:`PLAN_BUDGET_S` per report, so
no report holds the event loop long; until a list reaches far enough a plan is shorter, never
wrong. Measured (tests/master/test_master_plan.py ``test_plan_cost_at_1000_nodes``, slow tier, one
core of a 2-core machine): 100,000 shards, a ring of 1,000 nodes with a trainer each, 100 slots and
100 held shards a node: a report (a full one, applied) and its plan 0.61 ms on average, p99 0.96 ms,
once the lists are built. Building them is the one-time cost: the first epoch 15.6 s of CPU in all
(100,000 owners over 1,000 members, ~150 µs each, plus the order), each later epoch 0.9 s (the
order; owners stay memoised), spread over reports 20 ms at a time. The answer's ``interval_s``
(:func:`plan_interval`) grows with the reporting nodes, max(2, nodes / 100) s, so the master plans
at most ~100 reports a second: at 1,000 nodes ~0.06 of a core.

Memory: the state's holder table, 2 bytes a shard of a windowed job, and its hash index
(:class:`loader.master.server.locality.ShardIndex`), 12 bytes a shard, built on the first report; in the service, a node's
holdings 12 bytes a held shard (shard + hash), and for a planned job 8 bytes a shard per epoch
layout (two: the open epoch and the next) plus 4 bytes a covered position, and without a ring
20 bytes a shard for the trainer-node owners' memo.
"""

from __future__ import annotations

import bisect
import heapq
import math
import time
from array import array
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from operator import itemgetter
from typing import TYPE_CHECKING, Any

from loader.master.server.locality import JobLocality, Owners, Ring, ShardIndex, job_index
from wire.nodeplan import JOB_COUNTERS, MAX_KEEP, MAX_PREFETCH, NodePlan, NodeReport, PrefetchItem
from wire.shuffle import EpochOrder

if TYPE_CHECKING:
    from loader.master.server.spec import JobSpec
    from loader.master.server.state import EpochState, JobState, MasterState

__all__ = [
    "REPORT_VIEW_S",
    "RECORD_KEEP_S",
    "TRAINER_RECENT_S",
    "VIEW_MAX_NODES",
    "PLAN_BUDGET_S",
    "PLAN_STALE_SHARE",
    "MIN_PLAN_INTERVAL_S",
    "DEFAULT_ENTRY_BYTES",
    "Resolution",
    "resolve_report",
    "HeldSet",
    "NodeRecord",
    "NodeBook",
    "Planner",
    "plan_interval",
]

REPORT_VIEW_S = 300.0
"""A node that has not reported for this long leaves the jobs' ``cache`` view."""
RECORD_KEEP_S = 3600.0
"""A node that has not reported for this long is forgotten (its counters stay in the totals); its
next report, a delta, is answered ``resend: "full"``."""
TRAINER_RECENT_S = 60.0
"""A trainer counts as on a node while it holds a live lease leased from it, or was seen (any
call) within this long after leasing from it."""
VIEW_MAX_NODES = 1000
"""Most nodes a job's ``cache.nodes`` lists (sorted by node name; beyond it, the most waiting and
then the lowest hit rates are kept); ``nodes_omitted`` counts the rest,
whose figures are still in ``totals``."""
PLAN_BUDGET_S = 0.02
"""Most time one report may spend extending a job's shared position lists (the event loop's)."""
PLAN_LEAD_PER_TRAINER = 2
"""How far ahead a node's plan fetches: its next positions in the job's order, this many per
trainer of the job on the node (at most half the job's share of the cache); the shards of those
it does not hold are fetched. Only a lead: the rest of the share keeps the held shards needed
soonest (Belady's rule over the known order). A plan that filled the whole share
with the shards needed next pushed out, at every plan, each shard just read (its next use is in
the next epoch, behind every shard not yet read) for one of this epoch's: the cache became a
prefetch buffer that kept nothing across epochs, and a dataset twice the cluster's cache was
fetched at 0.85-0.88 of itself an epoch where the bound is 0.5 (``bench.cluster_sim``'s
capacity scenario and the bed's ``bench.capacity_bench``). While the job's trainers on the node
wait, the lead is of shards to fetch instead (:class:`_Lead`)."""
LEAD_WAIT_FRACTION = 0.02
"""A node whose job's trainers waited this share of their time since its last plan, or more,
fetches through the shards it kept (:class:`_Lead`)."""
LEAD_HOLD_S = 300.0
"""For this long after its trainers last waited. Longer than an epoch of the bed (a warm epoch
opens with a run of hits, no wait, before the misses that need the lead), and a node that went
back to the base rule too early pays one epoch of waits to come back."""
WAIT_LEAD_PER_TRAINER = 1
"""Fetching through (:class:`_Lead`), the shards to fetch ahead per trainer of the job on the node:
counting only shards to fetch, one each keeps the link busy (the bed: 0.5-4% stall at 0.50-0.55
of the dataset a warm epoch; two each, 0.2% at 0.57). A node with room fetches
:data:`ROOMY_LEAD_PER_TRAINER` instead, into room only."""
ROOM_SLOTS_PER_TRAINER = 8
"""A node with this many slots a trainer of the job or more fetches through
:data:`ROOMY_LEAD_PER_TRAINER` shards a trainer, into room only (:meth:`_JobPlanner.desired`)."""
ROOMY_LEAD_PER_TRAINER = 2
"""Fetching through on a node with room (:data:`ROOM_SLOTS_PER_TRAINER`), the shards to fetch ahead
per trainer; only as many as fit the slots that the held shards the epoch still needs leave, so no
kept shard gives way to one fetched ahead. At one a trainer and a plan a second, the link to a slow
origin idled through the first half of a warm epoch (0.69-0.84 busy, the 768 MiB bed: a node asked
for 2 shards a second where its share of the link carried 2.45) and the misses at its end waited:
4-7% stall. Two a trainer fill the link from the start: 0.3-1.2% stall, at 1.10-1.13x the bound
of bytes against 1.04-1.13x (three runs each); without the room rule 1.16-1.18x. On fewer slots
(the 12-shard bed, 6 a trainer) there is too little room to fetch into: 8-12% stall against
2-9%, so such a node keeps :data:`WAIT_LEAD_PER_TRAINER`, which may displace a kept shard."""
PLAN_STALE_SHARE = 1 / 8
"""The share of a node's cache that may change between two of its plans (:func:`plan_interval`).
A plan is answered to a report; until the next one the node fills and evicts on its own, and what
it filled meanwhile is unranked (the first to go) while what it evicted may still be listed to
keep. In the capacity bed a node's cache turned over every 2-4 s with a plan every second:
0.035-0.08 of the dataset an epoch was prefetched by the plan and evicted unread, and plan fills
were refused room they had been planned for."""
MIN_PLAN_INTERVAL_S = 0.25
"""The shortest interval a fast-changing node is asked to report at. Past 25 reporting nodes the
floor is theirs / 100 seconds instead, so all of them together still make ~100 reports a second
at most."""
_FILLED = tuple(JOB_COUNTERS.index(c) for c in ("origin_bytes", "peer_bytes", "prefetch_bytes"))
"""The counters of bytes that came into a node (:meth:`NodeRecord.turnover_s`)."""
DEFAULT_ENTRY_BYTES = 64 << 20
"""The shard size a plan assumes when neither the spec nor the daemon tells one."""
_UNKNOWN = 0xFFFFFFFF
_NO_AHEAD: frozenset[int] = frozenset()
_SMALL_DELTA = 64


# -- a report, resolved -----------------------------------------------------------------------------


@dataclass
class Resolution:
    """A report's hashes as shards of the windowed jobs (:func:`resolve_report`)."""

    held: array[int] = field(default_factory=lambda: array("Q"))
    """The reported held hashes that name a shard of some windowed job, as reported."""
    dropped: array[int] = field(default_factory=lambda: array("Q"))
    jobs: dict[str, tuple[JobSpec, float, list[tuple[int, int]], list[int]]] = field(default_factory=dict)
    """job -> (its spec, created_at, [(shard, hash)] held, [shard] dropped)."""

    def hint(self) -> dict[str, tuple[JobSpec, list[int], list[int]]]:
        """The ``Holdings.resolved`` shortcut."""
        return {name: (spec, [s for s, _ in held], dropped) for name, (spec, _, held, dropped) in self.jobs.items()}


def resolve_report(jobs: list[tuple[str, JobSpec, float, JobLocality]], report: NodeReport) -> Resolution:
    """The shards each windowed job has among the report's hashes; pure on immutable inputs (the
    specs, their indexes), so it runs on a thread: O(reported x jobs) binary searches, ~1 µs each."""
    out = Resolution()
    named_held: set[int] = set()
    named_dropped: set[int] = set()
    for name, spec, created, loc in jobs:
        index = job_index(loc, spec)
        if index is None:
            continue
        find = index.find
        held: list[tuple[int, int]] = []
        for h in report.held:
            s = find(h)
            if s >= 0:
                held.append((s, h))
                named_held.add(h)
        dropped: list[int] = []
        for h in report.dropped:
            s = find(h)
            if s >= 0:
                dropped.append(s)
                named_dropped.add(h)
        out.jobs[name] = (spec, created, held, dropped)
    out.held = array("Q", (h for h in report.held if h in named_held))
    out.dropped = array("Q", (h for h in report.dropped if h in named_dropped))
    return out


# -- the nodes' bookkeeping (memory only) --------------------------------------------------------------


class HeldSet:
    """What a node holds of one job: its shards ascending, with their hashes (12 bytes a shard)."""

    __slots__ = ("shards", "hashes")

    def __init__(self, pairs: Iterable[tuple[int, int]] = ()) -> None:
        self.shards = array("I")
        self.hashes = array("Q")
        self._rebuild(dict(pairs))

    def _rebuild(self, pairs: dict[int, int]) -> None:
        items = sorted(pairs.items())
        self.shards = array("I", [s for s, _ in items])
        self.hashes = array("Q", [h for _, h in items])

    def __len__(self) -> int:
        return len(self.shards)

    def _at(self, shard: int) -> int:
        i = bisect.bisect_left(self.shards, shard)
        return i if i < len(self.shards) and self.shards[i] == shard else -1

    def __contains__(self, shard: object) -> bool:
        return isinstance(shard, int) and self._at(shard) >= 0

    def hash_of(self, shard: int) -> int | None:
        i = self._at(shard)
        return self.hashes[i] if i >= 0 else None

    def update(self, held: list[tuple[int, int]], dropped: list[int]) -> None:
        """A delta: ``dropped`` first, then ``held`` (an object in both is held, as the state has it)."""
        if len(held) + len(dropped) > _SMALL_DELTA + len(self.shards) // 8:
            pairs = dict(zip(self.shards, self.hashes, strict=True))
            for shard in dropped:
                pairs.pop(shard, None)
            pairs.update(held)
            self._rebuild(pairs)
            return
        for shard in dropped:  # a few: memmoves, not a rebuild
            i = self._at(shard)
            if i >= 0:
                del self.shards[i]
                del self.hashes[i]
        for shard, h in held:
            i = bisect.bisect_left(self.shards, shard)
            if i < len(self.shards) and self.shards[i] == shard:
                self.hashes[i] = h
            else:
                self.shards.insert(i, shard)
                self.hashes.insert(i, h)


def _zero() -> list[int]:
    return [0] * len(JOB_COUNTERS)


@dataclass(slots=True)
class _Lead:
    """Whether a node's plans for one job fetch through the shards it kept (and what it kept).

    Where the origin is slower than the trainers, a warm epoch opens with a run of shards the node
    kept (Belady's rule keeps those needed soonest) with the link idle: the base lead, a few
    positions, finds nothing to fetch in that run, and the misses after it come all at once while
    the trainers wait (the capacity bed: 14-20% stall at 0.6 x D, the link 0.7 busy). Fetching
    through the run instead (:data:`WAIT_LEAD_PER_TRAINER` shards to fetch, whatever is held
    between them) keeps the link busy from the start; but where the origin keeps up, shards fetched
    that far ahead only take the places of shards the next epoch would keep (``bench.cluster_sim``:
    0.63 of the dataset an epoch against 0.55). The master does not know the origin's speed, so
    it follows the trainers' own wait reports: a node whose trainers waited (more than
    :data:`LEAD_WAIT_FRACTION` of a plan's interval) in an epoch it entered with shards kept for
    it fetches through for :data:`LEAD_HOLD_S` after."""

    created: float
    waited: float = 0.0
    elapsed: float = 0.0
    until: float = 0.0
    epoch: int = -1
    carried: array[int] = field(default_factory=lambda: array("I"))
    """Of what the node held at its first plan of ``epoch``, the shards the epoch had yet to hand
    out: kept for it, so the walk passes them without counting; the ones fetched ahead since are
    bounded (:meth:`_JobPlanner.desired`). Ascending, 4 bytes a shard."""

    def carry(self, epoch: int, ep: EpochState | None, held: HeldSet | None) -> None:
        """The node's first plan of ``epoch``: of what it holds, the shards the epoch has yet to
        hand out (those read already, as the first epoch's first ones, were not kept for it)."""
        self.epoch = epoch
        shards = held.shards if held is not None else array("I")
        self.carried = array("I", shards if ep is None else (s for s in shards if ep.order.index(s) >= ep.cursor))

    def was_carried(self, shard: int) -> bool:
        i = bisect.bisect_left(self.carried, shard)
        return i < len(self.carried) and self.carried[i] == shard

    def update(self, waited: tuple[float, float] | None, now: float) -> bool:
        """Take the trainers' cumulative (wait, wall) seconds: whether to fetch through now."""
        if waited is not None:
            dw, de = waited[0] - self.waited, waited[1] - self.elapsed
            self.waited, self.elapsed = waited
            # Only in an epoch the node entered holding shards kept for it: in one it entered
            # empty (the first) the trainers wait on a full link with no run to fetch through,
            # and fetching through from there filled the end of the first epoch with the
            # second's shards (the default bed: cold 1.10 of the dataset, not 1.05-1.08, and the
            # warm stall 5.6-7.0%, not 4.4-5.4%). (A trainer that left the node takes its sums
            # with it: dw < 0.)
            if de > 0 and dw >= LEAD_WAIT_FRACTION * de and self.carried:
                self.until = now + LEAD_HOLD_S
        return now < self.until


@dataclass(slots=True)
class NodeRecord:
    """One node as its reports told the master (memory only)."""

    node: str
    daemon: str = ""
    """The daemon instance whose reports count now (random per daemon start)."""
    seq: int = 0
    applied: bool = False
    """Whether report ``seq`` of ``daemon`` was applied: only then may a delta build on it."""
    full_jobs: frozenset[tuple[str, float]] = frozenset()
    """The windowed jobs (name, created_at) there were at the node's last full report."""
    last_report: float = 0.0
    last_full: float = 0.0
    capacity_bytes: int = 0
    used_bytes: int = 0
    mean_entry_bytes: int = 0
    counters: dict[str, list[int]] = field(default_factory=dict)
    """job -> the current daemon instance's cumulative counters (JOB_COUNTERS' order)."""
    base: dict[str, list[int]] = field(default_factory=dict)
    """job -> what earlier instances had counted (a daemon restart starts its counters over)."""
    held: dict[str, tuple[float, HeldSet]] = field(default_factory=dict)
    """windowed job -> (its created_at, what the node holds of it)."""
    planned: dict[str, tuple[int, int]] = field(default_factory=dict)
    """job -> (desired shards, of those the current epoch's still to hand out held) at the last plan."""
    leads: dict[str, _Lead] = field(default_factory=dict)
    """windowed job -> whether its plans fetch through the shards kept on this node."""
    fill_rate: float | None = None
    """Bytes a second the node's jobs' reads and prefetches brought into it (origin, peer and
    prefetch bytes of its counters), smoothed over its reports."""

    def turnover_s(self) -> float | None:
        """About how long the node's cache takes to be replaced once: its bytes over the bytes it
        fills a second (:meth:`NodeBook.take`)."""
        if not self.fill_rate:
            return None
        return self.used_bytes / self.fill_rate

    def held_set(self, job: str, created: float) -> HeldSet | None:
        got = self.held.get(job)
        return got[1] if got is not None and got[0] == created else None

    def total(self, job: str) -> list[int]:
        cur, base = self.counters.get(job), self.base.get(job)
        out = _zero()
        for values in (cur, base):
            if values is not None:
                for i, v in enumerate(values):
                    out[i] += v
        return out


class NodeBook:
    """Every reporting node's :class:`NodeRecord`, and the jobs' ``cache`` views built from them."""

    def __init__(self) -> None:
        self.records: dict[str, NodeRecord] = {}
        self.retired: dict[str, list[int]] = {}
        """job -> counters of forgotten nodes (so the totals never go down)."""
        self._pruned = 0.0

    def take(self, node: str, report: NodeReport, now: float) -> NodeRecord:
        """Note a report's counters and capacity (cumulative, so whatever becomes of its holdings)."""
        rec = self.records.get(node)
        if rec is None:
            rec = self.records[node] = NodeRecord(node)
        if rec.daemon != report.daemon:
            for job, values in rec.counters.items():  # a new instance: the old one's last values are a base
                base = rec.base.setdefault(job, _zero())
                for i, v in enumerate(values):
                    base[i] += v
            rec.counters, rec.daemon, rec.seq, rec.applied = {}, report.daemon, 0, False
        # Bytes in: the jobs' counters, or the objects the delta names held, whichever says more.
        # The counters miss what a cluster's owner fills for its peers' reads (counted at the
        # reading node); a delta misses what came and went between two reports.
        filled = 0
        seen = len(report.held) * report.mean_entry_bytes if report.base is not None else 0
        for job, counters in report.jobs.items():
            values = [counters[c] for c in JOB_COUNTERS]
            before = rec.counters.get(job)
            if before is not None:
                filled += sum(values[i] - before[i] for i in _FILLED)
            rec.counters[job] = values
        elapsed = now - rec.last_report
        if rec.last_report and elapsed > 0:
            rate = max(0, filled, seen) / elapsed
            rec.fill_rate = rate if rec.fill_rate is None else (rec.fill_rate + rate) / 2
        rec.last_report = now
        rec.capacity_bytes, rec.used_bytes, rec.mean_entry_bytes = report.capacity_bytes, report.used_bytes, report.mean_entry_bytes
        if now - self._pruned > 60.0:
            self._pruned = now
            self.prune(now)
        return rec

    @staticmethod
    def needs_full(rec: NodeRecord, report: NodeReport, jobs: frozenset[tuple[str, float]]) -> bool:
        """Whether a report cannot be applied: a delta on a report the master does not hold (a
        master restarted or newly elected, a report lost, a new daemon instance), or from a node
        whose last full report predates a windowed job."""
        return report.base is not None and (not rec.applied or rec.seq != report.base or not jobs <= rec.full_jobs)

    @staticmethod
    def applied(rec: NodeRecord, report: NodeReport, resolution: Resolution, jobs: frozenset[tuple[str, float]], now: float) -> None:
        """The report's holdings are applied (or there were none to apply): the next delta may build on it."""
        rec.seq, rec.applied = report.seq, True
        if report.full:
            rec.full_jobs, rec.last_full = jobs, now
            rec.held = {name: (created, HeldSet(held)) for name, (_, created, held, _) in resolution.jobs.items()}
            return
        for name, (_, created, held, dropped) in resolution.jobs.items():
            if not held and not dropped:
                continue
            got = rec.held.get(name)
            if got is None or got[0] != created:
                got = rec.held[name] = (created, HeldSet())
            got[1].update(held, dropped)

    def lost_state(self) -> None:
        """The master's state was dropped (leadership lost, a store failure): what it held of the
        nodes' holdings may be gone with it, so every node's next delta is answered resend full."""
        for rec in self.records.values():
            rec.applied, rec.held, rec.planned = False, {}, {}

    def prune(self, now: float) -> None:
        for node, rec in list(self.records.items()):
            if now - rec.last_report > RECORD_KEEP_S:
                for job in set(rec.counters) | set(rec.base):
                    retired = self.retired.setdefault(job, _zero())
                    for i, v in enumerate(rec.total(job)):
                        retired[i] += v
                del self.records[node]

    def forget_job(self, job: str) -> None:
        """A job was deleted: its holdings and plans go; its counters start over (a job created
        again under the name counts from zero, though daemons count by name)."""
        self.retired.pop(job, None)
        for rec in self.records.values():
            rec.held.pop(job, None)
            rec.planned.pop(job, None)
            rec.leads.pop(job, None)
            current = rec.counters.get(job)
            if current is not None or job in rec.base:
                rec.base[job] = [-v for v in current] if current is not None else _zero()

    def reporting(self, now: float) -> int:
        return sum(1 for rec in self.records.values() if now - rec.last_report <= REPORT_VIEW_S)

    def totals(self, job: str) -> list[int]:
        """The job's counters summed over every node that ever reported them (never down)."""
        out = list(self.retired.get(job, _zero()))
        for rec in self.records.values():
            if job in rec.counters or job in rec.base:
                for i, v in enumerate(rec.total(job)):
                    out[i] += v
        return out

    def view(self, job: str, now: float, windowed: bool, trainers: Mapping[str, set[str]],
             wait_of: Callable[[str], float | None]) -> dict[str, Any]:
        """The job status' ``cache``: per node (reported within :data:`REPORT_VIEW_S`, and counting
        the job's reads, holding its shards or running its trainers), sorted by node, at most
        :data:`VIEW_MAX_NODES`; totals over every node."""
        shown: list[dict[str, Any]] = []
        for node, rec in self.records.items():
            age = now - rec.last_report
            if age > REPORT_VIEW_S:
                continue
            held = rec.held.get(job)
            if not (job in rec.counters or job in rec.base or (held is not None and len(held[1])) or node in trainers):
                continue
            on_node = trainers.get(node, set())
            waits = [w for w in (wait_of(t) for t in sorted(on_node)) if w is not None]
            planned = rec.planned.get(job)
            lead = rec.leads.get(job)
            entry: dict[str, Any] = {"node": node, "report_age_s": round(max(age, 0.0), 1), "trainers": len(on_node)}
            entry.update(_counters(rec.total(job)))
            entry.update({
                "held_shards": (len(held[1]) if held is not None else 0) if windowed else None,
                "planned_shards": (planned[0] if planned is not None else 0) if windowed else None,
                "prefetch_lead_shards": (planned[1] if planned is not None else 0) if windowed else None,
                "fetching_through": (lead is not None and now < lead.until) if windowed else None,
                "wait_fraction": round(sum(waits) / len(waits), 4) if waits else None,
            })
            shown.append(entry)
        if len(shown) > VIEW_MAX_NODES:
            # Keep the nodes worth looking at: the most waiting, then the lowest hit rate.
            shown.sort(key=lambda e: (-(e["wait_fraction"] or 0.0), e["hit_rate"] if e["hit_rate"] is not None else 1.0,
                                      e["node"]))
        listed = sorted(shown[:VIEW_MAX_NODES], key=itemgetter("node"))
        return {
            "reporting_nodes": len(shown),
            "totals": _counters(self.totals(job)),
            "nodes": listed,
            "nodes_omitted": max(0, len(shown) - VIEW_MAX_NODES),
        }


def _counters(values: list[int]) -> dict[str, Any]:
    out: dict[str, Any] = dict(zip(JOB_COUNTERS, values, strict=True))
    served = out["hit_bytes"] + out["origin_bytes"] + out["peer_bytes"]
    out["hit_rate"] = round(out["hit_bytes"] / served, 4) if served > 0 else None
    return out


def plan_interval(nodes: int, turnover_s: float | None = None) -> float:
    """Seconds until a node's next report: 1, or one per 100 reporting nodes past 100, so the
    master plans ~100 reports a second at most. Shorter for a node whose cache turns over fast
    (``turnover_s``: the seconds its entries take to be replaced once, :meth:`NodeRecord.turnover_s`):
    about :data:`PLAN_STALE_SHARE` of them change between two plans, down to
    :data:`MIN_PLAN_INTERVAL_S` and never below one second per 100 nodes (the budget holds)."""
    interval = max(1.0, nodes / 100)
    if turnover_s is not None:
        floor = max(MIN_PLAN_INTERVAL_S, nodes / 100)
        interval = min(interval, max(floor, turnover_s * PLAN_STALE_SHARE))
    return float(min(3600.0, interval))


# -- the plan ----------------------------------------------------------------------------------------


class _Budget:
    __slots__ = ("deadline",)

    def __init__(self, seconds: float) -> None:
        self.deadline = time.perf_counter() + seconds if math.isfinite(seconds) else math.inf

    def ok(self) -> bool:
        return self.deadline == math.inf or time.perf_counter() < self.deadline


class _Layout:
    """One epoch's seeded order as plans walk it: the shard at each position and the position of
    each shard (filled as they are needed, 8 bytes a shard), and for one assignment the positions
    assigned to each node from ``covered`` on (4 bytes a position)."""

    __slots__ = ("order", "n", "shard_at", "pos_of", "version", "covered", "frontier", "lists")

    def __init__(self, epoch: int, spec: JobSpec) -> None:
        n = len(spec.shards)
        self.order = EpochOrder(n, spec.seed, epoch, spec.shuffle)
        self.n = n
        self.shard_at = array("I", [_UNKNOWN]) * n
        self.pos_of = array("I", [_UNKNOWN]) * n
        self.version: Any = None
        self.covered = 0
        """``lists`` hold every assigned position in ``[covered, frontier)``."""
        self.frontier = 0
        self.lists: dict[str, array[int]] = {}

    def shard(self, position: int) -> int:
        s = self.shard_at[position]
        if s == _UNKNOWN:
            s = self.order[position]
            self.shard_at[position] = s
            self.pos_of[s] = position
        return s

    def position(self, shard: int) -> int:
        p = self.pos_of[shard]
        if p == _UNKNOWN:
            p = self.order.index(shard)
            self.pos_of[shard] = p
            self.shard_at[p] = shard
        return p

    def retarget(self, version: Any, cursor: int) -> None:
        """Positions before ``cursor`` are handed out: the lists start at it; a new assignment
        (ring or trainer nodes changed) starts them over."""
        if self.version != version:
            self.version, self.lists = version, {}
            self.covered = self.frontier = cursor
        elif self.frontier < cursor:
            self.covered = self.frontier = cursor

    def known(self, shard: int, cursor: int) -> int | None:
        """``shard``'s position if known; -1 when it is known to be before ``cursor``; None."""
        p = self.pos_of[shard]
        if p != _UNKNOWN:
            return p
        return -1 if self.covered <= cursor and self.frontier >= self.n else None

    def extend(self, node: str, cursor: int, want: int, end: int, assign: Callable[[int], str | None], budget: _Budget) -> None:
        """Assign positions from the frontier on until ``node`` has ``want`` at or past ``cursor``,
        the frontier reaches ``end``, or the budget is spent."""
        lists = self.lists
        while self.frontier < end and budget.ok():
            mine = lists.get(node)
            if mine is not None and len(mine) - bisect.bisect_left(mine, cursor) >= want:
                return
            stop = min(end, self.frontier + 32)
            for p in range(self.frontier, stop):
                owner = assign(self.shard(p))
                if owner:
                    got = lists.get(owner)
                    if got is None:
                        got = lists[owner] = array("I")
                    got.append(p)
            self.frontier = stop


@dataclass
class _Desired:
    desired: list[tuple[int, int, bool]]
    """(next use, shard, held), soonest first."""
    now: int
    """The job's next fresh position (epoch x shards + cursor): next uses are ranked from it."""
    lead: int


def current_epoch(job: JobState) -> tuple[int, EpochState | None] | None:
    """The epoch whose fresh positions leases take now (the newest open one with any), or the next
    to open (None: none will)."""
    for epoch, ep in job.open.items():
        if ep.cursor < ep.n:
            return epoch, ep
    epochs = job.spec.epochs
    if job.finished or (epochs is not None and job.next_epoch >= epochs):
        return None
    return job.next_epoch, None


class _JobPlanner:
    """A job's plan layouts and its trainer nodes' ring (derived; dropped with the job)."""

    def __init__(self, job: JobState) -> None:
        self.spec = job.spec
        self.layouts: dict[int, _Layout] = {}
        self.ring = Ring()
        self.owners: Owners | None = None

    def layout(self, epoch: int) -> _Layout:
        lay = self.layouts.get(epoch)
        if lay is None:
            for old in [e for e in self.layouts if e < epoch - 1]:
                del self.layouts[old]
            lay = self.layouts[epoch] = _Layout(epoch, self.spec)
        return lay

    def assigner(self, state: MasterState, loc: JobLocality, nodes: Iterable[str]) -> tuple[Any, int, Callable[[int], str | None]]:
        """(the assignment's version, how many nodes it spreads over, shard -> its node)."""
        ring = state.ring
        ring_nodes = ring.nodes if ring.node_of else 0
        if ring_nodes:
            return ("ring", ring.version), ring_nodes, lambda shard: loc.owner_node(shard, ring)
        own = self.ring
        own.update((node, node) for node in sorted(nodes))
        if not own.node_of or loc.names is None:
            return ("none", own.version), 0, lambda shard: None
        owners = self.owners
        if owners is None:
            owners = self.owners = Owners(len(self.spec.shards), loc.names)
        return ("nodes", own.version), len(own.node_of), lambda shard: owners.member(shard, own)

    def desired(self, state: MasterState, job: JobState, node: str, slots: int, held: HeldSet | None,
                nodes: Iterable[str], budget: _Budget, lead: int, carried: Callable[[int], bool] | None = None,
                into_room: bool = False) -> _Desired:
        """The ``slots`` shards to hold, soonest next use first: those of the node's next ``lead``
        positions it does not hold, and the held ones needed soonest. With ``carried`` (fetching
        through: :class:`_Lead`), the lead counts only the shards to fetch; with ``into_room`` too
        (:data:`ROOM_SLOTS_PER_TRAINER`), only as many as fit beside the held shards this epoch
        still needs."""
        cur = current_epoch(job)
        loc = job.locality
        if cur is None or loc is None or slots <= 0:
            return _Desired([], 0, 0)
        epoch, ep = cur
        n = job.n
        epochs = job.spec.epochs
        has_next = epochs is None or epoch + 1 < epochs
        cursor = ep.cursor if ep is not None else 0
        ahead = ep.window.ahead if ep is not None and ep.window is not None else _NO_AHEAD
        version, k, assign = self.assigner(state, loc, nodes)
        # Per-node caches (no ring): a shard another node holds is that node's to keep and its
        # trainers' to be leased (leases prefer holders), so this node neither fetches it nor keeps
        # a place for it: the nodes keep what they hold and divide only what nobody holds, with no
        # reshuffle of what is cached. A shard inside the window now is about to be leased to
        # whoever asks first: fetched ahead here it would be read from the origin twice.
        per_node = version[0] == "nodes"
        near = epoch * n + cursor + loc.window
        readers = loc.readers

        def elsewhere(shard: int, use: int) -> bool:
            if not per_node or (held is not None and shard in held):
                return False
            holder = readers.get(shard)
            return (holder is not None and holder != node) or use < near
        limit = min(4 * slots * max(1, k) + (loc.window if version[0] == "nodes" else 0), (2 if has_next else 1) * n)
        here = self.layout(epoch)
        here.retarget(version, cursor)
        here.extend(node, cursor, slots + min(len(ahead), slots) + (slots // 2 + lead if carried else 0), min(n, cursor + limit),
                    assign, budget)
        best: dict[int, int] = {}  # shard -> next use
        # Shards to fetch: those of the node's next ``lead`` positions it does not hold (held
        # ones are ranked below, each at its own next use). A lead of positions, not of shards to
        # fetch: a plan that fetched the next k shards not held, however far ahead, kept the next
        # shards needed and nothing else (each read one gave way to the next one missing), and
        # fetched 0.84 of the dataset an epoch where Belady's rule fetches 0.52 (25 shards to a
        # node, 12 slots; a lead of up to 4 positions fetches 0.52, 12 positions 0.79).
        lead = max(0, min(lead, slots))
        walked = 0
        # Fetching through (``carried`` given: :class:`_Lead`), the lead counts only the shards to
        # fetch, walking past the held ones, so the node keeps fetching through a run of shards
        # it kept; the ones it fetched ahead in this epoch and has not read yet are bounded apart
        # (half the slots), so that a fast origin cannot turn the cache into a prefetch buffer.
        # (A quarter was too few where a warm epoch opens with a run of ~25 kept shards a node:
        # the 768 MiB bed's epoch 3 stalled 10.3%, against 3.3% with half.)
        buffered, bound = 0, slots // 2
        mine = here.lists.get(node)
        if mine is not None:
            i = bisect.bisect_left(mine, cursor)
            while i < len(mine) and walked < lead and buffered < bound:
                p = mine[i]
                i += 1
                if p not in ahead:
                    shard = here.shard(p)
                    is_held = held is not None and shard in held
                    far = not is_held and elsewhere(shard, epoch * n + p)
                    if carried is not None and (is_held or far):  # fetching through: passed
                        buffered += is_held and not carried(shard)
                        continue
                    walked += 1
                    if not is_held and not far:
                        best[shard] = epoch * n + p
        after: _Layout | None = None
        if walked < lead and buffered < bound and has_next and here.frontier >= n and limit > n - cursor:
            # The next epoch's order: of the node's positions there, only shards handed out in
            # this one count (the others come sooner, above), so extend as they are found.
            after = self.layout(epoch + 1)
            after.retarget(version, 0)
            end, seen = min(n, limit - (n - cursor)), 0
            while walked < lead:
                after.extend(node, 0, seen + lead - walked, end, assign, budget)
                mine = after.lists.get(node)
                if mine is None or seen >= len(mine):
                    break
                while seen < len(mine) and walked < lead:
                    p = mine[seen]
                    seen += 1
                    s = after.shard(p)
                    q = here.known(s, cursor)
                    if q is not None and q >= cursor and q not in ahead:
                        continue  # still to come in this epoch: counted there
                    is_held = held is not None and s in held
                    far = not is_held and elsewhere(s, (epoch + 1) * n + p)
                    if carried is not None and (is_held or far):
                        continue
                    walked += 1
                    if not is_held and s not in best and not far:
                        best[s] = (epoch + 1) * n + p
        if held is not None:
            for s in held.shards:
                at = here.known(s, cursor)
                if at is None and budget.ok():
                    at = here.position(s)
                if at is None:
                    continue  # not placed yet (the budget is spent): a later plan ranks it
                if at >= cursor and at not in ahead:
                    use = epoch * n + at
                elif ep is not None and not ep.is_done(s):
                    # Handed out and not back: a trainer reads it now (or opens it next, a lease
                    # taken ahead), or it returns to be handed out again. Needed now, not next
                    # epoch: ranked so, it is not the first a fill evicts under its reader.
                    use = epoch * n + cursor
                elif has_next:
                    if after is None:
                        after = self.layout(epoch + 1)
                    q = after.pos_of[s]
                    if q == _UNKNOWN:
                        if not budget.ok():
                            continue
                        q = after.position(s)
                    use = (epoch + 1) * n + q
                else:
                    continue  # not needed again
                if use < best.get(s, use + 1):
                    best[s] = use
        now, end = epoch * n + cursor, (epoch + 1) * n
        if into_room and held is not None:
            kept_now = sum(1 for s, use in best.items() if use < end and s in held)
            fetches = sorted((use, s) for s, use in best.items() if s not in held)
            for _, s in fetches[max(0, slots - kept_now):]:
                del best[s]
        chosen = heapq.nsmallest(slots, best.items(), key=itemgetter(1))
        desired = [(use, s, held is not None and s in held) for s, use in chosen]
        lead = sum(1 for use, _, is_held in desired if is_held and use < end)
        return _Desired(desired, now, lead)


class Planner:
    """The plans of every node (:meth:`plan`), from per-job layouts shared by all nodes."""

    def __init__(self, budget_s: float = PLAN_BUDGET_S) -> None:
        self.budget_s = budget_s
        self._jobs: dict[str, _JobPlanner] = {}

    def forget(self, job: str) -> None:
        self._jobs.pop(job, None)

    def _job(self, name: str, job: JobState) -> _JobPlanner:
        planner = self._jobs.get(name)
        if planner is None or planner.spec is not job.spec:
            planner = self._jobs[name] = _JobPlanner(job)
        return planner

    def plan(self, state: MasterState, rec: NodeRecord, seq: int, trainers: Mapping[str, Mapping[str, set[str]]],
             interval_s: float, waited: Mapping[str, tuple[float, float]] | None = None) -> NodePlan:
        """The plan for ``rec``'s node: for each windowed job with trainers there (``trainers``:
        job -> node -> trainer names), its share of the node's capacity in slots, filled with the
        shards needed soonest among those it holds and those of its next few positions (the lead;
        ``waited``: job -> what its trainers on the node reported waiting, see :class:`_Lead`)."""
        node = rec.node
        here: list[tuple[str, JobState, int, ShardIndex]] = []
        for name, job in state.jobs.items():
            loc = job.locality
            count = len(trainers.get(name, {}).get(node, ()))
            if loc is None or loc.names is None or job.finished or not count:
                continue
            index = job_index(loc, job.spec)
            if index is not None:
                here.append((name, job, count, index))
        rec.planned = {}
        if not here or rec.capacity_bytes <= 0:
            return NodePlan(seq, interval_s=interval_s)
        share = sum(count for _, _, count, _ in here)
        budget = _Budget(self.budget_s)
        fetch: list[tuple[int, int, str, int, ShardIndex]] = []
        keep: list[tuple[int, int]] = []
        for name, job, count, index in here:
            mean = index.mean_size or rec.mean_entry_bytes or DEFAULT_ENTRY_BYTES
            slots = min(job.n, MAX_KEEP, rec.capacity_bytes * count // share // max(1, mean))
            held = rec.held_set(name, job.created_at)
            lead = max(1, min(slots // 2, PLAN_LEAD_PER_TRAINER * count))
            grown = rec.leads.get(name)
            if grown is None or grown.created != job.created_at:
                grown = rec.leads[name] = _Lead(job.created_at)
            cur = current_epoch(job)
            if cur is not None and cur[0] != grown.epoch:
                grown.carry(cur[0], cur[1], held)
            through = grown.update(waited.get(name) if waited else None, rec.last_report)
            roomy = through and slots >= ROOM_SLOTS_PER_TRAINER * count
            if through:
                lead = max(1, min(slots // 2, (ROOMY_LEAD_PER_TRAINER if roomy else WAIT_LEAD_PER_TRAINER) * count))
            got = self._job(name, job).desired(state, job, node, slots, held, trainers.get(name, {}).keys(), budget, lead,
                                               grown.was_carried if through else None, roomy)
            rec.planned[name] = (len(got.desired), got.lead)
            for use, shard, is_held in got.desired:
                if is_held:
                    assert held is not None
                    h = held.hash_of(shard)
                    keep.append((use - got.now, h if h is not None else index.hash_of(shard)))
                else:
                    fetch.append((use - got.now, use, name, shard, index))
                    # Ranked at its own next use too: a daemon ranks the prefetches after the kept
                    # objects, so a prefetch ranked only there was the first a demand fill evicted
                    # (farthest rank first), though needed sooner than all it kept.
                    keep.append((use - got.now, index.hash_of(shard)))
        # Jobs' next uses count from each job's own position: ranked by how far ahead they are.
        fetch.sort(key=itemgetter(0, 2, 1))
        keep.sort(key=itemgetter(0))
        items = tuple(PrefetchItem(name, index.bucket, index.key(shard), use) for _, use, name, shard, index in fetch[:MAX_PREFETCH])
        return NodePlan(seq, None, interval_s, items, array("Q", [h for _, h in keep[:MAX_KEEP]]))
