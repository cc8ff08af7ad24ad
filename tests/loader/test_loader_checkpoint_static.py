"""Static mode's ``loader.torch.DataLoader`` checkpoints against a real file:// dataset.

A loop takes some batches, saves ``dl.state_dict()``, takes more (lost, as if the process died
there), and a fresh ShardDataset + DataLoader in the same configuration loads the state: what
the loop received before the checkpoint plus what the resumed one receives is exactly what an
uninterrupted run of that configuration receives in that epoch, each sample once, and the
epochs after it are the right ones (``set_epoch``, or persistent workers advancing on their
own). Checkpoints at the very start, mid-epoch (also with some workers through their plans)
and between two epochs; ``num_workers`` 0 and 2, persistent workers or not, batch sizes that
do and do not divide the shards, ``drop_last`` both ways. The shards are of uneven sizes, so
the workers' plans differ in length. States of another ``num_workers``, seed or rank are
refused with a ConfigError and change nothing."""

from __future__ import annotations

import collections
import functools
import itertools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")

from loader import ConfigError  # noqa: E402
from loader.torch import DataLoader, ShardDataset  # noqa: E402
from tests.support.shards import Written, write_manifest, write_shards  # noqa: E402

pytestmark = [pytest.mark.filterwarnings("ignore:This DataLoader will create"), pytest.mark.timeout(120)]

SEED = 5
WORLD = 2
# (shards, samples each): 8 shards of 2, 4, 6 and 8 samples. Every size is even (batch size 2
# divides every shard and every worker's plan), none is a multiple of 3 (batch size 3 leaves
# partial batches, which drop_last drops).
GROUPS = ((2, 2), (2, 4), (2, 6), (2, 8))


@dataclass(frozen=True)
class Config:
    workers: int
    persistent: bool
    batch: int | None
    drop_last: bool

    def __str__(self) -> str:
        kind = "persistent" if self.persistent else "fresh"
        return f"w{self.workers}-{kind}-b{self.batch}-{'drop' if self.drop_last else 'keep'}"


CONFIGS = [
    Config(workers, persistent, batch, drop_last)
    for workers, persistent in ((0, False), (2, False), (2, True))
    for batch in (2, 3)
    for drop_last in (False, True)
]


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Written]:
    root = tmp_path_factory.mktemp("static-ckpt") / "root" / "bk" / "st"
    merged = Written(root, [])
    for i, (shards, per_shard) in enumerate(GROUPS):
        part = write_shards(root, shards=shards, per_shard=per_shard, seed=i, prefix=f"g{i}", sizes=(10, 60))
        merged.samples.update(part.samples)
        merged.order.update(part.order)
    merged.keys = sorted(merged.order)
    write_manifest(merged)
    return f"file://{root.parent.parent.parent}/root/bk/st/", merged


def ident(sample: dict[str, Any]) -> str:
    """The sample's identity, made in the worker (no bytes travel)."""
    return f"{str(sample['__url__']).rsplit('/', 1)[-1]}/{sample['__key__']}"


def build(url: str, cfg: Config, *, rank: int = 1, seed: int = SEED, epoch: int = 0,
          workers: int | None = None) -> tuple[ShardDataset, DataLoader]:
    ds = ShardDataset(url, rank=rank, world_size=WORLD, seed=seed, epoch=epoch, transform=ident)
    n = cfg.workers if workers is None else workers
    dl = DataLoader(ds, batch_size=cfg.batch, num_workers=n, persistent_workers=cfg.persistent and n > 0,
                    drop_last=cfg.drop_last)
    return ds, dl


def flat(batches: Any) -> list[str]:
    out: list[str] = []
    for batch in batches:
        out.extend(batch if isinstance(batch, list) else [batch])
    return out


def take(it: Any, n: int) -> list[str]:
    return flat(itertools.islice(it, n))


@functools.cache
def reference(url: str, cfg: Config, epoch: int, rank: int = 1) -> tuple[tuple[str, ...], int]:
    """What an uninterrupted loop of this configuration receives in ``epoch`` (its samples, and
    how many batches)."""
    _, dl = build(url, cfg, rank=rank, epoch=epoch)
    batches = list(dl)
    return tuple(flat(batches)), len(batches)


def checkpoint(dl: DataLoader) -> dict[str, Any]:
    state = dl.state_dict()
    return json.loads(json.dumps(state))  # small, and survives a JSON checkpoint


def interrupted(dl: DataLoader, n: int) -> tuple[list[str], dict[str, Any]]:
    """The first ``n`` batches a loop received, and the state saved right after them (the loop
    then stops, as a process that died would)."""
    it = iter(dl)
    head = take(it, n)
    state = checkpoint(dl)
    del it
    return head, state


def once(samples: list[str]) -> collections.Counter[str]:
    counts = collections.Counter(samples)
    twice = sorted(k for k, n in counts.items() if n > 1)
    assert not twice, f"received more than once: {twice}"
    return counts


def test_the_references_are_each_sample_of_the_rank_once(data: tuple[str, Written]) -> None:
    """Sanity of the fixture: uneven plans, and without drop_last each rank's epoch is its shards."""
    url, written = data
    everything = set()
    for rank in range(WORLD):
        samples, _ = reference(url, Config(2, False, 2, False), 1, rank)
        everything |= set(once(list(samples)))
    assert everything == {f"{shard}/{key}" for shard, key in written.samples}
    kept, _ = reference(url, Config(2, False, 3, False), 1)
    dropped, _ = reference(url, Config(2, False, 3, True), 1)
    assert set(dropped) < set(kept), "batch size 3 leaves partial batches for drop_last to drop"


@pytest.mark.parametrize("cfg", CONFIGS, ids=str)
@pytest.mark.parametrize("at", ["start", "mid", "late", "end"])
@pytest.mark.slow
def test_resume_receives_the_rest_of_the_epoch_once(data: tuple[str, Written], cfg: Config, at: str) -> None:
    """``start``: before any batch; ``mid``: after 3 batches; ``late``: 2 batches before the
    epoch's end (a worker with a shorter plan is through it); ``end``: after the ``for`` loop,
    before the next epoch's iteration."""
    url, _ = data
    epoch = 1
    whole, batches = reference(url, cfg, epoch)
    ds, dl = build(url, cfg, epoch=epoch)
    received: list[str] = []
    if at == "end":
        received = flat(dl)
        assert sorted(received) == sorted(whole)
        if not cfg.persistent:
            ds.set_epoch(epoch + 1)
    it = iter(dl)
    if at in ("mid", "late"):
        received = take(it, 3 if at == "mid" else batches - 2)
    state = checkpoint(dl)
    take(it, 2)  # received after the checkpoint: lost with the process
    del it

    ds2, dl2 = build(url, cfg, epoch=epoch)
    dl2.load_state_dict(state)
    rest = flat(dl2)
    if at == "end":
        # Saved between two epochs: the resumed loop reads the next one.
        assert once(rest) == collections.Counter(reference(url, cfg, epoch + 1)[0])
        return
    assert once(received + rest) == collections.Counter(whole)
    # The epoch after the resumed one: set_epoch, or persistent workers advancing on their own.
    if not cfg.persistent:
        ds2.set_epoch(epoch + 1)
    assert once(flat(dl2)) == collections.Counter(reference(url, cfg, epoch + 1)[0])
    if cfg.persistent:
        assert once(flat(dl2)) == collections.Counter(reference(url, cfg, epoch + 2)[0])


@pytest.mark.parametrize("cfg", [Config(0, False, 3, False), Config(2, False, 3, True), Config(2, True, 2, False)],
                         ids=str)
def test_a_resumed_loop_checkpoints_again(data: tuple[str, Written], cfg: Config) -> None:
    """A state saved right after loading one is the loaded one; a state saved after a batch of
    the resumed loop (its other worker not heard from yet) still resumes that worker where the
    first state put it."""
    url, _ = data
    whole, _ = reference(url, cfg, 1)
    _, dl = build(url, cfg, epoch=1)
    first, state = interrupted(dl, 3)
    _, dl2 = build(url, cfg, epoch=1)
    dl2.load_state_dict(state)
    assert checkpoint(dl2) == state
    it2 = iter(dl2)
    second = take(it2, 1)
    again = checkpoint(dl2)
    take(it2, 1)
    del it2
    _, dl3 = build(url, cfg, epoch=1)
    dl3.load_state_dict(again)
    assert once(first + second + flat(dl3)) == collections.Counter(whole)


def test_persistent_workers_checkpoint_in_a_later_epoch(data: tuple[str, Written]) -> None:
    """Persistent workers advance on their own: a state saved in their second epoch (the
    dataset was built with epoch=0) resumes in that epoch, and the loop goes on from there."""
    url, _ = data
    cfg = Config(2, True, 3, False)
    _, dl = build(url, cfg, epoch=0)
    assert sorted(flat(dl)) == sorted(reference(url, cfg, 0)[0])
    it = iter(dl)
    head = take(it, 2)
    state = checkpoint(dl)
    assert {tuple(p)[0] for p in state["workers"].values()} == {1}
    take(it, 1)
    del it
    _, dl2 = build(url, cfg, epoch=0)
    dl2.load_state_dict(state)
    assert once(head + flat(dl2)) == collections.Counter(reference(url, cfg, 1)[0])
    assert once(flat(dl2)) == collections.Counter(reference(url, cfg, 2)[0])


def test_loading_into_a_dataloader_whose_persistent_workers_run(data: tuple[str, Written]) -> None:
    """Persistent workers already started hold their own loaders: loading a state replaces them."""
    url, _ = data
    cfg = Config(2, True, 2, False)
    _, dl = build(url, cfg, epoch=1)
    head, state = interrupted(dl, 3)
    _, dl2 = build(url, cfg, epoch=1)
    assert flat(dl2)  # its workers are up, in epoch 2 now
    dl2.load_state_dict(state)
    assert once(head + flat(dl2)) == collections.Counter(reference(url, cfg, 1)[0])


def test_a_worker_with_nothing_to_read(tmp_path: Path) -> None:
    """One shard per rank: the second worker's plan is empty; the state still resumes exactly,
    and a state saved after the epoch says the next one."""
    written = write_shards(tmp_path / "root" / "bk" / "one", shards=4, per_shard=5, sizes=(10, 20))
    write_manifest(written)
    url = f"file://{tmp_path}/root/bk/one/"
    for cfg in (Config(2, False, 2, False), Config(2, True, 2, False)):
        ds = ShardDataset(url, rank=3, world_size=4, seed=1, epoch=0, transform=ident)
        dl = DataLoader(ds, batch_size=cfg.batch, num_workers=2, persistent_workers=cfg.persistent)
        epochs = [sorted(flat(dl)) for _ in range(2)] if cfg.persistent else []
        ds = ShardDataset(url, rank=3, world_size=4, seed=1, epoch=0, transform=ident)
        dl = DataLoader(ds, batch_size=cfg.batch, num_workers=2, persistent_workers=cfg.persistent)
        head, state = interrupted(dl, 1)
        ds2 = ShardDataset(url, rank=3, world_size=4, seed=1, epoch=0, transform=ident)
        dl2 = DataLoader(ds2, batch_size=cfg.batch, num_workers=2, persistent_workers=cfg.persistent)
        dl2.load_state_dict(state)
        epoch0 = once(head + flat(dl2))
        assert len(epoch0) == 5
        end = checkpoint(dl2)
        assert {tuple(p)[0] for p in end["workers"].values()} == {1}
        ds3 = ShardDataset(url, rank=3, world_size=4, seed=1, epoch=0, transform=ident)
        dl3 = DataLoader(ds3, batch_size=cfg.batch, num_workers=2, persistent_workers=cfg.persistent)
        dl3.load_state_dict(end)
        epoch1 = once(flat(dl3))
        assert len(epoch1) == 5
        if epochs:
            assert [sorted(epoch0), sorted(epoch1)] == epochs


def test_states_of_another_configuration_are_refused(data: tuple[str, Written]) -> None:
    url, _ = data
    cfg = Config(2, False, 3, False)
    _, dl = build(url, cfg, epoch=1)
    head, state = interrupted(dl, 3)
    _, zero = build(url, cfg, epoch=1, workers=0)
    with pytest.raises(ConfigError, match=r"num_workers=2 and this DataLoader has num_workers=0"):
        zero.load_state_dict(state)
    _, four = build(url, cfg, epoch=1, workers=4)
    with pytest.raises(ConfigError, match=r"num_workers=2 and this DataLoader has num_workers=4.*same num_workers"):
        four.load_state_dict(state)
    for kwargs, name in (({"seed": SEED + 1}, "seed"), ({"rank": 0}, "rank")):
        _, other = build(url, cfg, epoch=1, **kwargs)
        with pytest.raises(ConfigError, match=f"checkpoint was taken with {name}="):
            other.load_state_dict(state)
        assert checkpoint(other) == checkpoint(build(url, cfg, epoch=1, **kwargs)[1]), "a refused state changes nothing"
    for bad in ({"kind": "nope"}, dict(state, version=9), dict(state, workers={"0": [1, 0]}),
                dict(state, workers={"0": [1, 0, 0]}), dict(state, workers={"0": [1, 0, 0], "1": [1, 0, 0], "2": [1, 0, 0]})):
        _, fresh = build(url, cfg, epoch=1)
        with pytest.raises(ConfigError):
            fresh.load_state_dict(bad)
    # A refused state changed nothing; the right one still resumes exactly.
    fresh.load_state_dict(state)
    assert once(head + flat(fresh)) == collections.Counter(reference(url, cfg, 1)[0])


def test_continuous_resumes_the_stream_across_epochs(data: tuple[str, Written]) -> None:
    """``continuous=True``: the state resumes the stream where the loop was, across epoch ends.
    (With an even number of batches taken, the two workers' turns line up as they were.)"""
    url, _ = data

    def make() -> DataLoader:
        ds = ShardDataset(url, rank=1, world_size=WORLD, seed=SEED, continuous=True, transform=ident)
        return DataLoader(ds, batch_size=3, num_workers=2)

    total = 18  # 54 samples: more than two epochs of the rank's 20 each
    reference = take(iter(make()), total)
    dl = make()
    it = iter(dl)
    head = take(it, 8)
    state = checkpoint(dl)
    take(it, 2)
    del it
    resumed = make()
    resumed.load_state_dict(state)
    assert collections.Counter(head + take(iter(resumed), total - 8)) == collections.Counter(reference)


def test_a_loaders_own_position_is_not_split_between_workers(data: tuple[str, Written]) -> None:
    """A ShardLoader state (of a loop without workers) points into the rank's whole plan: workers
    that split the plan are refused it instead of each skipping that much of its own."""
    url, _ = data
    cfg = Config(0, False, 3, False)
    ds, dl = build(url, cfg, epoch=1)
    it = iter(dl)
    head = take(it, 2)
    mine = ds.state_dict()  # the dataset's loader: it read those samples itself
    del it
    ds2, dl2 = build(url, cfg, epoch=1, workers=2)
    ds2.load_state_dict(mine)
    with pytest.raises(ConfigError, match="DataLoader workers split that plan"):
        iter(dl2)
    _, dl3 = build(url, cfg, epoch=1)
    dl3.load_state_dict(mine)  # a num_workers=0 DataLoader takes it
    assert once(head + flat(dl3)) == collections.Counter(reference(url, cfg, 1)[0])


@pytest.mark.parametrize("cfg", [Config(0, False, 2, False), Config(2, False, 3, False)], ids=str)
def test_set_epoch_of_the_resumed_epoch_keeps_the_state(data: tuple[str, Written], cfg: Config) -> None:
    """A DistributedSampler-style loop calls ``ds.set_epoch(epoch)`` before each epoch, the
    resumed one too: the state holds for that epoch; another epoch starts afresh."""
    url, _ = data
    samples, _ = reference(url, cfg, 1)
    _, dl = build(url, cfg, epoch=1)
    before, state = interrupted(dl, 3)
    ds2, dl2 = build(url, cfg)
    dl2.load_state_dict(state)
    ds2.set_epoch(1)
    rest = flat(dl2)
    assert collections.Counter(before + rest) == collections.Counter(samples)
    ds3, dl3 = build(url, cfg)
    dl3.load_state_dict(state)
    ds3.set_epoch(2)
    assert collections.Counter(flat(dl3)) == collections.Counter(reference(url, cfg, 2)[0])
