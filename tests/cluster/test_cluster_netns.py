"""One cache per cluster (issue 17) on the multi-host test bed: three ``shardcache serve`` daemons,
one per host (network namespaces on one bridge, the origin on a host of its own behind a cap),
``--peer`` each other with a shared secret. Every node reads the whole dataset through its own
daemon; the bytes are checked against the dataset's xxh3-128 by the reader itself.

What readers on the killed daemon's own host do: they see the connection refused and retry (as
a trainer whose node daemon is restarted by its DaemonSet waits for it); the test restarts the
daemon on the same cache directory and their reads then complete with the right bytes. Trainers
(ShardLoader) on that host ride over a prompt restart on the loader's own retries (5 attempts with
backoff); one whose retries run out fails, and the master gives its lease to a trainer on another
node after the TTL, so exactly-once holds either way."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from bench.clusterbed import DAEMON_PORT, read_results
from tests.support.clusterbed import NODES, Bed, origin_bytes, owned_bytes, run_readers, wait_readers
from tests.support.masters import MasterProcess
from tests.support.processes import PYTHON
from tests.support.waits import wait_until

pytestmark = pytest.mark.slow

CACHE = "256MiB"  # the dataset fits every node: only the ring decides who reads the origin


def _errors(rows: dict[str, list[dict[str, object]]]) -> dict[str, list[dict[str, object]]]:
    return {role: [r for r in rs if "error" in r] for role, rs in rows.items() if any("error" in r for r in rs)}


def _all_read(bed: Bed, rows: dict[str, list[dict[str, object]]], epochs: int = 1) -> None:
    want = {obj["key"] for obj in bed.objects}
    for role, rs in rows.items():
        assert len(rs) == len(want) * epochs, (role, len(rs))
        assert {r["key"] for r in rs} == want, role
        assert all(r.get("ok") for r in rs), (role, [r for r in rs if not r.get("ok")][:3])


@pytest.mark.timeout(90)
def test_without_peers_every_node_reads_the_whole_dataset_from_the_origin(bed: Bed) -> None:
    """The contrast the cluster cache exists for (and a check of the bed): islands."""
    daemons = bed.cluster.start_daemons(CACHE, peers=False)
    rows = wait_readers(run_readers(bed, "islands"), timeout=60)
    assert not _errors(rows)
    _all_read(bed, rows)
    for daemon in daemons:
        daemon.settle()
    assert origin_bytes(daemons) == NODES * bed.dataset_bytes


@pytest.mark.timeout(120)
def test_a_dataset_read_on_every_node_leaves_the_origin_about_once(bed: Bed) -> None:
    daemons = bed.cluster.start_daemons(CACHE)
    bed.cluster.wait_members(NODES)
    peers = daemons[0].peers()
    assert peers["peer_links"] == "authenticated"
    assert sorted(m["url"].rstrip("/") for m in peers["members"]) == sorted(d.url for d in daemons)
    rows = wait_readers(run_readers(bed, "epoch"), timeout=90)
    assert not _errors(rows)
    _all_read(bed, rows)
    for daemon in daemons:
        daemon.settle()
    stats = [d.stats() for d in daemons]
    origin = sum(int(s["origin_read_bytes"]) for s in stats)
    assert origin <= 1.1 * bed.dataset_bytes, (origin, bed.dataset_bytes)
    # Each node read two thirds of the dataset from its peers; what the peers served adds up.
    peer_in = sum(int(s["peer_read_bytes"]) for s in stats)
    peer_out = sum(int(s["served_bytes"]["peer"]) for s in stats)
    assert peer_in >= 0.5 * (NODES - 1) * bed.dataset_bytes, peer_in
    assert peer_out == peer_in
    for s in stats:
        assert s["cluster"]["live"] == NODES and s["cluster"]["peer_links"] == "authenticated", s["cluster"]


@pytest.mark.timeout(150)
def test_a_spread_warmup_then_reads_on_every_node_fetch_nothing_more(bed: Bed) -> None:
    daemons = bed.cluster.start_daemons(CACHE)
    bed.cluster.wait_members(NODES)
    node0 = bed.cluster.hosts[0]
    args = [sys.executable, "-m", "sidecar.cli", "warmup", bed.url, "--spread", "--json", "--timeout", "90",
            "--s3-endpoint", bed.cluster.s3_endpoint]
    for daemon in daemons:
        args += ["--daemon", daemon.url]
    done = node0.run(args, timeout=110)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for daemon in daemons:
        daemon.settle()
    warmed = origin_bytes(daemons)
    assert bed.dataset_bytes <= warmed <= 1.1 * bed.dataset_bytes, (warmed, bed.dataset_bytes)
    rows = wait_readers(run_readers(bed, "after-warmup"), timeout=90)
    assert not _errors(rows)
    _all_read(bed, rows)
    for daemon in daemons:
        daemon.settle()
    assert origin_bytes(daemons) == warmed


@pytest.mark.timeout(180)
def test_kill_9_of_one_daemon_mid_read_costs_only_its_share(bed: Bed) -> None:
    cluster = bed.cluster
    daemons = cluster.start_daemons(CACHE)
    cluster.wait_members(NODES)
    victim = daemons[-1]
    share = owned_bytes(bed, victim.host)
    # Readers on the other nodes get no retry at all: any error they see fails the test. The
    # reader on the victim's own host retries refused connections until the restart.
    outs = run_readers(bed, "kill", delay_s=0.35, retry_for={victim.host.role: 60.0})
    third = len(bed.objects) // 3
    wait_until(lambda: min(len(read_results(out)) for out in outs.values()) >= third, timeout=60,
               what="the readers to read a third of the dataset")
    before_kill = int(victim.stats()["origin_read_bytes"])
    victim.kill()
    read_at_kill = {role: len(read_results(out)) for role, out in outs.items()}
    survivors = [d for d in daemons if d is not victim]
    others = {role: out for role, out in outs.items() if role != victim.host.role}
    rows = wait_readers(others, timeout=90)
    assert not _errors(rows), "readers on the surviving nodes saw errors"
    _all_read(bed, rows)
    assert all(s["cluster"]["live"] == NODES - 1 for s in (d.stats() for d in survivors))
    # As a DaemonSet would: the same daemon, the same cache dir. Its reader then finishes.
    victim.start()
    cluster.wait_members(NODES)
    mine = wait_readers({victim.host.role: outs[victim.host.role]}, timeout=90)
    _all_read(bed, mine)
    assert any(int(str(r["attempts"])) > 1 for r in mine[victim.host.role]), "the victim's reader never waited"
    for daemon in daemons:
        daemon.settle()
    origin = origin_bytes(daemons) + before_kill
    print(f"dataset {bed.dataset_bytes}, victim's share {share}, origin {origin}, read at the kill {read_at_kill}")
    # mid-read: the survivors' readers still had a third of the dataset or more to go
    assert all(n <= 2 * len(bed.objects) // 3 for role, n in read_at_kill.items() if role != victim.host.role)
    # Once for the whole dataset, and once more only for the objects the dead daemon owned (its
    # fills in flight at the kill are the slack of two shards).
    slack = 2 * max(obj["size"] for obj in bed.objects)
    assert origin <= 1.1 * bed.dataset_bytes + share + slack, (origin, bed.dataset_bytes, share)


@pytest.mark.timeout(60)
def test_closing_the_bed_removes_its_namespaces_and_what_runs_in_them(bed: Bed) -> None:
    cluster = bed.cluster
    host = cluster.hosts[0]
    orphan = host.spawn(["sh", "-c", "setsid sleep 60 & wait"], bed.workdir / "orphan.log")
    assert host.run(["ip", "-o", "addr", "show", "eth0"], timeout=10).stdout.count(host.address) == 1
    # a daemon's port is free inside each host: every host is its own network stack
    probe = f"import socket; s = socket.socket(); s.bind(('{host.address}', {DAEMON_PORT})); print('free')"
    assert "free" in host.run([sys.executable, "-c", probe], timeout=10).stdout
    cluster.close()
    assert cluster.gone()
    assert orphan.poll() is not None or orphan.wait(timeout=10) is not None
    with pytest.raises(subprocess.CalledProcessError):
        subprocess.run(["ip", "netns", "exec", host.netns, "true"], check=True, capture_output=True, timeout=10)


@pytest.mark.timeout(150)
def test_kill_9_of_one_daemon_under_trainers_on_every_node_keeps_exactly_once(bed: Bed) -> None:
    """Real trainers (``tests/support/trainer_proc.py``: a dynamic ShardLoader) on every node, each
    through its node's daemon, one lease master; the victim daemon is restarted at once, as its
    DaemonSet would."""
    cluster = bed.cluster
    daemons = cluster.start_daemons(CACHE)
    cluster.wait_members(NODES)
    master = MasterProcess(bed.workdir, f"sqlite://{bed.workdir / 'master.db'}", advertise=False)
    master.listen_on(cluster.control_address, []).start("healthz")
    master_url = master.url
    try:
        epochs, job = 2, "cluster-job"
        outs, trainers = {}, {}
        for host, daemon in zip(cluster.hosts, daemons, strict=True):
            outs[host.role] = bed.workdir / f"trainer-{host.role}.jsonl"
            cfg = {"url": bed.url, "job": job, "master": master_url, "trainer": host.role, "epochs": epochs,
                   "ttl": 3.0, "delay": 0.05, "out": str(outs[host.role]),
                   "log": str(bed.workdir / f"trainer-{host.role}.log"), "seed": 3}
            trainers[host.role] = host.spawn([PYTHON, "-m", "tests.support.trainer_proc", json.dumps(cfg)],
                                             bed.workdir / f"trainer-{host.role}.stdout",
                                             env={"SHARDCACHE_ENDPOINT": daemon.url})
        victim = daemons[-1]
        samples = sum(1 for _ in _samples(bed))
        wait_until(lambda: sum(_delivered(out) for out in outs.values()) >= samples // 3, timeout=60,
                   what="the trainers to deliver a third of epoch 1")
        victim.kill()
        victim.start()
        for role, proc in trainers.items():
            if role != victim.host.role:
                assert proc.wait(timeout=100) == 0, (bed.workdir / f"trainer-{role}.stdout").read_text()[-3000:]
        victim_rc = trainers[victim.host.role].wait(timeout=60)
        status = json.loads(urllib.request.urlopen(f"{master_url}/v1/jobs/{job}", timeout=10).read())
        print(f"victim's trainer exited {victim_rc}; master totals {status['totals']}")
        assert status["finished"], status
        assert status["totals"]["completed"] == len(bed.objects) * epochs  # exactly once per shard and epoch
        delivered = {(row["e"], row["s"], row["k"]) for out in outs.values() for row in read_results(out) if "k" in row}
        for epoch in range(epochs):
            assert {(epoch, s, k) for s, k in _samples(bed)} <= delivered, f"epoch {epoch}: samples missing"
    finally:
        master.stop()


def _samples(bed: Bed) -> list[tuple[str, str]]:
    """(shard name, sample key) of every sample of the dataset, as the trainers name them."""
    import io
    import tarfile

    client = bed.cluster.s3_client()
    out = []
    for obj in bed.objects:
        body = client.get_object(Bucket="cluster-data", Key=obj["key"])["Body"].read()
        with tarfile.open(fileobj=io.BytesIO(body)) as tar:
            keys = sorted({member.name.split(".", 1)[0] for member in tar.getmembers()})
        out += [(obj["key"].rsplit("/", 1)[-1], key) for key in keys]
    return out


def _delivered(out: Path) -> int:
    return sum(1 for row in read_results(out) if "k" in row)
