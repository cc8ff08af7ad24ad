"""Real faults: origin down, throttling, truncated bodies, kill -9, flipped bits, a full disk."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from botocore.exceptions import ClientError

from tests.support.daemons import DaemonProcess, cache_files, make_settings
from tests.support.processes import free_port, kill9
from tests.support.s3 import put_objects, s3_client
from tests.support.waits import wait_until


def _error(call) -> tuple[str, int]:
    with pytest.raises(ClientError) as err:
        call()
    return err.value.response["Error"]["Code"], err.value.response["ResponseMetadata"]["HTTPStatusCode"]


def test_origin_down_gives_503_and_no_cache_entry(tmp_path, start_daemon):
    closed_port = free_port()  # nothing listens here
    daemon = start_daemon(make_settings(tmp_path / "cache", "s3", f"http://127.0.0.1:{closed_port}"))
    client = daemon.client()
    code, status = _error(lambda: client.get_object(Bucket="bucket", Key="train/0.tar"))
    assert (code, status) == ("ServiceUnavailable", 503)
    code, status = _error(lambda: client.head_object(Bucket="bucket", Key="train/0.tar"))
    assert status == 503
    code, status = _error(lambda: client.list_objects_v2(Bucket="bucket"))
    assert (code, status) == ("ServiceUnavailable", 503)
    stats = daemon.stats()
    assert stats["cache"]["items"] == 0 and stats["cache"]["reserved_bytes"] == 0
    assert "shardcache_origin_errors_total" in daemon.metrics()
    assert cache_files(tmp_path / "cache") == []


def test_throttling_is_retried_then_reported_as_slowdown(s3_server, bucket, s3_daemon, proxy):
    put_objects(s3_server.client(), bucket, {"a.tar": b"a" * 1000, "b.tar": b"b" * 1000})
    client = s3_daemon.client()
    proxy.faults.slowdown = 2  # two 503 SlowDown, then the origin recovers: retried transparently
    assert client.get_object(Bucket=bucket, Key="a.tar")["Body"].read() == b"a" * 1000
    proxy.faults.slowdown = -1  # throttled for good: bounded retries, then SlowDown to the caller
    assert _error(lambda: client.get_object(Bucket=bucket, Key="b.tar")) == ("SlowDown", 503)
    assert proxy.gets(f"/{bucket}/b.tar") == 4  # 1 attempt + 3 retries, bounded
    s3_daemon.settle()
    assert s3_daemon.stats()["cache"]["items"] == 1


@pytest.mark.slow
def test_truncated_bodies_are_retried_and_never_cached(s3_server, bucket, s3_daemon, proxy):
    data = os.urandom(300_000)
    put_objects(s3_server.client(), bucket, {"t.tar": data, "u.tar": data})
    client = s3_daemon.client()
    proxy.faults.truncate = 1
    proxy.faults.truncate_at = 1000
    assert client.get_object(Bucket=bucket, Key="t.tar")["Body"].read() == data
    s3_daemon.settle()
    proxy.faults.truncate = -1  # every answer cut: 502, no entry, no temp file left behind
    assert _error(lambda: client.get_object(Bucket=bucket, Key="u.tar")) == ("BadGateway", 502)
    s3_daemon.settle()
    stats = s3_daemon.stats()
    assert stats["cache"]["items"] == 1 and stats["cache"]["reserved_bytes"] == 0
    tmp_dir = Path(stats["cache"]["root"]) / "v1" / "tmp"
    assert list(tmp_dir.iterdir()) == []
    proxy.faults.truncate = 0
    assert client.get_object(Bucket=bucket, Key="u.tar")["Body"].read() == data


def test_stalled_origin_times_out_and_is_retried(s3_server, bucket, tmp_path, proxy, start_daemon):
    import dataclasses

    data = os.urandom(10_000)
    put_objects(s3_server.client(), bucket, {"slow.tar": data, "reset.tar": data})
    settings = make_settings(tmp_path / "cache", "s3", proxy.endpoint)
    settings = dataclasses.replace(settings, s3=dataclasses.replace(settings.s3, read_timeout_s=0.5))
    daemon = start_daemon(settings)
    proxy.faults.stall, proxy.faults.stall_s = 2, 1.5
    assert daemon.client().get_object(Bucket=bucket, Key="slow.tar")["Body"].read() == data
    # 3 GETs: two attempts timed out (0.5 s) instead of waiting the stalls out, the third answered
    assert proxy.gets(f"/{bucket}/slow.tar") == 3
    proxy.faults.reset = 2  # connections reset without an answer: retried too
    assert daemon.client().get_object(Bucket=bucket, Key="reset.tar")["Body"].read() == data
    assert proxy.gets(f"/{bucket}/reset.tar") == 3


@pytest.mark.slow
def test_bit_flip_in_cached_file_is_detected_and_refetched(s3_server, bucket, s3_daemon, proxy):
    data = os.urandom(200_000)
    put_objects(s3_server.client(), bucket, {"f.tar": data})
    client = s3_daemon.client()
    assert client.get_object(Bucket=bucket, Key="f.tar")["Body"].read() == data
    s3_daemon.settle()
    [data_file] = [p for p in cache_files(Path(s3_daemon.stats()["cache"]["root"])) if "/data/" in str(p)]
    os.chmod(data_file, 0o644)
    with open(data_file, "r+b") as handle:
        handle.seek(12345)
        byte = handle.read(1)
        handle.seek(12345)
        handle.write(bytes([byte[0] ^ 0x01]))
    resp = client.get_object(Bucket=bucket, Key="f.tar")
    assert resp["Body"].read() == data
    assert resp["ResponseMetadata"]["HTTPHeaders"]["x-shardcache-cache"] == "miss"
    assert proxy.gets(f"/{bucket}/f.tar") == 2
    s3_daemon.settle()
    assert s3_daemon.stats()["cache"]["corrupt_removed"] == 1


def test_corrupt_file_found_after_restart_is_refetched(s3_server, bucket, tmp_path, proxy, start_daemon):
    data = os.urandom(100_000)
    put_objects(s3_server.client(), bucket, {"g.tar": data})
    settings = make_settings(tmp_path / "cache", "s3", proxy.endpoint)
    daemon = start_daemon(settings)
    assert daemon.client().get_object(Bucket=bucket, Key="g.tar")["Body"].read() == data
    daemon.settle()
    daemon.stop()
    [data_file] = [p for p in cache_files(tmp_path / "cache") if "/data/" in str(p)]
    os.chmod(data_file, 0o644)
    raw = bytearray(data_file.read_bytes())
    raw[0] ^= 0xFF
    data_file.write_bytes(bytes(raw))
    daemon = start_daemon(settings)
    assert daemon.client().get_object(Bucket=bucket, Key="g.tar")["Body"].read() == data


@pytest.mark.slow
def test_kill9_during_fetch_leaves_no_partial_object(s3_server, bucket, tmp_path, proxy):
    data = os.urandom(6 * 1024 * 1024)
    put_objects(s3_server.client(), bucket, {"k.tar": data})
    proxy.faults.trickle_bps = 2e6  # a slow origin: the fill is in progress for ~3 s
    cache_dir = tmp_path / "cache"
    args = ["--origin", "s3", "--s3-endpoint", proxy.endpoint, "--cache-dir", str(cache_dir),
            "--cache-size", "1GiB", "--min-free", "0", "--part-size", "1MiB", "--parts-per-object", "2"]
    daemon = DaemonProcess(args, tmp_path / "daemon.log").start()
    reader = threading.Thread(
        target=lambda: _ignore(lambda: s3_client(daemon.url).get_object(Bucket=bucket, Key="k.tar")["Body"].read()),
        daemon=True,
    )
    reader.start()
    tmp_dir = cache_dir / "v1" / "tmp"
    wait_until(lambda: any(p.stat().st_size > 0 for p in tmp_dir.iterdir()), timeout=20, what="a fill to start writing")
    kill9(daemon.proc)
    reader.join(10)
    assert any(tmp_dir.iterdir())  # the crash left a partial temp file behind ...
    assert not any((cache_dir / "v1" / "meta").rglob("*.json"))  # ... and published nothing
    proxy.faults.trickle_bps = 0
    daemon = DaemonProcess(args, tmp_path / "daemon2.log").start()
    try:
        assert list(tmp_dir.iterdir()) == []  # start-up discarded it
        assert daemon.stats()["cache"]["items"] == 0
        assert s3_client(daemon.url).get_object(Bucket=bucket, Key="k.tar")["Body"].read() == data
    finally:
        daemon.stop()


@pytest.mark.slow
def test_kill9_after_publish_keeps_a_consistent_cache(s3_server, bucket, tmp_path, proxy):
    objects = {f"s{i}.tar": os.urandom(50_000 + i) for i in range(5)}
    put_objects(s3_server.client(), bucket, objects)
    cache_dir = tmp_path / "cache"
    args = ["--origin", "s3", "--s3-endpoint", proxy.endpoint, "--cache-dir", str(cache_dir),
            "--cache-size", "1GiB", "--min-free", "0"]
    daemon = DaemonProcess(args, tmp_path / "daemon.log").start()
    client = s3_client(daemon.url)
    for key, data in objects.items():
        assert client.get_object(Bucket=bucket, Key=key)["Body"].read() == data
    wait_until(lambda: daemon.stats()["fills_in_flight"] == 0, what="fills to finish")
    kill9(daemon.proc)
    # an orphan data file (crash between the data rename and the meta publish) must be dropped
    orphan = cache_dir / "v1" / "data" / "ff" / ("ff" * 16)
    orphan.parent.mkdir(parents=True, exist_ok=True)
    orphan.write_bytes(b"junk")
    daemon = DaemonProcess(args, tmp_path / "daemon2.log").start()
    try:
        assert daemon.stats()["cache"]["items"] == 5
        assert not orphan.exists()
        before = sum(proxy.gets(f"/{bucket}/{k}") for k in objects)
        client = s3_client(daemon.url)
        for key, data in objects.items():
            resp = client.get_object(Bucket=bucket, Key=key)
            assert resp["Body"].read() == data
            assert resp["ResponseMetadata"]["HTTPHeaders"]["x-shardcache-cache"] == "hit"
        assert sum(proxy.gets(f"/{bucket}/{k}") for k in objects) == before
    finally:
        daemon.stop()


def _ignore(fn) -> None:
    try:
        fn()
    except Exception:
        pass


@pytest.fixture
def small_fs(tmp_path: Path):
    """A real, tiny file system (tmpfs) that fills up."""
    mount = tmp_path / "small"
    mount.mkdir()
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)], capture_output=True)
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {result.stderr.decode().strip()}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def test_disk_full_serves_without_caching(s3_server, bucket, small_fs, proxy, start_daemon):
    objects = {f"d{i}.tar": os.urandom(700_000) for i in range(4)}  # 2.8 MB into a 2 MiB disk
    put_objects(s3_server.client(), bucket, objects)
    # The capacity setting believes there is room (10 GiB): only the real disk says no.
    daemon = start_daemon(make_settings(small_fs, "s3", proxy.endpoint, capacity=10 << 30))
    client = daemon.client()
    for _ in range(2):
        for key, data in objects.items():
            assert client.get_object(Bucket=bucket, Key=key)["Body"].read() == data
            daemon.settle()
    stats = daemon.stats()["cache"]
    assert stats["no_space"] >= 1
    assert 1 <= stats["items"] < 4
    assert stats["reserved_bytes"] == 0
    assert list((small_fs / "v1" / "tmp").iterdir()) == []


def test_sigterm_shuts_down_gracefully(tmp_path):
    origin = tmp_path / "origin" / "bk"
    origin.mkdir(parents=True)
    (origin / "x").write_bytes(b"x")
    sock = tmp_path / "d.sock"
    daemon = DaemonProcess(
        ["--origin", f"file://{tmp_path / 'origin'}", "--cache-dir", str(tmp_path / "c"), "--listen", f"unix://{sock}"],
        tmp_path / "daemon.log",
    ).start()
    assert sock.exists()
    began = time.monotonic()
    os.killpg(daemon.proc.pid, signal.SIGTERM)
    assert daemon.proc.wait(15) == 0
    assert time.monotonic() - began < 10
    assert not sock.exists()
    with pytest.raises(OSError):
        urllib.request.urlopen(daemon.url + "/healthz", timeout=2)
