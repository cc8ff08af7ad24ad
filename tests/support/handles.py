"""The app container's side of the daemon's handle socket (``--handles``): a request, the reply
and the file descriptor passed with it, and reading a descriptor as the loader does."""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any

from wire.handles import exchange

__all__ = ["ask", "connect", "read_all", "read_fd", "read_handle", "refused"]


def connect(path: Path, timeout: float = 30.0) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    # Blocking while connecting: with a timeout, a unix socket's connect() fails at once (EAGAIN)
    # while the server's backlog is full instead of waiting its turn.
    sock.connect(str(path))
    sock.settimeout(timeout)
    return sock


def ask(path: Path, bucket: str, key: str, **fields: Any) -> tuple[dict[str, Any], int | None]:
    """One request on a new connection: the reply and the descriptor (the caller closes it)."""
    with connect(path) as sock:
        return exchange(sock, {"op": "open", "bucket": bucket, "key": key, **fields})


def read_all(fd: int) -> bytes:
    """Everything in the file behind ``fd``, read as the loader does: pread (``fd`` stays open)."""
    size = os.fstat(fd).st_size
    data = b""
    while len(data) < size:
        chunk = os.pread(fd, size - len(data), len(data))
        if not chunk:
            break
        data += chunk
    return data


def read_fd(fd: int) -> bytes:
    """:func:`read_all`, then ``fd`` closed."""
    try:
        return read_all(fd)
    finally:
        os.close(fd)


def read_handle(path: Path, bucket: str, key: str, **fields: Any) -> tuple[dict[str, Any], bytes]:
    reply, fd = ask(path, bucket, key, **fields)
    assert reply["status"] == 200 and fd is not None, reply
    return reply, read_fd(fd)


def refused(path: Path, bucket: str, key: str, **fields: Any) -> dict[str, Any]:
    """A request that must get an error reply and no descriptor (exchange checks the pairing)."""
    reply, fd = ask(path, bucket, key, **fields)
    assert fd is None and reply["status"] != 200, reply
    return reply
