"""Object headers and conditional requests, compared field by field with the origin (moto).

Every S3 client reads more than the bytes: ``aws s3 cp`` needs ``LastModified``, s3fs and pyarrow
report it as the file's mtime, rclone sets it on the copy, and browsers and gateways act on
``Content-Type``, ``Content-Encoding`` and ``x-amz-meta-*``. The daemon answers each of them as the
origin sent them, on a miss, on a hit and on a hit after a restart; and answers
``If-Match``/``If-None-Match``/``If-Modified-Since``/``If-Unmodified-Since`` with S3's statuses.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import urllib.error
import urllib.request
from collections.abc import Callable
from email.utils import formatdate
from pathlib import Path
from typing import Any

import pytest
from botocore.exceptions import ClientError

from cache import Store, StoreSettings
from tests.support.daemons import make_settings
from tests.support.processes import free_port

FIELDS = (
    "ContentLength", "ContentType", "ETag", "LastModified", "Metadata", "CacheControl", "ContentEncoding",
    "ContentDisposition", "ContentLanguage", "ExpiresString",
)

EXPIRES = datetime.datetime(2031, 5, 6, 7, 8, 9, tzinfo=datetime.UTC)


def put_described(client: Any, bucket: str) -> dict[str, bytes]:
    """One object with every stored header S3 keeps, one with none (S3's defaults)."""
    client.put_object(
        Bucket=bucket, Key="described.tar", Body=b"described bytes" * 100,
        ContentType="application/x-tar; charset=binary", Metadata={"Shard": "0007", "origin-name": "a b=c"},
        CacheControl="max-age=3600, immutable", ContentEncoding="identity",
        ContentDisposition='attachment; filename="described.tar"', ContentLanguage="en-GB", Expires=EXPIRES,
    )
    client.put_object(Bucket=bucket, Key="plain.bin", Body=b"plain")
    return {"described.tar": b"described bytes" * 100, "plain.bin": b"plain"}


def fields(resp: dict[str, Any]) -> dict[str, Any]:
    return {name: resp.get(name) for name in FIELDS}


def cache_state(resp: dict[str, Any]) -> str:
    return str(resp["ResponseMetadata"]["HTTPHeaders"]["x-shardcache-cache"])


def assert_like_origin(origin: Any, daemon: Any, bucket: str, key: str, data: bytes, state: str) -> None:
    expected = fields(origin.head_object(Bucket=bucket, Key=key))
    head = daemon.head_object(Bucket=bucket, Key=key)
    assert fields(head) == expected, (key, state, "HEAD")
    get = daemon.get_object(Bucket=bucket, Key=key)
    assert get["Body"].read() == data
    assert fields(get) == expected, (key, state, "GET")
    assert cache_state(get) == state
    ranged = daemon.get_object(Bucket=bucket, Key=key, Range="bytes=1-3")
    assert ranged["Body"].read() == data[1:4]
    origin_ranged = origin.get_object(Bucket=bucket, Key=key, Range="bytes=1-3")
    origin_ranged["Body"].read()
    assert {**fields(ranged), "ContentLength": None} == {**fields(origin_ranged), "ContentLength": None}


def test_miss_and_hit_answer_the_origins_headers(s3_server, bucket, s3_daemon):
    objects = put_described(s3_server.client(), bucket)
    origin = s3_server.client()
    client = s3_daemon.client()
    for key, data in objects.items():
        assert_like_origin(origin, client, bucket, key, data, "miss")
        s3_daemon.settle()
        assert_like_origin(origin, client, bucket, key, data, "hit")
    # What the origin answered for the object put without any: S3's default type.
    assert client.head_object(Bucket=bucket, Key="plain.bin")["ContentType"] == "binary/octet-stream"


def test_headers_survive_a_restart(s3_server, bucket, tmp_path, start_daemon):
    objects = put_described(s3_server.client(), bucket)
    settings = make_settings(tmp_path / "cache", "s3", s3_server.endpoint)
    first = start_daemon(settings)
    for key in objects:
        first.client().get_object(Bucket=bucket, Key=key)["Body"].read()
    first.settle()
    first.stop()
    again = start_daemon(dataclasses.replace(settings, listen=(f"tcp://127.0.0.1:{free_port()}",)))
    origin = s3_server.client()
    for key, data in objects.items():
        assert_like_origin(origin, again.client(), bucket, key, data, "hit")


def test_uncached_names_and_short_circuit_carry_the_headers(s3_server, bucket, s3_daemon):
    origin = s3_server.client()
    origin.put_object(Bucket=bucket, Key="ds/manifest.json", Body=b"{}", ContentType="application/json",
                      Metadata={"version": "3"})
    client = s3_daemon.client()
    # manifest.json is never cached: straight from the origin, with its headers.
    assert fields(client.get_object(Bucket=bucket, Key="ds/manifest.json")) == fields(
        origin.head_object(Bucket=bucket, Key="ds/manifest.json")
    )
    put_described(origin, bucket)
    client.get_object(Bucket=bucket, Key="described.tar")["Body"].read()
    s3_daemon.settle()
    request = urllib.request.Request(
        f"{s3_daemon.url}/{bucket}/described.tar", headers={"x-shardcache-short-circuit": "1"}
    )
    with urllib.request.urlopen(request, timeout=10) as resp:
        assert resp.headers["x-shardcache-path"]
        assert resp.headers["Last-Modified"] == origin.head_object(
            Bucket=bucket, Key="described.tar")["ResponseMetadata"]["HTTPHeaders"]["last-modified"]
        assert resp.headers["x-amz-meta-shard"] == "0007"


def test_file_origin_answers_mtime_and_s3s_default_type(tmp_path, start_daemon):
    root = tmp_path / "origin"
    (root / "data").mkdir(parents=True)
    shard = root / "data" / "s.tar"
    shard.write_bytes(b"file origin bytes")
    os.utime(shard, (1_700_000_000.7, 1_700_000_000.7))
    daemon = start_daemon(make_settings(tmp_path / "cache", f"file://{root}"))
    client = daemon.client()
    expected_lm = datetime.datetime.fromtimestamp(1_700_000_000, datetime.UTC)
    for state in ("miss", "hit"):
        head = client.head_object(Bucket="data", Key="s.tar")
        get = client.get_object(Bucket="data", Key="s.tar")
        assert get["Body"].read() == b"file origin bytes"
        assert cache_state(get) == state
        for resp in (head, get):
            assert resp["LastModified"] == expected_lm
            assert resp["ResponseMetadata"]["HTTPHeaders"]["last-modified"] == formatdate(1_700_000_000, usegmt=True)
            assert resp["ContentType"] == "binary/octet-stream"
        daemon.settle()


# -- the cache entry keeps them ----------------------------------------------------------------


def _store(root: Path) -> Store:
    store = Store(StoreSettings(root=root, capacity_bytes=1 << 20, min_free_ratio=0.0))
    store.open()
    return store


def _put(store: Store, headers: tuple[tuple[str, str], ...]) -> str:
    writer = store.begin("b", "k", '"e"', 3, last_modified="Tue, 01 Dec 2026 10:00:00 GMT", headers=headers)
    assert writer is not None
    writer.write_at(0, b"abc")
    return writer.commit().id


def test_entry_headers_persist_and_older_entries_still_load(tmp_path):
    headers = (("Content-Type", "text/plain"), ("x-amz-meta-a", "b"))
    store = _store(tmp_path)
    ident = _put(store, headers)
    store.close()
    store = _store(tmp_path)
    entry = store.lookup("b", "k")
    assert entry is not None and entry.id == ident
    assert entry.headers == headers and entry.last_modified == "Tue, 01 Dec 2026 10:00:00 GMT"
    store.close()
    # A meta file written before the daemon kept headers: the entry loads, with none.
    meta_path = next((tmp_path / "v1" / "meta").glob("*/*.json"))
    meta = json.loads(meta_path.read_text())
    del meta["headers"], meta["last_modified"]
    meta_path.write_text(json.dumps(meta))
    store = _store(tmp_path)
    entry = store.lookup("b", "k")
    assert entry is not None and entry.headers == () and entry.last_modified is None
    store.close()


@pytest.mark.parametrize("headers", [
    [["Content-Type", "text/plain\r\nSet-Cookie: x=1"]],  # a header injected into every answer
    [["Content-Type"]],
    "Content-Type: text/plain",
    [["x-amz-meta-big", "v" * 70_000]],
])
def test_tampered_entry_headers_discard_the_entry(tmp_path, headers):
    store = _store(tmp_path)
    _put(store, ())
    store.close()
    meta_path = next((tmp_path / "v1" / "meta").glob("*/*.json"))
    meta = json.loads(meta_path.read_text())
    meta["headers"] = headers
    meta_path.write_text(json.dumps(meta))
    store = _store(tmp_path)
    assert store.lookup("b", "k") is None
    store.close()


def test_too_much_object_metadata_is_refused(s3_server, bucket, s3_daemon):
    """S3 keeps at most 2 KB of user metadata; an origin sending far more gets no cache entry
    and the client a clean error, not a daemon storing and replaying whatever it was sent."""
    origin = s3_server.client()
    # moto does not enforce S3's limit, so it stands in for a broken or hostile origin here.
    origin.put_object(Bucket=bucket, Key="huge-meta", Body=b"x",
                      Metadata={f"k{i}": "v" * 1000 for i in range(12)})
    client = s3_daemon.client()
    for call in (client.get_object, client.head_object):
        with pytest.raises(ClientError) as err:
            call(Bucket=bucket, Key="huge-meta")
        assert err.value.response["ResponseMetadata"]["HTTPStatusCode"] == 502
    assert s3_daemon.stats()["cache"]["items"] == 0


# -- conditional requests ----------------------------------------------------------------------


def status_of(call: Callable[..., Any], **params: Any) -> int:
    try:
        resp = call(**params)
    except ClientError as exc:
        return int(exc.response["ResponseMetadata"]["HTTPStatusCode"])
    if "Body" in resp:
        resp["Body"].read()
    return int(resp["ResponseMetadata"]["HTTPStatusCode"])


DAY = datetime.timedelta(days=1)


def _cases(etag: str, lm: datetime.datetime) -> list[tuple[str, dict[str, Any], int | None]]:
    """(name, conditions, S3's documented status where moto answers otherwise, else None)."""
    other = '"0123456789abcdef0123456789abcdef"'
    return [
        ("none", {}, None),
        ("if-match", {"IfMatch": etag}, None),
        ("if-match other", {"IfMatch": other}, None),
        ("if-none-match", {"IfNoneMatch": etag}, None),
        ("if-none-match other", {"IfNoneMatch": other}, None),
        ("if-modified-since before", {"IfModifiedSince": lm - DAY}, None),
        ("if-modified-since at", {"IfModifiedSince": lm}, None),
        ("if-modified-since after", {"IfModifiedSince": lm + DAY}, None),
        ("if-unmodified-since before", {"IfUnmodifiedSince": lm - DAY}, None),
        ("if-unmodified-since at", {"IfUnmodifiedSince": lm}, None),
        ("if-unmodified-since after", {"IfUnmodifiedSince": lm + DAY}, None),
        ("match + modified since", {"IfMatch": etag, "IfModifiedSince": lm + DAY}, None),
        ("none-match + unmodified", {"IfNoneMatch": etag, "IfUnmodifiedSince": lm + DAY}, None),
        ("none-match + modified", {"IfNoneMatch": etag, "IfModifiedSince": lm - DAY}, None),
        ("other + unmodified", {"IfMatch": other, "IfUnmodifiedSince": lm + DAY}, None),
        # S3's documented precedence, which moto does not implement (it checks each header alone):
        # If-Match true wins over If-Unmodified-Since false (200) ...
        ("match + unmodified false", {"IfMatch": etag, "IfUnmodifiedSince": lm - DAY}, 200),
        # ... and a failed If-None-Match makes If-Modified-Since not count (RFC 9110 13.2.2).
        ("none-match other + not modified", {"IfNoneMatch": other, "IfModifiedSince": lm + DAY}, 200),
        # "*" matches any object that exists (moto compares it as an ETag).
        ("if-match *", {"IfMatch": "*"}, 200),
        ("if-none-match *", {"IfNoneMatch": "*"}, 304),
    ]


@pytest.mark.slow
def test_conditional_requests_answer_as_s3(s3_server, bucket, s3_daemon):
    origin = s3_server.client()
    client = s3_daemon.client()
    methods = ("head_object", "get_object")
    for index in range(len(_cases('"x"', EXPIRES))):
        key = f"cond-{index}"  # one cold object per case: each is seen on a miss, then on a hit
        origin.put_object(Bucket=bucket, Key=key, Body=b"probe")
        info = origin.head_object(Bucket=bucket, Key=key)
        name, conditions, documented = _cases(info["ETag"], info["LastModified"])[index]
        expected = {
            method: documented if documented is not None
            else status_of(getattr(origin, method), Bucket=bucket, Key=key, **conditions)
            for method in methods
        }
        seen = {}
        for state in ("miss", "hit"):
            # A HEAD miss asks the origin; the GET miss starts the fill the hits then read.
            for method in methods:
                seen[(state, method)] = status_of(getattr(client, method), Bucket=bucket, Key=key, **conditions)
            s3_daemon.settle()
        assert seen == {(state, method): expected[method] for state in ("miss", "hit") for method in methods}, name
        assert cache_state(client.head_object(Bucket=bucket, Key=key)) == "hit", name


def test_not_modified_and_precondition_failed_answers(s3_server, bucket, s3_daemon):
    origin = s3_server.client()
    put_described(origin, bucket)
    client = s3_daemon.client()
    etag = origin.head_object(Bucket=bucket, Key="described.tar")["ETag"]
    for _ in ("miss", "hit"):
        with pytest.raises(ClientError) as err:
            client.get_object(Bucket=bucket, Key="described.tar", IfMatch='"other"')
        assert err.value.response["Error"]["Code"] == "PreconditionFailed"
        request = urllib.request.Request(f"{s3_daemon.url}/{bucket}/described.tar", headers={"If-None-Match": etag})
        with pytest.raises(urllib.error.HTTPError) as not_modified:
            urllib.request.urlopen(request, timeout=10)
        assert not_modified.value.code == 304
        answered = not_modified.value.headers
        assert answered["ETag"] == etag and answered["Last-Modified"]
        assert answered["Cache-Control"] == "max-age=3600, immutable"
        # Like S3, no Content-* on a 304: there is no content.
        assert answered["Content-Disposition"] is None and answered["Content-Language"] is None
        assert not_modified.value.read() == b""
        client.get_object(Bucket=bucket, Key="described.tar")["Body"].read()
        s3_daemon.settle()

