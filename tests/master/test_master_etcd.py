"""High availability with a real etcd: one leader, standbys that point clients at it, takeover
within seconds of the leader's kill -9 while trainers keep going, and state that survives."""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import pytest

from loader.master.client import MasterClient
from tests.support.masters import EtcdServer, MasterProcess, Trainers, http, job_spec
from tests.support.waits import http_ok, wait_until

pytestmark = pytest.mark.slow


def etcd_state(etcd: EtcdServer) -> str:
    return f"etcd://127.0.0.1:{etcd.port}/ha-{uuid.uuid4().hex[:8]}"


def leader_and_standby(etcd: EtcdServer, tmp_path: Path, master_procs: list[MasterProcess],
                       *args: str) -> tuple[MasterProcess, MasterProcess]:
    """Two masters on one fresh etcd prefix: ``m1`` started first (the leader), then ``m2``."""
    state = etcd_state(etcd)
    m1 = MasterProcess(tmp_path, state, *args, name="m1")
    m2 = MasterProcess(tmp_path, state, *args, name="m2")
    master_procs.extend([m1, m2])
    m1.start()
    m2.start(wait="health")
    return m1, m2


def wait_completions(trainers: Trainers, more: int, timeout: float = 20) -> None:
    target = len(trainers.completions) + more
    wait_until(lambda: len(trainers.completions) >= target or not any(t.is_alive() for t in trainers.threads),
               timeout=timeout, what=f"{more} more completions")


def test_standby_takes_over_while_trainers_keep_going(etcd_server: EtcdServer, tmp_path: Path,
                                                       master_procs: list[MasterProcess]) -> None:
    m1, m2 = leader_and_standby(etcd_server, tmp_path, master_procs, "--election-ttl", "2", "--snapshot-events", "30")
    # Healthy is not yet "has read the election key": under load the first answer may come first.
    wait_until(lambda: http("GET", m2.url + "/v1/leader")[1].get("leader") == m1.url, timeout=30,
               what="the standby to see the leader")

    # The standby refuses to serve and names the leader.
    status, body = http("GET", m2.url + "/v1/jobs")
    assert (status, body["error"], body["leader"]) == (503, "NotLeader", m1.url)
    assert http("GET", m2.url + "/readyz")[0] == 503
    assert http("GET", m2.url + "/v1/leader")[1] == {"leader": m1.url, "role": "standby", "self": m2.url}

    n, epochs = 60, 2
    job = "ha-" + uuid.uuid4().hex[:6]
    urls = f"{m2.url},{m1.url}"  # the standby first: clients must follow its NotLeader hint
    MasterClient(urls).create_job(job_spec(job, n, epochs=epochs, lease_ttl_s=2))
    trainers = Trainers(urls, job, 4, abandon_every=9, work_s=0.01).start()
    try:
        wait_completions(trainers, 15)
        killed = time.monotonic()
        m1.kill9()
        wait_until(lambda: http_ok(m2.url + "/readyz"), timeout=20, what="the standby to take over")
        takeover_s = time.monotonic() - killed
        assert takeover_s < 8, f"takeover took {takeover_s:.1f}s"
        wait_completions(trainers, 15)

        # The old leader comes back as a standby; then the new leader dies too.
        m1.start(wait="health")
        wait_until(lambda: http("GET", m1.url + "/v1/leader")[1]["leader"] == m2.url, timeout=10, what="m1 to see m2 lead")
        m2.kill9()
        wait_until(lambda: http_ok(m1.url + "/readyz"), timeout=20, what="m1 to take over again")
    finally:
        trainers.join(120)
    trainers.check_exactly_once(n, epochs)
    status = MasterClient(urls).status(job)
    assert status["finished"] and status["totals"]["completed"] == n * epochs


def test_graceful_stop_hands_over_at_once(etcd_server: EtcdServer, tmp_path: Path,
                                          master_procs: list[MasterProcess]) -> None:
    m1, m2 = leader_and_standby(etcd_server, tmp_path, master_procs, "--election-ttl", "10")
    job = "gs-" + uuid.uuid4().hex[:6]
    client = MasterClient(f"{m1.url},{m2.url}")
    client.create_job(job_spec(job, 4))
    lease = client.lease(job, "t1", "n1", 1)["leases"][0]
    stopped = time.monotonic()
    m1.stop()  # SIGTERM: revokes the leadership lease instead of letting it run out (10 s)
    wait_until(lambda: http_ok(m2.url + "/readyz"), timeout=8, what="m2 to take over")
    assert time.monotonic() - stopped < 8
    client.complete(job, lease["lease"], "t1")
    assert client.status(job)["shards"]["done"] == 1


def test_large_job_survives_in_chunks(etcd_server: EtcdServer, tmp_path: Path, master_procs: list[MasterProcess]) -> None:
    """A spec far over etcd's request limit (1.5 MiB) is logged in chunks and replayed after kill -9."""
    master = MasterProcess(tmp_path, etcd_state(etcd_server), "--election-ttl", "2")
    master_procs.append(master)
    master.start()
    client = MasterClient(master.url, retry_deadline_s=30)
    job = "big-" + uuid.uuid4().hex[:6]
    spec = job_spec(job, 30_000)
    client.create_job(spec)
    leases = client.lease(job, "t1", "n1", 3)["leases"]
    master.kill9()
    master.start()
    assert client.create_job(spec)["shards"]["leased"] == 3  # same spec: joins the restored job
    for lease in leases:
        client.complete(job, lease["lease"], "t1")
    for _ in range(3):
        client.renew(job, client.lease(job, "t2", "n1", 1)["leases"][0]["lease"], "t2", 1)
    master.kill9()
    master.start()
    status = client.status(job)
    assert status["shards"]["done"] == 3 and status["shards"]["leased"] == 3


def test_a_checkpoint_mark_survives_a_failover_before_the_resume(etcd_server: EtcdServer, tmp_path: Path,
                                                                 master_procs: list[MasterProcess]) -> None:
    """A trainer checkpoints (a mark at its clock) through the leader, reads on, and the leader is
    killed; the new leader rewinds the job to the mark: what was delivered after it comes back."""
    m1, m2 = leader_and_standby(etcd_server, tmp_path, master_procs, "--election-ttl", "2")
    job = "ck-" + uuid.uuid4().hex[:6]
    client = MasterClient(f"{m1.url},{m2.url}", retry_deadline_s=30)
    client.create_job(job_spec(job, 3))
    first, second = client.lease(job, "t1", "n1", 2)["leases"]
    client.renew(job, first["lease"], "t1", 2, clock=2)
    mark = client.mark(job, "t1", 3, [(first["lease"], 3)])
    client.renew(job, first["lease"], "t1", 5, clock=6)  # after the checkpoint
    client.complete(job, second["lease"], "t1", clock=9)
    assert client.status(job)["shards"]["done"] == 1
    m1.kill9()
    wait_until(lambda: http_ok(m2.url + "/readyz"), timeout=20, what="the standby to take over")
    answer = client.rewind(job, "t2", mark.mark, mark.clock, mark.job_created)
    assert (answer.undone, answer.revoked) == (2, 1), answer  # both shards' later deliveries; the held lease
    status = client.status(job)
    assert status["shards"]["done"] == 0 and status["checkpoints"]["rewinds"] == 1
    resumed = {g["key"]: g["offset"] for g in client.lease(job, "t2", "n1", 3)["leases"]}
    assert (resumed[first["key"]], resumed[second["key"]]) == (3, 0), resumed
