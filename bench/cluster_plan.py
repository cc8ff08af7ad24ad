"""The master's plan in the cluster model (issue 32): ``bench.cluster_sim``'s ``planned`` policies.

Three pieces, each standing in for one side of ``--eviction planned`` with ``--master``, and each
driving the real code where the real code can run without a daemon, a disk or a network:

- :class:`PlannedCache` is one daemon's store in shards of one size: the real eviction policy
  (:class:`cache.eviction.PlannedPolicy`, told of real :class:`cache.entry.Entry` records) under a
  model of what :class:`cache.Store` does around it (capacity in entries, ``set_plan``'s ranks,
  ``plan_room``, and a plan fill's ``spare_kept`` admission: cache/store.py).
- :class:`DaemonLink` is one daemon's report side (``sidecar/daemon/masterlink.py``): the real
  :class:`sidecar.daemon.masterlink.HeldNames` watches the store, and reports are built as
  ``MasterLink._build`` builds them (a full one first, then deltas on the last report taken).
- :class:`PlanService` is the master's side of ``POST /v1/nodes/{node}/report``: the steps of
  ``Service.node_report`` (loader/master/server/service.py) with the real :class:`NodeBook`,
  :func:`resolve_report`, the ``Holdings`` event applied to the model's one ``MasterState``,
  :func:`plan_interval` and :class:`Planner`.

What the model leaves out, and why it matters: a plan's prefetches complete at once (the model
is consumption-bound: no link or origin cap slows a fill), so a prefetch is never late and never
competes with a demand read: on bytes the model is the policy's best case, and its origin figure
is what the policy itself costs, apart from timing.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Iterable, Mapping, Sequence

from cache.entry import Entry
from cache.eviction import PlannedPolicy
from loader.master.server.events import Holdings
from loader.master.server.holdings import NodeBook, Planner, plan_interval, resolve_report
from loader.master.server.state import MasterState
from sidecar.daemon.masterlink import HeldNames
from wire.nodeplan import NodePlan, NodeReport, name_hash

__all__ = ["PlannedCache", "DaemonLink", "PlanService", "plan_reports"]


class PlannedCache:
    """One daemon's store under ``--eviction planned``, in shards of one size (``capacity``
    entries): hits, demand fills and plan fills, evicting by the real :class:`PlannedPolicy`.

    The same reading interface as ``bench.cluster_sim.NodeCache`` (``in``, :meth:`hit`,
    :meth:`put`, ``entries``, ``evictions``); the plan's side is :meth:`set_plan`,
    :meth:`plan_room` and :meth:`plan_fill`. Counts what became of its plan fills: read (a hit
    on it, or a peer served from it) or evicted unread (a wasted prefetch); and what plan fills
    evicted that had been read (``displaced``: entries the plan no longer ranks once read, since
    shards not yet read come sooner; what the plan's churn costs)."""

    __slots__ = ("capacity", "bucket", "keys", "size", "entries", "evictions", "policy", "watchers", "_ranks",
                 "_versions", "unread", "used", "wasted", "displaced")

    def __init__(self, capacity: int, bucket: str, keys: Sequence[str], size: int) -> None:
        if capacity < 1:
            raise ValueError("a node's cache must hold at least one shard: raise --cache-bytes or lower the shard size")
        self.capacity = capacity
        self.bucket = bucket
        self.keys = keys
        """shard -> its object key in ``bucket`` (the names plans hash)."""
        self.size = size
        self.entries: dict[int, Entry] = {}
        self.evictions = 0
        self.policy = PlannedPolicy()
        self.watchers: list[HeldNames] = []
        self._ranks: dict[int, int] = {}
        self._versions = 0
        self.unread: set[int] = set()
        """Plan fills not read since (evicted like this: wasted)."""
        self.used = 0
        self.wasted = 0
        self.displaced = 0
        # The daemon hands the store an empty plan at start (MasterLink.start): the policy indexes
        # entries by name from then on.
        self.set_plan(())

    def __contains__(self, shard: int) -> bool:
        return shard in self.entries

    def hit(self, shard: int) -> bool:
        """A read of ``shard`` (a trainer's, or a peer's from this owner): True when it is here."""
        entry = self.entries.get(shard)
        if entry is None:
            return False
        self.policy.on_touch(entry)
        if shard in self.unread:
            self.unread.discard(shard)
            self.used += 1
        return True

    def put(self, shard: int, borrowed: bool) -> None:
        """A demand fill: it may evict what the plan ranks, farthest needed first."""
        if self.hit(shard):
            return
        while len(self.entries) >= self.capacity:
            victim = self.policy.victim(False)
            if victim is None:  # nothing is pinned in the model: unreachable while entries exist
                raise RuntimeError("the planned policy named no victim in a full cache")
            self._remove(victim)
        self._add(shard, borrowed)

    def plan_room(self) -> bool:
        """``Store.plan_room`` for one shard: free room, counting what the plan does not rank as free."""
        _, spare = self.policy.spare()
        return len(self.entries) - spare + 1 <= self.capacity

    def plan_fill(self, shard: int, borrowed: bool) -> bool:
        """A fill the plan asked for (``Store.begin`` under ``spare_kept``): it evicts only what the
        plan does not rank, and is refused (False) when that cannot make room."""
        if shard in self.entries or not self.plan_room():
            return False
        while len(self.entries) >= self.capacity:
            victim = self.policy.victim(True)
            if victim is None:
                return False
            self.displaced += self._remove(victim)
        self._add(shard, borrowed)
        self.unread.add(shard)
        return True

    def set_plan(self, keep: Iterable[int]) -> None:
        """``Store.set_plan``: the names to keep, soonest needed first (a name's first place counts)."""
        order = array("Q", dict.fromkeys(keep))
        ranks = dict(zip(order, range(len(order)), strict=True))
        old = self._ranks
        entered = [name for name in ranks if name not in old]
        left = [name for name in old if name not in ranks]
        self.policy.plan(order, ranks, entered, left, name_hash)
        self._ranks = ranks

    def _add(self, shard: int, borrowed: bool) -> None:
        self._versions += 1
        entry = Entry(f"{shard}.{self._versions}", self.bucket, self.keys[shard], "", self.size, "", 0.0,
                      borrowed=borrowed)
        self.entries[shard] = entry
        self.policy.on_add(entry)
        for watcher in self.watchers:
            watcher((entry,), ())

    def _remove(self, entry: Entry) -> bool:
        """Evict ``entry``; whether it had been read (not a plan fill still unread)."""
        shard = int(entry.id.split(".", 1)[0])
        del self.entries[shard]
        self.policy.on_remove(entry)
        self.evictions += 1
        read = shard not in self.unread
        if not read:
            self.unread.discard(shard)
            self.wasted += 1
        for watcher in self.watchers:
            watcher((), (entry,))
        return read


class DaemonLink:
    """One daemon's reports (``MasterLink``): what it holds, by the real :class:`HeldNames`
    watching its store, as a full report first (and after ``resend: "full"``), else a delta on
    the last report the master took."""

    __slots__ = ("node", "daemon", "cache", "held", "seq", "acked", "full_next", "reports", "resends")

    def __init__(self, node: str, daemon: str, cache: PlannedCache) -> None:
        self.node = node
        self.daemon = daemon
        self.cache = cache
        self.held = HeldNames()
        for entry in cache.entries.values():  # Store.watch: the watcher hears of what is there first
            self.held((entry,), ())
        cache.watchers.append(self.held)
        self.seq = 0
        self.acked: int | None = None
        self.full_next = True
        self.reports = 0
        self.resends = 0

    def build(self) -> NodeReport:
        """``MasterLink._build``: the next report (capacity, use and mean entry size from the store)."""
        full, held, dropped = self.held.take(self.full_next or self.acked is None)
        self.seq += 1
        cache = self.cache
        items = len(cache.entries)
        used = items * cache.size
        return NodeReport(self.daemon, self.seq, None if full else self.acked, held, dropped,
                          cache.capacity * cache.size, used, used // items if items else 0)

    def answered(self, report: NodeReport, plan: NodePlan) -> float:
        """The master took ``report`` (``MasterLink.report_once``): seconds to the next one."""
        self.acked = report.seq
        self.reports += 1
        if plan.resend == "full":
            self.resends += 1
            self.full_next = True
            return 0.0 if not report.full else plan.interval_s
        self.full_next = False
        return plan.interval_s


class PlanService:
    """The master's answer to a node's report, as ``Service.node_report`` makes it, on the
    model's one :class:`MasterState` (whose leases the model takes too).

    The planner runs without its per-report time budget (``PLAN_BUDGET_S``): the real one spreads
    the building of its position lists over reports, 20 ms at a time, and plans short until they
    reach far enough; unbounded, the model's plans are those of a master whose lists are built,
    and they do not depend on how fast this machine is."""

    def __init__(self, state: MasterState) -> None:
        self.state = state
        self.book = NodeBook()
        self.planner = Planner(budget_s=math.inf)
        self.holdings = 0
        """``Holdings`` events applied (reports that changed what a job's holder table may say)."""

    def report(self, node: str, report: NodeReport, trainers: Mapping[str, Mapping[str, set[str]]],
               now: float) -> NodePlan:
        """The plan for ``node``'s ``report``; ``trainers``: job -> node -> its trainers there (the
        service's ``_trainer_nodes``)."""
        state, book = self.state, self.book
        rec = book.take(node, report, now)
        windowed = [(name, job.spec, job.created_at, job.locality) for name, job in state.jobs.items()
                    if job.locality is not None and job.locality.names is not None]
        key = frozenset((name, created) for name, _, created, _ in windowed)
        interval = plan_interval(book.reporting(now))
        if book.needs_full(rec, report, key):
            return NodePlan(report.seq, resend="full", interval_s=interval)
        resolution = resolve_report(windowed, report)
        if report.full or resolution.held or resolution.dropped:
            event = Holdings(node, report.full, tuple(resolution.held), tuple(resolution.dropped), resolution.hint())
            state.apply(event, now)
            self.holdings += 1
        book.applied(rec, report, resolution, key, now)
        return self.planner.plan(state, rec, report.seq, trainers, plan_interval(book.reporting(now), rec.turnover_s()))


def plan_reports(nodes: int, epochs: int, epoch_s: float) -> int:
    """About how many reports a planned run takes: each node reports every
    :func:`plan_interval` seconds of the job's simulated time, plus its first."""
    return int(nodes * (epochs * epoch_s / plan_interval(nodes) + 1))
