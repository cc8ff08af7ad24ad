"""``python -m bench.resume_bench --quick`` end to end: a moto origin behind the latency proxy, a
real node daemon, and each resume in a process of its own; the result file has every case before
and after member indexes, each resumed at the shard's last sample, the ``before`` reads having read
the whole shard and the ``after`` ones no more than the shard from the last sample on (a mapping
brings in whole pages, and the archive's end too). Speed
is measured, never asserted: the machine is shared."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.common import REPO

pytestmark = pytest.mark.slow

SLACK = 2 * 4096  # a mapping brings in whole pages: one more at each end


@pytest.mark.timeout(300)
def test_quick_resume_bench_reads_only_the_last_sample_after(tmp_path: Path) -> None:
    results = tmp_path / "results"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.resume_bench", "--quick", "--size", "12MiB", "--results-dir", str(results),
         "--workdir", str(tmp_path / "work")],
        cwd=REPO, capture_output=True, text=True, timeout=280,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((results / "resume-quick.json").read_text())
    shard = result["shard"]
    assert set(result["cases"]) == {"http_cold", "http_warm", "short_circuit_warm", "s3"}
    assert result["ranged_get_s"] > 0
    for case, figures in result["cases"].items():
        before, after = figures["before"], figures["after"]
        for variant in (before, after):
            assert variant["sample_key"] == shard["last_key"] and variant["first_sample_s"] > 0, case
        if before["bytes_read"] is None:  # a mapped read where the page cache could not be emptied
            assert case == "short_circuit_warm" and after["bytes_read"] is None
            continue
        # Before: the whole shard, read from its first byte. After: the last sample only.
        assert before["bytes_read"] >= shard["bytes"] - SLACK, case
        assert shard["last_bytes"] <= after["bytes_read"] <= shard["bytes"] - shard["last_start"] + SLACK, case
    # Cold: before, the daemon's fill of the whole shard answers the read; after, the rest of the
    # shard from the last sample is one ranged read of the origin (the fill goes on behind it).
    assert result["cases"]["http_cold"]["before"]["origin_read_bytes"] >= shard["bytes"]
    cold_after = result["cases"]["http_cold"]["after"]["origin_read_bytes"]
    assert shard["last_bytes"] <= cold_after <= shard["index_bytes"] + 2 * shard["bytes"]
    for variant in ("before", "after"):
        # Warm: nothing of the shard from the origin.
        assert result["cases"]["http_warm"][variant]["origin_read_bytes"] < shard["last_bytes"]
        assert result["cases"]["s3"][variant]["daemon_served_bytes"] == 0
    # Over HTTP the daemon sent the whole shard before; after, the member index and the shard from
    # the last sample on (and the manifest, both times).
    assert result["cases"]["http_warm"]["before"]["daemon_served_bytes"] >= shard["bytes"]
    assert result["cases"]["http_warm"]["after"]["daemon_served_bytes"] <= (
        shard["index_bytes"] + shard["bytes"] - shard["last_start"] + 4096)
