"""``python -m bench.accelerator_bench --quick`` end to end: every reader runs its emulated
accelerators on real processes (moto, the latency proxy, shardcache daemons, each peer), and the
JSON, the table and the plot come out. Counts and speeds are measured, never asserted: the checks
are about completeness and accounting."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.common import REPO

pytestmark = pytest.mark.slow

__all__: list[str] = []

PEERS = ("s3fs", "webdataset", "streaming", "s3torchconnector", "matplotlib")
MISSING = [name for name in PEERS if importlib.util.find_spec(name) is None]
# As in test_bench_smoke: scripts/test.sh installs the peers and requires them; a developer's
# partial environment skips.
if MISSING and os.environ.get("SHARDCACHE_BENCH_PEERS") != "required":
    pytest.skip(f"benchmark peers not installed: {', '.join(MISSING)} "
                "(pip install -c constraints.txt -e '.[bench]')", allow_module_level=True)


@pytest.mark.timeout(150)
def test_quick_run_reports_an_accelerator_count_for_every_reader(tmp_path: Path) -> None:
    assert not MISSING, f"benchmark peers not installed: {MISSING}"
    out = tmp_path / "results" / "accelerators.json"
    proc = subprocess.run([sys.executable, "-m", "bench.accelerator_bench", "--quick", "--out", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=140)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    from bench.accelerator_bench import READERS

    assert set(result["rows"]) == set(READERS)
    assert "not an MLPerf result" in result["method"]
    assert result["scaling"]["samples_per_s_per_accelerator"] == pytest.approx(40 / 0.0224, rel=1e-3)
    for name, row in result["rows"].items():
        assert "error" not in row, (name, row)
        assert 0 <= row["max_accelerators"] <= 2, name
        for trial in row["trials"]:
            assert "error" not in trial, (name, trial)
            assert len(trial["accelerators"]) == trial["n"]
            # every accelerator stepped, and AU is a fraction (compute / wall)
            assert all(a["steps"] >= 1 and 0.0 < a["au"] <= 1.05 for a in trial["accelerators"]), (name, trial)
            assert trial["passed"] == (trial["min_au"] >= 0.9 and trial["min_steps"] >= 2)
        if row["max_accelerators"]:
            assert row["mb_per_s"] > 0 and row["samples_per_s"] > 0
    # A warm daemon serves one accelerator: a wiring check, far below any machine's limit.
    assert result["rows"]["shardcache_warm"]["max_accelerators"] >= 1
    assert result["machine"]["cpu_count"] >= 1
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "max N" in proc.stdout
