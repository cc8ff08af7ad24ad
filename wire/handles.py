"""Short-circuit by handle: how an open file descriptor of a cached object travels.

Instead of a cache path (which only a pod holding the whole cache directory can open, so every
object any tenant cached), the node daemon opens an authorized, verified entry itself and passes
the descriptor over a unix socket (``SCM_RIGHTS``): to the pod's sidecar over the node socket
directory, and the sidecar on to the app container over a pod-local socket in an ``emptyDir``.
The receiver reads the file as it would have read the path; it cannot name any other file.

One JSON object per line each way, on a kept-alive stream socket:

* request (at most :data:`MAX_REQUEST` bytes): ``{"op": "open", "bucket", "key",
  "xxh3_128"?, "recheck"?, "session"?, "proof"?}`` (``session``/``proof`` as the HTTP headers of
  ``--auth sigv4``, added by the sidecar);
* reply (at most :data:`MAX_REPLY` bytes): ``{"status": 200, "size", "etag", "xxh3_128",
  "cache"}`` with exactly one descriptor attached, or ``{"status": 4xx|5xx, "error", "message"}``
  with none (the status and code the HTTP API would answer).

Strictly one request, then its reply: no pipelining (a reader takes what arrived as one message).

What the error replies mean to a client (the loader):

* 409 :data:`NOT_CACHED`: the daemon does not keep this object (``manifest.json``, a full cache,
  the tenant's quota): read it over HTTP, where it streams from the origin;
* 503 ``ServiceUnavailable`` / ``SlowDown``: no node daemon behind the sidecar, or too many
  connections: read over HTTP (the sidecar's standalone cache answers there);
* 400, 403 ``AccessDenied``, 404 ``NoSuchKey``, 409 ``ChecksumMismatch``, 502: what the HTTP GET
  of the object would answer, for the same reason. A 403 may carry ``"renew": true`` (as the
  HTTP header ``x-shardcache-auth: renew``): the sidecar opens a new session and asks once more.

The descriptor is read-only and its own: the daemon and the sidecar close their copies once it
is sent. Its file offset is 0 and shared with nobody who reads; read it with ``pread``/``mmap``.
A received descriptor is close-on-exec (``MSG_CMSG_CLOEXEC``), so a child process the receiver
starts does not inherit cache files.

Blocking sockets; stdlib only (``socket.send_fds``/``recvmsg``): both the loader and the daemon
use it.
"""

from __future__ import annotations

import array
import json
import os
import socket
import time
from typing import Any

from wire import jsontext
from wire.errors import WireError

__all__ = [
    "MAX_REPLY", "MAX_REQUEST", "NOT_CACHED", "HandleProtocolError", "exchange", "recv_message", "send_message",
]

MAX_REQUEST = 16 * 1024
MAX_REPLY = 64 * 1024
NOT_CACHED = "NotCached"
"""The error code of a 409 for an object the daemon does not cache: read it over HTTP."""
_MAX_FDS = 4  # room for a misbehaving peer's extras, all closed
# Linux: received descriptors are close-on-exec atomically; elsewhere 0 (and os.set_inheritable).
_CLOEXEC = getattr(socket, "MSG_CMSG_CLOEXEC", 0)


class HandleProtocolError(WireError, ConnectionError):
    """The peer broke the protocol (no JSON object, too long, descriptors where none belong)."""


def send_message(sock: socket.socket, message: dict[str, Any], fd: int | None = None) -> None:
    """Send one message, with ``fd`` attached when given (the sender keeps its own copy)."""
    data = json.dumps(message, separators=(",", ":")).encode() + b"\n"
    if fd is None:
        sock.sendall(data)
        return
    sent = socket.send_fds(sock, [data], [fd])
    if sent < len(data):
        sock.sendall(data[sent:])  # the descriptor went with the first bytes


def recv_message(
    sock: socket.socket, limit: int, deadline: float | None = None
) -> tuple[dict[str, Any], int | None] | None:
    """The next message and the descriptor that came with it; ``None`` when the peer closed the
    connection between messages. Descriptors beyond one are closed, and the message refused.

    ``deadline`` (a :func:`time.monotonic` time) bounds the whole message, however slowly its
    bytes trickle in (``TimeoutError`` past it); it sets the socket's timeout as it goes."""
    data = b""
    fds: list[int] = []
    try:
        while not data.endswith(b"\n"):
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError("no complete message in time")
                sock.settimeout(left)
            chunk, ancillary, flags, _ = sock.recvmsg(limit + 1 - len(data), socket.CMSG_SPACE(_MAX_FDS * 4), _CLOEXEC)
            for level, kind, payload in ancillary:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    received = array.array("i")
                    received.frombytes(payload[: len(payload) - len(payload) % received.itemsize])
                    fds.extend(received)
            if not _CLOEXEC:
                for fd in fds:
                    os.set_inheritable(fd, False)
            if flags & socket.MSG_CTRUNC:
                raise HandleProtocolError(f"more than {_MAX_FDS} descriptors with one message")
            if not chunk:
                if data:
                    raise HandleProtocolError("connection closed in the middle of a message")
                if fds:
                    raise HandleProtocolError("descriptors without a message")
                return None
            data += chunk
            if len(data) > limit:
                raise HandleProtocolError(f"message longer than {limit} bytes")
        if len(fds) > 1:
            raise HandleProtocolError(f"{len(fds)} descriptors with one message")
        try:
            message = jsontext.loads(data)
        except ValueError as exc:
            raise HandleProtocolError(f"not a JSON message: {exc}") from exc
        if not isinstance(message, dict):
            raise HandleProtocolError("a message is a JSON object")
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return message, (fds[0] if fds else None)


def exchange(
    sock: socket.socket, request: dict[str, Any], deadline: float | None = None
) -> tuple[dict[str, Any], int | None]:
    """One request and its reply, checked: a 200 with exactly one descriptor, anything else
    with none (a stray one is closed, and the reply refused). The caller closes the descriptor.
    Raises :class:`HandleProtocolError` when the peer closed the connection instead of replying."""
    send_message(sock, request)
    received = recv_message(sock, MAX_REPLY, deadline)
    if received is None:
        raise HandleProtocolError("the peer closed the connection instead of replying")
    reply, fd = received
    status = reply.get("status")
    if type(status) is not int or (status == 200) != (fd is not None):
        if fd is not None:
            os.close(fd)
        raise HandleProtocolError(f"a reply with status {status!r} and {'a' if fd is not None else 'no'} descriptor")
    return reply, fd
