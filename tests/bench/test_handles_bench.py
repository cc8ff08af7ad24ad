"""``python -m bench.handles_bench --quick`` end to end: a real ``shardcache serve --handles`` node
daemon, the loader reading by handle, by path and over HTTP; the result file has every variant and
mode, every figure and ratio positive. The benchmark itself checks each round read the way it is
labelled (the daemon's served bytes, the descriptors received) and fails otherwise. Speed is
measured, never asserted: the machine is shared."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.common import REPO
from bench.handles_bench import MODES, VARIANTS

pytestmark = pytest.mark.slow


@pytest.mark.timeout(180)
def test_quick_handles_bench_writes_every_variant_and_sane_ratios(tmp_path: Path) -> None:
    results = tmp_path / "results"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.handles_bench", "--quick", "--results-dir", str(results), "--workdir", str(tmp_path / "work")],
        cwd=REPO, capture_output=True, text=True, timeout=170,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((results / "handles-quick.json").read_text())
    assert result["benchmark"] == "handles" and result["config"]["quick"] is True
    assert result["machine"]["cpu_count"] and "--handles unix://" in result["config"]["daemon"]
    dataset = result["dataset"]
    assert dataset["shards"] > 1 and dataset["samples"] > 0
    for mode in MODES:
        summary = result[mode]
        assert summary["rounds"] == 3 and summary["passes_per_round"] >= 1
        assert set(summary["variants"]) == set(VARIANTS)
        for variant in VARIANTS:
            row = summary["variants"][variant]
            assert row["bytes_per_round"] == dataset["bytes"] * summary["passes_per_round"]
            assert row["mb_s"] > 0 and len(row["rounds_mb_s"]) == 3 and set(row["cpu_s_per_gb"]) == {"client", "daemon"}
            if mode == "epoch":
                assert row["samples_per_round"] == dataset["samples"] * summary["passes_per_round"] and row["samples_s"] > 0
            else:
                assert row["open_ms_p50"] > 0
        for name in ("handle/path", "handle/http"):
            ratio = summary["ratios"][name]
            assert ratio["mb_s"] > 0 and ratio["paired"] > 0 and len(ratio["paired_rounds"]) == 3
    served = result["daemon_served_bytes"]
    assert served["short_circuit"] > 0 and served["hit"] > 0
    assert "handle/path" in proc.stdout and "handle/http" in proc.stdout
