"""Hostile input against every handler: traversal, NUL, bad JSON, huge headers and bodies."""

from __future__ import annotations

import http.client
import json
import socket
import urllib.parse
import xml.etree.ElementTree as ET

import botocore.exceptions
import pytest

from tests.support.daemons import cache_files, make_settings
from tests.support.s3 import s3_client
from tests.support.waits import wait_until
from wire.web import ConnectionLimits


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
    # A claim, not an order: the caller gets an error naming both hashes and no byte; the
    # origin's copy is what the cache keeps (a file origin vouches for nothing: unverified).
    assert status == 409 and b"ChecksumMismatch" in body and b"0" * 32 in body
    wait_until(lambda: file_daemon.stats()["cache"]["items"] == 1, 10, what="the fill published")
    assert file_daemon.stats()["cache"]["unverified_items"] == 1


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


# -- issue 12: hostile input gets a 4xx S3 error body that parses ---------------------------------

HUGE = "9" * 5000  # past Python's int digit limit (4300)


def s3_error(body: bytes) -> tuple[str, str]:
    """The code and resource of an S3 error body, which must parse as XML."""
    root = ET.fromstring(body)
    assert root.tag == "Error", body[:200]
    return root.findtext("Code") or "", root.findtext("Resource") or ""


@pytest.mark.parametrize(
    ("header", "status", "expected"),
    [
        (f"bytes={HUGE}-", 416, None),  # starts past the end: unsatisfiable
        (f"bytes={HUGE}-{HUGE}", 416, None),
        (f"bytes=0-{HUGE}", 206, b"shard zero"),  # the end is clamped to the object's
        (f"bytes=2-{HUGE}", 206, b"ard zero"),
        (f"bytes=-{HUGE}", 206, b"shard zero"),  # the last N bytes, N past the size: all of it
        (f"bytes={HUGE}-1", 200, b"shard zero"),  # last < first: malformed, ignored like S3
        (f"bytes=1-{HUGE}0,2-3", 200, b"shard zero"),  # multi-range: ignored
    ],
    ids=["huge-start", "huge-both", "huge-end", "huge-end-from-2", "huge-suffix", "end-before-start", "multi"],
)
def test_ranges_with_huge_numbers_are_answered_like_s3(file_daemon, header, status, expected):
    got, body, headers = raw(file_daemon, "GET", "/bk/train/0.tar", headers={"Range": header})
    assert got == status, (header[:30], body[:300])
    if expected is None:
        assert s3_error(body)[0] == "InvalidRange" and headers["Content-Range"] == "bytes */10"
    else:
        assert body == expected
    assert raw(file_daemon, "GET", "/bk/train/0.tar")[:2] == (200, b"shard zero")


def test_boto3_reads_huge_ranges_as_s3_answers_them(file_daemon):
    client = s3_client(file_daemon.url)
    assert client.get_object(Bucket="bk", Key="train/0.tar", Range=f"bytes=0-{HUGE}")["Body"].read() == b"shard zero"
    with pytest.raises(botocore.exceptions.ClientError) as caught:
        client.get_object(Bucket="bk", Key="train/0.tar", Range=f"bytes={HUGE}-")
    assert caught.value.response["Error"]["Code"] == "InvalidRange"


DEEP = b'{"objects": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"


@pytest.mark.parametrize("path", ["/_shardcache/prefetch", "/_shardcache/warmups"])
def test_deeply_nested_json_is_400(file_daemon, path):
    status, data, _ = raw(file_daemon, "POST", path, body=DEEP, headers={"Content-Type": "application/json"})
    assert status == 400, data[:300]
    answer = json.loads(data)
    assert answer["error"] == "InvalidArgument" and "nested too deeply" in answer["message"]
    assert raw(file_daemon, "GET", "/bk/train/0.tar")[:2] == (200, b"shard zero")


@pytest.mark.parametrize("char", [*map(chr, range(1, 32)), "\x7f"])
def test_every_control_character_in_a_key_is_the_same_400(file_daemon, char):
    path = "/bk/train/a" + urllib.parse.quote(char) + "b"
    for method in ("GET", "HEAD"):
        status, body, _ = raw(file_daemon, method, path)
        assert status == 400, (repr(char), method, body[:300])
    code, resource = s3_error(raw(file_daemon, "GET", path)[1])
    assert code == "InvalidArgument"
    assert resource.startswith("/bk/train/a") and resource.endswith("b")


@pytest.mark.parametrize("char", ["\n", "\r", "\x01", "\x1b", "\x7f"])
def test_boto3_reads_the_code_of_an_error_about_a_control_character(file_daemon, char):
    client = s3_client(file_daemon.url)
    with pytest.raises(botocore.exceptions.ClientError) as caught:
        client.get_object(Bucket="bk", Key=f"train/a{char}b")
    assert caught.value.response["Error"]["Code"] == "InvalidArgument"
    assert caught.value.response["ResponseMetadata"]["HTTPStatusCode"] == 400


@pytest.mark.parametrize("path", ["/bk/a%01b/../c", "/bk%0A/key", "/b%0Ak/key", "/bk/%FF%FE", "/bk/%ED%A0%80"])
def test_error_bodies_parse_whatever_the_path_holds(file_daemon, path):
    status, body, _ = raw(file_daemon, "GET", path)
    assert 400 <= status < 500, (path, body[:300])
    assert s3_error(body)[0]


# -- issue 12: slow clients cannot hold the daemon's connections ----------------------------------


def closed_within(sock: socket.socket, seconds: float) -> bytes:
    """What the daemon sends before it closes ``sock``; socket.timeout if it is still open."""
    sock.settimeout(seconds)
    data = b""
    while chunk := sock.recv(4096):
        data += chunk
    return data


def guarded(tmp_path, start_daemon, timeout_s: float):
    root = tmp_path / "origin"
    (root / "bk" / "train").mkdir(parents=True)
    (root / "bk" / "train" / "0.tar").write_bytes(b"shard zero")
    limits = ConnectionLimits(header_timeout_s=timeout_s, idle_timeout_s=timeout_s, max_connections=4)
    sock = tmp_path / "d.sock"
    daemon = start_daemon(make_settings(tmp_path / "cache", f"file://{root}", extra_listen=(f"unix://{sock}",),
                                        connections=limits))
    daemon.sock = sock
    return daemon


@pytest.fixture
def guarded_daemon(tmp_path, start_daemon):
    return guarded(tmp_path, start_daemon, 0.5)


@pytest.mark.parametrize("sent", [b"", b"GET /bk/train/0.tar HTTP/1.1\r\nHost: x\r\nRange: by"],
                         ids=["nothing", "half-headers"])
@pytest.mark.parametrize("family", ["tcp", "unix"])
@pytest.mark.slow
def test_a_connection_without_a_whole_head_is_closed_within_the_bound(guarded_daemon, sent, family):
    if family == "tcp":
        sock = socket.create_connection(("127.0.0.1", guarded_daemon.port), timeout=5)
    else:
        sock = socket.socket(socket.AF_UNIX)
        sock.connect(str(guarded_daemon.sock))
    with sock:
        sock.sendall(sent)
        assert closed_within(sock, 5) == b""
    assert raw(guarded_daemon, "GET", "/bk/train/0.tar")[:2] == (200, b"shard zero")


def test_an_idle_kept_alive_connection_is_closed(guarded_daemon):
    conn = http.client.HTTPConnection("127.0.0.1", guarded_daemon.port, timeout=5)
    conn.request("GET", "/bk/train/0.tar")
    resp = conn.getresponse()
    assert (resp.status, resp.read()) == (200, b"shard zero") and not resp.will_close
    assert closed_within(conn.sock, 5) == b""  # the daemon hung up on the idle connection
    conn.close()


@pytest.mark.slow
def test_beyond_the_connection_limit_clients_are_refused_then_served_once_slow_ones_go(tmp_path, start_daemon):
    # Bounds long enough that the slow connections still hold their slots when the refusal is checked.
    guarded_daemon = guarded(tmp_path, start_daemon, 3.0)
    slow = [socket.create_connection(("127.0.0.1", guarded_daemon.port), timeout=5) for _ in range(4)]
    try:
        # Every slot is held, by a connection that sends nothing: the next one is refused, and
        # boto3 (without retries) sees the 503 or the closed connection.
        wait_until(lambda: b" 503 " in socket_answer(guarded_daemon.port), timeout=10, what="a refusal")
        for sock in slow:
            assert closed_within(sock, 5) == b""
    finally:
        for sock in slow:
            sock.close()
    client = s3_client(guarded_daemon.url, retries=3)
    for _ in range(10):
        assert client.get_object(Bucket="bk", Key="train/0.tar")["Body"].read() == b"shard zero"


def socket_answer(port: int) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        try:
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            return sock.recv(200)
        except ConnectionResetError:
            return b""
