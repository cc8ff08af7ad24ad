"""The store's admission into free room only (``Store.has_room``, ``begin(evict=False)``), what a
fill behind a direct range is admitted by: real files in a tmp dir."""

from __future__ import annotations

import os
from pathlib import Path

from cache import Entry, Store, StoreSettings

ALICE = "arn:aws:iam::123456789012:user/alice"


def make(root: Path, capacity: int = 300, quota: int | None = None, max_items: int = 1000) -> Store:
    store = Store(StoreSettings(root=root, capacity_bytes=capacity, min_free_ratio=0.0, max_items=max_items,
                                tenant_quota_bytes=quota))
    store.open()
    return store


def put(store: Store, key: str, size: int, tenant: str = "", evict: bool = True) -> Entry | None:
    writer = store.begin("b", key, f'"{key}"', size, tenant=tenant, evict=evict)
    if writer is None:
        return None
    writer.write_at(0, os.urandom(size))
    return writer.commit()


def keys(store: Store) -> set[str]:
    return {entry.key for entry in store.entries()}


def test_free_room_counts_entries_and_the_room_fills_in_progress_reserved(tmp_path: Path) -> None:
    store = make(tmp_path, capacity=300)
    assert put(store, "a", 100) is not None
    filling = store.begin("b", "f", '"f"', 100)  # reserved, not published
    assert filling is not None
    assert store.has_room(100) and not store.has_room(101)
    assert store.begin("b", "big", '"big"', 101, evict=False) is None  # would evict a: refused
    assert keys(store) == {"a"} and store.stats()["evictions"] == 0
    assert store.stats()["rejected_full"] == 1
    assert put(store, "c", 100, evict=False) is not None  # fits into the free room
    assert not store.has_room(1)
    filling.abort()  # its reservation goes back
    assert store.has_room(100)
    # A demand fill keeps the eviction policy: it makes room.
    assert put(store, "d", 250) is not None
    assert store.stats()["evictions"] == 2 and keys(store) == {"d"}


def test_an_object_larger_than_the_cache_and_the_item_limit(tmp_path: Path) -> None:
    store = make(tmp_path, capacity=300, max_items=2)
    assert not store.has_room(301)
    assert put(store, "a", 10, evict=False) is not None and put(store, "b", 10, evict=False) is not None
    assert not store.has_room(10)  # two items already: a third would evict
    assert put(store, "c", 10, evict=False) is None and keys(store) == {"a", "b"}


def test_free_room_within_the_tenants_quota_only(tmp_path: Path) -> None:
    store = make(tmp_path, capacity=1000, quota=150)
    assert put(store, "a", 100, ALICE) is not None
    assert store.has_room(50, ALICE) and not store.has_room(51, ALICE)
    assert store.has_room(500)  # nobody's: no quota
    # Past the quota the tenant's own entries would go: not without eviction.
    assert put(store, "b", 100, ALICE, evict=False) is None and keys(store) == {"a"}
    assert put(store, "b", 100, ALICE) is not None and keys(store) == {"b"}
