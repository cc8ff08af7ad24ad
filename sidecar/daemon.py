"""The daemon's aiohttp application: the S3 read API, the control API, metrics and health.

Resources open and close in ``cleanup_ctx`` and live under typed ``AppKey``s. Every blocking call
(file system, hashing, boto3) runs in an executor; warm objects go out with ``sendfile`` from a
file descriptor opened (and verified) in one executor call.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import re
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from cache import CacheError, CorruptEntry, Entry, EntryNotFound, IntegrityError, Store
from sidecar.errors import BadRequest, OriginError, SidecarError, s3_error_for
from sidecar.fetcher import Fetcher, Fill, retrying
from sidecar.metrics import Metrics
from sidecar.names import parse_object_url, validate_bucket, validate_key, validate_prefix
from sidecar.origin import FileOrigin, ObjectInfo, Origin
from sidecar.prefetch import PrefetchItem, Prefetcher, QueueFull
from sidecar.priority import DEMAND, priority_value
from sidecar.s3origin import Boto3S3Origin, S3Origin
from sidecar.s3xml import error_response, parse_range
from sidecar.settings import ServeSettings

__all__ = ["build_app", "make_origin", "SETTINGS", "STORE", "ORIGIN", "FETCHER", "METRICS", "PREFETCHER"]

log = logging.getLogger(__name__)

SETTINGS = web.AppKey("settings", ServeSettings)
STORE = web.AppKey("store", Store)
ORIGIN = web.AppKey("origin", Origin)
FETCHER = web.AppKey("fetcher", Fetcher)
METRICS = web.AppKey("metrics", Metrics)
PREFETCHER = web.AppKey("prefetcher", Prefetcher)
STARTED = web.AppKey("started", float)

CONTROL = "/_shardcache/"
UNCACHED_NAMES = frozenset({"manifest.json"})
MAX_CONTROL_BODY = 8 * 1024 * 1024
_HEX128 = re.compile(r"^[0-9a-fA-F]{32}$")


def make_origin(settings: ServeSettings) -> Origin:
    if settings.origin == "s3":
        return Boto3S3Origin(settings.s3) if settings.s3.client == "boto3" else S3Origin(settings.s3)
    if settings.origin.startswith("file://"):
        root = Path(settings.origin[len("file://"):])
        if not root.is_absolute():
            raise ValueError(f"file origin needs an absolute path: file:///abs/root, not {settings.origin!r}")
        return FileOrigin(root)
    raise ValueError(f"unknown origin {settings.origin!r}: use s3 or file:///abs/root")


# -- responses ---------------------------------------------------------------------------------


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


def _object_headers(size: int, etag: str, cache: str, last_modified: str | None = None) -> dict[str, str]:
    headers = {"ETag": etag, "Accept-Ranges": "bytes", "x-shardcache-cache": cache}
    if last_modified:
        headers["Last-Modified"] = last_modified
    return headers


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
            return web.Response(status=200)
        return await _list(request, bucket)
    validate_key(key)
    expected = request.headers.get("x-shardcache-xxh3-128")
    if expected is not None and not _HEX128.match(expected):
        raise BadRequest("x-shardcache-xxh3-128 must be 32 hex digits")
    store = request.app.get(STORE)
    if key.rsplit("/", 1)[-1] in UNCACHED_NAMES:
        # The manifest is the mutable index of immutable shards: always the origin's current copy.
        store = None
    if request.method == "HEAD":
        return await _head(request, store, bucket, key, expected)
    return await _get(request, store, bucket, key, expected)


async def _list(request: web.Request, bucket: str) -> web.Response:
    if request.query.get("list-type") != "2":
        raise BadRequest("only ListObjectsV2 is supported: add list-type=2 to the query")
    validate_prefix(request.query.get("prefix", ""))
    origin = request.app[ORIGIN]
    metrics = request.app[METRICS]
    began = time.perf_counter()
    body = await retrying(
        request.app[FETCHER].settings, metrics, f"list {bucket}", origin.list_objects_v2, bucket, dict(request.query)
    )
    metrics.origin_latency.labels(op="list").observe(time.perf_counter() - began)
    return web.Response(body=body, content_type="application/xml")


async def _head(request: web.Request, store: Store | None, bucket: str, key: str, expected: str | None) -> web.Response:
    entry = store.lookup(bucket, key, xxh3_128=expected) if store is not None else None
    if entry is not None:
        headers = _object_headers(entry.size, entry.etag, "hit")
        headers["Content-Length"] = str(entry.size)
        return web.Response(status=200, headers=headers)
    metrics = request.app[METRICS]
    began = time.perf_counter()
    info: ObjectInfo = await retrying(
        request.app[FETCHER].settings, metrics, f"head {bucket}/{key}", request.app[ORIGIN].head, bucket, key
    )
    metrics.origin_latency.labels(op="head").observe(time.perf_counter() - began)
    headers = _object_headers(info.size, info.etag, "miss", info.last_modified)
    headers["Content-Length"] = str(info.size)
    return web.Response(status=200, headers=headers)


async def _open_hit(store: Store, entry: Entry) -> tuple[int, os.stat_result] | None:
    try:
        return await asyncio.to_thread(store.open_verified, entry)
    except (CorruptEntry, EntryNotFound):
        return None  # detected and removed: refetch below


async def _get(request: web.Request, store: Store | None, bucket: str, key: str, expected: str | None) -> web.StreamResponse:
    metrics = request.app[METRICS]
    began = time.perf_counter()
    short_circuit = request.headers.get("x-shardcache-short-circuit") == "1"
    if store is not None:
        entry = store.lookup(bucket, key, xxh3_128=expected)
        if entry is not None and short_circuit and store.known_good(entry):
            # The caller reads the file itself: no open, no executor hop, just the path.
            store.touch_in_memory(entry)
            metrics.cache_lookups.labels(result="hit").inc()
            return _short_circuit_answer(request, store, entry, "hit")
        if entry is not None:
            with store.pinned(entry):
                opened = await _open_hit(store, entry)
                if opened is not None:
                    metrics.cache_lookups.labels(result="hit").inc()
                    response = await _serve_entry(request, store, entry, opened, "hit", short_circuit)
                    metrics.request_duration.labels(cache="hit").observe(time.perf_counter() - began)
                    return response

    fetcher = request.app[FETCHER]
    if store is None:
        return await _passthrough_get(request, bucket, key)
    fill, created = fetcher.start(bucket, key, DEMAND, expected)
    state = "miss" if created else "coalesced"
    metrics.cache_lookups.labels(result=state).inc()
    info = await fill.wait_info()

    if short_circuit and fill.cacheable and store is not None:
        entry = await fill.wait_done()
        if entry is not None:
            with store.pinned(entry):
                opened = await _open_hit(store, entry)
                if opened is not None:
                    return await _serve_entry(request, store, entry, opened, state, short_circuit)

    rng = parse_range(request.headers.get("Range"), info.size)
    headers = _object_headers(info.size, info.etag, state, info.last_modified)
    status, start, end = _range_headers(headers, rng, info.size)
    response = web.StreamResponse(status=status, headers=headers)
    response.content_length = end - start
    if fill.cacheable:
        await _send_fill(request, response, fetcher, fill, start, end, state)
        metrics.request_duration.labels(cache=state).observe(time.perf_counter() - began)
        return response
    body = fetcher.passthrough(bucket, key, start, end, info.etag or None)
    source = "passthrough"
    # Pull the first chunk before committing to a 200: an origin that fails at once still gets
    # its proper S3 error answer instead of a truncated body.
    first = await anext(body, b"")
    await response.prepare(request)
    if first:
        await response.write(first)
        metrics.served_bytes.labels(source=source).inc(len(first))
    async for chunk in body:
        await response.write(chunk)
        metrics.served_bytes.labels(source=source).inc(len(chunk))
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
    rng = parse_range(request.headers.get("Range"), info.size)
    headers = _object_headers(info.size, info.etag, "miss", info.last_modified)
    status, start, end = _range_headers(headers, rng, info.size)
    response = web.StreamResponse(status=status, headers=headers)
    response.content_length = end - start
    await response.prepare(request)
    async for chunk in fetcher.passthrough(bucket, key, start, end, info.etag or None):
        await response.write(chunk)
        metrics.served_bytes.labels(source="passthrough").inc(len(chunk))
    await response.write_eof()
    return response


async def _send_fill(
    request: web.Request, response: web.StreamResponse, fetcher: Fetcher, fill: Fill, start: int, end: int, state: str
) -> None:
    """Send ``[start, end)`` of a fill in progress with sendfile from its temp file, as the bytes
    land. If caching fails underneath (disk full), finish from the origin at the byte reached."""
    metrics = request.app[METRICS]
    loop = asyncio.get_running_loop()
    sent = start
    try:
        async for fd, offset, length in fill.ranges(start, end):
            if offset + length >= end and fill.expected_xxh3:
                # The caller named the checksum it expects: hold the last bytes back until the
                # fill is verified, so a mismatch reaches it as an error, not as wrong data.
                await fill.wait_done()
            if not response.prepared:
                # Prepared only once bytes exist: a fill failing at once still gets an S3 error.
                await response.prepare(request)
            transport = request.transport
            if transport is None:
                raise ConnectionResetError("client went away")
            with os.fdopen(fd, "rb", closefd=False) as fobj:
                await loop.sendfile(transport, fobj, offset, length)
            sent = offset + length
            metrics.served_bytes.labels(source=state).inc(length)
    except (CacheError, OSError) as exc:
        if isinstance(exc, (OriginError, IntegrityError, ConnectionError)) or not fill.info:
            raise
        log.warning("cache fill of %s/%s failed (%s); serving from the origin", fill.bucket, fill.key, exc)
        async for chunk in fetcher.passthrough(fill.bucket, fill.key, sent, end, fill.info.etag or None):
            if not response.prepared:
                await response.prepare(request)
            await response.write(chunk)
            metrics.served_bytes.labels(source="passthrough").inc(len(chunk))
    if not response.prepared:  # an empty range
        await response.prepare(request)
    await response.write_eof()


def _short_circuit_answer(request: web.Request, store: Store, entry: Entry, state: str) -> web.Response:
    headers = _object_headers(entry.size, entry.etag, state)
    headers["x-shardcache-path"] = str(store.data_path(entry))
    headers["x-shardcache-size"] = str(entry.size)
    request.app[METRICS].served_bytes.labels(source="short_circuit").inc(entry.size)
    return web.Response(status=200, headers=headers)


async def _serve_entry(
    request: web.Request, store: Store, entry: Entry, opened: tuple[int, os.stat_result], state: str, short_circuit: bool
) -> web.StreamResponse:
    fd, _ = opened
    metrics = request.app[METRICS]
    headers = _object_headers(entry.size, entry.etag, state)
    if short_circuit:
        os.close(fd)
        return _short_circuit_answer(request, store, entry, state)
    try:
        rng = parse_range(request.headers.get("Range"), entry.size)
    except BaseException:
        os.close(fd)
        raise
    status, start, end = _range_headers(headers, rng, entry.size)
    response = _SendfileResponse(fd, start, end - start, status=status, headers=headers)
    response.content_length = end - start
    await response.prepare(request)
    metrics.served_bytes.labels(source=state).inc(end - start)
    return response


# -- control API -------------------------------------------------------------------------------


async def _json_body(request: web.Request) -> dict[str, Any]:
    if request.content_length is not None and request.content_length > MAX_CONTROL_BODY:
        raise web.HTTPRequestEntityTooLarge(max_size=MAX_CONTROL_BODY, actual_size=request.content_length)
    # The whole body, however many segments it arrives in; aiohttp stops at client_max_size (413).
    raw = await request.read()
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    return body


def _prefetch_items(request: web.Request, body: dict[str, Any]) -> list[PrefetchItem]:
    settings = request.app[SETTINGS]
    file_root = settings.origin[len("file://"):] if settings.origin.startswith("file://") else None
    items: list[PrefetchItem] = []
    objects = body.get("objects", [])
    urls = body.get("urls", [])
    if not isinstance(objects, list) or not isinstance(urls, list):
        raise BadRequest("'objects' and 'urls' must be lists")
    for obj in objects:
        if not isinstance(obj, dict) or not isinstance(obj.get("bucket"), str) or not isinstance(obj.get("key"), str):
            raise BadRequest("each object needs string 'bucket' and 'key'")
        expected = obj.get("xxh3_128")
        if expected is not None and (not isinstance(expected, str) or not _HEX128.match(expected)):
            raise BadRequest("'xxh3_128' must be 32 hex digits")
        items.append(PrefetchItem(validate_bucket(obj["bucket"]), validate_key(obj["key"]), expected))
    for url in urls:
        if not isinstance(url, str):
            raise BadRequest("'urls' must hold strings")
        bucket, key = parse_object_url(url, file_root)
        items.append(PrefetchItem(bucket, validate_key(key)))
    if not items:
        raise BadRequest("nothing to prefetch: give 'objects' [{bucket, key}] or 'urls'")
    return items


async def prefetch_handler(request: web.Request) -> web.Response:
    body = await _json_body(request)
    try:
        priority = priority_value(str(body.get("priority", "lease")))
    except ValueError as exc:
        raise BadRequest(str(exc)) from exc
    items = _prefetch_items(request, body)
    try:
        accepted = request.app[PREFETCHER].submit(items, priority)
    except QueueFull as exc:
        return web.json_response({"error": "SlowDown", "message": f"{exc}; retry later"}, status=503)
    return web.json_response({"accepted": accepted, "requested": len(items)}, status=202)


def stats(app: web.Application) -> dict[str, Any]:
    settings = app[SETTINGS]
    store = app.get(STORE)
    metrics = app[METRICS]

    def counter(metric: Any, **labels: str) -> float:
        return float(metric.labels(**labels)._value.get()) if labels else float(metric._value.get())

    hits = counter(metrics.cache_lookups, result="hit")
    misses = counter(metrics.cache_lookups, result="miss")
    coalesced = counter(metrics.cache_lookups, result="coalesced")
    total = hits + misses + coalesced
    return {
        "mode": settings.mode,
        "origin": app[ORIGIN].description if ORIGIN in app else settings.origin,
        "origin_url": settings.origin,
        "uptime_s": round(time.monotonic() - app[STARTED], 3),
        "cache": store.stats() if store is not None else None,
        "requests": {"hits": hits, "misses": misses, "coalesced": coalesced,
                     "hit_ratio": round(hits / total, 4) if total else None},
        "served_bytes": {
            source: counter(metrics.served_bytes, source=source)
            for source in ("hit", "miss", "coalesced", "passthrough", "short_circuit")
        },
        "origin_read_bytes": counter(metrics.origin_bytes),
        "fills_in_flight": len(app[FETCHER].inflight),
        "prefetch": {"queued": app[PREFETCHER].queued(), "done": app[PREFETCHER].done,
                     "failed": app[PREFETCHER].failed},
    }


async def stats_handler(request: web.Request) -> web.Response:
    # store.stats() asks the file system for free space: off the loop.
    return web.json_response(await asyncio.to_thread(stats, request.app))


async def cached_handler(request: web.Request) -> web.Response:
    """What fraction of a dataset prefix is cached here: lists the origin, checks the index."""
    url = request.query.get("url")
    if not url:
        raise BadRequest("give ?url=s3://bucket/prefix/")
    settings = request.app[SETTINGS]
    file_root = settings.origin[len("file://"):] if settings.origin.startswith("file://") else None
    bucket, prefix = parse_object_url(url, file_root)
    validate_prefix(prefix)
    store = request.app.get(STORE)
    origin = request.app[ORIGIN]
    fetch_settings = request.app[FETCHER].settings
    metrics = request.app[METRICS]
    import xml.etree.ElementTree as ET

    ns = "{http://s3.amazonaws.com/doc/2006-03-01/}"
    objects = cached = size = cached_size = 0
    missing: list[str] = []
    token: str | None = None
    for _page in range(10_000):  # bounded: 10M objects
        params = {"list-type": "2", "prefix": prefix}
        if token:
            params["continuation-token"] = token
        body = await retrying(fetch_settings, metrics, f"list {bucket}", origin.list_objects_v2, bucket, params)
        root = ET.fromstring(body)
        for item in root.iter(f"{ns}Contents"):
            key = item.findtext(f"{ns}Key") or ""
            if key.endswith("/"):
                continue
            length = int(item.findtext(f"{ns}Size") or 0)
            etag = item.findtext(f"{ns}ETag")
            objects += 1
            size += length
            entry = store.lookup(bucket, key) if store is not None else None
            if entry is not None and (not etag or entry.etag == etag):
                cached += 1
                cached_size += length
            elif len(missing) < 1000:
                missing.append(key)
        token = root.findtext(f"{ns}NextContinuationToken")
        if (root.findtext(f"{ns}IsTruncated") or "false") != "true" or not token:
            break
    return web.json_response({
        "url": url, "objects": objects, "cached": cached, "bytes": size, "cached_bytes": cached_size,
        "fraction": round(cached_size / size, 6) if size else 1.0, "missing": missing,
    })


async def metrics_handler(request: web.Request) -> web.Response:
    body = await asyncio.to_thread(generate_latest, request.app[METRICS].registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def readyz(request: web.Request) -> web.Response:
    ready = ORIGIN in request.app and FETCHER in request.app
    return web.json_response({"ready": ready, "mode": request.app[SETTINGS].mode}, status=200 if ready else 503)


# -- errors, one mapping ------------------------------------------------------------------------


@web.middleware
async def error_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    metrics = request.app[METRICS]
    control = request.path.startswith(CONTROL) or request.path in ("/metrics", "/healthz", "/readyz")
    try:
        response = await handler(request)
    except web.HTTPException as exc:
        metrics.requests.labels(method=request.method, status=str(exc.status)).inc()
        if control:
            raise
        return error_response(exc.status, exc.reason.replace(" ", ""), exc.text or exc.reason, request.path)
    except (SidecarError, CacheError) as exc:
        status, code = s3_error_for(exc)
        metrics.requests.labels(method=request.method, status=str(status)).inc()
        if control:
            return web.json_response({"error": code, "message": str(exc)}, status=status)
        headers = {}
        size = getattr(exc, "size", None)
        if code == "InvalidRange" and size is not None:
            headers["Content-Range"] = f"bytes */{size}"
        return error_response(status, code, str(exc), request.path, headers=headers)
    metrics.requests.labels(method=request.method, status=str(response.status)).inc()
    return response


# -- application -------------------------------------------------------------------------------


def build_app(settings: ServeSettings, with_store: bool = True) -> web.Application:
    app = web.Application(middlewares=[error_middleware], client_max_size=MAX_CONTROL_BODY)
    app[SETTINGS] = settings
    app[METRICS] = Metrics()
    app[STARTED] = time.monotonic()

    async def resources(app: web.Application) -> AsyncIterator[None]:
        origin = make_origin(settings)
        await origin.start()
        app[ORIGIN] = origin
        store: Store | None = None
        if with_store:
            # The origin's identity is part of every entry id: a cache dir reused with another
            # origin never serves that origin's bytes.
            store = Store(dataclasses.replace(settings.store, namespace=origin.namespace))
            try:
                await asyncio.to_thread(store.open)
            except BaseException:
                await origin.close()
                raise
            app[STORE] = store
            app[METRICS].watch_store(store.stats)
        fetcher = Fetcher(store, origin, settings.fetch, app[METRICS])
        app[FETCHER] = fetcher
        prefetcher = Prefetcher(store, fetcher, app[METRICS], settings.prefetch_workers, settings.prefetch_queue_max)
        prefetcher.start()
        app[PREFETCHER] = prefetcher
        log.info("serving %s from %s (cache %s)", settings.mode, origin.description, settings.store.root)
        try:
            yield
        finally:
            await prefetcher.stop()
            await fetcher.close()
            await origin.close()
            if store is not None:
                await asyncio.to_thread(store.close)

    app.cleanup_ctx.append(resources)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics_handler)
    app.router.add_post(CONTROL + "prefetch", prefetch_handler)
    app.router.add_get(CONTROL + "stats", stats_handler)
    app.router.add_get(CONTROL + "cached", cached_handler)
    with contextlib.suppress(ImportError):
        from sidecar import warmups  # the warm-up job API, when built

        warmups.setup(app)
    app.router.add_route("*", "/{path:.*}", s3_handler)
    return app
