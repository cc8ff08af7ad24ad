"""Byte sources for real: S3 (moto server) read directly with boto3, the real ``shardcache serve``
daemon with s3 and file origins (short-circuit reads, prefetch hints), and a misbehaving HTTP peer
that breaks connections, points short-circuit reads at files that are not here, and answers errors."""

from __future__ import annotations

import http.server
import json
import re
import threading
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from loader import (
    AccessDenied,
    ConfigError,
    CorruptShard,
    DatasetNotFound,
    LoaderSettings,
    ShardLoader,
    ShardNotFound,
    SourceError,
)
from tests.support.processes import free_port
from tests.support.shards import Written, delivered, write_manifest, write_shards
from tests.support.waits import wait_until


def upload(client: Any, bucket: str, written: Written, prefix: str) -> None:
    for path in sorted(written.root.iterdir()):
        client.put_object(Bucket=bucket, Key=prefix + path.name, Body=path.read_bytes())


@pytest.fixture
def s3_dataset(s3_server: Any, bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[str, Written]:
    """Shards and a manifest under s3://bucket/train/; boto3 finds moto through AWS_ENDPOINT_URL."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server.endpoint)
    written = write_shards(tmp_path / "w", shards=4, per_shard=6, sizes=(10, 200_000))
    write_manifest(written)
    upload(s3_server.client(), bucket, written, "train/")
    return f"s3://{bucket}/train/", written


@pytest.mark.slow
def test_s3_direct_byte_exact(s3_dataset: tuple[str, Written], s3_server: Any, bucket: str, tmp_path: Path) -> None:
    url, written = s3_dataset
    loader = ShardLoader(url, endpoint="", seed=3)
    assert [s.key for s in loader.shards] == written.keys
    assert all(s.xxh3_128 for s in loader.shards)  # the manifest was read
    assert delivered(list(loader)) == written.samples
    # without a manifest the prefix is listed
    other = write_shards(tmp_path / "o", shards=2, per_shard=3, seed=7)
    upload(s3_server.client(), bucket, other, "nomanifest/")
    listed = ShardLoader(f"s3://{bucket}/nomanifest", endpoint="")
    assert [(s.key, s.size) for s in listed.shards] == [(k, (other.root / k).stat().st_size) for k in other.keys]
    assert delivered(list(listed)) == other.samples


def test_s3_faults(s3_dataset: tuple[str, Written], s3_server: Any, bucket: str) -> None:
    url, written = s3_dataset
    client = s3_server.client()
    whole = (written.root / written.keys[1]).read_bytes()
    client.put_object(Bucket=bucket, Key="train/" + written.keys[1], Body=whole[: len(whole) // 2])
    with pytest.raises(CorruptShard, match=written.keys[1]):
        list(ShardLoader(url, endpoint="", shuffle=False))
    client.delete_object(Bucket=bucket, Key="train/" + written.keys[1])
    with pytest.raises(ShardNotFound, match="NoSuchKey"):
        list(ShardLoader(url, endpoint="", shuffle=False))
    with pytest.raises(DatasetNotFound):
        _ = ShardLoader("s3://no-such-bucket-here/x/", endpoint="").shards
    with pytest.raises(DatasetNotFound):
        _ = ShardLoader(f"s3://{bucket}/empty-prefix/", endpoint="").shards


def test_through_daemon_with_s3_origin(s3_dataset: tuple[str, Written], s3_server: Any, start_daemon: Callable[..., str]) -> None:
    url, written = s3_dataset
    endpoint = start_daemon("s3", env={"AWS_ENDPOINT_URL": s3_server.endpoint})
    loader = ShardLoader(url, endpoint=endpoint, seed=1)
    assert delivered(list(loader)) == written.samples
    stats = json.load(urllib.request.urlopen(endpoint + "/_shardcache/stats"))
    assert stats["served_bytes"]["short_circuit"] > 0  # same machine: the cache files are readable
    # short-circuit off: streamed over HTTP, from the cache this time
    http_only = ShardLoader(url, endpoint=endpoint, settings=LoaderSettings(short_circuit=False))
    assert delivered(list(http_only)) == written.samples
    stats = json.load(urllib.request.urlopen(endpoint + "/_shardcache/stats"))
    assert stats["served_bytes"]["hit"] > 0


def test_endpoint_from_environment(dataset: tuple[str, Written], start_daemon: Callable[..., str], monkeypatch: pytest.MonkeyPatch) -> None:
    url, written = dataset
    root = url[len("file://") :].split("/bkt/")[0]
    endpoint = start_daemon(f"file://{root}")
    monkeypatch.setenv("SHARDCACHE_ENDPOINT", endpoint)
    loader = ShardLoader(url)
    assert loader.settings.endpoint == endpoint
    assert delivered(list(loader)) == written.samples
    assert loader._source().via == endpoint
    # endpoint="" reads the origin directly even with the variable set
    assert ShardLoader(url, endpoint="")._source().via == "file"


def test_through_daemon_with_file_origin(dataset: tuple[str, Written], start_daemon: Callable[..., str], tmp_path: Path) -> None:
    url, written = dataset
    root = url[len("file://") :].split("/bkt/")[0]
    endpoint = start_daemon(f"file://{root}")
    loader = ShardLoader(url, endpoint=endpoint, rank=0, world_size=1, seed=8)
    assert delivered(list(loader)) == written.samples
    handle = loader._source().open(loader.shards[0])
    try:
        assert type(handle).__name__ == "FileIO"  # a short-circuit read of the cache file
    finally:
        handle.close()
    elsewhere = write_shards(tmp_path / "elsewhere", shards=1, per_shard=1)
    with pytest.raises(ConfigError, match="not under the cache's origin root"):
        _ = ShardLoader(f"file://{elsewhere.root}/", endpoint=endpoint).shards
    with pytest.raises(ConfigError, match="first directory under"):
        _ = ShardLoader(f"file://{root}/", endpoint=endpoint).shards


def test_through_a_unix_socket(dataset: tuple[str, Written], start_daemon: Callable[..., str], tmp_path: Path) -> None:
    url, written = dataset
    root = url[len("file://") :].split("/bkt/")[0]
    sock = tmp_path / "daemon.sock"
    start_daemon(f"file://{root}", unix=sock)
    loader = ShardLoader(url, endpoint=f"unix://{sock}", settings=LoaderSettings(short_circuit=False))
    assert delivered(list(loader)) == written.samples


def test_prefetch_hints_reach_the_daemon(tmp_path: Path, start_daemon: Callable[..., str]) -> None:
    written = write_shards(tmp_path / "root" / "bk" / "p", shards=5, per_shard=3)
    write_manifest(written)
    endpoint = start_daemon(f"file://{tmp_path}/root")
    loader = ShardLoader(
        f"file://{tmp_path}/root/bk/p/", endpoint=endpoint, shuffle=False, settings=LoaderSettings(lease_ahead=3)
    )
    first = next(iter(loader))  # reading shard 0 hints shards 1..3
    assert first["__url__"].endswith(written.keys[0])

    def cached() -> int:
        answer = json.load(urllib.request.urlopen(f"{endpoint}/_shardcache/cached?url=s3://bk/p/"))
        return int(answer["cached"])

    def prefetched() -> int:
        return int(json.load(urllib.request.urlopen(endpoint + "/_shardcache/stats"))["prefetch"]["done"])

    # Shard 1 is also opened ahead (loader.ahead): whichever reaches the daemon first fills it,
    # so at least shards 2 and 3 are prefetches.
    wait_until(lambda: prefetched() >= 2 and cached() >= 4, timeout=20, what="the hinted shards cached")
    # shard 0 (read) and shards 1-3 (hinted); not shard 4, and not the manifest (never cached)
    assert cached() == 4


def test_daemon_down_is_a_clear_error(dataset: tuple[str, Written]) -> None:
    url, _ = dataset
    loader = ShardLoader(
        "s3://bucket/x/", endpoint=f"http://127.0.0.1:{free_port()}",
        settings=LoaderSettings(io_attempts=2, retry_backoff_s=0.01),
    )
    with pytest.raises(SourceError, match="failed after 2 attempts.*daemon/sidecar is running"):
        _ = loader.shards


# -- a misbehaving peer ------------------------------------------------------------------------


class Peer:
    """An HTTP server speaking the daemon API badly on purpose. ``mode`` per test."""

    def __init__(self, objects: dict[str, bytes]) -> None:
        self.objects = objects
        self.requests: list[tuple[str, str, dict[str, str]]] = []
        self.mode = "cut"
        self.cut_after = 5000
        self.cut_times: dict[str, int] = {}
        peer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def _send(self, status: int, body: bytes, headers: dict[str, str] | None = None) -> None:
                self.send_response(status)
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length)
                peer.requests.append(("POST", self.path, {"body": body.decode()}))
                self._send(202, b'{"accepted": 1}')

            def do_GET(self) -> None:
                peer.requests.append(("GET", self.path, dict(self.headers)))
                if self.path.startswith("/_shardcache/stats"):
                    return self._send(200, b'{"origin": "s3"}')
                if peer.mode == "garbage500":
                    return self._send(500, b"<<<not xml")
                if peer.mode == "denied":
                    return self._send(403, b"<Error><Code>AccessDenied</Code><Message>no</Message></Error>")
                key = self.path.lstrip("/")
                data = peer.objects.get(key)
                if data is None:
                    return self._send(404, b"<Error><Code>NoSuchKey</Code><Message>gone</Message></Error>")
                if self.headers.get("x-shardcache-short-circuit") == "1":
                    return self._send(200, b"", {"x-shardcache-path": "/nonexistent/cache/file", "x-shardcache-size": str(len(data)), "ETag": '"e1"'})
                match = re.match(r"bytes=(\d+)-$", self.headers.get("Range", ""))
                start = int(match.group(1)) if match else 0
                body = data[start:]
                self.send_response(206 if match else 200)
                self.send_header("Content-Length", str(len(body)))
                self.send_header("ETag", '"e1"')
                self.end_headers()
                times = peer.cut_times.get(key, 0)
                if peer.mode == "cut" and times < 3 and len(body) > peer.cut_after:
                    peer.cut_times[key] = times + 1
                    self.wfile.write(body[: peer.cut_after])  # then drop the connection
                    self.wfile.flush()
                    self.close_connection = True
                    return
                self.wfile.write(body)

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def peer(tmp_path: Path) -> Iterator[tuple[Peer, Written]]:
    written = write_shards(tmp_path / "w", shards=3, per_shard=4, sizes=(1000, 30_000))
    write_manifest(written)
    objects = {f"bkt/ds/{p.name}": p.read_bytes() for p in written.root.iterdir()}
    server = Peer(objects)
    try:
        yield server, written
    finally:
        server.close()


FAST = LoaderSettings(io_attempts=5, retry_backoff_s=0.01)


def test_broken_connections_resume_and_short_circuit_falls_back(peer: tuple[Peer, Written]) -> None:
    server, written = peer
    loader = ShardLoader("s3://bkt/ds/", endpoint=server.url, settings=FAST)
    assert delivered(list(loader)) == written.samples
    gets = [h for m, p, h in server.requests if m == "GET" and p.endswith(".tar")]
    assert sum(1 for h in gets if h.get("x-shardcache-short-circuit") == "1") == 1  # asked once, then stopped
    assert any(h.get("Range", "").startswith("bytes=") for h in gets)  # resumed, not restarted
    assert all(v == 3 for v in server.cut_times.values()) and len(server.cut_times) == 3


def test_connection_cut_more_often_than_the_budget(peer: tuple[Peer, Written]) -> None:
    server, _ = peer
    server.cut_after = 100
    loader = ShardLoader("s3://bkt/ds/", endpoint=server.url, settings=LoaderSettings(io_attempts=2, retry_backoff_s=0.01, short_circuit=False))
    with pytest.raises(SourceError, match="failed after 2 attempts"):
        list(loader)


@pytest.mark.parametrize("mode, error, match", [
    ("garbage500", SourceError, "HTTP500"),
    ("denied", AccessDenied, "AccessDenied"),
])
def test_error_answers(peer: tuple[Peer, Written], mode: str, error: type, match: str) -> None:
    server, _ = peer
    server.mode = mode
    with pytest.raises(error, match=match):
        list(ShardLoader("s3://bkt/ds/", endpoint=server.url, settings=FAST))


def test_missing_object_behind_the_daemon(peer: tuple[Peer, Written]) -> None:
    server, written = peer
    del server.objects[f"bkt/ds/{written.keys[0]}"]
    with pytest.raises(ShardNotFound, match="NoSuchKey"):
        list(ShardLoader("s3://bkt/ds/", endpoint=server.url, settings=FAST, shuffle=False))
    # The hint goes out from its own thread (loader.hints), after the failed open's request.
    wait_until(lambda: any(m == "POST" for m, _, _ in server.requests), timeout=10, what="the prefetch hint")
    prefetches = [h["body"] for m, p, h in server.requests if m == "POST"]
    assert prefetches and json.loads(prefetches[0]) == {
        "objects": [{"bucket": "bkt", "key": f"ds/{written.keys[1]}"}], "priority": "lease"
    }
