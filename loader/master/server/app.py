"""The master's HTTP API (aiohttp): routes, body limits, and the one place errors become answers.

The contract is ``docs/master-api.md``. Every error is ``{"error": code, "message": ...}``
with the status of its :class:`~loader.master.errors.MasterError` class; aiohttp's own errors
(unknown route, wrong method, oversized body or headers) get the same shape.
"""

from __future__ import annotations

import asyncio
import contextvars
import ctypes
import functools
import gc
import json
import logging
import os
import signal
import sys
import time
from collections.abc import AsyncIterator, Callable, Set
from typing import Any

from aiohttp import hdrs, web
from aiohttp.http_exceptions import ContentEncodingError
from aiohttp.typedefs import Handler
from aiohttp.web_protocol import RequestPayloadError
from prometheus_client import CONTENT_TYPE_LATEST

from loader.master.errors import BadRequest, BodyTooLarge, Forbidden, LeaseLost, MasterError, MasterUnavailable, NotLeaseHolder
from loader.master.protocol import (
    CHECKPOINT_FEATURE,
    COMPLETE_FIELDS,
    FAIL_FIELDS,
    LEASE_FIELDS,
    MARK_FIELDS,
    RELEASE_FIELDS,
    RENEW_FIELDS,
    REWIND_FIELDS,
)
from loader.master.server.auth import Identities, TenantTokens, TokenFile, auth_middleware, caller_of
from loader.master.server.events import Complete, DeleteJob, Fail, Lease, Mark, Release, Renew, Rewind
from loader.master.server.page import PAGE_PATHS, add_page_routes
from loader.master.server.service import MasterService
from loader.master.server.settings import MasterSettings, listen_address
from loader.master.server.spec import check_ident, check_int
from loader.master.server.state import MAX_COUNT, MAX_LEASE_WAIT_S, validate_job_name, validate_lease_id
from wire import errors as wire_errors
from wire.nodeplan import MAX_REPORT_BYTES, NodeReport, parse_report
from wire.stall import WAIT_FEATURE, WaitReport, validate_wait
from wire.web import (
    LISTENING,
    ConnectionGuard,
    decode_json_object,
    error_middleware,
    http_code,
    listening,
    read_body,
    read_json_object,
    remove_sockets,
    start_listeners,
)

__all__ = ["build_app", "serve", "run_forever", "tune_allocator", "trim_allocator", "SERVICE_KEY", "SETTINGS_KEY"]

log = logging.getLogger(__name__)

SETTINGS_KEY = web.AppKey("master_settings", MasterSettings)
SERVICE_KEY = web.AppKey("master_service", MasterService)

# -- the allocator ---------------------------------------------------------------------------

_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter (malloc.h)
_MMAP_THRESHOLD_BYTES = 128 * 1024
# A job this large frees tens of MB at once when it is created, has an epoch closed or is
# deleted: then, and once the state is loaded, free heap pages go back to the system.
_TRIM_SHARDS = 100_000


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    """The C library when it is glibc (the allocator tuning below is glibc's), else None."""
    try:
        if not os.confstr("CS_GNU_LIBC_VERSION"):
            return None
        return ctypes.CDLL("libc.so.6")
    except (ValueError, OSError, AttributeError):  # not glibc (musl, macOS): nothing to tune
        return None


def tune_allocator() -> bool:
    """Fix glibc's mmap threshold at 128 KiB (its initial value) for the master process.

    glibc raises its threshold to the size of any mmapped block that is freed (up to 32 MiB): after
    one 73 MB create record or snapshot text came and went, every later buffer up to 32 MiB (a
    lease dict's table, a parse's columns, a batch of log text) went on the heap, where freeing it
    returns nothing to the system while anything above it lives. A fixed threshold keeps such
    buffers mmapped, unmapped when freed. An operator's own ``MALLOC_MMAP_THRESHOLD_`` wins. A
    no-op (False) off glibc."""
    if "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    libc = _glibc()
    return bool(libc is not None and libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_BYTES))


def trim_allocator() -> bool:
    """Give free heap pages back to the system (glibc ``malloc_trim(0)``: also the free pages in
    the middle of the heap, which ``free`` never returns); False off glibc. Takes milliseconds
    to tens of them on a large heap: run it off the event loop."""
    libc = _glibc()
    return bool(libc is not None and libc.malloc_trim(0))


_trimming: set[asyncio.Task[bool]] = set()


def _trim_soon() -> None:
    """:func:`trim_allocator` on a thread, at most one at a time, never awaited by a request."""
    if _trimming:
        return
    task = asyncio.ensure_future(asyncio.to_thread(trim_allocator))
    _trimming.add(task)
    task.add_done_callback(_trimming.discard)


def _json(data: Any, status: int = 200) -> web.Response:
    return web.Response(
        body=json.dumps(data, separators=(",", ":")).encode(), status=status, content_type="application/json"
    )


def _error(exc: MasterError) -> web.Response:
    resp = _json(exc.to_json(), exc.status)
    if exc.status == 503:
        resp.headers["Retry-After"] = "1"
    return resp


# Seconds a long poll held the current request: set by the lease handler, read by the middleware
# (both run in the request's task, so they share its context; request storage keys need aiohttp 3.14).
_held_s: contextvars.ContextVar[float] = contextvars.ContextVar("held_s", default=0.0)


def _error_answer(request: web.Request, exc: Exception) -> web.Response:
    """The master's one error answer: ``{"error": code, "message": ...}`` with the status of the
    :class:`~loader.master.errors.MasterError` class; aiohttp's own errors get the same shape."""
    if isinstance(exc, MasterError):  # first: the master's BadRequest is also wire's
        return _error(exc)
    if isinstance(exc, wire_errors.BodyTooLarge):
        return _error(BodyTooLarge(str(exc)))
    if isinstance(exc, wire_errors.WireError):
        return _error(BadRequest(str(exc)))
    if isinstance(exc, web.HTTPException):  # aiohttp's own: unknown route, bad method, body too large
        return _json({"error": http_code(exc.status), "message": f"{exc.reason}: {request.method} {request.path[:200]}"},
                     exc.status)
    return _json({"error": "InternalError", "message": "internal error in the master; see its log"}, 500)


@web.middleware
async def _observe(request: web.Request, handler: Handler) -> web.StreamResponse:
    # Outside the error middleware: every error is an answer by the time it gets here.
    started = time.perf_counter()
    _held_s.set(0.0)  # one task serves every request of a kept-alive connection
    resource = request.match_info.route.resource
    route = resource.canonical if resource is not None else "unmatched"
    resp = await handler(request)
    service = request.app.get(SERVICE_KEY)
    if service is not None:
        # A long poll's hold is the trainer waiting for work, not the master being slow: it has
        # its own histogram, and would otherwise fill the latency's top bucket.
        service.metrics.observe_request(route, resp.status, time.perf_counter() - started - _held_s.get())
    return resp


def _only(body: dict[str, Any], allowed: Set[str]) -> None:
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise BadRequest(f"unknown field(s) {[str(u)[:40] for u in unknown[:10]]}: expected some of {sorted(allowed)}")


def _service(request: web.Request) -> MasterService:
    return request.app[SERVICE_KEY]


def _job(request: web.Request) -> str:
    """The job the path names, once its caller is known to be allowed to it (403 Forbidden
    before anything is read or done; submit() checks again at the apply)."""
    job = validate_job_name(request.match_info["job"])
    _service(request).authorize(job, caller_of(request))
    return job


async def create_job(request: web.Request) -> web.Response:
    # The body is parsed as it arrives (a 1M-shard spec never exists as bytes or dicts whole).
    # aiohttp's server decompresses a gzip/deflate body itself (auto_decompress) in bounded
    # steps, so the limit counts decompressed bytes: a gzip bomb is a 413 like any other.
    service = _service(request)
    limit = service.settings.max_body_bytes
    length = request.content_length
    if length is not None and length > limit:
        raise BodyTooLarge(f"request body of {length} bytes is over the {limit}-byte limit; {_create_advice(limit)}")
    encoded = request.headers.get(hdrs.CONTENT_ENCODING, "identity").strip().lower() not in ("", "identity")
    status, created = await service.create_job(
        _create_body(request, limit), caller_of(request), length=None if encoded else length
    )
    if created and status["shards"]["total"] >= _TRIM_SHARDS:
        _trim_soon()  # the parse's buffers and the create record's text are freed by now
    return _json(status, 201 if created else 200)


_CREATE_CHUNK = 1 << 20


def _create_advice(limit: int) -> str:
    return (f"the master's --max-body sets it (counted decompressed; {limit >> 20} MiB holds 1,000,000 shards with "
            "keys of up to ~190 characters); send a smaller spec, or raise --max-body")


async def _create_body(request: web.Request, limit: int) -> AsyncIterator[bytes]:
    """The body in pieces of about 1 MiB (fewer parse calls than aiohttp's ~64 KiB reads),
    :class:`BodyTooLarge` as soon as more than ``limit`` bytes arrived."""
    total = 0
    pending = bytearray()
    while True:
        try:
            chunk = await request.content.read(_CREATE_CHUNK)
        except (RequestPayloadError, ContentEncodingError) as exc:
            # aiohttp's own word for a body it cannot read: bad compression, cut chunking.
            raise BadRequest(f"request body cannot be read ({str(exc).strip()[:200]}): send plain or gzip-compressed "
                             "JSON, whole") from None
        total += len(chunk)
        if total > limit:
            raise BodyTooLarge(f"request body is over the {limit}-byte limit; {_create_advice(limit)}")
        if chunk:
            pending += chunk
            if len(pending) < _CREATE_CHUNK:
                continue
        if pending:
            yield bytes(pending)
            pending.clear()
        if not chunk:
            return


async def delete_job(request: web.Request) -> web.Response:
    service = _service(request)
    job = _job(request)
    unknown = sorted(set(request.query) - {"force"})
    if unknown:
        raise BadRequest(f"unknown query parameter(s) {[u[:40] for u in unknown[:10]]}: expected only 'force'")
    force = request.query.get("force", "false").lower()
    if force not in ("true", "false", "1", "0"):
        raise BadRequest(f"'force' must be true or false, got {force[:40]!r}")
    state = service.require_state()
    found = state.jobs.get(job)
    result = await service.submit(DeleteJob(job, force in ("true", "1")), caller_of(request))
    # What the service keeps per job beside the state (trainer presence, the samples/s window:
    # a point per completion) goes with it; a job created later under the name starts afresh.
    service.forget(job)
    if found is not None and found.n >= _TRIM_SHARDS:
        _trim_soon()  # its columns and lease state are freed
    return _json(result.answer)


async def list_jobs(request: web.Request) -> web.Response:
    return _json({"jobs": _service(request).jobs(caller_of(request))})


async def job_status(request: web.Request) -> web.Response:
    return _json(_service(request).status(_job(request), caller_of(request)))


async def lease(request: web.Request) -> web.Response:
    service = _service(request)
    job = _job(request)
    body = await read_json_object(request, service.settings.max_small_body_bytes)
    _only(body, LEASE_FIELDS)
    count = body.get("count", 1)
    if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= MAX_COUNT:
        raise BadRequest(f"'count' must be an integer in [1, {MAX_COUNT}], got {str(count)[:40]!r}")
    wait_s = body.get("wait_s", 0)
    if isinstance(wait_s, bool) or not isinstance(wait_s, (int, float)) or not 0 <= wait_s <= MAX_LEASE_WAIT_S:
        raise BadRequest(f"'wait_s' must be a number of seconds in [0, {MAX_LEASE_WAIT_S:g}], got {str(wait_s)[:40]!r}")
    event = Lease(
        job, body.get("trainer"), body.get("node"), count, body.get("epoch"),  # type: ignore[arg-type]
        service.new_lease_ids(count), body.get("request_id"), body.get("stream"),
    )
    result = await service.submit(event, caller_of(request))
    answer = result.answer
    if wait_s and answer.get("status") == "wait":
        # Long poll: hold the request until the job changes (the last leases of the epoch
        # complete, one fails back) or until the master's retry hint (the next lease expiry)
        # is due, then answer afresh. The trainer learns at once, where it slept a fixed
        # interval before asking again.
        started = time.monotonic()
        service.metrics.lease_polls.inc()
        try:
            await service.wait_for_change(job, min(wait_s, answer.get("retry_after_s") or wait_s))
        finally:
            service.metrics.lease_polls.dec()
            held = time.monotonic() - started
            _held_s.set(held)
            service.metrics.lease_poll_wait.observe(held)
        answer = dict((await service.submit(event, caller_of(request))).answer)
        answer["waited_s"] = round(held, 3)
    service.note(job, event.trainer, event.node)
    return _json(answer)


_WAIT_CARRIERS = frozenset({"renew", "release", "complete"})


def _wait_report(body: dict[str, Any]) -> WaitReport | None:
    """The body's optional ``wait`` field, validated (400 saying what is wrong), or None."""
    if "wait" not in body:
        return None
    check_ident(body.get("trainer"), "trainer")
    return validate_wait(body["wait"])


async def _lease_call(request: web.Request, action: str, fields: Set[str], make: Callable[[str, str, dict[str, Any]], Any]) -> web.Response:
    service = _service(request)
    job = _job(request)
    lease_id = validate_lease_id(request.match_info["lease"])
    body = await read_json_object(request, service.settings.max_small_body_bytes)
    # A wait report rides on the calls the iterating process makes (not on fail: a worker's).
    _only(body, fields | ({"wait"} if action in _WAIT_CARRIERS else set()))
    report = _wait_report(body)
    # The lease's epoch, read before the call (a complete or release closes the lease).
    wait_epoch = service.wait_epoch(job, body["trainer"], lease_id) if report is not None else 0
    epochs = _closed_epochs(service, job)
    try:
        result = await service.submit(make(job, lease_id, body), caller_of(request))
    except (LeaseLost, NotLeaseHolder) as exc:
        if isinstance(exc, LeaseLost):
            service.metrics.refused.labels(action).inc()
        # The wait happened whatever became of the lease, and the master read it: counted, so
        # the trainer does not send it again (only a 400, 404 or 503 leaves it uncounted).
        if report is not None:
            service.report_wait(job, body["trainer"], wait_epoch, report)
        raise
    if epochs is not None and _closed_epochs(service, job) != epochs:
        _trim_soon()  # a large job's epoch closed (its done bits, requeue and progress are gone)
    if report is not None:
        service.report_wait(job, body["trainer"], wait_epoch, report)
    service.note(job, body.get("trainer"), None, result.progress)
    return _json(result.answer)


async def report_wait(request: web.Request) -> web.Response:
    """``POST /v1/jobs/{job}/wait``: a wait report from a trainer with no lease to renew."""
    service = _service(request)
    job = _job(request)
    body = await read_json_object(request, service.settings.max_small_body_bytes)
    _only(body, {"trainer", "epoch", "wait"})
    if "wait" not in body:
        raise BadRequest("'wait' is required: {\"trainer\": ..., \"epoch\": ... (optional), \"wait\": {seconds, steps, "
                         "elapsed_s, buckets}}")
    report = _wait_report(body)
    assert report is not None
    trainer = body["trainer"]
    epoch = body.get("epoch")
    if epoch is not None:
        check_int(epoch, "epoch")
    service.authorize(job, caller_of(request))  # again: the body was read meanwhile
    service.require_state().job(job)  # 404 NoSuchJob for a job that does not exist (or not any more)
    service.report_wait(job, trainer, epoch if epoch is not None else service.wait_epoch(job, trainer), report)
    service.note(job, trainer, None)
    return web.Response(status=204)


def _closed_epochs(service: MasterService, job: str) -> int | None:
    """How many epochs ``job`` closed so far, for a job large enough to trim after; else None."""
    state = service.state
    found = state.jobs.get(job) if state is not None else None
    return found.totals["epochs"] if found is not None and found.n >= _TRIM_SHARDS else None


def _get(body: dict[str, Any], name: str, default: Any = None) -> Any:
    """A body field as sent; the state machine validates types and ranges (one place for it)."""
    return body.get(name, default)


async def renew(request: web.Request) -> web.Response:
    return await _lease_call(
        request, "renew", RENEW_FIELDS,
        lambda j, lease, b: Renew(j, lease, _get(b, "trainer"), _get(b, "offset"), _get(b, "clock")),
    )


async def complete(request: web.Request) -> web.Response:
    return await _lease_call(
        request, "complete", COMPLETE_FIELDS, lambda j, lease, b: Complete(j, lease, _get(b, "trainer"), _get(b, "clock"))
    )


async def fail(request: web.Request) -> web.Response:
    return await _lease_call(
        request, "fail", FAIL_FIELDS, lambda j, lease, b: Fail(j, lease, _get(b, "trainer"), _get(b, "error", ""))
    )


async def release(request: web.Request) -> web.Response:
    return await _lease_call(
        request, "release", RELEASE_FIELDS,
        lambda j, lease, b: Release(j, lease, _get(b, "trainer"), _get(b, "offset"), _get(b, "clock")),
    )


async def _job_call(request: web.Request, fields: Set[str], make: Callable[[str, dict[str, Any]], Mark | Rewind]) -> web.Response:
    """A checkpoint call of a trainer on a job (no lease in the path): its body checked against
    ``fields``, made into an event by ``make(job, body)``, applied, the trainer noted."""
    service = _service(request)
    job = _job(request)
    body = await read_json_object(request, service.settings.max_small_body_bytes)
    _only(body, fields)
    event = make(job, body)
    result = await service.submit(event, caller_of(request))
    service.note(job, event.trainer, None, result.progress)
    return _json(result.answer)


def _positions(body: dict[str, Any]) -> tuple[tuple[Any, Any], ...]:
    raw = body.get("positions", [])
    if not isinstance(raw, list) or not all(isinstance(p, list) and len(p) == 2 for p in raw):
        raise BadRequest("'positions' must be a list of [lease id, offset] pairs")
    return tuple((p[0], p[1]) for p in raw)


async def mark(request: web.Request) -> web.Response:
    """``POST /v1/jobs/{job}/marks``: a checkpoint (a trainer's ``state_dict()``), with the exact
    positions its loop had received at ``clock``."""
    return await _job_call(request, MARK_FIELDS, lambda j, b: Mark(j, _get(b, "trainer"), _get(b, "clock"), _positions(b)))


async def rewind(request: web.Request) -> web.Response:
    """``POST /v1/jobs/{job}/rewind``: resume the job from a mark (a ``load_state_dict()``)."""
    return await _job_call(
        request, REWIND_FIELDS,
        lambda j, b: Rewind(j, _get(b, "trainer"), _get(b, "mark"), _get(b, "clock"), _get(b, "job_created")),
    )


# A report body larger than this is decoded and checked on a thread (a full report of 100,000
# objects is ~1 MB of base64: ~5 ms to decode).
_REPORT_INLINE_BYTES = 256 * 1024


def _read_report(raw: bytes) -> NodeReport:
    return parse_report(decode_json_object(raw, "a shardcache-node-report-v1 document"))


async def node_report(request: web.Request) -> web.Response:
    """``POST /v1/nodes/{node}/report``: a node daemon's report (``wire/nodeplan.py``), answered with
    the node's plan. The operator's call only (daemons report with its token); checked before
    the body is read: a standby answers ``NotLeader`` as for every write."""
    service = _service(request)
    try:
        if not caller_of(request).operator:
            raise Forbidden("only the operator reports node holdings: start the node daemons with the master's "
                            "--token-file token, not a tenant's")
        node = check_ident(request.match_info["node"], "node")
        service.require_state()
        raw = await read_body(request, MAX_REPORT_BYTES, "a node report holds at most 4,000,000 hashes a list")
        report = await asyncio.to_thread(_read_report, raw) if len(raw) > _REPORT_INLINE_BYTES else _read_report(raw)
        del raw
        plan = await service.node_report(node, report)
    except (MasterError, wire_errors.WireError):
        service.metrics.node_reports.labels("refused").inc()
        raise
    return _json(plan.to_json())


def _package_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("shardcache")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown"


# Read once at import: looking it up reads the file system, which a request must not do on the loop.
_VERSION = _package_version()


async def api_version(request: web.Request) -> web.Response:
    # What this master takes beyond the first v1: a client sends a newer field only to a master
    # listing it here (unknown body fields are refused, 400).
    return _json({"api": "v1", "version": _VERSION, "features": [WAIT_FEATURE, CHECKPOINT_FEATURE]})


async def cluster(request: web.Request) -> web.Response:
    """The cluster cache's ring the master places shards by (``--cluster``), and where it came from."""
    service = _service(request)
    return _json(service.cluster())


async def leader(request: web.Request) -> web.Response:
    service = _service(request)
    return _json({"leader": service.leader_url(), "role": service.role, "self": service.identity["url"]})


async def healthz(request: web.Request) -> web.Response:
    return _json({"ok": True, "role": _service(request).role})


async def readyz(request: web.Request) -> web.Response:
    service = _service(request)
    if not listening(request.app):  # the probe came in on a listener bound before the others
        raise MasterUnavailable("the master is still opening its listeners; retry in a moment")
    service.require_state()  # NotLeader (etcd standby) or StateUnavailable (loading, recovering)
    return _json({"ready": True, "role": service.role})


async def metrics(request: web.Request) -> web.Response:
    """Open, so that Prometheus scrapes the master's own series from pod annotations; a caller's
    token adds the series of the jobs it may see (the operator's: every job)."""
    # On the loop, as the state it reads is only ever changed there (a thread could see a job's
    # dicts change size under it).
    data = _service(request).metrics_text(caller_of(request))
    return web.Response(body=data, headers={"Content-Type": CONTENT_TYPE_LATEST})


def build_app(settings: MasterSettings, *, clock: Callable[[], float] = time.time) -> web.Application:
    # client_max_size is aiohttp's own cap; read_json_object() applies the tighter per-route limits.
    errors = error_middleware(_error_answer, known=(MasterError, wire_errors.WireError), log=log)
    # The token check sits inside the error middleware, so a refusal is the usual JSON answer.
    # The status page's own files hold no data and are served without the token.
    identities = Identities(
        TokenFile(settings.token_file) if settings.token_file is not None else None,
        TenantTokens(settings.tenant_tokens_dir) if settings.tenant_tokens_dir is not None else None,
    )
    checks = [] if identities.open else [auth_middleware(identities, open_reads=PAGE_PATHS)]
    app = web.Application(client_max_size=settings.max_body_bytes, middlewares=[_observe, errors, *checks])
    app[SETTINGS_KEY] = settings
    app[LISTENING] = asyncio.Event()  # set once every listener is bound: /readyz waits for it

    async def service_ctx(app: web.Application) -> AsyncIterator[None]:
        service = MasterService(settings, clock=clock)
        await service.start()
        # Loading the state (a snapshot's text, a replayed create record) freed what it parsed.
        await asyncio.to_thread(trim_allocator)
        app[SERVICE_KEY] = service
        try:
            yield
        finally:
            await service.stop()

    app.cleanup_ctx.append(service_ctx)
    app.router.add_post("/v1/jobs", create_job)
    app.router.add_get("/v1/jobs", list_jobs)
    app.router.add_get("/v1/jobs/{job}", job_status)
    app.router.add_delete("/v1/jobs/{job}", delete_job)
    app.router.add_post("/v1/jobs/{job}/leases", lease)
    app.router.add_post("/v1/jobs/{job}/leases/{lease}/renew", renew)
    app.router.add_post("/v1/jobs/{job}/leases/{lease}/complete", complete)
    app.router.add_post("/v1/jobs/{job}/leases/{lease}/fail", fail)
    app.router.add_post("/v1/jobs/{job}/leases/{lease}/release", release)
    app.router.add_post("/v1/jobs/{job}/wait", report_wait)
    app.router.add_post("/v1/jobs/{job}/marks", mark)
    app.router.add_post("/v1/jobs/{job}/rewind", rewind)
    app.router.add_get("/v1/version", api_version)
    app.router.add_get("/v1/leader", leader)
    app.router.add_get("/v1/cluster", cluster)
    app.router.add_post("/v1/nodes/{node}/report", node_report)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics)
    add_page_routes(app)  # GET /: the status page (loader/master/server/page/)
    return app


async def serve(
    settings: MasterSettings,
    *,
    stop: asyncio.Event | None = None,
    clock: Callable[[], float] = time.time,
    on_ready: Callable[[], None] | None = None,
) -> None:
    """Run the master until ``stop`` is set (or SIGTERM/SIGINT when serving from the CLI)."""
    stop = stop or asyncio.Event()
    app = build_app(settings, clock=clock)
    runner = web.AppRunner(app, access_log=None, handle_signals=False, **settings.connections.runner_args())
    await runner.setup()
    guard = ConnectionGuard(settings.connections, log)  # one bound for every listener
    addresses = [listen_address(a) for a in settings.listen]
    try:
        await start_listeners(runner, guard, addresses, log=log)
        if on_ready is not None:
            on_ready()
        await stop.wait()
    finally:
        await runner.cleanup()
        await asyncio.to_thread(remove_sockets, addresses)


def run_forever(settings: MasterSettings) -> None:
    """Entry point of ``shardcache master``: serve until SIGTERM or SIGINT."""

    # Every journal commit hands the GIL to the store thread and back a few times; with the
    # default 5 ms switch interval each hand-over can wait that long behind a busy event loop,
    # which dominated commit latency under load. 0.5 ms bounds it at a small cost in switches.
    sys.setswitchinterval(0.0005)
    tune_allocator()
    # Each request allocates many short-lived containers; with the default thresholds the cyclic
    # collector ran constantly and its full passes walked the whole job state. Rarer collections,
    # and the state loaded at start frozen out of them, gave ~25% more round trips/s and a
    # lower p99 in bench/master_bench.py.
    gc.set_threshold(20_000, 20, 20)

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await serve(settings, stop=stop, on_ready=gc.freeze)

    asyncio.run(main())

