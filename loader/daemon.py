"""Client of the node daemon / sidecar HTTP API (``docs/daemon-api.md``): small, synchronous,
stdlib only, over TCP or a unix socket.

Object bodies stream through a connection of their own (a shard is large; reusing the pooled
connection would block hints and listings behind it). Small calls (stats, listings, prefetch
hints, the manifest) reuse one keep-alive connection per thread and process.
"""

from __future__ import annotations

import http.client
import json
import logging
import random
import time
import urllib.parse
import xml.etree.ElementTree as ET
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from loader.errors import AccessDenied, LoaderError, ShardNotFound, SourceError
from wire.httpclient import (
    AnswerTooLarge,
    ThreadConnections,
    UnixHTTPConnection,
    exchange,
)
from loader.settings import LoaderSettings

__all__ = ["RETRYABLE_HTTP", "DaemonClient", "DaemonObject", "ListedObject"]

log = logging.getLogger(__name__)

T = TypeVar("T")

_USER_AGENT = "shardcache-loader/1"
_S3_NS = "{http://s3.amazonaws.com/doc/2006-03-01/}"
_RETRY_STATUS = {500, 502, 503, 504}
_MAX_SMALL_BODY = 256 << 20  # listings and manifests; anything larger is not what we asked for
RETRYABLE_HTTP: tuple[type[BaseException], ...] = (OSError, http.client.HTTPException)


@dataclass(frozen=True)
class ListedObject:
    key: str
    size: int
    etag: str | None


@dataclass
class DaemonObject:
    """An opened object: either a short-circuit ``path`` or a streaming ``response``."""

    size: int | None
    etag: str | None
    path: str | None = None
    response: http.client.HTTPResponse | None = None
    conn: http.client.HTTPConnection | None = None
    cache: str | None = None  # x-shardcache-cache: hit|miss|coalesced

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None


class _DaemonHTTPError(Exception):
    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(f"HTTP {status} {code}: {message}")
        self.status = status
        self.code = code
        self.message = message


def _s3_error(status: int, body: bytes) -> _DaemonHTTPError:
    code, message = f"HTTP{status}", ""
    try:
        root = ET.fromstring(body[:65536])
        code = (root.findtext("Code") or root.findtext(f"{_S3_NS}Code") or code).strip()
        message = (root.findtext("Message") or root.findtext(f"{_S3_NS}Message") or "").strip()
    except ET.ParseError:
        message = body[:200].decode("utf-8", "replace")
    return _DaemonHTTPError(status, code, message)


class DaemonClient:
    """The cache endpoint as the loader uses it. Safe to share between threads; after a fork
    (DataLoader workers) each process opens its own connections."""

    def __init__(self, endpoint: str, settings: LoaderSettings) -> None:
        self.endpoint = endpoint.rstrip("/")
        self._settings = settings
        parts = urllib.parse.urlsplit(self.endpoint)
        if parts.scheme == "unix":
            self._unix: str | None = urllib.parse.unquote(parts.path)
            self._host, self._port, self._base = "localhost", None, ""
        elif parts.scheme in ("http", "https"):
            self._unix = None
            self._host, self._port, self._base = parts.hostname or "127.0.0.1", parts.port, parts.path.rstrip("/")
        else:
            raise SourceError(f"invalid cache endpoint {endpoint!r}: use http://host:port or unix:///path.sock")
        self._https = parts.scheme == "https"
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
                headers={"User-Agent": _USER_AGENT, **(headers or {})}, max_body=_MAX_SMALL_BODY,
            )
        except AnswerTooLarge as exc:
            # Not a transient fault: listings and manifests this large are not what we asked for.
            raise SourceError(f"{self.endpoint}{path}: {exc}") from exc

    def _with_retries(self, what: str, call: Callable[[], T]) -> T:
        """Run ``call()``, retrying connection errors and 5xx answers with backoff."""
        delay = self._settings.retry_backoff_s
        last: BaseException | None = None
        for attempt in range(self._settings.io_attempts):
            try:
                return call()
            except LoaderError:
                raise  # already a decision (e.g. an oversized answer), not a transient fault
            except _DaemonHTTPError as exc:
                if exc.status not in _RETRY_STATUS:
                    raise
                last = exc
            except RETRYABLE_HTTP as exc:
                last = exc
            if attempt + 1 < self._settings.io_attempts:
                time.sleep(delay * (0.5 + random.random() / 2))
                delay = min(delay * 2, 5.0)
        raise SourceError(
            f"cache endpoint {self.endpoint}: {what} failed after {self._settings.io_attempts} attempts: {last}. "
            "Check that the shardcache daemon/sidecar is running, or unset SHARDCACHE_ENDPOINT to read the origin."
        ) from last

    # -- API ------------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        def call() -> dict[str, Any]:
            status, _, data = self._exchange("GET", "/_shardcache/stats", headers={"Accept": "application/json"})
            if status != 200:
                raise _s3_error(status, data)
            try:
                answer = json.loads(data)
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
                if err.code == "NoSuchBucket":
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
                root = ET.fromstring(data)
            except ET.ParseError as exc:
                raise SourceError(f"{self.endpoint}: malformed ListObjectsV2 answer for {bucket}/{prefix}") from exc
            for item in list(root.iter(f"{_S3_NS}Contents")) + list(root.iter("Contents")):
                key = item.findtext(f"{_S3_NS}Key") or item.findtext("Key")
                size = item.findtext(f"{_S3_NS}Size") or item.findtext("Size") or "0"
                etag = item.findtext(f"{_S3_NS}ETag") or item.findtext("ETag")
                if key is not None:
                    yield ListedObject(key, int(size), etag.strip('"') if etag else None)
            truncated = (root.findtext(f"{_S3_NS}IsTruncated") or root.findtext("IsTruncated") or "false").strip()
            token = root.findtext(f"{_S3_NS}NextContinuationToken") or root.findtext("NextContinuationToken")
            if truncated.lower() != "true" or not token:
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

    def open_object(self, bucket: str, key: str, *, offset: int = 0, short_circuit: bool = False) -> DaemonObject:
        """Open ``bucket/key`` for streaming from byte ``offset`` (retried on connection errors
        and 5xx). With ``short_circuit`` the daemon may answer with the cached file's path."""

        def call() -> DaemonObject:
            conn = self._new_connection(self._settings.io_timeout_s)
            headers = {"User-Agent": _USER_AGENT}
            if offset:
                headers["Range"] = f"bytes={offset}-"
            if short_circuit and not offset:
                headers["x-shardcache-short-circuit"] = "1"
            try:
                conn.request("GET", self._base + _object_path(bucket, key), headers=headers)
                resp = conn.getresponse()
            except BaseException:
                conn.close()
                raise
            if resp.status not in (200, 206):
                data = resp.read(65536)
                conn.close()
                raise _s3_error(resp.status, data)
            if offset and resp.status != 206:
                conn.close()
                raise SourceError(f"{self.endpoint}: asked bytes {offset}- of {bucket}/{key}, got the whole object")
            length = resp.getheader("Content-Length")
            etag = resp.getheader("ETag")
            obj = DaemonObject(
                size=int(length) if length and length.isdigit() else None,
                etag=etag.strip('"') if etag else None,
                cache=resp.getheader("x-shardcache-cache"),
            )
            path = resp.getheader("x-shardcache-path")
            if path and short_circuit and not offset:
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
            if exc.status == 404:
                raise ShardNotFound(f"{where}: {exc.code} ({exc.message or 'not found'})") from exc
            if exc.status == 403:
                raise AccessDenied(f"{where}: {exc.code} ({exc.message or 'access denied'})") from exc
            raise SourceError(f"{where}: {exc}") from exc


def _object_path(bucket: str, key: str) -> str:
    return "/" + urllib.parse.quote(bucket, safe="") + "/" + urllib.parse.quote(key, safe="/~")
