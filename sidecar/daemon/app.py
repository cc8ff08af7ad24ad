"""The daemon's aiohttp application: resources, routes and the one place errors become answers.

Resources open and close in ``cleanup_ctx`` and live under the typed ``AppKey``s of
:mod:`sidecar.daemon.keys`. Every blocking call (file system, hashing, boto3) runs in an executor;
warm objects go out with ``sendfile`` from a file descriptor opened (and verified) in one executor
call (:mod:`sidecar.daemon.s3api`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator
from pathlib import Path

from aiohttp import web
from aiohttp.typedefs import Handler

from cache import CacheError, Store
from sidecar.daemon import control, warmups
from sidecar.daemon.auth import RENEW_HEADER, Authorizer
from sidecar.daemon.auth import http as auth_http
from sidecar.daemon.claims import Claims
from sidecar.daemon.fills import Fetcher
from sidecar.daemon.jobstats import JOBS, JobCollector, JobStats, job_header
from sidecar.daemon.keys import (
    CLAIMS,
    CONTROL,
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
)
from sidecar.daemon.masterlink import MasterLink, start_masterlink
from sidecar.daemon.members import MemberIndexes
from sidecar.daemon.metrics import Metrics
from sidecar.daemon.origins import Boto3S3Origin, FileOrigin, Origin, S3Origin
from sidecar.daemon.peers import http as peers_http
from sidecar.daemon.peers.membership import Membership
from sidecar.daemon.peers.origin import ClusterOrigin
from sidecar.daemon.prefetch import Prefetcher
from sidecar.daemon.reads import ReadService
from sidecar.daemon.s3api import s3_handler
from sidecar.daemon.s3xml import error_response
from sidecar.daemon.scrub import Scrubber
from sidecar.daemon.settings import ServeSettings
from sidecar.errors import PreconditionFailed, SidecarError, s3_error_for
from wire.errors import WireError
from wire.s3errors import S3_MESSAGES
from wire.web import LISTENING, error_middleware, http_code

__all__ = ["build_app", "count_requests", "error_answer", "make_origin"]

log = logging.getLogger(__name__)


def make_origin(settings: ServeSettings) -> Origin:
    if settings.origin == "s3":
        return Boto3S3Origin(settings.s3) if settings.s3.client == "boto3" else S3Origin(settings.s3)
    if settings.origin.startswith("file://"):
        root = Path(settings.origin[len("file://"):])
        if not root.is_absolute():
            raise ValueError(f"file origin needs an absolute path: file:///abs/root, not {settings.origin!r}")
        return FileOrigin(root)
    raise ValueError(f"unknown origin {settings.origin!r}: use s3 or file:///abs/root")


_KNOWN_ERRORS = (SidecarError, WireError, CacheError)


def _is_control(path: str) -> bool:
    return path.startswith(CONTROL) or path in ("/metrics", "/healthz", "/readyz")


def error_answer(request: web.Request, exc: Exception) -> web.Response:
    """The daemon's one error answer: S3 XML on the S3 API, ``{"error", "message"}`` JSON on the
    control API, with the status and code of :func:`sidecar.errors.s3_error_for`."""
    control = _is_control(request.path)
    if isinstance(exc, web.HTTPException):
        message = exc.text or exc.reason
        if control:
            return web.json_response({"error": http_code(exc.status), "message": message}, status=exc.status)
        return error_response(exc.status, exc.reason.replace(" ", ""), message, request.path)
    status, code = s3_error_for(exc)
    # A bug's own words (and types) stay in the log; the client learns where to look.
    message = str(exc) if isinstance(exc, _KNOWN_ERRORS) else "internal error in the daemon; see its log"
    headers: dict[str, str] = {}
    retry_after = getattr(exc, "retry_after", None)
    if retry_after is not None:
        headers["Retry-After"] = str(retry_after)
    if getattr(exc, "renew", False):
        headers[RENEW_HEADER] = "renew"  # the sidecar starts a new session and retries once
    if control:
        return web.json_response({"error": code, "message": message}, status=status, headers=headers)
    size = getattr(exc, "size", None)
    if code == "InvalidRange" and size is not None:
        headers["Content-Range"] = f"bytes */{size}"
    if code in S3_MESSAGES:
        # The origin's words, as S3 sends them; ours (which bucket, which key) go to the log.
        log.debug("%s %s: %s: %s", request.method, request.path[:200], code, message)
        message = S3_MESSAGES[code]
    return error_response(status, code, message, request.path, headers=headers, details=_details(request, code, exc))


def _details(request: web.Request, code: str, exc: Exception) -> dict[str, str]:
    """The elements S3 adds to an error body after ``<Message>``, for the codes that have them."""
    bucket, _, key = request.match_info.get("path", "").partition("/")
    if code == "NoSuchKey" and key:
        return {"Key": key}
    if code == "NoSuchBucket" and bucket:
        return {"BucketName": bucket}
    if code == "PreconditionFailed" and isinstance(exc, PreconditionFailed):
        return {"Condition": exc.condition}
    if code == "InvalidRange":
        details = {"RangeRequested": request.headers.get("Range", "")}
        size = getattr(exc, "size", None)
        if size is not None:
            details["ActualObjectSize"] = str(size)
        return details
    return {}


@web.middleware
async def count_requests(request: web.Request, handler: Handler) -> web.StreamResponse:
    # Outside the error middleware: errors are answers by the time they get here, and count too.
    response = await handler(request)
    request.app[METRICS].requests.labels(method=request.method, status=str(response.status)).inc()
    return response


def build_app(settings: ServeSettings, with_store: bool = True) -> web.Application:
    errors = error_middleware(error_answer, known=_KNOWN_ERRORS, log=log)
    # job_header inside errors: a malformed x-shardcache-job is an error answer (400) like any other.
    app = web.Application(middlewares=[count_requests, errors, job_header], client_max_size=control.MAX_CONTROL_BODY)
    app[SETTINGS] = settings
    app[METRICS] = Metrics()
    app[STARTED] = time.monotonic()
    app[LISTENING] = asyncio.Event()  # set once every listener is bound: /readyz waits for it
    app[JOBS] = JobStats()
    # Under --auth a job's name is its tenant's to know: no per-job series (jobstats.py).
    app[METRICS].registry.register(JobCollector(app[JOBS], by_job=settings.auth.mode != "sigv4"))

    async def resources(app: web.Application) -> AsyncIterator[None]:
        origin = make_origin(settings)
        await origin.start()
        app[ORIGIN] = origin
        if settings.auth.mode == "sigv4":
            if not isinstance(origin, S3Origin):
                await origin.close()
                raise ValueError("--auth sigv4 needs an S3 origin")
            endpoint, region, style = origin.proof_endpoint()
            app[auth_http.AUTH] = Authorizer(settings.auth, origin.replay, endpoint, region, style)
            log.info("--auth sigv4: proofs replayed against %s (%s), identity by %s", endpoint, region,
                     settings.auth.identity)
        membership: Membership | None = None
        if settings.cluster is not None:
            # The fetcher reads through the cluster: the owner of each object first (peers/).
            membership = Membership(settings.cluster, settings.node, app[METRICS])
            cluster = ClusterOrigin(origin, membership, settings.cluster)
            await cluster.start()
            origin = cluster
            app[ORIGIN] = origin
            await membership.start()
            app[peers_http.MEMBERSHIP] = membership
            if settings.cluster.secret is None:
                log.warning("peer links are OPEN (no --peer-secret-file): anyone who reaches this daemon can read "
                            "through the peer path; give every daemon the same --peer-secret-file")
            log.info("cluster member %s (node %s), peers %s", membership.self_id, settings.node or "unnamed",
                     ", ".join(m for m in membership.members if m != membership.self_id) or "from DNS")
        store: Store | None = None
        if with_store:
            # The origin's identity is part of every entry id: a cache dir reused with another
            # origin never serves that origin's bytes.
            store = Store(dataclasses.replace(settings.store, namespace=origin.namespace))
            try:
                await asyncio.to_thread(store.open)
            except BaseException:
                if membership is not None:
                    await membership.stop()
                await origin.close()
                raise
            app[STORE] = store
            app[METRICS].watch_store(store.stats)
        fetcher = Fetcher(store, origin, settings.fetch, app[METRICS])
        app[FETCHER] = fetcher
        app[CLAIMS] = Claims(settings.claims)
        reads = ReadService(
            store, fetcher, app[CLAIMS], app[METRICS],
            direct_range_bytes=settings.direct_range_bytes, fills_behind=settings.prefetch_workers, jobs=app[JOBS],
        )
        app[READS] = reads
        # Only the entries that leave from now on: no pass over the index at start.
        stop_unread = store.watch(reads.unread.watch, existing=False) if store is not None else None
        prefetcher = Prefetcher(reads, app[METRICS], settings.prefetch_workers, settings.prefetch_queue_max)
        prefetcher.start()
        app[PREFETCHER] = prefetcher
        scrubber: Scrubber | None = None
        if store is not None:
            scrubber = Scrubber(store, fetcher, settings.scrub)
            scrubber.start()
            app[SCRUBBER] = scrubber
            app[MEMBERS] = MemberIndexes(store)
        link: MasterLink | None = None
        if settings.master is not None and store is not None and settings.node:
            link = await start_masterlink(app, settings.master, settings.node, store, prefetcher, app[JOBS], app[METRICS],
                                          settings.store.eviction)
        log.info("serving %s from %s (cache %s)", settings.mode, origin.description, settings.store.root)
        try:
            yield
        finally:
            if link is not None:
                await link.stop()
            if scrubber is not None:
                await scrubber.stop()
            await prefetcher.stop()
            if stop_unread is not None:
                stop_unread()
            if membership is not None:
                await membership.stop()
            await fetcher.close()
            await origin.close()
            if store is not None:
                await asyncio.to_thread(store.close)

    app.cleanup_ctx.append(resources)
    app.router.add_get("/healthz", control.healthz)
    app.router.add_get("/readyz", control.readyz)
    app.router.add_get("/metrics", control.metrics_handler)
    app.router.add_post(CONTROL + "prefetch", control.prefetch_handler)
    app.router.add_get(CONTROL + "stats", control.stats_handler)
    app.router.add_get(CONTROL + "cached", control.cached_handler)
    app.router.add_get(CONTROL + "members", control.members_handler)
    warmups.setup(app)
    auth_http.setup(app)
    peers_http.setup(app)
    # Every path, newlines included: "." does not match "\n", which made a key with %0A a 404
    # instead of the 400 every other control character gets from wire.names.
    app.router.add_route("*", "/{path:[\\s\\S]*}", s3_handler)
    return app
