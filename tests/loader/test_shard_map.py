"""Samples by index (issue 31, first part): :class:`loader.ShardIndex` and
``loader.torch.ShardMapDataset`` on a ``file://`` dataset and through a real node daemon (over
HTTP, and by descriptor over its handle socket), with torch's own samplers and DataLoader workers.

``ds[i]`` must be sample ``i`` of the dataset's order (shards sorted, samples in tar order) with
the streaming loader's fields; a damaged shard is refused (and healed by a cache in between);
bad indices and manifests without counts get clear errors.
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from loader import CorruptShard, LoaderSettings, ManifestError, ShardIndex
from tests.support.daemons import DaemonProcess
from tests.support.shards import Written, write_manifest, write_shards
from tests.support.waits import wait_until

pytestmark = pytest.mark.timeout(180)


def in_order(written: Written) -> list[tuple[str, str]]:
    return [(shard, key) for shard in written.keys for key in written.order[shard]]


def ident(sample: dict[str, Any]) -> tuple[str, str]:
    return sample["__url__"].rsplit("/", 1)[-1], sample["__key__"]


def check(sample: dict[str, Any], written: Written) -> None:
    fields = {k: v for k, v in sample.items() if not k.startswith("__")}
    assert fields == written.samples[ident(sample)], ident(sample)


def test_every_index_is_that_sample_in_any_order(dataset: tuple[str, Written]) -> None:
    url, written = dataset
    index = ShardIndex(url, endpoint="")
    order = in_order(written)
    assert len(index) == len(order) == written.total()
    for i in reversed(range(len(index))):  # backwards: every shard's samples out of order
        sample = index.sample(i)
        assert ident(sample) == order[i]
        check(sample, written)
    assert ident(index.sample(-1)) == order[-1]
    batch = index.samples([5, 40, 6, 0, 41])
    assert [ident(s) for s in batch] == [order[i] for i in (5, 40, 6, 0, 41)]
    for bad, error in ((len(order), IndexError), (-len(order) - 1, IndexError), ("3", TypeError), (True, TypeError)):
        with pytest.raises(error):
            index.sample(bad)  # type: ignore[arg-type]
    index.close()


def test_zero_copy_gives_views_of_the_mapping(dataset: tuple[str, Written]) -> None:
    url, written = dataset
    index = ShardIndex(url, endpoint="", settings=LoaderSettings(zero_copy=True))
    for i in (3, 30, 0):
        sample = index.sample(i)
        assert all(isinstance(v, memoryview) for k, v in sample.items() if not k.startswith("__"))
        assert {k: bytes(v) for k, v in sample.items() if not k.startswith("__")} == written.samples[ident(sample)]
    held = index.sample(5)["jpg"]
    index.close()  # a view still held keeps its mapping alive: it stays readable
    assert bytes(held) == written.samples[in_order(written)[5]]["jpg"]


def test_the_same_samples_as_the_streaming_loader(dataset: tuple[str, Written]) -> None:
    from loader import ShardLoader

    url, _ = dataset
    streamed = list(ShardLoader(url, endpoint="", shuffle=False))
    index = ShardIndex(url, endpoint="")
    assert [index.sample(i) for i in range(len(index))] == streamed


def test_a_manifest_without_counts_and_a_damaged_shard_are_refused(tmp_path: Path) -> None:
    written = write_shards(tmp_path / "root" / "b" / "ds", shards=2, per_shard=5)
    write_manifest(written, samples=False)
    url = f"file://{tmp_path}/root/b/ds/"
    with pytest.raises(ManifestError, match="shardcache index"):
        ShardIndex(url, endpoint="")
    write_manifest(written)
    shard = written.root / written.keys[1]
    data = bytearray(shard.read_bytes())
    data[700] ^= 0xFF  # a flipped byte inside the first member's data
    shard.write_bytes(bytes(data))
    index = ShardIndex(url, endpoint="")
    assert ident(index.sample(0)) == (written.keys[0], written.order[written.keys[0]][0])
    with pytest.raises(CorruptShard, match="checksum mismatch"):
        index.sample(5)


def _single_shard_dataset(root: Path, data: bytes, samples: int) -> str:
    root.mkdir(parents=True)
    (root / "train-000000.tar").write_bytes(data)
    (root / "manifest.json").write_text(json.dumps({"version": 1, "format": "webdataset", "shards": [
        {"key": "train-000000.tar", "size": len(data), "samples": samples}]}))
    return f"file://{root.parent.parent}/{root.parent.name}/{root.name}/"


def test_shards_that_cannot_be_indexed_are_refused_with_the_reason(tmp_path: Path) -> None:
    import gzip
    import os
    import random

    from tests.loader.test_tar_formats import TAR, make_sparse

    written = write_shards(tmp_path / "src" / "b" / "ds", shards=1, per_shard=3)
    plain = (written.root / written.keys[0]).read_bytes()
    cases = {
        "gzip": (gzip.compress(plain), "gzip"),
        "noise": (random.Random(1).randbytes(20_000), "not a tar|tar header|checksum"),
    }
    src = tmp_path / "sparse-src"
    make_sparse(src / "0001.bin", 1 << 20, [(4096, b"hello")])
    (src / "0001.cls").write_bytes(b"1")
    info = os.stat(src / "0001.bin")
    if os.path.exists(TAR) and info.st_blocks * 512 < info.st_size:  # GNU tar, and a file system that keeps holes
        out = tmp_path / "sparse.tar"
        import subprocess

        subprocess.run([TAR, "-C", str(src), "-cf", str(out), "--sparse", "0001.bin", "0001.cls"], check=True, timeout=60)
        cases["sparse"] = (out.read_bytes(), "sparse member")
    for name, (data, said) in cases.items():
        url = _single_shard_dataset(tmp_path / "root" / name / "ds", data, 1)
        with pytest.raises(CorruptShard, match=said):
            ShardIndex(url, endpoint="").sample(0)
        assert os.path.exists(url[len("file://"):] + "train-000000.tar")  # nothing removed or changed


def test_a_replaced_shard_is_read_anew_never_by_its_old_table(tmp_path: Path) -> None:
    """The member table of a shard is tied to its file (device, inode, size, times) and to the
    checksum it was verified against: a shard replaced by other samples of the very same size
    (atomically, as a publisher does) is parsed and checked again, never sliced by the old table."""
    import os

    first = write_shards(tmp_path / "a" / "b" / "ds", shards=1, per_shard=4, seed=1, sizes=(2000, 2000))
    second = write_shards(tmp_path / "c" / "b" / "ds", shards=1, per_shard=4, seed=2, sizes=(2000, 2000))
    key = first.keys[0]
    assert (first.root / key).stat().st_size == (second.root / key).stat().st_size
    write_manifest(first)
    url = f"file://{tmp_path}/a/b/ds/"
    old = ShardIndex(url, endpoint="")
    assert [ident(old.sample(i)) for i in range(4)] == in_order(first)
    old.close()
    os.replace(second.root / key, first.root / key)
    write_manifest(Written(first.root, second.keys, second.samples, second.order))
    new = ShardIndex(url, endpoint="")
    samples = [new.sample(i) for i in range(4)]
    assert [s["__key__"] for s in samples] == second.order[key]
    for sample in samples:
        assert {k: v for k, v in sample.items() if not k.startswith("__")} == second.samples[(key, sample["__key__"])]


def test_batches_open_each_shard_once(dataset: tuple[str, Written], monkeypatch: pytest.MonkeyPatch) -> None:
    url, written = dataset
    index = ShardIndex(url, endpoint="", max_open_shards=1)
    opened: list[str] = []
    real = index._load

    def counting(source: Any, shard: Any) -> Any:
        opened.append(shard.key)
        return real(source, shard)

    monkeypatch.setattr(index, "_load", counting)
    per = len(written.order[written.keys[0]])
    # Two shards, interleaved: one open each, even with one shard kept open at a time.
    index.samples([0, per, 1, per + 1, 2, per + 2])
    assert opened == [written.keys[0], written.keys[1]]


@pytest.fixture
def node(dataset: tuple[str, Written], tmp_path: Path) -> Iterator[tuple[str, Written, str, Path]]:
    """A real ``shardcache serve --handles`` on the dataset's root: (url, written, endpoint, handle socket)."""
    url, written = dataset
    root = url[len("file://"):].split("/bkt/")[0]
    sockets = tmp_path / "node"
    sockets.mkdir()
    proc = DaemonProcess(["--min-free", "0%", "--listen", f"unix://{sockets}/daemon.sock",
                          "--handles", f"unix://{sockets}/handles.sock", "--cache-dir", str(tmp_path / "cache"),
                          "--cache-size", "1GiB", "--origin", f"file://{root}"], tmp_path / "node.log",
                         ready_path="/healthz").start()
    try:
        wait_until(lambda: (sockets / "handles.sock").exists(), timeout=20, what="the handle socket")
        yield "s3://bkt/ds/", written, proc.url, sockets / "handles.sock"
    finally:
        proc.stop()


def _stats(endpoint: str) -> dict[str, Any]:
    with urllib.request.urlopen(endpoint + "/_shardcache/stats", timeout=10) as resp:
        return json.load(resp)


def test_through_the_node_cache_over_http_and_by_descriptor(node: tuple[str, Written, str, Path]) -> None:
    url, written, endpoint, handles = node
    order = in_order(written)
    over_http = ShardIndex(url, endpoint=endpoint, settings=LoaderSettings(short_circuit=False))
    for i in (17, 3, 40, 0):
        assert ident(over_http.sample(i)) == order[i]
        check(over_http.sample(i), written)
    wait_until(lambda: int(_stats(endpoint)["fills_in_flight"]) == 0, timeout=30, what="fills published")
    over_http_bytes = int(_stats(endpoint)["served_bytes"]["hit"]) + int(_stats(endpoint)["served_bytes"]["miss"])
    short_before = int(_stats(endpoint)["served_bytes"]["short_circuit"])
    by_handle = ShardIndex(url, endpoint=endpoint, settings=LoaderSettings(handles=f"unix://{handles}"))
    for i in range(len(by_handle)):
        sample = by_handle.sample(i)
        assert ident(sample) == order[i]
        check(sample, written)
    served = _stats(endpoint)["served_bytes"]
    # Every shard by descriptor (counted as short-circuit bytes), none of them over HTTP again.
    assert int(served["short_circuit"]) - short_before == sum((written.root / k).stat().st_size for k in written.keys)
    assert int(served["hit"]) + int(served["miss"]) == over_http_bytes


def test_a_batch_hints_its_cold_shards_and_nothing_more(node: tuple[str, Written, str, Path],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A sampler's batch over three cold shards asks the daemon for those three (the first by its
    read, the other two as prefetch hints, filled while the first is read), and no other; a batch
    of shards already open hints nothing."""
    url, written, endpoint, _ = node
    index = ShardIndex(url, endpoint=endpoint, settings=LoaderSettings(short_circuit=False))
    source = index._get_source()
    hinted: list[list[str]] = []
    real = source.prefetch

    def spy(shards: Any) -> None:
        hinted.append([s.key for s in shards])
        real(shards)

    monkeypatch.setattr(source, "prefetch", spy)
    per = len(written.order[written.keys[0]])
    batch = [0, per, 2 * per, 1, per + 1]
    assert [ident(s) for s in index.samples(batch)] == [in_order(written)[i] for i in batch]
    assert hinted == [[written.keys[1], written.keys[2]]]
    index.samples([2, per + 2, 2 * per + 2])
    assert len(hinted) == 1
    wait_until(lambda: int(_stats(endpoint)["fills_in_flight"]) == 0, timeout=30, what="fills published")
    assert _stats(endpoint)["cache"]["items"] == 3  # the batch's three shards, not the dataset's six


@pytest.mark.parametrize("workers", [0, 2])
def test_distributed_sampler_and_dataloader_workers_see_every_index_once(dataset: tuple[str, Written], workers: int) -> None:
    import torch.utils.data

    from loader.torch import DataLoader, ShardMapDataset

    url, written = dataset
    ds = ShardMapDataset(url, endpoint="", transform=lambda s: (s["__url__"].rsplit("/", 1)[-1], s["__key__"]))
    seen: list[tuple[str, str]] = []
    world = 3
    for epoch in range(2):
        per_epoch: list[tuple[str, str]] = []
        for rank in range(world):
            sampler = torch.utils.data.DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=True, seed=5,
                                                          drop_last=False)
            sampler.set_epoch(epoch)
            loader = DataLoader(ds, batch_size=4, sampler=sampler, num_workers=workers,
                                collate_fn=lambda batch: batch)
            per_epoch.extend(item for batch in loader for item in batch)
        # DistributedSampler pads to a multiple of the world size with repeats of the first indices.
        padding = (-len(ds)) % world
        assert sorted(set(per_epoch)) == sorted(in_order(written)) and len(per_epoch) == len(ds) + padding
        seen.extend(per_epoch)
    assert len(seen) == 2 * (len(ds) + (-len(ds)) % world)


# -- wids interop: a dataset indexed by either tool works with both ----------------------------------


def _index_cli(url: str, *extra: str) -> dict[str, Any]:
    import subprocess

    from tests.support.processes import PYTHON, REPO

    out = subprocess.run([PYTHON, "-m", "sidecar.cli", "index", url, "--json", "--quiet", *extra], capture_output=True,
                         text=True, timeout=120, env={**__import__("os").environ, "PYTHONPATH": str(REPO)})
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_shardcache_index_writes_a_wids_index_that_wids_reads(tmp_path: Path) -> None:
    wids = pytest.importorskip("wids", reason="wids is a test dependency (pip install wids)")
    written = write_shards(tmp_path / "root" / "b" / "ds", shards=3, per_shard=6)
    url = f"file://{tmp_path}/root/b/ds/"
    result = _index_cli(url, "--wids", "shardindex.json")
    assert result["wids"].endswith("shardindex.json")
    doc = json.loads((written.root / "shardindex.json").read_text())
    assert doc["__kind__"] == "wids-shard-index-v1" and [s["url"] for s in doc["shardlist"]] == written.keys
    theirs = wids.ShardListDataset(str(written.root / "shardindex.json"), cache_dir=str(tmp_path / "wids-cache"),
                                   transformations=[])
    ours = ShardIndex(url + "shardindex.json", endpoint="")
    assert len(theirs) == len(ours) == written.total()
    for i in (0, 7, len(ours) - 1):
        mine, wid = ours.sample(i), theirs[i]
        assert mine["__key__"] == wid["__key__"]
        # wids hands each member over as a BytesIO.
        assert {"." + k: v for k, v in mine.items() if not k.startswith("__")} == {
            k: v.getvalue() for k, v in wid.items() if k.startswith(".")}


def test_a_wids_index_written_by_wids_is_read(tmp_path: Path) -> None:
    pytest.importorskip("wids", reason="wids is a test dependency (pip install wids)")
    import subprocess
    import sys

    written = write_shards(tmp_path / "root" / "b" / "ds", shards=2, per_shard=4)
    index = written.root / "wids.json"
    # wids' own tool, with absolute paths as its users give them.
    made = subprocess.run([sys.executable, "-c", "import sys; from wids.wids_index import main; sys.exit(main())",
                           "create", "-o", str(index), *[str(written.root / k) for k in written.keys]],
                          capture_output=True, text=True, timeout=120)
    assert made.returncode == 0, made.stderr
    ours = ShardIndex(f"file://{tmp_path}/root/b/ds/wids.json", endpoint="")
    assert [s.key for s in ours.shards] == written.keys and len(ours) == written.total()
    assert ident(ours.sample(len(ours) - 1)) == in_order(written)[-1]


@pytest.mark.parametrize("doc, said", [
    ({"__kind__": "wids-shard-index-v2", "wids_version": 1, "shardlist": [{"url": "a.tar", "nsamples": 1}]}, "unsupported"),
    ({"wids_version": 1, "shardlist": [{"url": "../escape.tar", "nsamples": 1}]}, "shardlist[0]"),
    ({"wids_version": 1, "shardlist": [{"url": "s3://other/x.tar", "nsamples": 1}]}, "not under the dataset"),
    ({"wids_version": 1, "shardlist": [{"url": "/etc/passwd", "nsamples": 1}]}, "not under the dataset"),
    ({"wids_version": 1, "shardlist": [{"url": "a.tar"}]}, "nsamples is required"),
    ({"wids_version": 1, "shardlist": [{"url": "a.tar", "nsamples": -1}]}, "nsamples"),
    ({"wids_version": 1, "shardlist": [{"url": "a.tar", "nsamples": 1}, {"url": "a.tar", "nsamples": 1}]}, "twice"),
    ({"wids_version": 1, "shardlist": [], "datasets": [{"source_url": "http://x/y.json"}]}, "sub-datasets"),
    ({"wids_version": 1, "shardlist": "a.tar"}, "must be a list"),
])
def test_hostile_wids_indexes_are_refused_with_the_reason(tmp_path: Path, doc: dict[str, Any], said: str) -> None:
    root = tmp_path / "root" / "b" / "ds"
    root.mkdir(parents=True)
    (root / "bad.json").write_text(json.dumps(doc))
    with pytest.raises(ManifestError, match=said.replace("[", r"\[").replace("]", r"\]")):
        ShardIndex(f"file://{tmp_path}/root/b/ds/bad.json", endpoint="")


def test_index_refuses_a_wids_name_that_is_not_a_file_beside_the_shards(tmp_path: Path) -> None:
    import subprocess

    from tests.support.processes import PYTHON, REPO

    write_shards(tmp_path / "root" / "b" / "ds", shards=1, per_shard=2)
    for name in ("sub/x.json", "x.txt", "manifest.json"):
        out = subprocess.run([PYTHON, "-m", "sidecar.cli", "index", f"file://{tmp_path}/root/b/ds/", "--wids", name],
                             capture_output=True, text=True, timeout=60, env={**__import__("os").environ, "PYTHONPATH": str(REPO)})
        assert out.returncode != 0 and "--wids takes a file name" in out.stderr, (name, out.stderr)
