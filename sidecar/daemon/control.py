"""The daemon's control API under ``/_shardcache/`` (prefetch, stats, cached), metrics and health.
Warm-up jobs have their own module, :mod:`sidecar.daemon.warmups`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from cache import CacheError
from sidecar.daemon.auth.http import AUTH, batch_access, caller, listing_access, object_access, optional_caller
from sidecar.daemon.jobstats import JOBS
from sidecar.daemon.keys import (
    FETCHER,
    MEMBERS,
    METRICS,
    ORIGIN,
    PREFETCHER,
    READS,
    SCRUBBER,
    SETTINGS,
    STARTED,
    STORE,
    file_root,
)
from sidecar.daemon.masterlink import MASTERLINK
from sidecar.daemon.members import NotIndexable
from sidecar.daemon.metrics import (
    LOOKUP_RESULTS,
    RANGE_FILL_OUTCOMES,
    SERVED_SOURCES,
    counter_by,
    counter_value,
    node_reads,
)
from sidecar.daemon.peers.http import cluster_stats
from sidecar.daemon.prefetch import PrefetchItem, QueueFull
from sidecar.daemon.priority import priority_value
from sidecar.daemon.s3xml import error_response
from sidecar.errors import BadRequest, Busy, OriginBadResponse
from wire.names import parse_object_url, validate_bucket, validate_key, validate_prefix, validate_xxh3_128
from wire.s3xml import S3XMLError, parse_list_page
from wire.web import listening, read_json_object

log = logging.getLogger(__name__)

__all__ = ["prefetch_handler", "stats", "stats_handler", "cached_handler", "metrics_handler", "healthz", "readyz",
           "MAX_CONTROL_BODY"]

MAX_CONTROL_BODY = 8 * 1024 * 1024


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
        if obj.get("xxh3_128") is not None:  # accepted, and checked, as the documented body has it (see PrefetchItem)
            validate_xxh3_128(obj["xxh3_128"], "'xxh3_128'")
        items.append(PrefetchItem(validate_bucket(obj["bucket"]), validate_key(obj["key"])))
    for url in urls:
        if not isinstance(url, str):
            raise BadRequest("'urls' must hold strings")
        bucket, key = parse_object_url(url, origin_root)
        items.append(PrefetchItem(bucket, validate_key(key)))
    if not items:
        raise BadRequest("nothing to prefetch: give 'objects' [{bucket, key}] or 'urls'")
    return items


async def prefetch_handler(request: web.Request) -> web.Response:
    body = await read_json_object(request, MAX_CONTROL_BODY)
    try:
        priority = priority_value(str(body.get("priority", "lease")))
    except ValueError as exc:
        raise BadRequest(str(exc)) from exc
    items = _prefetch_items(request, body)
    # --auth sigv4: only what the caller proved it may read, counted for it (--tenant-quota).
    tenant, refusals = await batch_access(request, body, [(item.bucket, item.key) for item in items])
    allowed = [dataclasses.replace(item, tenant=tenant) for item, refused in zip(items, refusals, strict=True) if refused is None]
    try:
        accepted = request.app[PREFETCHER].submit(allowed, priority) if allowed else 0
    except QueueFull as exc:
        raise Busy(f"{exc}; retry later", retry_after=1) from exc
    answer: dict[str, Any] = {"accepted": accepted, "requested": len(items)}
    if len(allowed) < len(items):
        answer["refused"] = len(items) - len(allowed)
        answer["refusals"] = [
            {"bucket": item.bucket, "key": item.key, "reason": str(refused)}
            for item, refused in zip(items, refusals, strict=True) if refused is not None
        ][:20]
    return web.json_response(answer, status=202)


def stats(app: web.Application) -> dict[str, Any]:
    settings = app[SETTINGS]
    store = app.get(STORE)
    metrics = app[METRICS]

    lookups = {result: counter_value(metrics.cache_lookups, result=result) for result in LOOKUP_RESULTS}
    hits, misses, coalesced = lookups["hit"], lookups["miss"], lookups["coalesced"]
    total = sum(lookups.values())
    fill_results = counter_by(metrics.fill_checks, "result")
    disputes = counter_by(metrics.claim_outcomes, "outcome")
    return {
        "mode": settings.mode,
        "origin": app[ORIGIN].description if ORIGIN in app else settings.origin,
        "origin_url": settings.origin,
        "uptime_s": round(time.monotonic() - app[STARTED], 3),
        "cache": store.stats() if store is not None else None,
        "requests": {"hits": hits, "misses": misses, "coalesced": coalesced,
                     "hit_ratio": round(hits / total, 4) if total else None},
        "served_bytes": {
            source: counter_value(metrics.served_bytes, source=source) for source in SERVED_SOURCES
        },
        "origin_read_bytes": counter_value(metrics.origin_bytes),
        # What this node's own clients read, by where the bytes came from: this node's cache, a
        # peer, the origin (served_bytes says how they were sent; peers' reads are not in here).
        "node_reads": node_reads(metrics),
        # The cluster cache (sidecar/daemon/peers/): bytes read from other daemons, and who is in the ring.
        "peer_read_bytes": counter_value(metrics.peer_bytes, direction="in"),
        "node": settings.node,
        "cluster": cluster_stats(app),
        "fills_in_flight": len(app[FETCHER].inflight),
        # Small ranges of objects not cached, read straight from the origin (--direct-range-bytes),
        # and what became of filling their objects behind them.
        "direct_ranges": {
            "max_bytes": app[READS].direct_range_bytes,
            "fills": {outcome: counter_value(metrics.range_fills, outcome=outcome) for outcome in RANGE_FILL_OUTCOMES},
        },
        "prefetch": {"queued": app[PREFETCHER].queued(), "done": app[PREFETCHER].done,
                     "failed": app[PREFETCHER].failed, "read_first": app[PREFETCHER].read_first,
                     "plan": dict(app[PREFETCHER].plan_counts),
                     # Prefetched entries the cache let go before anyone read them (unread.py).
                     "evicted_unread": app[READS].unread.stats()},
        # What each job's readers (x-shardcache-job) read, by where it came from (jobstats.py).
        "jobs": app[JOBS].snapshot(),
        # The lease master this node reports to (--master; masterlink.py), None without one.
        "master": app[MASTERLINK].describe() if MASTERLINK in app else None,
        # How far the cached bytes are vouched for (sidecar/daemon/checksums.py, claims.py).
        "verification": {
            "fills": {result: fill_results.get(result, 0.0) for result in ("verified", "unverified", "failed")},
            "fills_by_algorithm": counter_by(metrics.fill_checks, "algorithm"),
            "claim_disputes": {outcome: disputes.get(outcome, 0.0) for outcome in ("refetched", "mismatch")},
            "etag_md5": app[FETCHER].settings.verify.etag_md5,
            "scrubbed_bytes": app[SCRUBBER].scrubbed_bytes if SCRUBBER in app else 0,
        },
    }


async def stats_handler(request: web.Request) -> web.Response:
    # store.stats() asks the file system for free space: off the loop.
    answer = await asyncio.to_thread(stats, request.app)
    auth = request.app.get(AUTH)
    answer["auth"] = {"mode": "sigv4", "identity": auth.settings.identity, **auth.counts} if auth else {"mode": "none"}
    # Every caller sees the totals; a tenant (a valid session) sees its own share, no one else's.
    session = optional_caller(request)
    store = request.app.get(STORE)
    if session is not None and store is not None:
        answer["tenant"] = store.tenant_usage(session.tenant)
    if auth:
        # A job's name is its tenant's to know (jobstats.py): the caller's own jobs, none without a session.
        answer["jobs"] = request.app[JOBS].snapshot_of(session.tenant) if session is not None else {}
    return web.json_response(answer)


def _may_read(request: web.Request) -> Callable[[str, str], bool]:
    """Whether the caller may learn if ``bucket/key`` is cached: only where it may read it.

    Whether an object is cached says that someone on this node read it; a listing right does not
    make that the caller's to know (a policy may grant ``s3:ListBucket`` on a bucket and
    ``s3:GetObject`` on part of it, and a prefix that is one key would tell about that key). A
    reader learns it anyway from its own GET, so the answer tells the cache state of the objects
    whose read the origin allowed this caller within ``--auth-cache-ttl`` (a read, HEAD, prefetch
    or warm-up through its sidecar): the decisions a read would be served on without a proof.
    The rest count as ``unproven``. Proving each object here would need a signature per listed
    key, which the sidecar cannot make before the daemon has listed them; ``shardcache warmup
    --check`` asks those with a HEAD each instead (proved by the sidecar)."""
    auth = request.app.get(AUTH)
    session = caller(request)
    if auth is None or session is None:
        return lambda bucket, key: True
    return lambda bucket, key: auth.cached(session, bucket, key) is True


async def cached_handler(request: web.Request) -> web.Response:
    """What fraction of a dataset prefix is cached here: lists the origin, checks the index."""
    url = request.query.get("url")
    if not url:
        raise BadRequest("give ?url=s3://bucket/prefix/")
    settings = request.app[SETTINGS]
    origin_root = file_root(settings)
    bucket, prefix = parse_object_url(url, origin_root)
    validate_prefix(prefix)
    await listing_access(request, bucket, prefix)
    may_read = _may_read(request)
    store = request.app.get(STORE)
    origin = request.app[ORIGIN]
    fetcher = request.app[FETCHER]
    objects = cached = size = cached_size = unproven = unproven_size = 0
    missing: list[str] = []
    token: str | None = None
    for _page in range(10_000):  # bounded: 10M objects
        # Encoded names: a key S3 allows but XML 1.0 cannot carry raw still parses (decoded there).
        params = {"list-type": "2", "prefix": prefix, "encoding-type": "url"}
        if token:
            params["continuation-token"] = token
        body = await fetcher.call_origin("list", f"list {bucket}", origin.list_objects_v2, bucket, params)
        try:
            page = parse_list_page(body, what=f"the origin's listing of {bucket}")
        except S3XMLError as exc:
            raise OriginBadResponse(str(exc)) from exc
        for obj in page.contents:
            if obj.key.endswith("/"):
                continue
            objects += 1
            size += obj.size
            if not may_read(bucket, obj.key):
                unproven += 1
                unproven_size += obj.size
                continue
            entry = store.lookup(bucket, obj.key) if store is not None else None
            if entry is not None and (not obj.etag or entry.etag == obj.etag):
                cached += 1
                cached_size += obj.size
            elif len(missing) < 1000:
                missing.append(obj.key)
        token = page.next_token
        if not page.truncated or not token:
            break
    return web.json_response({
        "url": url, "objects": objects, "cached": cached, "bytes": size, "cached_bytes": cached_size,
        "fraction": round(cached_size / size, 6) if size else 1.0, "missing": missing,
        "unproven": unproven, "unproven_bytes": unproven_size,
    })


async def members_handler(request: web.Request) -> web.Response:
    """The member index of a shard this daemon holds (sidecar/daemon/members.py): for a caller
    that may read the object (as its GET), never a fill: 404 ``NotCached`` when it is not here."""
    bucket = validate_bucket(request.query.get("bucket", ""))
    key = validate_key(request.query.get("key", ""))
    await object_access(request, bucket, key)
    store = request.app.get(STORE)
    entry = store.lookup(bucket, key) if store is not None else None
    if entry is None:
        return error_response(404, "NotCached", f"{bucket}/{key} is not cached on this daemon", request.path)
    try:
        doc = await request.app[MEMBERS].document(entry)
    except NotIndexable as exc:
        return error_response(422, "NotIndexable", str(exc), request.path)
    except CacheError as exc:  # evicted meanwhile, or its copy failed its check (and is gone)
        return error_response(404, "NotCached", f"{bucket}/{key}: {exc}", request.path)
    return web.Response(body=doc, content_type="application/json", headers={"x-shardcache-xxh3-128": entry.xxh3_128})


async def metrics_handler(request: web.Request) -> web.Response:
    body = await asyncio.to_thread(generate_latest, request.app[METRICS].registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def readyz(request: web.Request) -> web.Response:
    # Not before every listener is bound: the probe may have come in on the first of them.
    ready = ORIGIN in request.app and FETCHER in request.app and listening(request.app)
    settings = request.app[SETTINGS]
    # The node's name too: the cluster's health checks learn each member's from it.
    return web.json_response({"ready": ready, "mode": settings.mode, "node": settings.node}, status=200 if ready else 503)
