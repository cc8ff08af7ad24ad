"""``http.client`` pieces shared by the small JSON clients: the loader's daemon and master
clients and the CLI's daemon client (stdlib only, so ``import loader`` stays light).

:class:`UnixHTTPConnection` carries the daemon's and the master's ``unix://`` addresses;
:class:`ThreadConnections` keeps one connection per thread and server; :func:`exchange` is one
bounded request on such a kept-alive connection.
"""

from __future__ import annotations

import http.client
import os
import socket
import threading
from collections.abc import Callable, Mapping

__all__ = ["STALE_CONNECTION", "AnswerTooLarge", "ThreadConnections", "UnixHTTPConnection", "exchange"]

# What a kept-alive connection the server closed while it sat idle raises on its next use.
STALE_CONNECTION: tuple[type[BaseException], ...] = (
    http.client.RemoteDisconnected,
    BrokenPipeError,
    ConnectionResetError,
)


class AnswerTooLarge(http.client.HTTPException):
    """The answer's body is larger than the caller's bound (its connection is closed)."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"answer larger than {limit} bytes")
        self.limit = limit


class UnixHTTPConnection(http.client.HTTPConnection):
    """An ``HTTPConnection`` whose transport is the unix socket at ``path``."""

    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self._path)
        except BaseException:
            sock.close()
            raise
        self.sock = sock


class ThreadConnections:
    """Kept-alive connections, one per thread and key (a server's URL), made by ``factory(key)``.

    ``http.client`` connections are not thread-safe, and the clients built on this are shared
    by a trainer's threads (renewer, prefetcher, readers). A forked child (a DataLoader worker)
    starts with none: the parent's sockets are shared with it and must neither carry the child's
    requests nor be closed by it. :meth:`close` ends every connection, whichever thread made it
    (a call in flight on another thread then fails, and retries on a fresh one).
    """

    def __init__(self, factory: Callable[[str], http.client.HTTPConnection]) -> None:
        self._factory = factory
        self._local = threading.local()
        self._lock = threading.Lock()
        self._open: set[http.client.HTTPConnection] = set()
        self._pid = os.getpid()

    def _mine(self) -> dict[str, http.client.HTTPConnection]:
        pid = os.getpid()
        conns: dict[str, http.client.HTTPConnection] | None = getattr(self._local, "conns", None)
        if conns is None or self._local.pid != pid:
            conns = self._local.conns = {}
            self._local.pid = pid
            with self._lock:
                if self._pid != pid:
                    self._pid, self._open = pid, set()
        return conns

    def get(self, key: str = "") -> http.client.HTTPConnection:
        conns = self._mine()
        conn = conns.get(key)
        if conn is None:
            conn = conns[key] = self._factory(key)
        with self._lock:
            # Also after close() on another thread: http.client reopens a closed connection.
            self._open.add(conn)
        return conn

    def discard(self, key: str = "") -> None:
        conn = self._mine().pop(key, None)
        if conn is not None:
            with self._lock:
                self._open.discard(conn)
            conn.close()

    def open_count(self) -> int:
        with self._lock:
            return len(self._open)

    def close(self) -> None:
        with self._lock:
            conns, self._open = self._open, set()
        for conn in conns:
            conn.close()


def exchange(
    connection: Callable[[], http.client.HTTPConnection],
    discard: Callable[[], None],
    method: str,
    path: str,
    *,
    body: bytes | None = None,
    headers: Mapping[str, str] | None = None,
    max_body: int,
) -> tuple[int, http.client.HTTPMessage, bytes]:
    """Send one request on ``connection()`` and read its whole answer, at most ``max_body`` bytes.

    A connection the server closed while it was idle in the pool is not the server being down:
    one immediate retry on a fresh connection (``discard()`` drops the pooled one, and the next
    ``connection()`` call makes a new one). Any other failure discards the connection and raises:
    ``OSError`` or ``http.client.HTTPException`` (a cut answer is ``IncompleteRead``, a body over
    the bound :class:`AnswerTooLarge`), for the caller's own retry policy to judge. An answer left
    unread would corrupt the next exchange on the same connection, so a connection is only kept
    after its answer was read to the end.
    """
    for attempt in (0, 1):
        conn = connection()
        try:
            conn.request(method, path, body=body, headers=dict(headers or {}))
            resp = conn.getresponse()
            data = resp.read(max_body + 1)
            if len(data) > max_body:
                raise AnswerTooLarge(max_body)
            if resp.length:
                # read(amt) returns what arrived when the peer closes early: a cut answer.
                raise http.client.IncompleteRead(data, resp.length)
        except STALE_CONNECTION:
            discard()
            if attempt:
                raise
            continue
        except BaseException:
            discard()
            raise
        if resp.will_close:
            discard()
        return resp.status, resp.headers, data
    raise AssertionError("unreachable")
