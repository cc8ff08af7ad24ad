"""``python -m bench.cluster_bench --quick`` runs end to end on the test bed and writes its result
file: per-node caches read the origin once per node, the cluster cache about once in all."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.clusterbed import ClusterUnavailable, check_available
from tests.support.processes import REPO

pytestmark = pytest.mark.slow


@pytest.mark.timeout(150)
def test_the_quick_cluster_bench_compares_islands_with_one_cache(tmp_path: Path) -> None:
    try:
        check_available()
    except ClusterUnavailable as exc:
        pytest.skip(str(exc))
    out = tmp_path / "cluster.json"
    done = subprocess.run([sys.executable, "-m", "bench.cluster_bench", "--quick", "--out", str(out),
                           "--workdir", str(tmp_path / "work")], cwd=REPO, capture_output=True, text=True, timeout=140)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads(out.read_text())
    assert results["machine"]["cpu_count"] and results["setup"]["nodes"] == 4
    assert results["setup"]["dataset_over_cache"] >= 1.9
    islands, cluster = results["modes"]["per_node"]["epochs"], results["modes"]["cluster"]["epochs"]
    # epoch 1 of four islands: every node misses everything
    assert islands[0]["origin_over_dataset"] == pytest.approx(4.0, abs=0.05)
    assert islands[0]["peer_read_bytes"] == 0
    # one cache: each shard leaves the origin about once, and stays in the cluster for epoch 2
    assert cluster[0]["origin_over_dataset"] <= 1.1
    assert cluster[1]["origin_over_dataset"] <= 0.1
    assert cluster[0]["peer_read_bytes"] == cluster[0]["peer_served_bytes"] > 0
