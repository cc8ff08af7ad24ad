"""The daemon's control API under ``/_shardcache/`` (prefetch, stats, cached), metrics and health.
Warm-up jobs have their own module, :mod:`sidecar.daemon.warmups`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from sidecar.errors import BadRequest
from sidecar.daemon.fills import retrying
from sidecar.daemon.keys import FETCHER, METRICS, ORIGIN, PREFETCHER, SETTINGS, STARTED, STORE, file_root
from sidecar.daemon.prefetch import PrefetchItem, QueueFull
from sidecar.daemon.priority import priority_value
from wire.names import parse_object_url, validate_bucket, validate_key, validate_prefix

log = logging.getLogger(__name__)

__all__ = ["prefetch_handler", "stats", "stats_handler", "cached_handler", "metrics_handler", "healthz", "readyz",
           "MAX_CONTROL_BODY"]

MAX_CONTROL_BODY = 8 * 1024 * 1024
_HEX128 = re.compile(r"^[0-9a-fA-F]{32}$")


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
    origin_root = file_root(settings)
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
        bucket, key = parse_object_url(url, origin_root)
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
    origin_root = file_root(settings)
    bucket, prefix = parse_object_url(url, origin_root)
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
