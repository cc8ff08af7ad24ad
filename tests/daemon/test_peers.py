"""The cluster cache (issue 17, daemon side): real daemons peered on loopback in front of the
session's moto server. Each object leaves the origin about once for the cluster, a killed member
drops out and comes back, a peer's corrupt bytes are refused, the peer path is closed to anyone
without the secret, and borrowed copies are evicted first."""

from __future__ import annotations

import dataclasses
import http.client
import http.server
import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from cache import Store, StoreSettings
from sidecar.daemon.peers.config import ClusterSettings
from sidecar.daemon.peers.signing import PEER_HEADER, PeerAsk, new_nonce, sign
from tests.support.daemons import PEER_SECRET, Cluster, http_get, live_members, make_settings
from tests.support.processes import PYTHON, REPO, free_port
from tests.support.s3 import put_objects
from tests.support.threads import serving
from tests.support.waits import wait_until
from wire.rendezvous import member_id, ranked

pytestmark = pytest.mark.timeout(180)

_get = http_get


def _json(url: str) -> Any:
    status, body = _get(url)
    assert status == 200, body
    return json.loads(body)


@pytest.fixture
def cluster(tmp_path: Path, s3_server: Any) -> Any:
    group = Cluster(tmp_path, s3_server.endpoint, 3)
    group.start()
    try:
        yield group
    finally:
        group.stop()


def _dataset(prefix: str, count: int, size: int) -> dict[str, bytes]:
    return {f"{prefix}/shard-{i:04d}.tar": os.urandom(size) for i in range(count)}


@pytest.mark.slow
def test_three_daemons_read_each_object_from_the_origin_once(cluster: Cluster, s3_server: Any, bucket: str) -> None:
    client = s3_server.client()
    dataset = _dataset("train", 24, 300 * 1024)
    put_objects(client, bucket, dataset)
    cluster.wait_live(set(cluster.ids))
    for daemon in cluster.daemons:
        peers = _json(daemon.url + "/_shardcache/peers")
        assert peers["peer_links"] == "authenticated" and peers["self"] == member_id(daemon.url)
        assert {m["node"] for m in peers["members"]} == {"node-0", "node-1", "node-2"}
    # Every node reads the whole dataset, each starting at another place (as trainers do).
    for turn, daemon in enumerate(cluster.daemons):
        keys = sorted(dataset)
        for key in keys[turn * 8:] + keys[:turn * 8]:
            status, body = _get(f"{daemon.url}/{bucket}/{key}")
            assert status == 200 and body == dataset[key], key
    stats = [d.stats() for d in cluster.daemons]
    total = sum(len(v) for v in dataset.values())
    origin = sum(s["origin_read_bytes"] for s in stats)
    peer_in = sum(s["peer_read_bytes"] for s in stats)
    peer_out = sum(s["served_bytes"]["peer"] for s in stats)
    print(f"dataset {total} B: origin {origin} B ({origin / total:.3f}x), peers {peer_in} B")
    assert origin <= 1.1 * total
    assert peer_in >= total  # each node read the two thirds it does not own from their owners
    assert peer_out == peer_in
    for s in stats:
        assert s["cluster"]["live"] == 3 and s["cluster"]["peer_links"] == "authenticated"
        assert s["cache"]["borrowed_items"] > 0

    # kill -9 of one member: it leaves the others' rings within seconds, and reads go on.
    victim, rest = cluster.daemons[2], cluster.daemons[:2]
    victim.kill9()
    fresh = _dataset("more", 12, 200 * 1024)
    put_objects(client, bucket, fresh)
    for key in sorted(fresh)[:4]:  # before the others notice: the dead owner costs a refused connection
        for daemon in rest:
            status, body = _get(f"{daemon.url}/{bucket}/{key}")
            assert status == 200 and body == fresh[key]
    dropped = cluster.wait_live(set(cluster.ids[:2]), rest, timeout=10)
    print(f"dead member dropped out of the ring in {dropped:.1f} s after the first reads")
    for key in sorted(fresh):
        for daemon in rest:
            status, body = _get(f"{daemon.url}/{bucket}/{key}")
            assert status == 200 and body == fresh[key]
    for key in sorted(dataset):  # the dead one's share of the old objects: from its next candidate
        status, body = _get(f"{rest[0].url}/{bucket}/{key}")
        assert status == 200 and body == dataset[key]

    # Restarted (as the DaemonSet does, same cache), it is back in every ring.
    victim.launch()
    cluster.wait_live(set(cluster.ids), timeout=30)


@pytest.mark.slow
def test_a_new_owner_takes_over_from_the_member_ranked_next(tmp_path: Path, s3_server: Any, bucket: str) -> None:
    """A member joining owns objects the member ranked after it holds: its first reads of them
    come from that member's cache (a hand-off), not from the object store again; an object no one
    holds costs the owner one refused request, and the member asked does not fill it."""
    group = Cluster(tmp_path, s3_server.endpoint, 3)
    first, late = group.daemons[:2], group.daemons[2]
    names = [f"handoff/shard-{i:04d}.tar" for i in range(300)]
    owned = [k for k in names if ranked(group.ids, f"{bucket}/{k}")[0] == group.ids[2]]
    held, cold = owned[:4], owned[4:6]
    # Owned by the late one, held by the first (ranked next), never read by the second: read
    # through the second, the late owner's fill for a peer takes it over from the first too.
    relayed = [k for k in owned[6:] if ranked(group.ids, f"{bucket}/{k}")[1] == group.ids[0]][:2]
    assert len(held) == 4 and len(cold) == 2 and len(relayed) == 2
    data = {k: os.urandom(256 * 1024) for k in held + cold + relayed}
    put_objects(s3_server.client(), bucket, data)
    try:
        for daemon in first:  # at once: no readiness waits on peers
            daemon.launch()
        for daemon in first:
            daemon.wait_ready()
        group.wait_live(set(group.ids[:2]), first)
        for key in held + relayed:  # filled by their owner among the first two: the one ranked after the late one
            status, body = _get(f"{first[0].url}/{bucket}/{key}")
            assert status == 200 and body == data[key]
        before = [d.stats()["origin_read_bytes"] for d in first]
        late.start()
        group.wait_live(set(group.ids))

        for key in held:
            status, body = _get(f"{late.url}/{bucket}/{key}")
            assert status == 200 and body == data[key]
        stats = late.stats()
        size = sum(len(data[k]) for k in held)
        assert stats["origin_read_bytes"] == 0, "the new owner read objects its predecessor held from the origin"
        assert stats["peer_read_bytes"] == size and stats["cache"]["borrowed_items"] == 0  # its own now
        assert [d.stats()["origin_read_bytes"] for d in first] == before

        cold_size = sum(len(data[k]) for k in cold)
        items = [d.stats()["cache"]["items"] for d in first]
        for key in cold:
            status, body = _get(f"{late.url}/{bucket}/{key}")
            assert status == 200 and body == data[key]
        assert late.stats()["origin_read_bytes"] == cold_size
        assert [d.stats()["cache"]["items"] for d in first] == items  # asked from its cache only: no fill
        assert [d.stats()["origin_read_bytes"] for d in first] == before

        for key in relayed:
            status, body = _get(f"{first[1].url}/{bucket}/{key}")
            assert status == 200 and body == data[key]
        assert late.stats()["origin_read_bytes"] == cold_size, "the owner's fill for a peer went to the origin"
        assert [d.stats()["origin_read_bytes"] for d in first] == before
    finally:
        group.stop()


def test_peer_header_needs_the_secret(start_daemon: Any, tmp_path: Path, s3_server: Any, bucket: str) -> None:
    s3_server.client().put_object(Bucket=bucket, Key="a.bin", Body=b"x" * 1000)
    settings = make_settings(tmp_path / "cache", "s3", s3_server.endpoint)
    url = "http://" + settings.listen[0][len("tcp://"):]
    settings = dataclasses.replace(settings, cluster=ClusterSettings(
        peers=(f"http://127.0.0.1:{free_port()}",), advertise_url=url, secret=PEER_SECRET,
    ))
    daemon = start_daemon(settings)
    target = f"/{bucket}/a.bin"
    asker = "http://127.0.0.1:1"

    def ask() -> PeerAsk:
        return PeerAsk(asker, member_id(url), new_nonce())

    refused = {
        "unsigned": f"m={asker},open",
        "wrong secret": sign(b"another-secret-of-16-bytes", ask(), "GET", target),
        "expired": sign(PEER_SECRET, ask(), "GET", target, now=time.time() - 300),
        "another path": sign(PEER_SECRET, ask(), "GET", target + "x"),
        "another member": sign(PEER_SECRET, PeerAsk(asker, "http://127.0.0.1:2", new_nonce()), "GET", target),
        "no nonce": sign(PEER_SECRET, PeerAsk(asker, member_id(url), ""), "GET", target),
        "no member": "t=1,sig=00",
    }
    for why, value in refused.items():
        status, body = _get(daemon.url + target, {PEER_HEADER: value})
        assert status == 403 and b"<Code>AccessDenied</Code>" in body and b"not a peer" in body, why
    status, body = _get(daemon.url + target, {PEER_HEADER: sign(PEER_SECRET, ask(), "GET", target)})
    assert status == 200 and body == b"x" * 1000
    assert daemon.stats()["served_bytes"]["peer"] == 1000
    status, body = _get(daemon.url + target)  # a client's read, no peer header: as ever
    assert status == 200 and body == b"x" * 1000
    peers = _json(daemon.url + "/_shardcache/peers")
    assert peers["peer_links"] == "authenticated" and [m["self"] for m in peers["members"]].count(True) == 1


class _CorruptPeer(http.server.BaseHTTPRequestHandler):
    """A 'peer' that answers every read with the real headers (ETag, checksums) and flipped bytes."""

    objects: dict[str, tuple[bytes, dict[str, str]]] = {}
    reads = 0

    def log_message(self, *args: Any) -> None:
        pass

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        if self.path == "/readyz":
            body, headers = b'{"ready": true, "node": "liar"}', {"Content-Type": "application/json"}
        elif self.path in self.objects:
            type(self).reads += 1
            data, headers = self.objects[self.path]
            body = bytes(b ^ 0xFF for b in data)
        else:
            self.send_error(404)
            return
        self.send_response(200)
        for name, value in headers.items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def test_corrupt_peer_bytes_are_refused(start_daemon: Any, tmp_path: Path, s3_server: Any, bucket: str) -> None:
    liar = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _CorruptPeer)
    liar_url = f"http://127.0.0.1:{liar.server_address[1]}"
    settings = make_settings(tmp_path / "cache", "s3", s3_server.endpoint)
    url = "http://" + settings.listen[0][len("tcp://"):]
    # A key the liar owns in the ring of the two.
    key = next(f"k{i}.bin" for i in range(1000) if ranked([member_id(url), member_id(liar_url)],
                                                       f"{bucket}/k{i}.bin")[0] == member_id(liar_url))
    data = os.urandom(256 * 1024)
    client = s3_server.client()
    client.put_object(Bucket=bucket, Key=key, Body=data)
    head = client.head_object(Bucket=bucket, Key=key)
    _CorruptPeer.objects = {f"/{bucket}/{key}": (data, {"ETag": head["ETag"], "Content-Type": "binary/octet-stream"})}
    settings = dataclasses.replace(settings, cluster=ClusterSettings(peers=(liar_url,), advertise_url=url))
    with serving(liar):
        daemon = start_daemon(settings)
        wait_until(lambda: live_members(daemon.url) == {member_id(url), member_id(liar_url)}, timeout=15, what="liar live")
        assert _json(daemon.url + "/_shardcache/peers")["peer_links"] == "open"
        answers = []
        for _ in range(3):
            try:
                answers.append(_get(f"{daemon.url}/{bucket}/{key}"))
            except (OSError, http.client.HTTPException) as exc:  # cut short: corrupt bytes never complete an answer
                answers.append((0, repr(exc).encode()))
            if answers[-1] == (200, data):
                break
        assert answers[-1] == (200, data)
        assert all(body != bytes(b ^ 0xFF for b in data) for _, body in answers)
        assert _CorruptPeer.reads == 1  # refused once, then the object comes from the origin
        stats = daemon.stats()
        assert stats["verification"]["fills"]["failed"] == 1
        assert stats["origin_read_bytes"] >= len(data)
        status, body = _get(f"{daemon.url}/{bucket}/{key}")
        assert status == 200 and body == data


def test_sigv4_with_peers_and_no_secret_refuses_to_start(tmp_path: Path) -> None:
    args = [PYTHON, "-m", "sidecar.cli", "serve", "--auth", "sigv4", "--origin", "s3", "--cache-dir", str(tmp_path),
            "--listen", "tcp://127.0.0.1:1", "--peer", "http://127.0.0.1:2"]
    done = subprocess.run(args, capture_output=True, timeout=60, cwd=str(REPO), env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode != 0
    assert b"--peer-secret-file" in done.stderr


def test_borrowed_entries_are_evicted_first(tmp_path: Path) -> None:
    def put(store: Store, key: str, borrowed: bool) -> None:
        writer = store.begin("b", key, f'"{key}"', 100, borrowed=borrowed)
        assert writer is not None
        writer.write_at(0, key.encode().ljust(100, b"."))
        writer.commit()

    store = Store(StoreSettings(root=tmp_path, capacity_bytes=300, min_free_ratio=0.0))
    store.open()
    put(store, "owned-old", False)
    put(store, "borrowed", True)
    put(store, "owned", False)
    entry = store.lookup("b", "borrowed")
    assert entry is not None and entry.borrowed
    store.touch_in_memory(entry)  # the most recently used, and still the first to go
    put(store, "new", False)
    assert store.lookup("b", "borrowed") is None
    assert store.lookup("b", "owned-old") is not None
    put(store, "borrowed-2", True)  # no borrowed one left: the oldest owned goes
    assert store.lookup("b", "owned-old") is None
    store.close()
    reopened = Store(StoreSettings(root=tmp_path, capacity_bytes=300, min_free_ratio=0.0))
    reopened.open()  # persisted in the meta file
    again = reopened.lookup("b", "borrowed-2")
    assert again is not None and again.borrowed and reopened.stats()["borrowed_items"] == 1
    reopened.close()




def test_dns_records_are_members_at_the_advertised_port() -> None:
    from sidecar.daemon.peers.membership import Membership

    settings = ClusterSettings(peers_dns="peers.invalid", advertise_url="http://10.0.0.1:8600")
    membership = Membership(settings, "n1")
    membership._apply_dns({"10.0.0.1", "10.0.0.2", "fd00::3"})  # self's own record is self
    assert sorted(membership.members) == ["http://10.0.0.1:8600", "http://10.0.0.2:8600", "http://[fd00::3]:8600"]
    assert membership.live == ("http://10.0.0.1:8600",)  # the others are dead until they answer
    membership._apply_dns({"10.0.0.1"})  # gone from the records: gone from the ring
    assert list(membership.members) == ["http://10.0.0.1:8600"]
