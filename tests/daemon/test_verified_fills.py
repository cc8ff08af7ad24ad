"""Every cached byte vouched for (issue 13): a proxy between the daemon and a real S3 server (moto,
in its own process) flips one bit once, truncates, resets and stalls; the origin sends S3's
additional checksums, or only ETags, or a multipart (composite) checksum; readers send the
manifest's xxh3-128 or not. Afterwards no complete answer held wrong bytes, and no wrong entry
stays in the cache."""

from __future__ import annotations

import dataclasses
import http.client
import os
import time
from pathlib import Path
from typing import Any

import boto3
import pytest
import xxhash
from botocore.config import Config

from sidecar.daemon.checksums import VerifySettings
from sidecar.daemon.claims import ClaimSettings
from sidecar.daemon.scrub import ScrubSettings
from tests.support.daemons import FAST_RETRY, make_settings
from tests.support.waits import wait_until

SIZE = 3 * 1024 * 1024 + 12345  # three 1 MiB parts and a bit: a split fill lands out of order


def _plain_client(s3_server: Any) -> Any:
    """A boto3 client that stores no additional checksum: the object has only its ETag (an MD5)."""
    return boto3.client("s3", endpoint_url=s3_server.endpoint,
                        config=Config(request_checksum_calculation="when_required"))


def put(s3_server: Any, bucket: str, key: str, data: bytes, kind: str) -> None:
    """``kind``: ``crc32`` (boto3's default upload checksum), ``etag`` (none: only the MD5 ETag),
    ``multipart`` (a composite CRC32 over two parts; its ETag is no MD5 either)."""
    if kind == "crc32":
        s3_server.client().put_object(Bucket=bucket, Key=key, Body=data)
    elif kind == "etag":
        _plain_client(s3_server).put_object(Bucket=bucket, Key=key, Body=data)
    else:
        client = s3_server.client()
        upload = client.create_multipart_upload(Bucket=bucket, Key=key, ChecksumAlgorithm="CRC32")
        half = 5 * 1024 * 1024  # S3's smallest part
        parts = []
        for number, chunk in enumerate((data[:half], data[half:]), start=1):
            answer = client.upload_part(Bucket=bucket, Key=key, UploadId=upload["UploadId"], PartNumber=number,
                                        Body=chunk, ChecksumAlgorithm="CRC32")
            parts.append({"PartNumber": number, "ETag": answer["ETag"], "ChecksumCRC32": answer["ChecksumCRC32"]})
        client.complete_multipart_upload(Bucket=bucket, Key=key, UploadId=upload["UploadId"],
                                         MultipartUpload={"Parts": parts})


def get(daemon: Any, path: str, headers: dict[str, str] | None = None) -> tuple[int, bytes, bool, dict[str, str]]:
    """(status, body, complete, headers): ``complete`` when the whole announced body arrived."""
    conn = http.client.HTTPConnection("127.0.0.1", daemon.port, timeout=20)
    try:
        conn.request("GET", path, headers=headers or {})
        resp = conn.getresponse()
        try:
            body = resp.read()
            complete = True
        except http.client.IncompleteRead as exc:
            body, complete = exc.partial, False
        except (ConnectionError, TimeoutError):
            body, complete = b"", False
        return resp.status, body, complete, {k.lower(): v for k, v in resp.getheaders()}
    finally:
        conn.close()


def cached_copies(cache_dir: Path) -> list[bytes]:
    return [p.read_bytes() for p in sorted((cache_dir / "v1" / "data").rglob("*")) if p.is_file()]


def start(start_daemon: Any, tmp_path: Path, proxy: Any, **changes: Any) -> Any:
    settings = make_settings(tmp_path / "cache", "s3", proxy.endpoint, **changes)
    return start_daemon(settings)


def no_md5(**changes: Any) -> Any:
    return dataclasses.replace(FAST_RETRY, verify=VerifySettings(etag_md5=False), **changes)


# -- the origin vouches: a flipped bit fails the fill, no answer completes, nothing is cached ----


@pytest.mark.parametrize("kind", ["crc32", "etag"])
@pytest.mark.parametrize("claimed", [False, True], ids=["no-claim", "claim"])
@pytest.mark.slow
def test_a_bit_flipped_once_on_the_wire_is_never_cached_nor_served(
    s3_server, bucket, proxy, tmp_path, start_daemon, kind, claimed
):
    data = os.urandom(SIZE)
    put(s3_server, bucket, "s.tar", data, kind)
    daemon = start(start_daemon, tmp_path, proxy)
    headers = {"x-shardcache-xxh3-128": xxhash.xxh3_128_hexdigest(data)} if claimed else {}
    proxy.faults.flip, proxy.faults.flip_at = 1, 777
    status, body, complete, _ = get(daemon, f"/{bucket}/s.tar", headers)
    assert any("flipped" in line for line in proxy.log)
    # The answer fails (a 502 before any byte for a claimant, a cut body for a streaming one):
    # never a complete answer with the wrong bytes.
    assert not (status == 200 and complete), (status, len(body))
    if claimed:
        assert status == 502 and b"BadDigest" in body
    daemon.settle()
    assert cached_copies(tmp_path / "cache") == []
    checks = daemon.stats()["verification"]
    assert checks["fills"]["failed"] == 1
    assert checks["fills_by_algorithm"] == {"crc32" if kind == "crc32" else "md5": 1.0}
    # The origin healed: the next read gets the right bytes, verified and cached.
    status, body, complete, _ = get(daemon, f"/{bucket}/s.tar", headers)
    assert (status, complete, body == data) == (200, True, True)
    daemon.settle()
    assert cached_copies(tmp_path / "cache") == [data]
    stats = daemon.stats()
    assert stats["cache"]["unverified_items"] == 0 and stats["verification"]["fills"]["verified"] == 1
    status, body, _, answer = get(daemon, f"/{bucket}/s.tar", headers)
    assert (status, body == data, answer["x-shardcache-cache"]) == (200, True, "hit")


@pytest.mark.parametrize("fault", ["truncate", "reset", "stall"])
@pytest.mark.slow
def test_transport_faults_are_retried_and_the_copy_is_verified(s3_server, bucket, proxy, tmp_path, start_daemon, fault):
    data = os.urandom(SIZE)
    put(s3_server, bucket, "s.tar", data, "crc32")
    daemon = start(start_daemon, tmp_path, proxy)
    setattr(proxy.faults, fault, 1)
    proxy.faults.truncate_at, proxy.faults.stall_s = 5000, 6.0  # longer than the daemon's 5 s read timeout
    status, body, complete, _ = get(daemon, f"/{bucket}/s.tar")
    assert (status, complete, body == data) == (200, True, True)
    daemon.settle()
    assert cached_copies(tmp_path / "cache") == [data]
    assert daemon.stats()["verification"]["fills"] == {"verified": 1.0, "unverified": 0.0, "failed": 0.0}


# -- nothing to verify against: unverified, and the manifest's claim heals it --------------------


@pytest.mark.parametrize("kind", ["multipart", "etag"])
def test_an_unverified_copy_is_marked_and_healed_by_the_manifests_claim(
    s3_server, bucket, proxy, tmp_path, start_daemon, kind
):
    data = os.urandom(6 * 1024 * 1024 + 99) if kind == "multipart" else os.urandom(SIZE)
    put(s3_server, bucket, "s.tar", data, kind)
    # An ETag-only object is unverifiable with MD5 verification off; a multipart one always is.
    daemon = start(start_daemon, tmp_path, proxy, fetch=no_md5())
    proxy.faults.flip, proxy.faults.flip_at = 1, 4321
    claim = {"x-shardcache-xxh3-128": xxhash.xxh3_128_hexdigest(data)}
    status, body, _, _ = get(daemon, f"/{bucket}/s.tar", claim)
    # The fill had nothing to check but the claim: the claimant gets an error, no byte.
    assert status == 409 and b"ChecksumMismatch" in body and b"unverified" in body
    daemon.settle()
    stats = daemon.stats()
    assert stats["cache"]["unverified_items"] == 1 and stats["verification"]["fills"]["unverified"] == 1
    assert "shardcache_cache_unverified_bytes " in daemon.metrics()
    # Read again with the claim (the loader does): the unverified copy is fetched once more, the
    # healed origin's bytes match, and they replace the bad copy.
    gets = proxy.gets(f"/{bucket}/s.tar")
    status, body, complete, _ = get(daemon, f"/{bucket}/s.tar", claim)
    assert (status, complete, body == data) == (200, True, True)
    assert proxy.gets(f"/{bucket}/s.tar") > gets
    daemon.settle()
    assert cached_copies(tmp_path / "cache") == [data]
    assert daemon.stats()["verification"]["claim_disputes"]["refetched"] == 1


def test_a_false_claim_never_purges_nor_refetches_a_verified_copy(s3_server, bucket, proxy, tmp_path, start_daemon):
    data = os.urandom(SIZE)
    put(s3_server, bucket, "s.tar", data, "crc32")
    daemon = start(start_daemon, tmp_path, proxy)
    assert get(daemon, f"/{bucket}/s.tar")[0] == 200
    daemon.settle()
    gets = proxy.gets(f"/{bucket}/s.tar")
    for _ in range(5):
        status, body, _, _ = get(daemon, f"/{bucket}/s.tar", {"x-shardcache-xxh3-128": "f" * 32})
        assert status == 409 and b"verified against the origin's crc32" in body and b"f" * 32 in body
    assert proxy.gets(f"/{bucket}/s.tar") == gets  # not one refetch
    status, body, _, answer = get(daemon, f"/{bucket}/s.tar")
    assert (status, body == data, answer["x-shardcache-cache"]) == (200, True, "hit")
    assert daemon.stats()["verification"]["claim_disputes"] == {"refetched": 0.0, "mismatch": 5.0}


def test_false_claims_refetch_an_unverified_copy_once_each_and_boundedly(
    s3_server, bucket, proxy, tmp_path, start_daemon
):
    data = os.urandom(100_000)
    put(s3_server, bucket, "s.tar", data, "etag")
    settings = dataclasses.replace(
        make_settings(tmp_path / "cache", "s3", proxy.endpoint, fetch=no_md5()),
        claims=ClaimSettings(refetches_per_minute=3),
    )
    daemon = start_daemon(settings)
    assert get(daemon, f"/{bucket}/s.tar")[0] == 200
    daemon.settle()
    gets = proxy.gets(f"/{bucket}/s.tar")
    same = {"x-shardcache-xxh3-128": "a" * 32}
    assert get(daemon, f"/{bucket}/s.tar", same)[0] == 409  # refetched once for this claim
    daemon.settle()
    assert get(daemon, f"/{bucket}/s.tar", same)[0] == 409  # and not again
    assert proxy.gets(f"/{bucket}/s.tar") == gets + 1
    for digit in "bcdef":  # other claims from the same caller: its budget runs out
        assert get(daemon, f"/{bucket}/s.tar", {"x-shardcache-xxh3-128": digit * 32})[0] == 409
        daemon.settle()
    assert proxy.gets(f"/{bucket}/s.tar") == gets + 3
    status, body, _, _ = get(daemon, f"/{bucket}/s.tar")
    assert (status, body == data) == (200, True)  # the copy itself is untouched


# -- a damaged cache file is never handed out ------------------------------------------------------


def _damage(cache_dir: Path, keep_stamp: bool = False) -> Path:
    (path,) = [p for p in (cache_dir / "v1" / "data").rglob("*") if p.is_file()]
    st = path.stat()
    path.chmod(0o644)
    with open(path, "r+b") as handle:
        handle.seek(100)
        byte = handle.read(1)
        handle.seek(100)
        handle.write(bytes([byte[0] ^ 0x40]))
    path.chmod(0o444)
    if keep_stamp:
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # only the ctime tells
    return path


def test_short_circuit_never_names_a_file_changed_on_disk(s3_server, bucket, proxy, tmp_path, start_daemon):
    data = os.urandom(SIZE)
    put(s3_server, bucket, "s.tar", data, "crc32")
    daemon = start(start_daemon, tmp_path, proxy)
    short = {"x-shardcache-short-circuit": "1"}
    assert get(daemon, f"/{bucket}/s.tar", short)[0] == 200
    daemon.settle()
    _damage(tmp_path / "cache", keep_stamp=True)
    time.sleep(0.01)
    for _ in range(5):
        status, _, _, answer = get(daemon, f"/{bucket}/s.tar", short)
        assert status == 200
        assert Path(answer["x-shardcache-path"]).read_bytes() == data  # a refetched copy, never the damaged one
    assert daemon.stats()["cache"]["corrupt_removed"] == 1


def test_the_scrubber_finds_a_damaged_file_without_a_read(s3_server, bucket, proxy, tmp_path, start_daemon):
    data = os.urandom(SIZE)
    put(s3_server, bucket, "s.tar", data, "crc32")
    settings = dataclasses.replace(
        make_settings(tmp_path / "cache", "s3", proxy.endpoint),
        scrub=ScrubSettings(bytes_per_s=1e9, min_age_s=0.2, idle_poll_s=0.05),
    )
    daemon = start_daemon(settings)
    assert get(daemon, f"/{bucket}/s.tar")[0] == 200
    daemon.settle()
    _damage(tmp_path / "cache", keep_stamp=True)
    wait_until(lambda: daemon.stats()["cache"]["corrupt_removed"] == 1, 10, what="the scrubber to find the damage")
    assert cached_copies(tmp_path / "cache") == []
    assert daemon.stats()["verification"]["scrubbed_bytes"] >= SIZE
    status, body, _, _ = get(daemon, f"/{bucket}/s.tar")
    assert (status, body == data) == (200, True)


# -- S3 clients get the origin's checksums back ----------------------------------------------------


def test_checksum_headers_are_answered_to_clients_that_ask(s3_server, bucket, proxy, tmp_path, start_daemon):
    data = os.urandom(100_000)
    put(s3_server, bucket, "s.tar", data, "crc32")
    daemon = start(start_daemon, tmp_path, proxy)
    mode = {"x-amz-checksum-mode": "ENABLED"}
    origin = s3_server.client().head_object(Bucket=bucket, Key="s.tar", ChecksumMode="ENABLED")["ChecksumCRC32"]
    for _ in ("miss", "hit"):
        _, body, _, answer = get(daemon, f"/{bucket}/s.tar", mode)
        assert body == data and answer["x-amz-checksum-crc32"] == origin
        daemon.settle()
    assert "x-amz-checksum-crc32" not in get(daemon, f"/{bucket}/s.tar")[3]  # not asked
    assert "x-amz-checksum-crc32" not in get(daemon, f"/{bucket}/s.tar", {**mode, "Range": "bytes=0-9"})[3]
    # boto3 asks on every GetObject and checks the body against it itself.
    answer = daemon.client().get_object(Bucket=bucket, Key="s.tar")
    assert answer["ChecksumCRC32"] == origin and answer["Body"].read() == data


# -- the loader: its manifest's checksum heals a bad copy instead of failing every run -----------


@pytest.mark.parametrize("short_circuit", [True, False], ids=["short-circuit", "http"])
@pytest.mark.slow
def test_loader_runs_heal_a_bad_unverified_copy(s3_server, bucket, proxy, tmp_path, start_daemon, short_circuit):
    from loader import LoaderSettings, ShardLoader
    from tests.support.shards import delivered, write_manifest, write_shards

    written = write_shards(tmp_path / "ds", shards=3, per_shard=5, sizes=(20_000, 40_000))
    write_manifest(written)
    plain = _plain_client(s3_server)  # ETag-only objects, and MD5 verification off: unverifiable
    for path in sorted(written.root.iterdir()):
        plain.put_object(Bucket=bucket, Key=f"ds/{path.name}", Body=path.read_bytes())
    daemon = start(start_daemon, tmp_path, proxy, fetch=no_md5())
    # A reader without the manifest fills the cache through one flipped bit: a bad copy, unverified.
    proxy.faults.flip, proxy.faults.flip_at = 1, 30_000
    first = written.keys[0]
    status, body, complete, _ = get(daemon, f"/{bucket}/ds/{first}")
    assert status == 200 and complete and body != (written.root / first).read_bytes()
    daemon.settle()
    assert daemon.stats()["cache"]["unverified_items"] == 1
    # Two loader runs in a row: both read every sample right (the claim refetches the bad copy once).
    for _run in range(2):
        settings = dataclasses.replace(LoaderSettings(), short_circuit=short_circuit)
        loader = ShardLoader(f"s3://{bucket}/ds/", endpoint=daemon.url, rank=0, world_size=1, epochs=1,
                             shuffle=False, settings=settings)
        assert delivered(list(loader)) == written.samples
        daemon.settle()
    assert sorted(cached_copies(tmp_path / "cache")) == sorted(p.read_bytes() for p in written.root.glob("*.tar"))
    assert daemon.stats()["verification"]["claim_disputes"]["refetched"] == 1


@pytest.mark.parametrize("algorithm", ["CRC64NVME", "CRC32C", "CRC32", "SHA256", "SHA1"])
@pytest.mark.slow
def test_every_additional_checksum_verifies_a_fill(s3_server, bucket, proxy, tmp_path, start_daemon, algorithm):
    data = os.urandom(SIZE)
    s3_server.client().put_object(Bucket=bucket, Key="s.tar", Body=data, ChecksumAlgorithm=algorithm)
    daemon = start(start_daemon, tmp_path, proxy)
    status, body, _, _ = get(daemon, f"/{bucket}/s.tar")
    assert (status, body == data) == (200, True)
    daemon.settle()
    assert daemon.stats()["verification"]["fills_by_algorithm"] == {algorithm.lower(): 1.0}
    proxy.faults.flip = 1  # and each catches a flipped bit
    daemon2 = start(start_daemon, tmp_path / "other", proxy)
    assert get(daemon2, f"/{bucket}/s.tar")[0] == 200
    daemon2.settle()
    assert daemon2.stats()["verification"]["fills"]["failed"] == 1 and cached_copies(tmp_path / "other" / "cache") == []


@pytest.mark.parametrize("kind", ["etag", "crc32"])
@pytest.mark.slow
def test_split_fills_end_without_hanging(s3_server, bucket, proxy, tmp_path, start_daemon, kind):
    """Found by the far-host benchmark: a fill split into parts whose last hashing run ended in
    the same loop turn as its parts waited for it forever (the daemon's loop spun)."""
    objects = {f"s{i}.tar": os.urandom(SIZE) for i in range(30)}
    for key, data in objects.items():
        put(s3_server, bucket, key, data, kind)
    always_split = no_md5(split_below_bytes_per_s=float("inf"), part_size=64 * 1024)
    daemon = start(start_daemon, tmp_path, proxy, fetch=always_split)
    for key, data in objects.items():
        status, body, complete, _ = get(daemon, f"/{bucket}/{key}")
        assert (status, complete, body == data) == (200, True, True), key
    daemon.settle()
    assert len(cached_copies(tmp_path / "cache")) == len(objects)
