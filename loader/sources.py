"""Byte sources behind one interface: a local directory (``file://``), S3 directly (boto3), or
the cache daemon over HTTP (with short-circuit reads of its cache files: by descriptor over the
pod's handle socket, or by path where the cache directory is mounted).

A source opens a shard as a plain reader (``read(n)``, ``close()``) that the tar parser streams
from; broken connections are resumed at the byte reached (HTTP ``Range``), so a flaky network
costs a reconnect rather than a failed shard. Sources hold sockets and boto3 clients, so each
process makes its own (see ``ShardLoader``).
"""

from __future__ import annotations

import contextlib
import http.client
import logging
import os
import stat
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

from loader.daemon import RETRYABLE_HTTP, DaemonClient, DaemonObject, ListedObject
from loader.dataset import MANIFEST_NAME, MAX_MANIFEST_BYTES, DatasetURL, Shard, check_key, parse_manifest
from loader.errors import (
    AccessDenied,
    ConfigError,
    DatasetNotFound,
    LoaderError,
    ShardNotFound,
    SourceError,
)
from loader.handles import HandleClient
from loader.hints import HintSender
from loader.settings import LoaderSettings
from wire.names import split_origin_path
from wire.s3errors import S3ErrorKind, from_client_error

__all__ = ["Source", "Reader", "FileSource", "S3Source", "DaemonSource", "make_source", "resolve_shards"]

log = logging.getLogger(__name__)


class Reader(Protocol):
    def read(self, n: int = -1, /) -> bytes: ...

    def close(self) -> None: ...


class Source(Protocol):
    # Whether the last open() was answered from bytes already in place (a cache hit, a local
    # file): the next shard is then opened ahead of the loop (loader.ahead); see ShardLoader.
    last_open_in_place: bool

    location: DatasetURL
    via: str  # "file", "s3" or the daemon's endpoint; shown in errors and logs

    def open(
        self, shard: Shard, recheck: bool = False, on_sent: Callable[[], None] | None = None, offset: int = 0,
        by_sample: bool = False,
    ) -> Reader:
        """The shard's bytes. ``recheck``: the last read of this shard did not match its checksum;
        a cache in between re-hashes its copy first (the others read again as they would).
        ``on_sent``: a source may call it once its request is on its way, before the answer.
        ``offset``: the bytes from there on (a shard resumed at a sample, by its member index): a
        stream starts there (a ranged request); a local file is answered positioned there (its
        reader maps it, and reads nothing before the offset). ``by_sample``: the caller checks
        each sample by the shard's member index (a cache in between may then answer a shard it
        is still filling with the bytes as they land)."""
        ...

    def read_manifest(self, name: str = MANIFEST_NAME) -> bytes | None:
        """The dataset's manifest (or another index at the prefix: ``name``); None when absent."""
        ...

    def read_range(self, shard: Shard, start: int, end: int) -> tuple[bytes, bool]:
        """Bytes ``[start, end)`` of the shard (one sample's, by its member index), and whether the
        whole shard is in place where this source reads it (a cache hit, a local file): opening
        it whole is then cheap. The caller checks the bytes (a range has no manifest checksum)."""
        ...

    def list_objects(self) -> Iterator[ListedObject]: ...

    def prefetch(self, shards: Sequence[Shard]) -> None: ...

    def close(self) -> None: ...


def make_source(location: DatasetURL, settings: LoaderSettings, job: str | None = None) -> Source:
    """``job``: the reader's job, named to a cache endpoint on every request (its per-job figures)."""
    if settings.endpoint:
        return DaemonSource(location, settings.endpoint, settings, job=job)
    if location.scheme == "s3":
        return S3Source(location, settings)
    return FileSource(location, settings)


def resolve_shards(source: Source) -> list[Shard]:
    """The dataset's shards: from ``manifest.json`` at the prefix, else a listing of ``*.tar``."""
    data = source.read_manifest()
    if data is not None:
        return parse_manifest(data, f"{source.location.url}{MANIFEST_NAME}")
    listed = sorted((obj for obj in source.list_objects() if obj.key.endswith(".tar")), key=lambda o: o.key)
    if not listed:
        raise DatasetNotFound(
            f"{source.location.url}: no {MANIFEST_NAME} and no *.tar shards under this prefix "
            "(check the URL, or build a manifest with `shardcache index`)"
        )
    return [
        Shard(i, check_key(obj.key, source.location.url), obj.size, None, None, obj.etag)
        for i, obj in enumerate(listed)
    ]


class _Resuming:
    """A reader that reopens its object at the byte reached when the connection breaks."""

    def __init__(
        self,
        open_at: Callable[[int], tuple[Reader, str | None]],
        what: str,
        settings: LoaderSettings,
        retryable: tuple[type[BaseException], ...],
        offset: int = 0,
    ) -> None:
        self._open_at = open_at
        self._what = what
        self._settings = settings
        self._retryable = retryable
        self._raw: Reader | None
        self._raw, self._etag = open_at(offset)
        self.position = offset  # the object's byte this reader reads next

    def read(self, n: int = -1, /) -> bytes:
        backoff = self._settings.backoff
        last: BaseException | None = None
        for attempt in range(self._settings.io_attempts):
            if attempt:
                time.sleep(backoff.delay(attempt))
            if self._raw is None:
                try:
                    self._raw, etag = self._open_at(self.position)
                except SourceError as exc:
                    last = exc
                    continue
                if self._etag and etag and etag != self._etag:
                    raise SourceError(
                        f"{self._what}: the object changed while it was read (ETag {self._etag} -> {etag})"
                    )
            try:
                data = self._raw.read(n)
            except LoaderError:
                raise
            except self._retryable as exc:
                last = exc
                log.info("%s: connection broke at byte %d (%s); resuming", self._what, self.position, exc)
                with contextlib.suppress(Exception):
                    self._raw.close()
                self._raw = None
                continue
            self.position += len(data)
            return data
        raise SourceError(f"{self._what}: reading failed after {self._settings.io_attempts} attempts: {last}") from last

    def close(self) -> None:
        if self._raw is not None:
            with contextlib.suppress(Exception):
                self._raw.close()
            self._raw = None


# -- local directory ----------------------------------------------------------------------------


class FileSource:
    """``file:///root/bucket/prefix/`` read straight from the local file system."""

    via = "file"
    last_open_in_place = True  # a local file

    def __init__(self, location: DatasetURL, settings: LoaderSettings) -> None:
        self.location = location
        self._base = location.path

    def _path(self, key: str) -> str:
        return os.path.join(self._base, *check_key(key, self.location.url).split("/"))

    def open(
        self, shard: Shard, recheck: bool = False, on_sent: Callable[[], None] | None = None, offset: int = 0,
        by_sample: bool = False,
    ) -> Reader:
        path = self._path(shard.key)
        try:
            handle = open(path, "rb", buffering=0)
        except FileNotFoundError as exc:
            raise ShardNotFound(f"{self.location.url}{shard.key}: no such file") from exc
        except PermissionError as exc:
            raise AccessDenied(f"{self.location.url}{shard.key}: permission denied") from exc
        except OSError as exc:
            raise SourceError(f"{self.location.url}{shard.key}: {exc.strerror or exc}") from exc
        if offset:
            handle.seek(offset)
        return handle

    def read_manifest(self, name: str = MANIFEST_NAME) -> bytes | None:
        path = self._path(name)
        try:
            with open(path, "rb") as handle:
                return handle.read(MAX_MANIFEST_BYTES + 1)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise SourceError(f"{self.location.url}{name}: {exc.strerror or exc}") from exc

    def read_range(self, shard: Shard, start: int, end: int) -> tuple[bytes, bool]:
        with self.open(shard) as handle:  # type: ignore[attr-defined]
            return os.pread(handle.fileno(), end - start, start), True

    def list_objects(self) -> Iterator[ListedObject]:
        if not os.path.isdir(self._base):
            raise DatasetNotFound(f"{self.location.url}: no such directory")
        for root, dirs, files in os.walk(self._base, onerror=None):
            dirs.sort()
            rel_root = os.path.relpath(root, self._base)
            for name in sorted(files):
                rel = name if rel_root == "." else f"{rel_root.replace(os.sep, '/')}/{name}"
                try:
                    size = os.stat(os.path.join(root, name)).st_size
                except OSError:
                    continue  # vanished while listing
                yield ListedObject(rel, size, None)

    def prefetch(self, shards: Sequence[Shard]) -> None:
        return None

    def close(self) -> None:
        return None


# -- S3 directly --------------------------------------------------------------------------------

# What S3's error answers become for the trainer; every other kind is a SourceError.
_S3_ERRORS: dict[S3ErrorKind, type[LoaderError]] = {
    S3ErrorKind.NOT_FOUND_KEY: ShardNotFound,
    S3ErrorKind.NOT_FOUND_BUCKET: DatasetNotFound,
    S3ErrorKind.ACCESS_DENIED: AccessDenied,
}


class S3Source:
    """``s3://bucket/prefix/`` through boto3: the standard credential chain, ``AWS_ENDPOINT_URL``."""

    via = "s3"
    last_open_in_place = False  # a stream from the store

    def __init__(self, location: DatasetURL, settings: LoaderSettings) -> None:
        import boto3
        import botocore.exceptions
        from botocore.config import Config
        from urllib3.exceptions import HTTPError as Urllib3Error

        self.location = location
        self._settings = settings
        config = Config(
            retries={"max_attempts": settings.io_attempts, "mode": "standard"},
            connect_timeout=min(settings.io_timeout_s, 10.0),
            read_timeout=settings.io_timeout_s,
        )
        self._client: Any = boto3.session.Session().client("s3", config=config)
        self._client_error = botocore.exceptions.ClientError
        self._retryable: tuple[type[BaseException], ...] = (
            *RETRYABLE_HTTP,
            botocore.exceptions.BotoCoreError,
            Urllib3Error,
        )

    @contextlib.contextmanager
    def _errors(self, what: str) -> Iterator[None]:
        try:
            yield
        except self._client_error as exc:
            answer = from_client_error(exc)
            message = f"{what}: {answer.code} ({answer.message or exc})"
            raise _S3_ERRORS.get(answer.kind, SourceError)(message) from exc
        except LoaderError:
            raise
        except self._retryable as exc:
            raise SourceError(f"{what}: {exc.__class__.__name__}: {exc}") from exc

    def _get(self, key: str, offset: int = 0, etag: str | None = None) -> tuple[Reader, str | None]:
        args: dict[str, Any] = {"Bucket": self.location.bucket, "Key": self.location.prefix + key}
        if offset:
            args["Range"] = f"bytes={offset}-"
        if etag:
            args["IfMatch"] = f'"{etag}"'
        with self._errors(f"s3://{self.location.bucket}/{self.location.prefix}{key}"):
            answer = self._client.get_object(**args)
        tag = answer.get("ETag")
        return answer["Body"], tag.strip('"') if tag else None

    def open(
        self, shard: Shard, recheck: bool = False, on_sent: Callable[[], None] | None = None, offset: int = 0,
        by_sample: bool = False,
    ) -> Reader:
        check_key(shard.key, self.location.url)
        first: list[str | None] = []  # the first answer's ETag: a resumed GET must be of the same object

        def open_at(at: int) -> tuple[Reader, str | None]:
            reader, etag = self._get(shard.key, at, first[0] if first else None)
            if not first:
                first.append(etag)
            return reader, etag

        return _Resuming(open_at, self.location.url + shard.key, self._settings, self._retryable, offset)

    def read_manifest(self, name: str = MANIFEST_NAME) -> bytes | None:
        try:
            reader, _ = self._get(name)
        except ShardNotFound:
            return None
        with self._errors(self.location.url + name):
            try:
                return reader.read(MAX_MANIFEST_BYTES + 1)
            finally:
                reader.close()

    def read_range(self, shard: Shard, start: int, end: int) -> tuple[bytes, bool]:
        key = check_key(shard.key, self.location.url)
        where = f"s3://{self.location.bucket}/{self.location.prefix}{key}"
        with self._errors(where):
            answer = self._client.get_object(Bucket=self.location.bucket, Key=self.location.prefix + key,
                                             Range=f"bytes={start}-{end - 1}")
            body = answer["Body"]
            try:
                data: bytes = body.read()
            finally:
                body.close()
        if len(data) != end - start:
            raise SourceError(f"{where}: asked bytes {start}-{end - 1}, got {len(data)} bytes")
        return data, False

    def list_objects(self) -> Iterator[ListedObject]:
        paginator = self._client.get_paginator("list_objects_v2")
        with self._errors(f"listing {self.location.url}"):
            for page in paginator.paginate(Bucket=self.location.bucket, Prefix=self.location.prefix):
                for item in page.get("Contents", []):
                    key = item["Key"][len(self.location.prefix) :]
                    etag = item.get("ETag")
                    yield ListedObject(key, int(item.get("Size", 0)), etag.strip('"') if etag else None)

    def prefetch(self, shards: Sequence[Shard]) -> None:
        return None

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._client.close()


# -- the cache daemon ---------------------------------------------------------------------------


class _HTTPBody:
    def __init__(self, resp: http.client.HTTPResponse, conn: http.client.HTTPConnection) -> None:
        self._resp, self._conn = resp, conn

    def read(self, n: int = -1, /) -> bytes:
        data = self._resp.read(n if n >= 0 else None)
        if not data and n != 0 and self._resp.length:
            # http.client answers b"" when the peer closes before Content-Length is reached;
            # that is a broken connection (resume it), not the end of the object.
            raise http.client.IncompleteRead(b"", self._resp.length)
        return data

    def close(self) -> None:
        self._conn.close()


def _once(call: Callable[[], None] | None) -> Callable[[], None] | None:
    """``call`` that runs at most once, however many requests it is handed to."""
    if call is None:
        return None
    pending = [call]

    def run() -> None:
        if pending:
            pending.pop()()

    return run


class DaemonSource:
    """The dataset read through ``shardcache serve`` (sidecar or node daemon) over HTTP, or from
    descriptors passed over its handle socket (``settings.handles``).

    ``s3://bucket/prefix/`` maps to ``/{bucket}/{prefix}...``; ``file:///root/bucket/prefix/``
    maps through the daemon's origin root (``GET /_shardcache/stats``) to ``/{bucket}/{prefix}``.
    """

    def __init__(self, location: DatasetURL, endpoint: str, settings: LoaderSettings, job: str | None = None) -> None:
        self.location = location
        self.via = endpoint
        self.last_open_in_place = False
        self._settings = settings
        self._client = DaemonClient(endpoint, settings, job=job)
        self._short_circuit = settings.short_circuit
        # With a handle socket the pod mounts no cache directory: a path answer could not be
        # opened, so short-circuit means handles only (and HTTP when there is none).
        self._handles = (HandleClient(settings.handles, settings, job=self._client.job)
                         if settings.handles and settings.short_circuit else None)
        # Whether open(by_sample=True) of a shard being filled streams its bytes as they land
        # (over HTTP without a claim; by path only for a cached copy). Not by descriptor: the
        # handle socket answers once the shard is in.
        self.streams_fills = self._handles is None
        self._bucket, self._prefix = self._map(location)
        self._hints: HintSender[tuple[str, str]] = HintSender(
            lambda objects: self._client.prefetch(objects, "lease"), name="shardcache-hints"
        )

    def _map(self, location: DatasetURL) -> tuple[str, str]:
        if location.scheme == "s3":
            return location.bucket, location.prefix
        origin = self._client.origin()
        if not origin.startswith("file://"):
            raise ConfigError(
                f"dataset {location.url} is a local directory but the cache at {self.via} serves origin "
                f"{origin!r}: point endpoint= at a daemon started with --origin file://..., or pass endpoint='' "
                "to read the directory directly"
            )
        split = split_origin_path(location.path, origin[len("file://") :])
        if split is None:
            raise ConfigError(
                f"dataset {location.url} is not under the cache's origin root {origin}: use a URL below it "
                "(file:///root/bucket/prefix/) or pass endpoint='' to read the directory directly"
            )
        bucket, prefix = split
        if not bucket:
            raise ConfigError(f"dataset {location.url}: the first directory under {origin} is the bucket; name one")
        return bucket, prefix

    def open(
        self, shard: Shard, recheck: bool = False, on_sent: Callable[[], None] | None = None, offset: int = 0,
        by_sample: bool = False,
    ) -> Reader:
        """``by_sample``: the caller checks each sample against the shard's member index, so no
        claim goes with the read, and a short-circuit read of a shard not cached is answered with
        the fill's bytes as they land (not once the whole shard is in)."""
        key = self._prefix + check_key(shard.key, self.location.url)
        what = self.location.url + shard.key
        # The manifest's checksum goes with every read, resumed ones too: the daemon answers only
        # bytes that hash to it (loader.daemon.DaemonClient.open_object).
        claim = shard.xxh3_128 if self._settings.verify and not by_sample else None
        self.last_open_in_place = False
        end = shard.size if by_sample else None
        if self._handles is not None:
            on_sent = _once(on_sent)
            if self._handles.available():
                obj = self._handles.open(self._bucket, key, xxh3_128=claim, recheck=recheck, on_sent=on_sent)
                if obj is not None:
                    handle = self._open_handle(obj, what, offset)
                    if handle is not None:
                        self.last_open_in_place = obj.cache == "hit"
                        return handle
            # No descriptor: over HTTP, with ``recheck`` again (the answer that is read is this one).
            return self._resuming(key, what, claim, recheck=recheck, on_sent=on_sent, offset=offset, end=end)
        if self._short_circuit:
            # A path is the whole file, positioned at ``offset`` here. Asked ``by_sample``, a path
            # only for a cached copy, and the request carries its range (bytes answer from there);
            # else a path is asked for only from the first byte (DaemonClient).
            obj = self._client.open_object(self._bucket, key, offset=offset if by_sample else 0, short_circuit=True,
                                           if_cached=by_sample, end=end, xxh3_128=claim, recheck=recheck,
                                           on_sent=on_sent)
            recheck, on_sent = False, None
            if obj.path is not None:
                handle = self._open_short_circuit(obj.path, obj.size, offset)
                if handle is not None:
                    self.last_open_in_place = obj.cache == "hit"
                    return handle
            elif obj.response is not None and obj.conn is not None:
                if by_sample or not offset:
                    return self._resuming(key, what, claim, first=(_HTTPBody(obj.response, obj.conn), obj.etag),
                                          offset=offset, end=end)
                # Bytes instead of a path (the daemon serves none here): what is wanted starts
                # further on, asked for by range rather than read through.
                obj.conn.close()
        return self._resuming(key, what, claim, recheck=recheck, on_sent=on_sent, offset=offset, end=end)

    def _open_short_circuit(self, path: str, size: int | None, offset: int = 0) -> Reader | None:
        # A fresh fill's bytes may be on the disk only (shardcache serve --direct-writes): the tar
        # reader's mapping reads them in with the kernel's sequential read-ahead. Not with
        # POSIX_FADV_WILLNEED for the whole file: that read-ahead fills the page cache with single
        # pages instead of large folios, and every later (warm) epoch's mapped read of the shard
        # then cost twice the CPU (2.4-2.6 GB/s warm instead of 3.5-4.5, suite's 2 GiB, measured).
        try:
            handle = open(path, "rb", buffering=0)
        except OSError as exc:
            if isinstance(exc, FileNotFoundError) and os.path.isdir(os.path.dirname(os.path.dirname(path))):
                # The cache is mounted here, the file went between the answer and the open
                # (evicted, or a fill that failed to publish): this shard streams over HTTP, and
                # short-circuit reads stay on.
                log.info("short-circuit file %s is gone; reading it through %s", path, self.via)
                return None
            # The cache dir is not mounted in this pod (or not readable): stream over HTTP from now on.
            log.info("short-circuit path %s not readable here (%s); reading through %s", path, exc, self.via)
            self._short_circuit = False
            return None
        if size is not None and os.fstat(handle.fileno()).st_size != size:
            handle.close()
            log.warning("short-circuit file %s has the wrong size; reading through %s", path, self.via)
            self._short_circuit = False
            return None
        if offset:
            handle.seek(offset)
        return handle

    def _open_handle(self, obj: DaemonObject, what: str, offset: int = 0) -> Reader | None:
        """A reader of the descriptor the handle socket passed (positioned at ``offset``), or None
        (it is closed, and the shard read over HTTP): a received file is checked as a path's is,
        by its size."""
        assert self._handles is not None
        fd = obj.take_fd()
        try:
            info = os.fstat(fd)
            if stat.S_ISREG(info.st_mode) and info.st_size == obj.size:
                # From the byte asked for: the descriptor is this reader's own open file (the daemon
                # opens one per answer), but nothing promised its offset.
                os.lseek(fd, offset, os.SEEK_SET)
                return os.fdopen(fd, "rb", buffering=0)
            why = f"it passed a descriptor that is not a {obj.size}-byte file ({info.st_size} bytes, mode {info.st_mode:o})"
        except OSError as exc:
            why = f"its descriptor cannot be read ({exc.strerror or exc})"
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)
        log.warning("%s: %s", what, why)
        self._handles.pause(why)
        return None

    def _resuming(
        self, key: str, what: str, claim: str | None, first: tuple[Reader, str | None] | None = None,
        recheck: bool = False, on_sent: Callable[[], None] | None = None, offset: int = 0, end: int | None = None,
    ) -> Reader:
        """An HTTP read from byte ``offset`` (``first``: the answer already in, from there),
        resumed at the byte reached; ``recheck`` and ``on_sent`` go with its first request only."""
        pending = [first] if first is not None else []
        fresh = [] if first is not None else [True]  # the first request is still to be made

        def open_at(at: int) -> tuple[Reader, str | None]:
            if pending and at == offset:
                return pending.pop()
            initial = bool(fresh and fresh.pop())
            obj = self._client.open_object(self._bucket, key, offset=at, xxh3_128=claim, recheck=recheck and initial,
                                           on_sent=on_sent if initial else None, end=end)
            assert obj.response is not None and obj.conn is not None
            return _HTTPBody(obj.response, obj.conn), obj.etag

        return _Resuming(open_at, what, self._settings, RETRYABLE_HTTP, offset)

    def read_manifest(self, name: str = MANIFEST_NAME) -> bytes | None:
        try:
            return self._client.get_small(self._bucket, self._prefix + name)
        except ShardNotFound as exc:
            raise DatasetNotFound(f"{self.location.url}: {exc}") from exc

    def cache_members(self, shard: Shard) -> bytes | None:
        """The member index the daemon builds of its cached copy of the shard, if it holds one."""
        return self._client.members(self._bucket, self._prefix + check_key(shard.key, self.location.url))

    def read_range(self, shard: Shard, start: int, end: int) -> tuple[bytes, bool]:
        key = self._prefix + check_key(shard.key, self.location.url)
        data, cache = self._client.get_range(self._bucket, key, start, end)
        return data, cache == "hit"

    def list_objects(self) -> Iterator[ListedObject]:
        for obj in self._client.list_objects(self._bucket, self._prefix):
            yield ListedObject(obj.key[len(self._prefix) :], obj.size, obj.etag)

    def prefetch(self, shards: Sequence[Shard]) -> None:
        self._hints.put([(self._bucket, self._prefix + s.key) for s in shards])

    def close(self) -> None:
        self._hints.close()
        self._client.close()
        if self._handles is not None:
            self._handles.close()
