"""``python -m bench.random_bench --quick`` end to end: a moto origin behind the latency proxy, a
real node daemon, and every reader in a process of its own (shardcache one at a time and in
batches, wids, mosaicml-streaming); the result file has both passes of every reader, each reading
the whole order once and fetching the dataset once cold and nothing warm. Speed is measured,
never asserted: the machine is shared."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.common import REPO

pytestmark = pytest.mark.slow


@pytest.mark.timeout(300)
def test_quick_random_bench_reads_every_sample_once_per_pass(tmp_path: Path) -> None:
    pytest.importorskip("wids")
    results = tmp_path / "results"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.random_bench", "--quick", "--size", "24MiB", "--shard-size", "4MiB",
         "--results-dir", str(results), "--workdir", str(tmp_path / "work")],
        cwd=REPO, capture_output=True, text=True, timeout=280,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((results / "random-quick.json").read_text())
    dataset = result["dataset"]
    assert set(result["readers"]) == {"shardcache", "shardcache_whole", "shardcache_batched", "shardcache_batched_per_sample",
                                      "shardcache_zero_copy", "wids", "streaming"}
    for reader, passes in result["readers"].items():
        for name, figures in passes.items():
            assert figures["samples"] == dataset["order_samples"] == dataset["samples"], (reader, name)
            assert figures["samples_per_s"] > 0 and figures["payload_bytes"] > 0, (reader, name)
        # Cold: the dataset's bytes come from the origin once (wids and streaming keep whole files,
        # MDS's differ a little in size), besides the samples read by range before their shard was
        # in (shardcache's, from member indexes); warm: nothing.
        cold = passes["cold"]["origin_bytes_per_sample"] * dataset["samples"] - passes["cold"]["origin_range_bytes"]
        assert 0.9 * dataset["bytes"] <= cold <= 1.1 * dataset["bytes"], (reader, cold, dataset["bytes"])
        assert passes["warm"]["origin_bytes_per_sample"] == 0, reader
    assert result["ranged_get_s"] > 0 and set(result["targets"]) == {
        "warm_vs_fastest_peer", "cold_first_sample_vs_ranged_get", "origin_bytes_per_epoch_over_dataset"}
