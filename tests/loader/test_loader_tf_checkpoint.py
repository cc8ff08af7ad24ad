"""Checkpoints of ``loader.tf`` datasets with real TensorFlow: ``tf.train.Checkpoint`` saves
``loader.tf.checkpoint_state(ds)`` (the loader's state as JSON) and restores it into a fresh
dataset. Static mode: mid-epoch saves of an unbuffered pipeline (``readahead=False``) resume at
exactly the next element, and the epochs after it follow; a buffered pipeline's save skips what
its buffers held (a contiguous run, never a duplicate), except at an epoch's end. Dynamic mode
against a real master: the state names a mark, and a fresh dataset restored from it reads
exactly what had not been handed out, once."""

from __future__ import annotations

import collections
import gc
import itertools
import json
from pathlib import Path
from typing import Any

import pytest

tf = pytest.importorskip("tensorflow")

import loader.tf as ltf  # noqa: E402
from loader import ConfigError, ShardLoader  # noqa: E402
from loader.master.client import MasterClient  # noqa: E402
from tests.support.shards import Written, write_manifest, write_shards  # noqa: E402

pytestmark = pytest.mark.timeout(120)

STATIC = {"fields": ("cls",), "rank": 1, "world_size": 2, "seed": 3, "epoch": 1}


@pytest.fixture
def data(tmp_path: Path) -> tuple[str, Written]:
    written = write_shards(tmp_path / "root" / "bk" / "tf", shards=6, per_shard=9, sizes=(10, 40))
    write_manifest(written)
    return f"file://{tmp_path}/root/bk/tf/", written


def keys(elements: Any) -> list[str]:
    """The sample keys of elements (dicts with ``__key__``, batched or not), in order."""
    if isinstance(elements, tf.data.Dataset):
        elements = elements.as_numpy_iterator()
    out: list[str] = []
    for element in elements:
        key = element["__key__"]
        out.extend([k.decode() for k in key] if hasattr(key, "shape") and key.shape else [key.decode()])
    return out


def take(it: Any, n: int) -> list[str]:
    return keys(itertools.islice(it, n))


def saved_state(path: str) -> dict[str, Any]:
    """The loader state a checkpoint holds (what ``checkpoint_state(...).serialize()`` wrote)."""
    reader = tf.train.load_checkpoint(path)
    (name,) = [n for n, _ in tf.train.list_variables(path) if n.startswith("data/") and "py_state" in n]
    doc = json.loads(reader.get_tensor(name))
    assert doc["kind"] == "shardcache-tf" and doc["version"] == 1
    return dict(doc["loader"])


def restored(url: str, path: str, **args: Any) -> tf.data.Dataset:
    ds = ltf.dataset(url, **args)
    tf.train.Checkpoint(data=ltf.checkpoint_state(ds)).restore(path).assert_existing_objects_matched().expect_partial()
    return ds


@pytest.mark.parametrize("taken", [0, 1, 11, 26, 27])
@pytest.mark.slow
def test_static_restore_reads_exactly_the_rest(data: tuple[str, Written], tmp_path: Path, taken: int) -> None:
    """27 samples in the rank's epoch: saved before any, mid-shard, at a shard's end, before the
    last, after the last (before the iteration's end: the rest is empty)."""
    url, _ = data
    whole = keys(ltf.dataset(url, **STATIC))
    following = keys(ltf.dataset(url, **dict(STATIC, epoch=2)))
    assert len(whole) == 27 and sorted(whole) != sorted(following)
    ds = ltf.dataset(url, **STATIC, readahead=False)
    ckpt = tf.train.Checkpoint(data=ltf.checkpoint_state(ds))
    it = ds.as_numpy_iterator()
    head = take(it, taken)
    path = ckpt.save(str(tmp_path / "ckpt"))
    take(it, 4)  # handed out after the save: lost with the process
    del it
    state = saved_state(path)
    assert (state["epoch"], state["rank"], state["seed"]) == (1, 1, 3)

    ds2 = restored(url, path, **dict(STATIC, epoch=0), readahead=False)  # the state says the epoch
    assert head + keys(ds2) == whole
    assert keys(ds2) == following  # the next iteration: the next epoch
    assert keys(ds2) == keys(ltf.dataset(url, **dict(STATIC, epoch=3)))


def test_static_batched_pipeline_restores_exactly(data: tuple[str, Written], tmp_path: Path) -> None:
    """map and batch over readahead=False pull only what they deliver (tf.data's default
    optimizations would fuse them into a map-and-batch that prefetches)."""
    url, _ = data

    def pipeline(ds: tf.data.Dataset) -> tf.data.Dataset:
        return ds.map(lambda e: {"__key__": e["__key__"], "n": tf.strings.length(e["cls"])}).batch(4)

    whole = keys(ltf.dataset(url, **STATIC))
    ds = ltf.dataset(url, **STATIC, readahead=False)
    ckpt = tf.train.Checkpoint(data=ltf.checkpoint_state(pipeline(ds)))  # found through map and batch
    it = pipeline(ds).as_numpy_iterator()
    head = take(it, 3)
    path = ckpt.save(str(tmp_path / "ckpt"))
    take(it, 2)
    del it
    ds2 = restored(url, path, **STATIC, readahead=False)
    assert head + keys(pipeline(ds2)) == whole


def test_a_buffered_pipeline_skips_what_its_buffers_held(data: tuple[str, Written], tmp_path: Path) -> None:
    """With prefetch (and tf.data's default read-ahead) the save is ahead of the loop by what
    the buffers held: the resumed run skips a contiguous run of at most that many elements and
    reads none twice. Saved at an epoch's end, it is exact: the next epoch, whole."""
    url, _ = data
    whole = keys(ltf.dataset(url, **STATIC))
    ds = ltf.dataset(url, **STATIC).prefetch(4)
    ckpt = tf.train.Checkpoint(data=ltf.checkpoint_state(ds))
    it = ds.as_numpy_iterator()
    head = take(it, 5)
    path = ckpt.save(str(tmp_path / "mid"))
    del it
    rest = keys(restored(url, path, **STATIC))
    skipped = len(whole) - len(head) - len(rest)
    assert head == whole[:5] and rest == whole[len(whole) - len(rest):]
    assert 0 <= skipped <= 4 + 4, "prefetch(4) plus tf.data's own read-ahead"

    ds = ltf.dataset(url, **STATIC).prefetch(4)
    ckpt = tf.train.Checkpoint(data=ltf.checkpoint_state(ds))
    assert keys(ds) == whole
    path = ckpt.save(str(tmp_path / "end"))
    assert keys(restored(url, path, **STATIC)) == keys(ltf.dataset(url, **dict(STATIC, epoch=2)))


@pytest.mark.slow
def test_dynamic_restore_reads_the_rest_once(data: tuple[str, Written], master: str, tmp_path: Path) -> None:
    url, written = data
    args = {"fields": ("cls",), "job": "tfck", "master": master, "epochs": 1, "seed": 3, "readahead": False}
    ds = ltf.dataset(url, **args)
    ckpt = tf.train.Checkpoint(data=ltf.checkpoint_state(ds))
    it = ds.as_numpy_iterator()
    head = take(it, 13)
    path = ckpt.save(str(tmp_path / "ckpt"))
    state = saved_state(path)
    assert state["kind"] == "shardcache-dynamic" and state["job"] == "tfck" and state["clock"] == 13
    assert isinstance(state["mark"], int) and state["mark"] > 0
    lost = take(it, 20)  # handed out after the save: lost with the process
    del it
    gc.collect()

    ds2 = restored(url, path, **args)  # a fresh loader: a new trainer
    rest = keys(ds2)
    counts = collections.Counter(head + rest)
    assert set(counts) == {key for _, key in written.samples} and max(counts.values()) == 1
    assert set(lost) <= set(rest), "what was handed out after the save is read again"
    st = MasterClient(master).status("tfck")
    assert st["finished"] and st["totals"]["rewinds"] == 1


def test_refusals_and_finding_the_loader(data: tuple[str, Written], tmp_path: Path) -> None:
    url, _ = data
    ds = ltf.dataset(url, **STATIC, readahead=False)
    it = ds.as_numpy_iterator()
    take(it, 3)
    path = tf.train.Checkpoint(data=ltf.checkpoint_state(ds)).save(str(tmp_path / "ckpt"))
    del it
    # A state of another seed is refused on restore, saying what differs; nothing changes.
    other = ltf.dataset(url, **dict(STATIC, seed=4), readahead=False)
    with pytest.raises(ConfigError, match="checkpoint was taken with seed=3"):
        tf.train.Checkpoint(data=ltf.checkpoint_state(other)).restore(path)
    assert keys(other) == keys(ltf.dataset(url, **dict(STATIC, seed=4)))
    with pytest.raises(ConfigError, match="not a loader.tf checkpoint state"):
        ltf.checkpoint_state(other).deserialize(b'{"epoch": 1}')

    # The loader behind a derived dataset; a ShardLoader is accepted as it is.
    shard_loader = ltf.loader_of(ds.map(lambda e: e).batch(2).prefetch(1))
    assert isinstance(shard_loader, ShardLoader) and shard_loader is ltf.checkpoint_state(ds).loader
    assert ltf.checkpoint_state(shard_loader).loader is shard_loader
    with pytest.raises(ConfigError, match="reads 2 ShardLoaders"):
        ltf.loader_of(tf.data.Dataset.zip((ds, other)))
    with pytest.raises(ConfigError, match="reads no ShardLoader"):
        ltf.checkpoint_state(tf.data.Dataset.range(3))
