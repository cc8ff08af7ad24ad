"""Client of the node daemon / sidecar HTTP API (``docs/daemon-api.md``): small, synchronous,
stdlib only, over TCP or a unix socket; and of the pod's handle socket (``wire.handles``).

A client made with a ``job`` names it on every request (``x-shardcache-job``,
:data:`wire.nodeplan.JOB_HEADER`): the daemon counts what the job's readers read, and tells the
lease master (``serve --master``).

Object bodies stream through a connection of their own (a shard is large; reusing the pooled
connection would block hints and listings behind it). Small calls (stats, listings, prefetch
hints, the manifest) reuse one keep-alive connection per thread and process, and so do handle
requests (:class:`HandleClient`).
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import urllib.parse
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from loader.errors import AccessDenied, CorruptShard, LoaderError, ShardNotFound, SourceError
from loader.settings import LoaderSettings, parse_endpoint
from wire import jsontext
from wire.errors import BadRequest
from wire.httpclient import (
    AnswerTooLarge,
    ThreadConnections,
    UnixHTTPConnection,
    exchange,
)
from wire.nodeplan import JOB_HEADER, job_name
from wire.retry import retry_sync
from wire.s3errors import TRANSIENT, S3ErrorAnswer, S3ErrorKind, from_http
from wire.s3xml import MAX_ERROR_BYTES, ListedObject, S3XMLError, parse_list_page

__all__ = ["RETRYABLE_HTTP", "DaemonClient", "DaemonObject", "ListedObject", "loader_error"]

log = logging.getLogger(__name__)

T = TypeVar("T")

_USER_AGENT = "shardcache-loader/1"
_MAX_SMALL_BODY = 256 << 20  # listings and manifests; anything larger is not what we asked for
RETRYABLE_HTTP: tuple[type[BaseException], ...] = (OSError, http.client.HTTPException)


@dataclass
class DaemonObject:
    """An opened object: a short-circuit ``path``, a descriptor ``fd`` received over the handle
    socket (the caller takes it: :meth:`take_fd`), or a streaming ``response``."""

    size: int | None
    etag: str | None
    path: str | None = None
    response: http.client.HTTPResponse | None = None
    conn: http.client.HTTPConnection | None = None
    cache: str | None = None  # x-shardcache-cache: hit|miss|coalesced
    fd: int | None = None
    xxh3_128: str | None = None  # the handle answer's: the hash of the bytes behind ``fd``

    def take_fd(self) -> int:
        """The received descriptor, now the caller's to close."""
        fd, self.fd = self.fd, None
        if fd is None:
            raise ValueError("no descriptor to take (not a handle answer, or taken already)")
        return fd

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


class _DaemonHTTPError(Exception):
    """An S3 error answer of the daemon, until :meth:`DaemonClient._wrap_errors` maps it."""

    def __init__(self, answer: S3ErrorAnswer) -> None:
        self.status = answer.status
        self.code = answer.code or f"HTTP{answer.status}"
        self.message = answer.message
        self.kind = answer.kind
        super().__init__(f"HTTP {self.status} {self.code}: {self.message}")


def _s3_error(status: int, body: bytes) -> _DaemonHTTPError:
    return _DaemonHTTPError(from_http(status, body))


def _transient(exc: BaseException) -> bool:
    """Worth another attempt: the daemon unreachable, or answering that it or its origin is."""
    if isinstance(exc, LoaderError):
        return False  # already a decision (e.g. an oversized answer), not a transient fault
    if isinstance(exc, _DaemonHTTPError):
        return exc.kind in TRANSIENT
    return isinstance(exc, RETRYABLE_HTTP)


# What the daemon's error answers become for the trainer, and the message when the answer has
# none; every other kind is a SourceError.
_ERRORS: dict[S3ErrorKind, tuple[type[LoaderError], str]] = {
    S3ErrorKind.NOT_FOUND_KEY: (ShardNotFound, "not found"),
    S3ErrorKind.NOT_FOUND_BUCKET: (ShardNotFound, "not found"),
    S3ErrorKind.ACCESS_DENIED: (AccessDenied, "access denied"),
    # The daemon's copy checks out and is not what the manifest says: a stale manifest.
    S3ErrorKind.CHECKSUM_MISMATCH: (CorruptShard, "checksum mismatch"),
}


def loader_error(where: str, kind: S3ErrorKind, code: str, message: str) -> LoaderError | None:
    """The trainer's error for an answer of these kinds (:data:`_ERRORS`); None for the others."""
    if kind not in _ERRORS:
        return None
    exc_type, default = _ERRORS[kind]
    return exc_type(f"{where}: {code} ({message or default})")


class DaemonClient:
    """The cache endpoint as the loader uses it. Safe to share between threads; after a fork
    (DataLoader workers) each process opens its own connections."""

    def __init__(self, endpoint: str, settings: LoaderSettings, job: str | None = None) -> None:
        """``job``: the reader's job, named on every request (none: nothing is sent)."""
        self.endpoint = endpoint.rstrip("/")
        self._settings = settings
        self._job_headers: dict[str, str] = {}
        if job:
            try:
                self._job_headers[JOB_HEADER] = job_name(job)
            except BadRequest as exc:  # the daemon would refuse every request: read uncounted instead
                log.warning("not naming job %r to the cache at %s: %s", job, self.endpoint, exc)
        self.job: str | None = self._job_headers.get(JOB_HEADER)
        """The job named to the daemon (None: none, or a name it would refuse)."""
        address = parse_endpoint(self.endpoint)
        self._unix: str | None = address.path if address.kind == "unix" else None
        self._host, self._port, self._base = address.host, address.port, address.base
        self._https = address.tls
        self._conns = ThreadConnections(lambda _: self._new_connection(self._settings.io_timeout_s))
        self._origin: str | None = None

    # -- connections ----------------------------------------------------------------------

    def _new_connection(self, timeout: float) -> http.client.HTTPConnection:
        if self._unix is not None:
            return UnixHTTPConnection(self._unix, timeout)
        if self._https:
            return http.client.HTTPSConnection(self._host, self._port, timeout=timeout)
        return http.client.HTTPConnection(self._host, self._port, timeout=timeout)

    def close(self) -> None:
        """Close the kept-alive connections of every thread (streams already opened stay open)."""
        self._conns.close()

    def _exchange(
        self, method: str, path: str, *, body: bytes | None = None, headers: dict[str, str] | None = None
    ) -> tuple[int, http.client.HTTPMessage, bytes]:
        """One small request on the pooled connection (one silent reconnect for a stale keep-alive)."""
        try:
            return exchange(
                self._conns.get, self._conns.discard, method, self._base + path, body=body,
                headers={"User-Agent": _USER_AGENT, **self._job_headers, **(headers or {})}, max_body=_MAX_SMALL_BODY,
            )
        except AnswerTooLarge as exc:
            # Not a transient fault: listings and manifests this large are not what we asked for.
            raise SourceError(f"{self.endpoint}{path}: {exc}") from exc

    def _with_retries(self, what: str, call: Callable[[], T]) -> T:
        """Run ``call()``, retrying connection errors and 5xx answers with backoff."""
        try:
            return retry_sync(call, self._settings.backoff, _transient)
        except Exception as exc:
            if not _transient(exc):
                raise
            raise SourceError(
                f"cache endpoint {self.endpoint}: {what} failed after {self._settings.io_attempts} attempts: {exc}. "
                "Check that the shardcache daemon/sidecar is running, or unset SHARDCACHE_ENDPOINT to read the origin."
            ) from exc

    # -- API ------------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        def call() -> dict[str, Any]:
            status, _, data = self._exchange("GET", "/_shardcache/stats", headers={"Accept": "application/json"})
            if status != 200:
                raise _s3_error(status, data)
            try:
                answer = jsontext.loads(data)
            except ValueError:
                answer = None
            if not isinstance(answer, dict):
                raise SourceError(f"{self.endpoint}/_shardcache/stats: expected a JSON object")
            return answer

        return self._wrap_errors("stats", "", lambda: self._with_retries("GET /_shardcache/stats", call))

    def origin(self) -> str:
        """The daemon's origin: ``"s3"`` or ``"file:///root"`` (cached per client)."""
        if self._origin is None:
            origin = self.stats().get("origin")
            if not isinstance(origin, str) or not origin:
                raise SourceError(f"{self.endpoint}/_shardcache/stats does not name its origin")
            self._origin = origin.rstrip("/") if origin.startswith("file://") else origin
        return self._origin

    def get_small(self, bucket: str, key: str) -> bytes | None:
        """Whole body of a small object (the manifest); None when it does not exist."""

        def call() -> bytes | None:
            status, _, data = self._exchange("GET", _object_path(bucket, key))
            if status == 404:
                err = _s3_error(status, data)
                if err.kind is S3ErrorKind.NOT_FOUND_BUCKET:
                    raise err
                return None
            if status != 200:
                raise _s3_error(status, data)
            return data

        return self._wrap_errors(f"GET {bucket}/{key}", key, lambda: self._with_retries(f"GET {bucket}/{key}", call))

    def list_objects(self, bucket: str, prefix: str) -> Iterator[ListedObject]:
        token: str | None = None
        for _ in range(1_000_000):  # bounded: a listing of a billion objects is not a dataset
            query = {"list-type": "2", "prefix": prefix, "max-keys": "1000"}
            if token:
                query["continuation-token"] = token
            path = "/" + urllib.parse.quote(bucket, safe="") + "?" + urllib.parse.urlencode(query)

            def call(path: str = path) -> bytes:
                status, _, data = self._exchange("GET", path)
                if status != 200:
                    raise _s3_error(status, data)
                return data

            data = self._wrap_errors(
                f"list {bucket}/{prefix}", prefix, lambda: self._with_retries("ListObjectsV2", call)
            )
            try:
                page = parse_list_page(data)
            except S3XMLError as exc:
                raise SourceError(f"{self.endpoint}: malformed ListObjectsV2 answer for {bucket}/{prefix}: {exc}") from exc
            for obj in page.contents:
                yield ListedObject(obj.key, obj.size, obj.etag.strip('"') if obj.etag else None)
            token = page.next_token
            if not page.truncated or not token:
                return
        raise SourceError(f"{self.endpoint}: listing {bucket}/{prefix} did not end")

    def prefetch(self, objects: Sequence[tuple[str, str]], priority: str = "lease") -> bool:
        """Ask the daemon to fetch ``objects`` in the background. A hint: failures are logged only."""
        if not objects:
            return True
        body = json.dumps(
            {"objects": [{"bucket": b, "key": k} for b, k in objects], "priority": priority}
        ).encode()
        try:
            status, _, data = self._exchange(
                "POST", "/_shardcache/prefetch", body=body, headers={"Content-Type": "application/json"}
            )
        except RETRYABLE_HTTP as exc:
            log.debug("prefetch hint to %s failed: %s", self.endpoint, exc)
            return False
        if status >= 300:
            log.debug("prefetch hint to %s answered %s: %s", self.endpoint, status, data[:200])
            return False
        return True

    def members(self, bucket: str, key: str) -> bytes | None:
        """The member index the daemon builds of its cached copy of ``bucket/key``
        (``GET /_shardcache/members``); None when it holds none (not cached, not indexable, a
        daemon without the endpoint)."""
        query = urllib.parse.urlencode({"bucket": bucket, "key": key})

        def call() -> bytes | None:
            status, _, data = self._exchange("GET", f"/_shardcache/members?{query}")
            if status in (404, 405, 422):
                return None
            if status != 200:
                raise _s3_error(status, data)
            return data

        what = f"GET member index of {bucket}/{key}"
        return self._wrap_errors(what, key, lambda: self._with_retries(what, call))

    def get_range(self, bucket: str, key: str, start: int, end: int) -> tuple[bytes, str | None]:
        """Bytes ``[start, end)`` of ``bucket/key`` and how the daemon served them (its
        ``x-shardcache-cache``: ``hit`` when the object is cached whole). No claim goes with it:
        a whole object's checksum says nothing of a range, the caller checks the bytes itself."""
        if not 0 <= start < end:
            raise ValueError(f"an empty or inverted range: [{start}, {end})")
        headers = {"Range": f"bytes={start}-{end - 1}"}

        def call() -> tuple[bytes, str | None]:
            status, answer, data = self._exchange("GET", _object_path(bucket, key), headers=headers)
            if status != 206:
                if status == 200:
                    raise SourceError(f"{self.endpoint}: asked bytes {start}-{end - 1} of {bucket}/{key}, got the whole object")
                raise _s3_error(status, data)
            if len(data) != end - start or not (answer.get("Content-Range") or "").startswith(f"bytes {start}-{end - 1}/"):
                raise SourceError(f"{self.endpoint}: asked bytes {start}-{end - 1} of {bucket}/{key}, got "
                                  f"{len(data)} bytes ({answer.get('Content-Range')})")
            return data, answer.get("x-shardcache-cache")

        what = f"GET {bucket}/{key} bytes {start}-{end - 1}"
        return self._wrap_errors(what, key, lambda: self._with_retries(what, call))

    def open_object(
        self, bucket: str, key: str, *, offset: int = 0, short_circuit: bool = False,
        xxh3_128: str | None = None, recheck: bool = False, on_sent: Callable[[], None] | None = None,
        if_cached: bool = False, end: int | None = None,
    ) -> DaemonObject:
        """Open ``bucket/key`` for streaming from byte ``offset`` (retried on connection errors
        and 5xx). With ``short_circuit`` the daemon may answer with the cached file's path.

        ``xxh3_128`` is the manifest's checksum of the object: the daemon answers only bytes that
        hash to it, or ``CorruptShard`` naming both (a claim it judges: it refetches only a copy
        that fails its own check or that the origin did not vouch for). ``recheck`` asks it to
        re-hash its copy first: this caller's last read of it did not match. ``on_sent`` is called
        once, as soon as the first request is on its way (before its answer: a claimed miss is
        answered only once the whole object is in and checked).

        ``if_cached`` (with ``short_circuit``): a path only for a copy cached now, from any
        ``offset``; an object not cached is answered with its fill's bytes as they land, from
        ``offset`` (for a caller that checks each sample by the shard's member index). ``end``:
        with an ``offset``, the range's end (the object's size: a small rest of an object not
        cached is then read from the origin by range, not after the daemon's whole fill)."""
        sent = [on_sent] if on_sent is not None else []

        def call() -> DaemonObject:
            conn = self._new_connection(self._settings.io_timeout_s)
            headers = {"User-Agent": _USER_AGENT, **self._job_headers}
            if xxh3_128:
                headers["x-shardcache-xxh3-128"] = xxh3_128
            if recheck:
                headers["x-shardcache-recheck"] = "1"
            if offset:
                headers["Range"] = f"bytes={offset}-{end - 1}" if end is not None and end > offset else f"bytes={offset}-"
            path_asked = short_circuit and (not offset or if_cached)
            if path_asked:
                headers["x-shardcache-short-circuit"] = "if-cached" if if_cached else "1"
            try:
                conn.request("GET", self._base + _object_path(bucket, key), headers=headers)
                if sent:
                    sent.pop()()
                resp = conn.getresponse()
            except BaseException:
                conn.close()
                raise
            if resp.status not in (200, 206):
                data = resp.read(MAX_ERROR_BYTES)
                conn.close()
                raise _s3_error(resp.status, data)
            path = resp.getheader("x-shardcache-path")
            if offset and resp.status != 206 and not (path and path_asked):
                conn.close()
                raise SourceError(f"{self.endpoint}: asked bytes {offset}- of {bucket}/{key}, got the whole object")
            length = resp.getheader("Content-Length")
            etag = resp.getheader("ETag")
            obj = DaemonObject(
                size=int(length) if length and length.isdigit() else None,
                etag=etag.strip('"') if etag else None,
                cache=resp.getheader("x-shardcache-cache"),
            )
            if path and path_asked:
                resp.read(65536)  # empty by contract
                conn.close()
                # The object's size: x-shardcache-size when given (an empty answer's Content-Length
                # may be forced to 0 by the server framework), else Content-Length as documented.
                size = resp.getheader("x-shardcache-size")
                if size is not None:
                    obj.size = int(size) if size.strip().isdigit() else None
                obj.path = path
                return obj
            obj.response, obj.conn = resp, conn
            return obj

        return self._wrap_errors(f"GET {bucket}/{key}", key, lambda: self._with_retries(f"GET {bucket}/{key}", call))

    def _wrap_errors(self, what: str, key: str, call: Callable[[], T]) -> T:
        try:
            return call()
        except _DaemonHTTPError as exc:
            where = f"cache endpoint {self.endpoint}: {what}"
            error = loader_error(where, exc.kind, exc.code, exc.message)
            if error is not None:
                raise error from exc
            raise SourceError(f"{where}: {exc}") from exc


def _object_path(bucket: str, key: str) -> str:
    return "/" + urllib.parse.quote(bucket, safe="") + "/" + urllib.parse.quote(key, safe="/~")
