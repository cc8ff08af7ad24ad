"""The aiohttp request plumbing of the three servers (the node daemon, the lease master and the
admission webhook): bounded request bodies, JSON object bodies, the middleware that turns
every error into the app's own error answer, and listeners that bound what a connection may hold
(:class:`ConnectionLimits`: header-read time, idle time, connections at once).

The only :mod:`wire` module that imports aiohttp; only servers import it. What an error looks
like on the wire (S3 XML, ``{"error", "message"}`` JSON, the webhook's ``{"error"}``) stays with
each app: it hands :func:`error_middleware` one function that maps an exception to its answer.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from wire import jsontext
from wire.errors import BodyTooLarge, InvalidBody
from wire.names import Address

__all__ = [
    "HTTP_CODES",
    "ConnectionGuard",
    "ConnectionLimits",
    "ErrorAnswer",
    "GuardedSite",
    "LISTENING",
    "decode_json_object",
    "error_middleware",
    "http_code",
    "listening",
    "prepare_socket_path",
    "read_body",
    "remove_sockets",
    "start_listeners",
    "read_json_object",
]

ErrorAnswer = Callable[[web.Request, Exception], web.StreamResponse]
"""An app's one mapping from an exception (aiohttp's ``HTTPException`` included) to its answer."""

HTTP_CODES = {
    400: "BadRequest",
    404: "NotFound",
    405: "MethodNotAllowed",
    413: "BodyTooLarge",
    431: "HeadersTooLarge",
}
"""The ``"error"`` code of JSON answers to aiohttp's own errors (unknown route, wrong method)."""

_READ_CHUNK = 1 << 20
# Decoding a few megabytes of JSON takes milliseconds of CPU: larger bodies decode off the loop.
_OFFLOAD_BYTES = 1 << 20


def http_code(status: int) -> str:
    """The JSON error code of an aiohttp error status (``"HTTPError"`` for the rare others)."""
    return HTTP_CODES.get(status, "HTTPError")


async def read_body(request: web.Request, limit: int, advice: str = "") -> bytes:
    """The whole request body, at most ``limit`` bytes, or :class:`~wire.errors.BodyTooLarge`.

    A declared ``Content-Length`` over the limit is refused before reading anything; a chunked
    body (or one that lies about its length) is refused as soon as the bytes read pass the limit,
    so a client cannot make the server buffer more than ``limit`` whatever its headers say.
    """
    tail = f"; {advice}" if advice else ""
    length = request.content_length
    if length is not None and length > limit:
        raise BodyTooLarge(f"request body of {length} bytes is over the {limit}-byte limit{tail}", limit)
    data = bytearray()
    while True:
        # StreamReader.read(n) returns what has arrived, up to n bytes: loop to EOF.
        chunk = await request.content.read(_READ_CHUNK)
        if not chunk:
            return bytes(data)
        data += chunk
        if len(data) > limit:
            raise BodyTooLarge(f"request body is over the {limit}-byte limit{tail}", limit)


def decode_json_object(raw: bytes, what: str = "a JSON object") -> dict[str, Any]:
    """The JSON object in ``raw`` (UTF-8, as RFC 8259 requires), or :class:`~wire.errors.InvalidBody`.

    ``what`` names the object in the messages (``"an AdmissionReview object"``). Pure CPU work:
    callers with large bodies run it on a thread (:func:`read_json_object` does).
    """
    if not raw:
        raise InvalidBody(f"request body is empty: send {what}")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidBody(f"request body is not JSON: it is not UTF-8 ({exc})") from None
    try:
        body = jsontext.loads(text)
    except ValueError as exc:
        raise InvalidBody(f"request body is not JSON: {str(exc)[:200]}") from None
    if not isinstance(body, dict):
        raise InvalidBody(f"request body must be {what}")
    return body


async def read_json_object(request: web.Request, limit: int, advice: str = "") -> dict[str, Any]:
    """:func:`read_body` then :func:`decode_json_object`, large bodies decoded off the event loop."""
    raw = await read_body(request, limit, advice)
    if len(raw) > _OFFLOAD_BYTES:
        return await asyncio.to_thread(decode_json_object, raw)
    return decode_json_object(raw)


def error_middleware(answer: ErrorAnswer, *, known: tuple[type[Exception], ...], log: logging.Logger) -> Middleware:
    """A middleware that answers every error of a handler through ``answer(request, exc)``.

    ``exc`` is aiohttp's ``HTTPException`` (4xx/5xx: unknown route, wrong method, oversized body),
    one of the app's ``known`` errors, or anything else: a bug, logged here with its traceback;
    ``answer`` gives it a 500 in the app's format, so no error is answered with aiohttp's bare
    text page. Redirects and other non-error ``HTTPException``\\ s pass through as answers.
    """

    @web.middleware
    async def errors(request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            error: Exception = exc
        except Exception as exc:
            if request.writer.output_size > 0:
                # The answer was already under way: another one cannot follow on this connection.
                # aiohttp logs it and closes the connection.
                raise
            if not isinstance(exc, known):
                log.exception("internal error serving %s %s", request.method, request.path[:200])
            error = exc
        try:
            return answer(request, error)
        except Exception:  # the error answer itself failed: still answer, and say so in the log
            log.exception("cannot answer the error of %s %s", request.method, request.path[:200])
            return web.json_response({"error": "InternalError", "message": "internal error; see the server's log"},
                                     status=500)

    return errors


# -- connection limits -----------------------------------------------------------------------------


@dataclass(frozen=True)
class ConnectionLimits:
    """What one client connection may hold of a server. aiohttp bounds header sizes but not how
    long a client takes to send them, and accepts connections without limit: a client sending
    half its headers, or nothing, kept a descriptor forever, and enough of them exhaust the
    process's descriptors."""

    header_timeout_s: float = 30.0
    """Seconds a new connection has to send its first request's headers; then it is closed."""

    idle_timeout_s: float = 75.0
    """Seconds a kept-alive connection may wait for its next request (headers included) after an
    answer; then it is closed (aiohttp's ``keepalive_timeout``)."""

    max_connections: int = 1024
    """Connections served at once, every listener together; a connection beyond them is answered
    503 with ``Retry-After`` and closed."""

    def __post_init__(self) -> None:
        if not self.header_timeout_s > 0 or not self.idle_timeout_s > 0:
            raise ValueError("connection timeouts must be positive seconds")
        if self.max_connections < 1:
            raise ValueError("max_connections must be at least 1")

    def runner_args(self) -> dict[str, Any]:
        """The ``web.AppRunner`` arguments these limits set."""
        return {"keepalive_timeout": self.idle_timeout_s}


# Written to a connection over the limit before it is closed: S3 clients, the loader and the API
# server all retry a 503 (the body is empty so that it suits every app's format).
_REFUSAL = (
    b"HTTP/1.1 503 Service Unavailable\r\nRetry-After: 1\r\nConnection: close\r\n"
    b"Content-Length: 0\r\n\r\n"
)
_HEAD_END = b"\r\n\r\n"


class ConnectionGuard:
    """Applies :class:`ConnectionLimits` to every connection of one server (all its listeners):
    :meth:`protocol_factory` wraps aiohttp's protocol factory, and :class:`GuardedSite` listens
    with it. ``active``, ``refused`` and ``timed_out`` count connections for tests and logs."""

    def __init__(self, limits: ConnectionLimits, log: logging.Logger) -> None:
        self.limits = limits
        self.log = log
        self.active = 0
        self.refused = 0
        self.timed_out = 0

    def protocol_factory(self, server: web.Server) -> Callable[[], asyncio.Protocol]:
        return lambda: _GuardedConnection(self, server)


class _GuardedConnection(asyncio.Protocol):
    """One connection: counted against the limit, given ``header_timeout_s`` for its first
    request's head (the bytes up to the first blank line), then handed to aiohttp's
    ``RequestHandler``, whose keep-alive timeout bounds the wait between requests."""

    def __init__(self, guard: ConnectionGuard, server: web.Server) -> None:
        self._guard = guard
        self._server = server
        self._inner: asyncio.Protocol | None = None
        self._transport: asyncio.Transport | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._tail = b""  # the last bytes seen, for a blank line split across reads

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        guard = self._guard
        if guard.active >= guard.limits.max_connections:
            guard.refused += 1
            if guard.refused == 1 or guard.refused % 1000 == 0:
                guard.log.warning("refused %d connections: %d open is the limit (max connections)",
                                  guard.refused, guard.limits.max_connections)
            transport.write(_REFUSAL)
            transport.close()
            return
        guard.active += 1
        self._transport = transport
        self._timer = asyncio.get_running_loop().call_later(guard.limits.header_timeout_s, self._too_slow)
        self._inner = self._server()
        self._inner.connection_made(transport)

    def _too_slow(self) -> None:
        self._timer = None
        self._guard.timed_out += 1
        self._guard.log.info("closed a connection that sent no request head in %.0fs", self._guard.limits.header_timeout_s)
        if self._transport is not None:
            self._transport.abort()  # nothing was answered: nothing to flush

    def data_received(self, data: bytes) -> None:
        if self._inner is None:
            return  # refused: the 503 is on its way
        if self._timer is not None:
            seen = self._tail + data
            if _HEAD_END in seen:
                self._timer.cancel()
                self._timer = None
                self._tail = b""
            else:
                self._tail = seen[-(len(_HEAD_END) - 1):]
        self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received() if self._inner is not None else None

    def pause_writing(self) -> None:
        if self._inner is not None:
            self._inner.pause_writing()

    def resume_writing(self) -> None:
        if self._inner is not None:
            self._inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._inner is not None:
            self._guard.active -= 1
            inner, self._inner = self._inner, None
            inner.connection_lost(exc)


class GuardedSite(web.BaseSite):
    """A TCP (``host``, ``port``) or unix socket (``path``) listener of ``runner`` whose
    connections go through ``guard``; otherwise aiohttp's ``TCPSite`` / ``UnixSite``. With TLS,
    the handshake is bounded by the header timeout too."""

    def __init__(
        self,
        runner: web.BaseRunner,
        guard: ConnectionGuard,
        *,
        host: str | None = None,
        port: int | None = None,
        path: str | None = None,
        ssl_context: ssl.SSLContext | None = None,
        reuse_address: bool = True,
        backlog: int = 128,
    ) -> None:
        if (path is None) == (port is None):
            raise ValueError("a listener has a port or a socket path, not both")
        super().__init__(runner, ssl_context=ssl_context, backlog=backlog)
        self._guard = guard
        self._host = host
        self._port = port
        self._path = path
        self._reuse_address = reuse_address
        self._bound: int | None = None

    @property
    def name(self) -> str:
        scheme = "https" if self._ssl_context else "http"
        if self._path is not None:
            return f"{scheme}://unix:{self._path}:"
        return f"{scheme}://{self._host or '0.0.0.0'}:{self.port}"

    @property
    def port(self) -> int:
        """The bound port (the one asked for until started; 0 asks for a free one)."""
        return self._bound if self._bound is not None else self._port or 0

    async def start(self) -> None:
        await super().start()
        server = self._runner.server
        assert server is not None
        factory = self._guard.protocol_factory(server)
        loop = asyncio.get_running_loop()
        handshake = self._guard.limits.header_timeout_s if self._ssl_context else None
        if self._path is not None:
            self._server = await loop.create_unix_server(
                factory, self._path, ssl=self._ssl_context, backlog=self._backlog, ssl_handshake_timeout=handshake
            )
        else:
            listening = await loop.create_server(
                factory, self._host, self._port or 0, ssl=self._ssl_context, backlog=self._backlog,
                reuse_address=self._reuse_address, ssl_handshake_timeout=handshake,
            )
            self._server = listening
            self._bound = int(listening.sockets[0].getsockname()[1]) if listening.sockets else self._port


LISTENING = web.AppKey("listening", asyncio.Event)
"""Set by :func:`start_listeners` once every listener of the app is bound. Each server's
``/readyz`` answers 503 until then: a probe that reached the first listener would otherwise call
the server ready while its unix socket did not exist yet."""


def listening(app: web.Application) -> bool:
    """Whether every listener of ``app`` is bound (see :data:`LISTENING`)."""
    event = app.get(LISTENING)
    return event is not None and event.is_set()


def prepare_socket_path(path: Path) -> None:
    """Make a unix socket's directory and remove a stale socket a killed server left (blocking)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)


async def start_listeners(
    runner: web.AppRunner,
    guard: ConnectionGuard,
    addresses: Sequence[Address],
    *,
    log: logging.Logger,
    socket_access: Callable[[str], None] | None = None,
) -> None:
    """Listen on every address (``host`` "" is every interface), all behind ``guard``; each unix
    socket's directory is made and a stale socket replaced, then ``socket_access(path)`` sets who
    may connect (off the loop). Last, the app's :data:`LISTENING` is set, so ``/readyz`` says
    ready only with every listener there."""
    for where in addresses:
        if where.kind == "unix":
            await asyncio.to_thread(prepare_socket_path, Path(where.path))
            site = GuardedSite(runner, guard, path=where.path)
            await site.start()
            if socket_access is not None:
                await asyncio.to_thread(socket_access, where.path)
            log.info("listening on unix://%s", where.path)
        else:
            site = GuardedSite(runner, guard, host=where.host or None, port=where.port, reuse_address=True)
            await site.start()
            log.info("listening on tcp://%s:%d", where.host or "*", site.port)  # "": every interface, IPv6 too
    runner.app[LISTENING].set()  # each server's build_app made it


def remove_sockets(addresses: Sequence[Address]) -> None:
    """Remove the unix sockets among ``addresses`` (a server's last step: no stale file left)."""
    for where in addresses:
        if where.kind == "unix":
            Path(where.path).unlink(missing_ok=True)
