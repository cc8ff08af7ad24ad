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
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:  # entries are only named in hints
    from cache.entry import Entry

__all__ = [
    "EvictionPolicy",
    "LRUPolicy",
    "HoldPolicy",
    "BorrowedFirst",
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
    def victim(self) -> Entry | None:
        """The unpinned entry to evict next to make room, or ``None``: nothing (more) may go. The
        store evicts it and asks again until the fill fits."""


class LRUPolicy(EvictionPolicy):
    """The least recently used unpinned entry goes first."""

    def __init__(self) -> None:
        self._order: OrderedDict[str, Entry] = OrderedDict()  # entry id -> entry, oldest first

    def on_add(self, entry: Entry) -> None:
        self._order[entry.id] = entry

    def on_touch(self, entry: Entry) -> None:
        if entry.id in self._order:
            self._order.move_to_end(entry.id)

    def on_remove(self, entry: Entry) -> None:
        self._order.pop(entry.id, None)

    def victim(self) -> Entry | None:
        return next((entry for entry in self._order.values() if entry.pins == 0), None)


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

    def victim(self) -> Entry | None:
        return None


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

    def victim(self) -> Entry | None:
        victim = self._borrowed.victim()
        return victim if victim is not None else self._owned.victim()


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
}
"""Every ``StoreSettings.eviction`` and the policy it makes: the one place a name becomes a policy."""

EVICTION_POLICIES = tuple(POLICIES)


def policy_for(eviction: str) -> EvictionPolicy:
    """A fresh policy for a store whose ``StoreSettings.eviction`` is ``eviction`` (a checked name)."""
    return POLICIES[eviction]()
