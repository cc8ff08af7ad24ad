"""Fills: one origin fetch per object, parallel ranged GETs, retries, streaming to waiting readers.

A :class:`Fill` is the single fetch of one object. The first request for a cold object starts it
(``miss``); every request that arrives while it runs joins it (``coalesced``) and streams the bytes
as the contiguous prefix lands in the temp file, so a reader never waits for the whole object. The
in-flight map entry is removed in ``finally`` whatever happens, and a failure is delivered to every
waiter (mosaicml/streaming's ``_ShardState`` without its missing ``try/finally``).

The first request of a fill is a ranged GET of the first part: its ``Content-Range`` gives the
size and its ETag pins the version, so the remaining parts start at once (no HEAD round trip) and
carry ``If-Match``. Each part retries from the byte it reached, with jittered exponential backoff,
on connection errors, 5xx/SlowDown, stalls and truncated bodies; after the bounded retries the fill
fails, nothing is published, and readers get 503/502.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from cache import Entry, IntegrityError, NoSpace, Store, Writer
from sidecar.errors import InvalidRange, OriginBadResponse, OriginError, OriginUnavailable
from sidecar.metrics import Metrics
from sidecar.origin import ObjectInfo, Origin
from sidecar.priority import DEMAND, PriorityLimiter

__all__ = ["FetchSettings", "Fetcher", "Fill", "retrying"]

log = logging.getLogger(__name__)

_WRITE_BUFFER = 1024 * 1024


@dataclass(frozen=True)
class FetchSettings:
    part_size: int = 8 * 1024 * 1024
    """Bytes per ranged GET. Objects up to this size take a single request."""

    parts_per_object: int = 8
    """Ranged GETs in flight for one object."""

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


class Fill:
    """One fetch of one object, shared by every reader that wants it."""

    def __init__(self, bucket: str, key: str, priority: int, expected_xxh3: str | None) -> None:
        self.bucket = bucket
        self.key = key
        self.priority = priority
        self.expected_xxh3 = expected_xxh3
        self.info: ObjectInfo | None = None
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

    async def stream(self, start: int, end: int) -> AsyncIterator[bytes]:
        """Bytes ``[start, end)`` as they land. Raises the fill's error if it fails first."""
        self._readers += 1
        try:
            sent = start
            while sent < end:
                event = self._progress
                if self.contiguous > sent and self._read_fd is not None:
                    length = min(self.contiguous, end) - sent
                    chunk = await asyncio.to_thread(os.pread, self._read_fd, min(length, _WRITE_BUFFER), sent)
                    if not chunk:
                        raise OriginBadResponse(f"{self.bucket}/{self.key}: temp file ended early")
                    sent += len(chunk)
                    yield chunk
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
    settings: FetchSettings, metrics: Metrics, what: str, attempt_fn, *args
):  # type: ignore[no-untyped-def]
    """Run ``attempt_fn(*args)`` with bounded, jittered exponential backoff on transient errors."""
    delay = settings.backoff_base_s
    for attempt in range(settings.retries + 1):
        try:
            return await attempt_fn(*args)
        except (OriginUnavailable, OriginBadResponse) as exc:
            metrics.origin_errors.labels(kind=type(exc).__name__).inc()
            if attempt == settings.retries:
                raise
            metrics.origin_retries.inc()
            log.info("retrying %s after %s (attempt %d)", what, exc, attempt + 1)
            await asyncio.sleep(random.uniform(0, delay))
            delay = min(delay * 2, settings.backoff_max_s)
    raise AssertionError("unreachable")


class Fetcher:
    """Starts and tracks fills; owns the origin request limiter."""

    def __init__(self, store: Store | None, origin: Origin, settings: FetchSettings, metrics: Metrics) -> None:
        self.store = store
        self.origin = origin
        self.settings = settings
        self.metrics = metrics
        self.limiter = PriorityLimiter(settings.origin_concurrency, settings.demand_reserved)
        self.inflight: dict[tuple[str, str], Fill] = {}

    def start(self, bucket: str, key: str, priority: int, expected_xxh3: str | None = None) -> tuple[Fill, bool]:
        """The fill of ``bucket/key``: the running one (``False``) or a new one (``True``)."""
        name = (bucket, key)
        fill = self.inflight.get(name)
        if fill is not None:
            fill.priority = min(fill.priority, priority)  # a demand read promotes a prefetch
            return fill, False
        fill = Fill(bucket, key, priority, expected_xxh3)
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
                log.warning("fill of %s/%s failed: %s", fill.bucket, fill.key, exc)
            else:
                log.exception("fill of %s/%s failed", fill.bucket, fill.key)
        finally:
            writer = fill.writer
            if writer is not None and fill.entry is None:
                await asyncio.to_thread(writer.abort)
            fill.finished = True
            self.inflight.pop((fill.bucket, fill.key), None)
            self.metrics.fills.labels(outcome=outcome).inc()
            fill._notify()
            fill._maybe_close()

    async def _open_first(self, fill: Fill) -> tuple[ObjectInfo, AsyncIterator[bytes]]:
        async with self.limiter.slot(fill.priority):
            began = time.perf_counter()
            result = await self.origin.read_head(fill.bucket, fill.key, self.settings.part_size)
            self.metrics.origin_latency.labels(op="get").observe(time.perf_counter() - began)
            return result

    async def _fill(self, fill: Fill) -> None:
        info, first_body = await retrying(
            self.settings, self.metrics, f"{fill.bucket}/{fill.key}", self._open_first, fill
        )
        writer: Writer | None = None
        if self.store is not None:
            try:
                writer = await asyncio.to_thread(
                    self.store.begin, fill.bucket, fill.key, info.etag, info.size, fill.expected_xxh3
                )
            except OSError as exc:
                log.warning("cannot cache %s/%s: %s", fill.bucket, fill.key, exc)
                writer = None
        if writer is None:
            # No room (hold policy full, all in use, disk full): callers stream from the origin.
            with contextlib.suppress(BaseException):
                await first_body.aclose()  # type: ignore[attr-defined]
            fill.cacheable = False
            fill.info = info
            fill._notify()
            return
        fill.writer = writer
        fill._read_fd = os.open(writer.path, os.O_RDONLY)
        fill.info = info
        fill._notify()

        size = info.size
        part = self.settings.part_size
        bounds = [(start, min(start + part, size)) for start in range(0, size, part)]
        written = [0] * len(bounds)

        def advance() -> None:
            contiguous = 0
            for (start, end), done in zip(bounds, written):
                contiguous = start + done
                if start + done < end:
                    break
            else:
                contiguous = size
            if contiguous > fill.contiguous:
                fill.contiguous = contiguous
                fill._notify()

        async def sink(index: int, body: AsyncIterator[bytes]) -> None:
            start, end = bounds[index]
            buffer = bytearray()
            async for chunk in body:
                buffer += chunk
                self.metrics.origin_bytes.inc(len(chunk))
                if len(buffer) >= _WRITE_BUFFER:
                    await self._write(writer, start + written[index], bytes(buffer))
                    written[index] += len(buffer)
                    buffer.clear()
                    advance()
            if buffer:
                await self._write(writer, start + written[index], bytes(buffer))
                written[index] += len(buffer)
                advance()
            if start + written[index] != end:
                raise OriginBadResponse(f"{fill.bucket}/{fill.key}: part ended at {start + written[index]} of {end}")

        async def attempt_part(index: int) -> None:
            start, end = bounds[index]
            async with self.limiter.slot(fill.priority):
                began = time.perf_counter()
                body = self.origin.read(fill.bucket, fill.key, start + written[index], end, etag=info.etag or None)
                first = await anext(body, None)
                self.metrics.origin_latency.labels(op="get").observe(time.perf_counter() - began)

                async def chained() -> AsyncIterator[bytes]:
                    if first is not None:
                        yield first
                    async for chunk in body:
                        yield chunk

                await sink(index, chained())

        if size == 0:
            pass
        else:
            # Part 0 streams from the request that told us the size; a cut retries from where it got.
            try:
                await sink(0, first_body)
            except (OriginUnavailable, OriginBadResponse):
                await retrying(self.settings, self.metrics, f"{fill.bucket}/{fill.key}#0", attempt_part, 0)
            if len(bounds) > 1:
                queue: asyncio.Queue[int] = asyncio.Queue()
                for index in range(1, len(bounds)):
                    queue.put_nowait(index)

                async def worker() -> None:
                    while not queue.empty():
                        index = queue.get_nowait()
                        await retrying(
                            self.settings, self.metrics, f"{fill.bucket}/{fill.key}#{index}", attempt_part, index
                        )

                workers = [
                    asyncio.create_task(worker(), name=f"part-worker:{fill.key}")
                    for _ in range(min(self.settings.parts_per_object, len(bounds) - 1))
                ]
                try:
                    await asyncio.gather(*workers)
                finally:
                    for task in workers:
                        task.cancel()
                    for task in workers:
                        with contextlib.suppress(BaseException):
                            await task
        advance()
        try:
            fill.entry = await asyncio.to_thread(writer.commit)
        finally:
            fill.writer = None  # committed, or commit already aborted it

    async def _write(self, writer: Writer, offset: int, data: bytes) -> None:
        await asyncio.to_thread(writer.write_at, offset, data)

    # -- straight from the origin (nothing cached) --------------------------------------------

    async def passthrough(self, bucket: str, key: str, start: int, end: int, etag: str | None) -> AsyncIterator[bytes]:
        """Stream ``[start, end)`` from the origin with resuming retries, caching nothing."""
        sent = start
        delay = self.settings.backoff_base_s
        attempt = 0
        while sent < end:
            try:
                async with self.limiter.slot(DEMAND):
                    async for chunk in self.origin.read(bucket, key, sent, end, etag=etag):
                        sent += len(chunk)
                        self.metrics.origin_bytes.inc(len(chunk))
                        yield chunk
                if sent < end:
                    raise OriginBadResponse(f"{bucket}/{key}: origin ended at {sent} of {end}")
            except (OriginUnavailable, OriginBadResponse) as exc:
                self.metrics.origin_errors.labels(kind=type(exc).__name__).inc()
                attempt += 1
                if attempt > self.settings.retries:
                    raise
                self.metrics.origin_retries.inc()
                await asyncio.sleep(random.uniform(0, delay))
                delay = min(delay * 2, self.settings.backoff_max_s)
            except InvalidRange:
                raise
