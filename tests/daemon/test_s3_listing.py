"""Listings and buckets through the daemon, compared field by field with the origin's own answers.

Every S3 client must get what the origin would have told it: ListObjectsV2 and ListObjects (v1)
with and without ``EncodingType=url`` (encoded names only when the client asks, as S3 does),
every page of a listing longer than 1,000 keys with its tokens and markers, ``HEAD /{bucket}``
(404 for a missing bucket) and GetBucketLocation. The origin is moto in its own process; the
daemon reaches it through the fault proxy, once with each S3 client. A ``file://`` origin builds
its listings itself and is compared with moto's answers for the same keys.
"""

from __future__ import annotations

import concurrent.futures
import urllib.parse
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from botocore.exceptions import ClientError
from botocore.handlers import set_list_objects_encoding_type_url

from tests.support.daemons import make_settings
from tests.support.s3 import s3_client
from tests.support.threads import DaemonThread

# Names S3 allows and XML, URLs or both treat specially; "many/" makes listings longer than a page.
ODD_KEYS = [
    "top.txt",
    "with space/one two.tar",
    "with space/sub dir/deep file.tar",
    "plus+sign/a+b.tar",
    "percent%25/100%.tar",
    "percent%25/%2F-not-a-slash.tar",
    "amp&lt/a&b<c>d.tar",
    "quote\"apos'/x.tar",
    "uni/ünïcødé-日本語.tar",
    "tilde~star*/x~y*z.tar",
    "eq=and?q/a=b?c#d.tar",
]
MANY = [f"many/{i:05d}.tar" for i in range(1105)]
KEYS = ODD_KEYS + MANY
PREFIXES = ["", "with space/", "plus+sign/", "percent%25/", "amp&lt/", "uni/ün", "many/", "eq=and?q/"]
HTTP_TIMEOUT_S = 30


@pytest.fixture(scope="module")
def listed_bucket(s3_server: Any) -> str:
    """One bucket holding :data:`KEYS` (filled once: 1,116 PUTs are the slow part)."""
    name = s3_server.new_bucket()
    client = s3_server.client()
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda key: client.put_object(Bucket=name, Key=key, Body=key.encode()), KEYS))
    return name


def plain_client(endpoint: str) -> Any:
    """A boto3 client that does not ask for ``encoding-type=url`` by itself: what pyarrow,
    s3torchconnector, rclone and the loader send."""
    client = s3_client(endpoint)
    for op in ("ListObjects", "ListObjectsV2"):
        client.meta.events.unregister(f"before-parameter-build.s3.{op}", set_list_objects_encoding_type_url)
    return client


def _fields(resp: dict[str, Any]) -> dict[str, Any]:
    return {name: value for name, value in resp.items() if name != "ResponseMetadata"}


# (client kind, extra call arguments): boto3 as it is (asks for url encoding and decodes the
# answer itself), boto3 asking explicitly (gets encoded names back), a client that does not ask.
ENCODINGS: list[tuple[str, dict[str, str]]] = [
    ("boto3", {}),
    ("boto3", {"EncodingType": "url"}),
    ("plain", {}),
]


def _clients(kind: str, daemon_url: str, origin_url: str) -> tuple[Any, Any]:
    make = plain_client if kind == "plain" else s3_client
    return make(daemon_url), make(origin_url)


def _v2_pages(client: Any, bucket: str, token: str | None = None, **kwargs: Any) -> dict[str, Any]:
    if token:
        kwargs["ContinuationToken"] = token
    return _fields(client.list_objects_v2(Bucket=bucket, **kwargs))


def _v1_next_marker(page: dict[str, Any]) -> str | None:
    """Where a v1 listing continues: NextMarker (sent with a delimiter), else the last key."""
    if not page.get("IsTruncated"):
        return None
    if page.get("NextMarker"):
        return str(page["NextMarker"])
    return str(page["Contents"][-1]["Key"])


def compare_v2(daemon: Any, origin: Any, bucket: str, **kwargs: Any) -> int:
    """Page through a ListObjectsV2 listing on both and compare every page; the pages seen."""
    token: str | None = None
    for pages in range(1, 100):
        got = _v2_pages(daemon, bucket, token, **kwargs)
        want = _v2_pages(origin, bucket, token, **kwargs)
        assert got == want, (kwargs, pages)
        token = got.get("NextContinuationToken")
        if not got["IsTruncated"]:
            return pages
        assert token
    raise AssertionError("listing did not end")


def compare_v1(daemon: Any, origin: Any, bucket: str, **kwargs: Any) -> int:
    marker: str | None = None
    for pages in range(1, 100):
        extra = {"Marker": marker} if marker else {}
        got = _fields(daemon.list_objects(Bucket=bucket, **kwargs, **extra))
        want = _fields(origin.list_objects(Bucket=bucket, **kwargs, **extra))
        assert got == want, (kwargs, pages)
        marker = _v1_next_marker(got)
        if marker is None:
            return pages
        if kwargs.get("EncodingType") == "url":
            marker = urllib.parse.unquote_plus(marker)
    raise AssertionError("listing did not end")


@pytest.mark.parametrize(("kind", "extra"), ENCODINGS, ids=["boto3", "boto3-url", "plain"])
@pytest.mark.slow
def test_list_objects_v2_matches_the_origin(s3_server, listed_bucket, s3_daemon, kind, extra):
    daemon, origin = _clients(kind, s3_daemon.url, s3_server.endpoint)
    # Every page of a 1,105-key listing, its tokens, KeyCount and MaxKeys.
    assert compare_v2(daemon, origin, listed_bucket, **extra) == 2
    assert compare_v2(daemon, origin, listed_bucket, Prefix="many/", MaxKeys=400, **extra) == 3
    for prefix in PREFIXES:
        compare_v2(daemon, origin, listed_bucket, Prefix=prefix, Delimiter="/", **extra)
    compare_v2(daemon, origin, listed_bucket, Delimiter="/", StartAfter="percent%25/", FetchOwner=True, **extra)
    compare_v2(daemon, origin, listed_bucket, Prefix="with space/", Delimiter=" ", **extra)
    # The keys come back as they are, or encoded exactly when the client asked for it.
    keys = [obj["Key"] for obj in daemon.list_objects_v2(Bucket=listed_bucket, Prefix="with space/", **extra)["Contents"]]
    if extra:
        assert keys and all(" " not in key for key in keys)
    else:
        assert keys == ["with space/one two.tar", "with space/sub dir/deep file.tar"]


@pytest.mark.parametrize(("kind", "extra"), ENCODINGS, ids=["boto3", "boto3-url", "plain"])
@pytest.mark.slow
def test_list_objects_v1_matches_the_origin(s3_server, listed_bucket, s3_daemon, kind, extra):
    daemon, origin = _clients(kind, s3_daemon.url, s3_server.endpoint)
    assert compare_v1(daemon, origin, listed_bucket, **extra) == 2
    assert compare_v1(daemon, origin, listed_bucket, Prefix="many/", MaxKeys=500, Delimiter="/", **extra) == 3
    for prefix in PREFIXES:
        compare_v1(daemon, origin, listed_bucket, Prefix=prefix, Delimiter="/", **extra)
    compare_v1(daemon, origin, listed_bucket, Delimiter="/", Marker="percent%25/", **extra)
    # (moto pages v1 common prefixes unlike S3, so NextMarker is checked on the file:// origin.)


def _raw(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=HTTP_TIMEOUT_S) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def test_unsigned_http_listings_are_the_origins_bytes(s3_server, listed_bucket, s3_daemon):
    """A client that sends neither a signature nor an encoding: the very bytes the origin sends."""
    queries = [
        {"list-type": "2", "prefix": "with space/", "delimiter": "/"},
        {"list-type": "2", "prefix": "amp&lt/"},
        {"list-type": "2", "prefix": "uni/", "encoding-type": "url"},
        {"prefix": "plus+sign/"},
        {"prefix": "", "delimiter": "/", "marker": "percent%25/", "max-keys": "4"},
        {"prefix": "eq=and?q/", "encoding-type": "url"},
    ]
    for query in queries:
        path = f"/{listed_bucket}?" + urllib.parse.urlencode(query, quote_via=urllib.parse.quote)
        got = _raw(s3_daemon.url + path)
        want = _raw(s3_server.endpoint + path)
        assert got == want, query
        assert got[0] == 200


def _head_bucket(client: Any, bucket: str) -> tuple[int, str, str | None]:
    try:
        resp = client.head_bucket(Bucket=bucket)
    except ClientError as exc:
        meta = exc.response["ResponseMetadata"]
        return meta["HTTPStatusCode"], exc.response["Error"]["Code"], meta["HTTPHeaders"].get("x-amz-bucket-region")
    meta = resp["ResponseMetadata"]
    return meta["HTTPStatusCode"], "", meta["HTTPHeaders"].get("x-amz-bucket-region")


def _error(call: Callable[[], Any]) -> tuple[int, str]:
    with pytest.raises(ClientError) as err:
        call()
    return err.value.response["ResponseMetadata"]["HTTPStatusCode"], err.value.response["Error"]["Code"]


def test_head_bucket_and_location_match_the_origin(s3_server, listed_bucket, s3_daemon):
    daemon, origin = s3_daemon.client(), s3_server.client()
    missing = "no-such-" + uuid.uuid4().hex[:12]
    assert _head_bucket(daemon, listed_bucket) == _head_bucket(origin, listed_bucket) == (200, "", "us-east-1")
    assert _head_bucket(daemon, missing) == _head_bucket(origin, missing)
    assert _head_bucket(daemon, missing)[:2] == (404, "404")
    # The answer to a HEAD has no body, whatever it says.
    request = urllib.request.Request(f"{s3_daemon.url}/{missing}", method="HEAD")
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(request, timeout=HTTP_TIMEOUT_S)
    assert err.value.code == 404
    assert err.value.read() == b""

    located = daemon.get_bucket_location(Bucket=listed_bucket)
    assert _fields(located) == _fields(origin.get_bucket_location(Bucket=listed_bucket))
    assert _error(lambda: daemon.get_bucket_location(Bucket=missing)) == (404, "NoSuchBucket")
    assert _error(lambda: daemon.list_objects(Bucket=missing)) == _error(lambda: origin.list_objects(Bucket=missing))


def test_pyarrow_lists_names_and_sees_missing_buckets(s3_server, listed_bucket, s3_daemon):
    """pyarrow's S3 file system (the AWS C++ SDK: never asks for url-encoded names)."""
    fs = pytest.importorskip("pyarrow.fs")

    def filesystem(url: str) -> Any:
        host = url.removeprefix("http://")
        return fs.S3FileSystem(
            access_key="testing", secret_key="testing", region="us-east-1", scheme="http",
            endpoint_override=host, connect_timeout=5, request_timeout=HTTP_TIMEOUT_S,
        )

    daemon, origin = filesystem(s3_daemon.url), filesystem(s3_server.endpoint)

    def names(filesystem: Any, base: str) -> list[tuple[str, int]]:
        selector = fs.FileSelector(f"{listed_bucket}/{base}", recursive=True)
        return sorted((info.path, info.size or 0) for info in filesystem.get_file_info(selector))

    for base in ("with space", "uni", "plus+sign", "percent%25"):
        got = names(daemon, base)
        assert got == names(origin, base)
        keys = sorted(key for key in KEYS if key.startswith(base + "/"))
        assert [path for path, _ in got if not path.endswith(tuple(f"/{d}" for d in ("sub dir",)))] == [
            f"{listed_bucket}/{key}" for key in keys
        ]
    assert daemon.get_file_info(listed_bucket).type == fs.FileType.Directory
    missing = "no-such-" + uuid.uuid4().hex[:12]
    assert daemon.get_file_info(missing).type == origin.get_file_info(missing).type == fs.FileType.NotFound


# -- the file:// origin, which builds its listings itself -------------------------------------


@pytest.fixture(scope="module")
def file_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("file-origin")
    for key in KEYS:
        path = root / "files" / key
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(key.encode())
    return root


@pytest.fixture
def file_daemon(tmp_path: Path, file_root: Path, start_daemon: Callable[..., DaemonThread]) -> DaemonThread:
    return start_daemon(make_settings(tmp_path / "cache", f"file://{file_root}"))


def _names(page: dict[str, Any], encoded: bool) -> dict[str, Any]:
    """What a file:// listing shares with S3's: names (decoded when encoded), sizes, counts."""

    def name(text: str) -> str:
        return urllib.parse.unquote_plus(text) if encoded else text

    shared = {
        "Contents": [(name(obj["Key"]), obj["Size"]) for obj in page.get("Contents", [])],
        "CommonPrefixes": [name(common["Prefix"]) for common in page.get("CommonPrefixes", [])],
    }
    for field in ("Name", "KeyCount", "MaxKeys", "IsTruncated", "EncodingType"):
        shared[field] = page.get(field)
    for field in ("Prefix", "Delimiter", "StartAfter", "Marker"):
        shared[field] = name(page[field]) if page.get(field) else None
    shared["NextMarker"] = name(page["NextMarker"]) if page.get("NextMarker") else None
    return shared


def _walk(list_page: Callable[..., dict[str, Any]], v1: bool, encoded: bool, **kwargs: Any) -> Iterator[dict[str, Any]]:
    token: str | None = None
    for _ in range(100):
        extra: dict[str, str] = {}
        if token:
            extra = {"Marker": token} if v1 else {"ContinuationToken": token}
        page = list_page(**kwargs, **extra)
        yield _names(page, encoded)
        if not page["IsTruncated"]:
            return
        if v1:
            marker = _v1_next_marker(page)
            assert marker
            token = urllib.parse.unquote_plus(marker) if encoded else marker
        else:
            token = page["NextContinuationToken"]
    raise AssertionError("listing did not end")


FILE_CASES: list[dict[str, Any]] = [
    {},
    {"Prefix": "many/", "MaxKeys": 300},
    {"Prefix": "many/", "MaxKeys": 300, "Delimiter": "/"},
    *({"Prefix": prefix, "Delimiter": "/"} for prefix in PREFIXES),
    {"Delimiter": "/", "MaxKeys": 3},
    {"Prefix": "many/0", "Delimiter": "0", "MaxKeys": 4},
]


@pytest.mark.parametrize(("kind", "extra"), ENCODINGS, ids=["boto3", "boto3-url", "plain"])
@pytest.mark.slow
def test_file_origin_listings_match_s3(s3_server, listed_bucket, file_daemon, kind, extra):
    """ListObjectsV2 page by page as moto answers it (the tokens are each server's own)."""
    daemon, origin = _clients(kind, file_daemon.url, s3_server.endpoint)
    encoded = bool(extra)
    for case in FILE_CASES:
        got = list(_walk(lambda **kw: daemon.list_objects_v2(Bucket="files", **kw), False, encoded, **case, **extra))
        want = list(_walk(lambda **kw: origin.list_objects_v2(Bucket=listed_bucket, **kw), False, encoded, **case, **extra))
        for page in want:
            page["Name"] = "files"
        assert got == want, case
    # Encoded names are S3's: a space is '+', a '+' is '%2B' and '/' stays.
    if encoded:
        page = daemon.list_objects_v2(Bucket="files", Prefix="plus+sign/", Delimiter=" ", **extra)
        assert [obj["Key"] for obj in page["Contents"]] == ["plus%2Bsign/a%2Bb.tar"]
        assert page["Prefix"] == "plus%2Bsign/"
        assert page["Delimiter"] == "+"


@pytest.mark.parametrize(("kind", "extra"), ENCODINGS, ids=["boto3", "boto3-url", "plain"])
@pytest.mark.slow
def test_file_origin_v1_listings_are_s3s(file_daemon, kind, extra):
    """ListObjects (v1) pages hold what the ListObjectsV2 pages (checked against moto above)
    hold; markers as S3 sets them: Marker echoes the request, NextMarker (only with a delimiter)
    names the page's last key or common prefix. moto itself pages v1 common prefixes unlike S3."""
    client = plain_client(file_daemon.url) if kind == "plain" else file_daemon.client()
    encoded = bool(extra)
    for case in FILE_CASES:
        v2 = list(_walk(lambda **kw: client.list_objects_v2(Bucket="files", **kw), False, encoded, **case, **extra))
        v1 = list(_walk(lambda **kw: client.list_objects(Bucket="files", **kw), True, encoded, **case, **extra))
        assert len(v1) == len(v2), case
        previous = None
        for old, new in zip(v1, v2, strict=True):
            assert old["Marker"] == previous, case
            last = max([key for key, _ in old["Contents"]] + old["CommonPrefixes"], default=None)
            assert old["NextMarker"] == (last if case.get("Delimiter") and old["IsTruncated"] else None), case
            previous = old["NextMarker"] or (old["Contents"][-1][0] if old["IsTruncated"] else None)
            if kind == "boto3" and not extra and old["Prefix"]:
                # S3 encodes a v1 Prefix too (AWS: "Delimiter, Marker, Prefix, NextMarker, Key"),
                # but botocore decodes every element of a v1 answer it asked to encode but that.
                old["Prefix"] = urllib.parse.unquote_plus(old["Prefix"])
            for field in ("Contents", "CommonPrefixes", "IsTruncated", "MaxKeys", "Prefix", "Delimiter", "EncodingType"):
                assert old[field] == new[field], (case, field)


def test_file_origin_buckets(file_daemon):
    client = file_daemon.client()
    assert _head_bucket(client, "files")[:2] == (200, "")
    assert _head_bucket(client, "no-such-bucket")[:2] == (404, "404")
    assert client.get_bucket_location(Bucket="files")["LocationConstraint"] is None
    assert _error(lambda: client.get_bucket_location(Bucket="no-such-bucket")) == (404, "NoSuchBucket")
    assert _error(lambda: client.list_objects(Bucket="no-such-bucket")) == (404, "NoSuchBucket")
