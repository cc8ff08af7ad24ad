"""The on-disk shard store: capacity, eviction, integrity and crash safety.

Layout under ``settings.root``::

    v1/LOCK                    flock'ed by the owning process
    v1/tmp/<random>.part       fills in progress (discarded at start-up)
    v1/data/<id[:2]>/<id>      published object bytes, exactly the object (read-only, 0444)
    v1/meta/<id[:2]>/<id>.json what the bytes are: bucket, key, etag, size, xxh3-128, the
                               origin's Last-Modified and stored object headers, and the tenant
                               whose request filled them

An entry exists only once both its data file and its meta file are in place. Publishing renames
the (fsync'ed) data file first and then atomically writes the meta file, so a crash at any moment
leaves either a complete entry or orphans that :meth:`Store.open` deletes. Published files are
never modified in place: a reader holding one open (the daemon's sendfile, or a pod's
short-circuit read) keeps valid bytes even if the entry is evicted, because unlink only drops the
name.

Eviction (:mod:`cache.eviction`): the store accounts for capacity (bytes, items, free disk) and
pins; which entries go to make room is its policy's choice (``StoreSettings.eviction``), told of
every entry indexed, touched and removed. Under ``lru`` borrowed entries (:attr:`Entry.borrowed`:
copies of objects another daemon of the cluster owns, read from that peer) go first, least recently
used first, then the least recently used owned ones; ``hold`` evicts nothing for room; ``planned``
evicts by a lease master's plan (:meth:`Store.set_plan`, Belady's rule over the order its trainers
will read in: :class:`cache.eviction.PlannedPolicy`). A fill the plan asked for
(:meth:`Store.spare_kept`) never evicts an entry the plan keeps, nor one a reader's hint filled
and nobody has read yet (:meth:`Store.awaited`).

Watchers (:meth:`Store.watch`) are told of every entry indexed and every entry that leaves the
index, under the store's lock: the daemon's report of what it holds to the lease master.

Tenants (``StoreSettings.tenant_quota_bytes``): an entry counts for the tenant whose request
caused its fill. A fill that would take that tenant past its quota first evicts the tenant's own
least recently used entries (:class:`cache.eviction.TenantQuota`), under either policy; entries of
tenant "" count for nobody.

Integrity: the xxh3-128 of every entry is computed while it is filled and checked against the
expected checksum when the caller knows it (manifest). A published file is re-hashed before it is
served whenever its (inode, size, mtime, ctime) stamp differs from the one last verified by this
process, i.e. on the first read after start-up and after anything touched the file.

Descriptors for other processes (``StoreSettings.read_only_view``): a process handed a descriptor
opened read-only can still reopen it for writing through ``/proc/self/fd/N`` if it may write the
file (root with ``CAP_DAC_OVERRIDE``: mode 0444 does not stop it). That reopen goes through the
mount the descriptor was opened on, so :meth:`Store.open_verified` with ``for_others`` opens
through a read-only mount of the same directory: the reopen fails with ``EROFS`` whoever asks, and
so do ``fchmod``, ``fchown`` and ``futimens`` on the descriptor. :meth:`Store.open` refuses a view
that is not this directory or not read-only (:class:`ReadOnlyViewError`), and every such open
checks its descriptor again (same file system, read-only mount), so a view remounted or unmounted
meanwhile hands out nothing rather than a writable descriptor.

This module is synchronous and thread-safe; the daemon calls it from an executor.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import mmap
import os
import secrets
import shutil
import threading
import time
from array import array
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import xxhash

from cache.entry import LAYOUT, Entry
from cache.errors import CacheLocked, CorruptEntry, EntryNotFound, IntegrityError, NoSpace, ReadOnlyViewError
from cache.eviction import NameHash, TenantQuota, policy_for
from cache.settings import StoreSettings

__all__ = ["Store", "Entry", "Writer", "Verifier", "Watcher", "ReadOnlyViewError", "entry_id", "hash_file"]

log = logging.getLogger(__name__)

_HASH_CHUNK = 4 * 1024 * 1024
_DIRECT_ALIGN = 4096  # offset and length of an O_DIRECT write: a multiple of any logical block size in use
# An entry's object headers, as a sanity bound on what a meta file may hold (the daemon refuses
# far less from an origin; this only keeps a tampered meta file from being loaded or replayed).
_MAX_HEADER_BYTES = 64 * 1024
# A tenant is an IAM principal ARN or ``key:<access key id>``; ARNs stay far below this. The bound
# keeps a tampered meta file (or a caller) from making every entry carry megabytes of name.
_MAX_TENANT_CHARS = 2048


def entry_id(namespace: str, bucket: str, key: str, etag: str) -> str:
    """Stable id of one immutable object version; also its file name in the store."""
    ident = "\0".join((namespace, bucket, key, etag)).encode("utf-8", "surrogatepass")
    return xxhash.xxh3_128_hexdigest(ident)


def aligned_buffer(size: int) -> memoryview:
    """A page-aligned buffer for ``readinto``/``recv_into``/``pwrite`` loops.

    Not ``bytearray(size)``: glibc serves a 1 MiB allocation with its own mapping and hands out
    page + 16 bytes, and the kernel's copies between page-aligned page-cache pages (or socket
    buffers) and a buffer 16 bytes past a 4 KiB boundary hit the CPU's 4K-aliasing stall. Measured
    on the project's 2-core VM: ``recv_into`` 1.3 vs 6.4 GB/s, ``pwrite`` 9.8 vs 14.8 GB/s,
    ``readinto`` of a warm file 6-7 vs 13-16 GB/s. An anonymous mapping starts on a page."""
    return memoryview(mmap.mmap(-1, size))


def hash_file(fd: int, size: int) -> str:
    """xxh3-128 of the first ``size`` bytes of an open file, read with pread."""
    hasher = xxhash.xxh3_128()
    offset = 0
    while offset < size:
        chunk = os.pread(fd, min(_HASH_CHUNK, size - offset), offset)
        if not chunk:
            break
        hasher.update(chunk)
        offset += len(chunk)
    if offset != size:
        raise IntegrityError(f"file is {offset} bytes, expected {size}")
    return hasher.hexdigest()


class Verifier(Protocol):
    """A check of an object's bytes the caller brings to a fill (the origin's checksum): fed every
    byte in order as the hashed prefix grows, asked once at the end."""

    algorithm: str

    def update(self, data: bytes | memoryview, /) -> None: ...

    def matches(self) -> bool: ...

    def actual(self) -> str: ...


Watcher = Callable[[Sequence[Entry], Sequence[Entry]], None]
"""Told ``(added, removed)``: entries just indexed, entries that just left the index
(:meth:`Store.watch`)."""


@dataclass
class _Stamp:
    ino: int
    size: int
    mtime_ns: int
    ctime_ns: int


class Writer:
    """A fill in progress: bytes land in a temp file at any offset (parallel ranged GETs), the
    checksum advances over the contiguous prefix, and :meth:`commit` publishes atomically."""

    def __init__(
        self, store: Store, bucket: str, key: str, etag: str, size: int, expected_xxh3: str | None,
        last_modified: str | None = None, headers: tuple[tuple[str, str], ...] = (),
        verifier: Verifier | None = None, checksums: tuple[tuple[str, str], ...] = (), tenant: str = "",
        borrowed: bool = False,
    ) -> None:
        """Made by :meth:`Store.begin`, which has checked ``last_modified``, ``headers`` and ``tenant``."""
        self.store = store
        self.bucket = bucket
        self.key = key
        self.etag = etag
        self.size = size
        self.expected_xxh3 = expected_xxh3
        self.last_modified = last_modified
        self.headers = headers
        self.verifier = verifier
        self.checksums = checksums
        self.tenant = tenant
        self.borrowed = borrowed
        self.digest: str | None = None  # the xxh3-128, once sealed
        self.path = store._tmp_dir / f"{secrets.token_hex(8)}.part"
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        # A second descriptor for aligned writes that skip the page cache (StoreSettings.direct_writes);
        # None where the file system refuses O_DIRECT (tmpfs, some FUSE): every write is buffered.
        self._direct: int | None = None
        self._direct_refused = False
        if store.settings.direct_writes and hasattr(os, "O_DIRECT"):
            with contextlib.suppress(OSError):
                self._direct = os.open(self.path, os.O_WRONLY | os.O_DIRECT)
        self._hasher = xxhash.xxh3_128()
        self._hashed = 0
        self._hash_lock = threading.Lock()
        self._closed = False
        self._reserved = size

    def write_at(self, offset: int, data: bytes | memoryview) -> None:
        self.writev_at(offset, [data])

    def writev_at(self, offset: int, chunks: list[bytes | memoryview], direct: bool = True) -> None:
        """Write ``chunks`` back to back at ``offset`` with one vectored write (no joining copy).

        Bytes that extend the hashed prefix are hashed from memory here; bytes landing beyond it
        (a later part of a parallel fill) are hashed by reading them back once the gap is filled.
        ``direct``: the bytes may skip the page cache (``StoreSettings.direct_writes``); ``False``
        writes them through it. Fills pass nothing: streamed or not, they skip it (see
        ``StoreSettings.direct_writes`` for what buffering a streamed fill cost).
        """
        total = sum(len(chunk) for chunk in chunks)
        if offset < 0 or offset + total > self.size:
            raise IntegrityError(f"write of {total} bytes at {offset} is outside an object of {self.size} bytes")
        views = [memoryview(chunk) for chunk in chunks if len(chunk)]
        position = offset
        try:
            aligned = len(views) == 1 and offset % _DIRECT_ALIGN == 0 and total % _DIRECT_ALIGN == 0
            if direct and aligned and self._direct is not None and not self._direct_refused:
                # Whole aligned blocks (a fill's 1 MiB pieces from an aligned buffer): straight to
                # the disk. The object's last piece, or a buffer that is not aligned, is buffered;
                # Linux keeps the two coherent (a direct write drops the cached pages it covers).
                try:
                    position += os.pwrite(self._direct, views[0], position)
                    views = [views[0][position - offset :]] if position < offset + total else []
                except OSError as exc:
                    if exc.errno != errno.EINVAL:
                        raise
                    # This buffer or device wants another alignment: buffered from now on. Not
                    # closed here: another part's thread may be writing through it right now.
                    self._direct_refused = True
            while views:
                written = os.pwritev(self.fd, views, position)
                position += written
                while views and written >= len(views[0]):
                    written -= len(views[0])
                    views.pop(0)
                if views and written:
                    views[0] = views[0][written:]
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
                raise NoSpace(exc.errno, f"cache file system full while writing {self.key}: {exc.strerror}") from exc
            raise
        with self._hash_lock:
            if offset == self._hashed:
                for chunk in chunks:
                    self._feed(chunk)
                self._hashed += total

    def _feed(self, data: bytes | memoryview) -> None:
        self._hasher.update(data)
        if self.verifier is not None:
            self.verifier.update(data)

    @property
    def hashed(self) -> int:
        """How far the checksums have got (the contiguous prefix they have seen)."""
        return self._hashed

    def hash_upto(self, end: int) -> None:
        """Advance the checksum over ``[hashed, end)``, which the caller knows is written."""
        with self._hash_lock:
            while self._hashed < end:
                chunk = os.pread(self.fd, min(_HASH_CHUNK, end - self._hashed), self._hashed)
                if not chunk:
                    raise IntegrityError(f"temp file shorter than {end} bytes")
                self._feed(chunk)
                self._hashed += len(chunk)

    def seal(self) -> str:
        """Hash what is left and check the bytes: against ``expected_xxh3`` and the verifier.
        Returns the xxh3-128. Raises :class:`IntegrityError` on a mismatch (the caller aborts);
        the temp file is still open and unpublished either way: readers of a fill in progress
        may go on once it is sealed, before the fsync of :meth:`commit`."""
        if self.digest is not None:
            return self.digest
        self.hash_upto(self.size)
        digest = self._hasher.hexdigest()
        if self.expected_xxh3 and digest != self.expected_xxh3.lower():
            self.store._count("integrity_failures")
            raise IntegrityError(
                f"{self.bucket}/{self.key}: xxh3-128 {digest} does not match expected {self.expected_xxh3}"
            )
        if self.verifier is not None and not self.verifier.matches():
            self.store._count("integrity_failures")
            raise IntegrityError(
                f"{self.bucket}/{self.key}: the bytes received have {self.verifier.algorithm} "
                f"{self.verifier.actual()}, not the {self.verifier.algorithm} the origin vouches for"
            )
        self.digest = digest
        return digest

    def place(self) -> Path | None:
        """After :meth:`seal`: give the checked bytes their published file name now, before the
        fsync and the meta file that publish them, so that a reader can be handed the file at once
        (a short-circuit reader waited 40-65 ms per 64 MiB shard for the publish otherwise). The
        file counts as published only once its meta file exists: until then it is an orphan that
        :meth:`abort` removes, and so does start-up after a crash. Not done (``None``) while an
        entry with that id is indexed (a refetch): its file stays until the new one is published."""
        assert self.digest is not None, "place() before seal()"
        ident = entry_id(self.store.settings.namespace, self.bucket, self.key, self.etag)
        with self.store._lock:
            if ident in self.store._entries:
                return None
        data_path = self.store._data_path(ident)
        data_path.parent.mkdir(exist_ok=True)
        os.fchmod(self.fd, 0o444)
        os.replace(self.path, data_path)
        self.path = data_path
        return data_path

    def commit(self) -> Entry:
        """Seal (verify), fsync and publish. On any failure the temp file is removed and nothing is published."""
        try:
            digest = self.seal()
            os.fchmod(self.fd, 0o444)
            try:
                os.fsync(self.fd)
            except OSError as exc:
                if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                    raise NoSpace(exc.errno, f"cache file system full while syncing {self.key}") from exc
                raise
            return self.store._publish(self, digest)
        except BaseException:
            self.abort()
            raise
        finally:
            self._close_fd()

    def abort(self) -> None:
        self._close_fd()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        self.store._release(self)

    def _close_fd(self) -> None:
        if not self._closed:
            self._closed = True
            os.close(self.fd)
            if self._direct is not None:
                os.close(self._direct)


class Store:
    """A byte-capacity-bounded directory of immutable objects. See the module docstring."""

    NO_SPACE_BACKOFF_S = 5.0

    def __init__(self, settings: StoreSettings) -> None:
        self.settings = settings
        self.base = Path(settings.root) / LAYOUT
        self._tmp_dir = self.base / "tmp"
        self._data_dir = self.base / "data"
        self._meta_dir = self.base / "meta"
        view = settings.read_only_view
        self._view_data_dir = Path(view) / LAYOUT / "data" if view is not None else None
        self._data_dev: int | None = None  # st_dev of the data directory, once the view is checked
        self._lock = threading.RLock()
        self._entries: dict[str, Entry] = {}  # the index; recency is the policy's to keep
        self._policy = policy_for(settings.eviction)
        self._by_name: dict[tuple[str, str], str] = {}
        self._verified: dict[str, _Stamp] = {}
        # When each entry's bytes were last hashed in full (monotonic), oldest first, and the
        # entries not hashed since this process loaded them: the scrubber's work list.
        self._hashed_at: OrderedDict[str, float] = OrderedDict()
        self._never_hashed: set[str] = set()
        self._used = 0
        self._unverified = [0, 0]  # entries and bytes with Entry.verified == ""
        self._borrowed_items = 0  # entries with Entry.borrowed
        self._reserved = 0
        self._tenants = TenantQuota(settings.tenant_quota_bytes)
        self._writers: set[Writer] = set()
        self._lock_fd: int | None = None
        self._no_space_until = 0.0
        self._counters = {
            "evictions": 0,
            "evicted_bytes": 0,
            "admitted": 0,
            "rejected_full": 0,
            "integrity_failures": 0,
            "corrupt_removed": 0,
            "no_space": 0,
        }
        # Reported in stats()["tenants"] only, apart from the capacity figures above.
        self._tenant_counters = {"quota_evictions": 0, "quota_evicted_bytes": 0, "rejected_quota": 0}
        self._watchers: list[Watcher] = []
        # The plan (set_plan): its ranks, as last handed to the policy; set_plan's own lock keeps
        # two plans from being diffed against the same old one.
        self._plan_lock = threading.Lock()
        self._plan_ranks: dict[int, int] = {}
        # Names whose fill the plan asked for (spare_kept): their begin evicts no ranked entry.
        self._sparing: set[tuple[str, str]] = set()
        # Names a reader announced it will read (awaited): published, the policy keeps them for it.
        self._awaiting: set[tuple[str, str]] = set()

    # -- life cycle -------------------------------------------------------------------------

    def open(self) -> None:
        """Take the directory lock, discard crash leftovers and rebuild the index from disk."""
        for directory in (self._tmp_dir, self._data_dir, self._meta_dir):
            directory.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.base / "LOCK", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as exc:
            os.close(fd)
            raise CacheLocked(f"cache directory {self.settings.root} is used by another process") from exc
        try:
            self._check_view(fd)
        except BaseException:
            os.close(fd)
            raise
        self._lock_fd = fd
        for leftover in self._tmp_dir.iterdir():
            with contextlib.suppress(FileNotFoundError, IsADirectoryError):
                leftover.unlink()
        self._rebuild_index()

    def _view_hint(self) -> str:
        root, view = self.settings.root, self.settings.read_only_view
        return (f"mount the cache directory {root} a second time, read-only, at {view} (mount --bind {root} {view} "
                f"&& mount -o remount,bind,ro {view}; in Kubernetes a second volumeMount of the cache volume "
                f"with readOnly: true)")

    def _check_view(self, lock_fd: int) -> None:
        """That ``read_only_view`` shows this very directory (the same LOCK file and data
        directory, by device and inode, as a bind mount does) on a read-only mount."""
        view = self.settings.read_only_view
        if view is None or self._view_data_dir is None:
            return
        try:
            seen = [os.stat(self._view_data_dir.parent / "LOCK"), os.stat(self._view_data_dir)]
        except OSError as exc:
            raise ReadOnlyViewError(
                f"the read-only view {view} does not show the cache ({exc.strerror}: {exc.filename}): {self._view_hint()}"
            ) from None
        own = [os.fstat(lock_fd), os.stat(self._data_dir)]
        if any((a.st_dev, a.st_ino) != (b.st_dev, b.st_ino) for a, b in zip(seen, own, strict=True)):
            raise ReadOnlyViewError(
                f"the read-only view {view} is another directory than the cache {self.settings.root} "
                f"(its {LAYOUT}/LOCK or {LAYOUT}/data is another file): {self._view_hint()}"
            )
        if not os.statvfs(self._view_data_dir).f_flag & os.ST_RDONLY:
            raise ReadOnlyViewError(
                f"the read-only view {view} is the cache directory, but mounted read-write: a descriptor opened "
                f"through it could be reopened for writing; {self._view_hint()}"
            )
        self._data_dev = own[1].st_dev
        log.info("cache %s: descriptors for other processes are opened through the read-only view %s",
                 self.settings.root, view)

    def close(self) -> None:
        with self._lock:
            for writer in list(self._writers):
                writer.abort()
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def __enter__(self) -> Store:
        self.open()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _rebuild_index(self) -> None:
        found: list[Entry] = []
        meta_ids: set[str] = set()
        foreign = [0, 0]  # entries and bytes not this origin's (or whose meta file lies about them)
        for meta_path in self._meta_dir.glob("*/*.json"):
            entry = self._read_meta(meta_path)
            if entry is not None and not self._is_own(entry, meta_path):
                # Every lookup trusts that an indexed entry's id is the one this origin gives its
                # bucket, key and ETag (a lookup by name goes by bucket and key alone), so an
                # entry filled from another origin, or a meta file whose fields are not what its
                # id was computed from, is never indexed. Nor kept: an entry that can never be
                # served would hold capacity, items and disk that the limits no longer see (or,
                # indexed only to be evicted, hold them for good under ``hold``, which evicts
                # nothing, and count against a tenant's quota), to save one refetch in the rare
                # case of switching back. Removed as an unreadable meta file is; its data file
                # goes with the orphans below.
                foreign[0] += 1
                foreign[1] += entry.size
                entry = None
            if entry is not None:
                entry = self._with_data(entry, meta_path)
            if entry is None:
                meta_path.unlink(missing_ok=True)
                continue
            meta_ids.add(entry.id)
            found.append(entry)
        if foreign[0]:
            # One line for them all: a directory reused with another origin may hold millions.
            log.warning(
                "cache %s: removed %d entries (%d bytes) filled from another origin than %r, or whose meta file "
                "does not match its id", self.settings.root, foreign[0], foreign[1], self.settings.namespace,
            )
        # Data files with no meta were renamed in just before a crash: never published.
        for data_path in self._data_dir.glob("*/*"):
            if data_path.name not in meta_ids:
                data_path.unlink(missing_ok=True)
        found.sort(key=lambda e: e.last_access)  # indexed (and told to the policy) oldest first
        with self._lock:
            for entry in found:
                self._entries[entry.id] = entry
                self._index_name(entry)
                self._account(entry, 1)
                self._never_hashed.add(entry.id)
        log.info("cache %s: %d entries, %d bytes", self.settings.root, len(found), self._used)

    def _read_meta(self, meta_path: Path) -> Entry | None:
        """The entry a meta file describes, or ``None`` if it cannot be read as one."""
        try:
            meta = json.loads(meta_path.read_bytes())
            entry = Entry(
                id=str(meta["id"]), bucket=str(meta["bucket"]), key=str(meta["key"]), etag=str(meta["etag"]),
                size=int(meta["size"]), xxh3_128=str(meta["xxh3_128"]), created=float(meta["created"]),
                # Both absent in entries written by older daemons (see Entry).
                last_modified=_checked_text(meta.get("last_modified")),
                headers=_checked_headers(meta.get("headers", [])),
                verified=_checked_text(meta.get("verified")) or "",
                checksums=_checked_headers(meta.get("checksums", [])),
                tenant=_checked_tenant(meta.get("tenant")),  # absent before tenants: nobody's
                borrowed=meta.get("borrowed") is True,  # absent before clusters: owned
            )
        except (OSError, ValueError, KeyError, TypeError):
            log.warning("discarding unreadable cache meta %s", meta_path)
            return None
        return entry

    def _is_own(self, entry: Entry, meta_path: Path) -> bool:
        """Whether a meta file describes an entry of this store: its id is the one this origin
        (``settings.namespace``) gives the bucket, key and ETag it names, and the file lies where
        that id's meta file lies (one entry, one meta file)."""
        ident = entry_id(self.settings.namespace, entry.bucket, entry.key, entry.etag)
        return entry.id == ident and meta_path == self._meta_path(ident)

    def _with_data(self, entry: Entry, meta_path: Path) -> Entry | None:
        """``entry`` with its recency, if its data file is in place and of its size."""
        try:
            stat = os.stat(self._data_path(entry.id))
        except FileNotFoundError:
            return None
        if stat.st_size != entry.size:
            log.warning("discarding cache entry %s: size %d != %d", entry.id, stat.st_size, entry.size)
            self._data_path(entry.id).unlink(missing_ok=True)
            return None
        # The meta file's mtime is refreshed on access, so it carries the LRU order across restarts.
        entry.last_access = meta_path.stat().st_mtime
        return entry

    # -- paths ------------------------------------------------------------------------------

    def _data_path(self, ident: str) -> Path:
        return self._data_dir / ident[:2] / ident

    def _meta_path(self, ident: str) -> Path:
        return self._meta_dir / ident[:2] / f"{ident}.json"

    def data_path(self, entry: Entry) -> Path:
        return self._data_path(entry.id)

    def _index_name(self, entry: Entry) -> None:
        name = (entry.bucket, entry.key)
        current = self._by_name.get(name)
        if current is None or self._entries[current].created <= entry.created:
            self._by_name[name] = entry.id

    # -- lookups ----------------------------------------------------------------------------

    def lookup(self, bucket: str, key: str, etag: str | None = None, xxh3_128: str | None = None) -> Entry | None:
        """The newest cached version of ``bucket/key``, or the one with ``etag``; ``None`` if absent
        or if ``xxh3_128`` is given and the cached bytes are another version.

        Only this origin's entries can be found, by name too: every indexed entry's id is
        ``entry_id(settings.namespace, ...)`` of its own fields (:meth:`_publish` computes it,
        :meth:`_rebuild_index` loads nothing else)."""
        with self._lock:
            if etag is not None:
                entry = self._entries.get(entry_id(self.settings.namespace, bucket, key, etag))
            else:
                ident = self._by_name.get((bucket, key))
                entry = self._entries.get(ident) if ident else None
            if entry is None:
                return None
            if xxh3_128 and entry.xxh3_128 != xxh3_128.lower():
                return None
            return entry

    def entries(self) -> list[Entry]:
        """Every indexed entry, in no particular order (recency is the policy's)."""
        with self._lock:
            return list(self._entries.values())

    @contextlib.contextmanager
    def pinned(self, entry: Entry) -> Iterator[Entry]:
        """Keep ``entry`` from eviction while in use (its disk space stays accounted for)."""
        with self._lock:
            entry.pins += 1
        try:
            yield entry
        finally:
            with self._lock:
                entry.pins -= 1

    def open_verified(
        self, entry: Entry, force: bool = False, *, for_others: bool = False
    ) -> tuple[int, os.stat_result]:
        """Open a published entry for reading, re-hashing it first if it is not known good (or
        with ``force``, whatever its stamp says).

        ``for_others``: the descriptor goes to another process (a pod): opened through
        ``read_only_view`` when there is one, so that it cannot be reopened for writing (see the
        module docstring). Same checks and stamp either way: a bind mount shows the same inode.

        Returns ``(fd, stat)``; the caller closes the fd. Raises :class:`CorruptEntry` (and removes
        the entry) when the bytes no longer match, :class:`EntryNotFound` if it vanished,
        :class:`ReadOnlyViewError` if the view stopped being the cache on a read-only mount.
        """
        view = for_others and self._view_data_dir is not None
        path = self._view_data_path(entry.id) if view else self._data_path(entry.id)
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError as exc:
            if view and self._data_path(entry.id).exists():
                # The view lost sight of the cache (unmounted): the entry itself is fine.
                raise ReadOnlyViewError(
                    f"the read-only view {self.settings.read_only_view} no longer shows {entry.bucket}/{entry.key}: "
                    f"{self._view_hint()}"
                ) from exc
            self.remove(entry)
            raise EntryNotFound(f"{entry.bucket}/{entry.key} is no longer cached") from exc
        try:
            stat = os.fstat(fd)
            if view:
                self._check_view_fd(fd, stat, entry)
            stamp = _Stamp(stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns)
            if force or self._verified.get(entry.id) != stamp:
                digest = None
                if stat.st_size == entry.size:
                    with contextlib.suppress(IntegrityError):
                        digest = hash_file(fd, entry.size)
                if digest != entry.xxh3_128:
                    self._count("corrupt_removed")
                    log.error("cache entry %s/%s (%s) is corrupt; removing it", entry.bucket, entry.key, entry.id)
                    self.remove(entry)
                    raise CorruptEntry(f"cached copy of {entry.bucket}/{entry.key} is corrupt and was removed")
                self._mark_hashed(entry.id, stamp)
            self.touch(entry)
            return fd, stat
        except BaseException:
            os.close(fd)
            raise

    def _view_data_path(self, ident: str) -> Path:
        assert self._view_data_dir is not None
        return self._view_data_dir / ident[:2] / ident

    def _check_view_fd(self, fd: int, stat: os.stat_result, entry: Entry) -> None:
        """A descriptor opened through the view is on the cache's file system and a read-only
        mount, as :meth:`open` found the view (two syscalls' worth; the view could have been
        remounted since)."""
        if stat.st_dev != self._data_dev or not os.fstatvfs(fd).f_flag & os.ST_RDONLY:
            raise ReadOnlyViewError(
                f"the read-only view {self.settings.read_only_view} is no longer the cache on a read-only mount "
                f"(opening {entry.bucket}/{entry.key}): {self._view_hint()}"
            )

    def _mark_hashed(self, ident: str, stamp: _Stamp) -> None:
        with self._lock:
            if ident not in self._entries:
                return
            self._verified[ident] = stamp
            self._never_hashed.discard(ident)
            self._hashed_at[ident] = time.monotonic()
            self._hashed_at.move_to_end(ident)

    def scrub_one(self, min_age_s: float) -> int:
        """Re-hash the entry whose bytes were hashed longest ago (first those not hashed since
        start-up), if that was more than ``min_age_s`` ago; removes it if it no longer matches.
        Catches what the stamp check cannot: bytes that changed on the disk with no write (bit
        rot, a fault below the file system). Returns the bytes hashed (0: nothing due)."""
        with self._lock:
            ident = next(iter(self._never_hashed), None)
            if ident is None and self._hashed_at:
                oldest, at = next(iter(self._hashed_at.items()))
                if time.monotonic() - at >= min_age_s:
                    ident = oldest
            entry = self._entries.get(ident) if ident is not None else None
            if entry is None:
                if ident is not None:
                    self._never_hashed.discard(ident)
                    self._hashed_at.pop(ident, None)
                return 0
        with self.pinned(entry), contextlib.suppress(CorruptEntry, EntryNotFound):  # removed if bad
            fd, _ = self.open_verified(entry, force=True)
            os.close(fd)
        return entry.size

    def touch_in_memory(self, entry: Entry) -> None:
        """Refresh LRU recency without touching the disk (the on-disk recency is refreshed by
        the next :meth:`touch`)."""
        with self._lock:
            current = self._entries.get(entry.id)
            if current is not None:
                self._policy.on_touch(current)
                self._tenants.on_touch(current)

    def touch(self, entry: Entry) -> None:
        now = time.time()
        self.touch_in_memory(entry)
        with self._lock:
            # Persist recency coarsely (it orders LRU after a restart) without a write per read.
            persist = now - entry.last_access > 30
            entry.last_access = now
        if persist:
            with contextlib.suppress(OSError):
                os.utime(self._meta_path(entry.id), (now, now))

    # -- watchers and the plan ----------------------------------------------------------------

    def watch(self, watcher: Watcher, existing: bool = True) -> Callable[[], None]:
        """Tell ``watcher`` of every entry indexed and every entry that leaves the index from now
        on, first of every entry indexed now (as added; not with ``existing`` false, for a watcher
        that cares only about changes: no O(entries) call), all under the store's lock: it sees
        each change once, in order. It must be quick (O(1) per entry) and must not call the store.
        Returns what stops it."""
        with self._lock:
            self._watchers.append(watcher)
            if existing:
                self._tell(watcher, list(self._entries.values()), ())

        def unwatch() -> None:
            with self._lock:
                with contextlib.suppress(ValueError):
                    self._watchers.remove(watcher)

        return unwatch

    @staticmethod
    def _tell(watcher: Watcher, added: Sequence[Entry], removed: Sequence[Entry]) -> None:
        try:
            watcher(added, removed)
        except Exception:  # a watcher's bug must not fail a fill or an eviction
            log.exception("cache watcher %r failed", watcher)

    def set_plan(self, keep: Iterable[int], name_hash: NameHash) -> dict[str, int]:
        """A lease master's plan: ``keep`` names the objects its trainers will read, soonest needed
        first (``name_hash(bucket, key)`` names them; the first place of a name counts). The
        ``planned`` policy evicts by it; the others ignore it. Costs O(len(keep)) off the store's
        lock and O(the names that came into or left the plan) under it (the first plan: one pass
        over the index too). Pass the same ``name_hash`` every time. Returns the policy's figures."""
        order = array("Q", keep)
        ranks = dict(zip(order, range(len(order)), strict=True))  # in rank order: ``left`` below is too
        if len(ranks) != len(order):  # a name twice: the order without its later places
            first: dict[int, int] = {}
            for rank, name in enumerate(order):
                first.setdefault(name, rank)
            order = array("Q", first)
            ranks = dict(zip(order, range(len(order)), strict=True))
        with self._plan_lock:
            old = self._plan_ranks
            entered = [name for name in ranks if name not in old]
            left = [name for name in old if name not in ranks]
            with self._lock:
                self._policy.plan(order, ranks, entered, left, name_hash)
                figures = self._policy.describe()
            self._plan_ranks = ranks
        return figures

    def plan_figures(self) -> dict[str, int]:
        """The policy's figures of the plan it holds now (what :meth:`set_plan` returns)."""
        with self._lock:
            return self._policy.describe()

    @contextlib.contextmanager
    def spare_kept(self, bucket: str, key: str) -> Iterator[None]:
        """While in the block, a fill of ``bucket/key`` begun (:meth:`begin`) is the plan's own (a
        plan prefetch): it evicts no entry the plan ranks, and is not admitted if the rest cannot
        make room (:meth:`cache.eviction.EvictionPolicy.spare`)."""
        with self._named(self._sparing, bucket, key):
            yield

    @contextlib.contextmanager
    def awaited(self, bucket: str, key: str) -> Iterator[None]:
        """While in the block, an entry of ``bucket/key`` published is one a reader announced it
        will read (a prefetch hint, or the plan's prefetch) and has not read yet: the policy is told
        (:meth:`cache.eviction.EvictionPolicy.on_awaited`; ``planned`` keeps it until it is read)."""
        with self._named(self._awaiting, bucket, key):
            yield

    @contextlib.contextmanager
    def _named(self, names: set[tuple[str, str]], bucket: str, key: str) -> Iterator[None]:
        """``bucket/key`` in ``names`` (one of the store's sets of names) while in the block."""
        with self._lock:
            names.add((bucket, key))
        try:
            yield
        finally:
            with self._lock:
                names.discard((bucket, key))

    def unspare(self, bucket: str, key: str) -> None:
        """A reader waits for ``bucket/key`` now: a fill of it not begun yet may evict as a demand
        read's does (ends :meth:`spare_kept` for it), and its entry, read as it lands, is awaited
        by nobody (ends :meth:`awaited`)."""
        with self._lock:
            self._sparing.discard((bucket, key))
            self._awaiting.discard((bucket, key))

    def plan_room(self, size: int) -> bool:
        """Whether a fill the plan asks for, of about ``size`` bytes, could be admitted now: free
        room, counting what such a fill may evict as free (all of it under ``lru``, nothing under
        ``hold``, what the plan does not rank under ``planned``). An estimate (pinned entries
        count as free): :meth:`begin` decides."""
        with self._lock:
            spare_bytes, spare_items = self._policy.spare()
            return (size <= self.settings.capacity_bytes and time.monotonic() >= self._no_space_until
                    and self._fits(size, spare_bytes, spare_items))

    def usage(self) -> tuple[int, int, int]:
        """``(capacity_bytes, used_bytes, items)``, without asking the file system (:meth:`stats` does)."""
        with self._lock:
            return self.settings.capacity_bytes, self._used, len(self._entries)

    # -- admission and eviction -------------------------------------------------------------

    def _disk_free_after(self, extra: int) -> bool:
        if self.settings.min_free_ratio <= 0:
            return True
        st = os.statvfs(self.base)
        total = st.f_blocks * st.f_frsize
        free = st.f_bavail * st.f_frsize
        # Bytes reserved for fills in progress are not on disk yet but will be.
        return free - self._reserved - extra >= self.settings.min_free_ratio * total

    def _fits(self, size: int, freed_bytes: int = 0, freed_items: int = 0) -> bool:
        """Whether ``size`` more bytes fit now, or once entries of ``freed_bytes`` and
        ``freed_items`` are gone (an estimate on disk: an open reader keeps its file's blocks)."""
        return (
            self._used - freed_bytes + self._reserved + size <= self.settings.capacity_bytes
            and len(self._entries) - freed_items + len(self._writers) + 1 <= self.settings.max_items
            and self._disk_free_after(size - freed_bytes)
        )

    def has_room(self, size: int, tenant: str = "") -> bool:
        """Whether an entry of ``size`` bytes fits now without evicting anything: free capacity
        (entries plus the room fills in progress have reserved), items, the file system's free
        share, and ``tenant``'s quota. Reserves nothing: :meth:`begin` with ``evict=False`` checks
        again (a fill that started meanwhile may have taken the room)."""
        with self._lock:
            return self._free_for(size, tenant)

    def _free_for(self, size: int, tenant: str) -> bool:
        """:meth:`has_room`; the caller holds the lock."""
        return (
            size <= self.settings.capacity_bytes
            and time.monotonic() >= self._no_space_until
            and self._tenants.victims(tenant, size) == []
            and self._fits(size)
        )

    def begin(
        self, bucket: str, key: str, etag: str, size: int, expected_xxh3: str | None = None,
        last_modified: str | None = None, headers: Sequence[tuple[str, str]] = (),
        verifier: Verifier | None = None, checksums: Sequence[tuple[str, str]] = (), tenant: str = "",
        borrowed: bool = False, evict: bool = True,
    ) -> Writer | None:
        """Reserve room for a new entry and start filling it, or ``None`` if the policy does not
        admit it now (no room under ``hold``, everything evictable is in use, or ``tenant``'s
        quota cannot make room). ``last_modified`` and ``headers`` are kept with the entry as given
        (raises ``ValueError`` if they could not be answered again as headers), and so are
        ``checksums`` (the origin's checksum headers); ``verifier`` checks the bytes at
        :meth:`Writer.seal`. ``tenant`` is whose request causes the fill ("" for nobody): past
        its quota, its own least recently used entries go first, under either eviction policy.
        ``borrowed``: a copy of an object another daemon of the cluster owns (evicted first; under
        ``planned`` it evicts no entry the plan ranks).
        ``evict=False``: admitted only into free room (:meth:`has_room`), never by evicting an
        entry, the tenant's own included (a fill nobody waits for: a ranged read's, behind it).
        A fill of a name in :meth:`spare_kept` evicts no entry the plan ranks."""
        headers = _checked_headers([list(pair) for pair in headers])
        checksums = _checked_headers([list(pair) for pair in checksums])
        _checked_text(last_modified)
        tenant = _checked_tenant(tenant)
        with self._lock:
            if not evict and not self._free_for(size, tenant):
                self._counters["rejected_full"] += 1
                return None
            if size > self.settings.capacity_bytes or time.monotonic() < self._no_space_until:
                self._counters["rejected_full"] += 1
                return None
            victims = self._tenants.victims(tenant, size)
            if victims is None:
                self._tenant_counters["rejected_quota"] += 1
                return None
            if (victims and not self._policy.evicts_for_room
                    and not self._fits(size, sum(entry.size for entry in victims), len(victims))):
                # Under hold nothing else makes room: evicting the tenant's entries would lose
                # them and still cache nothing.
                self._counters["rejected_full"] += 1
                return None
            # The plan's own fill, or under ``planned`` a copy of another daemon's object (a peer
            # read's): neither evicts what the plan keeps. A borrowed copy that took a kept
            # entry's place cost that entry's next read a fetch from the origin, for a copy its
            # owner keeps anyway: in the capacity bed, peer reads were 0.12-0.14 of the dataset an
            # epoch. (Under ``lru`` and ``hold`` nothing is ranked: borrowed fills evict as before.)
            sparing = (bucket, key) in self._sparing or (borrowed and self._policy.ranks)
            if sparing and not self._fits(size, *self._policy.spare()):
                # What the plan keeps is not its to evict, and the rest cannot make room.
                # Nothing evicted in vain: the read is served uncached.
                self._counters["rejected_full"] += 1
                return None
            for entry in victims:
                self._tenant_counters["quota_evictions"] += 1
                self._tenant_counters["quota_evicted_bytes"] += entry.size
                self._remove_locked(entry)
            while not self._fits(size):
                victim = self._policy.victim(sparing)
                if victim is None:
                    self._counters["rejected_full"] += 1
                    return None
                self._counters["evictions"] += 1
                self._counters["evicted_bytes"] += victim.size
                self._remove_locked(victim)
            try:
                writer = Writer(
                    self, bucket, key, etag, size, expected_xxh3, last_modified, headers, verifier, checksums, tenant,
                    borrowed,
                )
            except OSError as exc:
                if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                    self._counters["no_space"] += 1
                    self._no_space_until = time.monotonic() + self.NO_SPACE_BACKOFF_S
                    return None
                raise
            self._reserved += size
            self._tenants.reserve(tenant, size)
            self._writers.add(writer)
            return writer

    def _account(self, entry: Entry, sign: int) -> None:
        """Add (1) or take away (-1) an indexed entry's bytes; the caller holds the lock."""
        self._used += sign * entry.size
        if sign > 0:
            self._policy.on_add(entry)
            self._tenants.on_add(entry)
        else:
            self._policy.on_remove(entry)
            self._tenants.on_remove(entry)
        if entry.borrowed:
            self._borrowed_items += sign
        if not entry.verified:
            self._unverified[0] += sign
            self._unverified[1] += sign * entry.size
        for watcher in self._watchers:
            self._tell(watcher, (entry,) if sign > 0 else (), (entry,) if sign < 0 else ())

    def _release(self, writer: Writer) -> None:
        with self._lock:
            if writer in self._writers:
                self._writers.discard(writer)
                self._reserved -= writer._reserved
                self._tenants.reserve(writer.tenant, -writer._reserved)

    def _publish(self, writer: Writer, digest: str) -> Entry:
        ident = entry_id(self.settings.namespace, writer.bucket, writer.key, writer.etag)
        now = time.time()
        entry = Entry(
            id=ident, bucket=writer.bucket, key=writer.key, etag=writer.etag, size=writer.size,
            xxh3_128=digest, created=now, last_access=now, last_modified=writer.last_modified, headers=writer.headers,
            verified=writer.verifier.algorithm if writer.verifier is not None else "", checksums=writer.checksums,
            tenant=writer.tenant, borrowed=writer.borrowed,
        )
        data_path = self._data_path(ident)
        meta_path = self._meta_path(ident)
        data_path.parent.mkdir(exist_ok=True)
        meta_path.parent.mkdir(exist_ok=True)
        stat = os.fstat(writer.fd)
        # Rename the data in (unless Writer.place did), then publish by atomically writing the meta file.
        if writer.path != data_path:
            os.replace(writer.path, data_path)
        meta_tmp = self._tmp_dir / f"{secrets.token_hex(8)}.meta"
        try:
            with open(meta_tmp, "wb") as handle:
                handle.write(json.dumps(entry.meta()).encode())
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(meta_tmp, meta_path)
            _fsync_dir(data_path.parent)
            _fsync_dir(meta_path.parent)
        except OSError as exc:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(meta_tmp)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(data_path)
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise NoSpace(exc.errno, f"cache file system full while publishing {writer.key}") from exc
            raise
        with self._lock:
            self._writers.discard(writer)
            self._reserved -= writer._reserved
            self._tenants.reserve(writer.tenant, -writer._reserved)
            previous = self._entries.pop(ident, None)
            if previous is not None:
                self._account(previous, -1)
            self._entries[ident] = entry
            self._index_name(entry)
            self._account(entry, 1)
            if (writer.bucket, writer.key) in self._awaiting:
                self._policy.on_awaited(entry)
            self._counters["admitted"] += 1
        # Hashed while it was written: as good as a check now.
        self._mark_hashed(ident, _Stamp(stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns))
        return entry

    def remove(self, entry: Entry) -> None:
        with self._lock:
            self._remove_locked(entry)

    def _remove_locked(self, entry: Entry) -> None:
        current = self._entries.pop(entry.id, None)
        if current is None:
            return
        self._account(current, -1)
        self._verified.pop(entry.id, None)
        self._hashed_at.pop(entry.id, None)
        self._never_hashed.discard(entry.id)
        if self._by_name.get((entry.bucket, entry.key)) == entry.id:
            del self._by_name[(entry.bucket, entry.key)]
        # Unpublish (meta) first: a crash after this leaves an orphan data file, deleted at start-up.
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._meta_path(entry.id))
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._data_path(entry.id))

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counters[name] += n

    def note_no_space(self) -> None:
        """The file system refused a write: admit nothing for a while (serve uncached) rather than
        start fills that will fail the same way."""
        with self._lock:
            self._counters["no_space"] += 1
            self._no_space_until = time.monotonic() + self.NO_SPACE_BACKOFF_S

    # -- reporting --------------------------------------------------------------------------

    def tenant_usage(self, tenant: str) -> dict[str, object]:
        """What ``tenant`` has brought into the cache, for that tenant's own eyes (its name is in
        it). ``quota_bytes`` is ``None`` without a quota, and for tenant "" (never subject to one)."""
        with self._lock:
            return {
                "tenant": tenant,
                "used_bytes": self._tenants.used(tenant),
                "reserved_bytes": self._tenants.reserved(tenant),
                "items": self._tenants.items(tenant),
                "quota_bytes": self._tenants.quota if tenant else None,
            }

    def _tenant_stats(self) -> dict[str, object]:
        """The tenants block of :meth:`stats`: figures only, never a name (every tenant reads
        /stats); the caller holds the lock."""
        return {
            "quota_bytes": self._tenants.quota,
            "count": self._tenants.count,
            "over_quota": self._tenants.over(),
            **self._tenant_counters,
        }

    def stats(self) -> dict[str, object]:
        try:
            usage = shutil.disk_usage(self.base)
            fs_total, fs_free = usage.total, usage.free
        except OSError:  # the directory vanished under us: report what the index knows
            fs_total = fs_free = 0
        with self._lock:
            return {
                "root": str(self.settings.root),
                "eviction": self.settings.eviction,
                "capacity_bytes": self.settings.capacity_bytes,
                "used_bytes": self._used,
                "reserved_bytes": self._reserved,
                "items": len(self._entries),
                "borrowed_items": self._borrowed_items,
                # Entries the origin vouched for in no checkable way (see Entry.verified).
                "unverified_items": self._unverified[0],
                "unverified_bytes": self._unverified[1],
                "max_items": self.settings.max_items,
                "filling": len(self._writers),
                "fs_total_bytes": fs_total,
                "fs_free_bytes": fs_free,
                "min_free_ratio": self.settings.min_free_ratio,
                **self._counters,
                "tenants": self._tenant_stats(),
                "policy": self._policy.describe(),
            }


def _checked_text(value: object) -> str | None:
    """A header value fit to be sent again: text without line breaks or other control characters
    (a tampered meta file must not inject headers into answers)."""
    if value is None:
        return None
    if not isinstance(value, str) or any(ord(c) < 0x20 and c != "\t" or ord(c) == 0x7F for c in value):
        raise ValueError(f"not a header value: {value!r}")
    return value


def _checked_tenant(value: object) -> str:
    """A tenant name as a meta file or a caller may give it: bounded text with no control
    characters ("" when absent), or ``ValueError``."""
    if value is None:
        return ""
    if not isinstance(value, str) or len(value) > _MAX_TENANT_CHARS:
        raise ValueError(f"a tenant is text of at most {_MAX_TENANT_CHARS} characters, not {str(value)[:80]!r}")
    try:
        return _checked_text(value) or ""
    except ValueError:
        raise ValueError(f"a tenant holds no control characters: {value[:80]!r}") from None


def _checked_headers(value: object) -> tuple[tuple[str, str], ...]:
    """``[[name, value], ...]`` (as JSON holds them) as pairs, or ``ValueError``."""
    if not isinstance(value, list):
        raise ValueError("headers must be a list of [name, value] pairs")
    pairs: list[tuple[str, str]] = []
    total = 0
    for pair in value:
        if not isinstance(pair, list) or len(pair) != 2:
            raise ValueError(f"not a [name, value] pair: {pair!r}")
        name, text = _checked_text(pair[0]), _checked_text(pair[1])
        if not name or text is None or any(c in name for c in " \t:"):
            raise ValueError(f"not a header: {pair!r}")
        total += len(name) + len(text)
        if total > _MAX_HEADER_BYTES:
            raise ValueError(f"more than {_MAX_HEADER_BYTES} bytes of headers")
        pairs.append((name, text))
    return tuple(pairs)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
