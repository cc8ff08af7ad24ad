"""Warm-up jobs inside the daemon: ``POST/GET/DELETE /_shardcache/warmups``.

A warm-up runs here, not in the CLI, so it survives the CLI being interrupted; the CLI only polls.
A job is identified by a client-supplied id or by a hash of what it asks for, so running the same
command again attaches to the job in progress instead of starting a second one.

"Done" means verified in cache, never less (Fluid's DataLoad says "Complete" at 57% cached): an
object counts only once a cache entry with the expected checksum exists (re-hashed if this process
has not verified it yet), and a last pass re-checks every object so one evicted while the rest were
filling is reported as failed, with the reason, instead of being counted.

Fills go through the daemon's one-fetch-per-object :class:`~sidecar.daemon.fills.Fetcher` at ``warmup``
priority (trainers' demand reads and lease prefetches go first), with a bounded number per job and
an optional bandwidth limit. State is in memory: a restarted daemon forgets its jobs, and the CLI
re-creates them (objects already cached count as done at once).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import itertools
import logging
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from cache import Entry, IntegrityError, NoSpace
from sidecar.daemon.auth.authorizer import Session
from sidecar.daemon.auth.http import AUTH, caller
from sidecar.daemon.auth.proofs import InvalidProof, ProofBatch
from sidecar.daemon.keys import READS, SETTINGS, file_root
from sidecar.daemon.priority import PRIORITIES, WARMUP, priority_value
from sidecar.daemon.ratelimit import TokenBucket
from sidecar.daemon.reads import Filling, Hit, ReadContext, ReadService
from sidecar.errors import BadRequest, Busy, ChecksumMismatch, NoSuchWarmup, ObjectNotFound, OriginError, WarmupConflict
from wire.names import ID_RULE, is_id, parse_object_url, validate_bucket, validate_key, validate_xxh3_128, warmup_id
from wire.web import decode_json_object, read_body

__all__ = ["WARMUPS", "WarmupItem", "WarmupJob", "WarmupManager", "job_id_for", "owner_of", "setup"]

log = logging.getLogger(__name__)

MAX_BODY = 32 << 20  # a 200k-shard dataset with checksums fits
MAX_OBJECTS = 1_000_000
MAX_RUNNING = 64
KEEP_FINISHED = 64
MAX_LISTED_FAILURES = 1000
MAX_CONCURRENCY = 64
_RATE_WINDOW_S = 10.0
_ALLOWED_FIELDS = {"id", "objects", "urls", "priority", "bandwidth_bytes_per_s", "concurrency", "proofs"}
# With --auth sigv4 the pod's sidecar adds a signature of 64 hex digits per object.
MAX_PROVED_BODY = MAX_BODY + 64 * MAX_OBJECTS + 4096
MAX_RUNNING_PER_TENANT = 16
_OBJECT_FIELDS = {"bucket", "key", "xxh3_128", "size"}


# -- bandwidth ------------------------------------------------------------------------------------


# -- jobs -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class WarmupItem:
    bucket: str
    key: str
    xxh3_128: str | None = None
    size: int | None = None


def job_id_for(items: list[WarmupItem]) -> str:
    """The id of a job that names no id: a hash of what it asks for, order-independent, so the
    same request twice is the same job."""
    return warmup_id((item.bucket, item.key, item.xxh3_128) for item in items)


@dataclass
class WarmupJob:
    id: str
    items: list[WarmupItem]
    content_id: str = ""  # job_id_for(items), computed once (off the event loop) by the caller
    priority: int = WARMUP
    bandwidth_bytes_per_s: int | None = None
    concurrency: int = 4
    state: str = "running"  # running | done | failed | cancelled
    created: float = field(default_factory=time.time)
    started: float = field(default_factory=time.monotonic)
    finished: float | None = None
    files_done: int = 0
    cached_before: int = 0
    bytes_done: int = 0
    bytes_fetched: int = 0
    learned_bytes: int = 0  # sizes of objects the request did not size, learned as they filled
    failures: dict[tuple[str, str], str] = field(default_factory=dict)
    done_entries: dict[tuple[str, str], int] = field(default_factory=dict)
    inflight: dict[tuple[str, str], Any] = field(default_factory=dict)
    task: asyncio.Task[None] | None = None
    error: str | None = None
    owner: str = ""
    """Who asked for it (``--auth sigv4``, :func:`owner_of`): the only one who sees or cancels it."""
    tenant: str = ""
    """The owner's tenant: shares :data:`MAX_RUNNING_PER_TENANT` and is charged for the fills."""
    access: Callable[[], Awaitable[list[BaseException | None]]] | None = None
    """Checks, before any fill, which objects the owner may read (each one's refusal or None)."""
    _samples: collections.deque[tuple[float, int]] = field(default_factory=lambda: collections.deque(maxlen=256))
    _sized_bytes: int = -1

    @property
    def bytes_total(self) -> int:
        if self._sized_bytes < 0:
            self._sized_bytes = sum(item.size for item in self.items if item.size is not None)
        return self._sized_bytes + self.learned_bytes

    def same_request(self, other: WarmupJob) -> bool:
        return (self.content_id or job_id_for(self.items)) == (other.content_id or job_id_for(other.items))

    def _in_flight_bytes(self) -> int:
        return sum(getattr(fill, "contiguous", 0) for fill in self.inflight.values())

    def _rate(self, now: float) -> float | None:
        """Origin bytes per second over the last few seconds (what the ETA extrapolates)."""
        progress = self.bytes_fetched + self._in_flight_bytes()
        self._samples.append((now, progress))
        while len(self._samples) > 2 and now - self._samples[0][0] > _RATE_WINDOW_S:
            self._samples.popleft()
        then, before = self._samples[0]
        if now - then < 0.2:
            elapsed = now - self.started
            return progress / elapsed if elapsed > 0.2 and progress else None
        return (progress - before) / (now - then)

    def status(self, full: bool = True) -> dict[str, Any]:
        now = time.monotonic()
        end = self.finished if self.finished is not None else now
        in_flight = self._in_flight_bytes() if self.state == "running" else 0
        rate = self._rate(now) if self.state == "running" else (
            self.bytes_fetched / (end - self.started) if end > self.started else None
        )
        remaining = max(self.bytes_total - self.bytes_done - in_flight, 0)
        eta = None
        if self.state == "running" and rate:
            eta = round(remaining / rate, 1)
        elif self.state != "running":
            eta = 0.0
        answer: dict[str, Any] = {
            "id": self.id,
            "state": self.state,
            "priority": {value: name for name, value in PRIORITIES.items()}[self.priority],
            "bandwidth_bytes_per_s": self.bandwidth_bytes_per_s,
            "concurrency": self.concurrency,
            "created_at": round(self.created, 3),
            "elapsed_s": round(end - self.started, 3),
            "files": {
                "total": len(self.items),
                "done": self.files_done,
                "failed": len(self.failures),
                "in_flight": len(self.inflight),
                "cached_before": self.cached_before,
            },
            "bytes": {
                "total": self.bytes_total,
                "done": self.bytes_done,
                "in_flight": in_flight,
                "fetched": self.bytes_fetched,
            },
            "verified": self.files_done,
            "rate_bytes_per_s": round(rate, 1) if rate is not None else None,
            "eta_s": eta,
            "error": self.error,
        }
        if full:
            answer["failed"] = [
                {"bucket": bucket, "key": key, "reason": reason}
                for (bucket, key), reason in itertools.islice(self.failures.items(), MAX_LISTED_FAILURES)
            ]
        return answer


def _reason(exc: BaseException) -> str:
    """One line a user can act on, for a failed object."""
    if isinstance(exc, ChecksumMismatch):  # the manifest's checksum is not the object's
        return f"checksum mismatch: {exc}"
    if isinstance(exc, IntegrityError):
        return f"checksum mismatch: {exc} (the object differs from the manifest; re-run `shardcache index`?)"
    if isinstance(exc, ObjectNotFound):
        return f"not found at the origin: {exc}"
    if isinstance(exc, NoSpace):
        return f"cache disk full: {exc}"
    if isinstance(exc, OriginError):
        return f"origin error ({type(exc).__name__}): {exc}"
    return f"{type(exc).__name__}: {exc}"


class WarmupManager:
    """Owns the jobs of one daemon and their tasks."""

    def __init__(self, reads: ReadService, default_concurrency: int) -> None:
        self.reads = reads
        self.default_concurrency = default_concurrency
        self.jobs: dict[tuple[str, str], WarmupJob] = {}  # by (owner, id): owners never share ids

    # -- lifecycle --------------------------------------------------------------------------

    def submit(self, job: WarmupJob) -> tuple[WarmupJob, bool]:
        """Start ``job``, or return the running one with its id (``False``: attached)."""
        current = self.jobs.get((job.owner, job.id))
        if current is not None and current.state == "running":
            if not current.same_request(job):
                raise WarmupConflict(f"warm-up {job.id!r} is running with other objects; pick another id")
            return current, False
        running = sum(1 for j in self.jobs.values() if j.state == "running")
        if running >= MAX_RUNNING:
            raise Busy(f"{running} warm-ups are running (max {MAX_RUNNING}); wait for one to finish", retry_after=5)
        mine = sum(1 for j in self.jobs.values() if j.state == "running" and j.tenant == job.tenant)
        if job.tenant and mine >= MAX_RUNNING_PER_TENANT:
            # One tenant cannot take every slot of a node the others share.
            raise Busy(f"{mine} of your warm-ups are running (max {MAX_RUNNING_PER_TENANT}); wait for one to finish",
                       retry_after=5)
        self.jobs.pop((job.owner, job.id), None)  # a finished job of that id is replaced by a new run
        self.jobs[(job.owner, job.id)] = job
        self._forget_old()
        job.task = asyncio.create_task(self._guarded(job), name=f"warmup:{job.id}")
        return job, True

    def _forget_old(self) -> None:
        finished = [j for j in self.jobs.values() if j.state != "running"]
        finished.sort(key=lambda j: j.finished or 0.0)
        for job in finished[: max(len(finished) - KEEP_FINISHED, 0)]:
            del self.jobs[(job.owner, job.id)]

    async def cancel(self, job: WarmupJob) -> None:
        if job.task is not None and not job.task.done():
            job.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await job.task
        if job.state == "running":
            job.state = "cancelled"
            job.finished = time.monotonic()

    async def close(self) -> None:
        tasks = [job.task for job in self.jobs.values() if job.task is not None and not job.task.done()]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    # -- running ----------------------------------------------------------------------------

    async def _guarded(self, job: WarmupJob) -> None:
        # A bug in one job must neither kill the daemon nor leave the job "running" for ever.
        try:
            await self._run(job)
        except asyncio.CancelledError:
            job.state = "cancelled"
            raise
        except Exception as exc:  # the guard of a background task: log it, record it, go on
            log.exception("warm-up %s crashed", job.id)
            job.error = f"internal error: {type(exc).__name__}: {exc}"
            job.state = "failed"
        finally:
            job.inflight.clear()
            if job.finished is None:
                job.finished = time.monotonic()

    async def _run(self, job: WarmupJob) -> None:
        bucket = TokenBucket(job.bandwidth_bytes_per_s) if job.bandwidth_bytes_per_s else None
        items = job.items
        if job.access is not None:
            # Every object proved first (a fill is shared, so it must not start for a refused one).
            refusals = await job.access()
            job.access = None
            items = []
            for item, refused in zip(job.items, refusals, strict=True):
                if refused is None:
                    items.append(item)
                else:
                    job.failures[(item.bucket, item.key)] = f"access refused: {refused}"
        pending = iter(items)

        async def worker() -> None:
            for item in pending:  # shared iterator: each item taken by exactly one worker
                await self._warm(job, item, bucket)

        workers = [
            asyncio.create_task(worker(), name=f"warmup:{job.id}:{i}")
            for i in range(min(job.concurrency, max(len(job.items), 1)))
        ]
        try:
            await asyncio.gather(*workers)
        finally:
            for task in workers:
                task.cancel()
            for task in workers:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        await self._recheck(job)
        job.state = "failed" if job.failures else "done"
        job.finished = time.monotonic()
        log.info(
            "warm-up %s %s: %d/%d objects verified in cache, %d failed",
            job.id, job.state, job.files_done, len(job.items), len(job.failures),
        )

    async def _recheck(self, job: WarmupJob) -> None:
        """Done means in the cache now: an object evicted while others filled is a failure."""
        store = self.reads.store
        if store is None:
            return
        done = [item for item in job.items if (item.bucket, item.key) in job.done_entries]

        def gone() -> list[WarmupItem]:  # a million lookups: off the event loop, read-only
            return [item for item in done if store.lookup(item.bucket, item.key, xxh3_128=item.xxh3_128) is None]

        for item in await asyncio.to_thread(gone):
            name = (item.bucket, item.key)
            size = job.done_entries.pop(name)
            job.files_done -= 1
            job.bytes_done -= size
            job.failures[name] = (
                "evicted before the warm-up finished: the cache is smaller than what was asked "
                "(warm less, use `shardcache warmup --spread`, or raise --cache-size)"
            )

    async def _warm(self, job: WarmupJob, item: WarmupItem, bucket: TokenBucket | None) -> None:
        name = (item.bucket, item.key)
        if self.reads.store is None:
            job.failures[name] = "this daemon runs without a cache"
            return
        # The manifest's checksum is a claim (sidecar/daemon/claims.py): it refetches only an
        # unverified (or damaged) copy, once; a copy the origin vouched for stays, and the item fails.
        ctx = ReadContext(item.bucket, item.key, caller=f"warm-up {job.id}", tenant=job.tenant,
                          claim=item.xxh3_128.lower() if item.xxh3_128 else None, priority=job.priority,
                          counted=False)
        if not ctx.cacheable:
            job.failures[name] = "never cached: the mutable index of a dataset's shards is read from the origin"
            return

        async def rate_limited() -> None:
            if bucket is not None and item.size is not None:
                await bucket.acquire(item.size)

        try:
            result = await self.reads.read(ctx, before_fill=rate_limited)
            if isinstance(result, Hit):
                await asyncio.to_thread(os.close, result.fd)
                job.cached_before += 1
                self._done(job, item, result.entry, fetched=False)
                return
            if isinstance(result, Filling):
                job.inflight[name] = result.fill
                try:
                    entry = await result.fill.wait_done()
                finally:
                    job.inflight.pop(name, None)
            else:
                entry = None
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - whatever failed the fill fails this object, with its reason
            job.failures[name] = _reason(exc)
            return
        if entry is None:
            job.failures[name] = (
                "not cached: the cache had no room for it (cache full under --eviction hold, "
                "every entry in use, or the disk is full)"
            )
            return
        if bucket is not None and item.size is None:
            await bucket.acquire(entry.size)  # unsized: charged after the fact
        self._done(job, item, entry, fetched=True)

    @staticmethod
    def _done(job: WarmupJob, item: WarmupItem, entry: Entry, fetched: bool) -> None:
        job.files_done += 1
        job.bytes_done += entry.size
        if item.size is None:
            job.learned_bytes += entry.size
        if fetched:
            job.bytes_fetched += entry.size
        job.done_entries[(item.bucket, item.key)] = entry.size


# -- HTTP -----------------------------------------------------------------------------------------

WARMUPS = web.AppKey("warmups", WarmupManager)


def owner_of(session: Session | None) -> str:
    """Who owns the warm-ups a caller creates, and sees and cancels only those: the exact
    principal STS reports (an assumed role's session name included), ``""`` without ``--auth``.

    Not the tenant (the role): namespaces often share one role (one IRSA role per team or
    platform), and they would then see and cancel each other's warm-ups. The session name is what
    tells their pods apart, and it is stable for a job's life: botocore picks it once per
    credential provider (``AWS_ROLE_SESSION_NAME``, else ``botocore-session-<start time>``) and
    keeps it across IRSA's hourly refresh, so a sidecar keeps its principal until it restarts.
    A restarted sidecar is a new owner: the CLI, finding its job gone (404), submits it again,
    and what the first run cached counts at once. Not the access key either: that one changes at
    every refresh. Pods that set one ``AWS_ROLE_SESSION_NAME`` for one role share warm-ups.
    """
    return session.principal if session is not None else ""


def _count(value: Any, what: str, minimum: int, maximum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise BadRequest(f"{what} must be an integer >= {minimum}")
    if maximum is not None and value > maximum:
        raise BadRequest(f"{what} must be at most {maximum}")
    return value


@dataclass(frozen=True)
class _Request:
    items: list[WarmupItem]
    content_id: str
    ident: str | None
    priority: int
    bandwidth: int | None
    concurrency: int | None
    proofs: Any = None


def _parse_items(body: dict[str, Any], file_root: str | None) -> list[WarmupItem]:
    objects = body.get("objects", [])
    urls = body.get("urls", [])
    if not isinstance(objects, list) or not isinstance(urls, list):
        raise BadRequest("'objects' and 'urls' must be lists")
    if len(objects) + len(urls) > MAX_OBJECTS:
        raise BadRequest(f"at most {MAX_OBJECTS} objects per warm-up; split the dataset")
    items: list[WarmupItem] = []
    seen: set[tuple[str, str]] = set()
    for i, obj in enumerate(objects):
        if not isinstance(obj, dict) or not isinstance(obj.get("bucket"), str) or not isinstance(obj.get("key"), str):
            raise BadRequest(f"objects[{i}] needs string 'bucket' and 'key'")
        unknown = set(obj) - _OBJECT_FIELDS
        if unknown:
            raise BadRequest(f"objects[{i}] has unknown fields {sorted(unknown)}; known: {sorted(_OBJECT_FIELDS)}")
        digest = obj.get("xxh3_128")
        if digest is not None:
            digest = validate_xxh3_128(digest, f"objects[{i}].xxh3_128")
        size = obj.get("size")
        if size is not None:
            size = _count(size, f"objects[{i}].size", 0)
        item = WarmupItem(validate_bucket(obj["bucket"]), validate_key(obj["key"]), digest, size)
        items.append(item)
    for i, url in enumerate(urls):
        if not isinstance(url, str):
            raise BadRequest(f"urls[{i}] must be a string")
        bucket, key = parse_object_url(url, file_root)
        items.append(WarmupItem(bucket, validate_key(key)))
    for item in items:
        if (item.bucket, item.key) in seen:
            raise BadRequest(f"{item.bucket}/{item.key} is listed twice")
        seen.add((item.bucket, item.key))
    if not items:
        raise BadRequest("nothing to warm: give 'objects' [{bucket, key, xxh3_128?, size?}] or 'urls'")
    return items


def _parse_request(raw: bytes, file_root: str | None) -> _Request:
    """Decode and validate a create request. Pure CPU work on up to a million objects: the handler
    runs it on a thread so the event loop keeps serving trainers meanwhile."""
    body = decode_json_object(raw)
    unknown = set(body) - _ALLOWED_FIELDS
    if unknown:
        raise BadRequest(f"unknown fields {sorted(unknown)}; known: {sorted(_ALLOWED_FIELDS)}")
    items = _parse_items(body, file_root)
    ident = body.get("id")
    if ident is not None and not is_id(ident):
        raise BadRequest(f"'id' must be {ID_RULE}")
    priority_name = body.get("priority", "warmup")
    if priority_name not in ("warmup", "lease"):
        raise BadRequest("'priority' must be 'warmup' (default) or 'lease'; demand is for reads")
    bandwidth = body.get("bandwidth_bytes_per_s")
    if bandwidth is not None:
        bandwidth = _count(bandwidth, "'bandwidth_bytes_per_s'", 1)
    concurrency = body.get("concurrency")
    if concurrency is not None:
        concurrency = _count(concurrency, "'concurrency'", 1, MAX_CONCURRENCY)
    return _Request(items, job_id_for(items), ident, priority_value(priority_name), bandwidth, concurrency,
                    body.get("proofs"))


async def create_handler(request: web.Request) -> web.Response:
    session = caller(request)
    raw = await read_body(request, MAX_BODY if session is None else MAX_PROVED_BODY, advice="split the warm-up")
    settings = request.app[SETTINGS]
    origin_root = file_root(settings)
    parsed = await asyncio.to_thread(_parse_request, raw, origin_root)
    manager = request.app[WARMUPS]
    access = None
    if session is not None:
        if parsed.proofs is None:
            raise InvalidProof("a warm-up names objects the caller must prove it may read: send it through the "
                               "pod's shardcache sidecar")
        auth = request.app[AUTH]
        objects = [(item.bucket, item.key) for item in parsed.items]
        # Shape and date checked now, while the caller waits for an answer; each object in the job.
        batch = ProofBatch.from_json(parsed.proofs, len(objects))
        auth.check_date(batch[0])
        access = functools.partial(auth.authorize_batch, session, batch, objects)
    job = WarmupJob(
        id=parsed.ident or parsed.content_id, items=parsed.items, content_id=parsed.content_id,
        priority=parsed.priority, bandwidth_bytes_per_s=parsed.bandwidth,
        concurrency=parsed.concurrency or manager.default_concurrency,
        owner=owner_of(session), tenant=session.tenant if session is not None else "", access=access,
    )
    job, created = manager.submit(job)
    return web.json_response(job.status(), status=201 if created else 200)


def _job(request: web.Request) -> WarmupJob:
    ident = request.match_info["id"]
    if not is_id(ident):
        raise BadRequest(f"warm-up ids are {ID_RULE}")
    session = caller(request)
    job = request.app[WARMUPS].jobs.get((owner_of(session), ident))
    if job is None:
        raise NoSuchWarmup(
            f"no warm-up {ident!r} on this daemon (finished long ago, or the daemon restarted: run the warm-up again)"
        )
    return job


async def get_handler(request: web.Request) -> web.Response:
    return web.json_response(_job(request).status())


async def list_handler(request: web.Request) -> web.Response:
    owner = owner_of(caller(request))
    jobs = sorted((j for j in request.app[WARMUPS].jobs.values() if j.owner == owner), key=lambda j: j.created)
    return web.json_response({"warmups": [job.status(full=False) for job in jobs]})


async def delete_handler(request: web.Request) -> web.Response:
    job = _job(request)
    await request.app[WARMUPS].cancel(job)
    return web.json_response(job.status())


def setup(app: web.Application) -> None:
    """Register the warm-up routes and the job manager's lifecycle on the daemon's app."""

    async def lifecycle(app: web.Application) -> AsyncIterator[None]:
        # Runs after the daemon's own resources context (cleanup_ctx order): READS exists, and
        # on shutdown the jobs stop before the fetcher and store close.
        manager = WarmupManager(app[READS], app[SETTINGS].prefetch_workers)
        app[WARMUPS] = manager
        try:
            yield
        finally:
            await manager.close()

    app.cleanup_ctx.append(lifecycle)
    app.router.add_post("/_shardcache/warmups", create_handler)
    app.router.add_get("/_shardcache/warmups", list_handler)
    app.router.add_get("/_shardcache/warmups/{id}", get_handler)
    app.router.add_delete("/_shardcache/warmups/{id}", delete_handler)
