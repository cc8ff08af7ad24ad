"""The latency proxy the suite puts between readers and the store: it must add its delay to every
request (also on a kept-alive connection), pass bytes through unchanged, pace a connection when
asked, and close cleanly when the upstream is gone or the client sends garbage."""

from __future__ import annotations

import http.client
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.latency_proxy import LatencyProxy

DELAY_MS = 80


@pytest.fixture(scope="module")
def blob_key(s3_server) -> tuple[str, str, bytes]:  # type: ignore[no-untyped-def]
    bucket = s3_server.new_bucket()
    data = os.urandom(3 * 1024 * 1024)
    s3_server.client().put_object(Bucket=bucket, Key="blob.bin", Body=data)
    return bucket, "blob.bin", data


@pytest.fixture
def proxy(s3_server, tmp_path: Path) -> Iterator[LatencyProxy]:  # type: ignore[no-untyped-def]
    with LatencyProxy(s3_server.endpoint, DELAY_MS, None, tmp_path / "proxy.log") as running:
        yield running


def _signed(proxy: LatencyProxy, bucket: str, key: str, method: str = "get_object") -> str:
    """A presigned path for the proxy's address (moto checks signatures, as S3 does)."""
    from urllib.parse import urlsplit

    from bench.common import s3_client

    url = s3_client(proxy.endpoint).generate_presigned_url(method, Params={"Bucket": bucket, "Key": key}, ExpiresIn=600)
    parts = urlsplit(url)
    return parts.path + "?" + parts.query


def _get(conn: http.client.HTTPConnection, path: str) -> tuple[float, bytes, int]:
    started = time.monotonic()
    conn.request("GET", path)
    resp = conn.getresponse()
    body = resp.read()
    return time.monotonic() - started, body, resp.status


def test_every_request_waits_the_delay_and_bytes_pass_unchanged(proxy: LatencyProxy, blob_key) -> None:  # type: ignore[no-untyped-def]
    bucket, key, data = blob_key
    conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=30)
    try:
        for _ in range(3):  # the same kept-alive connection: the delay is per request, not per connection
            elapsed, body, status = _get(conn, _signed(proxy, bucket, key))
            assert status == 200
            assert body == data
            assert elapsed >= DELAY_MS / 1000 * 0.95
    finally:
        conn.close()


def test_pipe_delay_does_not_serialise_concurrent_requests(proxy: LatencyProxy, blob_key) -> None:  # type: ignore[no-untyped-def]
    from concurrent.futures import ThreadPoolExecutor

    bucket, key, _ = blob_key
    path = _signed(proxy, bucket, key, "head_object")

    def one(_: int) -> float:
        conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=30)
        try:
            conn.request("HEAD", path)
            resp = conn.getresponse()
            resp.read()
            assert resp.status == 200
            return time.monotonic()
        finally:
            conn.close()

    started = time.monotonic()
    with ThreadPoolExecutor(8) as pool:
        ends = list(pool.map(one, range(8)))
    # 8 requests in parallel cost about one delay, not eight.
    assert max(ends) - started < 8 * DELAY_MS / 1000 * 0.75


def test_stream_rate_cap_paces_one_connection(s3_server, blob_key, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    bucket, key, data = blob_key
    with LatencyProxy(s3_server.endpoint, 0, 10.0, tmp_path / "paced.log") as paced:  # 10 MB/s
        conn = http.client.HTTPConnection("127.0.0.1", paced.port, timeout=30)
        try:
            elapsed, body, status = _get(conn, _signed(paced, bucket, key))
        finally:
            conn.close()
    assert status == 200 and body == data
    assert elapsed >= len(data) / 10e6 * 0.8


def test_garbage_and_dead_upstream_close_the_connection(tmp_path: Path) -> None:
    from bench.common import free_port

    dead = f"127.0.0.1:{free_port()}"  # nothing listens there
    with LatencyProxy(dead, 5, None, tmp_path / "dead.log") as proxy:
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as sock:
            sock.sendall(b"\x00\xff" * 10000 + b"GET / HTTP/1.1\r\n\r\n")
            assert sock.recv(1024) == b""  # closed, no answer invented
        # the proxy still serves new connections after that
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as sock:
            assert sock.recv(1024) == b""
        assert proxy.proc is not None and proxy.proc.poll() is None


def test_total_rate_cap_is_shared_by_all_connections(s3_server, blob_key, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """4 parallel connections through a 20 MB/s total cap take 4x as long as one would alone; a
    per-connection cap of the same rate would let them finish in the time of one."""
    from concurrent.futures import ThreadPoolExecutor

    bucket, key, data = blob_key
    rate = 20e6
    with LatencyProxy(s3_server.endpoint, 0, None, tmp_path / "total.log", total_mbps=rate / 1e6) as capped:
        path = _signed(capped, bucket, key)

        def one(_: int) -> bytes:
            conn = http.client.HTTPConnection("127.0.0.1", capped.port, timeout=60)
            try:
                _elapsed, body, status = _get(conn, path)
                assert status == 200
                return body
            finally:
                conn.close()

        started = time.monotonic()
        with ThreadPoolExecutor(4) as pool:
            bodies = list(pool.map(one, range(4)))
        elapsed = time.monotonic() - started
    assert all(body == data for body in bodies)
    assert elapsed >= 4 * len(data) / rate * 0.8


def test_total_rate_cap_flag_is_validated(tmp_path: Path) -> None:
    import subprocess
    import sys

    from bench.common import REPO

    proc = subprocess.run([sys.executable, "-m", "bench.latency_proxy", "--port", "1", "--upstream", "127.0.0.1:2",
                           "--total-mbps", "0"], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert proc.returncode == 2
    assert "--total-mbps" in proc.stderr
