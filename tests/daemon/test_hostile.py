"""Hostile input against every handler: traversal, NUL, bad JSON, huge headers and bodies."""

from __future__ import annotations

import http.client
import json
import socket

import pytest

from tests.daemon.conftest import cache_files, make_settings


@pytest.fixture
def file_daemon(tmp_path, start_daemon):
    root = tmp_path / "origin"
    (root / "bk" / "train").mkdir(parents=True)
    (root / "bk" / "train" / "0.tar").write_bytes(b"shard zero")
    secret = tmp_path / "secret.txt"
    secret.write_bytes(b"do not serve me")
    (root / "bk" / "escape").symlink_to(secret)
    daemon = start_daemon(make_settings(tmp_path / "cache", f"file://{root}"))
    daemon.secret = secret
    daemon.cache_dir = tmp_path / "cache"
    return daemon


def raw(daemon, method: str, path: str, body: bytes | None = None, headers: dict | None = None) -> tuple[int, bytes, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", daemon.port, timeout=10)
    conn.putrequest(method, path, skip_accept_encoding=True)  # path sent as is, no normalisation
    for name, value in (headers or {}).items():
        conn.putheader(name, value)
    if body is not None:
        conn.putheader("Content-Length", str(len(body)))
    conn.endheaders()
    if body is not None:
        conn.send(body)
    resp = conn.getresponse()
    data = resp.read()
    conn.close()
    return resp.status, data, dict(resp.getheaders())


@pytest.mark.parametrize(
    "path",
    [
        "/bk/../../secret.txt",
        "/bk/train/../../../secret.txt",
        "/bk/%2e%2e/%2e%2e/secret.txt",
        "/bk/train/..%2f..%2f..%2fsecret.txt",
        "/bk/train/0.tar%00.jpg",
        "/bk/./train/0.tar",
        "/..%2f/secret.txt",
        "/bk/" + "a" * 1100,
        "/bk/%01control",
        "/bk/back%5cslash",
    ],
)
def test_traversal_and_nul_are_rejected_with_400(file_daemon, path):
    before = cache_files(file_daemon.cache_dir)
    status, body, _ = raw(file_daemon, "GET", path)
    assert status == 400, (path, body)
    assert b"<Code>InvalidArgument</Code>" in body
    assert b"do not serve me" not in body
    assert cache_files(file_daemon.cache_dir) == before


def test_symlink_out_of_the_bucket_is_refused(file_daemon):
    status, body, _ = raw(file_daemon, "GET", "/bk/escape")
    assert status == 403 and b"AccessDenied" in body
    assert b"do not serve me" not in body
    status, body, _ = raw(file_daemon, "GET", "/bk/train/0.tar")
    assert (status, body) == (200, b"shard zero")


def test_bad_bucket_names(file_daemon):
    for path in ["/..", "/a", "/-bad/key", "/bad%00name/key", "/" + "b" * 300 + "/k"]:
        status, body, _ = raw(file_daemon, "GET", path)
        assert status == 400, path


def test_huge_headers_are_refused(file_daemon):
    status, _, _ = raw(file_daemon, "GET", "/bk/train/0.tar", headers={"X-Big": "x" * 100_000})
    assert status in (400, 431)
    status, _, _ = raw(file_daemon, "GET", "/bk/train/0.tar?" + "q=1&" * 5000)
    assert status in (400, 414)
    # the daemon is still fine afterwards
    assert raw(file_daemon, "GET", "/bk/train/0.tar")[:2] == (200, b"shard zero")


def test_many_headers_and_garbage_request_line(file_daemon):
    with socket.create_connection(("127.0.0.1", file_daemon.port), timeout=5) as sock:
        sock.sendall(b"\x00\x01GARBAGE\r\n\r\n")
        answer = sock.recv(100)
        assert answer.startswith(b"HTTP/1.") and b" 400 " in answer
    headers = {f"X-H{i}": "v" for i in range(500)}
    status, _, _ = raw(file_daemon, "GET", "/bk/train/0.tar", headers=headers)
    assert status in (200, 400, 431)
    assert raw(file_daemon, "GET", "/bk/train/0.tar")[:2] == (200, b"shard zero")


@pytest.mark.parametrize(
    "body",
    [
        b"{not json",
        b"[1, 2, 3]",
        b'{"objects": "nope"}',
        b'{"objects": [{"bucket": "bk"}]}',
        b'{"objects": [{"bucket": "bk", "key": "../x"}]}',
        b'{"objects": [{"bucket": "bk", "key": "train/0.tar"}], "priority": "urgent"}',
        b'{"urls": ["http://evil/x"]}',
        b'{"urls": ["s3://bk/a\\u0000b"]}',
        b"{}",
        b"\xff\xfe\x00",
        b'{"objects": [{"bucket": "bk", "key": "k", "xxh3_128": "zz"}]}',
    ],
)
def test_prefetch_rejects_malformed_bodies(file_daemon, body):
    status, data, _ = raw(file_daemon, "POST", "/_shardcache/prefetch", body=body, headers={"Content-Type": "application/json"})
    assert status == 400, data
    answer = json.loads(data)
    assert answer["error"] == "InvalidArgument" and answer["message"]
    assert sum(file_daemon.stats()["prefetch"]["queued"].values()) == 0


def test_prefetch_huge_body_is_413(file_daemon):
    body = b'{"urls": [' + b'"s3://bk/k",' * 900_000 + b'"s3://bk/k"]}'
    try:
        status, _, _ = raw(file_daemon, "POST", "/_shardcache/prefetch", body=body)
    except (BrokenPipeError, ConnectionResetError):
        status = 413  # the server may close the connection before reading it all
    assert status == 413
    assert raw(file_daemon, "GET", "/bk/train/0.tar")[:2] == (200, b"shard zero")


def test_cached_query_validation(file_daemon):
    assert raw(file_daemon, "GET", "/_shardcache/cached")[0] == 400
    assert raw(file_daemon, "GET", "/_shardcache/cached?url=s3://bk/../../")[0] == 400
    status, data, _ = raw(file_daemon, "GET", "/_shardcache/cached?url=s3://bk/train/")
    assert status == 200 and json.loads(data)["objects"] == 1


def test_expected_checksum_header_is_validated(file_daemon):
    status, _, _ = raw(file_daemon, "GET", "/bk/train/0.tar", headers={"x-shardcache-xxh3-128": "nothex"})
    assert status == 400
    status, body, _ = raw(file_daemon, "GET", "/bk/train/0.tar", headers={"x-shardcache-xxh3-128": "0" * 32})
    assert status == 502 and b"BadDigest" in body  # the bytes do not match: not cached, error to caller
    assert file_daemon.stats()["cache"]["items"] == 0


def test_a_full_prefetch_queue_is_a_slowdown_with_retry_after(tmp_path, start_daemon):
    root = tmp_path / "origin"
    (root / "bk").mkdir(parents=True)
    daemon = start_daemon(make_settings(tmp_path / "cache", f"file://{root}", prefetch_queue_max=2))
    body = json.dumps({"objects": [{"bucket": "bk", "key": f"{i}.tar"} for i in range(3)]}).encode()
    status, answer, headers = raw(daemon, "POST", "/_shardcache/prefetch", body, {"Content-Type": "application/json"})
    assert status == 503, answer
    assert json.loads(answer)["error"] == "SlowDown" and "retry later" in json.loads(answer)["message"]
    assert int(headers["Retry-After"]) >= 1
    assert sum(daemon.stats()["prefetch"]["queued"].values()) == 0
