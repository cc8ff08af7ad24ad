"""Eviction under both policies, short-circuit reads, prefetch priorities, sidecar mode, metrics."""

from __future__ import annotations

import asyncio
import json
import os
import urllib.request
from pathlib import Path

import pytest

from sidecar.daemon.priority import DEMAND, LEASE, WARMUP, PriorityLimiter
from tests.support.daemons import make_settings
from tests.support.s3 import put_objects, s3_client
from tests.support.waits import wait_until

OBJ = 100_000


def _post(url: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


@pytest.mark.parametrize("eviction", ["lru", "hold"])
@pytest.mark.slow
def test_eviction_keeps_cache_within_limits(s3_server, bucket, tmp_path, proxy, start_daemon, eviction):
    objects = {f"e{i}.tar": os.urandom(OBJ) for i in range(8)}
    put_objects(s3_server.client(), bucket, objects)
    capacity = 3 * OBJ + OBJ // 2  # room for three objects
    daemon = start_daemon(make_settings(tmp_path / "cache", "s3", proxy.endpoint, capacity=capacity, eviction=eviction))
    client = daemon.client()
    for _epoch in range(2):
        for key, data in objects.items():
            assert client.get_object(Bucket=bucket, Key=key)["Body"].read() == data
            daemon.settle()
            cache = daemon.stats()["cache"]
            assert cache["used_bytes"] <= capacity and cache["items"] <= 3
            on_disk = sum(p.stat().st_size for p in (tmp_path / "cache" / "v1" / "data").rglob("*") if p.is_file())
            assert on_disk == cache["used_bytes"]
    cache = daemon.stats()["cache"]
    if eviction == "lru":
        # the last three read are the ones kept; every other admission evicted one
        assert cache["items"] == 3 and cache["evictions"] == 16 - 3
        for key in ["e5.tar", "e6.tar", "e7.tar"]:
            resp = client.get_object(Bucket=bucket, Key=key)
            assert resp["ResponseMetadata"]["HTTPHeaders"]["x-shardcache-cache"] == "hit"
    else:
        # hold: the first three admitted stay; the rest are served without caching, every epoch
        assert cache["items"] == 3 and cache["evictions"] == 0
        for key in ["e0.tar", "e1.tar", "e2.tar"]:
            resp = client.get_object(Bucket=bucket, Key=key)
            assert resp["ResponseMetadata"]["HTTPHeaders"]["x-shardcache-cache"] == "hit"
        resp = client.get_object(Bucket=bucket, Key="e7.tar")
        assert resp["ResponseMetadata"]["HTTPHeaders"]["x-shardcache-cache"] == "miss"
        assert resp["Body"].read() == objects["e7.tar"]


def test_max_items_limit(s3_server, bucket, tmp_path, proxy, start_daemon):
    import dataclasses

    objects = {f"m{i}": b"x" * (i + 1) for i in range(6)}
    put_objects(s3_server.client(), bucket, objects)
    settings = make_settings(tmp_path / "cache", "s3", proxy.endpoint)
    settings = dataclasses.replace(settings, store=dataclasses.replace(settings.store, max_items=2))
    daemon = start_daemon(settings)
    for key, data in objects.items():
        assert daemon.client().get_object(Bucket=bucket, Key=key)["Body"].read() == data
        daemon.settle()
        assert daemon.stats()["cache"]["items"] <= 2


def test_short_circuit_answers_a_readable_path(s3_server, bucket, s3_daemon):
    data = os.urandom(300_000)
    put_objects(s3_server.client(), bucket, {"sc.tar": data})
    req = urllib.request.Request(f"{s3_daemon.url}/{bucket}/sc.tar", headers={"x-shardcache-short-circuit": "1"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        assert resp.read() == b""
        path = Path(resp.headers["x-shardcache-path"])
        assert int(resp.headers["x-shardcache-size"]) == len(data)
    assert path.read_bytes() == data
    assert not os.access(path, os.W_OK) or os.geteuid() == 0  # published read-only (root ignores modes)
    assert oct(path.stat().st_mode & 0o777) == "0o444"


@pytest.mark.slow
def test_prefetch_fills_the_cache_in_priority_order(s3_server, bucket, s3_daemon, proxy):
    objects = {f"p/{i}.tar": os.urandom(20_000) for i in range(12)}
    put_objects(s3_server.client(), bucket, objects)
    status, answer = _post(s3_daemon.url + "/_shardcache/prefetch", {
        "objects": [{"bucket": bucket, "key": k} for k in list(objects)[:6]], "priority": "warmup"})
    assert status == 202 and answer["accepted"] == 6
    status, answer = _post(s3_daemon.url + "/_shardcache/prefetch", {
        "urls": [f"s3://{bucket}/{k}" for k in list(objects)[6:]], "priority": "lease"})
    assert status == 202 and answer["accepted"] == 6
    wait_until(lambda: s3_daemon.stats()["cache"]["items"] == 12, timeout=30, what="prefetch to finish")
    client = s3_daemon.client()
    for key, data in objects.items():
        resp = client.get_object(Bucket=bucket, Key=key)
        assert resp["ResponseMetadata"]["HTTPHeaders"]["x-shardcache-cache"] == "hit"
        assert resp["Body"].read() == data
    # re-submitting cached objects queues nothing
    status, answer = _post(s3_daemon.url + "/_shardcache/prefetch", {"urls": [f"s3://{bucket}/p/0.tar"]})
    assert answer["accepted"] == 0
    with urllib.request.urlopen(f"{s3_daemon.url}/_shardcache/cached?url=s3://{bucket}/p/", timeout=10) as resp:
        cached = json.loads(resp.read())
    assert cached["objects"] == 12 and cached["fraction"] == 1.0


def test_priority_limiter_serves_demand_first_and_keeps_reserved_slots():
    async def scenario() -> list[str]:
        limiter = PriorityLimiter(limit=2, reserved=1)
        order: list[str] = []
        await limiter.acquire(WARMUP)  # the one non-reserved slot
        # a second warm-up must wait even though a slot is free: it is reserved for demand
        warm = asyncio.create_task(limiter.acquire(WARMUP))
        await asyncio.sleep(0)
        assert not warm.done()
        await limiter.acquire(DEMAND)  # demand takes the reserved slot at once
        lease = asyncio.create_task(limiter.acquire(LEASE))
        demand = asyncio.create_task(limiter.acquire(DEMAND))
        for name, task in (("warmup", warm), ("lease", lease), ("demand", demand)):
            task.add_done_callback(lambda _t, n=name: order.append(n))
        await asyncio.sleep(0)
        limiter.release()  # frees one slot: the demand waiter gets it although it came last
        await asyncio.sleep(0)
        limiter.release()
        await asyncio.sleep(0)
        limiter.release()
        await asyncio.sleep(0)
        limiter.release()
        await asyncio.sleep(0)
        await asyncio.gather(warm, lease, demand)
        return order

    assert asyncio.run(asyncio.wait_for(scenario(), 10)) == ["demand", "lease", "warmup"]


def test_metrics_have_units_and_move(s3_server, bucket, s3_daemon):
    put_objects(s3_server.client(), bucket, {"mm": b"m" * 1000})
    s3_daemon.client().get_object(Bucket=bucket, Key="mm")["Body"].read()
    s3_daemon.settle()
    s3_daemon.client().get_object(Bucket=bucket, Key="mm")["Body"].read()
    text = s3_daemon.metrics()
    for name in [
        'shardcache_cache_lookups_total{result="hit"} 1.0',
        'shardcache_cache_lookups_total{result="miss"} 1.0',
        'shardcache_served_bytes_total{source="hit"} 1000.0',
        "shardcache_origin_request_duration_seconds_bucket",
        "shardcache_cache_used_bytes 1000.0",
        "shardcache_cache_capacity_bytes",
        "shardcache_cache_evictions_total",
        "shardcache_origin_read_bytes_total 1000.0",
    ]:
        assert name in text, name


def test_sidecar_forwards_to_node_daemon_and_falls_back_standalone(s3_server, bucket, tmp_path, proxy, start_daemon):
    data = os.urandom(50_000)
    put_objects(s3_server.client(), bucket, {"sd.tar": data})
    sock = tmp_path / "run" / "daemon.sock"
    node = start_daemon(make_settings(tmp_path / "node-cache", "s3", proxy.endpoint, extra_listen=(f"unix://{sock}",)))
    sidecar = start_daemon(make_settings(tmp_path / "pod-cache", "s3", proxy.endpoint, mode="sidecar", upstream=f"unix://{sock}"))
    client = s3_client(sidecar.url)
    resp = client.get_object(Bucket=bucket, Key="sd.tar")
    assert resp["Body"].read() == data
    assert resp["ResponseMetadata"]["HTTPHeaders"]["x-shardcache-via"] == "upstream"
    node.settle()
    assert node.stats()["cache"]["items"] == 1 and sidecar.stats()["mode"] == "node"  # stats forwarded
    # short-circuit through the sidecar names the node daemon's file
    req = urllib.request.Request(f"{sidecar.url}/{bucket}/sd.tar", headers={"x-shardcache-short-circuit": "1"})
    with urllib.request.urlopen(req, timeout=10) as r:
        assert Path(r.headers["x-shardcache-path"]).read_bytes() == data
    node.stop()  # the node daemon goes away: the sidecar serves from its own cache dir
    resp = client.get_object(Bucket=bucket, Key="sd.tar")
    assert resp["Body"].read() == data
    assert "x-shardcache-via" not in resp["ResponseMetadata"]["HTTPHeaders"]
    with urllib.request.urlopen(sidecar.url + "/readyz", timeout=10) as r:
        assert json.loads(r.read()) == {"ready": True, "mode": "sidecar", "upstream": False}
    sidecar.settle()
    assert any((tmp_path / "pod-cache" / "v1" / "data").rglob("*"))


def test_manifest_is_never_cached(s3_server, bucket, s3_daemon):
    put_objects(s3_server.client(), bucket, {"ds/manifest.json": b'{"version": 1}'})
    client = s3_daemon.client()
    assert client.get_object(Bucket=bucket, Key="ds/manifest.json")["Body"].read() == b'{"version": 1}'
    put_objects(s3_server.client(), bucket, {"ds/manifest.json": b'{"version": 2}'})  # re-indexed
    resp = client.get_object(Bucket=bucket, Key="ds/manifest.json")
    assert resp["Body"].read() == b'{"version": 2}'
    assert resp["ResponseMetadata"]["HTTPHeaders"]["x-shardcache-cache"] == "miss"
    assert s3_daemon.stats()["cache"]["items"] == 0


def test_control_body_in_several_segments(s3_server, bucket, s3_daemon):
    import socket
    import time

    put_objects(s3_server.client(), bucket, {"seg.tar": b"s" * 100})
    body = json.dumps({"objects": [{"bucket": bucket, "key": "seg.tar"}]}).encode()
    with socket.create_connection(("127.0.0.1", s3_daemon.port), timeout=10) as sock:
        sock.sendall(b"POST /_shardcache/prefetch HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     + f"Content-Length: {len(body)}\r\n\r\n".encode() + body[:10])
        time.sleep(0.3)  # a slow client: the rest of the body comes later (the subject)
        sock.sendall(body[10:])
        answer = sock.recv(4096)
    assert b" 202 " in answer.split(b"\r\n", 1)[0], answer


@pytest.mark.slow
def test_prefetch_waits_while_a_trainer_waits_on_a_demand_fill(s3_server, bucket, s3_daemon, proxy):
    import threading
    import time

    objects = {"now.tar": os.urandom(600_000), "next1.tar": os.urandom(10_000), "next2.tar": os.urandom(10_000)}
    put_objects(s3_server.client(), bucket, objects)
    proxy.faults.trickle_bps = 1e6  # the demand fill takes ~0.6 s
    done_at: list[float] = []

    def demand() -> None:
        body = s3_daemon.client().get_object(Bucket=bucket, Key="now.tar")["Body"].read()
        assert body == objects["now.tar"]
        done_at.append(time.monotonic())

    reader = threading.Thread(target=demand)
    reader.start()
    wait_until(lambda: proxy.gets(f"/{bucket}/now.tar") == 1, what="the demand GET")
    status, _ = _post(s3_daemon.url + "/_shardcache/prefetch", {
        "objects": [{"bucket": bucket, "key": "next1.tar"}, {"bucket": bucket, "key": "next2.tar"}],
        "priority": "lease"})
    assert status == 202
    reader.join(30)
    wait_until(lambda: s3_daemon.stats()["cache"]["items"] == 3, timeout=30, what="prefetches")
    prefetch_starts = [t for t, line in proxy.timeline if "/next" in line]
    demand_fill_end = done_at[0]
    # the hinted shards were not fetched while the trainer's own shard was still coming in
    assert len(prefetch_starts) == 2 and min(prefetch_starts) >= demand_fill_end - 0.1
