"""``python -m bench.random_bench --quick`` end to end: a moto origin behind the latency proxy, a
real node daemon, and every reader in a process of its own (shardcache one at a time and in
batches, wids, mosaicml-streaming, LitData where it is installed); the result file has both passes
of every reader, each reading the whole order once and fetching the dataset once cold and nothing
warm, and every sample each reader returned equal to the generator's. Speed is measured, never
asserted: the machine is shared."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench import random_bench
from bench.common import REPO

pytestmark = pytest.mark.slow

LITDATA = importlib.util.find_spec("litdata") is not None
# scripts/test.sh installs the bench extra (LitData with it) and says so: there a missing LitData
# fails the test; a developer's partial environment checks the reason it was skipped instead.
PEERS_REQUIRED = os.environ.get("SHARDCACHE_BENCH_PEERS") == "required"


@pytest.mark.timeout(300)
def test_quick_random_bench_reads_every_sample_once_per_pass(tmp_path: Path) -> None:
    pytest.importorskip("wids")
    assert LITDATA or not PEERS_REQUIRED, "litdata not installed (pip install -c constraints.txt -e '.[bench]')"
    results = tmp_path / "results"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.random_bench", "--quick", "--size", "24MiB", "--shard-size", "4MiB",
         "--results-dir", str(results), "--workdir", str(tmp_path / "work")],
        cwd=REPO, capture_output=True, text=True, timeout=280,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((results / "random-quick.json").read_text())
    dataset = result["dataset"]
    readers = {"limit", "shardcache", "shardcache_whole", "shardcache_batched", "shardcache_batched_per_sample",
               "shardcache_zero_copy", "wids", "streaming"}
    if LITDATA:
        readers.add("litdata")
        assert result["skipped"] == {}
        assert result["dataset"]["converted"]["litdata"]["samples"] == dataset["samples"]
        assert result["machine"]["packages"]["litdata"] and result["machine"]["packages"]["obstore"]
    else:
        assert set(result["skipped"]) == {"litdata"} and "litdata is not installed" in result["skipped"]["litdata"]
    assert set(result["readers"]) == readers
    # Read once more after the timed passes, every sample compared with the generator's bytes.
    assert result["verified_samples"] == {reader: dataset["samples"] for reader in readers}
    for reader, passes in result["readers"].items():
        for name, figures in passes.items():
            assert figures["samples"] == dataset["order_samples"] == dataset["samples"], (reader, name)
            assert figures["samples_per_s"] > 0 and figures["payload_bytes"] > 0, (reader, name)
        if reader == "limit":  # local copies: it never reads the origin
            assert passes["cold"]["origin_bytes_per_sample"] == passes["warm"]["origin_bytes_per_sample"] == 0
            continue
        # Cold: the dataset's bytes come from the origin once (wids, streaming and litdata keep
        # whole files, MDS's and LitData's chunks differ a little in size), besides the samples
        # read by range before their shard was in (shardcache's, from member indexes); warm: nothing.
        cold = passes["cold"]["origin_bytes_per_sample"] * dataset["samples"] - passes["cold"]["origin_range_bytes"]
        assert 0.9 * dataset["bytes"] <= cold <= 1.1 * dataset["bytes"], (reader, cold, dataset["bytes"])
        assert passes["warm"]["origin_bytes_per_sample"] == 0, reader
    assert result["ranged_get_s"] > 0 and set(result["targets"]) == {
        "warm_vs_fastest_peer", "cold_first_sample_vs_ranged_get", "origin_bytes_per_epoch_over_dataset"}
    warm = result["targets"]["warm_vs_fastest_peer"]
    assert warm["peer"] in {"wids", "streaming", "litdata"}
    assert warm["copy_limit_ratio"] > 0 and warm["of_copy_limit"] > 0 and warm["zero_copy_ratio"] > 0


@pytest.mark.timeout(120)
def test_a_reader_that_cannot_run_is_skipped_with_its_reason(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # LitData's module as if it were not installed: the run goes on without it, the reason in the
    # results, nothing converted for it.
    monkeypatch.setitem(random_bench.PEER_PACKAGES, "litdata", ("no_such_module_for_litdata", "litdata"))
    results = tmp_path / "results"
    assert random_bench.main(["--quick", "--size", "2MiB", "--shard-size", "1MiB", "--readers", "litdata",
                              "--results-dir", str(results), "--workdir", str(tmp_path / "work")]) == 0
    result = json.loads((results / "random-quick.json").read_text())
    assert result["readers"] == {} and result["verified_samples"] == {} and result["targets"] == {}
    assert result["skipped"] == {"litdata": "litdata is not installed (pip install -c constraints.txt -e '.[bench]')"}
    assert result["dataset"]["converted"] == {} and not (tmp_path / "work" / "litdata-optimize.log").exists()
