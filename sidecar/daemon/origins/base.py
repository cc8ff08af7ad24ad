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
import errno
import functools
import os
import stat as stat_mod
import threading
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from email.utils import formatdate
from pathlib import Path
from typing import Any, TypeVar

import xxhash

from sidecar.errors import AccessDenied, BadRequest, BucketNotFound, InvalidRange, ObjectNotFound
from wire.errors import InvalidName
from wire.names import origin_object_path, validate_bucket, validate_key, validate_prefix
from wire.s3headers import DEFAULT_CONTENT_TYPE, ObjectHeaders
from wire.s3xml import ListedObject, ListPage, iso_time, list_page_xml, location_xml

__all__ = ["Body", "ObjectInfo", "Origin", "FileOrigin"]

READ_CHUNK = 1024 * 1024

T = TypeVar("T")


@dataclass(frozen=True)
class ObjectInfo:
    """What an origin says about an object version; the cache entry keeps all of it, and every
    answer about the object (hit, miss, coalesced, passthrough) repeats it."""

    size: int
    etag: str
    last_modified: str | None = None  # RFC 7231 date, as S3 sends it
    headers: ObjectHeaders = ()
    """The headers S3 stores with an object, as the origin sent them (:func:`wire.s3headers.object_headers`)."""
    checksums: ObjectHeaders = ()
    """The origin's additional-checksum headers (``x-amz-checksum-*``, names lower case), when it
    sent any (:func:`sidecar.daemon.checksums.checksum_headers`)."""
    key_encrypted: bool = False
    """SSE-KMS or SSE-C: the ETag is no MD5 of the bytes."""
    source: str = "origin"
    """Who answered: ``origin``, or ``peer`` (another daemon of the cluster, :mod:`sidecar.daemon.peers`)."""
    borrowed: bool = False
    """Another daemon of the cluster owns the object: a cached copy is evicted first."""
    xxh3_128: str | None = None
    """The bytes' xxh3-128 where the answer vouched for it (a peer's hit): checked at the seal."""


class Body(abc.ABC):
    """An open object body, read on a worker thread straight into the caller's buffer."""

    source: str = "origin"
    """Where its bytes come from (``origin`` or ``peer``): which counter a fill adds them to."""

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

    def refused(self, bucket: str, key: str) -> None:  # noqa: B027 - optional: most origins route nothing
        """A fill of ``bucket/key`` failed its check: an origin that chose between sources
        (:class:`sidecar.daemon.peers.origin.ClusterOrigin`) reads it from the real one next time."""

    def fetching_from_peer(self, bucket: str, key: str) -> bool:
        """Whether this origin is reading ``bucket/key`` from another daemon now (a peer asking
        this daemon for it would then wait on itself). Only a cluster's origin ever is."""
        return False

    # ``origin_only``: the read must not be routed to another cache daemon (a peer asked for it,
    # or the object is never cached). Only an origin that routes (a cluster's) looks at it; it is
    # an argument, not a context variable, so every caller says what it wants.

    @abc.abstractmethod
    async def head(self, bucket: str, key: str, *, origin_only: bool = False) -> ObjectInfo:
        """Size and ETag of an object."""

    @abc.abstractmethod
    def open(
        self, bucket: str, key: str, start: int, end: int | None, etag: str | None = None, *, origin_only: bool = False
    ) -> Body:
        """Blocking: bytes ``[start, end)`` (``end=None``: to the end) as a body. Raises if the
        object is no longer the version ``etag``. Does not retry. ``Body.source`` says where
        its bytes come from."""

    direct_ranges: bool = False
    """Whether :meth:`open_range` answers a range with what the object is in one request. Not an
    origin that routes reads to other daemons (a cluster's): its ranges go through fills."""

    def open_range(self, bucket: str, key: str, start: int, end: int, etag: str | None = None) -> tuple[ObjectInfo, Body] | None:
        """Blocking: one request for bytes ``[start, end)`` (``end`` past the object: to its end)
        that also says what the object is (its size, ETag and headers, from the same answer as
        the bytes); ``None`` where the origin answered no range (the caller reads otherwise).
        ``InvalidRange`` when ``start`` is past the end; with ``etag``, ``ObjectNotFound`` if the
        object is no longer that version. Does not retry. Only where :attr:`direct_ranges`."""
        raise NotImplementedError(f"{type(self).__name__} answers no direct ranges")

    @abc.abstractmethod
    def open_first(self, bucket: str, key: str, *, origin_only: bool = False) -> tuple[ObjectInfo, Body]:
        """Blocking: one request that returns the object's info and a body of all its bytes, so
        a fill needs no separate HEAD round trip."""

    @abc.abstractmethod
    async def list_objects_v2(self, bucket: str, params: Mapping[str, str]) -> bytes:
        """A ListObjectsV2 XML document, as S3 would answer the client's query ``params``
        (names url-encoded only when it has ``encoding-type=url``)."""

    @abc.abstractmethod
    async def list_objects(self, bucket: str, params: Mapping[str, str]) -> bytes:
        """A ListObjects (v1: ``marker``, ``NextMarker``) XML document, as S3 would answer it."""

    @abc.abstractmethod
    async def head_bucket(self, bucket: str) -> str | None:
        """The bucket's region, ``None`` where the origin does not say; ``BucketNotFound``."""

    @abc.abstractmethod
    async def bucket_location(self, bucket: str) -> bytes:
        """A GetBucketLocation XML document, as S3 would answer it."""

    async def read(
        self, bucket: str, key: str, start: int, end: int | None, etag: str | None = None, *, origin_only: bool = False
    ) -> AsyncIterator[tuple[bytes | bytearray, str]]:
        """Bytes ``[start, end)`` as chunks of up to 1 MiB, for streaming without caching, each
        with where it came from (:attr:`Body.source`)."""
        body = await self.call(functools.partial(self.open, origin_only=origin_only), bucket, key, start, end, etag)
        source = body.source
        try:
            left = None if end is None else end - start
            while left is None or left > 0:
                buf = bytearray(READ_CHUNK if left is None else min(READ_CHUNK, left))
                count = await self.call(body.readinto, memoryview(buf))
                if not count:
                    break
                if left is not None:
                    left -= count
                yield (buf if count == len(buf) else bytes(memoryview(buf)[:count])), source
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


# What a key no file can have provokes: a component over NAME_MAX, a key below a file (or below
# a socket or a device), a link loop, a directory. S3 answers NoSuchKey for any key that names no
# object, and so does the file origin.
_MISSING_ERRNOS = frozenset({
    errno.ENOENT, errno.ENOTDIR, errno.ENAMETOOLONG, errno.ELOOP, errno.EISDIR, errno.ENXIO, errno.ENODEV,
})


def _file_error(exc: OSError, what: str) -> OSError:
    """The origin error for a failed stat or open of ``what``; other errors (EIO, EMFILE) are the
    daemon's own trouble and stay as they are."""
    if exc.errno in _MISSING_ERRNOS:
        return ObjectNotFound(f"{what} does not exist ({os.strerror(exc.errno or 0)})")
    if exc.errno in (errno.EACCES, errno.EPERM):
        return AccessDenied(f"{what}: permission denied")
    return exc


def _is_dir(real: str) -> bool:
    """Whether the resolved path ``real`` is a directory; a link (swapped in since) is not followed."""
    try:
        return stat_mod.S_ISDIR(os.stat(real, follow_symlinks=False).st_mode)
    except OSError:  # ENAMETOOLONG, ENOTDIR, ELOOP included: no such directory
        return False


# Links followed in one resolution before it is a loop: the kernel's own limit (MAXSYMLINKS).
_MAX_LINKS = 40


def _opened_path(fd: int) -> str | None:
    """The kernel's name for the file ``fd`` has open (Linux); None where ``/proc`` is missing."""
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return None


class FileOrigin(Origin):
    """Objects in a local (or network-mounted) directory tree: ``root/bucket/key``.

    The root is the boundary: nothing whose path, after every symlink is resolved, lies outside
    it is read, listed or described (403 AccessDenied), so a bucket that links to ``/`` or a
    dataset unpacked with links pointing out serves nothing of the host. Links that stay inside
    the root keep working, for reads and stats (a bucket that links to another, a file linked
    into two datasets). Listings resolve the bucket and the directory the prefix names, then walk
    without following directory links below it (no cycles, no key listed twice); a file link is
    listed when it resolves to a regular file inside the root.

    Containment is decided before the file system is asked about anything outside the root: the
    names are checked as text first (:mod:`wire.names`: no ``..`` segment, no absolute path), and
    the path is then resolved from the root down (:meth:`_resolve`), each link judged by its text
    before anything it names is touched. No call (not even a stat) lands outside the root, on its
    own parent directories neither: ``os.path.realpath``, used before, lstat-ed every ancestor of
    the root on every request, and walked a link to ``/`` or to another tree before refusing it
    (an automounter, a hung network mount or a timing probe outside the root stay out of reach).

    Keys are S3's: a key ending in ``/`` (a folder marker) or holding ``//`` is a key of its own,
    which no file has (the file system reads ``a/`` and ``a//b`` as the files ``a`` and ``a/b``):
    404 NoSuchKey, never the bytes of another key, and a listing never makes such a key of a path.

    Check and use are the same file: the resolved path is opened with ``O_NOFOLLOW | O_NONBLOCK``
    (a swapped-in last link fails, a FIFO cannot hang the thread), and the descriptor itself
    checked: its kernel name (``/proc/self/fd``) must lie inside the root and ``fstat`` must say
    regular file. A link swapped into the path between the resolution and the open is caught for
    one ``readlink`` per open, cheaper than opening each component with ``openat(O_NOFOLLOW)``
    (Python has no ``openat2(RESOLVE_BENEATH)``). Where ``/proc`` is not mounted the descriptor's
    inode must be the one the check stat-ed, which leaves a window between the resolution and the
    open. Stats (HEAD) open the file too, so they describe exactly what a read would return.

    The errors a hostile key provokes from the file system (a component over 255 bytes, a key
    below a file, a link loop) are missing objects, 404 NoSuchKey, as S3 answers for any key
    that names no object; permission errors are 403 AccessDenied.
    """

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        # The root as the daemon was given it: an absolute link that names it (say /data/bk/x,
        # where /data links to /mnt/ssd/data) names the root, whatever it resolves to.
        self._given_root = str(self.root)
        self.namespace = f"file://{self.root}"
        self.description = f"file://{self.root}"

    async def start(self) -> None:
        await super().start()
        # Resolving symlinks touches the file system: off the loop.
        self.root = await self.call(Path(self.root).resolve)
        self.namespace = f"file://{self.root}"
        self.description = f"file://{self.root}"

    def _path(self, bucket: str, key: str) -> str:
        return origin_object_path(str(self.root), bucket, key)

    def _inside(self, real: str) -> bool:
        root = str(self.root)
        return real == root or real.startswith(root.rstrip("/") + "/")

    def _resolve(self, path: str) -> str | None:
        """``path`` (the root, or lexically below it) with every link resolved, or ``None`` when
        a link leads out of the root.

        Walks from the root (resolved once, at start) one component at a time, as the kernel
        does, calling ``lstat`` and ``readlink`` only on a name in a real directory inside the
        root. A link's target is judged by its text before anything it names is touched: an
        absolute one must be the root or below it, and ``..`` may not climb above the root (a
        link that leaves the root and comes back is refused too: it would have to be followed
        out to know). Raises the ``OSError`` of a name that cannot be looked up (ENOENT,
        ENOTDIR, ENAMETOOLONG, EACCES) and ELOOP past the kernel's limit of links."""
        root = str(self.root)
        base = root.rstrip("/")
        if path != root and not path.startswith(base + "/"):
            return None
        done: list[str] = []  # resolved names below the root: no links among them
        todo = path[len(base) + 1 :].split("/")[::-1]  # names still to resolve, the next one last
        last_is_dir = True
        links = 0
        while todo:
            part = todo.pop()
            if not last_is_dir:  # 'file/x', 'file/..', 'file/': the kernel's ENOTDIR
                raise OSError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), "/".join([base, *done]))
            if part in ("", "."):
                continue
            if part == "..":
                if not done:
                    return None  # above the root
                done.pop()  # the parent of a real directory: no link to go back through
                continue
            current = "/".join([base, *done, part])
            st = os.lstat(current)
            if not stat_mod.S_ISLNK(st.st_mode):
                done.append(part)
                last_is_dir = stat_mod.S_ISDIR(st.st_mode)
                continue
            links += 1
            if links > _MAX_LINKS:
                raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), current)
            target = os.readlink(current)
            if target.startswith("/"):
                below = self._below_root(target)
                if below is None:
                    return None
                done, target = [], below
            todo.extend(target.split("/")[::-1])
        return "/".join([base, *done]) if done else root

    def _below_root(self, target: str) -> str | None:
        """An absolute link target as a path below the root, or ``None`` if its text names
        another place: the root is named as it resolves or as the daemon was given it."""
        for root in (str(self.root), self._given_root):
            base = root.rstrip("/")
            if target == root or target.startswith(base + "/"):
                return target[len(base) :]
        return None

    def _open_checked(self, bucket: str, key: str) -> tuple[int, os.stat_result]:
        """A descriptor on the regular file ``bucket``/``key`` names, inside the root after every
        link is resolved, and its ``fstat``; the caller closes it."""
        path = self._path(bucket, key)  # names validated: no traversal by the name itself
        self._bucket_dir(bucket)
        what = f"{bucket}/{key}"
        if "" in key.split("/"):
            # 'train/0.tar/' is not 'train/0.tar', though the file system would open that for it.
            raise ObjectNotFound(f"{what} names no file: a key ending in '/' or holding '//' is a key of its own")
        try:
            real = self._resolve(path)
        except OSError as exc:
            raise _file_error(exc, what) from exc
        if real is None:
            raise AccessDenied(f"{what} resolves outside the origin's root")
        return self._open_real(real, what)

    def _open_real(self, real: str, what: str) -> tuple[int, os.stat_result]:
        """Open the resolved path ``real`` and check the descriptor (see the class docstring)."""
        try:
            before = os.stat(real, follow_symlinks=False)
        except OSError as exc:
            raise _file_error(exc, what) from exc
        if not stat_mod.S_ISREG(before.st_mode):  # not opened at all: no device, no FIFO
            raise ObjectNotFound(f"{what} is not a file")
        try:
            fd = os.open(real, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
        except OSError as exc:
            raise _file_error(exc, what) from exc
        try:
            st = os.fstat(fd)
            opened = _opened_path(fd)
            if opened is not None and not self._inside(opened):
                raise AccessDenied(f"{what} resolves outside the origin's root")
            if opened is None and (st.st_dev, st.st_ino) != (before.st_dev, before.st_ino):
                raise ObjectNotFound(f"{what} changed while it was being opened")
            if not stat_mod.S_ISREG(st.st_mode):
                raise ObjectNotFound(f"{what} is not a file")
            os.set_blocking(fd, True)
        except BaseException:
            os.close(fd)
            raise
        return fd, st

    def _stat(self, bucket: str, key: str) -> os.stat_result:
        fd, st = self._open_checked(bucket, key)
        os.close(fd)
        return st

    @staticmethod
    def _etag(st: os.stat_result) -> str:
        return '"' + xxhash.xxh64_hexdigest(f"{st.st_ino}-{st.st_size}-{st.st_mtime_ns}".encode()) + '"'

    def _info(self, st: os.stat_result) -> ObjectInfo:
        # A file has no stored headers but its type; S3 answers its own default for an object put
        # without one, and so does this origin, so a client sees no difference between the two.
        return ObjectInfo(
            size=st.st_size, etag=self._etag(st), last_modified=_http_date(st.st_mtime),
            headers=(("Content-Type", DEFAULT_CONTENT_TYPE),),
        )

    async def head(self, bucket: str, key: str, *, origin_only: bool = False) -> ObjectInfo:
        st = await self.call(self._stat, bucket, key)
        return self._info(st)

    def _open(self, bucket: str, key: str, etag: str | None) -> tuple[int, os.stat_result]:
        fd, st = self._open_checked(bucket, key)
        if etag is not None and self._etag(st) != etag:
            os.close(fd)
            raise ObjectNotFound(f"{bucket}/{key} changed while it was being read")
        return fd, st

    def open(
        self, bucket: str, key: str, start: int, end: int | None, etag: str | None = None, *, origin_only: bool = False
    ) -> Body:
        fd, st = self._open(bucket, key, etag)
        stop = st.st_size if end is None else min(end, st.st_size)
        if start > st.st_size or (start == st.st_size and st.st_size > 0):
            os.close(fd)
            raise InvalidRange(f"range start {start} beyond object size {st.st_size}", st.st_size)
        return _FileBody(fd, start, stop)

    def open_first(self, bucket: str, key: str, *, origin_only: bool = False) -> tuple[ObjectInfo, Body]:
        fd, st = self._open(bucket, key, None)
        return self._info(st), _FileBody(fd, 0, st.st_size)

    direct_ranges = True

    def open_range(self, bucket: str, key: str, start: int, end: int, etag: str | None = None) -> tuple[ObjectInfo, Body] | None:
        fd, st = self._open(bucket, key, etag)
        if start >= st.st_size:
            os.close(fd)
            raise InvalidRange(f"range start {start} beyond object size {st.st_size}", st.st_size)
        return self._info(st), _FileBody(fd, start, min(end, st.st_size))

    async def list_objects_v2(self, bucket: str, params: Mapping[str, str]) -> bytes:
        return await self.call(self._list, bucket, dict(params), False)

    async def list_objects(self, bucket: str, params: Mapping[str, str]) -> bytes:
        return await self.call(self._list, bucket, dict(params), True)

    async def head_bucket(self, bucket: str) -> str | None:
        await self.call(self._bucket_dir, bucket)
        return None  # a directory has no region: S3's default, as GetBucketLocation says

    async def bucket_location(self, bucket: str) -> bytes:
        await self.call(self._bucket_dir, bucket)
        return location_xml(None)

    def _bucket_dir(self, bucket: str) -> str:
        """The bucket's directory, resolved: containment first (a bucket that links out is
        refused without a look at what it links to), then whether it is a directory."""
        validate_bucket(bucket)
        try:
            real = self._resolve(f"{str(self.root).rstrip('/')}/{bucket}")
        except OSError:  # missing, a link loop, a name too long: no such bucket
            real = ""
        if real is None:
            raise AccessDenied(f"bucket {bucket!r} resolves outside the origin's root")
        if not real or not _is_dir(real):
            raise BucketNotFound(f"bucket {bucket!r} does not exist under {self.root}")
        return real

    def _list(self, bucket: str, params: dict[str, str], v1: bool) -> bytes:
        """A listing page built as S3 builds it: keys after the marker (v1), the decoded token or
        ``start-after`` (v2) in UTF-8 order; with a delimiter, keys that hold it after the prefix
        roll up into one common prefix each, which counts once towards ``max-keys`` and is never
        listed again on a later page (a token or marker that names it skips all its keys)."""
        prefix = validate_prefix(params.get("prefix", ""))  # refused as text, before any look at the tree
        self._bucket_dir(bucket)
        delimiter = params.get("delimiter") or None
        try:
            max_keys = min(max(int(params.get("max-keys", "1000")), 0), 1000)
        except ValueError as exc:
            raise BadRequest("max-keys must be an integer") from exc
        token = params.get("continuation-token") or None
        start_after = params.get("start-after") or None
        marker = params.get("marker") or None
        if v1:
            start = marker or ""
        elif token:
            try:
                start = base64.urlsafe_b64decode(token.encode()).decode()
            except (ValueError, UnicodeDecodeError) as exc:
                raise BadRequest("invalid continuation-token") from exc
        else:
            start = start_after or ""
        # Walk only below the deepest directory the prefix names. A prefix holding '//' names
        # no key (no file's key has an empty segment): walking 'train/' for 'train//' would
        # list train/0.tar as 'train//0.tar', a key that does not exist.
        base_rel = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
        items = [] if "//" in prefix else sorted(
            (rel, st) for rel, st in self._walk(bucket, base_rel)
            if rel.startswith(prefix) and rel > start and _listable(rel)
        )
        contents: list[ListedObject] = []
        commons: list[str] = []
        last: str | None = None
        truncated = False
        for rel, st in items:
            cut = rel.find(delimiter, len(prefix)) if delimiter else -1
            common = rel[: cut + len(delimiter)] if delimiter and cut >= 0 else None
            if common is not None and (common <= start or (commons and commons[-1] == common)):
                continue  # listed already, on this page or an earlier one
            if len(contents) + len(commons) >= max_keys:
                truncated = max_keys > 0  # max-keys=0 asks for nothing, not for a page to follow
                break
            if common is None:
                contents.append(ListedObject(rel, st.st_size, self._etag(st), iso_time(st.st_mtime)))
            else:
                commons.append(common)
            last = rel if common is None else common
        next_token = base64.urlsafe_b64encode(last.encode()).decode() if truncated and last and not v1 else None
        page = ListPage(
            bucket, prefix, tuple(contents), tuple(commons), max_keys, truncated, next_token, delimiter,
            None if v1 else token, None if v1 else start_after,
            marker=marker if v1 else None,
            # S3 names the next marker only when a delimiter is given; without one the last key is it.
            next_marker=last if v1 and truncated and delimiter else None,
        )
        return list_page_xml(page, v1=v1, encoding_type=params.get("encoding-type"))

    def _walk(self, bucket: str, base_rel: str) -> Iterator[tuple[str, os.stat_result]]:
        """(key, stat) of each object below ``bucket/base_rel``: the directory is resolved and
        opened once, checked by its descriptor, then walked by descriptor (``os.fwalk``) without
        following directory links, so no directory can be swapped for a link mid-walk."""
        try:
            top = self._resolve(os.path.join(self.root, bucket, base_rel))
        except OSError:  # no such directory (missing, below a file, a name too long): no keys
            return
        if top is None:  # it links out of the root: no keys
            return
        try:
            # O_DIRECTORY: a file, a FIFO or a link swapped in fails here instead of being opened.
            topfd = os.open(top, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:  # no such directory (missing, below a file, a name too long): no keys
            return
        try:
            opened = _opened_path(topfd)
            if opened is not None and not self._inside(opened):
                return
            for dirpath, _dirnames, filenames, dirfd in os.fwalk(".", dir_fd=topfd, follow_symlinks=False):
                sub = dirpath[2:]  # "" for the top ("."), "a/b" below it ("./a/b")
                for name in filenames:
                    st = self._listed_stat(name, dirfd, os.path.join(top, sub, name))
                    if st is not None:
                        yield "/".join(part for part in (base_rel, sub, name) if part), st
        finally:
            os.close(topfd)

    def _listed_stat(self, name: str, dirfd: int, full: str) -> os.stat_result | None:
        """The stat a read of this entry would see, or None if it is no object of the origin: a
        file link is followed only to a regular file inside the root, and checked as a read is."""
        try:
            st = os.stat(name, dir_fd=dirfd, follow_symlinks=False)
        except OSError:
            return None
        if stat_mod.S_ISREG(st.st_mode):
            return st
        if not stat_mod.S_ISLNK(st.st_mode):
            return None
        try:
            real = self._resolve(full)
        except OSError:
            return None
        if real is None:
            return None
        try:
            fd, st = self._open_real(real, full)
        except OSError:  # ObjectNotFound and AccessDenied are OSErrors too
            return None
        os.close(fd)
        return st


def _listable(key: str) -> bool:
    """Whether a file's name is a key a listing can carry: UTF-8 (a name that is not decodes to
    lone surrogates) and a name the daemon serves, so every listed key can be read."""
    try:
        key.encode("utf-8")
        validate_key(key)
    except (UnicodeEncodeError, InvalidName):
        return False
    return True


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
