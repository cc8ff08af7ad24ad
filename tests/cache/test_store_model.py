"""The store against a plain reference model, driven by hypothesis: random sequences of reads as
the daemon makes them (a hit read verified, a miss filled whole, now and then a refetch), fills step
by step (begun for a tenant or none, owned or borrowed, of sizes around the capacity; written,
sealed and placed, committed or aborted, some with a checksum that fails), lookups, touches, pins,
removals, damage to published files and restarts on the same directory, under ``lru`` and ``hold``,
with and without a tenant quota, in a cache of 4 KiB and a few items.

The model is a second, naive implementation of the rules in ``cache/store.py`` and
``cache/eviction.py``: one dict of what is cached, oldest first, with each entry's size, tenant,
borrowed flag, pins and bytes, and the fills in progress. It chooses every eviction by filtering
that one order (a tenant's oldest for its quota; borrowed, then owned, for room under ``lru``;
nothing under ``hold``), so the store's own orders, kept by its policy, must agree with it at every
step: after each step the indexed set, every counter, each tenant's usage and the files on disk
are the model's, the limits hold, and nothing pinned was evicted (it would be missing).

Damage is a byte flipped or the file truncated (the next read must refuse it with
:class:`CorruptEntry` and drop the entry, never serve the wrong bytes), or a meta file made
unreadable, given the wrong size or the wrong checksum (a running store never reads it again; after
a restart the entry is not loaded, or is loaded and refused at its first read). A restart closes
the store (its fills are aborted) and opens a new one on the same directory: the same entries,
minus the damaged ones, in the same least-recently-used order.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from cache import CorruptEntry, Entry, IntegrityError, Store, StoreSettings, Writer, entry_id

ALICE = "arn:aws:iam::123456789012:user/alice"
BOB = "arn:aws:iam::123456789012:user/bob"
TENANTS = ("", ALICE, BOB)
KEYS = tuple(f"k{i}" for i in range(8))
BUCKET = "b"
CAPACITY = 4096
SIZES = (1, 500, 900, 1300, 2000, 2600, CAPACITY + 1)
# A change to a file within one tick of the file system's timestamps after the store last verified
# it leaves its (inode, size, mtime, ctime) stamp as it was, so the store cannot see it without
# re-hashing (kernels before multigrain timestamps tick every 1-10 ms): damage waits for the tick.
TIMESTAMP_TICK_NS = 20_000_000
DATA_DAMAGE = ("flip", "truncate")
META_DAMAGE = ("garbage", "size", "checksum")
FILL = st.tuples(st.sampled_from(KEYS), st.sampled_from(TENANTS), st.booleans())  # key, tenant, borrowed


def etag(key: str) -> str:
    return f'"{key}"'


def ident(key: str) -> str:
    return entry_id("", BUCKET, key, etag(key))


@dataclass
class Cached:
    """What the model holds of one cached entry."""

    size: int
    tenant: str
    borrowed: bool
    payload: bytes
    generation: int
    """Which publication (or load at start-up) made it: pins taken on an older one do not count."""
    pins: int = 0
    data_damage: str = ""
    """A damage to the data file that no read has found yet: the next read must refuse it."""
    meta_damage: str = ""


@dataclass
class Fill:
    """A fill in progress, as the model sees it."""

    writer: Writer
    size: int
    tenant: str
    borrowed: bool
    payload: bytes
    bad: bool
    """Begun with an expected checksum its bytes do not have: it can never be published."""
    written: bool = False
    placed: bool = False


class StoreMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.root = Path(tempfile.mkdtemp(prefix="store-model-"))
        self.store: Store | None = None
        self.cached: dict[str, Cached] = {}  # key -> entry, least recently used first
        self.fills: dict[str, Fill] = {}
        self.pins: list[tuple[str, int, contextlib.AbstractContextManager[Entry]]] = []
        self.generation = 0
        self.counters = self.zero_counters()

    # -- setup --

    @initialize(
        eviction=st.sampled_from(["lru", "lru", "hold"]),  # lru has more to get wrong
        max_items=st.sampled_from([2, 3, 5, 8]),
        quota=st.sampled_from([None, 1500, 3000]),
        sizes=st.lists(st.sampled_from(SIZES), min_size=len(KEYS), max_size=len(KEYS)),
        fills=st.lists(FILL, min_size=3, max_size=12),
    )
    def start(self, eviction: str, max_items: int, quota: int | None, sizes: list[int],
              fills: list[tuple[str, str, bool]]) -> None:
        self.store_settings = StoreSettings(
            root=self.root, capacity_bytes=CAPACITY, min_free_ratio=0.0, max_items=max_items, eviction=eviction,
            tenant_quota_bytes=quota,
        )
        self.sizes = dict(zip(KEYS, sizes, strict=True))
        self.store = Store(self.store_settings)
        self.store.open()
        for key, tenant, borrowed in fills:  # a cache under pressure from the first step
            self.get(key, tenant, borrowed)

    def teardown(self) -> None:
        if self.store is not None:
            self.store.close()
        shutil.rmtree(self.root, ignore_errors=True)

    # -- helpers --

    @staticmethod
    def zero_counters() -> dict[str, int]:
        return {
            "evictions": 0, "evicted_bytes": 0, "admitted": 0, "rejected_full": 0, "integrity_failures": 0,
            "corrupt_removed": 0, "quota_evictions": 0, "quota_evicted_bytes": 0, "rejected_quota": 0,
        }

    @property
    def live(self) -> Store:
        assert self.store is not None
        return self.store

    def next_generation(self) -> int:
        self.generation += 1
        return self.generation

    def used(self) -> int:
        return sum(c.size for c in self.cached.values())

    def reserved(self) -> int:
        return sum(f.size for f in self.fills.values())

    def fits(self, size: int, freed_bytes: int = 0, freed_items: int = 0) -> bool:
        return (
            self.used() - freed_bytes + self.reserved() + size <= CAPACITY
            and len(self.cached) - freed_items + len(self.fills) + 1 <= self.store_settings.max_items
        )

    def evict(self, key: str, reason: str) -> None:
        gone = self.cached.pop(key)
        assert gone.pins == 0, f"the model evicted pinned {key}"
        self.counters[f"{reason}evictions"] += 1
        self.counters[f"{reason}evicted_bytes"] += gone.size

    def admits(self, size: int, tenant: str) -> bool:
        """The model's admission of a fill: evicts what it must (as the store should) and says
        whether the fill is admitted."""
        if size > CAPACITY:
            self.counters["rejected_full"] += 1
            return False
        quota = self.store_settings.tenant_quota_bytes
        if tenant and quota is not None:
            charged = sum(c.size for c in self.cached.values() if c.tenant == tenant)
            charged += sum(f.size for f in self.fills.values() if f.tenant == tenant)
            excess = charged + size - quota
            victims: list[str] = []
            for key, cached in self.cached.items():  # oldest first
                if excess <= 0:
                    break
                if cached.tenant == tenant and cached.pins == 0:
                    victims.append(key)
                    excess -= cached.size
            if size > quota or excess > 0:
                self.counters["rejected_quota"] += 1
                return False
            freed = sum(self.cached[key].size for key in victims)
            if victims and self.store_settings.eviction == "hold" and not self.fits(size, freed, len(victims)):
                self.counters["rejected_full"] += 1
                return False
            for key in victims:
                self.evict(key, "quota_")
        while not self.fits(size):
            candidates = [key for key, c in self.cached.items() if c.borrowed and c.pins == 0]
            candidates += [key for key, c in self.cached.items() if not c.borrowed and c.pins == 0]
            if self.store_settings.eviction == "hold" or not candidates:
                self.counters["rejected_full"] += 1
                return False
            self.evict(candidates[0], "")
        return True

    def entry(self, key: str) -> Entry:
        found = self.live.lookup(BUCKET, key)
        assert found is not None, f"{key} is cached in the model, not in the store"
        return found

    def data_path(self, key: str) -> Path:
        return self.root / "v1" / "data" / ident(key)[:2] / ident(key)

    def meta_path(self, key: str) -> Path:
        return self.root / "v1" / "meta" / ident(key)[:2] / f"{ident(key)}.json"

    # -- fills --

    def begin_fill(self, key: str, tenant: str, borrowed: bool, bad: bool) -> Fill | None:
        size = self.sizes[key]
        payload = random.Random(f"{key}/{self.next_generation()}").randbytes(size)
        expected = "0" * 32 if bad else None
        writer = self.live.begin(BUCKET, key, etag(key), size, expected, tenant=tenant, borrowed=borrowed)
        assert (writer is not None) == self.admits(size, tenant)
        if writer is None:
            return None
        self.fills[key] = Fill(writer, size, tenant, borrowed, payload, bad)
        return self.fills[key]

    def free_key(self, data: st.DataObject) -> str:
        # One fill per object at a time: the daemon's single flight (sidecar.daemon.fills) keeps it so.
        return data.draw(st.sampled_from([k for k in KEYS if k not in self.fills]), label="key")

    @rule(fill=FILL, refetch=st.sampled_from([False, False, False, True]))
    def read(self, fill: tuple[str, str, bool], refetch: bool) -> None:
        """What the daemon does for a read: a hit is read (verified) from the cache, a miss filled
        whole (begin, write, commit) unless a fill of it is in progress. ``refetch``: a hit is
        filled again over the cached copy (as the daemon refetches a disputed or unverified one)."""
        self.get(*fill, refetch=refetch)

    def get(self, key: str, tenant: str, borrowed: bool, refetch: bool = False) -> None:
        if key in self.cached and not refetch:
            self.use_entry(key, "open_verified")
        elif key not in self.fills and self.begin_fill(key, tenant, borrowed, bad=False) is not None:
            self.write_fill(key, split=False)
            self.commit_fill(key)

    @precondition(lambda self: len(self.fills) < len(KEYS))
    @rule(data=st.data(), tenant=st.sampled_from(TENANTS), borrowed=st.booleans(), bad=st.booleans())
    def begin(self, data: st.DataObject, tenant: str, borrowed: bool, bad: bool) -> None:
        self.begin_fill(self.free_key(data), tenant, borrowed, bad)

    def pick_fill(self, data: st.DataObject, written: bool | None = None) -> str:
        keys = [k for k, f in self.fills.items() if written is None or f.written == written]
        return data.draw(st.sampled_from(sorted(keys)), label="fill")

    @precondition(lambda self: any(not f.written for f in self.fills.values()))
    @rule(data=st.data(), split=st.booleans())
    def write(self, data: st.DataObject, split: bool) -> None:
        self.write_fill(self.pick_fill(data, written=False), split)

    def write_fill(self, key: str, split: bool) -> None:
        fill = self.fills[key]
        half = fill.size // 2 if split else 0
        fill.writer.write_at(half, fill.payload[half:])  # the later part first, as parallel parts land
        if half:
            fill.writer.write_at(0, fill.payload[:half])
        fill.written = True

    @precondition(lambda self: any(f.written and not f.placed for f in self.fills.values()))
    @rule(data=st.data())
    def seal_and_place(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from(sorted(k for k, f in self.fills.items() if f.written and not f.placed)),
                        label="fill")
        fill = self.fills[key]
        if fill.bad:
            with pytest.raises(IntegrityError):
                fill.writer.seal()
            self.counters["integrity_failures"] += 1
            fill.writer.abort()  # what a fill does when its bytes fail
            del self.fills[key]
            return
        fill.writer.seal()
        placed = fill.writer.place()
        # A refetch of an indexed entry is placed at its commit only: its file serves until then.
        assert (placed is None) == (key in self.cached)
        fill.placed = placed is not None

    @precondition(lambda self: self.fills)
    @rule(data=st.data(), publish=st.booleans())
    def finish(self, data: st.DataObject, publish: bool) -> None:
        key = self.pick_fill(data)
        if publish:
            self.commit_fill(key)
        else:
            self.fills.pop(key).writer.abort()

    def commit_fill(self, key: str) -> None:
        fill = self.fills.pop(key)
        if not fill.written or fill.bad:
            with pytest.raises(IntegrityError):
                fill.writer.commit()
            self.counters["integrity_failures"] += int(fill.written)  # a short file fails before any check
            return
        entry = fill.writer.commit()
        assert (entry.key, entry.size, entry.tenant, entry.borrowed) == (key, fill.size, fill.tenant, fill.borrowed)
        self.cached.pop(key, None)  # a refetch replaces the entry (unpinned, undamaged, most recent)
        self.cached[key] = Cached(fill.size, fill.tenant, fill.borrowed, fill.payload, self.next_generation())
        self.counters["admitted"] += 1

    # -- entries --

    def pick_cached(self, data: st.DataObject) -> str:
        return data.draw(st.sampled_from(list(self.cached)), label="cached")

    def check_lookup(self, key: str) -> None:
        found = self.live.lookup(BUCKET, key)
        by_etag = self.live.lookup(BUCKET, key, etag=etag(key))
        assert found == by_etag
        assert self.live.lookup(BUCKET, key, etag='"another version"') is None
        cached = self.cached.get(key)
        if cached is None:
            assert found is None
        else:
            assert found is not None and found.id == ident(key)
            assert (found.size, found.tenant, found.borrowed) == (cached.size, cached.tenant, cached.borrowed)

    @precondition(lambda self: self.cached)
    @rule(data=st.data(), how=st.sampled_from(["open_verified", "touch", "touch_in_memory"]))
    def use(self, data: st.DataObject, how: str) -> None:
        """A read of the entry's bytes (verified), or a touch that only refreshes its recency."""
        self.use_entry(self.pick_cached(data), how)

    def use_entry(self, key: str, how: str) -> None:
        cached = self.cached[key]
        entry = self.entry(key)
        if how == "touch":
            self.live.touch(entry)
        elif how == "touch_in_memory":
            self.live.touch_in_memory(entry)
        elif cached.data_damage:
            with pytest.raises(CorruptEntry):
                self.live.open_verified(entry)
            del self.cached[key]
            self.counters["corrupt_removed"] += 1
            return
        else:
            fd, stat = self.live.open_verified(entry)
            try:
                assert stat.st_size == cached.size and os.pread(fd, cached.size + 1, 0) == cached.payload
            finally:
                os.close(fd)
        self.cached[key] = self.cached.pop(key)  # the most recently used now

    @precondition(lambda self: self.cached or self.pins)
    @rule(data=st.data(), release=st.booleans())
    def pin(self, data: st.DataObject, release: bool) -> None:
        """Pin an entry (as a reader does while it sends it), or release a pin taken earlier."""
        if (not release and self.cached) or not self.pins:
            key = self.pick_cached(data)
            pinned = self.live.pinned(self.entry(key))
            pinned.__enter__()
            self.pins.append((key, self.cached[key].generation, pinned))
            self.cached[key].pins += 1
            return
        key, generation, pinned = self.pins.pop(data.draw(st.integers(0, len(self.pins) - 1), label="pin"))
        pinned.__exit__(None, None, None)
        cached = self.cached.get(key)
        if cached is not None and cached.generation == generation:
            cached.pins -= 1

    @precondition(lambda self: self.cached)
    @rule(data=st.data())
    def remove(self, data: st.DataObject) -> None:
        key = self.pick_cached(data)
        self.live.remove(self.entry(key))
        del self.cached[key]

    # -- damage and restarts --

    @precondition(lambda self: self.cached)
    @rule(data=st.data(), kind=st.sampled_from(DATA_DAMAGE + META_DAMAGE))
    def damage(self, data: st.DataObject, kind: str) -> None:
        """Damage to an entry's data file (at most one) or meta file (at most one)."""
        field = "data_damage" if kind in DATA_DAMAGE else "meta_damage"
        key = self.pick_cached(data)
        if getattr(self.cached[key], field):
            return
        if kind in DATA_DAMAGE:
            self.damage_data(key, kind)
        else:
            self.damage_meta(key, kind)
        setattr(self.cached[key], field, kind)

    def damage_data(self, key: str, kind: str) -> None:
        path = self.data_path(key)
        wait = path.stat().st_ctime_ns + TIMESTAMP_TICK_NS - time.time_ns()
        if wait > 0:
            time.sleep(wait / 1e9)
        path.chmod(0o644)
        with open(path, "r+b") as handle:
            if kind == "flip":
                middle = self.cached[key].size // 2
                handle.seek(middle)
                handle.write(bytes([self.cached[key].payload[middle] ^ 0x01]))
            else:
                handle.truncate(self.cached[key].size // 2)
        path.chmod(0o444)

    def damage_meta(self, key: str, kind: str) -> None:
        path = self.meta_path(key)
        if kind == "garbage":
            path.write_bytes(path.read_bytes()[:20])
        else:
            meta = json.loads(path.read_text())
            if kind == "size":
                meta["size"] += 1
            else:
                meta["xxh3_128"] = "0" * 32
            path.write_text(json.dumps(meta))

    @rule()
    def restart(self) -> None:
        self.live.close()  # aborts the fills in progress
        self.fills.clear()
        # Recency survives a restart through the meta files' mtimes, which a running store refreshes
        # at most every 30 s: stamp them as a long-running store would have, in the model's order.
        for age, key in enumerate(reversed(self.cached)):
            stamp = 1_700_000_000 - age
            os.utime(self.meta_path(key), (stamp, stamp))
        self.store = Store(self.store_settings)
        self.store.open()
        self.pins.clear()  # pins held on the old store's entries count for nothing now
        self.counters = self.zero_counters()
        for key in list(self.cached):
            cached = self.cached[key]
            if cached.data_damage == "truncate" or cached.meta_damage in ("garbage", "size"):
                del self.cached[key]  # not loaded
                continue
            if cached.meta_damage == "checksum":
                cached.data_damage = "checksum"  # loaded, and refused when read
            cached.meta_damage = ""
            cached.pins = 0
            cached.generation = self.next_generation()
        assert {e.key for e in self.live.entries()} == set(self.cached)

    # -- invariants --

    @invariant()
    def agrees_with_the_model(self) -> None:
        if self.store is None:
            return
        stats = self.store.stats()
        entries = {e.key: e for e in self.store.entries()}
        assert set(entries) == set(self.cached)
        for key, cached in self.cached.items():
            entry = entries[key]
            assert (entry.size, entry.tenant, entry.borrowed) == (cached.size, cached.tenant, cached.borrowed)
            assert entry.pins == cached.pins
        for key in KEYS:
            self.check_lookup(key)
        assert stats["used_bytes"] == self.used() and stats["reserved_bytes"] == self.reserved()
        assert stats["items"] == len(self.cached) and stats["filling"] == len(self.fills)
        assert stats["borrowed_items"] == sum(c.borrowed for c in self.cached.values())
        assert self.used() + self.reserved() <= CAPACITY
        assert len(self.cached) + len(self.fills) <= self.store_settings.max_items
        tenants = stats["tenants"]
        assert isinstance(tenants, dict)
        figures = {name: stats[name] for name in ("evictions", "evicted_bytes", "admitted", "rejected_full",
                                                  "integrity_failures", "corrupt_removed")}
        figures.update({name: tenants[name] for name in ("quota_evictions", "quota_evicted_bytes", "rejected_quota")})
        assert figures == self.counters
        if self.store_settings.eviction == "hold":
            assert stats["evictions"] == 0
        assert tenants["count"] == len({c.tenant for c in self.cached.values()} - {""})
        assert tenants["over_quota"] == 0
        for tenant in (ALICE, BOB):
            assert self.store.tenant_usage(tenant) == {
                "tenant": tenant,
                "used_bytes": sum(c.size for c in self.cached.values() if c.tenant == tenant),
                "reserved_bytes": sum(f.size for f in self.fills.values() if f.tenant == tenant),
                "items": sum(1 for c in self.cached.values() if c.tenant == tenant),
                "quota_bytes": self.store_settings.tenant_quota_bytes,
            }

    @invariant()
    def files_are_the_entries(self) -> None:
        """Every published entry has its data and meta file; a placed fill has its data file only;
        nothing else lies in the data and meta directories."""
        if self.store is None:
            return
        data = {path.name for path in self.files("data")}
        meta = {path.name for path in self.files("meta")}
        placed = {ident(k) for k, f in self.fills.items() if f.placed}
        assert data == {ident(k) for k in self.cached} | placed
        assert meta == {f"{ident(k)}.json" for k in self.cached}
        for key, cached in self.cached.items():
            if cached.data_damage != "truncate":
                assert self.data_path(key).stat().st_size == cached.size

    def files(self, kind: str) -> Iterator[Path]:
        return (path for path in (self.root / "v1" / kind).glob("*/*") if path.is_file())


TestStoreMachine = StoreMachine.TestCase
TestStoreMachine.settings = settings(
    max_examples=100,
    stateful_step_count=50,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
