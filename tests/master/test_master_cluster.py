"""Cache-aware leases end to end: a real master (``--cluster``) learns the ring from real peered
daemons in front of the session's moto server, and real ShardLoader trainers, one per node,
read a job with ``locality_window`` through their own node's daemon: most shards are read where
they are owned, so peer bytes stay a small part of the dataset, and every sample is delivered
once. A daemon killed with -9 leaves the master's ring; a daemon answering garbage leaves it as
it was and says why."""

from __future__ import annotations

import http.server
import json
import threading
import time
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from loader import LoaderSettings, ShardLoader
from tests.support.cli import run_cli
from tests.support.daemons import Cluster
from tests.support.datasets import make_shards, put_dataset
from tests.support.masters import MasterProcess
from tests.support.processes import kill9
from tests.support.waits import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def _json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=20) as resp:
        return json.loads(resp.read())


def _locality(master: MasterProcess, job: str) -> dict[str, Any]:
    return _json(f"{master.url}/v1/jobs/{job}")["locality"]


def _ring_members(master: MasterProcess) -> int:
    return len(_json(f"{master.url}/v1/cluster")["members"])


def test_trainers_read_the_shards_their_node_owns(tmp_path: Path, s3_server: Any, bucket: str) -> None:
    shards = make_shards(36, samples=3, member_bytes=20_000, seed=18)
    put_dataset(s3_server.client(), bucket, "loc/", shards)
    dataset_bytes = sum(len(b) for b in shards.values())
    cluster = Cluster(tmp_path, s3_server.endpoint, 3)
    cluster.start()
    master = MasterProcess(tmp_path, f"sqlite:///{tmp_path}/m.db", "--cluster", cluster.daemons[0].url,
                           "--cluster", "http://127.0.0.1:9", "--cluster-poll", "0.3")
    try:
        cluster.wait_live(set(cluster.ids))
        master.start()
        url = f"s3://{bucket}/loc/"
        wait_until(lambda: _ring_members(master) == 3, timeout=20, what="the master to learn the ring")
        ring = _json(f"{master.url}/v1/cluster")
        assert {m["node"] for m in ring["members"]} == {"node-0", "node-1", "node-2"}
        assert ring["source"]["source"] == cluster.daemons[0].url
        seen: Counter[str] = Counter()
        errors: list[BaseException] = []

        def trainer(i: int) -> None:
            try:
                settings = LoaderSettings(endpoint=cluster.daemons[i].url, node=f"node-{i}")
                loader = ShardLoader(url, job="aware", master=master.url, epochs=2, locality_window=12,
                                     trainer=f"t{i}", settings=settings)
                for _ in range(2):  # one pass per epoch
                    for sample in loader:
                        seen[sample["__key__"]] += 1
            except BaseException as exc:  # reported below
                errors.append(exc)

        before = [_json(d.url + "/_shardcache/stats") for d in cluster.daemons]
        threads = [threading.Thread(target=trainer, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not errors, errors
        assert len(seen) == 36 * 3 and set(seen.values()) == {2}, "every sample exactly once per epoch"

        locality = _locality(master, "aware")
        assert locality["window"] == 12
        assert locality["local_share"] >= 0.8, locality
        assert all(e["max_displacement"] < 12 for e in locality["epochs"])
        after = [_json(d.url + "/_shardcache/stats") for d in cluster.daemons]
        origin = sum(a["origin_read_bytes"] - b["origin_read_bytes"] for a, b in zip(after, before, strict=True))
        peer = sum(a["peer_read_bytes"] - b["peer_read_bytes"] for a, b in zip(after, before, strict=True))
        assert origin <= 1.05 * dataset_bytes, "each shard left the origin about once"
        # Without the window a third of a node's reads would be its own: ~2/3 of each epoch from peers.
        assert peer <= 0.4 * dataset_bytes * 2, f"peer bytes {peer} over two epochs of {dataset_bytes}"

        # What an operator sees: the job's local share, how far the order moved, the ring.
        shown = run_cli(["status", "--master", master.url, "--job", "aware"])
        assert shown.returncode == 0, shown.stderr
        line = next(x for x in shown.stdout.splitlines() if x.startswith("aware: local leases"))
        assert f"{100 * locality['local_share']:.1f}%" in line and "window 12" in line, line
        assert "Spearman" in line and "ring of 3 members on 3 nodes" in line, line

        metrics = urllib.request.urlopen(master.url + "/metrics", timeout=10).read().decode()
        assert 'shardcache_master_job_local_lease_ratio{job="aware"}' in metrics
        assert 'shardcache_master_job_leases_by_locality_total{job="aware",locality="owner"}' in metrics

        # A member killed with -9 leaves the daemons' rings, then the master's.
        victim = cluster.daemons[2].proc
        assert victim is not None
        kill9(victim)
        cluster.daemons[2].proc = None
        wait_until(lambda: _ring_members(master) == 2, timeout=30, what="the master to drop the member")
        source = _locality(master, "aware")["ring"]["source"]
        assert source["source"] == cluster.daemons[0].url and source["error"] is None
    finally:
        master.stop()
        cluster.stop()


class _Garbage(http.server.BaseHTTPRequestHandler):
    answers = [b"not json", b'{"self": 1}', b'{"self": "x", "members": [{"url": 5}]}', b"[" * 10_000]
    served: list[int] = []  # which answer each request got, in order

    def log_message(self, *args: Any) -> None:
        pass

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        index = int(time.monotonic() * 10) % len(self.answers)
        self.served.append(index)
        body = self.answers[index]
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def test_a_daemon_answering_garbage_keeps_the_ring_and_says_why(tmp_path: Path) -> None:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Garbage)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    master = MasterProcess(tmp_path, f"sqlite:///{tmp_path}/m.db", "--cluster",
                           f"http://127.0.0.1:{server.server_address[1]}", "--cluster-poll", "0.2")
    try:
        master.start()
        body = json.dumps({"name": "j", "dataset": "s3://b/p/", "shards": [{"key": f"s{i}"} for i in range(4)],
                           "locality_window": 4}).encode()
        urllib.request.urlopen(urllib.request.Request(master.url + "/v1/jobs", data=body, method="POST",
                                                      headers={"Content-Type": "application/json"}), timeout=10)
        wait_until(lambda: _locality(master, "j")["ring"]["source"]["error"], timeout=10,
                   what="the poll's error in the status")
        # Every kind of garbage answered at least once, and taken in: the master asked again since.
        wait_until(lambda: set(_Garbage.served[:-1]) == set(range(len(_Garbage.answers))), timeout=10,
                   what="every kind of garbage to be answered")
        locality = _locality(master, "j")
        assert locality["ring"]["members"] == 0 and "ring the master holds is kept" in locality["ring"]["source"]["error"]
        assert _json(f"{master.url}/v1/cluster")["members"] == []
        assert urllib.request.urlopen(master.url + "/readyz", timeout=5).status == 200
    finally:
        master.stop()
        server.shutdown()
