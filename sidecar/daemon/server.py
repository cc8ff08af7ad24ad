"""Running the daemon: listeners (unix socket, TCP), signals and graceful shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import signal
from collections.abc import AsyncIterator

from aiohttp import web

from sidecar.daemon.app import build_app
from sidecar.daemon.forward import UPSTREAM, Upstream, forward_middleware
from sidecar.daemon.handles import HandleService, set_socket_access, start_handles
from sidecar.daemon.settings import ServeSettings
from wire.names import parse_listen
from wire.web import ConnectionGuard, remove_sockets, start_listeners

__all__ = ["run_daemon", "serve_forever", "make_app"]

log = logging.getLogger(__name__)

# Large enough for every S3 header a client sends, small enough that a hostile header costs nothing.
MAX_LINE = 8190
MAX_FIELD = 16384


def _warn_open_sockets(settings: ServeSettings) -> None:
    """The node daemon's sockets without ``--socket-group`` are any local user's to connect to."""
    unix = [a for a in (*settings.listen, settings.handles or "") if a.startswith("unix://")]
    if settings.mode == "node" and settings.socket_group is None and unix:
        log.warning(
            "%s: mode 0666, any process that sees the socket directory may connect; pass --socket-group GID "
            "(the chart does) for 0660 and give the sidecars that group (the injector's runAsGroup)", ", ".join(unix),
        )


def make_app(settings: ServeSettings) -> web.Application:
    app = build_app(settings)
    if settings.mode == "sidecar":
        assert settings.upstream is not None
        upstream = Upstream(settings.upstream)
        app[UPSTREAM] = upstream
        app.middlewares.insert(0, forward_middleware)

        async def upstream_ctx(app: web.Application) -> AsyncIterator[None]:
            await upstream.start()
            try:
                yield
            finally:
                await upstream.close()

        app.cleanup_ctx.append(upstream_ctx)
    return app


async def serve_forever(settings: ServeSettings, ready: asyncio.Event | None = None, stop: asyncio.Event | None = None) -> None:
    app = make_app(settings)
    runner = web.AppRunner(
        app,
        handle_signals=False,
        access_log=None,
        shutdown_timeout=settings.shutdown_timeout_s,
        max_line_size=MAX_LINE,
        max_field_size=MAX_FIELD,
        **settings.connections.runner_args(),
    )
    await runner.setup()
    stop = stop or asyncio.Event()
    addresses = [parse_listen(a) for a in settings.listen]
    handles: HandleService | None = None
    try:
        # After setup (the store, fetcher and authorizer it answers with are open), and before
        # the listeners: once /readyz answers, so does the handle socket.
        handles = await start_handles(app, settings)
        _warn_open_sockets(settings)
        await start_listeners(runner, ConnectionGuard(settings.connections, log), addresses, log=log,
                              socket_access=functools.partial(set_socket_access, group=settings.socket_group))
        loop = asyncio.get_running_loop()
        with contextlib.suppress(NotImplementedError, RuntimeError):
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, stop.set)
        if ready is not None:
            ready.set()
        await stop.wait()
        log.info("shutting down: finishing requests in progress (up to %.0fs)", settings.shutdown_timeout_s)
    finally:
        if handles is not None:
            # First: requests still waiting are answered (503) while the resources are open.
            await handles.stop()
        await runner.cleanup()
        await asyncio.to_thread(remove_sockets, addresses)


def run_daemon(settings: ServeSettings) -> None:
    asyncio.run(serve_forever(settings))
