"""The daemon's warm-up job API (``sidecar.daemon.warmups``), in this process so the blocking-call guard
watches its event loop: the job lifecycle, verification, and hostile input."""

from __future__ import annotations

import http.client
import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cache import StoreSettings
from sidecar.daemon.fills import FetchSettings
from sidecar.daemon.settings import ServeSettings
from tests.support.datasets import make_shards, write_dataset, xxh3
from tests.support.processes import free_port
from tests.support.threads import DaemonThread
from tests.support.waits import wait_until

SHARDS = make_shards(5, seed=11)


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[DaemonThread]:
    write_dataset(tmp_path / "root" / "bkt" / "train", SHARDS)
    settings = ServeSettings(
        store=StoreSettings(root=tmp_path / "cache", capacity_bytes=1 << 30, min_free_ratio=0.0),
        listen=(f"tcp://127.0.0.1:{free_port()}",),
        origin=f"file://{tmp_path}/root",
        fetch=FetchSettings(retries=1, backoff_base_s=0.01, backoff_max_s=0.02),
        prefetch_workers=2,
    )
    d = DaemonThread(settings).start()
    try:
        yield d
    finally:
        d.stop()


def call(d: DaemonThread, method: str, path: str, body: Any = None, raw: bytes | None = None,
         headers: dict[str, str] | None = None) -> tuple[int, Any]:
    conn = http.client.HTTPConnection("127.0.0.1", d.port, timeout=30)
    try:
        payload = raw if raw is not None else (None if body is None else json.dumps(body).encode())
        conn.request(method, path, body=payload, headers=headers or {})
        resp = conn.getresponse()
        data = resp.read()
        try:
            return resp.status, json.loads(data)
        except ValueError:
            return resp.status, data
    finally:
        conn.close()


def objects(keys: list[str] | None = None, with_digest: bool = True) -> list[dict[str, Any]]:
    chosen = keys if keys is not None else sorted(SHARDS)
    return [
        {"bucket": "bkt", "key": f"train/{k}", "size": len(SHARDS[k]), **({"xxh3_128": xxh3(SHARDS[k])} if with_digest else {})}
        for k in chosen
    ]


def wait_state(d: DaemonThread, ident: str, timeout: float = 20) -> dict[str, Any]:
    answer: dict[str, Any] = {}

    def finished() -> bool:
        nonlocal answer
        status, answer = call(d, "GET", f"/_shardcache/warmups/{ident}")
        return status == 200 and answer["state"] != "running"

    wait_until(finished, timeout=timeout, what=f"warm-up {ident} to finish")
    return answer


def test_job_lifecycle_and_idempotent_create(daemon: DaemonThread):
    status, created = call(daemon, "POST", "/_shardcache/warmups", {"objects": objects()})
    assert status == 201
    ident = created["id"]
    assert created["files"]["total"] == 5 and created["bytes"]["total"] == sum(len(v) for v in SHARDS.values())
    # Same request, other order: the same job (attached or, if already finished, run again).
    again_status, again = call(daemon, "POST", "/_shardcache/warmups", {"objects": objects()[::-1]})
    assert again["id"] == ident and again_status in (200, 201)
    done = wait_state(daemon, ident)
    assert done["state"] == "done" and done["verified"] == 5 and done["failed"] == []
    assert done["bytes"]["done"] == done["bytes"]["total"]
    listed = call(daemon, "GET", "/_shardcache/warmups")[1]["warmups"]
    assert [w["id"] for w in listed] == [ident] and "failed" not in listed[0]
    # Run again once finished: every object is already cached and re-verified, nothing fetched.
    before = json.loads(call(daemon, "GET", "/_shardcache/stats")[1]["origin_read_bytes"].__str__())
    status, rerun = call(daemon, "POST", "/_shardcache/warmups", {"objects": objects(), "id": ident})
    assert status == 201
    rerun = wait_state(daemon, ident)
    assert rerun["files"]["cached_before"] == 5 and rerun["bytes"]["fetched"] == 0
    assert call(daemon, "GET", "/_shardcache/stats")[1]["origin_read_bytes"] == before
    # Deleting a finished job leaves its state as it was.
    status, deleted = call(daemon, "DELETE", f"/_shardcache/warmups/{ident}")
    assert status == 200 and deleted["state"] == "done"


def test_wrong_checksum_and_missing_object_fail_with_reasons(daemon: DaemonThread):
    bad = objects(["train-000000.tar", "train-000001.tar"])
    bad[0]["xxh3_128"] = "0" * 32
    bad.append({"bucket": "bkt", "key": "train/nope.tar"})
    status, created = call(daemon, "POST", "/_shardcache/warmups", {"objects": bad, "id": "bad-1"})
    assert status == 201 and created["id"] == "bad-1"
    final = wait_state(daemon, "bad-1")
    assert final["state"] == "failed"
    reasons = {f["key"]: f["reason"] for f in final["failed"]}
    assert set(reasons) == {"train/train-000000.tar", "train/nope.tar"}
    assert "checksum mismatch" in reasons["train/train-000000.tar"]
    assert "not found" in reasons["train/nope.tar"]
    assert final["files"]["done"] == 1 and final["verified"] == 1


def test_bandwidth_limit_slows_the_job(daemon: DaemonThread):
    total = sum(len(v) for v in SHARDS.values())
    rate = total // 2  # about two seconds' worth, less the one-second burst
    began = time.monotonic()
    status, created = call(daemon, "POST", "/_shardcache/warmups",
                           {"objects": objects(), "bandwidth_bytes_per_s": rate, "concurrency": 4})
    assert status == 201 and created["bandwidth_bytes_per_s"] == rate
    final = wait_state(daemon, created["id"])
    elapsed = time.monotonic() - began
    assert final["state"] == "done"
    # Granted bytes <= burst (one second) + rate * elapsed + the last object.
    largest = max(len(v) for v in SHARDS.values())
    assert total <= rate * (1 + elapsed) + largest
    assert elapsed >= (total - rate - largest) / rate - 0.05


def test_cancel_running_job(daemon: DaemonThread):
    rate = 1024  # bytes per second: the job cannot finish during this test
    status, _ = call(daemon, "POST", "/_shardcache/warmups",
                     {"objects": objects(), "bandwidth_bytes_per_s": rate, "concurrency": 1, "id": "slow"})
    assert status == 201
    # A running job with the same id but other objects is a conflict; nothing changes.
    status, conflict = call(daemon, "POST", "/_shardcache/warmups", {"objects": objects()[:2], "id": "slow"})
    assert status == 409 and conflict["error"] == "WarmupConflict"
    status, cancelled = call(daemon, "DELETE", "/_shardcache/warmups/slow")
    assert status == 200 and cancelled["state"] == "cancelled"
    assert call(daemon, "GET", "/_shardcache/warmups/slow")[1]["state"] == "cancelled"


HOSTILE = [
    ("POST", "/_shardcache/warmups", b"{not json", 400, "InvalidArgument"),
    ("POST", "/_shardcache/warmups", b"[1, 2]", 400, "InvalidArgument"),
    ("POST", "/_shardcache/warmups", b"\xff\xfe\x00", 400, "InvalidArgument"),
    ("POST", "/_shardcache/warmups", json.dumps({"objects": []}).encode(), 400, "InvalidArgument"),
    ("POST", "/_shardcache/warmups", json.dumps({"objects": [{"bucket": "bkt", "key": "../../etc/passwd"}]}).encode(), 400, "InvalidArgument"),
    ("POST", "/_shardcache/warmups", json.dumps({"objects": [{"bucket": "bkt", "key": "a\u0000b"}]}).encode(), 400, "InvalidArgument"),
    ("POST", "/_shardcache/warmups", json.dumps({"objects": [{"bucket": "../x", "key": "k"}]}).encode(), 400, "InvalidArgument"),
    ("POST", "/_shardcache/warmups", json.dumps({"objects": [{"bucket": "bkt", "key": "k", "xxh3_128": "zz"}]}).encode(), 400, "InvalidArgument"),
    ("POST", "/_shardcache/warmups", json.dumps({"objects": [{"bucket": "bkt", "key": "k", "size": -1}]}).encode(), 400, "InvalidArgument"),
    ("POST", "/_shardcache/warmups", json.dumps({"objects": [{"bucket": "bkt", "key": "k", "evil": 1}]}).encode(), 400, "InvalidArgument"),
    ("POST", "/_shardcache/warmups", json.dumps({"objects": [{"bucket": "bkt", "key": "k"}, {"bucket": "bkt", "key": "k"}]}).encode(), 400, "InvalidArgument"),
    ("POST", "/_shardcache/warmups", json.dumps({"urls": ["http://elsewhere/x"]}).encode(), 400, "InvalidArgument"),
    ("POST", "/_shardcache/warmups", json.dumps({"urls": ["file:///etc/passwd"]}).encode(), 400, "InvalidArgument"),
    ("POST", "/_shardcache/warmups", json.dumps({"objects": [{"bucket": "bkt", "key": "k"}], "id": "../x"}).encode(), 400, "InvalidArgument"),
    ("POST", "/_shardcache/warmups", json.dumps({"objects": [{"bucket": "bkt", "key": "k"}], "bandwidth_bytes_per_s": True}).encode(), 400, "InvalidArgument"),
    ("POST", "/_shardcache/warmups", json.dumps({"objects": [{"bucket": "bkt", "key": "k"}], "bandwidth_bytes_per_s": 0}).encode(), 400, "InvalidArgument"),
    ("POST", "/_shardcache/warmups", json.dumps({"objects": [{"bucket": "bkt", "key": "k"}], "concurrency": 10_000}).encode(), 400, "InvalidArgument"),
    ("POST", "/_shardcache/warmups", json.dumps({"objects": [{"bucket": "bkt", "key": "k"}], "priority": "demand"}).encode(), 400, "InvalidArgument"),
    ("POST", "/_shardcache/warmups", json.dumps({"objects": [{"bucket": "bkt", "key": "k"}], "extra": 1}).encode(), 400, "InvalidArgument"),
    ("GET", "/_shardcache/warmups/no-such-job", None, 404, "NoSuchWarmup"),
    ("DELETE", "/_shardcache/warmups/no-such-job", None, 404, "NoSuchWarmup"),
    ("GET", "/_shardcache/warmups/%2E%2E%2Fetc", None, 400, "InvalidArgument"),
    ("GET", "/_shardcache/warmups/" + "a" * 300, None, 400, "InvalidArgument"),
]


def test_hostile_requests_get_clear_4xx_and_change_nothing(daemon: DaemonThread):
    status, _ = call(daemon, "POST", "/_shardcache/warmups", {"objects": objects(), "id": "keep"})
    assert status == 201
    wait_state(daemon, "keep")
    before = call(daemon, "GET", "/_shardcache/warmups")[1]
    for method, path, raw, code, error in HOSTILE:
        status, answer = call(daemon, method, path, raw=raw)
        assert status == code, (method, path, raw, answer)
        assert isinstance(answer, dict) and answer["error"] == error and answer["message"], (path, raw, answer)
    after = call(daemon, "GET", "/_shardcache/warmups")[1]

    def strip(doc: dict) -> list[dict]:
        return [{k: v for k, v in w.items() if k not in ("rate_bytes_per_s",)} for w in doc["warmups"]]

    assert strip(after) == strip(before)


def test_huge_body_is_refused_without_reading_it_all(daemon: DaemonThread):
    from sidecar.daemon.warmups import MAX_BODY

    # Declared too large: refused from the header alone.
    with socket.create_connection(("127.0.0.1", daemon.port), timeout=10) as sock:
        sock.sendall(
            b"POST /_shardcache/warmups HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {MAX_BODY + 1}\r\n\r\n".encode() + b"{" * 1024
        )
        head = sock.recv(65536).decode("latin-1")
    assert head.startswith("HTTP/1.1 413"), head[:200]
    # Chunked (no length), over the limit: refused once the limit is passed.
    conn = http.client.HTTPConnection("127.0.0.1", daemon.port, timeout=60)

    def chunks() -> Iterator[bytes]:
        piece = b" " * (1 << 20)
        for _ in range(MAX_BODY // len(piece) + 2):
            yield piece

    try:
        conn.request("POST", "/_shardcache/warmups", body=chunks(), encode_chunked=True,
                     headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 413
        assert json.loads(resp.read())["error"] == "BodyTooLarge"
    except (BrokenPipeError, ConnectionResetError):
        pass  # the daemon may close the connection as soon as it answered
    finally:
        conn.close()
    assert call(daemon, "GET", "/_shardcache/warmups")[1] == {"warmups": []}
