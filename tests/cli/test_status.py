"""``shardcache status`` against a real daemon and a real master (SQLite state)."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.cli import run_cli
from tests.support.daemons import Daemon
from tests.support.datasets import Dataset
from tests.support.masters import MasterProcess
from tests.support.processes import free_port


class Master(MasterProcess):
    def __init__(self, tmp: Path) -> None:
        super().__init__(tmp, f"sqlite://{tmp}/master.db", advertise=False)

    def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        request = urllib.request.Request(self.url + path, data=json.dumps(body).encode(), method="POST",
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=10) as resp:
            return json.loads(resp.read())


@pytest.fixture
def master(tmp_path: Path) -> Iterator[Master]:
    m = Master(tmp_path).start()
    try:
        yield m
    finally:
        m.stop()


def test_status_of_daemon_and_master(master: Master, file_dataset: Dataset, daemon_factory: Any, tmp_path: Path) -> None:
    daemon: Daemon = daemon_factory(f"file://{tmp_path}/root")
    assert run_cli(["warmup", file_dataset.url, "--daemon", daemon.url]).returncode == 0
    # Reads through the daemon: one miss... then hits.
    for _ in range(3):
        with urllib.request.urlopen(f"{daemon.url}/bkt/train/train-000000.tar", timeout=10) as resp:
            resp.read()
    shards = [{"key": k, "size": len(v), "samples": 4} for k, v in sorted(file_dataset.shards.items())]
    master.post("/v1/jobs", {"name": "resnet", "dataset": file_dataset.url, "shards": shards, "epochs": 2,
                             "max_failures": 1})
    lease = master.post("/v1/jobs/resnet/leases", {"trainer": "t1", "node": "n1", "count": 2})["leases"]
    master.post(f"/v1/jobs/resnet/leases/{lease[0]['lease']}/complete", {"trainer": "t1"})
    master.post(f"/v1/jobs/resnet/leases/{lease[1]['lease']}/fail", {"trainer": "t1", "error": "bad tar header"})

    result = run_cli(["status", "--daemon", daemon.unix, "--master", master.url, "--interval", "0.2"])
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert daemon.unix in out and "node" in out and "100.0%" in out  # every lookup was a hit
    assert file_dataset.url.rstrip("/").rsplit("/", 1)[1] in out  # the warm-up's id, listed
    assert "leader" in out
    row = next(line for line in out.splitlines() if line.startswith("resnet "))
    assert row.split()[:6] == ["resnet", "1/2", "1/5", "0", "3", "1"]
    assert f"FAILED shard resnet/{lease[1]['key']}" in out and "bad tar header" in out

    as_json = run_cli(["status", "--daemon", daemon.url, "--interval", "0", "--json"],
                      env={"SHARDCACHE_MASTER": master.url})
    assert as_json.returncode == 0, as_json.stderr
    doc = json.loads(as_json.stdout)
    (report,) = doc["daemons"]
    assert report["stats"]["requests"]["hits"] == 3 and report["stats"]["cache"]["items"] == 5
    assert report["warmups"][0]["state"] == "done"
    (job,) = doc["master"]["jobs"]
    assert job["name"] == "resnet" and job["shards"]["failed"] == 1
    assert job["failed_shards"][0]["key"] == lease[1]["key"]


@pytest.mark.slow
def test_status_unreachable_and_unknown_job(master: Master) -> None:
    down = f"http://127.0.0.1:{free_port()}"
    result = run_cli(["status", "--daemon", down, "--interval", "0"])
    assert result.returncode == 69
    assert "unreachable" in result.stdout and "connection refused" in result.stdout
    assert "Traceback" not in result.stderr
    only_master = run_cli(["status", "--master", master.url])
    assert only_master.returncode == 0 and "DAEMON" not in only_master.stdout and "no jobs" in only_master.stdout
    missing = run_cli(["status", "--master", master.url, "--job", "nope"])
    assert missing.returncode == 1 and "no job 'nope'" in missing.stdout
    master_down = run_cli(["status", "--master", down, "--json"])
    assert master_down.returncode == 69
    assert json.loads(master_down.stdout)["master"]["masters"][0]["error"]
    bad = run_cli(["status", "--master", "ftp://x"])
    assert bad.returncode == 2 and "invalid master address" in bad.stderr


@pytest.mark.slow
def test_status_shows_the_tenant_quota(file_dataset: Dataset, daemon_factory: Any, tmp_path: Path) -> None:
    daemon: Daemon = daemon_factory(f"file://{tmp_path}/root", extra=("--tenant-quota", "5GiB"))
    result = run_cli(["status", "--daemon", daemon.url, "--interval", "0"])
    assert result.returncode == 0, result.stdout + result.stderr
    line = next(line for line in result.stdout.splitlines() if "tenants:" in line)
    assert line == (f"{daemon.url}: tenants: 0 with entries, quota 5.0 GiB each, 0 over it; "
                    "quota evictions 0 (0 B), not cached for quota 0")
    as_json = run_cli(["status", "--daemon", daemon.url, "--interval", "0", "--json"])
    (report,) = json.loads(as_json.stdout)["daemons"]
    assert report["stats"]["cache"]["tenants"] == {
        "quota_bytes": 5 * 1024**3, "count": 0, "over_quota": 0,
        "quota_evictions": 0, "quota_evicted_bytes": 0, "rejected_quota": 0,
    }
    # Without a quota and with no tenants, the table is all there is (output as before tenants).
    plain: Daemon = daemon_factory(f"file://{tmp_path}/root")
    result = run_cli(["status", "--daemon", plain.url, "--interval", "0"])
    assert result.returncode == 0 and "tenant" not in result.stdout


def test_status_line_for_the_callers_own_tenant() -> None:
    # The shape of a daemon's /_shardcache/stats answer to an authenticated caller: the totals
    # under cache.tenants, the caller's own use at the top level.
    from sidecar.cli.commands.status import tenant_lines

    stats = {
        "cache": {"tenants": {"quota_bytes": 5 * 1024**3, "count": 3, "over_quota": 1, "quota_evictions": 12,
                              "quota_evicted_bytes": 3 * 1024**3, "rejected_quota": 2}},
        "tenant": {"tenant": "arn:aws:iam::123456789012:user/alice", "used_bytes": int(1.2 * 1024**3),
                   "reserved_bytes": 64 * 1024**2, "items": 12, "quota_bytes": 5 * 1024**3},
    }
    assert tenant_lines(stats) == [
        "tenants: 3 with entries, quota 5.0 GiB each, 1 over it; quota evictions 12 (3.0 GiB), not cached for quota 2",
        "tenant arn:aws:iam::123456789012:user/alice: 1.2 GiB (+64.0 MiB filling) of 5.0 GiB quota, 12 items",
    ]
    stats["tenant"] = {"tenant": "key:AKIA\x1b[2J", "used_bytes": 0, "reserved_bytes": 0, "items": 0,
                       "quota_bytes": None}
    assert tenant_lines({"tenant": stats["tenant"]}) == ["tenant key:AKIA?[2J: 0 B, no quota, 0 items"]
    assert tenant_lines({"cache": {"tenants": {"quota_bytes": None, "count": 2}}}) == ["tenants: 2 with entries, no quota"]
    assert tenant_lines({"cache": {"tenants": {"quota_bytes": None, "count": 0}}}) == []


def _wait(seconds: float, elapsed_s: float, bucket: int, steps: int) -> dict[str, Any]:
    from wire.stall import WAIT_BUCKETS_S, encode_wait

    counts = [steps if i == bucket else 0 for i in range(len(WAIT_BUCKETS_S))]
    return encode_wait(seconds, steps, elapsed_s, counts)


def _report_wait(master: Master, job: str, body: dict[str, Any]) -> None:
    request = urllib.request.Request(f"{master.url}/v1/jobs/{job}/wait", data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as resp:
        assert resp.status == 204


@pytest.mark.slow
def test_status_shows_the_trainers_wait_and_warns_above_the_threshold(master: Master) -> None:
    shards = [{"key": f"s-{i}.tar", "size": 10, "samples": 4} for i in range(4)]
    master.post("/v1/jobs", {"name": "slow", "dataset": "s3://b/p/", "shards": shards})
    master.post("/v1/jobs", {"name": "fast", "dataset": "s3://b/p/", "shards": shards})
    (held,) = master.post("/v1/jobs/slow/leases", {"trainer": "t1", "node": "n1", "count": 1})["leases"]
    # slow: t1 waited 4.1 s of 10 (41%), t2 0.5 s of 10 (5%): 23% of the job's 20 s.
    master.post(f"/v1/jobs/slow/leases/{held['lease']}/renew", {"trainer": "t1", "offset": 1, "wait": _wait(4.1, 10, 6, 30)})
    _report_wait(master, "slow", {"trainer": "t2", "wait": _wait(0.5, 10, 3, 200)})
    # fast: 5% waited, under the default 10%.
    _report_wait(master, "fast", {"trainer": "t3", "wait": _wait(0.5, 10, 0, 900)})

    result = run_cli(["status", "--master", master.url])
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert next(line for line in lines if line.startswith("slow ")).split()[-2:] == ["23%", "running"]
    assert next(line for line in lines if line.startswith("fast ")).split()[-2:] == ["5%", "running"]
    header = next(line for line in lines if line.startswith("JOB ") and "NODE" in line)
    assert header.split() == ["JOB", "TRAINER", "NODE", "LEASES", "WAIT", "60S", "WAITED", "P50", "P99"]
    rows = [line.split() for line in lines if line.startswith(("slow ", "fast ")) and len(line.split()) == 8]
    assert rows == [["fast", "t3", "-", "0", "5%", "0.5s", "1ms", "1ms"],  # jobs by name, trainers by wait
                    ["slow", "t1", "n1", "1", "41%", "4.1s", "1s", "1s"],
                    ["slow", "t2", "-", "0", "5%", "0.5s", "50ms", "50ms"]]
    warnings = [line for line in lines if line.startswith("WARNING")]
    assert len(warnings) == 1, result.stdout
    assert warnings[0].startswith("WARNING job slow: trainers waited 23% of the last 60 s for data (t1 41%, t2 5%): ")
    assert "warmup" in warnings[0] and "num_workers" in warnings[0]

    # The threshold moves: above 4% the fast job is warned about too; above 50%, neither.
    low = run_cli(["status", "--master", master.url, "--warn-wait", "4%"])
    assert sum(line.startswith("WARNING job") for line in low.stdout.splitlines()) == 2, low.stdout
    high = run_cli(["status", "--master", master.url, "--warn-wait", "50"])
    assert high.returncode == 0 and "WARNING" not in high.stdout
    bad = run_cli(["status", "--master", master.url, "--warn-wait", "lots"])
    assert bad.returncode == 2 and "--warn-wait" in bad.stderr

    # --json passes the master's fields through, with the warnings it would print.
    doc = json.loads(run_cli(["status", "--master", master.url, "--job", "slow", "--json"]).stdout)["master"]
    (job,) = doc["jobs"]
    assert job["wait"] == {"fraction_60s": 0.23, "trainers_waiting": 1}
    t1 = next(t for t in job["trainers"] if t["trainer"] == "t1")
    assert t1["wait"]["fraction_60s"] == 0.41 and t1["wait"]["steps"] == 30 and t1["wait"]["p99_s"] == 1.0
    assert t1["wait"]["epochs"] == {"0": {"seconds": 4.1, "steps": 30, "fraction": 0.41}}
    assert len(doc["wait_warnings"]) == 1 and doc["wait_warnings"][0].startswith("WARNING job slow")


def test_status_shows_a_jobs_checkpoints(master: Master) -> None:
    shards = [{"key": f"s-{i}.tar", "size": 10, "samples": 4} for i in range(3)]
    master.post("/v1/jobs", {"name": "ck", "dataset": "s3://b/p/", "shards": shards})
    master.post("/v1/jobs", {"name": "plain", "dataset": "s3://b/p/", "shards": shards})
    (held,) = master.post("/v1/jobs/ck/leases", {"trainer": "t1", "node": "n1", "count": 1})["leases"]
    mark = master.post("/v1/jobs/ck/marks", {"trainer": "t1", "clock": 3, "positions": [[held["lease"], 3]]})
    master.post("/v1/jobs/ck/marks", {"trainer": "t2", "clock": 3, "positions": []})
    master.post("/v1/jobs/ck/rewind", {"trainer": "t3", "mark": mark["mark"], "clock": 3})
    result = run_cli(["status", "--master", master.url])
    assert result.returncode == 0, result.stdout + result.stderr
    lines = [line for line in result.stdout.splitlines() if "checkpoints:" in line]
    assert lines == [f"ck: checkpoints: 1 kept, last mark {mark['mark']} at clock 3 (epoch 0, 2 trainer(s) reported), "
                     "1 rewind(s)"], result.stdout
    doc = json.loads(run_cli(["status", "--master", master.url, "--job", "ck", "--json"]).stdout)["master"]
    assert doc["jobs"][0]["checkpoints"]["last"]["trainers"] == 2
