"""The pod's handle socket (``SHARDCACHE_HANDLES``): short-circuit reads by file descriptor.

The sidecar passes the descriptor of an authorized, verified cache entry (``wire.handles``); the
loader reads the shard from it as from a file, and falls back to HTTP (:mod:`loader.daemon`)
whenever there is no descriptor to get.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from loader.daemon import DaemonObject, loader_error
from loader.errors import CorruptShard
from loader.settings import LoaderSettings
from wire.handles import MAX_REPLY, HandleProtocolError, recv_message, send_message
from wire.s3errors import classify

__all__ = ["HANDLES_RETRY_S", "HandleClient"]

log = logging.getLogger(__name__)


HANDLES_RETRY_S = 30.0
"""How long a handle socket found unreachable (or speaking something else) is left alone before
it is asked again; its shards read over HTTP meanwhile. Long enough that a pod without a working
socket pays one failed connect per half minute, short enough that a restarted sidecar is used
again soon."""


class _ThreadSockets:
    """One kept-alive socket per thread and process (as :class:`~wire.httpclient.ThreadConnections`
    for HTTP): a forked DataLoader worker starts with none, never sharing its parent's stream."""

    def __init__(self, path: str, timeout: float) -> None:
        self._path, self._timeout = path, timeout
        self._local = threading.local()
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()
        self._pid = os.getpid()

    def get(self) -> tuple[socket.socket, bool]:
        """This thread's socket, and whether it was connected just now (``OSError`` when the
        socket cannot be reached)."""
        pid = os.getpid()
        sock: socket.socket | None = getattr(self._local, "sock", None)
        if sock is not None and self._local.pid == pid and sock.fileno() != -1:
            return sock, False
        with self._lock:
            if self._pid != pid:
                self._pid, self._open = pid, set()  # the parent's, not ours to close
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(self._timeout)
            sock.connect(self._path)
        except BaseException:
            sock.close()
            raise
        self._local.sock, self._local.pid = sock, pid
        with self._lock:
            self._open.add(sock)
        return sock, True

    def discard(self) -> None:
        sock: socket.socket | None = getattr(self._local, "sock", None)
        self._local.sock = None
        if sock is not None and self._local.pid == os.getpid():
            with self._lock:
                self._open.discard(sock)
            sock.close()

    def close(self) -> None:
        with self._lock:
            socks, self._open = list(self._open), set()
            if self._pid != os.getpid():
                return
        for sock in socks:
            with contextlib.suppress(OSError):
                sock.close()


class HandleClient:
    """The pod's handle socket as the loader uses it (``wire.handles``): :meth:`open` asks for an
    object's descriptor. Safe to share between threads (a connection each).

    ``None`` from :meth:`open` means "read it over HTTP": the object has no handle (``409
    NotCached``: not cacheable, the cache full), the sidecar cannot reach its node daemon
    (``503``), or the socket is unreachable or broken, which also pauses asking it for
    :data:`HANDLES_RETRY_S`. The answers the HTTP API would raise for (403, 404, a checksum that
    is not the object's) raise here the same errors (``loader.daemon.loader_error``)."""

    def __init__(self, address: str, settings: LoaderSettings, retry_s: float = HANDLES_RETRY_S,
                 job: str | None = None) -> None:
        if not address.startswith("unix://"):
            raise ValueError(f"a handle socket is unix:///path.sock, not {address!r}")
        self.address = address
        self.job = job
        """The reader's job, named in every request (the daemon's per-job figures); checked by
        :class:`loader.daemon.DaemonClient`, which passes it on only when it is a valid name."""
        self._sockets = _ThreadSockets(address[len("unix://") :], settings.io_timeout_s)
        self._retry_s = retry_s
        self._paused_until = 0.0
        self.received = 0
        """Descriptors received (in this process): what reads took the short circuit."""

    def available(self) -> bool:
        """Whether to ask the socket at all (not paused after finding it unreachable)."""
        return time.monotonic() >= self._paused_until

    def pause(self, why: str) -> None:
        """Leave the socket alone for a while: ``why`` is logged, the reads go over HTTP."""
        if self.available():
            log.info("handle socket %s: %s; reading over HTTP for the next %.0f s", self.address, why, self._retry_s)
        self._paused_until = time.monotonic() + self._retry_s

    def close(self) -> None:
        """Close the kept-alive connections of every thread (received descriptors stay open)."""
        self._sockets.close()

    def open(
        self, bucket: str, key: str, *, xxh3_128: str | None = None, recheck: bool = False,
        on_sent: Callable[[], None] | None = None,
    ) -> DaemonObject | None:
        """``bucket/key``'s descriptor (in ``fd``) and what the daemon says of it, or None: read
        it over HTTP. ``xxh3_128``, ``recheck`` and ``on_sent`` as
        :meth:`DaemonClient.open_object` takes them."""
        request: dict[str, Any] = {"op": "open", "bucket": bucket, "key": key}
        if xxh3_128:
            request["xxh3_128"] = xxh3_128
        if recheck:
            request["recheck"] = True
        if self.job:
            request["job"] = self.job
        answer = self._exchange(request, on_sent)
        if answer is None:
            return None
        message, fd = answer
        try:
            obj = self._answer(bucket, key, xxh3_128, message, fd)
        except BaseException:
            if fd is not None:
                os.close(fd)
            raise
        if obj is None and fd is not None:
            os.close(fd)  # with an error answer, or one this client refused: not ours to read
        return obj

    def _exchange(
        self, request: dict[str, Any], on_sent: Callable[[], None] | None
    ) -> tuple[dict[str, Any], int | None] | None:
        """Send ``request`` and take its reply; a kept-alive connection found closed or broken is
        replaced once (the request only opens a file: asking again is harmless)."""
        for _ in range(2):
            try:
                sock, fresh = self._sockets.get()
            except OSError as exc:
                self.pause(f"cannot connect ({exc.strerror or exc})")
                return None
            try:
                send_message(sock, request)
                if on_sent is not None:
                    on_sent()
                    on_sent = None
                answer = recv_message(sock, MAX_REPLY)
            except HandleProtocolError as exc:
                self._sockets.discard()
                self.pause(f"not a handle answer ({exc})")
                return None
            except (TimeoutError, OSError) as exc:
                self._sockets.discard()
                if fresh or isinstance(exc, TimeoutError):
                    # A connection of its own failed, or the answer took longer than io_timeout_s:
                    # asking again would cost as much.
                    self.pause(f"no answer ({exc.strerror or exc})")
                    return None
                continue  # the kept-alive connection broke under us
            if answer is not None:
                return answer
            self._sockets.discard()
            if fresh:
                self.pause("it closed a new connection without answering")
                return None
            # Closed between messages (the server's idle timeout): a new connection.
        self.pause("connections break before their answer")
        return None

    def _answer(
        self, bucket: str, key: str, claim: str | None, message: dict[str, Any], fd: int | None
    ) -> DaemonObject | None:
        where = f"handle socket {self.address}: open {bucket}/{key}"
        status = message.get("status")
        if not isinstance(status, int) or isinstance(status, bool):
            self.pause(f"answered without a status: {str(message)[:200]}")
            return None
        if status != 200:
            code = message.get("error")
            code = code if isinstance(code, str) else ""
            text = message.get("message")
            text = text if isinstance(text, str) else ""
            error = loader_error(where, classify(status, code), code or f"HTTP{status}", text)
            if error is not None:
                raise error
            # NotCached, a sidecar without its daemon, an overloaded one: HTTP has the answer.
            log.debug("%s: %s %s (%s); reading it over HTTP", where, status, code, text)
            return None
        if fd is None:
            self.pause("a 200 answer came without a descriptor")
            return None
        size = message.get("size")
        etag = message.get("etag")
        digest = message.get("xxh3_128")
        cache = message.get("cache")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            self.pause(f"a 200 answer without a size: {str(message)[:200]}")
            return None
        digest = digest.lower() if isinstance(digest, str) and digest else None
        if claim and digest and digest != claim.lower():
            # An answer holds only bytes with the claimed hash (docs/daemon-api.md): this one
            # does not, so nothing is read from it (the loader reads again, with recheck).
            raise CorruptShard(f"{where}: the descriptor's bytes hash to {digest}, the manifest says {claim}")
        self.received += 1
        return DaemonObject(
            size=size,
            etag=etag.strip('"') if isinstance(etag, str) and etag else None,
            cache=cache if isinstance(cache, str) else None,
            fd=fd,
            xxh3_128=digest,
        )
