"""Per-node figures (issue 18): the bytes each daemon's own clients read, by where they came from
(``local``, ``peer``, ``origin``), in ``/_shardcache/stats`` (``node_reads``) and ``/metrics``.

Real daemon processes peered on loopback in front of the session's moto server (the cluster of
``tests/daemon/test_peers.py``), read over HTTP, by path (short-circuit) and by descriptor
(``--handles``), the way trainers read them.
"""

from __future__ import annotations

import functools
import os
import re
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from tests.support.daemons import Cluster
from tests.support.s3 import put_objects
from tests.support.waits import wait_until
from wire.handles import exchange
from wire.rendezvous import ranked

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

SIZE = 300 * 1024
NOTHING = {"local": 0, "peer": 0, "origin": 0}



def _settled(daemon: Any) -> bool:
    return int(daemon.stats()["fills_in_flight"]) == 0

def _get(url: str, headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    request = urllib.request.Request(url, headers=headers or {})
    with urllib.request.urlopen(request, timeout=20) as resp:
        return resp.status, {k.lower(): v for k, v in resp.headers.items()}, resp.read()


def _owned(bucket: str, ids: list[str], owner: int, count: int, prefix: str) -> list[str]:
    """``count`` keys whose owner over the live ``ids`` is ``ids[owner]``."""
    keys: list[str] = []
    for i in range(10_000):
        key = f"{prefix}/shard-{i:05d}.tar"
        if ranked(ids, f"{bucket}/{key}")[0] == ids[owner]:
            keys.append(key)
            if len(keys) == count:
                return keys
    raise AssertionError("no such keys")


def _node(daemon: Any) -> dict[str, Any]:
    reads: dict[str, Any] = daemon.stats()["node_reads"]
    return reads


def _metric(text: str, name: str, source: str) -> float:
    match = re.search(rf'^{name}\{{source="{source}"\}} (\S+)$', text, re.MULTILINE)
    assert match, f"{name}{{source={source}}} not exposed"
    return float(match.group(1))


def _descriptor(sock_path: Path, bucket: str, key: str) -> tuple[dict[str, Any], bytes]:
    import socket

    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(30)
        sock.connect(str(sock_path))
        reply, fd = exchange(sock, {"op": "open", "bucket": bucket, "key": key})
    assert fd is not None, reply
    try:
        return reply, os.pread(fd, os.fstat(fd).st_size, 0)
    finally:
        os.close(fd)


@pytest.fixture
def three(tmp_path: Path, s3_server: Any) -> Any:
    """Three peered daemons: node-0 serves descriptors too, node-2's cache holds no object (every
    read there streams uncached: the passthrough path)."""
    group = Cluster(tmp_path, s3_server.endpoint, 3)
    group.daemons[0].args += ["--handles", f"unix://{tmp_path}/handles0.sock"]
    group.daemons[2].args += ["--cache-size", "100KiB"]
    group.start()
    try:
        group.wait_live(set(group.ids))
        yield group
    finally:
        group.stop()


def test_client_bytes_by_source_on_each_node(three: Cluster, s3_server: Any, bucket: str, tmp_path: Path) -> None:
    d0, d1, d2 = three.daemons
    ids = three.ids
    own0 = _owned(bucket, ids, 0, 2, "n")
    own1 = _owned(bucket, ids, 1, 3, "n")
    own2 = _owned(bucket, ids, 2, 1, "n")
    data = {key: os.urandom(SIZE + i) for i, key in enumerate(own0 + own1 + own2)}
    put_objects(s3_server.client(), bucket, data)
    for daemon in three.daemons:  # before any read: zeros, and no ratio to give
        assert _node(daemon) == {"bytes": NOTHING, "reads": NOTHING, "local_hit_ratio": None,
                                 "peer_ratio": None, "origin_ratio": None}

    # A read through a non-owner: the owner fills it from the origin and streams it over.
    key = own1[0]
    status, headers, body = _get(f"{d0.url}/{bucket}/{key}")
    assert status == 200 and body == data[key] and headers["x-shardcache-cache"] == "miss"
    size = len(body)
    reads0 = _node(d0)
    assert reads0["bytes"] == {"local": 0, "peer": size, "origin": 0}
    assert reads0["reads"] == {"local": 0, "peer": 1, "origin": 0}
    assert (reads0["local_hit_ratio"], reads0["peer_ratio"], reads0["origin_ratio"]) == (0.0, 1.0, 0.0)
    # The owner's fill was for a peer: origin bytes on the owner, and none of its clients' bytes.
    stats1 = d1.stats()
    assert stats1["node_reads"]["bytes"] == NOTHING and stats1["node_reads"]["reads"] == NOTHING
    assert stats1["served_bytes"]["peer"] == size and stats1["origin_read_bytes"] == size

    # Again through the non-owner: its borrowed copy, local. On the owner: its own copy, local.
    # On the third node (a cache too small to keep it): streamed from the owner, peer. (Both fills
    # published first: a read while one is being committed joins it, "coalesced".)
    for daemon in (d0, d1):
        wait_until(functools.partial(_settled, daemon), timeout=20, interval=0.05, what=f"{daemon.url}'s fill to be published")
    status, headers, body = _get(f"{d0.url}/{bucket}/{key}")
    assert body == data[key] and headers["x-shardcache-cache"] == "hit"
    _, headers, body = _get(f"{d1.url}/{bucket}/{key}")
    assert body == data[key] and headers["x-shardcache-cache"] == "hit"
    _, headers, body = _get(f"{d2.url}/{bucket}/{key}")
    assert body == data[key]
    assert _node(d0)["bytes"] == {"local": size, "peer": size, "origin": 0}
    assert _node(d1)["bytes"] == {"local": size, "peer": 0, "origin": 0}
    stats2 = d2.stats()
    assert stats2["cache"]["items"] == 0 and stats2["served_bytes"]["passthrough"] == size
    assert stats2["node_reads"]["bytes"] == {"local": 0, "peer": size, "origin": 0}
    assert stats2["node_reads"]["reads"] == {"local": 0, "peer": 1, "origin": 0}
    # An object node-2 owns itself, uncached there too: the origin's bytes, streamed.
    _, _, body = _get(f"{d2.url}/{bucket}/{own2[0]}")
    assert body == data[own2[0]]
    assert _node(d2)["bytes"] == {"local": 0, "peer": size, "origin": len(body)}

    # The owner's own reads: a miss from the origin, then a short-circuit read by path, local.
    key0 = own0[0]
    _, headers, body = _get(f"{d0.url}/{bucket}/{key0}")
    assert body == data[key0] and headers["x-shardcache-cache"] == "miss"
    _, headers, body = _get(f"{d0.url}/{bucket}/{key0}", {"x-shardcache-short-circuit": "1"})
    assert body == b"" and Path(headers["x-shardcache-path"]).read_bytes() == data[key0]
    size0 = len(data[key0])
    reads0 = _node(d0)
    assert reads0["bytes"] == {"local": size + size0, "peer": size, "origin": size0}
    assert reads0["reads"] == {"local": 2, "peer": 1, "origin": 1}

    # By descriptor: a miss filled from the owner is the peer's; the next one is this node's copy.
    handles = tmp_path / "handles0.sock"
    key1 = own1[1]
    reply, got = _descriptor(handles, bucket, key1)
    assert got == data[key1] and reply["cache"] == "miss"
    reply, got = _descriptor(handles, bucket, key1)
    assert got == data[key1] and reply["cache"] == "hit"
    reply, got = _descriptor(handles, bucket, key0)  # and one the node owns, cached already
    assert got == data[key0] and reply["cache"] == "hit"
    size1 = len(data[key1])
    reads0 = _node(d0)
    local, peer, origin = size + size0 + size1 + size0, size + size1, size0
    assert reads0["bytes"] == {"local": local, "peer": peer, "origin": origin}
    assert reads0["reads"] == {"local": 4, "peer": 2, "origin": 1}
    total = local + peer + origin
    assert reads0["local_hit_ratio"] == round(local / total, 4)
    assert reads0["peer_ratio"] == round(peer / total, 4) and reads0["origin_ratio"] == round(origin / total, 4)
    # How the bytes were sent is counted as before (served_bytes), beside where they came from.
    served0 = d0.stats()["served_bytes"]
    assert served0["short_circuit"] == size0 + size1 + size1 + size0

    # The same figures in Prometheus, with the unit in the name; peers' reads are in none of them.
    with urllib.request.urlopen(d0.url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    for source, expected in reads0["bytes"].items():
        assert _metric(text, "shardcache_client_bytes_total", source) == expected
    for source, expected in reads0["reads"].items():
        assert _metric(text, "shardcache_client_reads_total", source) == expected
    assert _node(d1)["reads"] == {"local": 1, "peer": 0, "origin": 0}


@pytest.fixture
def two_small(tmp_path: Path, s3_server: Any) -> Any:
    group = Cluster(tmp_path, s3_server.endpoint, 2)
    group.daemons[1].args += ["--cache-size", "100KiB"]
    group.start()
    try:
        group.wait_live(set(group.ids))
        yield group
    finally:
        group.stop()


def test_uncached_read_from_a_peer_is_not_origin_egress(two_small: Cluster, s3_server: Any, bucket: str) -> None:
    """A node whose cache cannot hold an object streams it from its owner: peer bytes, not origin
    egress (Fetcher.passthrough once counted every streamed byte as read from the origin)."""
    owner, small = two_small.daemons
    (key,) = _owned(bucket, two_small.ids, 0, 1, "egress")
    data = os.urandom(SIZE)
    put_objects(s3_server.client(), bucket, {key: data})
    _, _, body = _get(f"{small.url}/{bucket}/{key}")
    assert body == data
    stats = small.stats()
    assert stats["node_reads"]["bytes"]["peer"] == SIZE  # where it came from, for the node's clients
    assert stats["origin_read_bytes"] == 0 and stats["peer_read_bytes"] >= SIZE
