"""The daemon's S3 read API: GET/HEAD object (hits with sendfile, misses joined to one fill),
ListObjectsV2, ListObjects (v1), HeadBucket and GetBucketLocation passed to the origin, and 405
for writes.

A read is described as a :class:`~sidecar.daemon.reads.ReadContext` and answered by the daemon's
one read path (:mod:`sidecar.daemon.reads`); this module translates: requests into contexts, and
what the read service returns into HTTP answers (sendfile of a hit, a fill streamed as it lands,
a short-circuit path, an uncached stream, a small range from one ranged GET of the origin, an S3
error).

A read may carry the caller's xxh3-128 of the object (``x-shardcache-xxh3-128``, the loader's
manifest): the answer then holds nothing but bytes that hash to it, or ``409 ChecksumMismatch``.
``x-shardcache-recheck: 1`` (a short-circuit reader whose own read of the file did not match)
makes the daemon re-hash its file before answering, as rarely as a disagreeing claim may. A
request signed by a peer daemon of the cluster (:func:`~sidecar.daemon.peers.http.peer_request`)
is read for that peer: no tenant check (the asking daemon checked its caller), origin only.

Bytes are counted by :class:`~sidecar.daemon.accounting.Tally`, as they are sent, and for the job
a reader names in ``x-shardcache-job`` (checked for every request by
:func:`~sidecar.daemon.jobstats.job_header`) by its :class:`~sidecar.daemon.jobstats.JobTally`.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import time
from typing import Any

from aiohttp import web

from cache import CacheError, Entry, IntegrityError
from sidecar.daemon.accounting import Tally
from sidecar.daemon.auth.http import AUTH, listing_access, object_access
from sidecar.daemon.claims import caller_of
from sidecar.daemon.jobstats import request_job
from sidecar.daemon.keys import ORIGIN, READS
from sidecar.daemon.origins import ObjectInfo
from sidecar.daemon.peers.http import peer_request
from sidecar.daemon.peers.signing import IF_CACHED_HEADER
from sidecar.daemon.reads import Decided, Direct, Filling, Hit, NotCached, ReadContext, ReadService, Uncached
from sidecar.daemon.s3xml import error_response, parse_range, requested_range
from sidecar.errors import BadRequest, OriginError, PreconditionFailed
from wire.names import validate_bucket, validate_key, validate_prefix, validate_xxh3_128
from wire.s3headers import ObjectHeaders, failed_condition, not_modified_headers, precondition

log = logging.getLogger(__name__)

__all__ = ["s3_handler"]


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
    obj: Entry | ObjectInfo, cache: str, stored: ObjectHeaders | None = None, request: web.Request | None = None,
    peer: bool = False,
) -> dict[str, str]:
    """What every answer about an object says, hit or miss alike: what the origin said about it
    (Last-Modified, Content-Type, x-amz-meta-*, ...; ``stored`` instead of its stored headers)
    and its ETag. An entry cached by an older daemon has no Last-Modified nor stored headers.

    The origin's additional checksums go to a ``request`` that asks for them
    (``x-amz-checksum-mode: ENABLED``) and is not ranged, as S3 answers them: a client such as
    boto3 then checks the whole body against them itself. A ``peer`` daemon is told a cached
    copy's xxh3-128 too: it checks its own copy against it."""
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
    if isinstance(obj, Entry) and peer:
        headers["x-shardcache-xxh3-128"] = obj.xxh3_128
    if obj.last_modified:
        headers["Last-Modified"] = obj.last_modified
    return headers


def _conditional(request: web.Request, ctx: ReadContext, obj: Entry | ObjectInfo, cache: str) -> web.Response | None:
    """The answer to a conditional request whose condition decides it (304, or 412 raised),
    else ``None``: answer the object. Evaluated before ``Range``, as S3 does."""
    status = precondition(request.headers, obj.etag, obj.last_modified)
    if status == 412:
        raise PreconditionFailed("At least one of the pre-conditions you specified did not hold",
                                 failed_condition(request.headers))
    if status == 304:
        stored = not_modified_headers(obj.headers)
        return web.Response(status=304, headers=_object_headers(obj, cache, stored, peer=ctx.peer is not None))
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
    # A peer's read (sidecar/daemon/peers/): checked here, then read for that peer.
    peer = peer_request(request)
    if isinstance(peer, web.Response):
        return peer
    expected = request.headers.get("x-shardcache-xxh3-128")
    if expected is not None:
        expected = validate_xxh3_128(expected, "x-shardcache-xxh3-128")
    # Before the cache is looked at: a cached object is refused like any other (--auth sigv4).
    # A peer's read skips them: the asking daemon checked its own caller.
    tenant = "" if peer is not None else await object_access(request, bucket, key)
    ctx = ReadContext(
        # Who asks matters only to a disputed claim's refetch budget: no socket query without one.
        bucket, key, caller=caller_of(request) if expected else "", tenant=tenant, claim=expected,
        recheck=request.headers.get("x-shardcache-recheck") == "1", peer=peer,
        if_cached=peer is not None and request.headers.get(IF_CACHED_HEADER) == "1",
        job="" if peer is not None else request_job(request),
    )
    if request.method == "HEAD":
        return await _head(request, request.app[READS], ctx)
    return await _get(request, request.app[READS], ctx)


# Bucket subresources S3 answers with documents of their own: a listing in their place would be
# a wrong answer that parses, so they are refused. ``location`` is answered (s3fs asks for it).
_SUBRESOURCES = frozenset({
    "accelerate", "acl", "analytics", "cors", "encryption", "intelligent-tiering", "inventory",
    "lifecycle", "logging", "metadataTable", "metrics", "notification", "object-lock",
    "ownershipControls", "policy", "policyStatus", "publicAccessBlock", "replication",
    "requestPayment", "tagging", "uploads", "versioning", "versions", "website",
})


async def _origin_call(request: web.Request, op: str, what: str, fn: Any, *args: Any) -> Any:
    return await request.app[READS].fetcher.call_origin(op, what, fn, *args)


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



# -- an object ------------------------------------------------------------------------------------


async def _head(request: web.Request, reads: ReadService, ctx: ReadContext) -> web.Response:
    obj, state = await reads.head(ctx)
    if (answer := _conditional(request, ctx, obj, state)) is not None:
        return answer
    headers = _object_headers(obj, state, request=request, peer=ctx.peer is not None)
    headers["Content-Length"] = str(obj.size)
    return web.Response(status=200, headers=headers)


async def _get(request: web.Request, reads: ReadService, ctx: ReadContext) -> web.StreamResponse:
    metrics = reads.metrics
    began = time.perf_counter()
    # Not under --auth: a path is for whoever shares the cache directory, and with tenants nobody
    # may (a pod holding the directory could open any tenant's file by path); bytes instead.
    mode = request.headers.get("x-shardcache-short-circuit")
    short_circuit = mode in ("1", "if-cached") and AUTH not in request.app
    # "if-cached": the path of a cached copy, else the fill's bytes as they land (a reader that
    # checks each sample against its member index need not wait for the whole object's seal).
    wait_for_path = short_circuit and mode == "1"
    # One explicit span (a sample of a shard): a small one of an object not cached may come
    # straight from the origin (reads.py). A short-circuit reader wants the whole file ("if-cached":
    # a cached one's; else the span it asks for).
    direct = None if short_circuit and wait_for_path else requested_range(request.headers.get("Range"))
    try:
        result = await reads.read(ctx, decide=functools.partial(_conditional, request, ctx), direct=direct)
    except NotCached as exc:
        # A hand-off asks for this daemon's copy only (peers/origin.py): without one here, the
        # asking owner reads the origin itself rather than have this daemon fill it too.
        return error_response(503, "NotCached", str(exc), request.path)
    if isinstance(result, Decided):
        answer: web.Response = result.answer
        return answer
    if isinstance(result, Hit):
        response = await _serve_hit(request, reads, ctx, result, short_circuit)
    elif isinstance(result, Uncached):
        response = await _serve_uncached(request, reads, ctx, result)
    elif isinstance(result, Direct):
        response = await _serve_direct(request, reads, ctx, result)
    else:
        before_seal = direct is not None and reads.may_go_direct(ctx, direct)
        response = await _serve_fill(request, reads, ctx, result, wait_for_path, before_seal)
    metrics.request_duration.labels(cache=result.state).observe(time.perf_counter() - began)
    return response


async def _serve_hit(
    request: web.Request, reads: ReadService, ctx: ReadContext, hit: Hit, short_circuit: bool
) -> web.StreamResponse:
    """A verified copy: its path (short-circuit), or its bytes with sendfile."""
    entry, fd = hit.entry, hit.fd
    assert reads.store is not None
    tally = reads.tally(ctx)
    with reads.store.pinned(entry):  # its disk space stays accounted for while it is sent
        if short_circuit:
            os.close(fd)
            return _short_circuit_answer(request, ctx, tally, entry, str(reads.store.data_path(entry)), hit)
        headers = _object_headers(entry, hit.state, request=request, peer=ctx.peer is not None)
        try:
            rng = parse_range(request.headers.get("Range"), entry.size)
        except BaseException:
            os.close(fd)
            raise
        status, start, end = _range_headers(headers, rng, entry.size)
        response = _SendfileResponse(fd, start, end - start, status=status, headers=headers)
        response.content_length = end - start
        await response.prepare(request)
        tally.read(hit.came_from)
        tally.served(hit.state, end - start, hit.came_from)
        return response


async def _serve_fill(
    request: web.Request, reads: ReadService, ctx: ReadContext, filling: Filling, short_circuit: bool,
    before_seal: bool = False,
) -> web.StreamResponse:
    """A fill's bytes as they land (sendfile from its temp file), or, for a short-circuit reader,
    the path of the sealed copy. ``before_seal``: a small range sent whole as soon as it has
    landed (reads.py's direct ranges), else its last byte waits for the origin's checksum."""
    fill, info = filling.fill, filling.info
    if short_circuit:
        await fill.wait_sealed()
        if fill.placed is not None:
            # Checked, and under its published name already: no need to wait for the fsync.
            return _short_circuit_answer(request, ctx, reads.tally(ctx), info, fill.placed, filling)
        entry = await fill.wait_done()
        fd = await reads.open(entry) if entry is not None else None
        if entry is not None and fd is not None:
            return await _serve_hit(request, reads, ctx, Hit(entry, fd, filling.state, filling.came_from), True)

    rng = parse_range(request.headers.get("Range"), info.size)
    headers = _object_headers(info, filling.state, request=request, peer=ctx.peer is not None)
    status, start, end = _range_headers(headers, rng, info.size)
    response = web.StreamResponse(status=status, headers=headers)
    response.content_length = end - start
    tally = reads.tally(ctx)
    loop = asyncio.get_running_loop()
    sent = start
    try:
        async for fd, offset, length in fill.ranges(start, end, before_seal):
            if not response.prepared:
                # Prepared only once bytes exist: a fill failing at once still gets an S3 error.
                await response.prepare(request)
                tally.read(filling.came_from)
            transport = request.transport
            if transport is None:
                raise ConnectionResetError("client went away")
            with os.fdopen(fd, "rb", closefd=False) as fobj:
                await loop.sendfile(transport, fobj, offset, length)
            sent = offset + length
            tally.served(filling.state, length, filling.came_from)
    except (CacheError, OSError) as exc:
        if isinstance(exc, (OriginError, IntegrityError, ConnectionError)) or not fill.info:
            raise
        # Caching failed underneath (the disk filled up): the rest from the origin.
        log.warning("cache fill of %s/%s failed (%s); serving from the origin", fill.bucket, fill.key, exc)
    if sent < end:
        await _stream_origin(request, response, reads, ctx, tally, info.etag, sent, end)
    if not response.prepared:  # an empty range
        await response.prepare(request)
        tally.read(filling.came_from)
    await response.write_eof()
    return response


async def _serve_uncached(
    request: web.Request, reads: ReadService, ctx: ReadContext, uncached: Uncached
) -> web.StreamResponse:
    """Straight from the origin, caching nothing (a name never cached, no store, no room)."""
    info = uncached.info
    rng = parse_range(request.headers.get("Range"), info.size)
    headers = _object_headers(info, uncached.state, request=request, peer=ctx.peer is not None)
    status, start, end = _range_headers(headers, rng, info.size)
    response = web.StreamResponse(status=status, headers=headers)
    response.content_length = end - start
    await _stream_origin(request, response, reads, ctx, reads.tally(ctx), info.etag, start, end)
    await response.write_eof()
    return response


async def _serve_direct(request: web.Request, reads: ReadService, ctx: ReadContext, direct: Direct) -> web.StreamResponse:
    """A small range of an object not cached, from the origin's answer to one ranged GET: its
    headers (the version the bytes are of) and its bytes, caching nothing (reads.py)."""
    read = direct.read
    try:
        headers = _object_headers(read.info, direct.state, request=request, peer=ctx.peer is not None)
        status, start, end = _range_headers(headers, (read.start, read.end), read.info.size)
        response = web.StreamResponse(status=status, headers=headers)
        response.content_length = end - start
        tally = reads.tally(ctx)
        await response.prepare(request)  # the origin has answered: its error would have come first
        tally.read(direct.came_from)
        async for chunk in read.chunks():
            await response.write(chunk)
            tally.served(direct.state, len(chunk), direct.came_from)
    finally:
        read.close()
    await response.write_eof()
    return response


async def _stream_origin(
    request: web.Request, response: web.StreamResponse, reads: ReadService, ctx: ReadContext, tally: Tally,
    etag: str, start: int, end: int,
) -> None:
    """``[start, end)`` from the origin (or the owner, where a cluster routes it), uncached, into
    ``response``: prepared once the first chunk is in, unless it was already (the rest of a fill
    that failed), so an origin failing at once still gets its proper S3 error answer. The read
    counts once, under where its first byte came from."""
    counted = response.prepared
    chunks = reads.fetcher.passthrough(ctx.bucket, ctx.key, start, end, etag or None, origin_only=ctx.origin_only)
    async for chunk, source in chunks:
        if not response.prepared:
            await response.prepare(request)
        if not counted:
            tally.read(source)
            counted = True
        await response.write(chunk)
        tally.served("passthrough", len(chunk), source)
    if not response.prepared:
        await response.prepare(request)
    if not counted:  # an empty range
        tally.read("origin")


def _short_circuit_answer(
    request: web.Request, ctx: ReadContext, tally: Tally, obj: Entry | ObjectInfo, path: str, read: Hit | Filling
) -> web.Response:
    headers = _object_headers(obj, read.state, request=request, peer=ctx.peer is not None)
    headers["x-shardcache-path"] = path
    headers["x-shardcache-size"] = str(obj.size)
    tally.read(read.came_from)
    tally.served("short_circuit", obj.size, read.came_from)
    return web.Response(status=200, headers=headers)
