"""Running the daemon: listeners (unix socket, TCP), signals and graceful shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import AsyncIterator
from pathlib import Path

from aiohttp import web

from sidecar.daemon.app import build_app
from sidecar.daemon.forward import UPSTREAM, Upstream, forward_middleware
from sidecar.daemon.handles import HandleService, set_socket_access, start_handles
from sidecar.daemon.settings import ServeSettings
from wire.names import parse_listen
from wire.web import ConnectionGuard, GuardedSite

__all__ = ["run_daemon", "serve_forever", "make_app", "start_sites"]

log = logging.getLogger(__name__)

# Large enough for every S3 header a client sends, small enough that a hostile header costs nothing.
MAX_LINE = 8190
MAX_FIELD = 16384


def _prepare_socket_path(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileNotFoundError):
        path.unlink()  # a stale socket from a killed daemon


def _remove_socket(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        path.unlink()


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


async def start_sites(runner: web.AppRunner, listen: tuple[str, ...], guard: ConnectionGuard,
                      socket_group: int | None = None) -> list[str]:
    """Listen on every address; ``guard`` bounds the connections of all of them together; unix
    sockets as :func:`set_socket_access` says for ``socket_group``."""
    bound: list[str] = []
    for address in listen:
        where = parse_listen(address)
        if where.kind == "unix":
            path = Path(where.path)
            await asyncio.to_thread(_prepare_socket_path, path)
            site = GuardedSite(runner, guard, path=str(path))
            await site.start()
            await asyncio.to_thread(set_socket_access, str(path), socket_group)
        else:
            site = GuardedSite(runner, guard, host=where.host or "0.0.0.0", port=where.port, reuse_address=True)
            await site.start()
        bound.append(address)
        log.info("listening on %s", address)
    return bound


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
    handles: HandleService | None = None
    try:
        # After setup (the store, fetcher and authorizer it answers with are open), and before
        # the listeners: once /readyz answers, so does the handle socket.
        handles = await start_handles(app, settings)
        _warn_open_sockets(settings)
        await start_sites(runner, settings.listen, ConnectionGuard(settings.connections, log), settings.socket_group)
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
        for address in settings.listen:
            where = parse_listen(address)
            if where.kind == "unix":
                await asyncio.to_thread(_remove_socket, Path(where.path))


def run_daemon(settings: ServeSettings) -> None:
    asyncio.run(serve_forever(settings))
