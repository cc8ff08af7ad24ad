"""S3 origin: boto3 for credentials, endpoint resolution and SigV4 signing; a pooled blocking
HTTP client (``sidecar/daemon/origins/httppool.py``) on the origin's threads for the requests themselves.

How the daemon talks to S3 was chosen by measurement (``bench/daemon_bench.py``, cold reads of
moto on loopback): boto3 ``get_object`` on an executor copies every chunk through botocore's and
urllib3's response wrappers; aiohttp streaming on the event loop was 15% faster than that but
still spent 0.9 CPU-s/GB turning socket reads into ``bytes`` on the loop that also serves
trainers; presigned requests read with ``readinto`` into a reused 1 MiB buffer on a worker thread
cost 0.45 CPU-s/GB and leave the loop alone. boto3 still does what it is good at: the standard
credential chain (env, profile, IRSA web identity, instance metadata), ``AWS_ENDPOINT_URL`` and
signing, so any S3 server (AWS, MinIO, Ceph RGW, moto) works. ``--s3-client boto3`` keeps plain
boto3 calls selectable, for the benchmark and as a fallback.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from sidecar.daemon.checksums import checksum_headers, key_encrypted
from sidecar.daemon.origins.base import Body, EmptyBody, ObjectInfo, Origin
from sidecar.daemon.origins.httppool import HTTPPool, Response
from sidecar.errors import (
    AccessDenied,
    BadRequest,
    BucketNotFound,
    InvalidRange,
    ObjectNotFound,
    OriginBadResponse,
    OriginThrottled,
    OriginUnavailable,
    SidecarError,
)
from wire.errors import HeadersTooLarge
from wire.names import validate_bucket, validate_key
from wire.s3errors import S3ErrorAnswer, S3ErrorKind, from_client_error, from_http
from wire.s3headers import object_headers
from wire.s3xml import MAX_ERROR_BYTES, MAX_LISTING_BYTES

__all__ = ["S3Origin", "Boto3S3Origin", "S3Settings"]

_RANGE_RE = re.compile(r"bytes (\d+)-(\d+)/(\d+|\*)")

# What each kind of S3 error answer becomes here, and its message: the origin's one error map.
# A request the origin rejects for an unexpected reason counts as the origin failing (retried).
_ERRORS: dict[S3ErrorKind, tuple[type[SidecarError], str]] = {
    S3ErrorKind.NOT_FOUND_BUCKET: (BucketNotFound, "bucket {bucket!r} does not exist"),
    S3ErrorKind.NOT_FOUND_KEY: (ObjectNotFound, "{what} does not exist"),
    S3ErrorKind.ACCESS_DENIED: (AccessDenied, "{what}: access denied by the origin ({detail})"),
    S3ErrorKind.INVALID_RANGE: (InvalidRange, "{what}: requested range not satisfiable"),
    S3ErrorKind.PRECONDITION_FAILED: (ObjectNotFound, "{what} changed while it was being read"),
    S3ErrorKind.BAD_REQUEST: (BadRequest, "{what}: origin rejected the request ({detail})"),
    S3ErrorKind.THROTTLED: (OriginThrottled, "{what}: origin is throttling ({detail})"),
    S3ErrorKind.UNAVAILABLE: (OriginUnavailable, "{what}: origin answered {status} {code}"),
    S3ErrorKind.CHECKSUM_MISMATCH: (OriginUnavailable, "{what}: origin answered {status} {code}"),
    S3ErrorKind.UNEXPECTED: (OriginUnavailable, "{what}: origin answered {status} {code}"),
}


@dataclass(frozen=True)
class S3Settings:
    endpoint_url: str | None = None
    """S3 endpoint; ``None`` lets boto3 resolve it (``AWS_ENDPOINT_URL``, config, AWS default)."""

    region: str | None = None
    """Signing region; ``None`` lets boto3 resolve it."""

    max_connections: int = 64
    """Pooled connections to the origin (and worker threads that read them)."""

    connect_timeout_s: float = 5.0
    """Seconds to establish a connection before the attempt counts as failed."""

    read_timeout_s: float = 30.0
    """Seconds without a byte from the origin before the attempt counts as failed."""

    addressing_style: str = "auto"
    """``path`` or ``virtual`` bucket addressing; ``auto`` picks path style for custom endpoints."""

    client: str = "http"
    """``http``: boto3 signs, a pooled HTTP client reads bodies on worker threads (default).
    ``boto3``: plain boto3 calls on the worker threads, kept for comparison in the benchmark."""


class S3Origin(Origin):
    def __init__(self, settings: S3Settings) -> None:
        self.settings = settings
        self.threads = settings.max_connections
        self._client: Any = None
        self._pool: HTTPPool | None = None
        self.namespace = "s3"
        self.description = "s3"

    async def start(self) -> None:
        await super().start()
        self._client = await self.call(self._make_client)
        endpoint = self._client.meta.endpoint_url
        self.namespace = f"s3:{endpoint}"
        self.description = f"s3 ({endpoint})"
        self._pool = HTTPPool(
            max_idle_per_host=self.settings.max_connections,
            connect_timeout_s=self.settings.connect_timeout_s,
            read_timeout_s=self.settings.read_timeout_s,
        )

    def _make_client(self) -> Any:
        import boto3
        from botocore.config import Config

        style = self.settings.addressing_style
        if style == "auto":
            style = "path" if self.settings.endpoint_url else "auto"
        session = boto3.session.Session()
        client = session.client(
            "s3",
            endpoint_url=self.settings.endpoint_url,
            region_name=self.settings.region,
            config=Config(signature_version="s3v4", s3={"addressing_style": style}),
        )
        if style == "auto" and client.meta.endpoint_url and "amazonaws.com" not in client.meta.endpoint_url:
            # AWS_ENDPOINT_URL pointing at MinIO/Ceph/moto: path style is what those serve.
            client = session.client(
                "s3",
                endpoint_url=self.settings.endpoint_url,
                region_name=self.settings.region,
                config=Config(signature_version="s3v4", s3={"addressing_style": "path"}),
            )
        return _plain_listings(client)

    async def close(self) -> None:
        if self._pool is not None:
            await self.call(self._pool.close)
            self._pool = None
        await super().close()

    def proof_endpoint(self) -> tuple[str, str, str]:
        """(endpoint URL, signing region, ``path`` or ``virtual``) of this origin's own client: where
        ``--auth sigv4`` replays a pod's proofs, so they reach the very service fills read from."""
        assert self._client is not None, "S3Origin.start() was not awaited"
        meta = self._client.meta
        style = (meta.config.s3 or {}).get("addressing_style", "auto")
        return meta.endpoint_url, meta.region_name or "us-east-1", "path" if style == "path" else "virtual"

    async def replay(self, method: str, url: str, headers: dict[str, str], body: bytes = b"") -> tuple[int, bytes]:
        """Send a request signed by someone else (a proof) as it is; its status and (bounded) body."""
        return await self.call(self._replay, method, url, headers, body)

    def _replay(self, method: str, url: str, headers: dict[str, str], body: bytes) -> tuple[int, bytes]:
        assert self._pool is not None, "S3Origin.start() was not awaited"
        resp = self._pool.request(method, url, headers, body or None)
        try:
            data = b"" if method == "HEAD" else resp.read(MAX_ERROR_BYTES)
        finally:
            resp.close()
        return resp.status, data

    # -- blocking requests, on the origin's threads -------------------------------------------

    def _request(
        self, method: str, op: str, params: dict[str, Any], headers: dict[str, str] | None = None
    ) -> Response:
        assert self._pool is not None, "S3Origin.start() was not awaited"
        url, headers = self._target(method, op, params, headers)
        return self._answered(self._pool.request(method, url, headers), method, params)

    def _answered(self, resp: Response, method: str, params: dict[str, Any]) -> Response:
        """``resp`` when it succeeded, else its S3 error raised (its body read, bounded, and closed)."""
        if resp.status >= 300:
            body = b""
            if method != "HEAD":
                with contextlib.suppress(OriginBadResponse):
                    body = resp.read(MAX_ERROR_BYTES)
            resp.close()
            raise self._error(from_http(resp.status, body), params)
        return resp

    def _target(
        self, method: str, op: str, params: dict[str, Any], headers: dict[str, str] | None
    ) -> tuple[str, dict[str, str] | None]:
        """The URL (presigned) and headers of a request."""
        # Presigning is CPU-only once credentials are resolved; a refreshable credential provider
        # may do network I/O on refresh, which is fine here: this runs on a worker thread.
        return self._client.generate_presigned_url(op, Params=params, ExpiresIn=900, HttpMethod=method), headers

    @staticmethod
    def _error(answer: S3ErrorAnswer, params: dict[str, Any]) -> SidecarError:
        exc_type, template = _ERRORS[answer.kind]
        message = template.format(
            bucket=params.get("Bucket"), what=f"{params.get('Bucket')}/{params.get('Key', '')}",
            detail=answer.detail, status=answer.status, code=answer.code,
        )
        return exc_type(message)

    async def head(self, bucket: str, key: str, *, origin_only: bool = False) -> ObjectInfo:
        return await self.call(self._head, bucket, key)

    def _head(self, bucket: str, key: str) -> ObjectInfo:
        # With the object's additional checksum, if it has one: answered again to clients that ask.
        params = {"Bucket": validate_bucket(bucket), "Key": validate_key(key), "ChecksumMode": "ENABLED"}
        resp = self._request("HEAD", "head_object", params, _CHECKSUM_MODE)
        try:
            return _info(resp.headers.items(), int(resp.headers.get("Content-Length", "0")), f"{bucket}/{key}")
        finally:
            resp.close()

    def open(
        self, bucket: str, key: str, start: int, end: int | None, etag: str | None = None, *, origin_only: bool = False
    ) -> Body:
        params = {"Bucket": validate_bucket(bucket), "Key": validate_key(key)}
        headers = {"Range": f"bytes={start}-{'' if end is None else end - 1}"}
        if etag:
            headers["If-Match"] = etag
        resp = self._request("GET", "get_object", params, headers)
        expected = _content_length(resp)
        if end is not None and resp.status == 206 and expected != end - start:
            match = _RANGE_RE.match(resp.headers.get("Content-Range", ""))
            # A short final range is fine (end beyond the object); anything else is not.
            if not match or int(match.group(2)) + 1 != int(match.group(3) if match.group(3) != "*" else -1):
                resp.close()
                raise OriginBadResponse(f"{bucket}/{key}: origin sent {expected} bytes for a range of {end - start}")
        return _HTTPBody(resp, expected, f"{bucket}/{key}")

    direct_ranges = True

    def open_range(self, bucket: str, key: str, start: int, end: int, etag: str | None = None) -> tuple[ObjectInfo, Body] | None:
        params = {"Bucket": validate_bucket(bucket), "Key": validate_key(key)}
        headers = {"Range": f"bytes={start}-{end - 1}"}
        if etag:
            headers["If-Match"] = etag
        resp = self._request("GET", "get_object", params, headers)
        return _ranged(resp.status, resp.headers.items(), _content_length(resp), start,
                       lambda expected: _HTTPBody(resp, expected, f"{bucket}/{key}"), resp.close, f"{bucket}/{key}")

    def open_first(self, bucket: str, key: str, *, origin_only: bool = False) -> tuple[ObjectInfo, Body]:
        # Not ranged: S3 answers the full-object checksum only to a GET of the whole object, with
        # x-amz-checksum-mode (signed: botocore lists it in the presigned URL's signed headers).
        # Content-Length is then the size; a fill that splits closes this stream at a part boundary.
        params = {"Bucket": validate_bucket(bucket), "Key": validate_key(key), "ChecksumMode": "ENABLED"}
        resp = self._request("GET", "get_object", params, _CHECKSUM_MODE)
        expected = _content_length(resp)
        size = expected
        if resp.status == 206:  # an origin that ranges anyway says the size in Content-Range
            match = _RANGE_RE.match(resp.headers.get("Content-Range", ""))
            size = int(match.group(3)) if match and match.group(3) != "*" else -1
        if size < 0:
            resp.close()
            raise OriginBadResponse(f"{bucket}/{key}: origin sent no usable Content-Length")
        try:
            info = _info(resp.headers.items(), size, f"{bucket}/{key}")
        except BaseException:
            resp.close()
            raise
        return info, (_HTTPBody(resp, expected, f"{bucket}/{key}") if size else _closed(resp))

    # Listings pass through: the client's query goes to the origin as it is (its encoding-type
    # too, and only if it sent one: see _plain_listings) and the origin's XML comes back as it
    # is. Parsing and re-rendering the page would drop what the daemon does not model and the
    # client may ask for (Owner with fetch-owner, StorageClass, ChecksumAlgorithm, RestoreStatus,
    # elements S3 adds later) and turn the origin's own tokens, markers and KeyCount into ours.
    async def list_objects_v2(self, bucket: str, params: Mapping[str, str]) -> bytes:
        return await self.call(self._list, bucket, dict(params), "list_objects_v2", _LIST_V2_PARAMS)

    async def list_objects(self, bucket: str, params: Mapping[str, str]) -> bytes:
        return await self.call(self._list, bucket, dict(params), "list_objects", _LIST_V1_PARAMS)

    async def head_bucket(self, bucket: str) -> str | None:
        return await self.call(self._head_bucket, bucket)

    def _head_bucket(self, bucket: str) -> str | None:
        try:
            resp = self._request("HEAD", "head_bucket", {"Bucket": validate_bucket(bucket)})
        except ObjectNotFound as exc:  # a HEAD has no body: S3's 404 carries no NoSuchBucket code
            raise BucketNotFound(f"bucket {bucket!r} does not exist") from exc
        try:
            return resp.headers.get("x-amz-bucket-region")
        finally:
            resp.close()

    async def bucket_location(self, bucket: str) -> bytes:
        return await self.call(self._read_xml, "get_bucket_location", {"Bucket": validate_bucket(bucket)}, bucket)

    def _list(self, bucket: str, params: dict[str, str], op: str, mapping: dict[str, str]) -> bytes:
        call: dict[str, Any] = {"Bucket": validate_bucket(bucket)}
        for name, value in params.items():
            if name in mapping:
                if name == "max-keys":
                    try:
                        call["MaxKeys"] = int(value)
                    except ValueError as exc:
                        raise BadRequest("max-keys must be an integer") from exc
                elif name == "fetch-owner":
                    call["FetchOwner"] = value.lower() == "true"
                else:
                    call[mapping[name]] = value
        return self._read_xml(op, call, bucket)

    def _read_xml(self, op: str, call: dict[str, Any], bucket: str) -> bytes:
        """The XML body of a bucket-level GET, bounded like a listing."""
        resp = self._request("GET", op, call)
        try:
            data = resp.read(MAX_LISTING_BYTES + 1)
        except OriginBadResponse as exc:
            raise OriginBadResponse(f"{op} {bucket}: {exc}") from exc
        finally:
            resp.close()
        if len(data) > MAX_LISTING_BYTES:
            raise OriginBadResponse(f"{op} {bucket}: answer larger than {MAX_LISTING_BYTES} bytes")
        return data


def _ranged(
    status: int, headers: Iterable[tuple[str, str]], length: int, start: int, body: Callable[[int], Body],
    close: Callable[[], None], what: str,
) -> tuple[ObjectInfo, Body] | None:
    """A ranged GET's answer as (what the object is, the range's body): the size from its
    ``Content-Range``, the rest from its headers; ``None`` (closed) when the origin answered
    something else than the range asked for, from ``start`` (a whole object, an unknown size)."""
    pairs = list(headers)
    content_range = next((value for name, value in pairs if name.lower() == "content-range"), "")
    match = _RANGE_RE.match(content_range)
    if status != 206 or not match or match.group(3) == "*" or int(match.group(1)) != start:
        close()
        return None
    if length != int(match.group(2)) + 1 - start:
        close()
        raise OriginBadResponse(f"{what}: origin sent {length} bytes for the range {content_range}")
    try:
        info = _info(pairs, int(match.group(3)), what)
    except BaseException:
        close()
        raise
    return info, body(length)


def _info(headers: Iterable[tuple[str, str]], size: int, what: str) -> ObjectInfo:
    """An object's info from the headers of a HEAD or GET answer (names in any case: the http
    client keeps the origin's, botocore lower-cases them)."""
    pairs = list(headers)
    lower = {name.lower(): value for name, value in pairs}
    try:
        stored = object_headers(pairs, what)
    except HeadersTooLarge as exc:
        # The origin's fault, told as one: 502, and nothing of the object is cached.
        raise OriginBadResponse(str(exc)) from exc
    return ObjectInfo(
        size=size, etag=lower.get("etag", ""), last_modified=lower.get("last-modified"), headers=stored,
        checksums=checksum_headers(pairs), key_encrypted=key_encrypted(pairs),
    )


_CHECKSUM_MODE = {"x-amz-checksum-mode": "ENABLED"}


def _closed(resp: Response) -> Body:
    """The body of an empty object: nothing to read, the connection back to the pool."""
    resp.close()
    return EmptyBody()


# Query parameter -> boto3 parameter, of each listing.
_LIST_V2_PARAMS = {
    "prefix": "Prefix",
    "delimiter": "Delimiter",
    "max-keys": "MaxKeys",
    "continuation-token": "ContinuationToken",
    "start-after": "StartAfter",
    "encoding-type": "EncodingType",
    "fetch-owner": "FetchOwner",
}
_LIST_V1_PARAMS = {
    "prefix": "Prefix",
    "delimiter": "Delimiter",
    "max-keys": "MaxKeys",
    "marker": "Marker",
    "encoding-type": "EncodingType",
}


def _plain_listings(client: Any) -> Any:
    """``client`` without botocore's habit of adding ``encoding-type=url`` to every listing it
    signs: the origin must be asked exactly what the client asked (S3 encodes names only then),
    and the parameter is signed, so it cannot be taken out of a presigned URL afterwards."""
    from botocore.handlers import set_list_objects_encoding_type_url

    for op in ("ListObjects", "ListObjectsV2"):
        client.meta.events.unregister(f"before-parameter-build.s3.{op}", set_list_objects_encoding_type_url)
    return client


def _content_length(resp: Response) -> int:
    try:
        return int(resp.headers.get("Content-Length", "-1"))
    except ValueError:
        return -1


class _SizedBody(Body):
    """A GetObject body of a known length: a body that ends short is an error here, once, with
    how far it got."""

    def __init__(self, expected: int, what: str) -> None:
        self._expected = expected
        self._what = what
        self._received = 0

    def _read(self, buf: memoryview) -> int:
        raise NotImplementedError

    def readinto(self, buf: memoryview) -> int:
        try:
            count = self._read(buf)
        except OriginBadResponse as exc:
            raise OriginBadResponse(f"{self._what}: {exc} after {self._received} of {self._expected} bytes") from exc
        self._received += count
        if not count and len(buf) and 0 <= self._expected != self._received:
            raise OriginBadResponse(f"{self._what}: body truncated at {self._received} of {self._expected} bytes")
        return count


class _HTTPBody(_SizedBody):
    def __init__(self, resp: Response, expected: int, what: str) -> None:
        super().__init__(expected, what)
        self._resp = resp

    def _read(self, buf: memoryview) -> int:
        return self._resp.readinto(buf)

    def close(self) -> None:
        self._resp.close()

    def abort(self) -> None:
        self._resp.abort()


class _Boto3Body(_SizedBody):
    def __init__(self, body: Any, expected: int, what: str) -> None:
        super().__init__(expected, what)
        self._body = body

    def _read(self, buf: memoryview) -> int:
        try:
            data = self._body.read(len(buf))
        except Exception as exc:  # botocore, urllib3 and socket errors alike
            raise OriginBadResponse(f"body cut: {exc}") from exc
        buf[: len(data)] = data
        return len(data)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._body.close()

    def abort(self) -> None:
        shutdown = getattr(getattr(self._body, "_raw_stream", None), "shutdown", None)  # urllib3 >= 2.3
        if shutdown is not None:
            with contextlib.suppress(Exception):
                shutdown()


class Boto3S3Origin(S3Origin):
    """The alternative the design asked to measure: every request a plain boto3 call on the
    origin's threads (``--s3-client boto3``), so ``bench/daemon_bench.py`` can compare it with
    the default on the same origin. Listings still pass through as XML over the HTTP pool."""

    async def start(self) -> None:
        from botocore.config import Config

        await super().start()
        # One pooled connection per concurrent request; boto3's default of 10 would queue parts.
        self._client = await self.call(
            _rebuild, self._client,
            Config(max_pool_connections=self.settings.max_connections, retries={"total_max_attempts": 1}),  # we retry
        )
        endpoint = self._client.meta.endpoint_url
        self.namespace = f"s3:{endpoint}"
        self.description = f"s3 ({endpoint}, boto3)"

    def _call(self, op: str, **params: Any) -> Any:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            return getattr(self._client, op)(**params)
        except ClientError as exc:
            raise self._error(from_client_error(exc), params) from exc
        except BotoCoreError as exc:
            raise OriginUnavailable(f"S3 {op} failed: {exc}") from exc

    def _head(self, bucket: str, key: str) -> ObjectInfo:
        resp = self._call("head_object", Bucket=validate_bucket(bucket), Key=validate_key(key), ChecksumMode="ENABLED")
        # The raw headers, not boto3's parsed fields: values exactly as sent (Expires is a
        # datetime there, and metadata keys lose their prefix).
        return _info(resp["ResponseMetadata"]["HTTPHeaders"].items(), int(resp["ContentLength"]), f"{bucket}/{key}")

    def open(
        self, bucket: str, key: str, start: int, end: int | None, etag: str | None = None, *, origin_only: bool = False
    ) -> Body:
        params: dict[str, Any] = {"Bucket": validate_bucket(bucket), "Key": validate_key(key),
                                  "Range": f"bytes={start}-{'' if end is None else end - 1}"}
        if etag:
            params["IfMatch"] = etag
        resp = self._call("get_object", **params)
        return _Boto3Body(resp["Body"], int(resp["ContentLength"]), f"{bucket}/{key}")

    def open_range(self, bucket: str, key: str, start: int, end: int, etag: str | None = None) -> tuple[ObjectInfo, Body] | None:
        params: dict[str, Any] = {"Bucket": validate_bucket(bucket), "Key": validate_key(key),
                                  "Range": f"bytes={start}-{end - 1}"}
        if etag:
            params["IfMatch"] = etag
        resp = self._call("get_object", **params)
        meta = resp["ResponseMetadata"]

        def close() -> None:
            with contextlib.suppress(Exception):
                resp["Body"].close()

        return _ranged(meta["HTTPStatusCode"], meta["HTTPHeaders"].items(), int(resp["ContentLength"]), start,
                       lambda expected: _Boto3Body(resp["Body"], expected, f"{bucket}/{key}"), close, f"{bucket}/{key}")

    def open_first(self, bucket: str, key: str, *, origin_only: bool = False) -> tuple[ObjectInfo, Body]:
        # Not ranged, with the checksum mode, as S3Origin.open_first (botocore validates the
        # checksum too, as it streams: a mismatch there is a body error, retried).
        resp = self._call("get_object", Bucket=validate_bucket(bucket), Key=validate_key(key), ChecksumMode="ENABLED")
        size = int(resp["ContentLength"])
        try:
            info = _info(resp["ResponseMetadata"]["HTTPHeaders"].items(), size, f"{bucket}/{key}")
        except BaseException:
            with contextlib.suppress(Exception):
                resp["Body"].close()
            raise
        return info, _Boto3Body(resp["Body"], size, f"{bucket}/{key}")


def _rebuild(client: Any, config: Any) -> Any:
    import boto3

    return _plain_listings(boto3.session.Session().client(
        "s3", endpoint_url=client.meta.endpoint_url, region_name=client.meta.region_name,
        config=client.meta.config.merge(config),
    ))
