"""The least a process between a reader and its store can cost: a TCP relay that moves bytes with
``splice(2)`` (socket to pipe to socket, never into user space), no parsing, no hashing, no disk.

``bench.daemon_bench`` reads through it (``relay_x4``) beside the daemon: any cache that is a
process of its own on the read path costs at least this relay's CPU per byte (each byte crosses
loopback twice, and the kernel's TCP work on both hops), so its figure against plain boto3 is an
upper bound on what such a daemon can reach on the machine, whatever the daemon does.

    python -m bench.splice_relay --upstream 127.0.0.1:5000 --port 5001

:class:`SpliceRelay` runs it in its own process (a ``bench.servers.ServerProcess``).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import sys
import threading
from pathlib import Path

from bench.servers import ServerProcess

__all__ = ["SpliceRelay", "serve", "main"]

_SPLICE_BYTES = 1 << 20


def _pump(src: socket.socket, dst: socket.socket) -> None:
    """Move ``src``'s bytes to ``dst`` through a pipe until ``src`` ends, then close both ways."""
    r, w = os.pipe()
    try:
        while True:
            moved = os.splice(src.fileno(), w, _SPLICE_BYTES)
            if not moved:
                break
            while moved:
                moved -= os.splice(r, dst.fileno(), moved)
    except OSError:
        pass  # the other side went away: the shutdowns below end its pump too
    finally:
        os.close(r)
        os.close(w)
        for sock in (src, dst):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)


def serve(port: int, upstream: tuple[str, int], host: str = "127.0.0.1") -> None:
    """Relay every connection to ``port`` to ``upstream``: a thread per direction (blocking
    splices; the GIL is released in each)."""
    listener = socket.create_server((host, port), backlog=128, reuse_port=False)
    while True:
        client, _ = listener.accept()
        try:
            server = socket.create_connection(upstream)
        except OSError:
            client.close()
            continue
        for src, dst in ((client, server), (server, client)):
            threading.Thread(target=_pump, args=(src, dst), daemon=True).start()


class SpliceRelay(ServerProcess):
    """:func:`serve` in its own process, in front of ``upstream`` (``http://host:port``)."""

    name = "splice relay"

    def __init__(self, upstream: str, log: Path) -> None:
        super().__init__(log)
        self.upstream = upstream.removeprefix("http://").rstrip("/")

    def command(self) -> list[str]:
        return [sys.executable, "-m", "bench.splice_relay", "--port", str(self.port), "--upstream", self.upstream]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.splice_relay",
                                     description="TCP relay by splice(2): the least a process on the read path costs")
    parser.add_argument("--upstream", required=True, help="HOST:PORT to relay to")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--host", default="127.0.0.1")
    args = parser.parse_args(argv)
    host, _, port = args.upstream.rpartition(":")
    if not host or not port.isdigit():
        parser.error(f"--upstream takes HOST:PORT, not {args.upstream!r}")
    with contextlib.suppress(KeyboardInterrupt):
        serve(args.port, (host, int(port)), args.host)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
