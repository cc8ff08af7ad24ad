"""Fills: one origin fetch per object, parallel ranged GETs, retries, streaming to waiting readers.

A :class:`Fill` is the single fetch of one object. The first request for a cold object starts it
(``miss``); every request that arrives while it runs joins it (``coalesced``) and streams the bytes
as the contiguous prefix lands in the temp file, so a reader never waits for the whole object. The
in-flight map entry is removed in ``finally`` whatever happens, and a failure is delivered to every
waiter (mosaicml/streaming's ``_ShardState`` without its missing ``try/finally``).

The first request of a fill is a GET of the whole object (not ranged: S3 answers its checksum only
then): its ``Content-Length`` gives the size and its ETag pins the version, so parts split off
start at once (no HEAD round trip) and carry ``If-Match``. Each part retries from the byte it reached, with jittered exponential backoff,
on connection errors, 5xx/SlowDown, stalls and truncated bodies; after the bounded retries the fill
fails, nothing is published, and readers get 503/502.

Every fill is checked against what the origin vouches for (:mod:`sidecar.daemon.checksums`):
the running checksum advances with the contiguous prefix, and the fill is *sealed* once all its
bytes are in and match. Until then a reader gets every byte of its range but the last, so a fill
that fails its check cuts every answer short (the client sees an incomplete body and retries)
and no answer ever completes with bytes the origin did not vouch for; nothing is published.
Readers that bring a checksum of their own (a caller's claim) wait for the seal and compare
before the first byte (:mod:`sidecar.daemon.reads`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from cache import Entry, IntegrityError, NoSpace, Store, Writer, aligned_buffer
from sidecar.daemon.checksums import OriginChecksum, VerifySettings, vouched
from sidecar.daemon.metrics import Metrics
from sidecar.daemon.origins.base import Body, ObjectInfo, Origin
from sidecar.daemon.priority import DEMAND, PriorityLimiter
from sidecar.daemon.splits import SplitJudge
from sidecar.errors import InvalidRange, OriginBadResponse, OriginError, OriginUnavailable
from wire.retry import Backoff, retry_async

__all__ = ["FetchSettings", "Fetcher", "Fill", "RangeRead", "retrying"]

log = logging.getLogger(__name__)

T = TypeVar("T")

_WRITE_BUFFER = 1024 * 1024
_MIN_PART = 1024 * 1024  # smallest ranged GET of a split fill: one pump buffer
# What a later attempt may not meet: the origin down or throttling, a body cut or stalled.
_TRANSIENT = (OriginUnavailable, OriginBadResponse)


@dataclass(frozen=True)
class FetchSettings:
    part_size: int = 8 * 1024 * 1024
    """Bytes per ranged GET once a fill is split."""

    parts_per_object: int = 8
    """Ranged GETs in flight for one object once a fill is split. A split only tops the daemon's
    origin streams up to this many: while other fills already keep that many connections busy
    (prefetches of the next shards), a slow stream stays one stream, since more requests would
    not add bandwidth the other fills are not already using."""

    split_below_bytes_per_s: float = 200e6
    """Split a fill into parallel ranged GETs only when its first stream delivers less than this
    (measured from the first byte, over the first 4 MiB). 0 never splits; infinity always does."""

    origin_concurrency: int = 32
    """Origin requests in flight for the whole daemon."""

    demand_reserved: int = 8
    """Of ``origin_concurrency``, slots only demand reads may use."""

    retries: int = 4
    """Retries of one part (or one request) after its first attempt."""

    backoff_base_s: float = 0.1
    """First retry delay; doubles each retry, with full jitter."""

    backoff_max_s: float = 5.0
    """Upper bound of one retry delay."""

    verify: VerifySettings = VerifySettings()
    """What a fill is checked against (the origin's checksums; its ETag as an MD5)."""

    @property
    def backoff(self) -> Backoff:
        """The retry policy of one part or request: ``retries`` after the first attempt."""
        return Backoff(self.backoff_base_s, self.backoff_max_s, attempts=self.retries + 1)


@dataclass
class FillTimeline:
    """When a fill's steps happened, in seconds after it started (``None``: not reached), and how
    its bytes came: logged at debug level as each fill ends (``--log-level debug``), the first
    place to look when cold reads are slow."""

    headers: float | None = None
    """The first GET's answer headers (size and ETag known; readers may start)."""
    split: float | None = None
    """The fill was split into parallel ranged GETs."""
    split_at: int = 0
    """Bytes the first stream had delivered when the split was decided."""
    extra: int = 0
    """Connections added by the split."""
    all_in: float | None = None
    """Every byte written."""
    sealed: float | None = None
    """Checked against the origin's checksum (readers may finish)."""
    published: float | None = None
    """Fsynced and published (a hit from now on)."""

    def describe(self, size: int) -> str:
        def at(value: float | None) -> str:
            return "-" if value is None else f"{value * 1000:.0f}"

        split = f"split at {self.split_at / 2**20:.1f} MiB (+{self.extra} at {at(self.split)} ms)" if self.split else "one stream"
        body = (self.all_in or 0) - (self.headers or 0)
        rate = f"{size / body / 1e6:.0f} MB/s" if body > 0 else "-"
        return (f"{size / 2**20:.1f} MiB, {split}: headers {at(self.headers)} ms, all in {at(self.all_in)} ms "
                f"({rate} from the first byte), sealed {at(self.sealed)} ms, published {at(self.published)} ms")


class Fill:
    """One fetch of one object, shared by every reader that wants it."""

    def __init__(
        self, bucket: str, key: str, priority: int, tenant: str = "", origin_only: bool = False, evict: bool = True
    ) -> None:
        self.bucket = bucket
        self.key = key
        self.priority = priority
        # Whether the fill may evict entries to make room for its own (cache.Store.begin): not the
        # fill behind a ranged read answered from the origin, until a reader who wants the whole
        # object (a demand read, a prefetch) joins it before it has its room.
        self.evict = evict
        self.asked = False  # its first request is on its way to the origin (past the limiter)
        # Started for a peer (or for an object never cached): reads the real origin only. Readers
        # who join later change nothing, as with the tenant.
        self.origin_only = origin_only
        # Whose request started the fill: the cached entry counts against that tenant's quota
        # (cache.StoreSettings.tenant_quota_bytes). Readers who join later change nothing.
        self.tenant = tenant
        self.info: ObjectInfo | None = None
        self.check: OriginChecksum | None = None  # what the origin vouches for, once info is known
        self.sealed: str | None = None  # the xxh3-128 of the bytes, once all are in and checked
        self.all_requested = False  # split, and every part is on a connection: more would not help it
        self.placed: str | None = None  # once sealed: the file the bytes already have their published name in
        self.writer: Writer | None = None
        self.cacheable = True
        self.contiguous = 0
        self.entry: Entry | None = None
        self.error: BaseException | None = None
        self.finished = False
        self.task: asyncio.Task[None] | None = None
        self._read_fd: int | None = None
        self._readers = 0
        self._progress = asyncio.Event()
        self.started = time.monotonic()
        self.timeline = FillTimeline()

    def _notify(self) -> None:
        event, self._progress = self._progress, asyncio.Event()
        event.set()

    async def wait_info(self) -> ObjectInfo:
        """Wait until the object's size and ETag are known (or the fill failed)."""
        while self.info is None and self.error is None:
            await self._progress.wait()
        if self.info is None:
            assert self.error is not None
            raise self.error
        return self.info

    async def wait_done(self) -> Entry | None:
        while not self.finished:
            await self._progress.wait()
        if self.error is not None:
            raise self.error
        return self.entry

    async def wait_sealed(self) -> str | None:
        """The xxh3-128 of the object's bytes once they are all in and checked (before the fsync
        that publishes them); ``None`` if the fill caches nothing (readers go to the origin)."""
        while self.sealed is None and self.error is None and not self.finished:
            if self.info is not None and not self.cacheable:
                return None
            await self._progress.wait()
        if self.error is not None:
            raise self.error
        return self.sealed

    async def ranges(self, start: int, end: int, before_seal: bool = False) -> AsyncIterator[tuple[int, int, int]]:
        """``(fd, offset, length)`` pieces of ``[start, end)`` as they land in the temp file, for
        sendfile. ``fd`` stays open until the generator finishes. Raises the fill's error.
        ``before_seal``: the range's last byte too as soon as it lands (a small range, which
        could as well have been read from the origin by range: reads.py's direct ranges)."""
        self._readers += 1
        try:
            sent = start
            while sent < end:
                event = self._progress
                # The last byte of the range waits for the seal: an answer never completes with
                # bytes the origin's checksum has not passed (a failed check cuts it short).
                ready = (self.contiguous if self.sealed is not None or self.check is None or before_seal
                         else min(self.contiguous, end - 1))
                if ready > sent and self._read_fd is not None:
                    length = min(ready, end) - sent
                    yield self._read_fd, sent, length
                    sent += length
                    continue
                if self.error is not None:
                    raise self.error
                if self.finished:
                    raise OriginBadResponse(f"{self.bucket}/{self.key}: fill ended at {self.contiguous}")
                await event.wait()
        finally:
            self._readers -= 1
            self._maybe_close()

    def _maybe_close(self) -> None:
        if self.finished and self._readers == 0 and self._read_fd is not None:
            os.close(self._read_fd)
            self._read_fd = None


async def retrying(
    settings: FetchSettings, metrics: Metrics, what: str, attempt_fn: Callable[..., Awaitable[T]], *args: object
) -> T:
    """Run ``attempt_fn(*args)`` with bounded, jittered exponential backoff on transient errors;
    every failed attempt is counted, the last one included."""
    retries = 0

    async def attempt() -> T:
        try:
            return await attempt_fn(*args)
        except _TRANSIENT as exc:
            metrics.origin_errors.labels(kind=type(exc).__name__).inc()
            raise

    def on_retry(exc: BaseException, delay: float) -> None:
        nonlocal retries
        retries += 1
        metrics.origin_retries.inc()
        log.info("retrying %s after %s (attempt %d)", what, exc, retries)

    return await retry_async(attempt, settings.backoff, lambda exc: isinstance(exc, _TRANSIENT), on_retry=on_retry)


class _PartedFill:
    """The bytes of one fill: one stream from the first byte, split into parallel ranged GETs
    only when that stream turns out slow.

    The first request asks for the whole object. Once its first MiBs have arrived its rate is
    known: an origin that streams faster than ``split_below_bytes_per_s`` (MinIO or Ceph in the
    same rack, moto) keeps the single stream, which costs one request per object; a slow one (S3
    over a WAN, a throttled gateway) is split: the first stream stops at the next part boundary
    and the rest is fetched in ``part_size`` ranges by ``parts_per_object - 1`` more connections.
    Each part retries from the byte it reached.

    Each part's body is pumped by a worker thread (``_pump``: readinto a reused 1 MiB buffer,
    pwrite, hash) that tells the loop how far it got with ``call_soon_threadsafe``; the loop
    owns everything else (the part list, readers' progress, the split's extra requests). A part
    is over only when its thread is: the temp file is never closed under a write.
    """

    def __init__(self, fetcher: Fetcher, fill: Fill, writer: Writer, info: ObjectInfo) -> None:
        self.fetcher = fetcher
        self.settings = fetcher.settings
        self.metrics = fetcher.metrics
        self.fill = fill
        self.writer = writer
        self.info = info
        self.loop = asyncio.get_running_loop()
        self.parts: list[list[int]] = [[0, info.size, 0]]  # [start, end, written]
        self.decided = False
        self.wants_split = False  # judged worth splitting, waiting for a free origin stream
        self.stopping = False
        self.workers: list[asyncio.Task[None]] = []
        self.queue: asyncio.Queue[int] = asyncio.Queue()
        self._advance_pending = False
        self._hashing: asyncio.Future[None] | None = None

    async def run(self, first_body: Body) -> None:
        what = f"{self.fill.bucket}/{self.fill.key}"
        try:
            if self.info.size:
                try:
                    await self._sink(0, first_body)
                except (OriginUnavailable, OriginBadResponse) as exc:
                    self.metrics.origin_errors.labels(kind=type(exc).__name__).inc()
                    await retrying(self.settings, self.metrics, f"{what}#0", self._attempt, 0)
                if self.workers:
                    await asyncio.gather(*self.workers)
            else:
                self.fetcher.origin.release(first_body)
            self._advance()
        finally:
            self.stopping = True
            for task in self.workers:
                task.cancel()
            for task in self.workers:
                with contextlib.suppress(BaseException):
                    await task
            # Never close the temp file under a hashing read. The run's own callback clears
            # _hashing, but only in a later loop turn: awaiting a future that is already done does
            # not yield, so waiting for the callback here spun the loop forever (found by the
            # far-host benchmark: a split fill's last hashing run ended as its parts did).
            while (hashing := self._hashing) is not None:
                with contextlib.suppress(BaseException):
                    await hashing
                if self._hashing is hashing:
                    self._hashing = None

    def _hash_behind(self) -> None:
        """On the loop: hash the part of the contiguous prefix the writing thread did not (the
        parts after the first land out of order), on a worker thread, one run at a time, so the
        seal has little left to do when the last byte lands."""
        target = self.fill.contiguous
        if self._hashing is not None or self.stopping or self.writer.hashed >= target:
            return
        future = asyncio.wrap_future(self.fetcher.origin.executor.submit(self.writer.hash_upto, target))

        def done(_: object) -> None:
            self._hashing = None
            if not future.cancelled() and future.exception() is None:
                self._hash_behind()

        self._hashing = future
        future.add_done_callback(done)

    def _advance(self) -> None:
        self._advance_pending = False  # before reading the parts: a thread's later update reschedules
        contiguous = 0
        for start, end, written in self.parts:  # parts are in offset order
            contiguous = start + written
            if start + written < end:
                break
        if contiguous > self.fill.contiguous:
            self.fill.contiguous = contiguous
            self.fill._notify()
            self._hash_behind()

    def _split(self, boundary: int, extra: int) -> None:
        """On the loop: fetch ``[boundary, size)`` in parts on ``extra`` more connections, which
        :meth:`Fetcher.grant_streams` counted already (and which are given back as they end)."""
        if self.stopping:
            self.fetcher.release_streams(extra)
            return
        # At least four parts per connection: parts then land roughly in order and the checksum
        # prefix grows while the fill runs. With one part per connection all parts end together
        # and the whole rest is hashed after the last byte: for an MD5-verified 64 MiB shard
        # that was 55 MiB at 0.86 GB/s, ~65 ms per shard on the critical path (measured on the
        # far-host benchmark: 133 MB/s with MD5, 153 without, on a 191 MB/s link).
        rest = self.info.size - boundary
        part_size = min(self.settings.part_size, max(_MIN_PART, rest // (4 * max(1, extra))))
        for start in range(boundary, self.info.size, part_size):
            self.parts.append([start, min(start + part_size, self.info.size), 0])
            self.queue.put_nowait(len(self.parts) - 1)
        what = f"{self.fill.bucket}/{self.fill.key}"

        async def worker() -> None:
            try:
                while not self.queue.empty():
                    index = self.queue.get_nowait()
                    if self.queue.empty():
                        self.fill.all_requested = True
                    await retrying(self.settings, self.metrics, f"{what}#{index}", self._attempt, index)
            finally:
                self.fetcher.release_streams(1)

        count = min(extra, len(self.parts) - 1)
        self.fetcher.release_streams(extra - count)
        self.workers = [asyncio.create_task(worker(), name=f"part-worker:{what}") for _ in range(count)]

    async def _attempt(self, index: int) -> None:
        start, end, written = self.parts[index]
        fill = self.fill
        origin = self.fetcher.origin
        async with self.fetcher.limiter.slot(fill.priority):
            with self.metrics.origin_request("get"):
                body = await origin.call(
                    functools.partial(origin.open, origin_only=fill.origin_only),
                    fill.bucket, fill.key, start + written, end, self.info.etag or None,
                )
            await self._sink(index, body)

    async def _sink(self, index: int, body: Body) -> None:
        """Pump ``body`` into part ``index`` on a worker thread; return when that thread has."""
        future = asyncio.wrap_future(self.fetcher.origin.executor.submit(self._pump, index, body))
        first = index == 0  # the split's part workers hold streams of their own (Fetcher.grant_streams)
        if first:
            self.fetcher.grant_streams(1, force=True)
        try:
            await asyncio.shield(future)
        except asyncio.CancelledError:
            self.stopping = True
            body.abort()
            with contextlib.suppress(BaseException):
                await future
            raise
        finally:
            if first:
                self.fetcher.release_streams(1)
            self._advance()
        part = self.parts[index]
        if part[0] + part[2] != part[1]:
            raise OriginBadResponse(
                f"{self.fill.bucket}/{self.fill.key}: part ended at {part[0] + part[2]} of {part[1]}"
            )

    def _pump(self, index: int, body: Body) -> None:
        """Worker thread: the body's bytes into the temp file, until the part's end."""
        part = self.parts[index]
        buffer = aligned_buffer(_WRITE_BUFFER)  # a bytearray here cost most of the CPU per filled GB
        began = time.perf_counter()  # the headers are in: the first byte is about to arrive
        try:
            while not self.stopping:
                position = part[0] + part[2]
                room = part[1] - position  # part 0's end moves closer if this thread splits the fill
                if room <= 0:
                    break
                want = min(room, _WRITE_BUFFER)
                count = 0
                while count < want:  # a body cut short raises here, before its partial buffer lands
                    got = body.readinto(buffer[count:want])
                    if not got:
                        break
                    count += got
                if not count:
                    break
                # Straight to the disk (direct_writes), readers streaming the fill or not: they
                # sendfile these bytes back from the disk. Through the page cache for them instead,
                # every byte of a streamed fill cost the daemon a copy into fresh page-cache pages:
                # 1.5-2.8 CPU-s/GB against 1.1-1.4 written direct, measured on this project's VM,
                # where that copy also pays the host's fault on memory it had taken back
                # (bench.daemon_bench's daemon_cold_buffered measures the choice in each run).
                self.writer.writev_at(position, [buffer[:count]])
                part[2] += count
                (self.metrics.peer_bytes_in if body.source == "peer" else self.metrics.origin_bytes).inc(count)
                if not self._advance_pending:
                    self._advance_pending = True
                    self.loop.call_soon_threadsafe(self._advance)
                if index == 0 and not self.decided:
                    self._maybe_split(began)
        finally:
            body.close()
        if self.stopping and part[0] + part[2] < part[1]:
            raise OriginUnavailable(f"{self.fill.bucket}/{self.fill.key}: fill stopped")

    def _maybe_split(self, first_byte_at: float) -> None:
        """Worker thread of part 0: decide once, early, whether to split the fill.

        After the first MiB a stream below half the threshold splits at once (at 90 MB/s, one S3
        connection, waiting for 4 MiB cost 45 ms per object before the other parts could start;
        over a WAN, TCP slow start shows in the first MiB too, and more connections are then what
        helps). Anything closer to the threshold is judged over 4 MiB: one scheduling hiccup of a
        few ms must not split a fast local stream, which costs an extra request per part (and, on
        moto, a copy of the whole object per part)."""
        part0 = self.parts[0]
        got = part0[2]
        if got < min(_WRITE_BUFFER, self.settings.part_size):
            return
        rate = got / max(time.perf_counter() - first_byte_at, 1e-6)
        threshold = self.settings.split_below_bytes_per_s
        final = got >= min(4 * _WRITE_BUFFER, self.settings.part_size)
        if not final and not self.wants_split and rate >= threshold / 2:
            return  # undecided: look again at 4 MiB
        part_size = self.settings.part_size
        boundary = got + part_size
        if self.info.size - boundary < part_size:
            self.decided = True  # too little left to be worth more requests
            return
        if not self.wants_split:
            if not self.fetcher.splits.should_split(rate):
                self.decided = True  # fast enough, or split fills have been slower on this origin
                return
            self.wants_split = True
        # This stream counts: at most ppo - 1 more. Granted here, under the fetcher's lock: fills
        # deciding at the same moment must not each take the same free streams.
        extra = self.fetcher.grant_streams(self.settings.parts_per_object - 1)
        if extra <= 0:
            # Slow, but other fills hold every origin stream: look again at the next MiB. Deciding
            # here for good left a fill that started beside another one on a single stream to its
            # end (the far-host benchmark: 86 MB/s on a 191 MB/s link once the other one ended).
            return
        self.decided = True
        part0[1] = boundary  # this thread stops there; the loop starts the rest
        timeline = self.fill.timeline
        timeline.split, timeline.split_at, timeline.extra = time.monotonic() - self.fill.started, got, extra
        self.loop.call_soon_threadsafe(self._split, boundary, extra)


class Fetcher:
    """Starts and tracks fills; owns the origin request limiter."""

    def __init__(self, store: Store | None, origin: Origin, settings: FetchSettings, metrics: Metrics) -> None:
        self.store = store
        self.origin = origin
        self.settings = settings
        self.metrics = metrics
        self.limiter = PriorityLimiter(settings.origin_concurrency, settings.demand_reserved)
        self.splits = SplitJudge(settings.split_below_bytes_per_s)
        self.inflight: dict[tuple[str, str], Fill] = {}
        self.streams = 0
        """Origin connections fills hold now: each fill's first stream while it is pumped, and a
        split's part workers from the split's decision to their end."""
        self._streams_lock = threading.Lock()  # taken by pump threads (a split's decision) and the loop

    def grant_streams(self, wanted: int, force: bool = False) -> int:
        """Take up to ``wanted`` origin streams of the ``parts_per_object`` a split may top the
        daemon up to (all of them with ``force``: a fill's first stream always runs); returns how
        many were taken, to give back with :meth:`release_streams`."""
        with self._streams_lock:
            granted = wanted if force else max(0, min(wanted, self.settings.parts_per_object - self.streams))
            self.streams += granted
            return granted

    def release_streams(self, count: int) -> None:
        with self._streams_lock:
            self.streams -= count

    def demand_in_flight(self) -> bool:
        """Whether a trainer waits on a fill (a demand read, or a prefetch it joined) that could
        use more of the origin: not once all its bytes are in (sealed, publishing), nor once its
        last parts are on their connections. Prefetches start again from there, so the next
        shard's fill runs in this one's tail instead of after it (measured on the far-host
        benchmark: the link idled between shards)."""
        return any(
            fill.priority == DEMAND and fill.sealed is None and not fill.all_requested
            for fill in self.inflight.values()
        )

    def start(
        self, bucket: str, key: str, priority: int, tenant: str = "", origin_only: bool = False, evict: bool = True
    ) -> tuple[Fill, bool]:
        """The fill of ``bucket/key``: the running one (``False``) or a new one (``True``).

        ``tenant`` is whose request this is ("" without auth); a new fill's entry counts for it,
        while joining a running fill keeps the tenant that started it (whose quota holds its bytes).
        ``origin_only``: a new fill reads no other daemon's copy (see :class:`Fill`).
        ``evict=False``: admitted into free room only (:meth:`cache.Store.begin`); a caller that
        may evict, joining such a fill, lets it."""
        name = (bucket, key)
        fill = self.inflight.get(name)
        if fill is not None:
            fill.priority = min(fill.priority, priority)  # a demand read promotes a prefetch
            fill.evict = fill.evict or evict
            return fill, False
        fill = Fill(bucket, key, priority, tenant, origin_only, evict)
        self.inflight[name] = fill
        fill.task = asyncio.create_task(self._run(fill), name=f"fill:{bucket}/{key}")
        return fill, True

    async def close(self) -> None:
        tasks = [fill.task for fill in self.inflight.values() if fill.task is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(BaseException):
                await task

    # -- the fill itself ----------------------------------------------------------------------

    async def _run(self, fill: Fill) -> None:
        outcome = "error"
        try:
            await self._fill(fill)
            outcome = "cached" if fill.entry is not None else "not_cached"
        except asyncio.CancelledError:
            fill.error = OriginUnavailable("daemon shutting down")
            outcome = "cancelled"
            raise
        except BaseException as exc:  # delivered to every waiter, never lost
            fill.error = exc
            if isinstance(exc, NoSpace):
                if self.store is not None:
                    self.store.note_no_space()
                log.warning("not caching %s/%s: %s", fill.bucket, fill.key, exc)
            elif isinstance(exc, (OriginError, IntegrityError)):
                if isinstance(exc, IntegrityError):
                    self.origin.refused(fill.bucket, fill.key)  # bytes from a peer: the origin's next time
                log.warning("fill of %s/%s failed: %s", fill.bucket, fill.key, exc)
            else:
                log.exception("fill of %s/%s failed", fill.bucket, fill.key)
        finally:
            writer = fill.writer
            if writer is not None and fill.entry is None:
                await asyncio.to_thread(writer.abort)
            fill.finished = True
            self.inflight.pop((fill.bucket, fill.key), None)
            source = fill.info.source if fill.info is not None else "origin"
            self.metrics.fills.labels(outcome=outcome, source=source).inc()
            fill._notify()
            fill._maybe_close()
            if fill.info is not None and log.isEnabledFor(logging.DEBUG):
                log.debug("fill of %s/%s %s: %s", fill.bucket, fill.key, outcome, fill.timeline.describe(fill.info.size))

    async def _open_first(self, fill: Fill) -> tuple[ObjectInfo, Body]:
        async with self.limiter.slot(fill.priority):
            fill.asked = True
            with self.metrics.origin_request("get"):
                return await self.origin.call(
                    functools.partial(self.origin.open_first, origin_only=fill.origin_only), fill.bucket, fill.key
                )

    async def call_origin(self, op: str, what: str, fn: Callable[..., Awaitable[T]], *args: object) -> T:
        """``fn(*args)``, an origin request outside fills (a HEAD, a listing), retried and timed."""
        async def timed(*inner: object) -> T:
            with self.metrics.origin_request(op):
                return await fn(*inner)

        return await retrying(self.settings, self.metrics, what, timed, *args)

    async def _fill(self, fill: Fill) -> None:
        info, first_body = await retrying(
            self.settings, self.metrics, f"{fill.bucket}/{fill.key}", self._open_first, fill
        )
        fill.timeline.headers = time.monotonic() - fill.started
        writer: Writer | None = None
        fill.check = vouched(info.checksums, info.etag, info.key_encrypted, self.settings.verify)
        if self.store is not None:
            try:
                # The entry keeps what the origin said about the object, to answer it on hits.
                writer = await asyncio.to_thread(
                    self.store.begin, fill.bucket, fill.key, info.etag, info.size, info.xxh3_128,
                    info.last_modified, info.headers, fill.check.verifier() if fill.check else None, info.checksums,
                    tenant=fill.tenant, borrowed=info.borrowed, evict=fill.evict,
                )
            except OSError as exc:
                log.warning("cannot cache %s/%s: %s", fill.bucket, fill.key, exc)
                writer = None
        if writer is None:
            # No room (hold policy full, all in use, disk full, the tenant's quota): callers
            # stream from the origin.
            self.origin.release(first_body)
            fill.cacheable = False
            fill.info = info
            fill._notify()
            return
        fill.writer = writer
        try:
            fill._read_fd = os.open(writer.path, os.O_RDONLY)
        except BaseException:
            self.origin.release(first_body)
            raise
        fill.info = info
        fill._notify()
        await _PartedFill(self, fill, writer, info).run(first_body)
        timeline = fill.timeline
        timeline.all_in = time.monotonic() - fill.started
        if info.size >= 2 * self.settings.part_size:  # a fill that could have been split teaches the judge
            self.splits.record(timeline.split is not None, info.size, timeline.all_in - (timeline.headers or 0))
        algorithm = fill.check.algorithm if fill.check else "none"
        def seal() -> tuple[str, Path | None]:
            return writer.seal(), writer.place()

        try:
            fill.sealed, placed = await asyncio.to_thread(seal)
            fill.placed = str(placed) if placed is not None else None
        except IntegrityError:
            self.metrics.fill_checks.labels(result="failed", algorithm=algorithm).inc()
            raise
        self.metrics.fill_checks.labels(result="verified" if fill.check else "unverified", algorithm=algorithm).inc()
        fill.timeline.sealed = time.monotonic() - fill.started
        fill._notify()  # readers holding their last byte, and those waiting to compare, go on
        fill.entry = await asyncio.to_thread(writer.commit)
        fill.timeline.published = time.monotonic() - fill.started
        fill.writer = None

    # -- straight from the origin (nothing cached) --------------------------------------------

    async def passthrough(
        self, bucket: str, key: str, start: int, end: int, etag: str | None, origin_only: bool = False
    ) -> AsyncIterator[tuple[bytes | bytearray, str]]:
        """Stream ``[start, end)`` from the origin with resuming retries, caching nothing: chunks
        with where each came from (``origin``, or ``peer`` where a cluster routed the read to the
        object's owner; a retry may land elsewhere)."""
        sent = start
        delays = self.settings.backoff.delays()
        while sent < end:
            try:
                async with self.limiter.slot(DEMAND):
                    async for chunk, source in self.origin.read(bucket, key, sent, end, etag=etag, origin_only=origin_only):
                        sent += len(chunk)
                        (self.metrics.peer_bytes_in if source == "peer" else self.metrics.origin_bytes).inc(len(chunk))
                        yield chunk, source
                if sent < end:
                    raise OriginBadResponse(f"{bucket}/{key}: origin ended at {sent} of {end}")
            except _TRANSIENT as exc:
                self.metrics.origin_errors.labels(kind=type(exc).__name__).inc()
                delay = next(delays, None)
                if delay is None:
                    raise
                self.metrics.origin_retries.inc()
                await asyncio.sleep(delay)  # then resume at the byte reached
            except InvalidRange:
                raise

    # -- one range straight from the origin (a ranged read of an object not cached) -------------

    async def open_range(self, bucket: str, key: str, start: int, end: int, etag: str | None) -> RangeRead | None:
        """The origin's answer to a GET of ``[start, end)``, its headers in (retried like any
        request), holding a demand slot of the limiter until :meth:`RangeRead.close`; ``None``
        where the origin answered no range. With ``etag``: that version or ``ObjectNotFound``."""
        origin = self.origin

        async def attempt() -> tuple[ObjectInfo, Body] | None:
            with self.metrics.origin_request("get"):
                return await origin.call(origin.open_range, bucket, key, start, end, etag)

        await self.limiter.acquire(DEMAND)
        try:
            opened = await retrying(self.settings, self.metrics, f"{bucket}/{key} bytes {start}-{end - 1}", attempt)
        except BaseException:
            self.limiter.release()
            raise
        if opened is None:
            self.limiter.release()
            return None
        info, body = opened
        return RangeRead(self, bucket, key, start, min(end, info.size), info, body)


class RangeRead:
    """One range of an object read straight from the origin, caching nothing: ``info`` is what
    the answer said of the object, and every byte :meth:`chunks` yields is of that version (a
    body cut short is resumed with ``If-Match`` on its ETag: an object replaced meanwhile ends
    the read with an error, never with bytes of the new version). :meth:`close` it, read or not."""

    def __init__(self, fetcher: Fetcher, bucket: str, key: str, start: int, end: int, info: ObjectInfo, body: Body) -> None:
        self.fetcher = fetcher
        self.bucket = bucket
        self.key = key
        self.start = start
        self.end = end
        self.info = info
        self.sent = start
        self._body: Body | None = body
        self._slot = True  # the limiter's demand slot, taken by Fetcher.open_range

    async def chunks(self) -> AsyncIterator[bytes | bytearray]:
        """The range's bytes, in chunks of up to 1 MiB as they arrive."""
        fetcher = self.fetcher
        origin, metrics = fetcher.origin, fetcher.metrics
        delays = fetcher.settings.backoff.delays()
        while self.sent < self.end:
            try:
                body = self._body
                if body is None:
                    with metrics.origin_request("get"):
                        body = self._body = await origin.call(
                            origin.open, self.bucket, self.key, self.sent, self.end, self.info.etag or None
                        )
                buf = bytearray(min(_WRITE_BUFFER, self.end - self.sent))
                count = await origin.call(body.readinto, memoryview(buf))
                if not count:
                    raise OriginBadResponse(f"{self.bucket}/{self.key}: origin ended at {self.sent} of {self.end}")
                self.sent += count
                metrics.origin_bytes.inc(count)
                yield buf if count == len(buf) else bytes(memoryview(buf)[:count])
            except _TRANSIENT as exc:
                metrics.origin_errors.labels(kind=type(exc).__name__).inc()
                self._drop_body()
                delay = next(delays, None)
                if delay is None:
                    raise
                metrics.origin_retries.inc()
                await asyncio.sleep(delay)  # then resume at the byte reached, of the same version

    def _drop_body(self) -> None:
        body, self._body = self._body, None
        if body is not None:
            self.fetcher.origin.release(body)

    def close(self) -> None:
        self._drop_body()
        if self._slot:
            self._slot = False
            self.fetcher.limiter.release()
