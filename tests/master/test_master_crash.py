"""kill -9 of a real master process mid-epoch, restarted on the same state (SQLite and etcd):
no acknowledged completion is lost, no shard is completed twice or double-issued, leases held
across the crash stay with their holders and offsets resume where they were reported."""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import pytest

from loader.master.client import MasterClient
from tests.support.masters import EtcdServer, MasterProcess, Trainers, http, job_spec
from tests.support.waits import wait_until

pytestmark = pytest.mark.slow


def state_url(kind: str, tmp_path: Path, etcd: EtcdServer | None) -> str:
    if kind == "sqlite":
        return f"sqlite://{tmp_path}/state/master.db"
    assert etcd is not None
    return f"etcd://127.0.0.1:{etcd.port}/t-{uuid.uuid4().hex[:8]}"


@pytest.fixture(params=["sqlite", "etcd"])
def state(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    etcd = request.getfixturevalue("etcd_server") if request.param == "etcd" else None
    return state_url(request.param, tmp_path, etcd)


def test_kill9_mid_epoch_loses_nothing_and_doubles_nothing(state: str, tmp_path: Path, master_procs: list[MasterProcess]) -> None:
    master = MasterProcess(tmp_path, state, "--election-ttl", "2", "--snapshot-events", "20")
    master_procs.append(master)
    master.start()
    n, epochs = 40, 2
    job = "crash-" + uuid.uuid4().hex[:6]
    MasterClient(master.url).create_job(job_spec(job, n, epochs=epochs, lease_ttl_s=2))
    trainers = Trainers(master.url, job, 4, abandon_every=7, work_s=0.005).start()
    try:
        for _ in range(3):
            before = len(trainers.completions)
            wait_until(lambda b=before: len(trainers.completions) >= b + 12, timeout=10, interval=0.02,
                       what="12 more completions")
            master.kill9()
            time.sleep(0.3)  # the master down a while: trainers' calls fail and are retried
            master.start()
    finally:
        trainers.join(120)
    trainers.check_exactly_once(n, epochs)
    status = MasterClient(master.url).status(job)
    assert status["finished"] and status["epoch"] == epochs
    assert status["shards"]["done"] == n
    assert status["totals"]["completed"] == n * epochs  # counts survive the crashes too


def test_leases_survive_a_crash_and_are_not_double_issued(state: str, tmp_path: Path, master_procs: list[MasterProcess]) -> None:
    master = MasterProcess(tmp_path, state, "--election-ttl", "2", "--snapshot-events", "20")
    master_procs.append(master)
    master.start()
    job = "hold-" + uuid.uuid4().hex[:6]
    client = MasterClient(master.url, retry_deadline_s=30)
    client.create_job(job_spec(job, 6, lease_ttl_s=3))
    a = client.lease(job, "t1", "n1", 1)["leases"][0]
    b = client.lease(job, "t2", "n1", 1)["leases"][0]
    assert client.renew(job, b["lease"], "t2", 7) == 3.0
    c = client.lease(job, "t3", "n1", 1)["leases"][0]
    client.complete(job, c["lease"], "t3")

    master.kill9()
    master.start()

    # Nothing held before the crash is handed out again, and the completion is still there.
    rest = client.lease(job, "t4", "n2", 100, epoch=0)
    assert rest["status"] == "ok"
    handed = {g["shard"] for g in rest["leases"]}
    assert handed == set(range(6)) - {a["shard"], b["shard"], c["shard"]}
    status = client.status(job)
    assert status["shards"] == {"total": 6, "todo": 0, "leased": 5, "done": 1, "failed": 0}
    # The holders keep their leases across the restart.
    client.complete(job, a["lease"], "t1")
    # t2 stops renewing: after the TTL its shard is re-issued at the offset it reported.
    deadline = time.monotonic() + 15
    while True:
        answer = client.lease(job, "t5", "n2", 1, epoch=0)
        if answer["status"] == "ok":
            break
        assert time.monotonic() < deadline, answer
        time.sleep(answer["retry_after_s"] or 0.2)
    again = answer["leases"][0]
    assert (again["shard"], again["offset"]) == (b["shard"], 7)
    status_code, body = http("POST", f"{master.url}/v1/jobs/{job}/leases/{b['lease']}/complete", {"trainer": "t2"})
    assert (status_code, body["error"]) == (409, "LeaseLost")

    master.kill9()
    master.start()
    status = client.status(job)
    assert status["shards"]["done"] == 2 and status["totals"]["reissued"] == 1
