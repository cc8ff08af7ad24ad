"""The torch and TensorFlow adapters for real (torch==2.13.0 CPU, tensorflow-cpu), and the
promise that ``import loader`` pulls in neither."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest

from loader import ConfigError
from tests.support.processes import REPO
from tests.support.shards import Written, delivered

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create")


def test_import_loader_imports_no_framework() -> None:
    """Nor the daemon's code: the loader talks to the daemon only over HTTP (and boto3 is loaded
    only when S3 is read directly)."""
    heavy = ("torch", "tensorflow", "keras", "boto3", "sidecar", "cache", "aiohttp")
    code = (
        "import sys, json, loader, loader.shardloader, loader.sources, loader.master.stream, loader.master.client\n"
        f"print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in {heavy!r})))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60, check=True)
    assert json.loads(out.stdout) == []


def test_torch_dataloader_four_workers_static(dataset: tuple[str, Written]) -> None:
    torch_data = pytest.importorskip("torch.utils.data")
    from loader.torch import ShardDataset

    url, written = dataset
    got: list[dict[str, Any]] = []
    for rank in range(2):
        ds = ShardDataset(url, rank=rank, world_size=2, seed=3)
        got.extend(torch_data.DataLoader(ds, batch_size=None, num_workers=4))
    assert delivered(got) == written.samples  # no duplicates (delivered() asserts), no gaps, same bytes


def test_torch_epochs_with_set_epoch_and_persistent_workers(dataset: tuple[str, Written]) -> None:
    torch_data = pytest.importorskip("torch.utils.data")
    from loader.torch import ShardDataset

    url, written = dataset

    def keys(ds: Any, **kwargs: Any) -> list[list[str]]:
        loader = torch_data.DataLoader(ds, batch_size=None, num_workers=2, **kwargs)
        epochs = []
        for epoch in range(2):
            if not kwargs:
                ds.set_epoch(epoch)
            epochs.append(sorted(s["__url__"] + "#" + s["__key__"] for s in loader))
        return epochs

    fresh = keys(ShardDataset(url, seed=1, world_size=1))
    persistent = keys(ShardDataset(url, seed=1, world_size=1), persistent_workers=True)
    for epochs in (fresh, persistent):
        assert all(len(e) == written.total() == len(set(e)) for e in epochs)


def test_torch_batches_and_transform(dataset: tuple[str, Written]) -> None:
    torch = pytest.importorskip("torch")
    from torch.utils.data import DataLoader

    from loader.torch import ShardDataset

    url, written = dataset

    def decode(sample: dict[str, Any]) -> dict[str, Any]:
        return {"label": torch.tensor(int(sample["cls"])), "n": torch.tensor(len(sample["jpg"]))}

    total = 0
    for batch in DataLoader(ShardDataset(url, transform=decode), batch_size=5, num_workers=2):
        assert batch["label"].dtype == torch.int64
        total += int(batch["label"].shape[0])
    assert total == written.total()


def test_tf_dataset(dataset: tuple[str, Written]) -> None:
    tf = pytest.importorskip("tensorflow")
    import loader.tf

    url, written = dataset
    ds = loader.tf.dataset(url, fields=("jpg", "cls", "json"), seed=2)
    got = []
    for element in ds.as_numpy_iterator():
        got.append({"__key__": element["__key__"].decode(), "__url__": "x/" + _shard_of(written, element["__key__"].decode()),
                    "jpg": element["jpg"], "cls": element["cls"], "json": element["json"]})
    assert delivered(got) == written.samples
    # iterating again reads the next epoch (same samples, another order)
    again = [e["__key__"] for e in ds.as_numpy_iterator()]
    assert sorted(again) == sorted(g["__key__"].encode() for g in got)
    assert again != [g["__key__"].encode() for g in got]

    # a transform with its output_signature, batched
    def label(sample: dict[str, Any]) -> tuple[int, int]:
        return int(sample["cls"]), len(sample["jpg"])

    sig = (tf.TensorSpec((), tf.int64), tf.TensorSpec((), tf.int64))
    batched = loader.tf.dataset(url, transform=label, output_signature=sig, rank=1, world_size=2).batch(4)
    labels = [int(x) for b in batched.as_numpy_iterator() for x in b[0]]
    assert 0 < len(labels) < written.total() and all(0 <= x < 7 for x in labels)

    with pytest.raises(ConfigError, match="fields="):
        loader.tf.dataset(url)
    with pytest.raises(ConfigError, match="output_signature"):
        loader.tf.dataset(url, transform=label)
    missing = loader.tf.dataset(url, fields=("jpg", "png"))
    with pytest.raises(Exception, match="has no field 'png'"):
        list(missing.as_numpy_iterator())


def _shard_of(written: Written, key: str) -> str:
    return next(shard for shard, k in written.samples if k == key)


def test_tf_samples_by_index(dataset: tuple[str, Written]) -> None:
    tf = pytest.importorskip("tensorflow")
    import numpy as np

    import loader.tf

    url, written = dataset
    order = [(shard, key) for shard in written.keys for key in written.order[shard]]
    picked = np.random.default_rng(3).permutation(len(order))[:20]
    ds = loader.tf.indexed_dataset(url, fields=("jpg", "cls"), indices=picked, endpoint="")
    got = list(ds.map(lambda e: e, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True).as_numpy_iterator())
    assert [e["__key__"].decode() for e in got] == [order[i][1] for i in picked]
    for element, i in zip(got, picked, strict=True):
        assert element["jpg"] == written.samples[order[i]]["jpg"] and element["cls"] == written.samples[order[i]]["cls"]
    everything = loader.tf.indexed_dataset(url, fields=("cls",), endpoint="")
    assert sum(1 for _ in everything) == written.total()
    with pytest.raises(IndexError):
        loader.tf.indexed_dataset(url, fields=("cls",), indices=[len(order)], endpoint="")
    with pytest.raises(ConfigError, match="fields="):
        loader.tf.indexed_dataset(url, fields=())
