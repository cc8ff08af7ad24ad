"""``python -m bench.fill_client_bench --quick`` end to end: moto behind the latency proxy, a real
node daemon, awscrt's S3 client and boto3 fill the same objects; the result file has every path at
every concurrency with a positive throughput, every fill verified against the objects' CRC64NVME
(awscrt's by awscrt itself: ``did_validate_checksum``), and the table beside it. Speed is
measured, never asserted: the machine is shared."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from bench.common import REPO
from bench.fill_client_bench import BASELINE, PATHS

pytestmark = pytest.mark.slow


@pytest.mark.timeout(150)
def test_quick_fill_client_bench_measures_and_verifies_every_path(tmp_path: Path, summary: Callable[[str, str], None]) -> None:
    output = tmp_path / "results" / "fill_client.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.fill_client_bench", "--quick", "--output", str(output), "--workdir", str(tmp_path / "work")],
        cwd=REPO, capture_output=True, text=True, timeout=140,
    )
    table = output.with_suffix(".md")
    if table.exists():
        summary("fill clients, quick run (python -m bench.fill_client_bench --quick; speed is not asserted)", table.read_text())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(output.read_text())
    config = result["config"]
    assert config["quick"] and config["objects"] == 4 and config["object_size"] == 16 << 20
    assert result["machine"]["packages"]["awscrt"]
    rows = {(row["path"], row["concurrency"]): row for row in result["rows"]}
    assert set(rows) == {(path, concurrency) for path in PATHS for concurrency in (1, 4)}
    for (path, concurrency), row in rows.items():
        assert row["mb_s"] > 0 and row["bytes_per_run"] == 4 * (16 << 20), (path, concurrency)
        assert row["cpu_s_per_gb"] > 0, (path, concurrency)
        assert row["filler_process"] == ("daemon" if path == "daemon" else "bench")
        assert row["verified"]["checksum_ok"] and row["verified"]["files_read_back_ok"], (path, concurrency)
        assert row["verified"]["validated_objects"] == 4 and row["verified"]["algorithms"] == ["crc64nvme"], (path, concurrency)
        assert row["mb_s_vs_boto3_get_object"] is not None and row["mb_s_vs_boto3_get_object"] > 0
        if path == BASELINE:
            assert row["mb_s_vs_boto3_get_object"] == 1.0
    for concurrency in (1, 4):
        assert rows[("awscrt", concurrency)]["verified"]["by"] == "awscrt (did_validate_checksum)"
        assert rows[("daemon", concurrency)]["cpu_s_per_gb_by_process"]["daemon"] > 0
    assert table.read_text().count("|") > 8 * len(rows)
