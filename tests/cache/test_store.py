"""The storage engine on its own: atomic publish, recovery, integrity, and eviction properties."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import pytest
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cache import CacheLocked, CorruptEntry, IntegrityError, Store, StoreSettings


def make(root: Path, capacity: int = 10_000, eviction: str = "lru", max_items: int = 1000, namespace: str = "") -> Store:
    store = Store(StoreSettings(
        root=root, capacity_bytes=capacity, min_free_ratio=0.0, eviction=eviction, max_items=max_items, namespace=namespace,
    ))
    store.open()
    return store


def put(store: Store, key: str, data: bytes, expected: str | None = None):
    writer = store.begin("b", key, f'"{key}"', len(data), expected)
    if writer is None:
        return None
    # out of order, as parallel ranged GETs land
    half = len(data) // 2
    writer.write_at(half, data[half:])
    writer.write_at(0, data[:half])
    return writer.commit()


def test_publish_and_read_back(tmp_path):
    store = make(tmp_path)
    data = os.urandom(5000)
    entry = put(store, "k", data, xxhash.xxh3_128_hexdigest(data))
    assert entry.xxh3_128 == xxhash.xxh3_128_hexdigest(data)
    fd, stat = store.open_verified(entry)
    try:
        assert os.pread(fd, 10_000, 0) == data and stat.st_size == 5000
    finally:
        os.close(fd)
    assert store.lookup("b", "k") == entry
    assert store.lookup("b", "k", xxh3_128="0" * 32) is None  # another version is a miss


def test_checksum_mismatch_publishes_nothing(tmp_path):
    store = make(tmp_path)
    with pytest.raises(IntegrityError):
        put(store, "k", b"abc" * 100, expected="0" * 32)
    assert store.lookup("b", "k") is None
    assert store.stats()["reserved_bytes"] == 0
    assert list((tmp_path / "v1" / "tmp").iterdir()) == []


def test_second_process_cannot_open_the_same_dir(tmp_path):
    make(tmp_path)
    with pytest.raises(CacheLocked):
        make(tmp_path)


def test_restart_rebuilds_index_and_discards_leftovers(tmp_path):
    store = make(tmp_path)
    entries = [put(store, f"k{i}", os.urandom(100 + i)) for i in range(5)]
    partial = store.begin("b", "partial", '"p"', 50)
    partial.write_at(0, b"x" * 20)  # a crash now leaves a temp file
    store.close()
    meta_only = tmp_path / "v1" / "meta" / "aa" / ("aa" * 16 + ".json")
    meta_only.parent.mkdir(exist_ok=True)
    meta_only.write_text('{"id": "' + "aa" * 16 + '", "bucket": "b", "key": "ghost", "etag": "x", "size": 1, "xxh3_128": "0", "created": 0}')
    bad_meta = tmp_path / "v1" / "meta" / entries[0].id[:2] / f"{entries[0].id}.json"
    bad_meta.write_text("{truncated")
    store = make(tmp_path)
    assert list((tmp_path / "v1" / "tmp").iterdir()) == []
    assert not meta_only.exists()
    assert store.lookup("b", "k0") is None and not store.data_path(entries[0]).exists()
    assert {e.key for e in store.entries()} == {"k1", "k2", "k3", "k4"}
    assert store.stats()["used_bytes"] == sum(e.size for e in entries[1:])


def test_a_cache_dir_reused_with_another_origin_serves_none_of_its_entries(tmp_path):
    """StoreSettings.namespace's promise: the same bucket, key and ETag filled from origin A is no
    entry of origin B, by name or by ETag; A's entries are not loaded (nor kept on disk)."""
    first = make(tmp_path, namespace="s3:http://origin-a")
    entry = put(first, "k", b"origin A's bytes")
    assert first.lookup("b", "k") == entry
    first.close()
    second = make(tmp_path, namespace="s3:http://origin-b")
    assert second.lookup("b", "k") is None
    assert second.lookup("b", "k", etag=entry.etag) is None
    assert second.entries() == [] and second.stats()["used_bytes"] == 0
    assert not second.data_path(entry).exists()
    assert list((tmp_path / "v1" / "meta").rglob("*.json")) == []
    second.close()
    # back on origin A, the entry is gone too: a miss (refetched), never stale bytes
    assert make(tmp_path, namespace="s3:http://origin-a").lookup("b", "k") is None


def test_a_meta_file_that_does_not_match_its_own_id_is_not_loaded(tmp_path):
    """A meta file whose bucket/key/ETag are not what its id (its file name) was computed from
    would answer one object's name with another object's bytes: it is not loaded."""
    store = make(tmp_path)
    k0 = put(store, "k0", b"the bytes of k0")
    k1 = put(store, "k1", b"the bytes of k1")
    store.close()
    meta_path = tmp_path / "v1" / "meta" / k1.id[:2] / f"{k1.id}.json"
    meta = json.loads(meta_path.read_text())
    assert meta["id"] == k1.id
    meta["key"] = "k0"  # k1's id, size and xxh3 (its data file checks out), claiming k0's name
    meta["created"] = k0.created + 1  # newer than k0: the one a lookup by name would pick
    meta_path.write_text(json.dumps(meta))
    misplaced = tmp_path / "v1" / "meta" / "zz" / f"{k0.id}.json"  # k0's own meta, in another shard directory
    misplaced.parent.mkdir()
    misplaced.write_bytes((tmp_path / "v1" / "meta" / k0.id[:2] / f"{k0.id}.json").read_bytes())
    store = make(tmp_path)
    found = store.lookup("b", "k0")
    assert found is not None and found.id == k0.id
    fd, _ = store.open_verified(found)
    try:
        assert os.pread(fd, 100, 0) == b"the bytes of k0"
    finally:
        os.close(fd)
    assert [e.key for e in store.entries()] == ["k0"]
    assert not meta_path.exists() and not store.data_path(k1).exists()
    assert not misplaced.exists()


def test_tampered_file_is_detected_and_removed(tmp_path):
    store = make(tmp_path)
    entry = put(store, "k", os.urandom(4096))
    path = store.data_path(entry)
    os.chmod(path, 0o644)
    with open(path, "r+b") as handle:
        handle.seek(100)
        handle.write(b"\x00")
    with pytest.raises(CorruptEntry):
        store.open_verified(entry)
    assert store.lookup("b", "k") is None and not path.exists()


def test_open_reader_survives_eviction(tmp_path):
    store = make(tmp_path, capacity=250)
    data = os.urandom(200)
    entry = put(store, "old", data)
    fd, _ = store.open_verified(entry)
    try:
        put(store, "new", os.urandom(200))  # evicts "old" while its file is open
        assert store.lookup("b", "old") is None
        assert os.pread(fd, 1000, 0) == data  # unlink drops the name, not the bytes
    finally:
        os.close(fd)


def test_pinned_entries_are_not_evicted(tmp_path):
    store = make(tmp_path, capacity=250)
    entry = put(store, "old", os.urandom(200))
    with store.pinned(entry):
        assert put(store, "new", os.urandom(200)) is None  # nothing evictable: not admitted
    assert put(store, "new", os.urandom(200)) is not None


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    ops=st.lists(st.tuples(st.integers(0, 15), st.integers(1, 400)), min_size=1, max_size=60),
    eviction=st.sampled_from(["lru", "hold"]),
    capacity=st.integers(300, 2000),
    max_items=st.integers(1, 8),
)
def test_limits_always_hold(ops, eviction, capacity, max_items):
    with tempfile.TemporaryDirectory() as tmp:
        store = make(Path(tmp), capacity=capacity, eviction=eviction, max_items=max_items)
        admitted_once: set[str] = set()
        for name, size in ops:
            key = f"k{name}"
            if store.lookup("b", key):
                continue
            entry = put(store, key, bytes([name]) * size)
            stats = store.stats()
            assert stats["used_bytes"] <= capacity
            assert stats["items"] <= max_items
            assert stats["reserved_bytes"] == 0
            if entry is not None:
                admitted_once.add(key)
                assert store.lookup("b", key) == entry
            elif eviction == "lru":
                assert size > capacity  # lru admits anything that fits at all
            if eviction == "hold":
                assert stats["evictions"] == 0
        on_disk = sum(p.stat().st_size for p in (Path(tmp) / "v1" / "data").rglob("*") if p.is_file())
        assert on_disk == store.stats()["used_bytes"]
        store.close()
        reopened = make(Path(tmp), capacity=capacity, eviction=eviction, max_items=max_items)
        assert {e.key for e in reopened.entries()} == {e.key for e in store.entries()}
        reopened.close()


# -- issue 13: a verifier the caller brings, rot the stamp cannot see, unverified accounting ------


def test_a_verifier_that_fails_publishes_nothing(tmp_path):
    from sidecar.daemon.checksums import OriginChecksum

    store = make(tmp_path)
    data = os.urandom(5000)
    import base64
    import zlib

    good = base64.b64encode(zlib.crc32(data).to_bytes(4, "big")).decode()
    writer = store.begin("b", "k", '"k"', len(data), verifier=OriginChecksum("crc32", good).verifier())
    writer.write_at(2500, data[2500:])  # out of order: the tail is hashed by reading it back
    writer.write_at(0, data[:2500])
    entry = writer.commit()
    assert entry.verified == "crc32"
    assert store.stats()["unverified_items"] == 0
    bad = base64.b64encode((zlib.crc32(data) ^ 1).to_bytes(4, "big")).decode()
    writer = store.begin("b", "k2", '"k2"', len(data), verifier=OriginChecksum("crc32", bad).verifier())
    writer.write_at(0, data)
    with pytest.raises(IntegrityError, match="crc32"):
        writer.commit()
    assert store.lookup("b", "k2") is None and store.stats()["integrity_failures"] == 1
    assert not any((tmp_path / "v1" / "tmp").iterdir())
    # Unverified entries are counted, and the mark survives a restart.
    put(store, "plain", data)
    assert (store.stats()["unverified_items"], store.stats()["unverified_bytes"]) == (1, 5000)
    store.close()
    again = make(tmp_path)
    assert again.lookup("b", "k").verified == "crc32" and again.lookup("b", "plain").verified == ""
    assert again.stats()["unverified_items"] == 1


def _rot(store: Store, entry) -> None:
    """Change a byte of the entry's file and make the store believe it verified the result: bits
    that changed below the file system, which no stamp shows."""
    path = store.data_path(entry)
    path.chmod(0o644)
    with open(path, "r+b") as handle:
        handle.seek(10)
        handle.write(b"\xff" if handle.read(1) != b"\xff" else b"\x00")
    path.chmod(0o444)
    st = path.stat()
    from cache.store import _Stamp

    store._verified[entry.id] = _Stamp(st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def test_a_forced_recheck_and_the_scrubber_find_what_the_stamp_cannot(tmp_path):
    store = make(tmp_path)
    a = put(store, "a", os.urandom(3000))
    b = put(store, "b", os.urandom(3000))
    _rot(store, a)
    fd, _ = store.open_verified(a)  # the stamp says it is the file last verified
    os.close(fd)
    with pytest.raises(CorruptEntry):
        store.open_verified(a, force=True)
    assert store.lookup("b", "a") is None
    _rot(store, b)
    assert store.scrub_one(min_age_s=3600) == 0  # hashed at publish, not due yet
    assert store.scrub_one(min_age_s=0) == 3000
    assert store.lookup("b", "b") is None and store.stats()["corrupt_removed"] == 2
    assert store.scrub_one(min_age_s=0) == 0  # nothing left
