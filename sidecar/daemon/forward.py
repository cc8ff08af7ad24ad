"""Sidecar mode: forward the pod's requests to the node daemon over its unix socket.

When the upstream is absent (no DaemonSet on this node, or it is restarting) the request is served
by the sidecar's own standalone cache on its ``--cache-dir`` (an emptyDir), so a training pod never
fails because of where it was scheduled.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import aiohttp
from aiohttp import web
from yarl import URL

from sidecar.daemon.auth import RENEW_HEADER, Prover
from sidecar.daemon.warmups import MAX_BODY
from sidecar.errors import NotAuthorized, OriginUnavailable
from wire.errors import InvalidName
from wire.names import DAEMON_PORT, parse_connect
from wire.web import read_body

__all__ = ["Upstream", "forward_middleware", "UPSTREAM"]

log = logging.getLogger(__name__)

_HOP_BY_HOP = {
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailers",
    "transfer-encoding", "upgrade", "host", "content-length",
}
_LOCAL_ONLY = {"/healthz", "/metrics"}
# The node daemon is not there: refused (unix socket, or a node port nobody listens on), or a
# connect that times out (restricted mode's node-local Service drops packets while no daemon
# on the node is ready). Then the sidecar serves from its standalone cache.
UNREACHABLE = (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError, FileNotFoundError, ConnectionRefusedError)
_AUTH_HEADERS = {"x-shardcache-session", "x-shardcache-proof", "x-shardcache-peer"}  # the sidecar's or a daemon's to set


class Upstream:
    """The node daemon as seen from the sidecar, with a short memory of it being down."""

    def __init__(self, address: str, retry_after_s: float = 2.0) -> None:
        self.address = address
        self.retry_after_s = retry_after_s
        self._down_until = 0.0
        self._session: aiohttp.ClientSession | None = None
        try:
            upstream = parse_connect(address, DAEMON_PORT)
        except InvalidName:
            raise ValueError(f"upstream must be unix:///path.sock or tcp://host:port, not {address!r}") from None
        if upstream.kind == "unix":
            self._connector_args: dict[str, Any] = {"path": upstream.path}
            self.base = "http://shardcache-daemon"
        else:
            self._connector_args = {}
            self.base = upstream.url
        # Proves each request with the pod's credentials when the daemon runs --auth sigv4.
        self.prover = Prover(self.base)

    async def start(self) -> None:
        connector: aiohttp.BaseConnector
        if "path" in self._connector_args:
            connector = aiohttp.UnixConnector(path=self._connector_args["path"], limit=256)
        else:
            connector = aiohttp.TCPConnector(limit=256)
        self._session = aiohttp.ClientSession(
            connector=connector,
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=2, sock_read=300),
            auto_decompress=False,
        )

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    @property
    def believed_up(self) -> bool:
        return time.monotonic() >= self._down_until

    def mark_down(self) -> None:
        self._down_until = time.monotonic() + self.retry_after_s

    async def ready(self) -> bool:
        if self._session is None:
            return False
        try:
            async with self._session.get(self.base + "/readyz") as resp:
                return resp.status == 200
        except (TimeoutError, aiohttp.ClientError, OSError):
            self.mark_down()
            return False

    async def forward(self, request: web.Request) -> web.StreamResponse | None:
        """Proxy ``request``; ``None`` if the upstream could not be reached (serve locally)."""
        assert self._session is not None
        # Proofs and sessions are the sidecar's to add: a pod's own are dropped, not passed on.
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_BY_HOP | _AUTH_HEADERS}
        # A warm-up body may be 32 MiB (sidecar/daemon/warmups.py), more than aiohttp's default.
        data = await read_body(request, MAX_BODY, advice="split the warm-up") if request.can_read_body else None
        # The request target exactly as the pod sent it: the decoded, dot-resolved ``rel_url``
        # would turn ``/bk/%2e%2e/other/key`` into bucket ``other`` and ``a%252Fb`` into ``a/b``.
        # ``encoded=True`` keeps yarl from normalising it again; the node daemon then applies its
        # own checks to the very bytes it would have got directly (a traversal is its 400).
        url = URL(self.base + request.raw_path, encoded=True)
        for attempt in range(2):
            try:
                extra, body = await self.prover.prove(self._session, request, data)
                upstream = await self._session.request(
                    request.method, url, headers={**headers, **extra}, data=body, allow_redirects=False,
                )
            except UNREACHABLE as exc:
                log.info("upstream %s unreachable (%s); serving from the standalone cache", self.address, exc)
                self.mark_down()
                return None
            if upstream.status == 403 and upstream.headers.get(RENEW_HEADER) == "renew" and attempt == 0:
                # Expired or unknown session (the daemon restarted), rotated keys, or a daemon that
                # has just turned --auth on: a new session, and the request once more.
                upstream.release()
                self.prover.invalidate()
                continue
            break
        try:
            response = web.StreamResponse(
                status=upstream.status,
                headers={k: v for k, v in upstream.headers.items() if k.lower() not in _HOP_BY_HOP},
            )
            if upstream.content_length is not None:
                response.content_length = upstream.content_length
            response.headers["x-shardcache-via"] = "upstream"
            await response.prepare(request)
            async for chunk in upstream.content.iter_chunked(1024 * 1024):
                await response.write(chunk)
            await response.write_eof()
            return response
        finally:
            upstream.release()


UPSTREAM = web.AppKey("upstream", Upstream)


@web.middleware
async def forward_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    upstream = request.app[UPSTREAM]
    if request.path == "/readyz":
        # Ready either way: through the node daemon, or standalone when it is absent.
        up = await upstream.ready()
        return web.json_response({"ready": True, "mode": "sidecar", "upstream": up})
    # An absolute-form target (``GET http://host/x``) cannot be appended to the upstream's base;
    # the sidecar's own handlers answer it (and refuse it the way the node daemon would).
    if request.path in _LOCAL_ONLY or not upstream.believed_up or not request.raw_path.startswith("/"):
        return await handler(request)
    try:
        response = await upstream.forward(request)
    except (NotAuthorized, OriginUnavailable) as exc:
        # Outside the app's error middleware: answered here, in the same words.
        from sidecar.daemon.app import error_answer

        return error_answer(request, exc)
    if response is None:
        return await handler(request)
    return response
