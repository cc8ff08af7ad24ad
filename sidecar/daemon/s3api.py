"""The daemon's S3 read API: GET/HEAD object (hits with sendfile, misses joined to one fill),
ListObjectsV2, ListObjects (v1), HeadBucket and GetBucketLocation passed to the origin, and 405
for writes.

A read may carry the caller's xxh3-128 of the object (``x-shardcache-xxh3-128``, the loader's
manifest). The answer then holds nothing but bytes that hash to it: a hit is compared before the
first byte, a miss waits for its fill to be sealed and compares; a disagreement is judged by
:mod:`sidecar.daemon.claims` (a claim, not an order) and answered ``409 ChecksumMismatch`` when
the copy is right. ``x-shardcache-recheck: 1`` (a short-circuit reader whose own read of the
file did not match) makes the daemon re-hash its file before answering, as rarely as a
disagreeing claim may.

Every byte a client is sent counts twice: by how it was sent (``served_bytes``: hit, miss,
coalesced, passthrough, short_circuit) and by where it came from (``client_bytes``, the node's
figures, :data:`~sidecar.daemon.metrics.NODE_SOURCES`): a hit, or a join of a fill already running
here, is ``local``; a miss is where its fill reads (the owner, ``peer``, or the ``origin``); a
read streamed uncached is where its body came from (:func:`~sidecar.daemon.peers.context.track_source`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import Any

from aiohttp import web

from cache import CacheError, CorruptEntry, Entry, EntryNotFound, IntegrityError, Store
from sidecar.daemon.auth.http import AUTH, listing_access, object_access
from sidecar.daemon.claims import caller_of
from sidecar.daemon.fills import Fetcher, Fill, retrying
from sidecar.daemon.keys import CLAIMS, FETCHER, METRICS, ORIGIN, STORE
from sidecar.daemon.origins import ObjectInfo
from sidecar.daemon.peers.context import ORIGIN_ONLY, PEER_CALLER, count_read, count_served, miss_source, track_source
from sidecar.daemon.peers.http import peer_request
from sidecar.daemon.peers.origin import ClusterOrigin
from sidecar.daemon.peers.signing import IF_CACHED_HEADER
from sidecar.daemon.priority import DEMAND
from sidecar.daemon.s3xml import error_response, parse_range
from sidecar.errors import BadRequest, ChecksumMismatch, OriginError, PreconditionFailed
from wire.names import validate_bucket, validate_key, validate_prefix, validate_xxh3_128
from wire.s3headers import ObjectHeaders, failed_condition, not_modified_headers, precondition

log = logging.getLogger(__name__)

__all__ = ["s3_handler", "UNCACHED_NAMES", "disputed", "mismatch"]

UNCACHED_NAMES = frozenset({"manifest.json"})


class _SendfileResponse(web.StreamResponse):
    """Body sent with sendfile(2) from an already-open, verified file descriptor."""

    def __init__(self, fd: int, offset: int, count: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._fd = fd
        self._offset = offset
        self._count = count

    async def prepare(self, request: web.BaseRequest):  # type: ignore[no-untyped-def]
        if self._fd < 0:  # aiohttp prepares a returned response again: already sent
            return await super().prepare(request)
        try:
            writer = await super().prepare(request)
            if request.method == "HEAD" or self._count == 0:
                return writer
            transport = request.transport
            if transport is None:
                raise ConnectionResetError("client went away")
            with os.fdopen(self._fd, "rb", closefd=False) as fobj:
                await asyncio.get_running_loop().sendfile(transport, fobj, self._offset, self._count)
            await super().write_eof()
            return writer
        finally:
            os.close(self._fd)
            self._fd = -1


def _object_headers(
    obj: Entry | ObjectInfo, cache: str, stored: ObjectHeaders | None = None, request: web.Request | None = None
) -> dict[str, str]:
    """What every answer about an object says, hit or miss alike: what the origin said about it
    (Last-Modified, Content-Type, x-amz-meta-*, ...; ``stored`` instead of its stored headers)
    and its ETag. An entry cached by an older daemon has no Last-Modified nor stored headers.

    The origin's additional checksums go to a ``request`` that asks for them
    (``x-amz-checksum-mode: ENABLED``) and is not ranged, as S3 answers them: a client such as
    boto3 then checks the whole body against them itself."""
    headers: dict[str, str] = {}
    for name, value in obj.headers if stored is None else stored:
        # One value per name: a repeated header means the values joined, as HTTP defines it.
        headers[name] = f"{headers[name]}, {value}" if name in headers else value
    if (
        request is not None
        and request.headers.get("x-amz-checksum-mode", "").upper() == "ENABLED"
        and "Range" not in request.headers
    ):
        headers.update(obj.checksums)
    headers.update({"ETag": obj.etag, "Accept-Ranges": "bytes", "x-shardcache-cache": cache})
    if isinstance(obj, Entry) and PEER_CALLER.get() is not None:
        headers["x-shardcache-xxh3-128"] = obj.xxh3_128  # a peer checks its copy against it too
    if obj.last_modified:
        headers["Last-Modified"] = obj.last_modified
    return headers


def _conditional(request: web.Request, obj: Entry | ObjectInfo, cache: str) -> web.Response | None:
    """The answer to a conditional request whose condition decides it (304, or 412 raised),
    else ``None``: answer the object. Evaluated before ``Range``, as S3 does."""
    status = precondition(request.headers, obj.etag, obj.last_modified)
    if status == 412:
        raise PreconditionFailed("At least one of the pre-conditions you specified did not hold",
                                 failed_condition(request.headers))
    if status == 304:
        return web.Response(status=304, headers=_object_headers(obj, cache, not_modified_headers(obj.headers)))
    return None


def _range_headers(headers: dict[str, str], rng: tuple[int, int] | None, size: int) -> tuple[int, int, int]:
    """Adds Content-Range when ranged; returns (status, start, end)."""
    if rng is None:
        return 200, 0, size
    start, end = rng
    headers["Content-Range"] = f"bytes {start}-{end - 1}/{size}"
    return 206, start, end


# -- the S3 read API ---------------------------------------------------------------------------


def _split(request: web.Request) -> tuple[str, str]:
    # The raw path keeps %2F and friends encoded; aiohttp has decoded request.path already.
    path = request.match_info.get("path", "")
    bucket, _, key = path.partition("/")
    return bucket, key


async def s3_handler(request: web.Request) -> web.StreamResponse:
    bucket, key = _split(request)
    if not bucket:
        raise BadRequest("listing buckets is not supported: address a bucket, /{bucket}?list-type=2")
    validate_bucket(bucket)
    if request.method not in ("GET", "HEAD"):
        return error_response(
            405, "MethodNotAllowed", f"{request.method} is not allowed: shardcache serves reads only",
            f"/{bucket}/{key}", headers={"Allow": "GET, HEAD"},
        )
    if not key:
        if request.method == "HEAD":
            await listing_access(request, bucket, "")  # S3 asks s3:ListBucket of a HeadBucket
            return await _head_bucket(request, bucket)
        return await _bucket_get(request, bucket)
    validate_key(key)
    # A peer's read (sidecar/daemon/peers/): checked here, then marked in this handler's context.
    if (refusal := peer_request(request)) is not None:
        return refusal
    expected = request.headers.get("x-shardcache-xxh3-128")
    if expected is not None:
        expected = validate_xxh3_128(expected, "x-shardcache-xxh3-128")
    # Before the cache is looked at: a cached object is refused like any other (--auth sigv4).
    # A peer's read skips them: the asking daemon checked its own caller.
    tenant = "" if PEER_CALLER.get() is not None else await object_access(request, bucket, key)
    store = request.app.get(STORE)
    if key.rsplit("/", 1)[-1] in UNCACHED_NAMES:
        # The manifest is the mutable index of immutable shards: always the origin's current copy.
        store = None
        ORIGIN_ONLY.set(True)  # and no peer caches it either
    if request.method == "HEAD":
        return await _head(request, store, bucket, key, expected)
    return await _get(request, store, bucket, key, expected, tenant)


# Bucket subresources S3 answers with documents of their own: a listing in their place would be
# a wrong answer that parses, so they are refused. ``location`` is answered (s3fs asks for it).
_SUBRESOURCES = frozenset({
    "accelerate", "acl", "analytics", "cors", "encryption", "intelligent-tiering", "inventory",
    "lifecycle", "logging", "metadataTable", "metrics", "notification", "object-lock",
    "ownershipControls", "policy", "policyStatus", "publicAccessBlock", "replication",
    "requestPayment", "tagging", "uploads", "versioning", "versions", "website",
})


async def _origin_call(request: web.Request, op: str, what: str, fn: Any, *args: Any) -> Any:
    metrics = request.app[METRICS]
    began = time.perf_counter()
    result = await retrying(request.app[FETCHER].settings, metrics, what, fn, *args)
    metrics.origin_latency.labels(op=op).observe(time.perf_counter() - began)
    return result


async def _head_bucket(request: web.Request, bucket: str) -> web.Response:
    """HeadBucket: 200 when the origin has the bucket, 404 NoSuchBucket (no body) when not."""
    region = await _origin_call(request, "head_bucket", f"head {bucket}", request.app[ORIGIN].head_bucket, bucket)
    return web.Response(status=200, headers={"x-amz-bucket-region": region} if region else None)


async def _bucket_get(request: web.Request, bucket: str) -> web.Response:
    """GetBucketLocation, ListObjectsV2 (``list-type=2``) or ListObjects (v1: no ``list-type``;
    rclone's default and older SDKs), each passed to the origin with the client's query."""
    query = request.query
    origin = request.app[ORIGIN]
    if "location" in query:
        await listing_access(request, bucket, "")
        body = await _origin_call(request, "location", f"location of {bucket}", origin.bucket_location, bucket)
        return web.Response(body=body, content_type="application/xml")
    refused = sorted(set(query) & _SUBRESOURCES)
    if refused:
        raise BadRequest(f"?{refused[0]} is not supported: shardcache serves object reads and listings only")
    list_type = query.get("list-type")
    if list_type not in (None, "2"):
        raise BadRequest("list-type must be 2 (ListObjectsV2), or absent (ListObjects)")
    if query.get("encoding-type", "url") != "url":
        raise BadRequest("Invalid Encoding Method specified in Request: encoding-type can only be url")
    max_keys = query.get("max-keys")
    if max_keys is not None and not (max_keys.isascii() and max_keys.isdigit()):
        raise BadRequest("max-keys must be a non-negative integer")
    validate_prefix(query.get("prefix", ""))
    await listing_access(request, bucket, query.get("prefix", ""))
    lister = origin.list_objects_v2 if list_type == "2" else origin.list_objects
    body = await _origin_call(request, "list", f"list {bucket}", lister, bucket, dict(query))
    return web.Response(body=body, content_type="application/xml")


async def _head(request: web.Request, store: Store | None, bucket: str, key: str, expected: str | None) -> web.Response:
    entry = store.lookup(bucket, key, xxh3_128=expected) if store is not None else None
    if entry is not None:
        if (answer := _conditional(request, entry, "hit")) is not None:
            return answer
        headers = _object_headers(entry, "hit", request=request)
        headers["Content-Length"] = str(entry.size)
        return web.Response(status=200, headers=headers)
    metrics = request.app[METRICS]
    began = time.perf_counter()
    info: ObjectInfo = await retrying(
        request.app[FETCHER].settings, metrics, f"head {bucket}/{key}", request.app[ORIGIN].head, bucket, key
    )
    metrics.origin_latency.labels(op="head").observe(time.perf_counter() - began)
    if (answer := _conditional(request, info, "miss")) is not None:
        return answer
    headers = _object_headers(info, "miss", request=request)
    headers["Content-Length"] = str(info.size)
    return web.Response(status=200, headers=headers)


async def _open_hit(store: Store, entry: Entry, force: bool = False) -> tuple[int, os.stat_result] | None:
    """The entry's file, open, if it checks out (re-hashed when its stamp moved, or ``force``)."""
    try:
        return await asyncio.to_thread(store.open_verified, entry, force)
    except (CorruptEntry, EntryNotFound):
        return None  # detected and removed: refetch below


async def disputed(app: web.Application, store: Store, entry: Entry, claim: str, caller: str) -> Entry | None:
    """A hit whose caller expects other bytes (:mod:`sidecar.daemon.claims`): ``None`` when the
    object is to be fetched again (the copy failed its own check, or an unverified copy's first
    dispute with this claim), else :class:`ChecksumMismatch`. The one rule, for the HTTP GET and
    for file handles (:mod:`sidecar.daemon.handles`)."""
    claims = app[CLAIMS]
    outcomes = app[METRICS].claim_outcomes
    if claims.may_recheck(entry):
        with store.pinned(entry):
            opened = await _open_hit(store, entry, force=True)
        if opened is None:
            outcomes.labels(outcome="refetched").inc()
            return None
        await asyncio.to_thread(os.close, opened[0])
    if claims.may_refetch(entry, claim, caller):
        outcomes.labels(outcome="refetched").inc()
        return None
    outcomes.labels(outcome="mismatch").inc()
    vouched = (
        f"verified against the origin's {entry.verified}" if entry.verified
        else "unverified: the origin sends no checksum for it, and it was fetched again for this checksum already"
    )
    raise mismatch(f"{entry.bucket}/{entry.key}: the cached copy", entry.etag, vouched, entry.xxh3_128, claim)


def mismatch(what: str, etag: str, vouched: str, digest: str, claim: str) -> ChecksumMismatch:
    return ChecksumMismatch(
        f"{what} (ETag {etag}, {vouched}) hashes to xxh3-128 {digest}, the caller expects {claim}: the "
        "manifest is stale or wrong (rebuild it with `shardcache index`)"
    )


async def _get(
    request: web.Request, store: Store | None, bucket: str, key: str, claim: str | None, tenant: str = ""
) -> web.StreamResponse:
    metrics = request.app[METRICS]
    began = time.perf_counter()
    # Not under --auth: a path is for whoever shares the cache directory, and with tenants nobody
    # may (a pod holding the directory could open any tenant's file by path); bytes instead.
    short_circuit = request.headers.get("x-shardcache-short-circuit") == "1" and AUTH not in request.app
    if store is not None:
        entry = store.lookup(bucket, key)
        if entry is not None and claim and entry.xxh3_128 != claim:
            entry = await disputed(request.app, store, entry, claim, caller_of(request))
        if entry is not None and (answer := _conditional(request, entry, "hit")) is not None:
            metrics.cache_lookups.labels(result="hit").inc()
            return answer
        if entry is not None:
            # A short-circuit reader that found the file wrong asks for a re-hash (bounded).
            force = request.headers.get("x-shardcache-recheck") == "1" and request.app[CLAIMS].may_recheck(entry)
            with store.pinned(entry):
                opened = await _open_hit(store, entry, force)
                if opened is not None:
                    metrics.cache_lookups.labels(result="hit").inc()
                    response = await _serve_entry(request, store, entry, opened, "hit", short_circuit, "local")
                    metrics.request_duration.labels(cache="hit").observe(time.perf_counter() - began)
                    return response

    fetcher = request.app[FETCHER]
    if PEER_CALLER.get() is not None and request.headers.get(IF_CACHED_HEADER) == "1":
        # A hand-off asks for this daemon's copy only (peers/origin.py): without one here, the
        # asking owner reads the origin itself rather than have this daemon fill it too.
        return error_response(503, "NotCached", f"{bucket}/{key} is not cached on this member", request.path)
    if store is None:
        return await _passthrough_get(request, bucket, key)
    origin = request.app[ORIGIN]
    if PEER_CALLER.get() is not None and isinstance(origin, ClusterOrigin) and origin.fetching_from_peer(bucket, key):
        # This daemon reads the object from a peer that (with another view of the ring) asks it
        # back: joining that fill would wait on itself. The origin's bytes, uncached, instead.
        return await _passthrough_get(request, bucket, key)
    fill, created = fetcher.start(bucket, key, DEMAND, tenant=tenant)
    state = "miss" if created else "coalesced"
    metrics.cache_lookups.labels(result=state).inc()
    info = await fill.wait_info()
    came_from = miss_source(state, info.source)
    # The fill goes on whatever the condition says: the object is wanted, in this version.
    if (answer := _conditional(request, info, state)) is not None:
        return answer
    if claim and fill.cacheable:
        # The caller's checksum is compared before the first byte: it gets these bytes or an error.
        digest = await fill.wait_sealed()
        if digest is not None and digest != claim:
            metrics.claim_outcomes.labels(outcome="mismatch").inc()
            vouched = f"just fetched, verified against its {fill.check.algorithm}" if fill.check else "just fetched, unverified"
            raise mismatch(f"{bucket}/{key}: the origin's bytes", info.etag, vouched, digest, claim)

    if short_circuit and fill.cacheable and store is not None:
        await fill.wait_sealed()
        if fill.placed is not None:
            # Checked, and under its published name already: no need to wait for the fsync.
            return _short_circuit_answer(request, info, fill.placed, state, came_from)
        entry = await fill.wait_done()
        if entry is not None:
            with store.pinned(entry):
                opened = await _open_hit(store, entry)
                if opened is not None:
                    return await _serve_entry(request, store, entry, opened, state, short_circuit, came_from)

    rng = parse_range(request.headers.get("Range"), info.size)
    headers = _object_headers(info, state, request=request)
    status, start, end = _range_headers(headers, rng, info.size)
    response = web.StreamResponse(status=status, headers=headers)
    response.content_length = end - start
    if fill.cacheable:
        await _send_fill(request, response, fetcher, fill, start, end, state, came_from)
        metrics.request_duration.labels(cache=state).observe(time.perf_counter() - began)
        return response
    read_from = track_source()  # the route is chosen anew: the owner's copy, or the origin's
    body = fetcher.passthrough(bucket, key, start, end, info.etag or None)
    source = "passthrough"
    # Pull the first chunk before committing to a 200: an origin that fails at once still gets
    # its proper S3 error answer instead of a truncated body.
    first = await anext(body, b"")
    await response.prepare(request)
    count_read(metrics, read_from.source)
    if first:
        await response.write(first)
        count_served(metrics, source, len(first), came_from=read_from.source)
    async for chunk in body:
        await response.write(chunk)
        count_served(metrics, source, len(chunk), came_from=read_from.source)
    await response.write_eof()
    metrics.request_duration.labels(cache=state).observe(time.perf_counter() - began)
    return response


async def _passthrough_get(request: web.Request, bucket: str, key: str) -> web.StreamResponse:
    """Straight from the origin, caching nothing (uncacheable names, or no store at all)."""
    fetcher = request.app[FETCHER]
    metrics = request.app[METRICS]
    metrics.cache_lookups.labels(result="miss").inc()
    info: ObjectInfo = await retrying(
        fetcher.settings, metrics, f"head {bucket}/{key}", request.app[ORIGIN].head, bucket, key
    )
    if (answer := _conditional(request, info, "miss")) is not None:
        return answer
    rng = parse_range(request.headers.get("Range"), info.size)
    headers = _object_headers(info, "miss", request=request)
    status, start, end = _range_headers(headers, rng, info.size)
    response = web.StreamResponse(status=status, headers=headers)
    response.content_length = end - start
    await response.prepare(request)
    read_from = track_source()
    counted = False
    async for chunk in fetcher.passthrough(bucket, key, start, end, info.etag or None):
        if not counted:  # the body is open now: its source is known
            count_read(metrics, read_from.source)
            counted = True
        await response.write(chunk)
        count_served(metrics, "passthrough", len(chunk), came_from=read_from.source)
    if not counted:
        count_read(metrics, read_from.source)
    await response.write_eof()
    return response


async def _send_fill(
    request: web.Request, response: web.StreamResponse, fetcher: Fetcher, fill: Fill, start: int, end: int, state: str,
    came_from: str,
) -> None:
    """Send ``[start, end)`` of a fill in progress with sendfile from its temp file, as the bytes
    land. If caching fails underneath (disk full), finish from the origin at the byte reached.
    ``came_from``: where this client's bytes count as coming from (``local`` when it joined a
    fill in progress, else the fill's source)."""
    metrics = request.app[METRICS]
    loop = asyncio.get_running_loop()
    sent = start
    try:
        async for fd, offset, length in fill.ranges(start, end):
            if not response.prepared:
                # Prepared only once bytes exist: a fill failing at once still gets an S3 error.
                await response.prepare(request)
                count_read(metrics, came_from)
            transport = request.transport
            if transport is None:
                raise ConnectionResetError("client went away")
            with os.fdopen(fd, "rb", closefd=False) as fobj:
                await loop.sendfile(transport, fobj, offset, length)
            sent = offset + length
            count_served(metrics, state, length, came_from=came_from)
    except (CacheError, OSError) as exc:
        if isinstance(exc, (OriginError, IntegrityError, ConnectionError)) or not fill.info:
            raise
        log.warning("cache fill of %s/%s failed (%s); serving from the origin", fill.bucket, fill.key, exc)
        read_from = track_source()  # the rest: from the owner or the origin, as routed now
        async for chunk in fetcher.passthrough(fill.bucket, fill.key, sent, end, fill.info.etag or None):
            if not response.prepared:
                await response.prepare(request)
                count_read(metrics, read_from.source)
            await response.write(chunk)
            count_served(metrics, "passthrough", len(chunk), came_from=read_from.source)
    if not response.prepared:  # an empty range
        await response.prepare(request)
        count_read(metrics, came_from)
    await response.write_eof()


def _short_circuit_answer(
    request: web.Request, obj: Entry | ObjectInfo, path: str, state: str, came_from: str
) -> web.Response:
    headers = _object_headers(obj, state, request=request)
    headers["x-shardcache-path"] = path
    headers["x-shardcache-size"] = str(obj.size)
    metrics = request.app[METRICS]
    count_read(metrics, came_from)
    count_served(metrics, "short_circuit", obj.size, came_from=came_from)
    return web.Response(status=200, headers=headers)


async def _serve_entry(
    request: web.Request, store: Store, entry: Entry, opened: tuple[int, os.stat_result], state: str, short_circuit: bool,
    came_from: str,
) -> web.StreamResponse:
    fd, _ = opened
    metrics = request.app[METRICS]
    headers = _object_headers(entry, state, request=request)
    if short_circuit:
        os.close(fd)
        return _short_circuit_answer(request, entry, str(store.data_path(entry)), state, came_from)
    try:
        rng = parse_range(request.headers.get("Range"), entry.size)
    except BaseException:
        os.close(fd)
        raise
    status, start, end = _range_headers(headers, rng, entry.size)
    response = _SendfileResponse(fd, start, end - start, status=status, headers=headers)
    response.content_length = end - start
    await response.prepare(request)
    count_read(metrics, came_from)
    count_served(metrics, state, end - start, came_from=came_from)
    return response
