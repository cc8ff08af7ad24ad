"""Static mode: the pure sharding functions (properties), and ShardLoader reading real shards from a
file:// dataset: disjoint and covering across ranks and workers, reproducible, epochs, continuous
mode, checkpoint/resume, manifests and listings, corrupt and hostile input."""

from __future__ import annotations

import itertools
import json
import pickle
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loader import (
    ConfigError,
    CorruptShard,
    DatasetNotFound,
    ManifestError,
    ShardLoader,
    ShardNotFound,
    epoch_order,
    rank_shards,
    worker_shards,
)
from tests.support.shards import Written, delivered, write_manifest, write_shards
from wire.shuffle import permutation


@given(
    n=st.integers(0, 300),
    world=st.integers(1, 17),
    seed=st.integers(-(2**40), 2**40),
    epoch=st.integers(0, 10_000),
    shuffle=st.booleans(),
)
@settings(max_examples=300, deadline=None)
def test_rank_shards_disjoint_covering_balanced_reproducible(n: int, world: int, seed: int, epoch: int, shuffle: bool) -> None:
    parts = [rank_shards(n, r, world, seed, epoch, shuffle) for r in range(world)]
    flat = [i for part in parts for i in part]
    assert sorted(flat) == list(range(n))  # covering, and disjoint (no index twice)
    assert max(map(len, parts)) - min(map(len, parts)) <= 1
    assert parts == [rank_shards(n, r, world, seed, epoch, shuffle) for r in range(world)]
    assert sorted(epoch_order(n, seed, epoch, shuffle)) == list(range(n))
    if not shuffle:
        assert epoch_order(n, seed, epoch, shuffle) == list(range(n))


@given(shards=st.lists(st.integers(), max_size=100, unique=True), workers=st.integers(1, 9))
def test_worker_split_disjoint_covering(shards: list[int], workers: int) -> None:
    parts = [worker_shards(shards, w, workers) for w in range(workers)]
    assert sorted(i for part in parts for i in part) == sorted(shards)


@given(n=st.integers(20, 200), seed=st.integers(0, 2**31))
@settings(max_examples=50)
def test_epochs_and_seeds_reshuffle(n: int, seed: int) -> None:
    orders = {tuple(epoch_order(n, seed, e)) for e in range(3)} | {tuple(epoch_order(n, seed + 1, 0))}
    assert len(orders) == 4  # 20! orders: a collision means the epoch or seed is ignored


@given(
    n=st.integers(0, 200),
    world=st.integers(1, 9),
    workers=st.integers(1, 5),
    seed=st.integers(-(2**63), 2**63),
    epoch=st.integers(0, 10**6),
)
@settings(max_examples=200, deadline=None)
def test_ranks_then_workers_read_each_shard_exactly_once(n: int, world: int, workers: int, seed: int, epoch: int) -> None:
    """The two-level split ShardLoader does (rank, then DataLoader worker) hands every shard of
    the epoch to exactly one (rank, worker), and in the epoch's order within each."""
    order = epoch_order(n, seed, epoch)
    where: dict[int, tuple[int, int]] = {}
    for r in range(world):
        mine = rank_shards(n, r, world, seed, epoch)
        assert mine == order[r::world]
        for w in range(workers):
            for shard in worker_shards(mine, w, workers):
                assert shard not in where, (shard, where[shard], (r, w))  # disjoint
                where[shard] = (r, w)
    assert sorted(where) == list(range(n))  # covering


@given(n=st.integers(0, 500), seed=st.integers(-(2**63), 2**63), epoch=st.integers(0, 10**6), shuffle=st.booleans())
@settings(max_examples=100, deadline=None)
def test_static_order_is_the_masters_shuffle(n: int, seed: int, epoch: int, shuffle: bool) -> None:
    """One shuffle: a static job reads its epoch in the order the master would hand it out."""
    assert epoch_order(n, seed, epoch, shuffle) == permutation(n, seed, epoch, shuffle)


def test_static_order_is_pinned() -> None:
    """The order is what a state_dict() position points into: a silent change would make resumed
    checkpoints duplicate and skip samples, so it needs a new state version (and this test's new
    values) on purpose. Values produced by wire.shuffle when static mode adopted it (state v2)."""
    assert epoch_order(10, 1, 0) == [5, 1, 3, 7, 0, 8, 2, 6, 4, 9]
    assert epoch_order(10, 1, 1) == [3, 9, 6, 2, 1, 0, 4, 7, 5, 8]
    assert epoch_order(5, -1, 0) == [3, 2, 1, 0, 4]
    assert [rank_shards(12, r, 3, 7, 3) for r in range(3)] == [[0, 3, 9, 6], [1, 4, 5, 7], [2, 8, 10, 11]]
    assert epoch_order(10, 1, 0, shuffle=False) == list(range(10))
    assert epoch_order(0, 1, 0) == [] and epoch_order(1, 1, 0) == [0]


def test_pure_functions_reject_bad_arguments() -> None:
    for bad in [(10, 2, 2), (10, -1, 2), (10, 0, 0)]:
        with pytest.raises(ConfigError):
            rank_shards(*bad, seed=0, epoch=0)
    with pytest.raises(ConfigError):
        worker_shards([1, 2], 3, 2)
    for call in (lambda: epoch_order(-1, 0, 0), lambda: rank_shards(-1, 0, 1, 0, 0)):
        with pytest.raises(ConfigError, match="num_shards"):
            call()


# -- ShardLoader on real shards ------------------------------------------------------------------


def test_ranks_and_workers_read_everything_once_byte_exact(dataset: tuple[str, Written]) -> None:
    url, written = dataset
    for world in (1, 2, 4, 6):
        for workers in (1, 2, 3):
            got: list[dict] = []
            for rank in range(world):
                base = ShardLoader(url, rank=rank, world_size=world, seed=5, epoch=2)
                for w in range(workers):
                    got.extend(base.for_worker(w, workers))
            assert delivered(got) == written.samples, (world, workers)


def test_same_arguments_same_samples_in_order(dataset: tuple[str, Written]) -> None:
    url, written = dataset
    first = [s["__key__"] for s in ShardLoader(url, rank=1, world_size=3, seed=9, epoch=4)]
    again = [s["__key__"] for s in ShardLoader(url, rank=1, world_size=3, seed=9, epoch=4)]
    other_epoch = [s["__key__"] for s in ShardLoader(url, rank=1, world_size=3, seed=9, epoch=5)]
    assert first == again and first
    whole = [s["__key__"] for s in ShardLoader(url, seed=9, epoch=4)]
    assert whole != [s["__key__"] for s in ShardLoader(url, seed=9, epoch=5)]
    assert sorted(whole) == sorted(k for _, k in written.samples)
    # within a shard, samples come in archive order
    for order in written.order.values():
        assert [k for k in whole if k in set(order)] == order
    del other_epoch


def test_iterating_again_yields_the_next_epoch(dataset: tuple[str, Written]) -> None:
    url, written = dataset
    loader = ShardLoader(url, seed=1)
    assert loader.epoch == 0
    epoch0 = [s["__key__"] for s in loader]
    assert loader.epoch == 1
    epoch1 = [s["__key__"] for s in loader]
    assert epoch0 == [s["__key__"] for s in ShardLoader(url, seed=1, epoch=0)]
    assert epoch1 == [s["__key__"] for s in ShardLoader(url, seed=1, epoch=1)]
    # breaking off an epoch and iterating again starts the next one
    partial = ShardLoader(url, seed=1)
    next(iter(partial))
    assert [s["__key__"] for s in partial] == epoch1
    assert partial.epoch == 2


def test_continuous_mode_crosses_epochs(dataset: tuple[str, Written]) -> None:
    url, written = dataset
    total = written.total()
    loader = ShardLoader(url, rank=0, world_size=2, seed=3, continuous=True)
    per_rank = [len(list(ShardLoader(url, rank=0, world_size=2, seed=3, epoch=e))) for e in range(3)]
    stream = [s["__key__"] for s in itertools.islice(loader, per_rank[0] + per_rank[1] + 5)]
    assert stream[: per_rank[0]] == [s["__key__"] for s in ShardLoader(url, rank=0, world_size=2, seed=3, epoch=0)]
    assert stream[per_rank[0] : per_rank[0] + per_rank[1]] == [
        s["__key__"] for s in ShardLoader(url, rank=0, world_size=2, seed=3, epoch=1)
    ]
    assert loader.epoch == 2
    assert total > 0


@pytest.mark.parametrize("taken", [0, 1, 6, 7, 8, 20, 41, 42])
def test_checkpoint_resume_continues_exactly(dataset: tuple[str, Written], taken: int) -> None:
    url, written = dataset
    reference = [s["__key__"] for s in ShardLoader(url, seed=2, epoch=1)]
    loader = ShardLoader(url, seed=2, epoch=1)
    it = iter(loader)
    head = [next(it)["__key__"] for _ in range(taken)]
    state = json.loads(json.dumps(loader.state_dict()))  # survives a JSON checkpoint
    resumed = ShardLoader(url, seed=2)
    resumed.load_state_dict(state)
    tail = [s["__key__"] for s in resumed]
    assert head + tail == reference
    # after the resumed epoch, the next iteration is the next epoch
    assert [s["__key__"] for s in resumed] == [s["__key__"] for s in ShardLoader(url, seed=2, epoch=2)]


def test_resume_refuses_a_different_configuration(dataset: tuple[str, Written]) -> None:
    url, _ = dataset
    state = ShardLoader(url, rank=0, world_size=2, seed=2).state_dict()
    for other in (ShardLoader(url, rank=1, world_size=2, seed=2), ShardLoader(url, rank=0, world_size=2, seed=3)):
        with pytest.raises(ConfigError, match="checkpoint was taken with"):
            other.load_state_dict(state)
    with pytest.raises(ConfigError):
        ShardLoader(url).load_state_dict({"version": 7})
    bad = dict(ShardLoader(url).state_dict(), offset="x")
    with pytest.raises(ConfigError):
        ShardLoader(url).load_state_dict(bad)


def test_resume_refuses_a_version_1_state(dataset: tuple[str, Written]) -> None:
    """Version 1 states index random.shuffle's order: resuming one on wire.shuffle's order would
    duplicate and skip samples, so it is refused with what to do instead."""
    url, _ = dataset
    state = ShardLoader(url, seed=2, epoch=3).state_dict()
    assert state["version"] == 2
    old = dict(state, version=1)
    with pytest.raises(ConfigError, match="version 1") as info:
        ShardLoader(url, seed=2).load_state_dict(old)
    message = str(info.value)
    assert "epoch 3" in message
    assert "duplicate" in message and "skip" in message  # why
    assert "Restart that epoch" in message and "shardcache version that wrote it" in message  # what to do
    loader = ShardLoader(url, seed=2)
    with pytest.raises(ConfigError):
        loader.load_state_dict(old)
    assert loader.state_dict() == dict(state, epoch=0)  # a refused state changes nothing


def test_loader_pickles_for_dataloader_workers(dataset: tuple[str, Written]) -> None:
    url, written = dataset
    loader = ShardLoader(url, seed=4)
    next(iter(loader))  # opens a source: must not travel
    clone = pickle.loads(pickle.dumps(loader))
    assert delivered(list(clone.for_worker(0, 1))) != {}


def test_listing_without_manifest(tmp_path: Path) -> None:
    written = write_shards(tmp_path / "b" / "p", shards=3, per_shard=4)
    (tmp_path / "b" / "p" / "notes.txt").write_text("not a shard")
    nested = write_shards(tmp_path / "b" / "p" / "more", shards=1, per_shard=2, seed=1, prefix="x")
    loader = ShardLoader(f"file://{tmp_path}/b/p")  # no trailing slash: still a prefix
    assert [s.key for s in loader.shards] == ["more/x-000000.tar"] + written.keys
    got = delivered(list(loader))
    assert {k: v for k, v in got.items() if k[0] != "x-000000.tar"} == written.samples
    assert len(got) == written.total() + nested.total()


def test_empty_or_missing_dataset(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    for url in (f"file://{tmp_path}/empty/", f"file://{tmp_path}/missing/"):
        with pytest.raises(DatasetNotFound, match="no manifest.json and no|no such directory"):
            list(ShardLoader(url))


@pytest.mark.parametrize(
    "manifest, error, match",
    [
        (b"{not json", ManifestError, "not valid JSON"),
        (b"[]", ManifestError, "JSON object"),
        (b'{"version": 2, "shards": []}', ManifestError, "version"),
        (b'{"version": 1, "format": "tfrecord", "shards": []}', ManifestError, "format"),
        (b'{"version": 1, "shards": {"a": 1}}', ManifestError, "must be a list"),
        (b'{"version": 1, "shards": []}', DatasetNotFound, "no shards"),
        (b'{"version": 1, "shards": [{"key": "../../etc/passwd"}]}', ManifestError, "plain relative path"),
        (b'{"version": 1, "shards": [{"key": "/etc/passwd"}]}', ManifestError, "plain relative path"),
        (b'{"version": 1, "shards": [{"key": "a\\u0000.tar"}]}', ManifestError, "NUL"),
        (b'{"version": 1, "shards": [{"key": 5}]}', ManifestError, "string"),
        (b'{"version": 1, "shards": [{"key": "a.tar"}, {"key": "a.tar"}]}', ManifestError, "twice"),
        (b'{"version": 1, "shards": [{"key": "a.tar", "size": -1}]}', ManifestError, "non-negative"),
        (b'{"version": 1, "shards": [{"key": "a.tar", "samples": true}]}', ManifestError, "non-negative"),
        (b'{"version": 1, "shards": [{"key": "a.tar", "xxh3_128": "zz"}]}', ManifestError, "32 hex"),
    ],
)
def test_hostile_manifests(tmp_path: Path, manifest: bytes, error: type, match: str) -> None:
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "manifest.json").write_bytes(manifest)
    with pytest.raises(error, match=match):
        list(ShardLoader(f"file://{tmp_path}/d/"))


def test_local_shards_are_mapped_unless_turned_off(dataset: tuple[str, Written], monkeypatch: pytest.MonkeyPatch) -> None:
    """``map_files`` (``SHARDCACHE_MAP_FILES``): mapped or streamed, the same samples; and with
    ``SHARDCACHE_ZERO_COPY`` the same content as views."""
    import loader.tar
    from loader import LoaderSettings

    url, written = dataset
    mapped: list[int] = []
    real_map = loader.tar.map_source

    def counting_map(*args: Any) -> Any:
        found = real_map(*args)
        if found is not None and found[2]:  # a file this reader mapped itself
            mapped.append(1)
        return found

    monkeypatch.setattr(loader.tar, "map_source", counting_map)
    assert delivered(list(ShardLoader(url, shuffle=False))) == written.samples
    assert len(mapped) == len(written.keys)
    mapped.clear()
    off = LoaderSettings.from_env({"SHARDCACHE_MAP_FILES": "0"})
    assert delivered(list(ShardLoader(url, shuffle=False, settings=off))) == written.samples
    assert not mapped
    with pytest.raises(ConfigError, match="SHARDCACHE_MAP_FILES"):
        LoaderSettings.from_env({"SHARDCACHE_MAP_FILES": "maybe"})
    # zero copy: views of the mapped shards, the same bytes (memoryview == bytes compares content)
    views = list(ShardLoader(url, shuffle=False, settings=LoaderSettings.from_env({"SHARDCACHE_ZERO_COPY": "1"})))
    assert all(isinstance(v, memoryview) for s in views for k, v in s.items() if not k.startswith("__"))
    assert delivered(views) == written.samples


def test_manifest_checks_catch_corruption(tmp_path: Path) -> None:
    written = write_shards(tmp_path / "d", shards=3, per_shard=5)
    write_manifest(written)
    victim = tmp_path / "d" / written.keys[1]
    data = bytearray(victim.read_bytes())
    pos = data.index(written.samples[(written.keys[1], written.order[written.keys[1]][2])]["jpg"][:16]) + 3
    data[pos] ^= 0xFF  # a payload byte: the tar stays valid, only the hash can tell
    victim.write_bytes(bytes(data))
    url = f"file://{tmp_path}/d/"
    with pytest.raises(CorruptShard, match="checksum mismatch") as info:
        list(ShardLoader(url, shuffle=False))
    assert written.keys[1] in str(info.value)
    # on_error="skip": the other shards are still delivered. The hash is known only at the end of
    # the shard, which is found before its last sample is handed out.
    got = delivered(list(ShardLoader(url, shuffle=False, on_error="skip")))
    assert set(got) == {k for k in written.samples if k[0] != written.keys[1]} | set(
        (written.keys[1], k) for k in written.order[written.keys[1]][:-1]
    )
    # verify=False reads it as it is
    from loader import LoaderSettings

    assert len(list(ShardLoader(url, settings=LoaderSettings(verify=False)))) == written.total()


def test_truncated_and_missing_shards(tmp_path: Path) -> None:
    written = write_shards(tmp_path / "d", shards=3, per_shard=5)
    url = f"file://{tmp_path}/d/"
    victim = tmp_path / "d" / written.keys[0]
    intact = victim.read_bytes()
    victim.write_bytes(intact[:3000])  # no manifest: nothing to compare sizes with
    with pytest.raises(CorruptShard, match="truncated"):
        list(ShardLoader(url, shuffle=False))
    victim.write_bytes(intact)
    write_manifest(written)
    (tmp_path / "d" / written.keys[2]).unlink()
    got = []
    with pytest.raises(ShardNotFound, match=written.keys[2]):
        for sample in ShardLoader(url, shuffle=False):
            got.append(sample)
    assert set(delivered(got)) == {k for k in written.samples if k[0] != written.keys[2]}
    skipped = list(ShardLoader(url, shuffle=False, on_error="skip"))
    assert set(delivered(skipped)) == set(delivered(got))


def test_sample_count_must_match_the_manifest(tmp_path: Path) -> None:
    written = write_shards(tmp_path / "d", shards=2, per_shard=5)
    doc = write_manifest(written, hashes=False)
    doc["shards"][0]["samples"] = 6
    (tmp_path / "d" / "manifest.json").write_text(json.dumps(doc))
    with pytest.raises(CorruptShard, match="holds 5 samples, the manifest says 6"):
        list(ShardLoader(f"file://{tmp_path}/d/", shuffle=False))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"rank": 2, "world_size": 2}, "rank must be in"),
        ({"world_size": 0}, "rank must be in"),
        ({"master": "http://127.0.0.1:1"}, "needs job="),
        ({"job": "j"}, "needs a master"),
        ({"job": "j", "master": "http://127.0.0.1:1", "rank": 0}, "static mode"),
        ({"on_error": "ignore"}, "on_error"),
        ({"endpoint": "ftp://x"}, "invalid cache endpoint"),
    ],
)
def test_bad_arguments(tmp_path: Path, kwargs: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        ShardLoader(f"file://{tmp_path}/", **kwargs)


@pytest.mark.parametrize("url", ["http://x/y", "s3:///nobucket", "file://host/x", "", "s3://b/a/../../c", "file:///a\x00b"])
def test_bad_urls(url: str) -> None:
    with pytest.raises(ConfigError):
        ShardLoader(url)
