"""``python -m bench.auth_bench --quick`` end to end: a moto origin, a plain, an ``--auth sigv4``
and a control node daemon with a sidecar each, real processes; the result file has every variant,
every figure and ratio positive, and the cold path's one origin replay per object. Speed is measured, never
asserted: the machine is shared."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.common import REPO

pytestmark = pytest.mark.slow


@pytest.mark.timeout(180)
def test_quick_auth_bench_writes_both_variants_and_sane_ratios(tmp_path: Path) -> None:
    results = tmp_path / "results"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.auth_bench", "--quick", "--results-dir", str(results), "--workdir", str(tmp_path / "work")],
        cwd=REPO, capture_output=True, text=True, timeout=170,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((results / "auth-quick.json").read_text())
    assert result["benchmark"] == "auth" and result["config"]["quick"] is True
    assert result["machine"]["cpu_count"] and result["config"]["auth_decision_ttl_s"] == 120
    for kind, figure in (("small", "requests_per_s"), ("large", "mb_s")):
        summary = result[kind]
        # plain and auth, and control: a second plain node, the run's own noise floor
        assert set(summary["variants"]) == {"plain", "auth", "control"}
        for variant, row in summary["variants"].items():
            assert len(row["rounds_s"]) == summary["rounds"] == 3, variant
            assert row[figure] > 0 and 0 < row["p50_ms"] <= row["p99_ms"], (kind, variant, row)
        cpu_key = "cpu_us_per_request" if kind == "small" else "cpu_s_per_gb"
        for name in ("auth/plain", "control/plain"):
            ratios = summary["ratios"][name]
            for key in (figure, "p50_ms", "p99_ms", "paired_median"):
                assert ratios[key] is not None and ratios[key] > 0, (kind, name, key, ratios)
            assert set(ratios[cpu_key]) >= {"sidecar", "daemon"}
            assert all(value is not None and value > 0 for value in ratios[cpu_key].values()), (kind, name, ratios)
        # A first read under --auth costs one origin HEAD per object (plus one identity replay
        # for the sidecar's session, opened by the first kind read); plain daemons replay nothing.
        cold = result["cold"][kind]
        assert cold["auth"]["replays_per_object"] == 1.0, cold
        assert "replays" not in cold["plain"] and cold["auth"]["states"].get("miss", 0) > 0
    assert result["cold"]["small"]["auth"]["sessions"] == 1 and result["cold"]["large"]["auth"]["sessions"] == 0
    # Warm reads cost no origin request while the decisions are fresh, and were all answered by one.
    assert result["measured_replays"] == 0 and result["auth_counts"]["cached"] > 0
    assert 0 < result["sidecar_sign_us"] < 10_000
    assert "auth/plain" in proc.stdout and "control/plain" in proc.stdout
