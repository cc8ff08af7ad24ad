"""Which entries leave the cache, and in what order: the eviction policies behind one interface.

:class:`cache.Store` keeps the capacity accounting, pins, files, locking and crash safety. It tells
its policy every entry it indexes, touches and removes, and asks it which entry to evict when a fill
needs room; a policy keeps whatever recency order it needs itself, so the store keeps no order in
step by hand. A new policy is a class here and a name in :data:`POLICIES`, the one place that
maps ``StoreSettings.eviction`` to a policy.

The tenant quota (:class:`TenantQuota`) holds under every policy: it keeps each tenant's entries in
their own least-recently-used order and names the ones to evict to bring a tenant within its quota.

Costs: every notification is O(1), and naming a victim costs only the pinned entries in front of it
in its order, never a scan of the index: evicting for a fill costs the same in a cache of millions
of entries as in one of a thousand. The store's lock guards every call.

A lease master may tell the daemon the order in which its trainers will need the cached objects
(``wire.nodeplan``'s ``keep``: object names, soonest needed first). :meth:`EvictionPolicy.plan`
hands it to the policy: ``planned`` (:class:`PlannedPolicy`) evicts by it, the others ignore it.
A fill the plan itself asked for (a plan prefetch) asks for victims with ``spare_ranked``: never
an entry the plan ranks (:meth:`EvictionPolicy.spare` says how much room that leaves).

A reader's hint (the daemon's prefetch of a trainer's next shards) makes an entry *awaited*
(:meth:`EvictionPolicy.on_awaited`): someone announced the read. ``planned`` keeps it like a ranked
entry until it is read, the plan ranks it, or the plan had its chance to (see :class:`PlannedPolicy`).
"""

from __future__ import annotations

import heapq
import time
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:  # entries are only named in hints
    from cache.entry import Entry

NameHash = Callable[[str, str], int]
"""How a plan names an object: ``(bucket, key) -> int`` (the daemon gives ``wire.nodeplan.name_hash``;
the storage engine imports nothing of wire)."""

__all__ = [
    "EvictionPolicy",
    "LRUPolicy",
    "HoldPolicy",
    "BorrowedFirst",
    "PlannedPolicy",
    "NameHash",
    "TenantQuota",
    "POLICIES",
    "EVICTION_POLICIES",
    "policy_for",
]


class EvictionPolicy(ABC):
    """Chooses the entries that make room for a fill. Told of every indexed entry; never names a
    pinned one (``Entry.pins``), so whatever is in use stays."""

    evicts_for_room: ClassVar[bool] = True
    """Whether the policy evicts entries to make room at all. Under one that does not (hold), the
    tenant quota evicts a tenant's entries only when that alone makes room: evicting them would
    otherwise lose them and still cache nothing."""

    ranks: ClassVar[bool] = False
    """Whether the policy ranks entries by a plan (:meth:`plan`): only then does a borrowed copy's
    fill, like a plan's own, spare the ranked ones (``Store.begin``)."""

    @abstractmethod
    def on_add(self, entry: Entry) -> None:
        """``entry`` was indexed: just published (the most recently used), or loaded at start-up
        (loaded least recently used first)."""

    @abstractmethod
    def on_touch(self, entry: Entry) -> None:
        """``entry``, indexed, was read: it is now the most recently used."""

    @abstractmethod
    def on_remove(self, entry: Entry) -> None:
        """``entry`` left the index: evicted, removed (corrupt, vanished) or replaced by a refetch."""

    @abstractmethod
    def victim(self, spare_ranked: bool = False) -> Entry | None:
        """The unpinned entry to evict next to make room, or ``None``: nothing (more) may go. The
        store evicts it and asks again until the fill fits. ``spare_ranked``: for a fill the plan
        asked for, never an entry the plan ranks (only a policy that ranks has any)."""

    @abstractmethod
    def spare(self) -> tuple[int, int]:
        """The bytes and entries :meth:`victim` with ``spare_ranked`` could name at most (pinned
        ones included: an estimate), for the store to refuse a plan's fill that cannot fit at once
        rather than evict for it in vain."""

    def on_awaited(self, entry: Entry) -> None:
        """``entry``, just indexed (:meth:`on_add`), was filled for a reader that announced it will
        read it (a prefetch hint), and nobody has read it yet. Only ``planned`` acts on it."""
        return

    def plan(self, order: Sequence[int], ranks: Mapping[int, int], entered: Sequence[int], left: Sequence[int],
             name_hash: NameHash) -> None:
        """A lease master's plan (:meth:`cache.Store.set_plan`): ``order`` names the objects to
        keep, soonest needed first, each once; ``ranks`` maps each name to its index in ``order``;
        ``entered`` and ``left`` are the names that came into and went out of it since the last
        plan. A policy that does not evict by plan ignores it."""
        return  # lru and hold: their orders are their own

    def describe(self) -> dict[str, int]:
        """Figures of the policy's own for the store's stats ({} for none)."""
        return {}


class LRUPolicy(EvictionPolicy):
    """The least recently used unpinned entry goes first."""

    def __init__(self) -> None:
        self._order: OrderedDict[str, Entry] = OrderedDict()  # entry id -> entry, oldest first
        self.bytes = 0  # of the entries in the order

    def on_add(self, entry: Entry) -> None:
        self._order[entry.id] = entry
        self.bytes += entry.size

    def add_oldest(self, entry: Entry) -> None:
        """Index ``entry`` as the least recently used (the next to go)."""
        self.on_add(entry)
        self._order.move_to_end(entry.id, last=False)

    def on_touch(self, entry: Entry) -> None:
        if entry.id in self._order:
            self._order.move_to_end(entry.id)

    def on_remove(self, entry: Entry) -> None:
        gone = self._order.pop(entry.id, None)
        if gone is not None:
            self.bytes -= gone.size

    def __contains__(self, entry: Entry) -> bool:
        return entry.id in self._order

    def entries(self) -> list[Entry]:
        """The entries in the order, oldest first."""
        return list(self._order.values())

    def __len__(self) -> int:
        return len(self._order)

    def victim(self, spare_ranked: bool = False) -> Entry | None:
        return next((entry for entry in self._order.values() if entry.pins == 0), None)

    def spare(self) -> tuple[int, int]:
        return self.bytes, len(self._order)


class HoldPolicy(EvictionPolicy):
    """Evict nothing: admit fills while they fit, then serve misses uncached (with shuffled epochs
    over a dataset larger than the cache this keeps a fixed share of hits; see
    ``StoreSettings.eviction``). Keeps no order, as it never chooses."""

    evicts_for_room = False

    def on_add(self, entry: Entry) -> None:
        pass

    def on_touch(self, entry: Entry) -> None:
        pass

    def on_remove(self, entry: Entry) -> None:
        pass

    def victim(self, spare_ranked: bool = False) -> Entry | None:
        return None

    def spare(self) -> tuple[int, int]:
        return 0, 0


class BorrowedFirst(EvictionPolicy):
    """Borrowed entries (``Entry.borrowed``: copies of objects another daemon of the cluster owns,
    which it could read again from that peer), least recently used first, go before anything the
    ``owned`` policy would evict: a node's share of the cluster's dataset stays while its disk holds
    borrowed copies. A borrowed entry is in the borrowed order only, an owned one in ``owned``'s."""

    def __init__(self, owned: EvictionPolicy) -> None:
        self._borrowed = LRUPolicy()
        self._owned = owned

    def _order_of(self, entry: Entry) -> EvictionPolicy:
        return self._borrowed if entry.borrowed else self._owned

    def on_add(self, entry: Entry) -> None:
        self._order_of(entry).on_add(entry)

    def on_touch(self, entry: Entry) -> None:
        self._order_of(entry).on_touch(entry)

    def on_remove(self, entry: Entry) -> None:
        self._order_of(entry).on_remove(entry)

    def victim(self, spare_ranked: bool = False) -> Entry | None:
        victim = self._borrowed.victim(spare_ranked)
        return victim if victim is not None else self._owned.victim(spare_ranked)

    def spare(self) -> tuple[int, int]:
        (borrowed_bytes, borrowed), (owned_bytes, owned) = self._borrowed.spare(), self._owned.spare()
        return borrowed_bytes + owned_bytes, borrowed + owned


class _FarthestFirst:
    """The entries of one kind (borrowed, or owned) whose names a plan ranks, farthest needed first:
    a walk down the plan's order from its end, with no order of its own to keep in step.

    The walk's ``cursor`` only moves down: no position above it holds an unpinned entry of this
    kind, but those in ``above`` (a max-heap of positions): entries indexed there after the walk
    passed (a refetch of an object the plan ranks), and positions where every entry of this kind
    was pinned when the walk passed. Over one plan the walk passes each position once; each
    victim costs the pinned positions in front of it, as in an LRU order."""

    def __init__(self, borrowed: bool) -> None:
        self.borrowed = borrowed
        self.count = 0  # entries of this kind ranked now
        self._order: Sequence[int] = ()
        self._cursor = -1
        self._above: list[int] = []  # negated positions, so that heapq's smallest is the farthest

    def reset(self, order: Sequence[int]) -> None:
        """A new plan: the walk starts again from the end of its order."""
        self._order = order
        self._cursor = len(order) - 1
        self._above = []

    def added(self, rank: int) -> None:
        self.count += 1
        if rank > self._cursor:
            heapq.heappush(self._above, -rank)

    def _at(self, rank: int, by_hash: Mapping[int, Mapping[str, Entry]]) -> tuple[bool, Entry | None]:
        """Whether position ``rank`` holds an entry of this kind, and an unpinned one if any."""
        found = False
        for entry in by_hash.get(self._order[rank], {}).values():
            if entry.borrowed == self.borrowed:
                if entry.pins == 0:
                    return True, entry
                found = True
        return found, None

    def victim(self, by_hash: Mapping[int, Mapping[str, Entry]]) -> Entry | None:
        if not self.count:
            return None
        pinned: list[int] = []
        try:
            while self._above:
                rank = -self._above[0]
                found, entry = self._at(rank, by_hash)
                if entry is not None:
                    return entry  # stays in the heap: looked at again once it is gone
                heapq.heappop(self._above)
                if found:
                    pinned.append(rank)
            while self._cursor >= 0:
                rank = self._cursor
                found, entry = self._at(rank, by_hash)
                if entry is not None:
                    return entry  # the cursor stays: a second version of the name may be there
                self._cursor -= 1
                if found:
                    pinned.append(rank)  # above the cursor now: looked at first next time
            return None
        finally:
            for rank in pinned:
                heapq.heappush(self._above, -rank)


class PlannedPolicy(EvictionPolicy):
    """``planned``: evict by the lease master's plan, Belady's rule over the order it knows.

    The plan (:meth:`plan`) ranks the cached objects the master's trainers will read, by when
    (rank = the name's index in the plan's ``keep``, soonest needed first). Victims, in order:

    1. borrowed entries (copies another daemon of the cluster owns), as under ``lru``: first those
       the plan does not rank, least recently used first, then those it ranks, farthest first;
    2. owned entries the plan does not rank, least recently used first (what other readers use,
       and what the plan no longer needs: an entry whose name leaves the plan goes to the least
       recently used end, first to go);
    3. owned entries the plan ranks, farthest needed (largest rank) first: Belady's rule.

    Awaited entries (:meth:`on_awaited`: a reader's hint or a plan's prefetch filled them, the plan
    does not rank them, nobody has read them yet) go after the ranked ones of their kind, oldest
    first. The plan cannot rank them yet: the master learns of an entry from the node's next
    report, and its answer is the plan after that. (A plan's prefetch is ranked by the plan that
    asked for it, but lands unranked when a plan answered while it filled no longer lists it: its
    shard was leased meanwhile, and the master ranks a leased shard only once the node holds it.
    The bed's daemon logs showed one evicted by the next plan fill 24 ms after it landed, and
    fetched again when its trainer read it 0.4 s later.) Until
    then such an entry was unranked, the first a plan's fill evicted: in the capacity bed the hints'
    fills evicted unread were 0.04-0.09 of the dataset an epoch, the largest waste the counters
    showed, though each was the next shard of a trainer reading now. An entry stops being awaited
    when it is read (:meth:`on_touch`), when a plan ranks it, when the second plan after it was
    indexed does not (the master knew of it and does not need it, or its reader is outside the
    master's jobs), and at the latest :attr:`AWAITED_S` after it was indexed (a master gone
    silent); not read, it is then an unranked entry like one just filled, never worse placed than
    it was without this rule. Before the first plan nothing is awaited: without a master the
    order is ``lru``'s.

    A fill the plan asked for, and a borrowed copy's (``spare_ranked``), takes victims of 1 and 2
    only, never an entry the plan ranks or a reader awaits: a prefetch of what is needed next must
    not evict what is needed sooner, nor a copy its owner keeps what this node keeps. A demand
    read's fill of an object this node owns may evict ranked entries, farthest first, then awaited
    ones. Without a plan every entry is unranked and the order is ``lru``'s exactly.

    Names are hashes (``wire.nodeplan.name_hash``, passed in by the store's caller with the
    plan): an entry's rank is its name's, whatever its version. The policy indexes entries by
    name from the first plan on (that plan costs one pass over the index); each notification
    after that stays O(1).
    """

    ranks = True

    AWAITED_S = 60.0
    """The longest an entry stays awaited unread without a plan deciding (a master gone silent)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._unranked = {True: LRUPolicy(), False: LRUPolicy()}  # by Entry.borrowed
        self._ranked = {True: _FarthestFirst(True), False: _FarthestFirst(False)}
        # Awaited entries, oldest first: entry id -> (entry, the plan count when it was indexed,
        # the clock then). In none of the orders above (neither unranked nor counted as ranked).
        self._awaited: OrderedDict[str, tuple[Entry, int, float]] = OrderedDict()
        self._plans = 0  # plans received
        self._clock = clock
        self._ranks: Mapping[int, int] = {}
        self._name_hash: NameHash | None = None  # known from the first plan
        self._by_hash: dict[int, dict[str, Entry]] = {}  # name -> its indexed versions, from the first plan

    def _hash(self, entry: Entry) -> int | None:
        return self._name_hash(entry.bucket, entry.key) if self._name_hash is not None else None

    def on_add(self, entry: Entry) -> None:
        name = self._hash(entry)
        if name is None:
            self._unranked[entry.borrowed].on_add(entry)
            return
        self._by_hash.setdefault(name, {})[entry.id] = entry
        rank = self._ranks.get(name)
        if rank is None:
            self._unranked[entry.borrowed].on_add(entry)
        else:
            self._ranked[entry.borrowed].added(rank)

    def on_awaited(self, entry: Entry) -> None:
        unranked = self._unranked[entry.borrowed]
        if self._name_hash is None or entry not in unranked:
            return  # no plan yet (lru's order), or ranked already: kept as the plan says
        unranked.on_remove(entry)
        self._awaited[entry.id] = (entry, self._plans, self._clock())

    def _unawait(self, entry: Entry) -> None:
        """``entry`` (awaited, just taken out of ``_awaited``) back into the order its name's rank
        says: ranked, or unranked as the most recently used."""
        name = self._hash(entry)
        rank = self._ranks.get(name) if name is not None else None
        if rank is not None:
            self._ranked[entry.borrowed].added(rank)
        else:
            self._unranked[entry.borrowed].on_add(entry)

    def _expire(self) -> None:
        """Awaited entries past :attr:`AWAITED_S` back into the order (the oldest are first)."""
        limit = self._clock() - self.AWAITED_S
        while self._awaited:
            ident, (entry, _, since) = next(iter(self._awaited.items()))
            if since > limit:
                break
            del self._awaited[ident]
            self._unawait(entry)

    def on_touch(self, entry: Entry) -> None:
        if self._awaited.pop(entry.id, None) is not None:
            self._unawait(entry)  # read: it waits for nobody now
            return
        self._unranked[entry.borrowed].on_touch(entry)  # a ranked entry's place is its rank

    def on_remove(self, entry: Entry) -> None:
        unranked = self._unranked[entry.borrowed]
        if self._awaited.pop(entry.id, None) is not None:
            ranked = False
        elif entry in unranked:
            unranked.on_remove(entry)
            ranked = False
        else:
            ranked = True
        name = self._hash(entry)
        if name is None:
            return
        versions = self._by_hash.get(name)
        if versions is None or versions.pop(entry.id, None) is None:
            return
        if not versions:
            del self._by_hash[name]
        if ranked:
            self._ranked[entry.borrowed].count -= 1

    def victim(self, spare_ranked: bool = False) -> Entry | None:
        if self._awaited:
            self._expire()
        for borrowed in (True, False):
            victim = self._unranked[borrowed].victim()
            if victim is None and not spare_ranked:
                victim = self._ranked[borrowed].victim(self._by_hash)
                if victim is None:
                    victim = next((entry for entry, _, _ in self._awaited.values()
                                   if entry.borrowed == borrowed and entry.pins == 0), None)
            if victim is not None:
                return victim
        return None

    def spare(self) -> tuple[int, int]:
        borrowed, owned = self._unranked[True], self._unranked[False]
        return borrowed.bytes + owned.bytes, len(borrowed) + len(owned)

    def plan(self, order: Sequence[int], ranks: Mapping[int, int], entered: Sequence[int], left: Sequence[int],
             name_hash: NameHash) -> None:
        if self._name_hash is not name_hash:
            # The first plan: every entry indexed by name, once (all unranked until now).
            entries = [entry for unranked in self._unranked.values() for entry in unranked.entries()]
            entries += [entry for versions in self._by_hash.values() for entry in versions.values()
                        if entry not in self._unranked[entry.borrowed]]
            self._name_hash = name_hash
            self._by_hash = {}
            for entry in entries:
                self._by_hash.setdefault(name_hash(entry.bucket, entry.key), {})[entry.id] = entry
        self._ranks = ranks
        self._plans += 1
        for ident, (entry, since, _) in list(self._awaited.items()):
            # Ranked now: kept by the plan. Or indexed before the last plan: the report before
            # this plan named it, so this plan had its chance to rank it and does not need it (or
            # its reader is outside the master's jobs): unranked, as if just filled.
            if name_hash(entry.bucket, entry.key) in ranks or since <= self._plans - 2:
                del self._awaited[ident]
                self._unawait(entry)
        for name in entered:
            for entry in self._by_hash.get(name, {}).values():
                unranked = self._unranked[entry.borrowed]
                if entry in unranked:
                    unranked.on_remove(entry)
                    self._ranked[entry.borrowed].count += 1
        for name in left:
            for entry in self._by_hash.get(name, {}).values():
                unranked = self._unranked[entry.borrowed]
                if entry not in unranked and entry.id not in self._awaited:
                    self._ranked[entry.borrowed].count -= 1
                    unranked.add_oldest(entry)  # no longer needed by the plan: first to go
        for ranked in self._ranked.values():
            ranked.reset(order)

    def describe(self) -> dict[str, int]:
        return {
            "plan_names": len(self._ranks),
            "ranked_items": self._ranked[True].count + self._ranked[False].count,
            "unranked_items": len(self._unranked[True]) + len(self._unranked[False]),
            "awaited_items": len(self._awaited),
        }


class TenantQuota:
    """Per-tenant figures behind ``StoreSettings.tenant_quota_bytes`` (``quota``; ``None``: no
    quota, the figures are still kept for the stats), under any policy.

    For each tenant (never "": entries of tenant "" count for nobody): its entries in least
    recently used order, told in step with the policy by the store, so quota eviction takes the
    oldest without scanning; the bytes of those entries; and the bytes its fills in progress
    reserve. A tenant with nothing left is dropped, so the maps hold only tenants with something in
    the cache."""

    def __init__(self, quota: int | None) -> None:
        self.quota = quota
        self._lru: dict[str, OrderedDict[str, Entry]] = {}  # tenant -> {entry id: entry}, oldest first
        self._used: dict[str, int] = {}
        self._reserved: dict[str, int] = {}

    def on_add(self, entry: Entry) -> None:
        if entry.tenant:
            self._lru.setdefault(entry.tenant, OrderedDict())[entry.id] = entry
            self._used[entry.tenant] = self._used.get(entry.tenant, 0) + entry.size

    def on_touch(self, entry: Entry) -> None:
        entries = self._lru.get(entry.tenant)
        if entries is not None and entry.id in entries:
            entries.move_to_end(entry.id)

    def on_remove(self, entry: Entry) -> None:
        entries = self._lru.get(entry.tenant)
        if entries is None or (gone := entries.pop(entry.id, None)) is None:
            return
        self._used[entry.tenant] -= gone.size
        if not entries:
            del self._lru[entry.tenant]
            del self._used[entry.tenant]

    def reserve(self, tenant: str, delta: int) -> None:
        """A fill of ``tenant`` began (``delta`` > 0: its size) or ended (< 0)."""
        if not tenant:
            return
        left = self._reserved.get(tenant, 0) + delta
        if left:
            self._reserved[tenant] = left
        else:
            self._reserved.pop(tenant, None)

    def used(self, tenant: str) -> int:
        return self._used.get(tenant, 0) if tenant else 0

    def reserved(self, tenant: str) -> int:
        return self._reserved.get(tenant, 0) if tenant else 0

    def items(self, tenant: str) -> int:
        entries = self._lru.get(tenant) if tenant else None
        return len(entries) if entries else 0

    def charged(self, tenant: str) -> int:
        """What counts against the tenant's quota: its entries plus its fills in progress."""
        return self.used(tenant) + self.reserved(tenant)

    @property
    def count(self) -> int:
        """How many tenants have entries in the cache."""
        return len(self._lru)

    def over(self) -> int:
        """How many tenants are past the quota (possible after a restart with a smaller one)."""
        quota = self.quota
        if quota is None:
            return 0
        return sum(1 for tenant in self._used.keys() | self._reserved.keys() if self.charged(tenant) > quota)

    def victims(self, tenant: str, size: int) -> list[Entry] | None:
        """The tenant's unpinned entries, least recently used first, whose eviction brings its
        entries plus fills in progress plus ``size`` within the quota (none without a tenant or a
        quota); ``None`` if they cannot."""
        if not tenant or self.quota is None:
            return []
        if size > self.quota:
            return None
        excess = self.charged(tenant) + size - self.quota
        victims: list[Entry] = []
        for entry in self._lru.get(tenant, OrderedDict()).values():
            if excess <= 0:
                break
            if entry.pins == 0:
                victims.append(entry)
                excess -= entry.size
        return victims if excess <= 0 else None


POLICIES: Mapping[str, Callable[[], EvictionPolicy]] = {
    "lru": lambda: BorrowedFirst(LRUPolicy()),
    "hold": HoldPolicy,  # borrowed entries stay too: hold evicts nothing for room
    "planned": PlannedPolicy,  # borrowed first too (its docstring)
}
"""Every ``StoreSettings.eviction`` and the policy it makes: the one place a name becomes a policy."""

EVICTION_POLICIES = tuple(POLICIES)


def policy_for(eviction: str) -> EvictionPolicy:
    """A fresh policy for a store whose ``StoreSettings.eviction`` is ``eviction`` (a checked name)."""
    return POLICIES[eviction]()
