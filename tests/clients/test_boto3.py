"""boto3 (the client most trainers use) through the cache: every field it parses from HEAD, GET,
ranged GET, both listings, HEAD bucket, conditional requests and errors must equal the origin's,
and its managed TransferManager downloads (parallel ranged GETs) must return the same bytes."""

from __future__ import annotations

import io
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from boto3.s3.transfer import TransferConfig
from botocore.exceptions import ClientError

from tests.support.client_dataset import BIG_SIZES, MANY, NESTED_KEYS, ODD_KEYS, Dataset, MiB, sha256
from tests.support.compare import assert_same
from tests.support.s3 import s3_client

# Keys whose answers are compared header by header: every kind of key and object in the data set.
SAMPLE = (*ODD_KEYS, *NESTED_KEYS, "many/k-00000", "many/k-01049", *BIG_SIZES, "tables/part-0.parquet", "nested/marker/")


def fields(resp: dict[str, Any]) -> dict[str, Any]:
    """What boto3 parsed from an answer, less the body and the transport details. The origin's
    object checksums (``ChecksumCRC32``..., which boto3 asks for on every GetObject) are in."""
    return {k: v for k, v in resp.items() if k not in ("Body", "ResponseMetadata")}


def outcome(call: Any, **kwargs: Any) -> dict[str, Any]:
    """The parsed answer, or the status and error code boto3 raised (the messages and the error's
    other fields are compared once, in test_error_documents_match_origin)."""
    try:
        resp = call(**kwargs)
    except ClientError as exc:
        return {"status": exc.response["ResponseMetadata"]["HTTPStatusCode"], "Code": exc.response["Error"]["Code"]}
    body = resp.get("Body")
    return {"status": resp["ResponseMetadata"]["HTTPStatusCode"], **fields(resp), **({"sha256": sha256(body.read())} if body else {})}


@pytest.mark.parametrize("operation", ["head_object", "get_object"])
def test_object_answers_match_origin(dataset: Dataset, origin_url: str, cache_url: str, operation: str) -> None:
    direct = {key: outcome(getattr(s3_client(origin_url), operation), Bucket=dataset.bucket, Key=key) for key in SAMPLE}
    assert all(direct[key]["ContentLength"] == len(dataset.objects[key].data) for key in SAMPLE)
    for _ in range(2):  # misses, then answers from the cache
        assert_same(direct, {key: outcome(getattr(s3_client(cache_url), operation), Bucket=dataset.bucket, Key=key) for key in SAMPLE})


RANGES = ("bytes=100-199", "bytes=-50", f"bytes={5 * MiB}-", "bytes=0-0", f"bytes=6000000-{7 * MiB}", "bytes=100000000-")


def test_ranged_gets_match_origin(dataset: Dataset, origin_url: str, cache_url: str) -> None:
    keys = ("big/six.bin", "odd/with space.txt")
    direct = {(k, r): outcome(s3_client(origin_url).get_object, Bucket=dataset.bucket, Key=k, Range=r) for k in keys for r in RANGES}
    assert direct[("odd/with space.txt", "bytes=100000000-")]["Code"] == "InvalidRange"
    for _ in range(2):
        assert_same(direct, {(k, r): outcome(s3_client(cache_url).get_object, Bucket=dataset.bucket, Key=k, Range=r) for k in keys for r in RANGES})


def listing(client: Any, operation: str, **kwargs: Any) -> dict[str, list[Any]]:
    """Every page of a listing, through boto3's paginator (continuation token or marker)."""
    out: dict[str, list[Any]] = {"Contents": [], "CommonPrefixes": [], "pages": []}
    for page in client.get_paginator(operation).paginate(**kwargs):
        out["Contents"] += page.get("Contents", [])
        out["CommonPrefixes"] += page.get("CommonPrefixes", [])
        out["pages"].append({k: v for k, v in page.items() if k not in ("Contents", "CommonPrefixes", "ResponseMetadata")})
    return out


QUERIES = ({}, {"Prefix": "odd/"}, {"Delimiter": "/"}, {"Prefix": "nested/", "Delimiter": "/"}, {"Prefix": "many/", "MaxKeys": 400}, {"Prefix": "none/"})


@pytest.mark.parametrize("operation", ["list_objects_v2", "list_objects"])
@pytest.mark.slow
def test_listings_match_origin(dataset: Dataset, origin_url: str, cache_url: str, operation: str) -> None:
    def listings(url: str) -> dict[str, Any]:
        out = {}
        for query in QUERIES:
            try:
                out[repr(query)] = listing(s3_client(url), operation, Bucket=dataset.bucket, **query)
            except ClientError as exc:
                out[repr(query)] = {"Code": exc.response["Error"]["Code"]}
        return out

    direct = listings(origin_url)
    assert [c["Key"] for c in direct["{}"]["Contents"]] == sorted(dataset.objects)
    assert len(direct[repr(QUERIES[4])]["pages"]) == 3  # 1,050 keys, 400 a page
    assert_same(direct, listings(cache_url))


@pytest.mark.slow
def test_listing_of_more_than_a_page(dataset: Dataset, cache_url: str) -> None:
    for operation in ("list_objects_v2", "list_objects"):
        got = listing(s3_client(cache_url), operation, Bucket=dataset.bucket, Prefix="many/")
        assert len(got["Contents"]) == MANY, operation
        assert len(got["pages"]) == 2, operation


def test_head_bucket_matches_origin(dataset: Dataset, origin_url: str, cache_url: str) -> None:
    assert_same(outcome(s3_client(origin_url).head_bucket, Bucket=dataset.bucket), outcome(s3_client(cache_url).head_bucket, Bucket=dataset.bucket))


MISSING_CALLS = ("head_bucket", "list_objects_v2", "list_objects", "get_object", "head_object")


def test_missing_bucket_matches_origin(dataset: Dataset, origin_url: str, cache_url: str) -> None:
    def answers(url: str) -> dict[str, Any]:
        client = s3_client(url)
        return {
            op: outcome(getattr(client, op), Bucket=dataset.missing_bucket, **({"Key": "k"} if op.endswith("_object") else {}))
            for op in MISSING_CALLS
        }

    direct = answers(origin_url)
    assert {a["status"] for a in direct.values()} == {404}
    assert_same(direct, answers(cache_url))


MISSING_KEYS = ("no/such key", "odd/with space.txt/", "odd", "odd/", "many/k-99999")


def test_missing_key_matches_origin(dataset: Dataset, origin_url: str, cache_url: str) -> None:
    def answers(url: str) -> dict[str, Any]:
        client = s3_client(url)
        return {(op, key): outcome(getattr(client, op), Bucket=dataset.bucket, Key=key) for op in ("get_object", "head_object") for key in MISSING_KEYS}

    direct = answers(origin_url)
    assert {a["status"] for a in direct.values()} == {404}
    for _ in range(2):
        assert_same(direct, answers(cache_url))


@pytest.mark.parametrize("operation", ["get_object", "head_object"])
def test_conditional_requests_match_origin(dataset: Dataset, origin_url: str, cache_url: str, operation: str) -> None:
    key = "odd/plus+sign.txt"
    head = s3_client(origin_url).head_object(Bucket=dataset.bucket, Key=key)
    etag, later, earlier = head["ETag"], head["LastModified"] + timedelta(days=1), head["LastModified"] - timedelta(days=1)
    conditions = (
        {"IfMatch": etag}, {"IfMatch": '"0123"'}, {"IfNoneMatch": etag}, {"IfNoneMatch": '"0123"'},
        {"IfModifiedSince": later}, {"IfModifiedSince": earlier}, {"IfUnmodifiedSince": later}, {"IfUnmodifiedSince": earlier},
    )

    def answers(url: str) -> dict[str, Any]:
        call = getattr(s3_client(url), operation)
        return {repr(c): outcome(call, Bucket=dataset.bucket, Key=key, **c) for c in conditions}

    direct = answers(origin_url)
    assert direct[repr(conditions[1])]["status"] == 412
    for _ in range(2):
        assert_same(direct, answers(cache_url))


def test_combined_conditions_answer_as_s3_documents(dataset: Dataset, origin_url: str, cache_url: str) -> None:
    """Two conditions at once, as S3 documents them (GetObject, RFC 7232 section 6): If-Match
    overrides If-Unmodified-Since and If-None-Match overrides If-Modified-Since. moto evaluates
    each on its own (412 and 304 for the first and third case), so the expected answers are S3's."""
    key = "odd/plus+sign.txt"
    head = s3_client(origin_url).head_object(Bucket=dataset.bucket, Key=key)
    etag, later, earlier = head["ETag"], head["LastModified"] + timedelta(days=1), head["LastModified"] - timedelta(days=1)
    documented = (
        ({"IfMatch": etag, "IfUnmodifiedSince": earlier}, 200),
        ({"IfNoneMatch": etag, "IfModifiedSince": earlier}, 304),
        ({"IfNoneMatch": '"0123"', "IfModifiedSince": later}, 200),
        ({"IfMatch": '"0123"', "IfUnmodifiedSince": later}, 412),
    )
    for operation in ("get_object", "head_object"):
        call = getattr(s3_client(cache_url), operation)
        got = {repr(c): outcome(call, Bucket=dataset.bucket, Key=key, **c)["status"] for c, _ in documented}
        assert got == {repr(c): status for c, status in documented}, operation


ERROR_CASES = (
    ("missing key", "get_object", {"Key": "no/such key"}),
    ("missing bucket", "get_object", {"Key": "k", "Bucket": "MISSING"}),
    ("missing bucket listing", "list_objects_v2", {"Bucket": "MISSING"}),
    ("range past the end", "get_object", {"Key": "odd/with space.txt", "Range": "bytes=1000-"}),
    ("failed If-Match", "get_object", {"Key": "odd/with space.txt", "IfMatch": '"0123"'}),
)


def test_error_documents_match_origin(dataset: Dataset, origin_url: str, cache_url: str) -> None:
    """The error's message and the fields S3 adds to it (Key, BucketName, RangeRequested,
    ActualObjectSize, Condition) are what aws-cli and boto3 users read; fields the cache adds
    besides (Resource) are allowed."""

    def documents(url: str) -> dict[str, Any]:
        out = {}
        for name, operation, args in ERROR_CASES:
            kwargs = {"Bucket": dataset.bucket, **args}
            if kwargs["Bucket"] == "MISSING":
                kwargs["Bucket"] = dataset.missing_bucket
            with pytest.raises(ClientError) as info:
                getattr(s3_client(url), operation)(**kwargs)
            out[name] = info.value.response["Error"]
        return out

    direct = documents(origin_url)
    cached = documents(cache_url)
    assert_same(direct, {name: {k: v for k, v in doc.items() if k in direct[name]} for name, doc in cached.items()})


SMALL_PARTS = TransferConfig(multipart_threshold=1 * MiB, multipart_chunksize=1 * MiB, max_concurrency=4)


@pytest.mark.slow
def test_transfer_manager_download_file(dataset: Dataset, origin_url: str, cache_url: str, tmp_path: Path) -> None:
    for key in BIG_SIZES:
        for name, url in (("direct", origin_url), ("cold", cache_url), ("warm", cache_url)):
            target = tmp_path / name
            s3_client(url).download_file(dataset.bucket, key, str(target), Config=SMALL_PARTS)
            assert sha256(target.read_bytes()) == dataset.objects[key].sha, (key, name)


@pytest.mark.slow
def test_transfer_manager_download_fileobj(dataset: Dataset, origin_url: str, cache_url: str) -> None:
    for key in (*BIG_SIZES, "odd/ünïcödé-日本語.txt", "odd/%41%2F literal escapes.txt"):
        for url in (origin_url, cache_url):
            sink = io.BytesIO()
            s3_client(url).download_fileobj(dataset.bucket, key, sink, Config=SMALL_PARTS)
            assert sha256(sink.getvalue()) == dataset.objects[key].sha, (key, url)


def test_transfer_manager_errors_match_origin(dataset: Dataset, origin_url: str, cache_url: str, tmp_path: Path) -> None:
    def failure(url: str) -> dict[str, Any]:
        out = {}
        for bucket, key in ((dataset.bucket, "no/such key"), (dataset.missing_bucket, "big/six.bin")):
            with pytest.raises(ClientError) as info:
                s3_client(url).download_file(bucket, key, str(tmp_path / "x"), Config=SMALL_PARTS)
            out[key] = {"status": info.value.response["ResponseMetadata"]["HTTPStatusCode"], "Code": info.value.response["Error"]["Code"]}
        return out

    assert_same(failure(origin_url), failure(cache_url))
