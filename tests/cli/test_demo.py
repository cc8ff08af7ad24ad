"""``shardcache demo`` end to end, and its clean-up when interrupted."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from tests.support.cli import run_cli, start_cli

pytestmark = pytest.mark.slow

SMALL = ["--shards", "8", "--samples-per-shard", "40", "--image-size", "48", "--step-ms", "5", "--lease-ttl", "2"]


def processes_mentioning(text: str) -> list[int]:
    """Live processes whose command line mentions ``text`` (read-only look at /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (entry / "stat").read_text().split(")")[-1].split()[0]
        except OSError:
            continue
        if text in cmdline and state != "Z":
            found.append(int(entry.name))
    return found


def test_demo_runs_the_main_job_and_checks_exactly_once(tmp_path: Path):
    began = time.monotonic()
    result = run_cli(["demo", *SMALL, "--json"], env={"TMPDIR": str(tmp_path)}, timeout=120)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads(result.stdout)
    assert summary["exactly_once"] == {
        "ok": True, "shards_completed_exactly_once": True, "every_sample_delivered": True,
        "missing_samples": [[], []], "samples_delivered_twice": summary["exactly_once"]["samples_delivered_twice"],
    }
    assert summary["master"]["completed"] == summary["master"]["expected_completions"] == 16
    assert summary["master"]["expired"] >= 1  # the killed trainer's leases
    trainers = summary["trainers"]
    assert trainers["t1"]["killed"] and trainers["t4"]["added_later"] and trainers["t4"]["samples"] > 0
    assert [e["epoch"] for e in summary["epochs"]] == [1, 2]
    assert all(e["samples"] >= 320 and e["samples_per_s"] for e in summary["epochs"])
    assert summary["epochs"][1]["hit_rate"] == 1.0  # the second epoch reads only from the cache
    assert summary["cache"]["items"] >= 8  # every shard stayed cached
    assert list(tmp_path.iterdir()) == []  # its temp dir is gone
    assert processes_mentioning(str(tmp_path)) == []
    assert time.monotonic() - began < 120


def test_demo_interrupted_cleans_up(tmp_path: Path):
    proc = start_cli(["demo", *SMALL, "--step-ms", "50"], env={"TMPDIR": str(tmp_path)})
    try:
        assert proc.stdout is not None
        lines = []
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            if "started trainers" in line:
                break
        assert any("started trainers" in line for line in lines), lines
        assert processes_mentioning(str(tmp_path))  # daemon, master, trainers are running
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 130, err
    assert "interrupted" in err and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []
    assert processes_mentioning(str(tmp_path)) == []


def test_demo_usage_error():
    result = run_cli(["demo", "--trainers", "1"])
    assert result.returncode == 2 and "--trainers must be between 2" in result.stderr
