"""The daemon's S3 read API, driven by boto3 against a real S3 endpoint (moto in its own process)."""

from __future__ import annotations

import concurrent.futures
import hashlib
import os

import pytest
from botocore.exceptions import ClientError

from tests.support.s3 import put_objects


def md5(data: bytes) -> str:
    return hashlib.md5(data).hexdigest()


def test_cold_then_warm_reads_are_byte_exact(s3_server, bucket, s3_daemon, proxy):
    objects = {
        "train/shard-0.tar": os.urandom(3 * 1024 * 1024 + 17),  # several 1 MiB parts
        "train/shard-1.tar": os.urandom(1000),
        "train/empty.tar": b"",
    }
    put_objects(s3_server.client(), bucket, objects)
    client = s3_daemon.client()
    for key, data in objects.items():
        cold = client.get_object(Bucket=bucket, Key=key)
        assert cold["ResponseMetadata"]["HTTPHeaders"]["x-shardcache-cache"] == "miss"
        assert cold["Body"].read() == data
        s3_daemon.settle()
        warm = client.get_object(Bucket=bucket, Key=key)
        assert warm["ResponseMetadata"]["HTTPHeaders"]["x-shardcache-cache"] == "hit"
        assert warm["Body"].read() == data
        assert warm["ContentLength"] == len(data)
    stats = s3_daemon.stats()
    assert stats["cache"]["items"] == 3
    assert stats["cache"]["used_bytes"] == sum(len(d) for d in objects.values())
    # download_fileobj (s3transfer, ranged parallel GETs) through the daemon
    import io

    buffer = io.BytesIO()
    client.download_fileobj(bucket, "train/shard-0.tar", buffer)
    assert buffer.getvalue() == objects["train/shard-0.tar"]


def test_keys_that_differ_only_in_slashes_are_distinct_objects(s3_server, bucket, s3_daemon):
    """A key ending in '/' (a folder marker) or holding '//' is its own key, through the cache and
    to the origin: never the object a path normalisation would make of it (the file origin's
    counterpart is in test_paths.py)."""
    objects = {"a": b"plain", "a/": b"marker", "a/b": b"slash", "a//b": b"double", "a/b/": b"b marker"}
    put_objects(s3_server.client(), bucket, objects)
    client = s3_daemon.client()
    for expected in ("miss", "hit"):
        for key, data in objects.items():
            got = client.get_object(Bucket=bucket, Key=key)
            assert (got["Body"].read(), got["ResponseMetadata"]["HTTPHeaders"]["x-shardcache-cache"]) == (data, expected), key
        s3_daemon.settle()


@pytest.mark.slow
def test_range_reads(s3_server, bucket, s3_daemon):
    data = os.urandom(2 * 1024 * 1024 + 5)
    put_objects(s3_server.client(), bucket, {"r.bin": data})
    client = s3_daemon.client()
    # cold ranged read (joins the fill), then warm ones (sendfile)
    for attempt in range(2):
        for rng, expected in [
            ("bytes=0-99", data[:100]),
            ("bytes=1048570-1048600", data[1048570:1048601]),
            ("bytes=2097000-", data[2097000:]),
            ("bytes=-10", data[-10:]),
            ("bytes=5-999999999", data[5:]),
        ]:
            resp = client.get_object(Bucket=bucket, Key="r.bin", Range=rng)
            assert resp["Body"].read() == expected, (attempt, rng)
            assert resp["ResponseMetadata"]["HTTPStatusCode"] == 206
            assert resp["ContentRange"].endswith(f"/{len(data)}")
    with pytest.raises(ClientError) as err:
        client.get_object(Bucket=bucket, Key="r.bin", Range=f"bytes={len(data)}-")
    assert err.value.response["Error"]["Code"] == "InvalidRange"
    assert err.value.response["ResponseMetadata"]["HTTPStatusCode"] == 416


def test_head_and_listing(s3_server, bucket, s3_daemon):
    keys = [f"train/{i:04d}.tar" for i in range(25)] + ["val/0000.tar", "manifest.json"]
    put_objects(s3_server.client(), bucket, {k: k.encode() for k in keys})
    client = s3_daemon.client()
    head = client.head_object(Bucket=bucket, Key="train/0003.tar")
    assert head["ContentLength"] == len(b"train/0003.tar")
    assert head["ResponseMetadata"]["HTTPHeaders"]["x-shardcache-cache"] == "miss"
    client.get_object(Bucket=bucket, Key="train/0003.tar")["Body"].read()
    s3_daemon.settle()
    head = client.head_object(Bucket=bucket, Key="train/0003.tar")
    assert head["ResponseMetadata"]["HTTPHeaders"]["x-shardcache-cache"] == "hit"

    paginator = client.get_paginator("list_objects_v2")
    listed = [obj["Key"] for page in paginator.paginate(Bucket=bucket, Prefix="train/", PaginationConfig={"PageSize": 10}) for obj in page.get("Contents", [])]
    assert listed == sorted(k for k in keys if k.startswith("train/"))
    top = client.list_objects_v2(Bucket=bucket, Delimiter="/")
    assert sorted(p["Prefix"] for p in top["CommonPrefixes"]) == ["train/", "val/"]
    assert [o["Key"] for o in top["Contents"]] == ["manifest.json"]


def test_errors_are_s3_xml_that_boto3_parses(s3_server, bucket, s3_daemon):
    client = s3_daemon.client()
    put_objects(s3_server.client(), bucket, {"a": b"a"})
    cases = [
        (lambda: client.get_object(Bucket=bucket, Key="missing"), "NoSuchKey", 404),
        (lambda: client.get_object(Bucket="no-such-bucket-xyz", Key="k"), "NoSuchBucket", 404),
        (lambda: client.put_object(Bucket=bucket, Key="a", Body=b"x"), "MethodNotAllowed", 405),
        (lambda: client.delete_object(Bucket=bucket, Key="a"), "MethodNotAllowed", 405),
        (lambda: client.list_objects_v2(Bucket="no-such-bucket-xyz"), "NoSuchBucket", 404),
    ]
    for call, code, status in cases:
        with pytest.raises(ClientError) as err:
            call()
        assert err.value.response["Error"]["Code"] == code
        assert err.value.response["ResponseMetadata"]["HTTPStatusCode"] == status
    # a failed lookup is not cached: the object appears at the origin and is then served
    put_objects(s3_server.client(), bucket, {"missing": b"now here"})
    assert client.get_object(Bucket=bucket, Key="missing")["Body"].read() == b"now here"
    # nothing was written by the refused PUT
    assert s3_server.client().get_object(Bucket=bucket, Key="a")["Body"].read() == b"a"


@pytest.mark.slow
def test_fifty_concurrent_readers_cause_one_origin_fetch(s3_server, bucket, s3_daemon, proxy):
    data = os.urandom(512 * 1024)  # below the part size: the fill is exactly one origin GET
    put_objects(s3_server.client(), bucket, {"hot.tar": data})
    proxy.faults.body_delay_s = 0.5  # hold the fill open so all readers arrive during it
    key_path = f"/{bucket}/hot.tar"

    def read(_: int) -> tuple[bytes, str]:
        resp = s3_daemon.client().get_object(Bucket=bucket, Key="hot.tar")
        return resp["Body"].read(), resp["ResponseMetadata"]["HTTPHeaders"]["x-shardcache-cache"]

    with concurrent.futures.ThreadPoolExecutor(50) as pool:
        results = list(pool.map(read, range(50)))
    assert all(body == data for body, _ in results)
    states = [state for _, state in results]
    assert states.count("miss") == 1
    assert set(states) <= {"miss", "coalesced", "hit"}
    assert proxy.gets(key_path) == 1, proxy.log


@pytest.mark.parametrize("split_below, gets", [(0, {1}), (float("inf"), {4, 5})])
def test_large_object_split_into_parallel_ranged_gets_only_when_slow(
    s3_server, bucket, tmp_path, proxy, start_daemon, split_below, gets
):
    from tests.support.daemons import make_settings, replace_fetch

    data = os.urandom(5 * 1024 * 1024 + 3)
    put_objects(s3_server.client(), bucket, {"big.tar": data})
    # 1 MiB parts: the first stream probes 1 MiB, then either keeps going alone (a fast origin)
    # or stops at 2 MiB while 3 more connections fetch [2, 5+) MiB in parts (a slow one).
    settings = replace_fetch(make_settings(tmp_path / "cache", "s3", proxy.endpoint), split_below_bytes_per_s=split_below)
    daemon = start_daemon(settings)
    assert daemon.client().get_object(Bucket=bucket, Key="big.tar")["Body"].read() == data
    # the split point follows the first 1 MiB write, so 3 or 4 more parts
    assert proxy.gets(f"/{bucket}/big.tar") in gets
    before = proxy.gets(f"/{bucket}/big.tar")
    daemon.settle()
    assert daemon.client().get_object(Bucket=bucket, Key="big.tar")["Body"].read() == data
    assert proxy.gets(f"/{bucket}/big.tar") == before  # warm: no origin traffic
