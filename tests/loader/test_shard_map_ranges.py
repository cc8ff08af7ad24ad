"""Samples by index, cold samples by range (issue 31): with member indexes pinned in the manifest
(``shardcache index --members``), a sample of a shard not yet open is read by a ranged read of
its own bytes through the node cache (or S3), checked against its own checksum; a batch's samples
of one shard share ranges; a shard the cache holds whole is then opened and mapped; bytes that
fail their checksum are never returned (the shard is opened whole, with the cache's recheck); a
stale or damaged member index is not used.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from loader import LoaderSettings, ShardIndex
from loader.members import members_key
from tests.support.daemons import Daemon, daemon_stats
from tests.support.shards import Written, write_manifest, write_shards
from tests.support.waits import wait_until

pytestmark = pytest.mark.timeout(180)


def ident(sample: dict[str, Any]) -> tuple[str, str]:
    return sample["__url__"].rsplit("/", 1)[-1], sample["__key__"]


def order_of(written: Written) -> list[tuple[str, str]]:
    return [(shard, key) for shard in written.keys for key in written.order[shard]]


def fields(sample: dict[str, Any]) -> dict[str, bytes]:
    return {k: bytes(v) for k, v in sample.items() if not k.startswith("__")}


@pytest.fixture
def node(tmp_path: Path) -> Iterator[tuple[Written, str]]:
    written = write_shards(tmp_path / "root" / "bkt" / "ds", shards=4, per_shard=9)
    write_manifest(written, members=True)
    proc = Daemon(tmp_path, f"file://{tmp_path / 'root'}").start()
    try:
        yield written, proc.url
    finally:
        proc.stop()


class _Counting:
    """Counts the source's ranged reads and whole opens."""

    def __init__(self, index: ShardIndex, monkeypatch: pytest.MonkeyPatch) -> None:
        source = index._get_source()
        self.ranges: list[tuple[str, int, int]] = []
        self.opens: list[str] = []
        real_range, real_open = source.read_range, source.open

        def read_range(shard: Any, start: int, end: int) -> Any:
            self.ranges.append((shard.key, start, end))
            return real_range(shard, start, end)

        def open_(shard: Any, *args: Any, **kwargs: Any) -> Any:
            self.opens.append(shard.key)
            return real_open(shard, *args, **kwargs)

        monkeypatch.setattr(source, "read_range", read_range)
        monkeypatch.setattr(source, "open", open_)


def test_a_cold_sample_is_read_by_its_own_range(node: tuple[Written, str], monkeypatch: pytest.MonkeyPatch) -> None:
    written, endpoint = node
    order = order_of(written)
    index = ShardIndex("s3://bkt/ds/", endpoint=endpoint, settings=LoaderSettings(short_circuit=False))
    counting = _Counting(index, monkeypatch)
    last = len(written.order[written.keys[0]]) - 1
    sample = index.sample(last)  # the first shard's last sample
    assert ident(sample) == order[last]
    assert fields(sample) == written.samples[order[last]]
    assert counting.opens == []
    (key, start, end), = counting.ranges
    shard_size = (written.root / key).stat().st_size
    assert key == written.keys[0] and 0 < end - start < shard_size // 4  # its bytes, not the shard's
    # Every sample of the dataset, in reverse, equal to what was written.
    for i in reversed(range(len(index))):
        got = index.sample(i)
        assert ident(got) == order[i] and fields(got) == written.samples[order[i]]
    index.close()


def test_a_batch_reads_each_cold_shard_by_few_ranges(node: tuple[Written, str], monkeypatch: pytest.MonkeyPatch) -> None:
    written, endpoint = node
    order = order_of(written)
    index = ShardIndex("s3://bkt/ds/", endpoint=endpoint, settings=LoaderSettings(short_circuit=False))
    counting = _Counting(index, monkeypatch)
    per = len(written.order[written.keys[0]])
    batch = [1, 2, 3, per + 5, 2 * per, 2 * per + 1, 0]
    got = index.samples(batch)
    assert [ident(s) for s in got] == [order[i] for i in batch]
    assert all(fields(s) == written.samples[ident(s)] for s in got)
    # Samples next to each other share one range: shard 0 (0-3) one, shard 1 one, shard 2 one.
    assert sorted(k for k, _, _ in counting.ranges) == [written.keys[0], written.keys[1], written.keys[2]]
    assert counting.opens == []


def test_a_shard_cached_whole_is_then_mapped(node: tuple[Written, str], monkeypatch: pytest.MonkeyPatch) -> None:
    written, endpoint = node
    order = order_of(written)
    index = ShardIndex("s3://bkt/ds/", endpoint=endpoint)
    counting = _Counting(index, monkeypatch)
    index.sample(0)
    wait_until(lambda: daemon_stats(endpoint)["cache"]["items"] >= 1 and int(daemon_stats(endpoint)["fills_in_flight"]) == 0,
               timeout=30, what="the shard cached")
    index.sample(1)  # answered from the cache: "hit", so the shard is opened whole next
    index.sample(2)
    assert counting.opens == [written.keys[0]]
    ranged_before = len(counting.ranges)
    for i in range(3, len(written.order[written.keys[0]])):
        assert ident(index.sample(i)) == order[i]
    assert len(counting.ranges) == ranged_before  # slices of the mapping from then on


def test_bytes_failing_their_checksum_are_never_returned(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A shard damaged at the origin after it was indexed: the ranged sample fails its checksum,
    the shard is opened whole, and that read's checks refuse it: an error, never the bytes."""
    from loader import CorruptShard

    written = write_shards(tmp_path / "root" / "bkt" / "ds", shards=2, per_shard=5)
    write_manifest(written, members=True)
    path = written.root / written.keys[1]
    data = bytearray(path.read_bytes())
    data[600] ^= 0xFF  # inside the first sample's first member
    path.write_bytes(bytes(data))
    proc = Daemon(tmp_path, f"file://{tmp_path / 'root'}").start()
    try:
        index = ShardIndex("s3://bkt/ds/", endpoint=proc.url, settings=LoaderSettings(short_circuit=False))
        with pytest.raises(CorruptShard):
            index.sample(5)
        sample = index.sample(4)  # the other shard is fine
        assert fields(sample) == written.samples[order_of(written)[4]]
    finally:
        proc.stop()


@pytest.mark.parametrize("damage", ["stale", "flipped", "missing"])
def test_a_member_index_that_cannot_be_used_is_not(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, damage: str,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    written = write_shards(tmp_path / "root" / "bkt" / "ds", shards=2, per_shard=5)
    write_manifest(written, members=True)
    doc = written.root / members_key(written.keys[0])
    if damage == "stale":  # another shard's index in its place, pin updated: names other bytes
        import xxhash

        other = (written.root / members_key(written.keys[1])).read_bytes()
        doc.write_bytes(other)
        manifest = json.loads((written.root / "manifest.json").read_text())
        manifest["shards"][0]["members_xxh3_128"] = xxhash.xxh3_128_hexdigest(other)
        (written.root / "manifest.json").write_text(json.dumps(manifest))
    elif damage == "flipped":
        raw = bytearray(doc.read_bytes())
        raw[len(raw) // 2] ^= 0x01
        doc.write_bytes(bytes(raw))
    else:
        doc.unlink()
    proc = Daemon(tmp_path, f"file://{tmp_path / 'root'}").start()
    try:
        index = ShardIndex("s3://bkt/ds/", endpoint=proc.url, settings=LoaderSettings(short_circuit=False))
        counting = _Counting(index, monkeypatch)
        order = order_of(written)
        for i in (3, 1, 0):
            sample = index.sample(i)
            assert ident(sample) == order[i] and fields(sample) == written.samples[order[i]]
        assert counting.ranges == [] and counting.opens == [written.keys[0]]  # read whole, once
        assert "reading" in caplog.text and written.keys[0] in caplog.text
    finally:
        proc.stop()


def test_zero_copy_ranged_samples_are_views(node: tuple[Written, str]) -> None:
    written, endpoint = node
    index = ShardIndex("s3://bkt/ds/", endpoint=endpoint, settings=LoaderSettings(short_circuit=False, zero_copy=True))
    sample = index.sample(3)
    assert all(isinstance(v, memoryview) for k, v in sample.items() if not k.startswith("__"))
    assert fields(sample) == written.samples[order_of(written)[3]]


def test_straight_from_s3_by_ranges(tmp_path: Path, s3_server: Any, bucket: str,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a cache, a random reader with member indexes reads each sample's bytes by range
    from S3 (no shard downloaded whole for one sample of it)."""
    written = write_shards(tmp_path / "ds", shards=3, per_shard=6)
    write_manifest(written, members=True)
    client = s3_server.client()
    for path in sorted(written.root.iterdir()):
        client.put_object(Bucket=bucket, Key="ds/" + path.name, Body=path.read_bytes())
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server.endpoint)
    for name, value in s3_server.credentials.items():
        monkeypatch.setenv(name, value)
    index = ShardIndex(f"s3://{bucket}/ds/", endpoint="")
    counting = _Counting(index, monkeypatch)
    order = order_of(written)
    for i in (17, 4, 9, 0):
        sample = index.sample(i)
        assert ident(sample) == order[i] and fields(sample) == written.samples[order[i]]
    assert counting.opens == [] and len(counting.ranges) == 4
    served = sum(end - start for _, start, end in counting.ranges)
    assert served < sum((written.root / k).stat().st_size for k in written.keys) // 3
