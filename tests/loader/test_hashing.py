"""A zero-copy read's hash on a thread of its own (loader.hashing): the same digest as inline, never
further ahead of the reader than its lead, stopped when the read is abandoned, its errors raised
where the reader checks the digest."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import xxhash

from loader import CorruptShard
from loader.hashing import HASH_CHUNK_BYTES, HASH_LEAD_BYTES, HashBehind
from loader.tarindex import TarIndex, iter_indexed
from tests.support.shards import member_table


def _wait(condition: object, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


def test_digest_is_the_inline_digest() -> None:
    data = bytes(range(256)) * ((3 * HASH_CHUNK_BYTES + 12345) // 256)
    behind = HashBehind(xxhash.xxh3_128(), memoryview(data), len(data))
    assert behind.digest() == xxhash.xxh3_128_hexdigest(data)
    assert behind.done == len(data)


def test_the_hash_waits_for_the_reader_past_its_lead() -> None:
    size = HASH_LEAD_BYTES + 4 * HASH_CHUNK_BYTES
    data = bytes(size)
    behind = HashBehind(xxhash.xxh3_128(), memoryview(data), size)
    _wait(lambda: behind.done >= HASH_LEAD_BYTES, "the hash to reach its lead")
    time.sleep(0.05)
    assert behind.done == HASH_LEAD_BYTES  # no further until the reader moves
    behind.read_to(HASH_CHUNK_BYTES)
    _wait(lambda: behind.done >= HASH_LEAD_BYTES + HASH_CHUNK_BYTES, "the hash to move on")
    assert behind.digest() == xxhash.xxh3_128_hexdigest(data)


def test_cancel_stops_the_thread_before_the_end() -> None:
    size = HASH_LEAD_BYTES + 8 * HASH_CHUNK_BYTES
    behind = HashBehind(xxhash.xxh3_128(), memoryview(bytes(size)), size)
    _wait(lambda: behind.done >= HASH_LEAD_BYTES, "the hash to reach its lead")
    behind.cancel()
    assert behind.done < size
    assert not any(t.name == "shardcache-hash" for t in threading.enumerate())
    with pytest.raises(RuntimeError, match="cancelled"):
        behind.digest()


def test_an_error_in_the_thread_is_raised_by_digest() -> None:
    class Broken:
        def update(self, _data: memoryview) -> None:
            raise MemoryError("no room")

        def hexdigest(self) -> str:
            return ""

    behind = HashBehind(Broken(), memoryview(bytes(10)), 10)
    with pytest.raises(MemoryError, match="no room"):
        behind.digest()


def _shard(tmp_path: Path, samples: int, member: int) -> tuple[Path, TarIndex]:
    import io

    import webdataset as wds

    buf = io.BytesIO()
    with wds.TarWriter(buf) as writer:
        for i in range(samples):
            writer.write({"__key__": f"{i:06d}", "bin": bytes([i % 251]) * member})
    path = tmp_path / "shard.tar"
    path.write_bytes(buf.getvalue())
    return path, member_table(path)


def test_an_abandoned_zero_copy_read_stops_its_hash(tmp_path: Path) -> None:
    """A trainer that stops inside a shard (a break, a preemption) leaves no thread reading the
    mapping it closes."""
    path, table = _shard(tmp_path, 64, 1 << 20)
    digest = xxhash.xxh3_128_hexdigest(path.read_bytes())
    with open(path, "rb", buffering=0) as handle:
        samples = iter_indexed(handle, table, url="u", expected_xxh3_128=digest, zero_copy=True)
        first = next(samples)
        assert bytes(first["bin"]) == bytes([0]) * (1 << 20)
        assert any(t.name == "shardcache-hash" for t in threading.enumerate())
        samples.close()
    assert not any(t.name == "shardcache-hash" for t in threading.enumerate())


def test_a_changed_byte_past_the_lead_is_caught(tmp_path: Path) -> None:
    """The last sample's byte, hashed only after the reader has moved the lead on to it."""
    path, table = _shard(tmp_path, 48, 1 << 20)
    data = bytearray(path.read_bytes())
    digest = xxhash.xxh3_128_hexdigest(bytes(data))
    data[table.offsets[-1] + 7] ^= 1
    path.write_bytes(bytes(data))
    with open(path, "rb", buffering=0) as handle, pytest.raises(CorruptShard, match="checksum mismatch"):
        for _ in iter_indexed(handle, table, url="u", expected_size=len(data), expected_xxh3_128=digest,
                              zero_copy=True):
            pass


def test_pages_are_released_behind_both_the_hash_and_the_reader() -> None:
    """The mapping's pages go back behind the reader while the hash is ahead, and behind the hash
    once the reader is done (it waits in digest()), so a shard never maps more than the lead."""
    size = HASH_LEAD_BYTES + 8 * HASH_CHUNK_BYTES
    calls: list[tuple[int, int]] = []

    def release(released: int, offset: int) -> int:
        calls.append((released, offset))
        return offset

    behind = HashBehind(xxhash.xxh3_128(), memoryview(bytes(size)), size, release=release)
    _wait(lambda: behind.done >= HASH_LEAD_BYTES, "the hash to reach its lead")
    assert calls == []  # the reader has read nothing: nothing is released under it
    behind.read_to(2 * HASH_CHUNK_BYTES)
    _wait(lambda: calls and calls[-1][1] == 2 * HASH_CHUNK_BYTES, "the pages behind the reader to go")
    assert behind.digest() == xxhash.xxh3_128_hexdigest(bytes(size))
    assert calls[-1][1] == size  # the reader done: released behind the hash to the end
    assert all(a == b for (_, a), (b, _) in zip(calls, calls[1:], strict=False))  # in order, no gap
