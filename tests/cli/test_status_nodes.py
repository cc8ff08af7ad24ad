"""``shardcache status`` against a real cluster (issue 18): a row per member of the ring with that
node's clients' bytes by where they came from (local, peer, origin), its local hit rate and what
it served to peers, each asked of the member itself; a member killed shows as unreachable, then
dead, never as a traceback. Real daemon processes peered on loopback, the real CLI."""

from __future__ import annotations

import json
import os
import re
import signal
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from sidecar.cli.commands.status import MEMBER_TIMEOUT_S
from sidecar.cli.progress import format_bytes
from tests.support.cli import run_cli
from tests.support.daemons import Cluster, Daemon
from tests.support.processes import kill9
from tests.support.s3 import put_objects
from wire.rendezvous import ranked

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

HEADER = ["NODE", "MEMBER", "LIVE", "LOCAL", "PEER", "ORIGIN", "LOCAL HIT", "TO PEERS"]


def _read(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=20) as resp:
        return resp.read()


def _owned_by(bucket: str, ids: list[str], owner: str, prefix: str) -> str:
    return next(f"{prefix}-{i}.tar" for i in range(10_000) if ranked(ids, f"{bucket}/{prefix}-{i}.tar")[0] == owner)


def _node_table(stdout: str) -> dict[str, list[str]]:
    """The per-node table's rows by node name (cells split where the table puts two spaces)."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if re.split(r"\s{2,}", line) == HEADER)
    rows: dict[str, list[str]] = {}
    for line in lines[start + 1:]:
        cells = re.split(r"\s{2,}", line.strip())
        if len(cells) != len(HEADER):
            break
        rows[cells[0]] = cells
    return rows


@pytest.fixture
def cluster(tmp_path: Path, s3_server: Any) -> Any:
    group = Cluster(tmp_path, s3_server.endpoint, 3)
    group.start()
    try:
        group.wait_live(set(group.ids))
        yield group
    finally:
        group.stop()


def test_status_shows_every_node_of_the_cluster(cluster: Cluster, s3_server: Any, bucket: str) -> None:
    d0, d1, d2 = cluster.daemons
    ids = cluster.ids
    borrowed = _owned_by(bucket, ids, ids[1], "b")  # owned by node-1, read on node-0
    own = _owned_by(bucket, ids, ids[0], "o")  # owned by node-0
    data = {borrowed: os.urandom(200_000), own: os.urandom(120_000)}
    put_objects(s3_server.client(), bucket, data)
    assert _read(f"{d0.url}/{bucket}/{borrowed}") == data[borrowed]  # peer
    assert _read(f"{d0.url}/{bucket}/{borrowed}") == data[borrowed]  # local: the borrowed copy
    assert _read(f"{d0.url}/{bucket}/{own}") == data[own]  # origin
    b, o = len(data[borrowed]), len(data[own])

    result = run_cli(["status", "--daemon", d0.url, "--interval", "0"], timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    rows = _node_table(result.stdout)
    assert sorted(rows) == ["node-0", "node-1", "node-2"]
    assert rows["node-0"] == ["node-0", ids[0], "yes", format_bytes(b), format_bytes(b), format_bytes(o),
                              f"{b / (2 * b + o) * 100:.1f}%", "0 B"]
    # node-1 filled the object for node-0: it served it to a peer, and its own clients read nothing.
    assert rows["node-1"] == ["node-1", ids[1], "yes", "0 B", "0 B", "0 B", "-", format_bytes(b)]
    assert rows["node-2"][2:] == ["yes", "0 B", "0 B", "0 B", "-", "0 B"]
    total = 2 * b + o
    assert (f"cluster: clients of 3 nodes read {format_bytes(total)}: local {format_bytes(b)} "
            f"({b / total * 100:.1f}%), peer {format_bytes(b)}") in result.stdout
    # The origin's egress beside it: node-1's fill for node-0 is in it, though no client of node-1 read it.
    assert f"these nodes read {format_bytes(b + o)} from the origin in all" in result.stdout
    assert "cluster: member" in result.stdout  # the daemon's own cluster lines, as before

    # --json: the same rows under cluster_nodes, each member's figures as it reports them itself.
    doc = json.loads(run_cli(["status", "--daemon", d0.url, "--interval", "0", "--json"], timeout=60).stdout)
    nodes = {n["node"]: n for n in doc["cluster_nodes"]}
    assert sorted(nodes) == ["node-0", "node-1", "node-2"]
    for daemon, name in zip(cluster.daemons, ("node-0", "node-1", "node-2"), strict=True):
        stats = daemon.stats()
        node = nodes[name]
        assert node["member"] == ids[int(name[-1])] and node["url"] == daemon.url
        assert (node["state"], node["live"], node["error"]) == ("live", True, None)
        assert node["node_reads"] == stats["node_reads"]
        assert node["served_to_peers_bytes"] == stats["served_bytes"]["peer"]
    assert nodes["node-0"]["node_reads"]["bytes"] == {"local": b, "peer": b, "origin": o}
    assert nodes["node-0"]["node_reads"]["reads"] == {"local": 1, "peer": 1, "origin": 1}

    # A member killed: unreachable while the ring still has it, then dead; never a traceback, and
    # the daemons asked answered, so the exit status stays 0.
    kill9(d2.proc)  # type: ignore[arg-type]
    result = run_cli(["status", "--daemon", d0.url, "--interval", "0"], timeout=60)
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stdout + result.stderr
    row = _node_table(result.stdout)["node-2"]
    if row[2] == "unreachable":  # the ring has not noticed yet
        assert row[3:] == ["-"] * 5
        assert f"{ids[2]}: cannot reach the daemon at {d2.url}: connection refused" in result.stdout
    else:
        assert row[2] == "dead"
    cluster.wait_live(set(ids[:2]), [d0], timeout=15)
    result = run_cli(["status", "--daemon", d0.url, "--interval", "0", "--json"], timeout=60)
    assert result.returncode == 0 and "Traceback" not in result.stderr
    down = next(n for n in json.loads(result.stdout)["cluster_nodes"] if n["node"] == "node-2")
    assert (down["state"], down["live"], down["node_reads"]) == ("dead", False, None)
    human = run_cli(["status", "--daemon", d1.url, "--interval", "0"], timeout=60)
    assert _node_table(human.stdout)["node-2"][2:] == ["dead", "-", "-", "-", "-", "-"]
    assert sorted(_node_table(human.stdout)) == ["node-0", "node-1", "node-2"]

    # A member that hangs (stopped, its socket still accepting) costs the table a bounded wait.
    assert d1.proc is not None
    os.kill(d1.proc.pid, signal.SIGSTOP)
    try:
        began = time.monotonic()
        result = run_cli(["status", "--daemon", d0.url, "--interval", "0"], timeout=60)
        elapsed = time.monotonic() - began
    finally:
        os.kill(d1.proc.pid, signal.SIGCONT)
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stdout + result.stderr
    assert elapsed < MEMBER_TIMEOUT_S + 15, elapsed
    row = _node_table(result.stdout)["node-1"]
    print(f"a stopped member is {row[2]}; status took {elapsed:.1f} s")
    assert row[2] in ("unreachable", "dead"), row  # dead once the ring's health checks noticed
    if row[2] == "unreachable":
        assert f"{ids[1]}: cannot reach the daemon at {d1.url}: timed out" in result.stdout


def test_standalone_daemon_shows_no_node_table(tmp_path: Path, s3_server: Any, bucket: str) -> None:
    s3_server.client().put_object(Bucket=bucket, Key="a.tar", Body=b"x" * 5000)
    daemon = Daemon(tmp_path, "s3", s3_server.endpoint).start()
    try:
        assert _read(f"{daemon.url}/{bucket}/a.tar") == b"x" * 5000
        result = run_cli(["status", "--daemon", daemon.url, "--interval", "0"], timeout=60)
        assert result.returncode == 0, result.stdout + result.stderr
        assert "LOCAL HIT" not in result.stdout and "cluster" not in result.stdout
        doc = json.loads(run_cli(["status", "--daemon", daemon.url, "--interval", "0", "--json"], timeout=60).stdout)
        assert "cluster_nodes" not in doc
        # The figures are there all the same: every read of a standalone node is local or the origin's.
        (report,) = doc["daemons"]
        assert report["stats"]["node_reads"]["bytes"] == {"local": 0, "peer": 0, "origin": 5000}
        assert report["stats"]["node_reads"]["origin_ratio"] == 1.0
    finally:
        daemon.stop()
