"""``warmup --spread``/``--check`` and ``status`` against a cluster: small HTTP daemons in this
process that answer ``/_shardcache/peers``, ``/stats``, ``/cached`` and the warm-up API, so the
placement can be compared with ``wire.rendezvous`` before the real peer daemons exist."""

from __future__ import annotations

import json
import threading
import urllib.parse
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from sidecar.cli.commands.warmup import place
from tests.support.cli import run_cli
from tests.support.datasets import Dataset
from wire.rendezvous import member_id, owner

pytestmark = pytest.mark.slow


class FakeDaemon:
    """Answers the control API as a node daemon with an S3 origin; records warm-up requests."""

    def __init__(self) -> None:
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.id = member_id(self.url)
        self.peers: dict[str, Any] | None = None  # None: answers 404 (an older daemon)
        self.cached: set[str] = set()  # bucket/key
        self.warmed: list[str] = []  # bucket/key of every object a warm-up asked for
        self.cluster: dict[str, Any] | None = None
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _send(self, status: int, doc: Any) -> None:
                body = json.dumps(doc).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:
                path, _, query = self.path.partition("?")
                if path == "/_shardcache/stats":
                    stats: dict[str, Any] = {"origin_url": "s3", "mode": "node", "origin_read_bytes": 1000,
                                             "uptime_s": 10, "served_bytes": {"client": 500, "peer": 2048},
                                             "cache": {"used_bytes": 0, "capacity_bytes": 1 << 30, "items": 0}}
                    if fake.cluster is not None:
                        stats["cluster"] = fake.cluster
                        stats["peer_read_bytes"] = 4096
                    self._send(200, stats)
                elif path == "/_shardcache/peers":
                    if fake.peers is None:
                        self._send(404, {"error": "NotFound", "message": "no such path"})
                    else:
                        self._send(200, fake.peers)
                elif path == "/_shardcache/cached":
                    url = urllib.parse.parse_qs(query)["url"][0]
                    bucket, _, prefix = url[len("s3://"):].partition("/")
                    keys = fake.dataset_keys
                    missing = [k for k in keys if f"{bucket}/{k}" not in fake.cached]
                    self._send(200, {"objects": len(keys), "cached": len(keys) - len(missing), "missing": missing})
                elif path == "/_shardcache/warmups":
                    self._send(200, {"warmups": []})
                elif path.startswith("/_shardcache/warmups/"):
                    self._send(200, fake.status)
                else:
                    self._send(404, {"error": "NotFound", "message": path})

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                fake.warmed += [f"{o['bucket']}/{o['key']}" for o in body["objects"]]
                fake.cached |= {f"{o['bucket']}/{o['key']}" for o in body["objects"]}
                n, size = len(body["objects"]), sum(o.get("size", 0) for o in body["objects"])
                fake.status = {
                    "id": body["id"], "state": "done", "verified": True, "elapsed_s": 0.1,
                    "rate_bytes_per_s": None, "eta_s": None, "failed": [], "error": None,
                    "files": {"total": n, "done": n, "failed": 0, "cached_before": 0},
                    "bytes": {"total": size, "done": size, "fetched": size, "in_flight": 0},
                }
                self._send(201, fake.status)

        return Handler

    dataset_keys: list[str] = []
    status: dict[str, Any] = {}


@pytest.fixture
def cluster(s3_dataset: Dataset) -> Iterator[list[FakeDaemon]]:
    daemons = [FakeDaemon() for _ in range(3)]
    keys = [s3_dataset.prefix + k for k in s3_dataset.shards]
    members = [{"id": d.id, "url": d.url, "live": True, "node": f"node-{i}"} for i, d in enumerate(daemons)]
    for i, d in enumerate(daemons):
        d.dataset_keys = keys
        d.peers = {"self": d.id, "node": f"node-{i}", "peer_links": "authenticated",
                   "members": [dict(m, self=m["id"] == d.id) for m in members]}
    try:
        yield daemons
    finally:
        for d in daemons:
            d.stop()


def events(stdout: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in stdout.splitlines() if line.strip()]


def expected_owners(dataset: Dataset, daemons: list[FakeDaemon]) -> dict[str, str]:
    ids = [d.id for d in daemons]
    return {f"{dataset.bucket}/{dataset.prefix}{k}": owner(ids, f"{dataset.bucket}/{dataset.prefix}{k}") or ""
            for k in dataset.shards}


def test_spread_places_by_the_ring_not_the_daemon_strings(
    s3_dataset: Dataset, cluster: list[FakeDaemon], cli_env: dict[str, str]
) -> None:
    first = cluster[0]
    port = first.url.rsplit(":", 1)[1]
    # One daemon under two spellings; the other two members come from its ring.
    flags = ["--daemon", first.url, "--daemon", f"localhost:{port}", "--spread"]
    dry = run_cli(["warmup", s3_dataset.url, *flags, "--dry-run", "--json"], env=cli_env, timeout=60)
    assert dry.returncode == 0, dry.stdout + dry.stderr
    plans = [e for e in events(dry.stdout) if e["event"] == "plan"]
    assert sorted(p["member"] for p in plans) == sorted(d.id for d in cluster)
    got = {f"{p['bucket']}/{k}": p["member"] for p in plans for k in p["keys"]}
    assert got == expected_owners(s3_dataset, cluster)
    assert not any(d.warmed for d in cluster)

    result = run_cli(["warmup", s3_dataset.url, *flags, "--json"], env=cli_env, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    warmed = {name: d.id for d in cluster for name in d.warmed}
    assert warmed == expected_owners(s3_dataset, cluster)  # each shard once, on its owner
    assert sum(len(d.warmed) for d in cluster) == len(s3_dataset.shards)
    assert not [e for e in events(result.stdout) if e["event"] == "warning"]


def test_daemons_without_a_ring_fall_back_to_their_addresses_with_a_warning(
    s3_dataset: Dataset, cluster: list[FakeDaemon], cli_env: dict[str, str]
) -> None:
    for d in cluster:
        d.peers = None
    flags = [arg for d in cluster for arg in ("--daemon", d.url)]
    result = run_cli(["warmup", s3_dataset.url, *flags, "--spread", "--dry-run"], env=cli_env, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "warning" in result.stderr and "answer no ring" in result.stderr
    assert "by the --daemon addresses" in result.stdout
    as_json = run_cli(["warmup", s3_dataset.url, *flags, "--spread", "--dry-run", "--json"], env=cli_env)
    plans = {e["url"]: sorted(e["keys"]) for e in events(as_json.stdout) if e["event"] == "plan"}
    legacy = place(list(s3_dataset.shards), [d.url for d in cluster])
    assert plans == {url: sorted(s3_dataset.prefix + k for k in keys) for url, keys in legacy.items()}
    assert any(e["event"] == "warning" for e in events(as_json.stdout))


def test_check_reports_cluster_coverage(s3_dataset: Dataset, cluster: list[FakeDaemon], cli_env: dict[str, str]) -> None:
    owners = expected_owners(s3_dataset, cluster)
    by_id = {d.id: d for d in cluster}
    names = sorted(owners)
    # Four shards on their owners, one on a member that does not own it, one nowhere.
    for name in names[:4]:
        by_id[owners[name]].cached.add(name)
    stray = next(d for d in cluster if d.id != owners[names[4]])
    stray.cached.add(names[4])
    result = run_cli(["warmup", s3_dataset.url, "--daemon", cluster[1].url, "--spread", "--check", "--json"],
                     env=cli_env, timeout=60)
    assert result.returncode == 1, result.stdout + result.stderr  # not all shards on their owners
    (row,) = [e for e in events(result.stdout) if e["event"] == "cluster"]
    assert (row["members"], row["files"], row["covered_files"], row["anywhere_files"]) == (3, 6, 4, 5)
    checks = [e for e in events(result.stdout) if e["event"] == "check"]
    assert len(checks) == 3 and sum(c["files"] for c in checks) == 6
    # Without --spread: a row for the daemon given only, and still the cluster's coverage.
    human = run_cli(["warmup", s3_dataset.url, "--daemon", cluster[1].url, "--check"], env=cli_env, timeout=60)
    assert human.returncode == 1
    assert "cluster (3 members)" in human.stdout and "on their owners" in human.stdout
    assert "anywhere in the cluster" in human.stdout
    assert sum(1 for line in human.stdout.splitlines() if line.startswith("http://")) == 1


def test_status_shows_the_cluster(cluster: list[FakeDaemon]) -> None:
    daemon = cluster[0]
    daemon.cluster = {"self": daemon.id, "node": "node-0", "live": 3, "members": 3, "peer_links": "authenticated"}
    result = run_cli(["status", "--daemon", daemon.url, "--interval", "0"], timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert f"cluster: member {daemon.id} on node node-0, 3 members (3 live, 0 dead), peer links authenticated" in out
    assert "node node-2" in out and "(this daemon)" in out
    assert "peer bytes: in 4.0 KiB" in out and "out 2.0 KiB" in out
    as_json = run_cli(["status", "--daemon", daemon.url, "--interval", "0", "--json"], timeout=60)
    (report,) = json.loads(as_json.stdout)["daemons"]
    assert report["stats"]["cluster"]["peer_links"] == "authenticated"
    assert len(report["peers"]["members"]) == 3
    # A standalone daemon: no cluster lines.
    plain = run_cli(["status", "--daemon", cluster[1].url, "--interval", "0"], timeout=60)
    assert "cluster:" not in plain.stdout and plain.returncode == 0
