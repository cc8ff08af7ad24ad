"""Proxies between a client and a real server, each on its own thread over real sockets:
:class:`FaultProxy` between the daemon and the S3 origin counts requests and injects faults
(503 SlowDown, resets, stalls, truncated or flipped bodies, a trickle); :class:`TcpForwarder`
forwards TCP to a real master, the base of the test proxies that count what a client sends or lose
an answer on the way back.

The fault proxy forwards each request on a fresh upstream connection (``Connection: close``) and
reads the whole answer before it is (maybe mangled and) sent back.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import re
import socket
import threading
import time
from dataclasses import dataclass, field

__all__ = ["FaultProxy", "Faults", "TcpForwarder"]

_LEN_RE = re.compile(rb"\r\ncontent-length:\s*(\d+)", re.IGNORECASE)


@dataclass
class Faults:
    """Faults to inject; each counter is decremented as it fires (``-1``: every time)."""

    slowdown: int = 0          # answer 503 SlowDown instead of forwarding
    reset: int = 0             # close the connection without answering
    truncate: int = 0          # send headers and only part of the body, then close
    truncate_at: int = 1000
    delay_s: float = 0.0       # wait before answering
    body_delay_s: float = 0.0  # wait between header and body (a slow origin mid-transfer)
    trickle_bps: float = 0.0   # send bodies at this many bytes per second (a slow transfer)
    stall: int = 0             # hold the answer back for stall_s (longer than the client's timeout)
    stall_s: float = 2.0
    flip: int = 0              # flip one bit of the body's byte at flip_at (a body that long or longer)
    flip_at: int = 1000
    only_get: bool = True      # faults apply to GETs of objects only


@dataclass
class FaultProxy:
    upstream_host: str
    upstream_port: int
    faults: Faults = field(default_factory=Faults)
    requests: collections.Counter[str] = field(default_factory=collections.Counter)
    log: list[str] = field(default_factory=list)
    timeline: list[tuple[float, str]] = field(default_factory=list)  # (time.monotonic(), request line)

    def __post_init__(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._server: asyncio.base_events.Server | None = None
        self._thread = threading.Thread(target=self._loop.run_forever, name="faultproxy", daemon=True)
        self.port = 0

    def start(self) -> FaultProxy:
        self._thread.start()
        fut = asyncio.run_coroutine_threadsafe(self._start(), self._loop)
        fut.result(10)
        return self

    async def _start(self) -> None:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        async def _close() -> None:
            if self._server is not None:
                self._server.close()
                # Python 3.11's wait_closed waits for client handlers too: don't hang on keep-alives.
                tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
                for task in tasks:
                    task.cancel()

        asyncio.run_coroutine_threadsafe(_close(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def gets(self, path_fragment: str) -> int:
        return sum(n for line, n in self.requests.items() if line.startswith("GET ") and path_fragment in line)

    def _take(self, name: str) -> bool:
        value = getattr(self.faults, name)
        if value == 0:
            return False
        if value > 0:
            setattr(self.faults, name, value - 1)
        return True

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                request_line = head.split(b"\r\n", 1)[0].decode("latin-1")
                method, target = request_line.split(" ")[:2]
                path = target.split("?", 1)[0]
                match = _LEN_RE.search(head)
                body = await reader.readexactly(int(match.group(1))) if match else b""
                key = f"{method} {path}"
                self.requests[key] += 1
                self.log.append(request_line)
                self.timeline.append((time.monotonic(), request_line))
                is_object_get = method == "GET" and path.count("/") >= 2 and "list-type" not in target
                faultable = is_object_get or not self.faults.only_get
                # A request's faults are drawn when it arrives: a handler still sleeping out a stall
                # must not take faults armed afterwards for later requests.
                stall = faultable and self._take("stall")
                reset = faultable and self._take("reset")
                slowdown = faultable and not reset and self._take("slowdown")
                truncate = faultable and not reset and not slowdown and self._take("truncate")
                if self.faults.delay_s:
                    await asyncio.sleep(self.faults.delay_s)
                if stall:
                    await asyncio.sleep(self.faults.stall_s)
                if reset:
                    writer.transport.abort()
                    return
                if slowdown:
                    payload = (
                        b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code>'
                        b"<Message>Please reduce your request rate.</Message></Error>"
                    )
                    writer.write(
                        b"HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\n"
                        + f"Content-Length: {len(payload)}\r\n\r\n".encode()
                        + payload
                    )
                    await writer.drain()
                    continue
                response = await self._forward(head, body)
                header_end = response.index(b"\r\n\r\n") + 4
                at = header_end + self.faults.flip_at
                if faultable and at < len(response) and self._take("flip"):
                    # One bit on the wire: the length, the headers and the framing stay right.
                    response = response[:at] + bytes([response[at] ^ 0x01]) + response[at + 1 :]
                    self.log.append(f"flipped byte {self.faults.flip_at} of {request_line}")
                if truncate:
                    writer.write(response[: header_end + self.faults.truncate_at])
                    await writer.drain()
                    writer.transport.abort()
                    return
                writer.write(response[:header_end])
                if self.faults.body_delay_s and faultable:
                    await writer.drain()
                    await asyncio.sleep(self.faults.body_delay_s)
                body = response[header_end:]
                if self.faults.trickle_bps and faultable:
                    step = 64 * 1024
                    for offset in range(0, len(body), step):
                        writer.write(body[offset : offset + step])
                        await writer.drain()
                        await asyncio.sleep(step / self.faults.trickle_bps)
                else:
                    writer.write(body)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError, ValueError):
            pass
        finally:
            writer.close()

    async def _forward(self, head: bytes, body: bytes) -> bytes:
        lines = head.split(b"\r\n")
        kept = [line for line in lines[1:] if line and not line.lower().startswith((b"connection:", b"keep-alive:"))]
        request = b"\r\n".join([lines[0], *kept, b"Connection: close"]) + b"\r\n\r\n" + body
        up_reader, up_writer = await asyncio.open_connection(self.upstream_host, self.upstream_port)
        up_writer.write(request)
        await up_writer.drain()
        response = await up_reader.read()
        up_writer.close()
        # Upstream closed the connection; re-frame with Connection: keep-alive semantics intact.
        header_end = response.index(b"\r\n\r\n")
        headers = [h for h in response[:header_end].split(b"\r\n") if not h.lower().startswith(b"connection:")]
        return b"\r\n".join(headers) + b"\r\n\r\n" + response[header_end + 4:]


class TcpForwarder:
    """Forwards every connection to ``127.0.0.1:port`` both ways. Subclasses override
    :meth:`serve` (what to do with a new connection) or :meth:`seen` (bytes the client sent)."""

    def __init__(self, port: int) -> None:
        self.target = port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self.serve, args=(client,), daemon=True).start()

    def serve(self, client: socket.socket) -> None:
        self.forward(client, socket.create_connection(("127.0.0.1", self.target)))

    def forward(self, client: socket.socket, upstream: socket.socket) -> None:
        threading.Thread(target=self._pump, args=(client, upstream, True), daemon=True).start()
        threading.Thread(target=self._pump, args=(upstream, client, False), daemon=True).start()

    def seen(self, data: bytes) -> None:
        """Bytes the client sent (called before they are forwarded)."""

    def _pump(self, src: socket.socket, dst: socket.socket, from_client: bool) -> None:
        try:
            while data := src.recv(1 << 16):
                if from_client:
                    self.seen(data)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                dst.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        self.listener.close()
