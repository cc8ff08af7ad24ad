"""Short-circuit reads by file handle (protocol: :mod:`wire.handles`): the node daemon's side and
the pod sidecar's.

Node mode (``serve --handles unix:///run/shardcache/handles.sock``): a request is checked as the
HTTP GET of the object is (``--auth sigv4``: the session, then the proof of that object, cached
or not), then answered with a descriptor of the entry that the store opened and verified
(:meth:`cache.Store.open_verified`, as the sendfile path does: never a file that changed since it
was published), opened ``for_others``: through the cache directory's read-only view
(``--cache-dir-read-only``), so that not even a root pod can reopen it for writing through
``/proc/self/fd``. A hit, or a miss filled at demand priority first. Objects the store does not keep
(``manifest.json``, a full cache, a tenant over its quota) are 409 ``NotCached``: the client reads
them over HTTP. The daemon closes its copy of the descriptor once it is sent.

Sidecar mode: the pod's app container asks on a pod-local socket (an ``emptyDir``); each request
goes on to the node daemon's handle socket with the pod's own proof added
(:meth:`~sidecar.daemon.auth.Prover.object_proof`), and the descriptor back to the app; the
sidecar closes its copy. A proof or session the app sends is dropped, as on HTTP. No node daemon
is a 503: the client reads over HTTP (the standalone cache).

A request may name the reader's job (``"job"``, checked as the ``x-shardcache-job`` header is):
the descriptor's entry counts for it whole when it is handed out, under where its bytes came from
(a hit: this node's cache; :mod:`sidecar.daemon.jobstats`). The sidecar relays it.

Threads, not the event loop: a thread per connection (at most :data:`MAX_CONNECTIONS`) on
blocking sockets with timeouts; what is asynchronous (the authorizer, the fill, the proof) runs
on the daemon's loop through ``run_coroutine_threadsafe``, and the store's open in its executor,
as for HTTP. Nothing here blocks the loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import socket
import struct
import threading
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

import aiohttp
from aiohttp import web

from cache import CacheError
from sidecar.daemon.auth.http import AUTH
from sidecar.daemon.forward import UPSTREAM
from sidecar.daemon.keys import READS
from sidecar.daemon.reads import Hit, NotCached, ReadContext, Uncached
from sidecar.daemon.settings import ServeSettings
from sidecar.errors import BadRequest, OriginUnavailable, SidecarError, s3_error_for
from wire.errors import WireError
from wire.handles import MAX_REQUEST, NOT_CACHED, HandleProtocolError, exchange, recv_message, send_message
from wire.names import DAEMON_PORT, parse_connect, parse_listen, validate_bucket, validate_key, validate_xxh3_128
from wire.nodeplan import job_name
from wire.web import prepare_socket_path

__all__ = ["MAX_CONNECTIONS", "REQUEST_TIMEOUT_S", "HandleRequest", "HandleServer", "HandleService", "NotCached",
           "error_reply", "parse_request", "set_socket_access", "start_handles"]

log = logging.getLogger(__name__)

MAX_CONNECTIONS = 256
"""A sidecar's handle socket serves at most this many connections at once (fewer with a lower
``--max-connections``), each holding one to the node daemon's, whose own bound is
``--max-connections`` (the node's pods together). One more is answered 503 ``SlowDown`` and closed."""
REQUEST_TIMEOUT_S = 900.0
"""How long one request may wait for its answer (a miss waits for the whole fill)."""

_CONNECT_TIMEOUT_S = 2.0
_KNOWN_ERRORS = (SidecarError, WireError, CacheError)
_PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid
T = TypeVar("T")
Reply = tuple[dict[str, Any], int | None]


def set_socket_access(path: str, group: int | None) -> None:
    """Who may connect to the unix socket at ``path`` (connecting needs write permission on it):
    the daemon's user and ``group`` (mode 0660, ``--socket-group``), or anyone who sees the file
    (0666) without one. Every socket the daemon listens on gets it, here.

    0666 stays the default because a socket's users are of other pods, running as any user: the
    node daemon's are the injected sidecars (which the chart gives ``--socket-group``'s group),
    a sidecar's own are its pod's containers, behind the pod's ``emptyDir``. A mode cannot stop a
    process with ``CAP_DAC_OVERRIDE`` (a root container keeps it unless it drops it) nor one of the
    daemon's own user: what keeps other pods off is that only the sidecar mounts the directory."""
    if group is None:
        os.chmod(path, 0o666)
        return
    try:
        os.chown(path, -1, group)
    except PermissionError as exc:
        raise PermissionError(
            f"cannot give {path} to group {group} (--socket-group): run the daemon as root, or as a user in that group"
        ) from exc
    os.chmod(path, 0o660)


@dataclass(frozen=True)
class HandleRequest:
    bucket: str
    key: str
    claim: str | None = None
    recheck: bool = False
    session: str | None = None
    proof: str | None = None
    job: str = ""
    """The reader's job (``"job"``, as ``x-shardcache-job`` over HTTP): the descriptor's bytes
    count for it (:mod:`sidecar.daemon.jobstats`)."""

    def to_json(self) -> dict[str, Any]:
        """The request as the node daemon reads it, without session and proof (added by the sidecar)."""
        message: dict[str, Any] = {"op": "open", "bucket": self.bucket, "key": self.key}
        if self.claim is not None:
            message["xxh3_128"] = self.claim
        if self.recheck:
            message["recheck"] = True
        if self.job:
            message["job"] = self.job
        return message


def parse_request(message: dict[str, Any]) -> HandleRequest:
    """A request checked with the HTTP API's own rules (names, checksum); raises ``BadRequest``
    or ``InvalidName`` (both 400 ``InvalidArgument``). Unknown fields are ignored."""
    op = message.get("op")
    if op != "open":
        raise BadRequest(f'unknown op {str(op)[:40]!r}: a handle request is {{"op": "open", "bucket", "key", ...}}')
    bucket, key = message.get("bucket"), message.get("key")
    if not isinstance(bucket, str) or not isinstance(key, str):
        raise BadRequest("a handle request names the object with string fields bucket and key")
    validate_bucket(bucket)
    validate_key(key)
    claim = message.get("xxh3_128")
    if claim is not None:
        claim = validate_xxh3_128(claim, "xxh3_128")
    recheck = message.get("recheck", False)
    if not isinstance(recheck, bool):
        raise BadRequest("recheck must be true or false")
    session, proof = message.get("session"), message.get("proof")
    if not isinstance(session, str | None) or not isinstance(proof, str | None):
        raise BadRequest("session and proof must be strings (the pod's sidecar adds them)")
    job = message.get("job")
    if job is not None:
        try:
            job = job_name(job, "job")
        except WireError as exc:
            raise BadRequest(str(exc)) from None
    return HandleRequest(bucket, key, claim, recheck, session, proof, job or "")


def error_reply(exc: BaseException) -> dict[str, Any]:
    """The reply for ``exc``: the status and code the HTTP API answers (:func:`s3_error_for`),
    409 ``NotCached`` for what has no descriptor, ``renew`` where a new session cures it."""
    status, code = (409, NOT_CACHED) if isinstance(exc, NotCached) else s3_error_for(exc)
    if isinstance(exc, _KNOWN_ERRORS):
        message = str(exc)
    else:
        # A bug's own words stay in the log; the client learns where to look.
        log.error("handle request failed", exc_info=exc)
        message = "internal error in the daemon; see its log"
    reply: dict[str, Any] = {"status": status, "error": code, "message": message}
    if getattr(exc, "renew", False):
        reply["renew"] = True
    return reply


def _peer(conn: socket.socket) -> str:
    """Who is connected, as :func:`sidecar.daemon.claims.caller_of` names a unix socket's peer
    (one budget of refetches per sidecar process, over HTTP and handles alike)."""
    try:
        pid, uid, _ = _PEERCRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
    except OSError:
        return "unix"
    return f"unix pid {pid} uid {uid}"


# -- the server: one thread per connection -------------------------------------------------------


class Connection(Protocol):
    def answer(self, message: dict[str, Any]) -> Reply: ...

    def close(self) -> None: ...


class HandleServer:
    """A unix socket serving :mod:`wire.handles` requests; ``connect(conn)`` makes what answers
    one connection's requests. ``active``/``refused`` count connections (tests, logs)."""

    def __init__(self, path: str, connect: Callable[[socket.socket], Connection], *, idle_timeout_s: float,
                 max_connections: int = MAX_CONNECTIONS, name: str = "handles", socket_group: int | None = None) -> None:
        self.path = path
        self._socket_group = socket_group
        self._connect = connect
        self._idle_timeout_s = idle_timeout_s
        self._max_connections = max_connections
        self._name = name
        self._listener: socket.socket | None = None
        self._accepting: threading.Thread | None = None
        self._lock = threading.Lock()
        self._connections: dict[socket.socket, threading.Thread] = {}
        self._stopping = threading.Event()
        self.refused = 0

    @property
    def active(self) -> int:
        with self._lock:
            return len(self._connections)

    def start(self) -> None:
        """Listen (blocking: call it off the event loop)."""
        prepare_socket_path(Path(self.path))
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            listener.bind(self.path)
            set_socket_access(self.path, self._socket_group)
            # Deep: a unix socket's connect() with a timeout fails at once (EAGAIN) when it is full.
            listener.listen(socket.SOMAXCONN)
            # Woken to look at _stopping this often: close() needs no trick to interrupt accept().
            listener.settimeout(0.2)
        except BaseException:
            listener.close()
            raise
        self._listener = listener
        self._accepting = threading.Thread(target=self._accept_loop, name=f"{self._name}-accept", daemon=True)
        self._accepting.start()
        log.info("serving file handles on unix://%s", self.path)

    def close(self, timeout: float = 5.0) -> None:
        """Stop accepting, cut every connection and remove the socket file (requests still
        waiting on the loop are answered by :meth:`HandleService.stop` first). Blocking: call it
        off the event loop."""
        self._stopping.set()
        if self._accepting is not None:
            self._accepting.join(timeout)
        if self._listener is not None:
            self._listener.close()
        with self._lock:
            connections = dict(self._connections)
        for conn in connections:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked in recv or send
        deadline = time.monotonic() + timeout
        for thread in connections.values():
            thread.join(max(0.0, deadline - time.monotonic()))
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    def _accept_loop(self) -> None:
        assert self._listener is not None
        while not self._stopping.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError as exc:
                if self._stopping.is_set():
                    return
                # Out of descriptors, most likely: give the connections being served time to end.
                log.warning("%s: accept failed (%s); retrying", self.path, exc)
                time.sleep(0.1)
                continue
            with self._lock:
                full = len(self._connections) >= self._max_connections
                if not full:
                    thread = threading.Thread(target=self._serve, args=(conn,), name=f"{self._name}-conn", daemon=True)
                    self._connections[conn] = thread
            if full:
                self._refuse(conn)
            else:
                thread.start()

    def _refuse(self, conn: socket.socket) -> None:
        self.refused += 1
        with contextlib.closing(conn):
            conn.settimeout(0.5)
            with contextlib.suppress(OSError):
                send_message(conn, {"status": 503, "error": "SlowDown", "message": (
                    f"more than {self._max_connections} connections to {self.path}: read over HTTP, or retry")})

    def _serve(self, conn: socket.socket) -> None:
        handler: Connection | None = None
        try:
            handler = self._connect(conn)
            while not self._stopping.is_set():
                try:
                    # The wait for the next request and the request itself, bounded together.
                    received = recv_message(conn, MAX_REQUEST, time.monotonic() + self._idle_timeout_s)
                except HandleProtocolError as exc:
                    # Where the next message starts is unknown now: answer, then hang up.
                    self._send(conn, error_reply(BadRequest(f"not a handle request: {exc}")), None)
                    return
                except OSError:  # idle past the timeout, reset, or cut by close()
                    return
                if received is None:
                    return
                message, stray = received
                if stray is not None:
                    os.close(stray)
                    reply: Reply = (error_reply(BadRequest("a handle request carries no descriptor")), None)
                else:
                    reply = self._answer(handler, message)
                if not self._send(conn, *reply):
                    return
        except Exception:
            log.exception("%s: connection failed", self.path)
        finally:
            if handler is not None:
                handler.close()
            conn.close()
            with self._lock:
                self._connections.pop(conn, None)

    @staticmethod
    def _answer(handler: Connection, message: dict[str, Any]) -> Reply:
        try:
            return handler.answer(message)
        except Exception as exc:
            return error_reply(exc), None

    def _send(self, conn: socket.socket, reply: dict[str, Any], fd: int | None) -> bool:
        try:
            conn.settimeout(self._idle_timeout_s)
            send_message(conn, reply, fd)
            return True
        except OSError:
            return False
        finally:
            if fd is not None:
                os.close(fd)  # the receiver has its own now (or nothing: it went away)


# -- the event loop, from a connection's thread ---------------------------------------------------


class _Loop:
    """Runs coroutines on the daemon's loop for the connection threads; :meth:`cancel_all` at
    shutdown answers every request still waiting."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._lock = threading.Lock()
        self._pending: set[concurrent.futures.Future[Any]] = set()

    def call(self, coro: Coroutine[Any, Any, T], timeout: float = REQUEST_TIMEOUT_S) -> T:
        try:
            future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        except RuntimeError:  # the loop is closed
            coro.close()
            raise OriginUnavailable("the daemon is shutting down; read over HTTP or retry") from None
        with self._lock:
            self._pending.add(future)
        try:
            return future.result(timeout)
        except concurrent.futures.CancelledError:
            raise OriginUnavailable("the daemon is shutting down; read over HTTP or retry") from None
        except TimeoutError:
            # Not cancelled: a result arriving later still has its descriptor closed.
            future.add_done_callback(_close_late_fd)
            raise OriginUnavailable(f"no answer within {timeout:.0f} s; retry") from None
        finally:
            with self._lock:
                self._pending.discard(future)

    def cancel_all(self) -> None:
        with self._lock:
            pending = list(self._pending)
        for future in pending:
            future.cancel()


def _close_late_fd(future: concurrent.futures.Future[Any]) -> None:
    """A reply that came after its request gave up: its descriptor is nobody's."""
    if future.cancelled() or future.exception() is not None:
        return
    result = future.result()
    if isinstance(result, tuple) and len(result) == 2 and isinstance(result[1], int):
        os.close(result[1])


# -- node mode: open the entry ------------------------------------------------------------------


class _NodeConnection:
    def __init__(self, node: NodeHandles, caller: str) -> None:
        self._node = node
        self._caller = caller

    def answer(self, message: dict[str, Any]) -> Reply:
        request = parse_request(message)
        return self._node.loop.call(self._node.open(request, self._caller))

    def close(self) -> None:
        pass


class NodeHandles:
    """Answers handle requests with the daemon's own resources (store, fetcher, authorizer)."""

    def __init__(self, app: web.Application, loop: _Loop) -> None:
        self.app = app
        self.loop = loop

    def connect(self, conn: socket.socket) -> Connection:
        return _NodeConnection(self, _peer(conn))

    async def open(self, request: HandleRequest, caller: str) -> Reply:
        """The reply and descriptor for ``request``, read as the HTTP GET is (:mod:`sidecar.daemon.reads`)."""
        app = self.app
        tenant = ""
        auth = app.get(AUTH)
        if auth is not None:
            # Before the cache is looked at: a cached object is refused like any other.
            session = auth.session(request.session)
            await auth.authorize(session, request.proof, request.bucket, request.key)
            tenant = session.tenant
        reads = app[READS]
        ctx = ReadContext(request.bucket, request.key, caller=caller, tenant=tenant, claim=request.claim,
                          recheck=request.recheck, job=request.job)
        if reads.store is None or not ctx.cacheable:
            raise NotCached(f"{ctx.bucket}/{ctx.key} is never cached (the mutable index of its shards): read it over HTTP")
        result = await reads.read(ctx, for_others=True)
        if isinstance(result, Uncached):
            raise NotCached(f"{ctx.bucket}/{ctx.key} cannot be cached now (no room, or the tenant's quota): read it over HTTP")
        hit = result if isinstance(result, Hit) else await reads.settle(result, for_others=True)
        # A descriptor is a whole read (a client's: peers never ask for one).
        tally = reads.tally(ctx)
        tally.served("short_circuit", hit.entry.size, hit.came_from)
        tally.read(hit.came_from)
        entry = hit.entry
        reply = {"status": 200, "size": entry.size, "etag": entry.etag, "xxh3_128": entry.xxh3_128, "cache": hit.state}
        return reply, hit.fd


# -- sidecar mode: relay to the node daemon ------------------------------------------------------


class _RelayConnection:
    """One app connection, with its own kept-alive connection to the node daemon's handle socket."""

    def __init__(self, relay: SidecarRelay) -> None:
        self._relay = relay
        self._upstream: socket.socket | None = None

    def answer(self, message: dict[str, Any]) -> Reply:
        # Checked here too: the proof is made for valid names only (the daemon answers the same 400).
        request = parse_request(message)
        relay = self._relay
        for attempt in range(2):
            proof = relay.loop.call(relay.proof(request.bucket, request.key))
            reply, fd = self._exchange({**request.to_json(), **proof})
            if reply.get("status") == 403 and reply.get("renew") is True and attempt == 0:
                # Unknown or expired session (the daemon restarted), rotated keys: a new one, once.
                relay.loop.call(relay.invalidate())
                continue
            return reply, fd
        raise AssertionError("unreachable")

    def _exchange(self, message: dict[str, Any]) -> Reply:
        deadline = time.monotonic() + REQUEST_TIMEOUT_S
        for attempt in range(2):
            reused = self._upstream is not None
            upstream = self._upstream or self._connect()
            try:
                return exchange(upstream, message, deadline)
            except TimeoutError:
                self._drop()
                raise OriginUnavailable(f"no answer from the node daemon's handle socket {self._relay.path}; retry") from None
            except OSError as exc:  # HandleProtocolError too: the peer closed, or broke the protocol
                self._drop()
                if reused and attempt == 0:
                    # Most likely the daemon closed the kept-alive connection (idle, restarted):
                    # opening a file is idempotent, so once more on a new one.
                    continue
                raise OriginUnavailable(f"the node daemon's handle socket {self._relay.path} failed ({exc}); retry") from exc
        raise OriginUnavailable(f"the node daemon's handle socket {self._relay.path} keeps closing; retry")

    def _connect(self) -> socket.socket:
        deadline = time.monotonic() + _CONNECT_TIMEOUT_S
        while True:
            conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                conn.settimeout(_CONNECT_TIMEOUT_S)
                conn.connect(self._relay.path)
            except BlockingIOError:
                # A full backlog: a unix socket's connect() says so at once rather than wait.
                conn.close()
                if time.monotonic() < deadline:
                    time.sleep(0.01)
                    continue
                raise OriginUnavailable(f"the node daemon at {self._relay.path} accepts no connection; retry") from None
            except OSError as exc:
                conn.close()
                raise OriginUnavailable(
                    f"no node daemon at {self._relay.path} ({exc.strerror or exc}): read over HTTP (the sidecar serves it)"
                ) from exc
            self._upstream = conn
            return conn

    def _drop(self) -> None:
        if self._upstream is not None:
            self._upstream.close()
            self._upstream = None

    def close(self) -> None:
        self._drop()


class SidecarRelay:
    """Relays the app's handle requests to the node daemon, proved with the pod's credentials by
    the prover the sidecar's HTTP forwarding uses (one session with the daemon for both)."""

    def __init__(self, app: web.Application, settings: ServeSettings, loop: _Loop) -> None:
        assert settings.upstream is not None
        self.loop = loop
        self.path = settings.upstream_handles_path()
        self._prover = app[UPSTREAM].prover
        self._upstream = parse_connect(settings.upstream, DAEMON_PORT)
        self._http: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        connector: aiohttp.BaseConnector
        if self._upstream.kind == "unix":
            connector = aiohttp.UnixConnector(path=self._upstream.path, limit=16)
        else:
            connector = aiohttp.TCPConnector(limit=16)
        self._http = aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=30, sock_connect=2))

    async def aclose(self) -> None:
        if self._http is not None:
            await self._http.close()

    def connect(self, conn: socket.socket) -> Connection:
        return _RelayConnection(self)

    async def proof(self, bucket: str, key: str) -> dict[str, str]:
        assert self._http is not None
        try:
            return await self._prover.object_proof(self._http, bucket, key)
        except SidecarError:
            raise  # NotAuthorized (no credentials here; an OSError too), OriginUnavailable
        except (aiohttp.ClientError, OSError) as exc:
            raise OriginUnavailable(f"no node daemon to prove this read to ({exc}): read over HTTP") from exc

    async def invalidate(self) -> None:
        self._prover.invalidate()


# -- wiring -------------------------------------------------------------------------------------


class HandleService:
    """The handle socket of a running daemon or sidecar; :meth:`stop` before the app's cleanup."""

    def __init__(self, server: HandleServer, loop: _Loop, relay: SidecarRelay | None) -> None:
        self.server = server
        self._loop = loop
        self._relay = relay

    async def stop(self) -> None:
        self._loop.cancel_all()
        await asyncio.to_thread(self.server.close)
        if self._relay is not None:
            await self._relay.aclose()


async def start_handles(app: web.Application, settings: ServeSettings) -> HandleService | None:
    """Serve ``settings.handles`` for a set-up ``app`` (its resources open), or nothing."""
    if settings.handles is None:
        return None
    path = parse_listen(settings.handles).path
    loop = _Loop(asyncio.get_running_loop())
    relay: SidecarRelay | None = None
    connect: Callable[[socket.socket], Connection]
    if settings.mode == "sidecar":
        relay = SidecarRelay(app, settings, loop)
        await relay.start()
        connect = relay.connect
    else:
        connect = NodeHandles(app, loop).connect
        if settings.store.read_only_view is None:
            log.warning(
                "--handles without --cache-dir-read-only: a pod running as root (CAP_DAC_OVERRIDE is in the default "
                "container capabilities) can reopen a descriptor it is handed for writing through /proc/self/fd and "
                "change the cached bytes other pods read. Mount the cache directory a second time, read-only, and pass "
                "it as --cache-dir-read-only (the chart does), or run training containers as non-root"
            )
    limit = settings.connections.max_connections
    if settings.mode == "sidecar":
        limit = min(limit, MAX_CONNECTIONS)  # one pod holds a bounded share of the node's
    server = HandleServer(path, connect, idle_timeout_s=settings.connections.idle_timeout_s, max_connections=limit,
                          name=f"handles-{settings.mode}", socket_group=settings.socket_group)
    try:
        await asyncio.to_thread(server.start)
    except BaseException:
        if relay is not None:
            await relay.aclose()
        raise
    return HandleService(server, loop, relay)
