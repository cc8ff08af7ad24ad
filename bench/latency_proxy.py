"""A TCP proxy that makes a loopback S3 endpoint behave like a remote object store.

Two properties of a real object store starve trainers, and a loopback moto server has neither:

- **request latency**: every request waits ``--delay-ms`` (one way, client to server) before the
  server sees it, so each GET costs at least that much before its first byte. The delay is a
  pipe delay, not a pause: bytes are forwarded at ``arrival + delay`` in order, so pipelined or
  concurrent requests overlap their delays exactly as on a long link.
- **single-stream throughput** (optional, ``--stream-mbps``): each connection's answers are paced
  to that many MB/s (10^6 bytes), as one S3 connection gives ~50-100 MB/s however fast the
  network; clients that open several connections (ranged GETs) get several times that.
- **total throughput** (optional, ``--total-mbps``): the answers of all connections together are
  paced to that many MB/s through one shared token bucket, as a node's share of a WAN link or a
  throttled gateway caps a reader however many connections it opens.

    python -m bench.latency_proxy --upstream 127.0.0.1:5000 --port 5001 --delay-ms 20

:class:`LatencyProxy` runs it in its own process for the benchmark suite.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import socket
import sys
import time
from collections import deque
from pathlib import Path

from bench.servers import ServerProcess

__all__ = ["LatencyProxy", "SharedRate", "serve", "main"]

_CHUNK = 256 * 1024


async def _pipe_delayed(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay_s: float) -> None:
    """Forward reader → writer, each chunk ``delay_s`` after it arrived, order kept."""
    loop = asyncio.get_running_loop()
    pending: deque[tuple[float, bytes]] = deque()
    arrived = asyncio.Event()
    eof = False

    async def intake() -> None:
        nonlocal eof
        while True:
            data = await reader.read(_CHUNK)
            if not data:
                break
            pending.append((loop.time() + delay_s, data))
            arrived.set()
        eof = True
        arrived.set()

    feeder = asyncio.create_task(intake(), name="proxy-intake")
    try:
        while True:
            if not pending:
                if eof:
                    break
                arrived.clear()
                await arrived.wait()
                continue
            due, data = pending.popleft()
            wait = due - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
            writer.write(data)
            await writer.drain()
        with contextlib.suppress(OSError):
            writer.write_eof()
    finally:
        feeder.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await feeder


class SharedRate:
    """One token bucket for every connection of the proxy: each chunk reserves its transmission
    slot after the slots already reserved (by any connection), so the connections together never
    exceed ``bytes_per_s`` and share it in arrival order. No burst credit is kept over idle time."""

    def __init__(self, bytes_per_s: float) -> None:
        if bytes_per_s <= 0:
            raise ValueError("bytes_per_s must be positive")
        self.bytes_per_s = bytes_per_s
        self.next_free = 0.0

    def reserve(self, now: float, size: int) -> float:
        """The time at which ``size`` bytes reserved now have been sent."""
        self.next_free = max(self.next_free, now) + size / self.bytes_per_s
        return self.next_free


async def _pipe_paced(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, bytes_per_s: float | None,
                      shared: SharedRate | None = None) -> None:
    """Forward reader → writer, at most ``bytes_per_s`` (a token bucket with no burst credit
    carried over idle time, so a new answer starts at the stream rate, not above it) and, with
    ``shared``, within the proxy-wide rate as well."""
    loop = asyncio.get_running_loop()
    next_free = 0.0
    # Smaller chunks under a shared cap: a 256 KiB reservation at a few MB/s would hold the
    # bucket for tens of ms and make the other connections' answers bursty.
    chunk = _CHUNK if shared is None else 64 * 1024
    while True:
        data = await reader.read(chunk)
        if not data:
            break
        if bytes_per_s or shared is not None:
            now = loop.time()
            due = now
            if bytes_per_s:
                next_free = max(next_free, now) + len(data) / bytes_per_s
                due = next_free
            if shared is not None:
                due = max(due, shared.reserve(now, len(data)))
            if due - now > 0.001:
                await asyncio.sleep(due - now)
        writer.write(data)
        await writer.drain()
    with contextlib.suppress(OSError):
        writer.write_eof()


async def serve(port: int, upstream: tuple[str, int], delay_s: float, bytes_per_s: float | None,
                ready: asyncio.Event | None = None, total_bytes_per_s: float | None = None) -> None:
    shared = SharedRate(total_bytes_per_s) if total_bytes_per_s else None

    async def handle(creader: asyncio.StreamReader, cwriter: asyncio.StreamWriter) -> None:
        try:
            sreader, swriter = await asyncio.open_connection(*upstream)
        except OSError:
            cwriter.close()
            return
        for w in (cwriter, swriter):
            sock = w.get_extra_info("socket")
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        tasks = [asyncio.create_task(_pipe_delayed(creader, swriter, delay_s), name="proxy-up"),
                 asyncio.create_task(_pipe_paced(sreader, cwriter, bytes_per_s, shared), name="proxy-down")]
        try:
            # Either side closing ends the pair: the other direction cannot make progress.
            await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        finally:
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
            for w in (cwriter, swriter):
                with contextlib.suppress(Exception):
                    w.close()

    server = await asyncio.start_server(handle, "127.0.0.1", port, backlog=1024)
    if ready is not None:
        ready.set()
    async with server:
        await server.serve_forever()


class LatencyProxy(ServerProcess):
    """:func:`serve` in its own process (a ``bench.servers.ServerProcess``), in front of ``upstream``."""

    name = "latency proxy"

    def __init__(self, upstream: str, delay_ms: float, stream_mbps: float | None, log: Path,
                 total_mbps: float | None = None) -> None:
        super().__init__(log)
        self.upstream = upstream.removeprefix("http://").rstrip("/")
        self.delay_ms = delay_ms
        self.stream_mbps = stream_mbps
        self.total_mbps = total_mbps

    def command(self) -> list[str]:
        args = [sys.executable, "-m", "bench.latency_proxy", "--port", str(self.port), "--upstream", self.upstream,
                "--delay-ms", str(self.delay_ms)]
        if self.stream_mbps:
            args += ["--stream-mbps", str(self.stream_mbps)]
        if self.total_mbps:
            args += ["--total-mbps", str(self.total_mbps)]
        return args


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.latency_proxy",
        description="TCP proxy adding a per-request delay (and optionally per-connection and total rate caps)",
        epilog="examples:\n  python -m bench.latency_proxy --upstream 127.0.0.1:5000 --port 5001 --delay-ms 20 --stream-mbps 100\n"
               "  python -m bench.latency_proxy --upstream 127.0.0.1:5000 --port 5001 --delay-ms 20 --total-mbps 60",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--port", type=int, required=True, help="port to listen on (127.0.0.1)")
    parser.add_argument("--upstream", required=True, help="host:port to forward to")
    parser.add_argument("--delay-ms", type=float, default=20.0, help="one-way delay added to every request")
    parser.add_argument("--stream-mbps", type=float, default=None, help="per-connection answer rate cap, MB/s")
    parser.add_argument("--total-mbps", type=float, default=None,
                        help="cap on the answers of all connections together, MB/s (shared token bucket)")
    args = parser.parse_args(argv)
    host, _, port = args.upstream.rpartition(":")
    if not host or not port.isdigit() or args.delay_ms < 0:
        parser.error("--upstream must be host:port and --delay-ms >= 0")
    if (args.stream_mbps is not None and args.stream_mbps <= 0) or (args.total_mbps is not None and args.total_mbps <= 0):
        parser.error("--stream-mbps and --total-mbps must be > 0")
    rate = args.stream_mbps * 1e6 if args.stream_mbps else None
    total = args.total_mbps * 1e6 if args.total_mbps else None
    started = time.monotonic()
    try:
        asyncio.run(serve(args.port, (host, int(port)), args.delay_ms / 1000, rate, total_bytes_per_s=total))
    except KeyboardInterrupt:
        pass
    print(f"latency proxy ran {time.monotonic() - started:.0f}s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
