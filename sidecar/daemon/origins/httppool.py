"""A blocking HTTP/1.1 client with kept-alive connections, for reading origin bodies on threads.

Why not aiohttp (or boto3) for the bytes of a fill: both hand every 64-256 KiB the socket returns
to Python as a new ``bytes`` object, and aiohttp does it on the event loop that also sends the
bytes on to trainers. Measured on the daemon benchmark's moto origin, a worker thread that
``readinto``-s 1 MiB at a time straight from the socket into a reused buffer, then ``pwrite``-s
and hashes that buffer, moves a body for 0.45 CPU-seconds per GB where an aiohttp stream costs
0.9, and the GIL is released for the whole recv and write. ``http.client`` does the parsing
(status line, headers, chunked or sized bodies); this module adds the pool, timeouts, a retry of a
request that met a connection the server had closed, and :meth:`Response.abort` to unblock a
reader from another thread.

Errors are the origin errors of :mod:`sidecar.errors`: a request that never got an answer is
:class:`OriginUnavailable` (retry-safe), a body that broke off or stalled is
:class:`OriginBadResponse`.
"""

from __future__ import annotations

import contextlib
import http.client
import socket
import ssl
import threading
import time
from collections.abc import Iterator, Mapping
from urllib.parse import urlsplit

from sidecar.errors import OriginBadResponse, OriginUnavailable

__all__ = ["HTTPPool", "Response"]

_Key = tuple[str, str, int]

# Errors that mean a kept-alive connection was closed by the server while it sat in the pool.
_STALE = (http.client.RemoteDisconnected, http.client.BadStatusLine, ConnectionResetError, BrokenPipeError)


class HTTPPool:
    """Kept-alive connections per (scheme, host, port); thread-safe."""

    def __init__(
        self,
        *,
        max_idle_per_host: int = 64,
        connect_timeout_s: float = 5.0,
        read_timeout_s: float = 30.0,
        idle_timeout_s: float = 20.0,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self.max_idle_per_host = max_idle_per_host
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        # S3 closes a connection idle for ~20 s; reusing one older than that only costs a retry.
        self.idle_timeout_s = idle_timeout_s
        self._ssl_context = ssl_context
        self._idle: dict[_Key, list[tuple[http.client.HTTPConnection, float]]] = {}
        self._lock = threading.Lock()
        self._closed = False

    def request(self, method: str, url: str, headers: Mapping[str, str] | None = None, body: bytes | None = None) -> Response:
        """Send a request (a small ``body``, or none) and return the response once its headers arrived."""
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise OriginUnavailable(f"cannot request {url!r}: not an http(s) URL")
        key = (parts.scheme, parts.hostname, parts.port or (443 if parts.scheme == "https" else 80))
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        for attempt in range(2):
            conn, reused = self._take(key)
            try:
                conn.request(method, target, body=body, headers=dict(headers or {}))
                resp = conn.getresponse()
            except _STALE as exc:
                conn.close()
                if reused and attempt == 0:
                    continue  # the server closed it while idle: one fresh connection
                raise OriginUnavailable(f"{method} {parts.hostname}:{key[2]}: connection lost: {exc}") from exc
            except TimeoutError as exc:
                conn.close()
                raise OriginUnavailable(
                    f"{method} {parts.hostname}:{key[2]}: no answer within {self.read_timeout_s:g} s"
                ) from exc
            except (OSError, http.client.HTTPException) as exc:
                conn.close()
                raise OriginUnavailable(f"{method} {parts.hostname}:{key[2]}: {exc}") from exc
            return Response(self, key, conn, resp)
        raise AssertionError("unreachable")

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, {}
        for conns in idle.values():
            for conn, _ in conns:
                conn.close()

    def _take(self, key: _Key) -> tuple[http.client.HTTPConnection, bool]:
        now = time.monotonic()
        with self._lock:
            conns = self._idle.get(key, [])
            while conns:
                conn, since = conns.pop()
                if now - since < self.idle_timeout_s:
                    return conn, True
                conn.close()
        return self._connect(key), False

    def _connect(self, key: _Key) -> http.client.HTTPConnection:
        scheme, host, port = key
        conn: http.client.HTTPConnection
        if scheme == "https":
            if self._ssl_context is None:
                self._ssl_context = ssl.create_default_context()
            conn = http.client.HTTPSConnection(host, port, timeout=self.connect_timeout_s, context=self._ssl_context)
        else:
            conn = http.client.HTTPConnection(host, port, timeout=self.connect_timeout_s)
        try:
            conn.connect()
        except TimeoutError as exc:
            conn.close()
            raise OriginUnavailable(f"connecting to {host}:{port} timed out after {self.connect_timeout_s:g} s") from exc
        except OSError as exc:
            conn.close()
            raise OriginUnavailable(f"cannot connect to {host}:{port}: {exc}") from exc
        assert conn.sock is not None
        # From here on the timeout bounds each wait for bytes: a stalled origin, not a slow one.
        conn.sock.settimeout(self.read_timeout_s)
        return conn

    def _give_back(self, key: _Key, conn: http.client.HTTPConnection) -> None:
        with self._lock:
            conns = self._idle.setdefault(key, [])
            if not self._closed and len(conns) < self.max_idle_per_host:
                conns.append((conn, time.monotonic()))
                return
        conn.close()


class Response:
    """One response. Read it with :meth:`readinto` (or :meth:`read` for small bodies), then
    :meth:`close`: a body read to its end returns the connection to the pool."""

    def __init__(self, pool: HTTPPool, key: _Key, conn: http.client.HTTPConnection, resp: http.client.HTTPResponse) -> None:
        self._pool = pool
        self._key = key
        self._conn = conn
        self._resp = resp
        self.status = resp.status
        self.headers = resp.headers
        self._closed = False
        self._aborted = False
        self._broken = False  # an error or a premature end: the connection is in an unknown state

    @property
    def length(self) -> int | None:
        """Body bytes not read yet, when the server said (``None`` for a chunked body)."""
        return self._resp.length

    def readinto(self, buf: memoryview) -> int:
        """Fill ``buf`` (up to the end of the body); 0 at the end, or where the body broke off
        (http.client's ``readinto`` does not raise for a short body: callers compare totals)."""
        with self._reading():
            return self._resp.readinto(buf)
        return 0  # the connection was aborted by another thread: no more bytes

    def read(self, limit: int) -> bytes:
        """At most ``limit`` bytes of the body (error documents, listings)."""
        with self._reading():
            return self._resp.read(limit)
        return b""

    @contextlib.contextmanager
    def _reading(self) -> Iterator[None]:
        """Map a failed read to ``OriginBadResponse`` and mark the connection as not reusable; a
        read that failed because :meth:`abort` shut the socket ends quietly instead."""
        try:
            yield
        except TimeoutError as exc:
            self._broken = True
            raise OriginBadResponse(f"origin stalled: no byte for {self._pool.read_timeout_s:g} s") from exc
        except (OSError, http.client.HTTPException, ValueError) as exc:
            # ValueError: http.client reading a response whose connection another thread aborted.
            self._broken = True
            if not self._aborted:
                raise OriginBadResponse(f"body broken off: {exc!r}") from exc

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        resp = self._resp
        if resp.length == 0 and not resp.chunked and not resp.isclosed():
            resp.read()  # nothing left (HEAD, 204, a body read to its end): no I/O
        # Reusable only after a body read to its announced end: a sized body that stopped short
        # leaves ``length`` above zero (http.client closes the response without an error then).
        complete = resp.isclosed() and not resp.length
        if complete and not resp.will_close and not self._aborted and not self._broken:
            self._pool._give_back(self._key, self._conn)
        else:
            resp.close()
            self._conn.close()

    def abort(self) -> None:
        """Unblock a :meth:`readinto` in progress on another thread; the connection is not reused."""
        self._aborted = True
        sock = self._conn.sock
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
