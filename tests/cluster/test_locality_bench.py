"""``python -m bench.locality_bench``: its sample check sees what the loader reads (no root needed),
and ``--quick`` runs end to end on the test bed (root): one job on four nodes reads the dataset
from the origin once in epoch 1 whatever the caches, per-node caches read most of it again in
epoch 2, the cluster cache does not, and cache-aware leases keep most reads on the reader's node."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bench.clusterbed import ClusterUnavailable, check_available
from bench.locality_bench import PREFIX, _check_epoch, _sample_digest, build_dataset
from tests.support.processes import REPO


@pytest.mark.timeout(60)
def test_every_sample_the_loader_reads_has_the_generators_digest(tmp_path: Path) -> None:
    """The trainers' check is not vacuous: a real ShardLoader over the dataset's files yields
    every generated sample once, each matching its digest, and a changed byte does not match."""
    from loader import ShardLoader

    dataset = build_dataset(3 << 20, 1 << 20)
    root = tmp_path / "bucket"
    for key, data in dataset.objects.items():
        path = root / key
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    seen = []
    with ShardLoader(f"file://{root}/{PREFIX}", shuffle=False) as loader:
        assert len(loader.shards) == len(dataset.shards) >= 3  # from the manifest, checksums and all
        for sample in loader:
            assert _sample_digest(sample["jpg"], sample["cls"]) == dataset.digests[sample["__key__"]]
            seen.append(sample["__key__"])
    assert sorted(seen) == sorted(dataset.digests)
    jpg = bytearray(sample["jpg"])
    jpg[0] ^= 1
    assert _sample_digest(bytes(jpg), sample["cls"]) != dataset.digests[sample["__key__"]]


def test_an_epoch_missing_or_repeating_a_sample_fails_the_run() -> None:
    dataset = build_dataset(1 << 20, 1 << 20)
    keys = sorted(dataset.digests)
    rows: dict[str, dict[str, Any]] = {"a": {"keys": keys[:2], "bad": 0, "bad_keys": []},
                                       "b": {"keys": keys[2:], "bad": 0, "bad_keys": []}}
    assert _check_epoch(rows, dataset, "m", 0)["samples"] == len(keys)
    rows["b"]["keys"] = keys[1:]  # one sample twice
    with pytest.raises(RuntimeError, match="'duplicated': 1"):
        _check_epoch(rows, dataset, "m", 0)
    rows["b"]["keys"] = keys[3:]  # one sample never delivered
    with pytest.raises(RuntimeError, match="'missing': 1"):
        _check_epoch(rows, dataset, "m", 0)
    rows["b"] = {"keys": keys[2:], "bad": 1, "bad_keys": [keys[2]]}  # wrong bytes
    with pytest.raises(RuntimeError, match="'bad_bytes': 1"):
        _check_epoch(rows, dataset, "m", 0)


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_the_quick_locality_bench_runs_one_job_on_four_nodes(tmp_path: Path) -> None:
    try:
        check_available()
    except ClusterUnavailable as exc:
        pytest.skip(str(exc))
    out = tmp_path / "locality.json"
    done = subprocess.run([sys.executable, "-m", "bench.locality_bench", "--quick", "--out", str(out),
                           "--workdir", str(tmp_path / "work")], cwd=REPO, capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads(out.read_text())
    assert "| caches | epoch |" in done.stdout  # the README table
    assert out.with_suffix(".png").stat().st_size > 0
    setup, modes = results["setup"], results["modes"]
    assert results["machine"]["cpu_count"] and setup["nodes"] == 4 and setup["trainers"] == 8
    assert setup["dataset_over_cache"] >= 1.9 and setup["dataset_over_cluster_cache"] <= 0.55
    ran = {name: mode["epochs"] for name, mode in modes.items() if "skipped" not in mode}
    assert {"per_node", "cluster"} <= set(ran)
    for name, epochs in ran.items():
        assert len(epochs) == 2
        for ep in epochs:  # every sample's bytes checked, each delivered once per epoch
            check = ep["check"]
            assert check["samples"] == check["expected"] == setup["samples"], (name, check)
            assert check["bad_bytes"] == check["missing"] == check["duplicated"] == 0, (name, check)
            assert 0 <= ep["stall"]["fraction"] <= 1 and ep["seconds"] > 0
    islands, one = ran["per_node"], ran["cluster"]
    # one job: each shard is read once per epoch in all, so epoch 1 reads the dataset once ...
    assert islands[0]["origin_over_dataset"] == pytest.approx(1.0, abs=0.05)
    assert islands[0]["peer_read_bytes"] == 0
    # ... and per-node caches read most of it again in epoch 2 (its next reader is mostly elsewhere)
    assert islands[1]["origin_over_dataset"] >= 0.4
    assert one[0]["origin_over_dataset"] <= 1.05
    assert one[1]["origin_over_dataset"] <= 0.05
    assert one[0]["peer_read_bytes"] == one[0]["peer_served_bytes"] > 0
    assert islands[0]["locality"] is None and one[0]["locality"] is None  # window 0: the plain shuffle
    if "cluster_aware" in ran:
        aware = ran["cluster_aware"]
        learned = modes["cluster_aware"]["master_ring"]["learned"]
        assert len(learned["members"]) == learned["nodes"] == 4
        for plain_ep, aware_ep in zip(one, aware, strict=True):
            assert aware_ep["locality"]["window"] == 16
            assert aware_ep["locality"]["local_share"] > 0.5
            assert aware_ep["peer_read_bytes"] <= 0.5 * plain_ep["peer_read_bytes"]
            assert aware_ep["locality"]["order"]["spearman"] > 0.5  # still a shuffle, a little moved
        assert aware[1]["origin_over_dataset"] <= 0.05
    if "per_node_aware" in ran:
        # the "cached on" preference alone: epoch 2 goes mostly where epoch 1 left each shard
        assert ran["per_node_aware"][1]["origin_over_dataset"] < islands[1]["origin_over_dataset"]
