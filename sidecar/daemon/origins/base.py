"""Origins: the object stores behind the cache, behind one small interface.

``FileOrigin`` serves ``file:///root`` (the embedded default: the first path component under the
root is the bucket); ``sidecar.daemon.origins.s3.S3Origin`` serves any S3 endpoint. Both raise only
:mod:`sidecar.errors` types; retries live in the fetcher, which knows how far a fill got.

Object bytes are read by blocking calls on the origin's own threads (:meth:`Origin.open` returns
a :class:`Body` that ``readinto``-s the caller's buffer): a fill then moves each megabyte from the
socket to the cache file with two system calls and no Python object per chunk, and the event loop
stays free to send bytes to trainers (``sidecar/daemon/origins/httppool.py`` has the measurement). Metadata
calls (``head``, listings) are coroutines that use the same threads.
"""

from __future__ import annotations

import abc
import asyncio
import base64
import contextlib
import os
import stat as stat_mod
import threading
from collections.abc import AsyncIterator, Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from email.utils import formatdate
from pathlib import Path
from typing import Any, TypeVar

import xxhash

from sidecar.errors import AccessDenied, BadRequest, BucketNotFound, InvalidRange, ObjectNotFound
from wire.names import origin_object_path, validate_bucket, validate_prefix
from wire.s3xml import ListedObject, ListPage, iso_time, list_page_xml

__all__ = ["Body", "ObjectInfo", "Origin", "FileOrigin"]

READ_CHUNK = 1024 * 1024

T = TypeVar("T")


@dataclass(frozen=True)
class ObjectInfo:
    size: int
    etag: str
    last_modified: str | None = None  # RFC 7231 date, as S3 sends it


class Body(abc.ABC):
    """An open object body, read on a worker thread straight into the caller's buffer."""

    @abc.abstractmethod
    def readinto(self, buf: memoryview) -> int:
        """Fill ``buf`` as far as the body goes; 0 at its end. Raises ``OriginBadResponse`` when
        the body breaks off or stalls (the caller checks the total against what it asked)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release it (a kept-alive connection goes back to its pool when the body was read to
        its end). Idempotent."""

    def abort(self) -> None:  # noqa: B027 - optional: a body that cannot block needs no abort
        """Make a ``readinto`` blocked on another thread return; may be called from any thread."""


class EmptyBody(Body):
    def readinto(self, buf: memoryview) -> int:
        return 0

    def close(self) -> None:
        pass


class Origin(abc.ABC):
    """An object store. ``namespace`` identifies it inside cache entry ids."""

    namespace: str
    description: str
    threads: int = 32
    """Worker threads for blocking origin calls (one per body being read at a time)."""

    _executor: ThreadPoolExecutor | None = None

    async def start(self) -> None:
        """Start the worker threads; subclasses also open connection pools, resolve credentials."""
        self._executor = ThreadPoolExecutor(max_workers=self.threads, thread_name_prefix="origin")

    async def close(self) -> None:
        """Stop the worker threads; subclasses also release connection pools."""
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)

    @property
    def executor(self) -> ThreadPoolExecutor:
        assert self._executor is not None, "Origin.start() was not awaited"
        return self._executor

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on the origin's threads. A :class:`Body` that arrives after the caller
        was cancelled is closed, so no connection or file descriptor leaks."""
        future = asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            future.add_done_callback(_close_late_body)
            raise

    def release(self, body: Body) -> None:
        """Close ``body`` without blocking the caller (closing a socket or file is a system call)."""
        try:
            self.executor.submit(body.close)
        except RuntimeError:  # shutting down: no threads left to do it for us
            body.close()

    @abc.abstractmethod
    async def head(self, bucket: str, key: str) -> ObjectInfo:
        """Size and ETag of an object."""

    @abc.abstractmethod
    def open(self, bucket: str, key: str, start: int, end: int | None, etag: str | None = None) -> Body:
        """Blocking: bytes ``[start, end)`` (``end=None``: to the end) as a body. Raises if the
        object is no longer the version ``etag``. Does not retry."""

    @abc.abstractmethod
    def open_first(self, bucket: str, key: str) -> tuple[ObjectInfo, Body]:
        """Blocking: one request that returns the object's info and a body of all its bytes, so
        a fill needs no separate HEAD round trip."""

    @abc.abstractmethod
    async def list_objects_v2(self, bucket: str, params: Mapping[str, str]) -> bytes:
        """A ListObjectsV2 XML document, as S3 would answer it."""

    async def read(
        self, bucket: str, key: str, start: int, end: int | None, etag: str | None = None
    ) -> AsyncIterator[bytes | bytearray]:
        """Bytes ``[start, end)`` as chunks of up to 1 MiB, for streaming without caching."""
        body = await self.call(self.open, bucket, key, start, end, etag)
        try:
            left = None if end is None else end - start
            while left is None or left > 0:
                buf = bytearray(READ_CHUNK if left is None else min(READ_CHUNK, left))
                count = await self.call(body.readinto, memoryview(buf))
                if not count:
                    break
                if left is not None:
                    left -= count
                yield buf if count == len(buf) else bytes(memoryview(buf)[:count])
        finally:
            self.release(body)


def _close_late_body(future: asyncio.Future[Any]) -> None:
    if future.cancelled() or future.exception() is not None:
        return
    result = future.result()
    for item in result if isinstance(result, tuple) else (result,):
        if isinstance(item, Body):
            with contextlib.suppress(Exception):
                item.close()


def _http_date(ts: float) -> str:
    return formatdate(ts, usegmt=True)


class FileOrigin(Origin):
    """Objects in a local (or network-mounted) directory tree: ``root/bucket/key``."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.namespace = f"file://{self.root}"
        self.description = f"file://{self.root}"

    async def start(self) -> None:
        await super().start()
        # Resolving symlinks touches the file system: off the loop.
        self.root = await self.call(Path(self.root).resolve)
        self.namespace = f"file://{self.root}"
        self.description = f"file://{self.root}"

    def _path(self, bucket: str, key: str) -> Path:
        return Path(origin_object_path(str(self.root), bucket, key))

    def _checked(self, bucket: str, key: str) -> tuple[Path, os.stat_result]:
        """Resolve and stat, refusing anything that escapes the bucket (symlinks included)."""
        path = self._path(bucket, key)
        bucket_dir = self.root / bucket
        if not bucket_dir.is_dir():
            raise BucketNotFound(f"bucket {bucket!r} does not exist under {self.root}")
        real = Path(os.path.realpath(path))
        if not real.is_relative_to(bucket_dir.resolve()):
            raise AccessDenied(f"{bucket}/{key} resolves outside its bucket")
        try:
            st = os.stat(real)
        except (FileNotFoundError, NotADirectoryError) as exc:
            raise ObjectNotFound(f"{bucket}/{key} does not exist") from exc
        except PermissionError as exc:
            raise AccessDenied(f"{bucket}/{key}: permission denied") from exc
        if not stat_mod.S_ISREG(st.st_mode):
            raise ObjectNotFound(f"{bucket}/{key} is not a file")
        return real, st

    @staticmethod
    def _etag(st: os.stat_result) -> str:
        return '"' + xxhash.xxh64_hexdigest(f"{st.st_ino}-{st.st_size}-{st.st_mtime_ns}".encode()) + '"'

    def _info(self, st: os.stat_result) -> ObjectInfo:
        return ObjectInfo(size=st.st_size, etag=self._etag(st), last_modified=_http_date(st.st_mtime))

    async def head(self, bucket: str, key: str) -> ObjectInfo:
        _, st = await self.call(self._checked, bucket, key)
        return self._info(st)

    def _open(self, bucket: str, key: str, etag: str | None) -> tuple[int, os.stat_result]:
        path, _ = self._checked(bucket, key)
        fd = os.open(path, os.O_RDONLY)
        st = os.fstat(fd)
        if etag is not None and self._etag(st) != etag:
            os.close(fd)
            raise ObjectNotFound(f"{bucket}/{key} changed while it was being read")
        return fd, st

    def open(self, bucket: str, key: str, start: int, end: int | None, etag: str | None = None) -> Body:
        fd, st = self._open(bucket, key, etag)
        stop = st.st_size if end is None else min(end, st.st_size)
        if start > st.st_size or (start == st.st_size and st.st_size > 0):
            os.close(fd)
            raise InvalidRange(f"range start {start} beyond object size {st.st_size}", st.st_size)
        return _FileBody(fd, start, stop)

    def open_first(self, bucket: str, key: str) -> tuple[ObjectInfo, Body]:
        fd, st = self._open(bucket, key, None)
        return self._info(st), _FileBody(fd, 0, st.st_size)

    async def list_objects_v2(self, bucket: str, params: Mapping[str, str]) -> bytes:
        return await self.call(self._list, bucket, dict(params))

    def _list(self, bucket: str, params: dict[str, str]) -> bytes:
        validate_bucket(bucket)
        bucket_dir = self.root / bucket
        if not bucket_dir.is_dir():
            raise BucketNotFound(f"bucket {bucket!r} does not exist under {self.root}")
        prefix = validate_prefix(params.get("prefix", ""))
        delimiter = params.get("delimiter") or None
        try:
            max_keys = min(max(int(params.get("max-keys", "1000")), 0), 1000)
        except ValueError as exc:
            raise BadRequest("max-keys must be an integer") from exc
        token = params.get("continuation-token")
        start_after = params.get("start-after") or ""
        if token:
            try:
                start_after = base64.urlsafe_b64decode(token.encode()).decode()
            except (ValueError, UnicodeDecodeError) as exc:
                raise BadRequest("invalid continuation-token") from exc
        # Walk only below the deepest directory the prefix names.
        base_rel = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
        walk_root = bucket_dir / base_rel
        items: list[tuple[str, os.stat_result]] = []
        if walk_root.is_dir():
            for dirpath, dirnames, filenames in os.walk(walk_root):
                dirnames.sort()
                for name in filenames:
                    full = Path(dirpath) / name
                    rel = full.relative_to(bucket_dir).as_posix()
                    if not rel.startswith(prefix) or rel <= start_after:
                        continue
                    try:
                        st = full.stat()
                    except OSError:
                        continue
                    if stat_mod.S_ISREG(st.st_mode):
                        items.append((rel, st))
        items.sort(key=lambda item: item[0])
        contents: list[ListedObject] = []
        commons: list[str] = []
        last_key = None
        truncated = False
        for rel, st in items:
            if len(contents) + len(commons) >= max_keys:
                truncated = True
                break
            if delimiter:
                cut = rel.find(delimiter, len(prefix))
                if cut >= 0:
                    common = rel[: cut + len(delimiter)]
                    if not commons or commons[-1] != common:
                        commons.append(common)
                    last_key = rel
                    continue
            contents.append(ListedObject(rel, st.st_size, self._etag(st), iso_time(st.st_mtime)))
            last_key = rel
        next_token = base64.urlsafe_b64encode(last_key.encode()).decode() if truncated and last_key else None
        return list_page_xml(ListPage(
            bucket, prefix, tuple(contents), tuple(commons), max_keys, truncated, next_token, delimiter, token,
            params.get("start-after"),
        ))


class _FileBody(Body):
    def __init__(self, fd: int, start: int, end: int) -> None:
        self._fd = fd
        self._offset = start
        self._end = end
        self._lock = threading.Lock()

    def readinto(self, buf: memoryview) -> int:
        with self._lock:
            if self._fd < 0 or self._offset >= self._end:
                return 0
            count = os.preadv(self._fd, [buf[: self._end - self._offset]], self._offset)
            self._offset += count
            return count

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1

    def abort(self) -> None:
        self._end = self._offset  # file reads do not block for long: stop at the next one
