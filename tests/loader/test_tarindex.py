"""Member tables (loader.tarindex): a warm read by the table of an earlier parse gives the parse's
samples and errors, from any sample, and never serves bytes that were not checked."""

from __future__ import annotations

import io
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
import xxhash

from loader import CorruptShard, LoaderSettings, ShardLoader, iter_samples
from loader import shardloader as shardloader_module
from loader.tar import MemberLog
from loader.tarindex import IndexRegistry, TarIndex, file_identity, iter_indexed
from tests.support.shards import Written, member_table, write_manifest, write_shards


def _tar(tmp_path: Path, samples: list[dict[str, Any]]) -> Path:
    import webdataset as wds

    buf = io.BytesIO()
    with wds.TarWriter(buf) as writer:
        for sample in samples:
            writer.write(sample)
    path = tmp_path / "shard.tar"
    path.write_bytes(buf.getvalue())
    return path


SAMPLES = [
    {"__key__": "a/b.c/000001", "jpg": b"x" * 10, "cls": 3, "seg.png": b"yy"},
    {"__key__": "e" * 60 + "/" + "k" * 120, "bin": b"z" * 5000},  # PAX long name
    {"__key__": "000002", "JPG": b"upper"},
    {"__key__": "a/b.c/000001", "jpg": b"again"},  # the key again, not next to its first: a new sample
    {"__key__": "000003", "empty": b""},
]


def _plain(samples: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: bytes(v) if isinstance(v, memoryview) else v for k, v in s.items()} for s in samples]


@pytest.mark.parametrize("zero_copy", [False, True])
def test_table_read_is_the_parse_from_every_sample(tmp_path: Path, zero_copy: bool) -> None:
    path = _tar(tmp_path, SAMPLES)
    data = path.read_bytes()
    digest = xxhash.xxh3_128_hexdigest(data)
    with open(path, "rb", buffering=0) as handle:
        parsed = list(iter_samples(handle, url="u"))
    table = member_table(path)
    assert table.samples == len(parsed) == len(SAMPLES)
    for start in range(len(parsed) + 2):
        with open(path, "rb", buffering=0) as handle:
            got = list(iter_indexed(handle, table, url="u", start=start, expected_size=len(data),
                                    expected_xxh3_128=digest, zero_copy=zero_copy))
        assert _plain(got) == parsed[start:]
        if zero_copy and got:
            assert all(isinstance(v, memoryview) for s in got for k, v in s.items() if not k.startswith("__"))


@pytest.mark.parametrize("zero_copy", [False, True])  # True: hashed on a thread of its own
def test_a_changed_byte_is_caught_by_the_checksum_even_with_the_same_table(tmp_path: Path, zero_copy: bool) -> None:
    """The table is no promise about the bytes: the whole file is still hashed, headers included.
    Here the file is changed in place and its mtime put back: its identity changes all the same
    (the ctime), and the old table, used regardless, fails the checksum."""
    path = _tar(tmp_path, SAMPLES)
    data = path.read_bytes()
    digest = xxhash.xxh3_128_hexdigest(data)
    table = member_table(path)
    before = os.stat(path)
    for where in (data.index(b"z" * 5000) + 9, 3):  # a data byte, then a header byte (a name)
        changed = bytearray(data)
        changed[where] ^= 0x20
        path.write_bytes(bytes(changed))
        os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
        with open(path, "rb", buffering=0) as handle:
            assert file_identity(handle) != (before.st_dev, before.st_ino, before.st_size, before.st_mtime_ns,
                                             before.st_ctime_ns)
            with pytest.raises(CorruptShard, match="checksum mismatch"):
                list(iter_indexed(handle, table, url="u", expected_size=len(data), expected_xxh3_128=digest,
                                  zero_copy=zero_copy))


def test_a_table_for_other_bytes_is_refused(tmp_path: Path) -> None:
    path = _tar(tmp_path, SAMPLES)
    table = member_table(path)
    path.write_bytes(path.read_bytes()[:2048])
    with open(path, "rb", buffering=0) as handle, pytest.raises(CorruptShard, match="member table"):
        list(iter_indexed(handle, table, url="u"))


def test_identity_is_of_a_regular_file_read_from_its_start(tmp_path: Path) -> None:
    path = _tar(tmp_path, SAMPLES)
    assert file_identity(io.BytesIO(b"x")) is None
    with open(path, "rb", buffering=0) as handle:
        first = file_identity(handle)
        handle.seek(512)
        assert file_identity(handle) is None  # mapped from elsewhere than its start: not tabled
    assert first is not None
    path.write_bytes(path.read_bytes() + bytes(512))  # rewritten: a new size (and mtime)
    with open(path, "rb", buffering=0) as handle:
        assert file_identity(handle) != first
    read, write = os.pipe()
    try:
        with os.fdopen(read, "rb", buffering=0, closefd=False) as pipe:
            assert file_identity(pipe) is None
    finally:
        os.close(read)
        os.close(write)


def test_no_table_from_a_partial_or_streamed_or_sparse_read(tmp_path: Path) -> None:
    path = _tar(tmp_path, SAMPLES)
    members = MemberLog()
    with open(path, "rb", buffering=0) as handle:
        list(iter_samples(handle, start=1, log=members))
    assert TarIndex.from_log(members, 0) is None  # resumed: the skipped members are not logged
    members = MemberLog()
    with open(path, "rb", buffering=0) as handle:
        for _ in iter_samples(handle, log=members):
            break  # stopped early: the end was never checked
    assert TarIndex.from_log(members, 0) is None
    members = MemberLog()
    list(iter_samples(io.BytesIO(path.read_bytes()), log=members))
    assert TarIndex.from_log(members, 0) is None  # a stream: no offsets into a file
    # GNU tar's sparse members are built, not sliced out of the shard
    src = tmp_path / "src"
    src.mkdir()
    with open(src / "000001.bin", "wb") as handle:
        handle.truncate(1 << 20)
        os.pwrite(handle.fileno(), b"data", 4096)
    sparse = tmp_path / "sparse.tar"
    subprocess.run(["tar", "-C", str(src), "--sparse", "--format=gnu", "-cf", str(sparse), "000001.bin"],
                   check=True, timeout=60)
    members = MemberLog()
    with open(sparse, "rb", buffering=0) as handle:
        assert len(list(iter_samples(handle, log=members))) == 1
    assert TarIndex.from_log(members, sparse.stat().st_size) is None


def test_registry_keeps_the_recent_tables_within_its_budget(tmp_path: Path) -> None:
    table = member_table(_tar(tmp_path, SAMPLES))
    registry = IndexRegistry(budget=table.nbytes * 2 + 1)
    registry.put((0, 1, 0, 0), table)
    registry.put((0, 2, 0, 0), table)
    assert registry.get((0, 1, 0, 0)) is table  # now the most recent
    registry.put((0, 3, 0, 0), table)
    assert registry.get((0, 2, 0, 0)) is None and len(registry) == 2
    assert registry.nbytes == 2 * table.nbytes
    registry.forget((0, 1, 0, 0))
    assert registry.get((0, 1, 0, 0)) is None and registry.nbytes == table.nbytes
    IndexRegistry(budget=1).put((0, 4, 0, 0), table)  # larger than the whole budget: not kept


def _dataset(tmp_path: Path) -> tuple[str, Written]:
    written = write_shards(tmp_path / "root" / "bkt" / "ds", shards=4, per_shard=9)
    write_manifest(written)
    return f"file://{tmp_path}/root/bkt/ds/", written


def test_shardloader_reads_warm_epochs_by_table_and_resumes_without_parsing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url, written = _dataset(tmp_path)
    monkeypatch.setattr(shardloader_module, "INDEXES", IndexRegistry())
    loader = ShardLoader(url, shuffle=False, endpoint="")
    first = _plain(list(loader))
    assert len(shardloader_module.INDEXES) == len(written.keys)
    parses = []
    real = shardloader_module.iter_samples
    monkeypatch.setattr(shardloader_module, "iter_samples", lambda *a, **k: parses.append(1) or real(*a, **k))
    assert _plain(list(loader)) == first and not parses  # epoch 2, by tables only
    # resumed in the middle of the third shard, warm: the rest, without reading the samples before
    fresh = ShardLoader(url, shuffle=False, endpoint="")
    stream = iter(fresh)
    for _ in range(2 * 9 + 4):
        next(stream)
    state = fresh.state_dict()
    stream.close()
    again = ShardLoader(url, shuffle=False, endpoint="")
    again.load_state_dict(state)
    assert _plain(list(again)) == first[2 * 9 + 4 :] and not parses


def test_shardloader_detects_a_shard_changed_behind_its_table(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    url, written = _dataset(tmp_path)
    monkeypatch.setattr(shardloader_module, "INDEXES", IndexRegistry())
    loader = ShardLoader(url, shuffle=False, endpoint="", settings=LoaderSettings(retry_backoff_s=0))
    list(loader)
    path = written.root / written.keys[1]
    before = path.stat()
    changed = bytearray(path.read_bytes())
    changed[len(changed) // 2] ^= 1
    path.write_bytes(bytes(changed))
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    with pytest.raises(CorruptShard, match="checksum mismatch"):
        list(loader)


@pytest.mark.parametrize("rehash", [True, False])
def test_rehash_warm_off_skips_the_hash_of_a_file_already_checked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, rehash: bool
) -> None:
    url, written = _dataset(tmp_path)
    monkeypatch.setattr(shardloader_module, "INDEXES", IndexRegistry())
    settings = LoaderSettings.from_env({"SHARDCACHE_REHASH_WARM": "1" if rehash else "0"})
    assert settings.rehash_warm is rehash
    loader = ShardLoader(url, shuffle=False, endpoint="", settings=settings)
    first = _plain(list(loader))
    hashers = []
    real = xxhash.xxh3_128
    monkeypatch.setattr(xxhash, "xxh3_128", lambda *a: hashers.append(1) or real(*a))
    assert _plain(list(loader)) == first
    assert len(hashers) == (len(written.keys) if rehash else 0)
    # a file written since is another identity: parsed and hashed again, and its change caught
    path = written.root / written.keys[0]
    changed = bytearray(path.read_bytes())
    changed[len(changed) // 2] ^= 1
    path.write_bytes(bytes(changed))
    with pytest.raises(CorruptShard, match="checksum mismatch"):
        list(loader)
