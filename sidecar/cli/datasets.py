"""Datasets as the operator CLI sees them: listing shards, scanning them, building and writing
``manifest.json``, on ``s3://`` or ``file://`` origins. The dataset URL and the manifest format
(the **contract**, and its reader) are :mod:`wire.dataset`'s, shared with the trainers.

Keys are relative to the dataset prefix. Samples are counted with the loader's own tar reader and
grouping rule (members sharing a basename up to the first dot are one sample), so the counts the
master bounds renew offsets by are exactly what a trainer will see.

Everything here is synchronous (boto3, files); the CLI runs it on threads.
"""

from __future__ import annotations

import contextlib
import json
import logging
import mmap
import os
import re
import tempfile
import threading
import urllib.parse
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Protocol

import xxhash

from sidecar.cli.util import EXIT_FAILED, EXIT_UNAVAILABLE, UserError
from sidecar.errors import SidecarError
from wire.dataset import MANIFEST_FORMAT, MANIFEST_VERSION, MAX_MANIFEST_BYTES, DatasetURL, ManifestShard, check_key
from wire.errors import ManifestError
from wire.members import members_bytes, members_key, parse_members
from wire.s3errors import S3ErrorKind, from_client_error
from wire.s3xml import ListedObject

__all__ = [
    "Counter",
    "DatasetAccessDenied",
    "DatasetError",
    "DatasetMissing",
    "DatasetUnavailable",
    "dataset_errors",
    "quiet_libraries",
    "ListedObject",
    "Mismatch",
    "ObjectStore",
    "ShardInfo",
    "atomic_write",
    "build_manifest",
    "compare",
    "list_shards",
    "manifest_bytes",
    "members_problem",
    "open_store",
    "read_object",
    "scan_and_index",
    "scan_shard",
    "write_object",
]

_META_RE = re.compile(r"__[^/]*__($|/)")  # the loader skips __meta__-style members
_READ = 1 << 20


class DatasetError(SidecarError):
    """Root of the errors reaching a dataset from the CLI."""


class DatasetMissing(DatasetError, FileNotFoundError):
    """The dataset, or an object of it, is not at the origin."""


class DatasetAccessDenied(DatasetError, PermissionError):
    pass


class DatasetUnavailable(DatasetError, ConnectionError):
    pass


@contextlib.contextmanager
def dataset_errors() -> Iterator[None]:
    """Dataset access errors as one line with what to do, and the matching exit code."""
    try:
        yield
    except DatasetMissing as exc:
        raise UserError(f"{exc} (check the URL)") from None
    except DatasetAccessDenied as exc:
        raise UserError(str(exc), EXIT_FAILED) from None
    except DatasetUnavailable as exc:
        raise UserError(str(exc), EXIT_UNAVAILABLE) from None


def quiet_libraries() -> None:
    """boto3's INFO lines ("Found credentials in environment variables") are noise to an operator
    reading a progress bar; keep them for --log-level DEBUG."""
    if logging.getLogger().getEffectiveLevel() > logging.DEBUG:
        for name in ("boto3", "botocore", "urllib3", "s3transfer"):
            logging.getLogger(name).setLevel(logging.WARNING)


# -- object access --------------------------------------------------------------------------------


class Reader(Protocol):
    def read(self, n: int = -1, /) -> bytes: ...

    def close(self) -> None: ...


class ObjectStore(Protocol):
    """What the CLI needs of an origin, keys relative to the dataset prefix."""

    dataset: DatasetURL

    def list(self) -> list[ListedObject]: ...

    def open(self, key: str) -> Reader: ...

    def read_small(self, key: str, limit: int) -> bytes | None: ...

    def write(self, key: str, data: bytes) -> None: ...


class FileObjects:
    def __init__(self, dataset: DatasetURL) -> None:
        self.dataset = dataset
        self.root = Path(dataset.path)

    def _path(self, key: str) -> Path:
        check_key(key, self.dataset.url)
        return self.root.joinpath(*key.split("/"))

    def list(self) -> list[ListedObject]:
        if not self.root.is_dir():
            raise DatasetMissing(f"{self.dataset.url}: no such directory")
        found: list[ListedObject] = []
        for dirpath, dirnames, filenames in os.walk(self.root):
            dirnames.sort()
            for name in filenames:
                full = Path(dirpath) / name
                with contextlib.suppress(OSError):  # vanished while listing
                    found.append(ListedObject(full.relative_to(self.root).as_posix(), full.stat().st_size))
        return sorted(found, key=lambda obj: obj.key)

    def open(self, key: str) -> Reader:
        try:
            return open(self._path(key), "rb", buffering=0)
        except FileNotFoundError as exc:
            raise DatasetMissing(f"{self.dataset.url}{key}: no such file") from exc
        except PermissionError as exc:
            raise DatasetAccessDenied(f"{self.dataset.url}{key}: permission denied") from exc

    def read_small(self, key: str, limit: int) -> bytes | None:
        try:
            with open(self._path(key), "rb") as handle:
                return handle.read(limit + 1)
        except FileNotFoundError:
            return None
        except PermissionError as exc:
            raise DatasetAccessDenied(f"{self.dataset.url}{key}: permission denied") from exc

    def write(self, key: str, data: bytes) -> None:
        """Publish ``data`` as ``key`` atomically (:func:`atomic_write`)."""
        try:
            atomic_write(self._path(key), data)
        except PermissionError as exc:
            raise DatasetAccessDenied(f"cannot write {self.dataset.url}{key}: permission denied") from exc
        except FileNotFoundError as exc:
            raise DatasetMissing(f"cannot write {self.dataset.url}{key}: its directory is gone") from exc


# What S3's error answers become for the CLI, with a hint for the operator; every other kind is
# DatasetUnavailable.
_S3_ERRORS: dict[S3ErrorKind, tuple[type[DatasetError], str]] = {
    S3ErrorKind.NOT_FOUND_KEY: (DatasetMissing, ""),
    S3ErrorKind.NOT_FOUND_BUCKET: (DatasetMissing, ""),
    S3ErrorKind.ACCESS_DENIED: (DatasetAccessDenied, "; check the AWS credentials"),
}


class S3Objects:
    """boto3 with the standard credential chain; ``endpoint_url`` or ``AWS_ENDPOINT_URL``."""

    def __init__(self, dataset: DatasetURL, endpoint_url: str | None = None) -> None:
        import boto3
        from botocore.config import Config

        self.dataset = dataset
        self.client: Any = boto3.session.Session().client(
            "s3",
            endpoint_url=endpoint_url or None,
            config=Config(
                retries={"max_attempts": 4, "mode": "standard"}, connect_timeout=5, read_timeout=60,
                max_pool_connections=64, s3={"addressing_style": "path"},
            ),
        )

    @contextlib.contextmanager
    def errors(self, what: str) -> Iterator[None]:
        import botocore.exceptions as bex

        try:
            yield
        except bex.ClientError as exc:
            answer = from_client_error(exc)
            message = f"{what}: {answer.code or 'error'} ({answer.message or exc})"
            exc_type, hint = _S3_ERRORS.get(answer.kind, (DatasetUnavailable, ""))
            raise exc_type(message + hint) from exc
        except bex.NoCredentialsError as exc:
            raise DatasetAccessDenied(f"{what}: no AWS credentials found (set AWS_ACCESS_KEY_ID/AWS_PROFILE)") from exc
        except (bex.EndpointConnectionError, bex.ConnectionError, bex.ReadTimeoutError) as exc:
            raise DatasetUnavailable(f"{what}: cannot reach S3 ({exc}); check --s3-endpoint / AWS_ENDPOINT_URL") from exc
        except bex.BotoCoreError as exc:
            raise DatasetUnavailable(f"{what}: {exc}") from exc

    def list(self) -> list[ListedObject]:
        found: list[ListedObject] = []
        prefix = self.dataset.prefix
        with self.errors(f"listing {self.dataset.url}"):
            for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.dataset.bucket, Prefix=prefix):
                for item in page.get("Contents", []):
                    key = item["Key"][len(prefix):]
                    if key and not key.endswith("/"):
                        found.append(ListedObject(key, int(item.get("Size", 0)), item.get("ETag")))
        return sorted(found, key=lambda obj: obj.key)

    def open(self, key: str) -> Reader:
        with self.errors(self.dataset.url + key):
            answer = self.client.get_object(Bucket=self.dataset.bucket, Key=self.dataset.prefix + key)
        return _S3Body(answer["Body"], self, self.dataset.url + key)

    def read_small(self, key: str, limit: int) -> bytes | None:
        try:
            body = self.open(key)
        except DatasetMissing:
            return None
        try:
            return body.read(limit + 1)
        finally:
            body.close()

    def write(self, key: str, data: bytes) -> None:
        """One PUT: S3 publishes an object whole or not at all."""
        with self.errors(f"writing {self.dataset.url}{key}"):
            self.client.put_object(Bucket=self.dataset.bucket, Key=self.dataset.prefix + key, Body=data,
                                   ContentType="application/json")


class _S3Body:
    def __init__(self, body: Any, store: S3Objects, what: str) -> None:
        self._body = body
        self._store = store
        self._what = what

    def read(self, n: int = -1, /) -> bytes:
        with self._store.errors(self._what):
            return bytes(self._body.read(None if n is None or n < 0 else n))

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._body.close()


def open_store(dataset: DatasetURL, s3_endpoint: str | None = None) -> ObjectStore:
    if dataset.scheme == "s3":
        return S3Objects(dataset, s3_endpoint)
    return FileObjects(dataset)


def list_shards(store: ObjectStore) -> list[ListedObject]:
    """The dataset's shards as the loader finds them without a manifest: every ``*.tar`` under the
    prefix, sorted by key."""
    return [obj for obj in store.list() if obj.key.endswith(".tar")]


# -- scanning shards ------------------------------------------------------------------------------


@dataclass
class ShardInfo:
    key: str
    size: int
    xxh3_128: str
    samples: int | None
    error: str | None = None  # not a readable WebDataset tar (the size and checksum still hold)
    members: str | None = None  # the xxh3-128 of the member index written next to it (--members)
    members_error: str | None = None  # why it has none though one was asked for

    def entry(self) -> dict[str, Any]:
        entry: dict[str, Any] = {"key": self.key, "size": self.size, "xxh3_128": self.xxh3_128, "samples": self.samples}
        if self.members is not None:
            entry["members_xxh3_128"] = self.members
        return entry


class _Hashing:
    """Passes reads through while hashing and counting them (``on_bytes`` feeds a progress bar),
    and copying them to ``spool`` when given."""

    def __init__(self, raw: Reader, on_bytes: Callable[[int], None] | None, spool: BinaryIO | None = None) -> None:
        self.raw = raw
        self.hasher = xxhash.xxh3_128()
        self.size = 0
        self.on_bytes = on_bytes
        self.spool = spool

    def read(self, n: int = -1, /) -> bytes:
        data = self.raw.read(n)
        if data:
            self.hasher.update(data)
            self.size += len(data)
            if self.spool is not None:
                self.spool.write(data)
            if self.on_bytes is not None:
                self.on_bytes(len(data))
        return data


def scan_shard(raw: Reader, key: str, url: str = "", on_bytes: Callable[[int], None] | None = None,
               spool: BinaryIO | None = None) -> ShardInfo:
    """Size, xxh3-128 and sample count of one shard, streaming (one member in memory at most);
    every byte read is also written to ``spool`` when given."""
    from loader.errors import (
        CorruptShard,  # the loader's strict reader: same counts as trainers
    )
    from loader.tar import iter_members, split_name

    reader = _Hashing(raw, on_bytes, spool)
    samples = 0
    current: str | None = None
    error = None
    try:
        for name, _ in iter_members(reader, url=url or key, want=lambda name: False):
            if _META_RE.match(name):
                continue
            parts = split_name(name)
            if parts is None:
                continue
            if parts[0] != current:
                current = parts[0]
                samples += 1
    except CorruptShard as exc:
        error = str(exc)
    while reader.read(_READ):  # the bytes after the end-of-archive block are part of the object
        pass
    return ShardInfo(key, reader.size, reader.hasher.hexdigest(), None if error else samples, error)


def _regular_file(raw: Reader) -> int | None:
    """The descriptor of ``raw`` when it is a regular file read from its start (``file://``):
    it is mapped after the scan instead of spooled."""
    from loader.tarindex import file_identity

    return int(raw.fileno()) if file_identity(raw) is not None else None  # type: ignore[attr-defined]


def scan_and_index(raw: Reader, key: str, url: str, on_bytes: Callable[[int], None] | None,
                   write: Callable[[str, bytes], None]) -> ShardInfo:
    """:func:`scan_shard`, and the shard's member index (:mod:`wire.members`) built from the same
    read and written with ``write(members_key(key), document)``; its checksum is the info's
    ``members``, or ``members_error`` says why it has none (not a tar, a sparse member, a
    field named twice in a sample).

    The shard is read once: a stream is copied to an unlinked temporary file (``TMPDIR``) as it is
    scanned, a regular file is used as it is; either is then mapped for
    :func:`loader.members.index_shard`. Memory: one member at a time and the table; the mapping's
    pages are the page cache's (disk: one shard's size per shard being read at once)."""
    from loader.errors import CorruptShard
    from loader.members import index_shard

    fd = _regular_file(raw)
    spool: BinaryIO | None = None
    buf: bytes | mmap.mmap = b""
    try:
        if fd is None:
            spool = tempfile.TemporaryFile(prefix="shardcache-index-")  # noqa: SIM115 (closed below)
            fd = spool.fileno()
        info = scan_shard(raw, key, url, on_bytes, spool)
        if info.error is not None:
            return info
        if spool is not None:
            spool.flush()
        if info.size:
            try:
                buf = mmap.mmap(fd, info.size, access=mmap.ACCESS_READ)
            except (OSError, ValueError) as exc:  # the file shrank after the scan
                info.members_error = f"the shard changed while it was read ({exc})"
                return info
        try:
            table = index_shard(buf, key, url=url or key)
        except CorruptShard as exc:
            reason = str(exc)
            info.members_error = reason[len(url or key):].lstrip(": ") if reason.startswith(url or key) else reason
            return info
    finally:
        if isinstance(buf, mmap.mmap):
            with contextlib.suppress(BufferError):  # a view still held: the GC unmaps it
                buf.close()
        if spool is not None:
            spool.close()
    if (table.size, table.xxh3_128) != (info.size, info.xxh3_128):
        info.members_error = "the shard changed while it was read (its bytes hash differently the second time)"
        return info
    if table.samples != info.samples:
        info.members_error = f"its member index lists {table.samples} samples, the scan counted {info.samples}"
        return info
    document = members_bytes(table)
    del table
    try:
        parse_members(document, members_key(url or key))  # never write what a reader refuses
    except ManifestError as exc:
        info.members_error = f"its member index would not be readable: {exc}"
        return info
    write(members_key(key), document)
    info.members = xxhash.xxh3_128_hexdigest(document)
    return info


def members_problem(data: bytes | None, shard: ManifestShard, found: ShardInfo, where: str) -> str | None:
    """What is wrong with the member index ``data`` (None: absent) that the manifest pins for
    ``shard``, the object being ``found``; None when it matches (pure: what was read is passed in)."""
    if data is None:
        return f"no member index at {where}; the manifest pins one (write it with `shardcache index --members`)"
    digest = xxhash.xxh3_128_hexdigest(data)
    if digest != shard.members:
        return (f"{where} hashes to {digest}, the manifest pins {shard.members} (damaged or rewritten: "
                "index again with --members)")
    try:
        table = parse_members(data, where)
    except ManifestError as exc:
        return str(exc)
    if table.shard_key != shard.key:
        return f"{where} indexes {table.shard_key!r}, not {shard.key!r}"
    if (shard.size is not None and table.size != shard.size) or (
        shard.xxh3_128 is not None and table.xxh3_128 != shard.xxh3_128
    ):
        return (f"{where} indexes {table.size} bytes of xxh3_128 {table.xxh3_128}, the manifest lists {shard.size} "
                f"bytes of xxh3_128 {shard.xxh3_128}")
    if (table.size, table.xxh3_128) != (found.size, found.xxh3_128):
        return (f"{where} indexes {table.size} bytes of xxh3_128 {table.xxh3_128}, the object is {found.size} bytes "
                f"of xxh3_128 {found.xxh3_128} (stale: the shard changed after it was indexed)")
    if shard.samples is not None and table.samples != shard.samples:
        return f"{where} lists {table.samples} samples, the manifest says {shard.samples}"
    return None


# -- the manifest ---------------------------------------------------------------------------------


def build_manifest(shards: list[ShardInfo]) -> dict[str, Any]:
    return {
        "version": MANIFEST_VERSION,
        "format": MANIFEST_FORMAT,
        "shards": [shard.entry() for shard in sorted(shards, key=lambda s: s.key)],
    }


def manifest_bytes(doc: dict[str, Any]) -> bytes:
    # One shard per line: diffable, greppable, and still plain JSON.
    lines = [json.dumps(entry, separators=(", ", ": ")) for entry in doc["shards"]]
    head = f'{{"version": {doc["version"]}, "format": {json.dumps(doc["format"])}, "shards": ['
    return (head + "\n  " + ",\n  ".join(lines) + "\n]}\n").encode() if lines else (head + "]}\n").encode()


@dataclass(frozen=True)
class Mismatch:
    key: str
    problem: str  # missing | size | xxh3_128 | samples | unreadable | members | unlisted
    detail: str

    def as_dict(self) -> dict[str, str]:
        return {"key": self.key, "problem": self.problem, "detail": self.detail}


def compare(expected: list[ManifestShard], found: dict[str, ShardInfo], listed: list[str],
            members: dict[str, str] | None = None) -> list[Mismatch]:
    """Every way the objects differ from the manifest (pure: what was read is passed in);
    ``members``: what is wrong with the member indexes it pins, by shard key
    (:func:`members_problem`)."""
    problems: list[Mismatch] = []
    for shard in expected:
        info = found.get(shard.key)
        if info is None:
            problems.append(Mismatch(shard.key, "missing", "listed in the manifest but not in the dataset"))
            continue
        if shard.size is not None and info.size != shard.size:
            problems.append(Mismatch(shard.key, "size", f"object is {info.size} bytes, the manifest says {shard.size}"))
        if shard.xxh3_128 is not None and info.xxh3_128 != shard.xxh3_128:
            problems.append(Mismatch(
                shard.key, "xxh3_128", f"object hashes to {info.xxh3_128}, the manifest says {shard.xxh3_128}"
            ))
        if info.error is not None:
            problems.append(Mismatch(shard.key, "unreadable", info.error))
        elif shard.samples is not None and info.samples != shard.samples:
            problems.append(Mismatch(
                shard.key, "samples", f"object holds {info.samples} samples, the manifest says {shard.samples}"
            ))
        if members and shard.key in members:
            problems.append(Mismatch(shard.key, "members", members[shard.key]))
    known = {shard.key for shard in expected}
    for key in listed:
        if key not in known:
            problems.append(Mismatch(key, "unlisted", "a *.tar shard in the dataset that the manifest does not list"))
    return problems


# -- writing --------------------------------------------------------------------------------------


def atomic_write(path: Path, data: bytes) -> None:
    """Temp file in the same directory, fsync, rename, fsync the directory: readers see the old
    manifest or the new one, never half of one; the temp is removed on any failure."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def write_object(target: str, data: bytes, s3_endpoint: str | None = None) -> str:
    """Write ``data`` to ``s3://bucket/key``, ``file:///path`` or a local path; returns where."""
    if target.startswith("s3://"):
        parts = urllib.parse.urlsplit(target)
        key = parts.path.lstrip("/")
        if not parts.netloc or not key or key.endswith("/"):
            raise ValueError(f"{target!r}: an S3 output needs a bucket and a key, s3://bucket/path/manifest.json")
        dataset = DatasetURL(f"s3://{parts.netloc}/", "s3", bucket=parts.netloc)
        store = S3Objects(dataset, s3_endpoint)
        with store.errors(f"writing {target}"):
            store.client.put_object(
                Bucket=parts.netloc, Key=key, Body=data, ContentType="application/json"
            )
        return target
    path = Path(urllib.parse.unquote(target[len("file://"):]) if target.startswith("file://") else target)
    if not path.parent.is_dir():
        raise DatasetMissing(f"cannot write {target}: directory {path.parent} does not exist")
    try:
        atomic_write(path, data)
    except PermissionError as exc:
        raise DatasetAccessDenied(f"cannot write {target}: permission denied") from exc
    return str(path)


def read_object(target: str, s3_endpoint: str | None = None) -> bytes | None:
    """The bytes at ``s3://bucket/key``, ``file:///path`` or a local path; None if absent."""
    if target.startswith("s3://"):
        parts = urllib.parse.urlsplit(target)
        key = parts.path.lstrip("/")
        dataset = DatasetURL(f"s3://{parts.netloc}/", "s3", bucket=parts.netloc)
        return S3Objects(dataset, s3_endpoint).read_small(key, MAX_MANIFEST_BYTES)
    path = Path(urllib.parse.unquote(target[len("file://"):]) if target.startswith("file://") else target)
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return None


@dataclass
class Counter:
    """Thread-safe progress counters for parallel scans."""

    files: int = 0
    bytes: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add_bytes(self, count: int) -> None:
        with self.lock:
            self.bytes += count

    def add_file(self) -> None:
        with self.lock:
            self.files += 1
