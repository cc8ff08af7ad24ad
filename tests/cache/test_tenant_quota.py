"""The per-tenant quota (``StoreSettings.tenant_quota_bytes``): real files in a tmp dir, and the
daemon's fetcher, prefetcher and metrics on a real ``file://`` origin."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest
from prometheus_client import generate_latest

from cache import Entry, Store, StoreSettings

ALICE = "arn:aws:iam::123456789012:user/alice"
BOB = "arn:aws:iam::123456789012:user/bob"


def make(root: Path, quota: int | None = 300, capacity: int = 10_000, eviction: str = "lru") -> Store:
    store = Store(StoreSettings(root=root, capacity_bytes=capacity, min_free_ratio=0.0, eviction=eviction,
                                tenant_quota_bytes=quota))
    store.open()
    return store


def put(store: Store, key: str, size: int, tenant: str = "") -> Entry | None:
    writer = store.begin("b", key, f'"{key}"', size, tenant=tenant)
    if writer is None:
        return None
    writer.write_at(0, os.urandom(size))
    return writer.commit()


def admitted(store: Store, key: str, size: int, tenant: str = "") -> Entry:
    entry = put(store, key, size, tenant)
    assert entry is not None, f"{key} was not admitted"
    return entry


def keys(store: Store) -> set[str]:
    return {entry.key for entry in store.entries()}


def tenants(store: Store) -> dict[str, object]:
    block = store.stats()["tenants"]
    assert isinstance(block, dict)
    return block


def test_quota_evicts_the_tenants_own_least_recently_used_first(tmp_path: Path) -> None:
    store = make(tmp_path, quota=300)
    a1, _, _ = (admitted(store, f"a{i}", 100, ALICE) for i in (1, 2, 3))
    put(store, "b1", 100, BOB)
    put(store, "n1", 100)  # no tenant: counts for nobody
    store.touch(a1)  # alice's LRU order is now a2, a3, a1
    assert put(store, "a4", 100, ALICE) is not None
    assert keys(store) == {"a1", "a3", "a4", "b1", "n1"}  # only a2 went
    # 150 more: a3 (the oldest now) is not enough, a1 goes too; a4 stays.
    assert put(store, "a5", 150, ALICE) is not None
    assert keys(store) == {"a4", "a5", "b1", "n1"}
    assert store.tenant_usage(ALICE) == {
        "tenant": ALICE, "used_bytes": 250, "reserved_bytes": 0, "items": 2, "quota_bytes": 300,
    }
    block = tenants(store)
    assert (block["quota_evictions"], block["quota_evicted_bytes"], block["rejected_quota"]) == (3, 300, 0)
    assert store.stats()["evictions"] == 0  # the capacity figures count none of them
    # A file evicted for the quota is gone from the disk as from the index.
    on_disk = sum(p.stat().st_size for p in (tmp_path / "v1" / "data").rglob("*") if p.is_file())
    assert on_disk == store.stats()["used_bytes"] == 450


def test_a_tenant_under_its_quota_is_untouched_and_capacity_works_as_before(tmp_path: Path) -> None:
    store = make(tmp_path, quota=1000, capacity=500)
    for i in range(3):
        put(store, f"a{i}", 100, ALICE)
    for i in range(3):
        put(store, f"b{i}", 100, BOB)  # the sixth needs room: plain LRU takes a0, anybody's oldest
    assert keys(store) == {"a1", "a2", "b0", "b1", "b2"}
    assert store.stats()["evictions"] == 1 and tenants(store)["quota_evictions"] == 0
    assert store.tenant_usage(ALICE)["used_bytes"] == 200 and store.tenant_usage(BOB)["items"] == 3


def test_an_object_larger_than_the_quota_is_not_admitted(tmp_path: Path) -> None:
    store = make(tmp_path, quota=300)
    put(store, "a1", 100, ALICE)
    assert store.begin("b", "huge", '"h"', 301, tenant=ALICE) is None
    assert keys(store) == {"a1"}  # nothing evicted for an object that could never fit
    assert tenants(store)["rejected_quota"] == 1 and store.stats()["rejected_full"] == 0
    assert put(store, "anon", 301) is not None  # without a tenant there is no quota


def test_pinned_entries_are_not_evicted_for_the_quota(tmp_path: Path) -> None:
    store = make(tmp_path, quota=300)
    a1, a2, _ = (admitted(store, f"a{i}", 100, ALICE) for i in (1, 2, 3))
    with store.pinned(a1), store.pinned(a2):
        # 200 needed, only a3 (100) is evictable: admit nothing, evict nothing.
        assert store.begin("b", "a4", '"a4"', 200, tenant=ALICE) is None
        assert keys(store) == {"a1", "a2", "a3"} and tenants(store)["rejected_quota"] == 1
        # 100 needed: a3 goes, although a1 and a2 are older.
        assert put(store, "a5", 100, ALICE) is not None
        assert keys(store) == {"a1", "a2", "a5"}
    assert tenants(store)["quota_evictions"] == 1


def test_quota_under_hold_still_evicts_the_tenants_entries(tmp_path: Path) -> None:
    store = make(tmp_path, quota=200, capacity=300, eviction="hold")
    put(store, "a1", 100, ALICE)
    put(store, "a2", 100, ALICE)
    put(store, "b1", 100, BOB)  # full: hold admits nothing more...
    assert put(store, "b2", 100, BOB) is None and store.stats()["rejected_full"] == 1
    # ...but alice at her quota makes room with her own oldest entry.
    assert put(store, "a3", 100, ALICE) is not None
    assert keys(store) == {"a2", "a3", "b1"} and tenants(store)["quota_evictions"] == 1


def test_hold_keeps_the_tenants_entries_when_the_cache_would_refuse_anyway(tmp_path: Path) -> None:
    store = make(tmp_path, quota=200, capacity=300, eviction="hold")
    put(store, "a1", 70, ALICE)
    put(store, "a2", 70, ALICE)
    put(store, "b1", 150, BOB)
    # Alice's quota frees a1 (70) for 100 more, but 290 - 70 + 100 > 300 and hold evicts no one
    # else: evicting a1 would cache nothing, so it stays.
    assert put(store, "a3", 100, ALICE) is None
    assert keys(store) == {"a1", "a2", "b1"}
    assert tenants(store)["quota_evictions"] == 0 and store.stats()["rejected_full"] == 1


def test_reserved_bytes_of_a_fill_in_progress_count(tmp_path: Path) -> None:
    store = make(tmp_path, quota=300)
    filling = store.begin("b", "big", '"big"', 200, tenant=ALICE)
    assert filling is not None
    assert store.tenant_usage(ALICE)["reserved_bytes"] == 200
    assert store.begin("b", "more", '"m"', 150, tenant=ALICE) is None  # 200 + 150 > 300, nothing to evict
    put(store, "a1", 100, ALICE)  # 200 + 100 fits
    # 100 more: the fill in progress cannot be evicted, a1 can.
    assert put(store, "a2", 100, ALICE) is not None
    assert keys(store) == {"a2"}
    filling.abort()
    assert store.tenant_usage(ALICE) == {
        "tenant": ALICE, "used_bytes": 100, "reserved_bytes": 0, "items": 1, "quota_bytes": 300,
    }
    done = store.begin("b", "big", '"big"', 200, tenant=ALICE)
    assert done is not None
    done.write_at(0, b"x" * 200)
    done.commit()
    assert store.tenant_usage(ALICE)["used_bytes"] == 300 and store.tenant_usage(ALICE)["reserved_bytes"] == 0


def test_tenant_persists_across_reopen_and_its_lru_is_rebuilt(tmp_path: Path) -> None:
    store = make(tmp_path, quota=300)
    entries = [admitted(store, f"a{i}", 100, ALICE) for i in range(3)]
    put(store, "b1", 50, BOB)
    put(store, "n1", 50)
    store.close()
    # Recency survives a restart through the meta files' mtimes: make a0 the most recent.
    for age, entry in ((100, entries[1]), (90, entries[2]), (10, entries[0])):
        meta = tmp_path / "v1" / "meta" / entry.id[:2] / f"{entry.id}.json"
        assert json.loads(meta.read_text())["tenant"] == ALICE
        stamp = meta.stat().st_mtime - age
        os.utime(meta, (stamp, stamp))
    store = make(tmp_path, quota=300)
    assert {e.key: e.tenant for e in store.entries()} == {"a0": ALICE, "a1": ALICE, "a2": ALICE, "b1": BOB, "n1": ""}
    assert store.tenant_usage(ALICE)["used_bytes"] == 300 and store.tenant_usage(BOB)["items"] == 1
    assert tenants(store)["count"] == 2
    assert put(store, "a3", 100, ALICE) is not None
    assert keys(store) == {"a0", "a2", "a3", "b1", "n1"}  # a1, the least recent before the restart


def test_meta_files_without_a_tenant_load_and_bad_ones_are_discarded(tmp_path: Path) -> None:
    store = make(tmp_path)
    old, long_name, control = (admitted(store, key, 10, ALICE) for key in ("old", "long", "control"))
    store.close()

    def rewrite(entry: Entry, **changes: str | None) -> None:
        path = tmp_path / "v1" / "meta" / entry.id[:2] / f"{entry.id}.json"
        meta = json.loads(path.read_text())
        meta.update(changes)
        if changes.get("tenant") is None:
            del meta["tenant"]  # as a daemon without tenants wrote it
        path.write_text(json.dumps(meta))

    rewrite(old, tenant=None)
    rewrite(long_name, tenant="x" * 2049)
    rewrite(control, tenant="alice\r\nx-evil: 1")
    store = make(tmp_path)
    assert [(e.key, e.tenant) for e in store.entries()] == [("old", "")]
    assert tenants(store)["count"] == 0 and store.tenant_usage(ALICE)["items"] == 0
    with pytest.raises(ValueError, match="control characters"):
        store.begin("b", "k", '"k"', 1, tenant="a\nb")
    with pytest.raises(ValueError, match="2048"):
        store.begin("b", "k", '"k"', 1, tenant="x" * 2049)


def test_stats_tenants_block(tmp_path: Path) -> None:
    store = make(tmp_path, quota=None)
    assert tenants(store) == {"quota_bytes": None, "count": 0, "over_quota": 0,
                              "quota_evictions": 0, "quota_evicted_bytes": 0, "rejected_quota": 0}
    for i in range(4):
        put(store, f"a{i}", 100, ALICE)  # no quota: tracked, never limited
    put(store, "b1", 100, BOB)
    put(store, "n1", 100)
    assert tenants(store)["count"] == 2 and tenants(store)["quota_evictions"] == 0
    assert store.tenant_usage("")["quota_bytes"] is None and store.tenant_usage("")["used_bytes"] == 0
    store.close()
    store = make(tmp_path, quota=300)  # restarted with a quota alice is already past
    assert tenants(store) == {"quota_bytes": 300, "count": 2, "over_quota": 1,
                              "quota_evictions": 0, "quota_evicted_bytes": 0, "rejected_quota": 0}
    assert put(store, "a4", 100, ALICE) is not None  # back within it: a0 and a1 go
    assert store.begin("b", "a5", '"a5"', 400, tenant=ALICE) is None
    assert tenants(store) == {"quota_bytes": 300, "count": 2, "over_quota": 0,
                              "quota_evictions": 2, "quota_evicted_bytes": 200, "rejected_quota": 1}
    assert "alice" not in json.dumps(store.stats()) and "bob" not in json.dumps(store.stats())


def test_a_refetch_counts_for_the_tenant_that_filled_it_last(tmp_path: Path) -> None:
    store = make(tmp_path)
    put(store, "k", 100, ALICE)
    put(store, "k", 100, BOB)  # same object version filled again (an unverified copy refetched)
    assert [e.tenant for e in store.entries()] == [BOB]
    assert store.tenant_usage(ALICE)["items"] == 0 and store.tenant_usage(BOB)["used_bytes"] == 100
    assert tenants(store)["count"] == 1


def test_settings_refuse_a_quota_that_is_not_positive(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="tenant_quota_bytes"):
        StoreSettings(root=tmp_path, tenant_quota_bytes=0)


# -- through the daemon's fetcher, prefetcher and metrics ------------------------------------------


def test_fills_and_prefetches_carry_their_tenant(tmp_path: Path) -> None:
    from sidecar.daemon.claims import Claims, ClaimSettings
    from sidecar.daemon.fills import Fetcher, FetchSettings
    from sidecar.daemon.metrics import Metrics
    from sidecar.daemon.origins import FileOrigin
    from sidecar.daemon.prefetch import Prefetcher, PrefetchItem
    from sidecar.daemon.priority import DEMAND, LEASE
    from sidecar.daemon.reads import ReadService

    bucket = tmp_path / "root" / "bkt"
    bucket.mkdir(parents=True)
    objects = {"one.tar": os.urandom(200), "two.tar": os.urandom(150), "big.tar": os.urandom(400)}
    for name, data in objects.items():
        (bucket / name).write_bytes(data)
    store = make(tmp_path / "cache", quota=300)
    metrics = Metrics()
    metrics.watch_store(store.stats)

    async def scenario() -> None:
        origin = FileOrigin(tmp_path / "root")
        await origin.start()
        fetcher = Fetcher(store, origin, FetchSettings(), metrics)
        reads = ReadService(store, fetcher, Claims(ClaimSettings()), metrics)
        prefetcher = Prefetcher(reads, metrics, workers=1, max_queued=10)
        prefetcher.start()
        try:
            fill, created = fetcher.start("bkt", "one.tar", DEMAND, ALICE)
            joined, again = fetcher.start("bkt", "one.tar", DEMAND, BOB)  # a coalesced reader
            assert created and not again and joined is fill
            entry = await fill.wait_done()
            assert entry is not None and entry.tenant == ALICE
            # Queued for bob: bob's entry, counted against bob's quota.
            assert prefetcher.submit([PrefetchItem("bkt", "two.tar", BOB)], LEASE) == 1
            while store.lookup("bkt", "two.tar") is None or prefetcher.done < 1:
                await asyncio.sleep(0.01)
            assert store.lookup("bkt", "two.tar").tenant == BOB  # type: ignore[union-attr]
            # Past any quota: served from the origin, nothing cached.
            fill, _ = fetcher.start("bkt", "big.tar", DEMAND, ALICE)
            assert await fill.wait_done() is None and not fill.cacheable
            # PrefetchItem(bucket, key) still means no tenant.
            assert PrefetchItem("bkt", "x").tenant == ""
        finally:
            await prefetcher.stop()
            await fetcher.close()
            await origin.close()

    asyncio.run(asyncio.wait_for(scenario(), 30))
    assert store.tenant_usage(ALICE)["used_bytes"] == 200 and store.tenant_usage(BOB)["used_bytes"] == 150
    scraped = generate_latest(metrics.registry).decode()
    figures = {
        line.split()[0]: float(line.split()[1])
        for line in scraped.splitlines() if line.startswith("shardcache_tenant")
    }
    assert figures == {
        "shardcache_tenant_quota_bytes": 300.0,
        "shardcache_tenants": 2.0,
        "shardcache_tenants_over_quota": 0.0,
        "shardcache_tenant_quota_evictions_total": 0.0,
        "shardcache_tenant_quota_evicted_bytes_total": 0.0,
        "shardcache_tenant_quota_rejections_total": 1.0,
    }
    assert "alice" not in scraped


@pytest.mark.parametrize("value", ["0", "lots"])
def test_serve_refuses_a_bad_tenant_quota(tmp_path: Path, value: str) -> None:
    from tests.support.cli import run_cli

    result = run_cli(["serve", "--origin", f"file://{tmp_path}", "--cache-dir", str(tmp_path / "c"),
                      "--tenant-quota", value])
    assert result.returncode == 2, result.stdout + result.stderr
    assert "--tenant-quota" in result.stderr and "Traceback" not in result.stderr
