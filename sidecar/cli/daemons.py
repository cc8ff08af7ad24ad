"""Which node daemons a command talks to: the ``--daemon`` flag (``warmup``, ``status``) and the
daemons its values, or the environment's default, stand for."""

from __future__ import annotations

import argparse
import os
import socket
from collections.abc import Callable

from sidecar.cli.control import DEFAULT_DAEMON, DaemonAddress, resolve_addresses
from sidecar.cli.util import EXIT_UNAVAILABLE, UserError, add_flag

__all__ = ["add_daemon_flag", "daemon_addresses"]


def add_daemon_flag(parser: argparse.ArgumentParser) -> None:
    add_flag(parser, "--daemon", action="append", default=None, metavar="ADDR",
             help="node daemon: http://host:port, host:port or unix:///path.sock; repeatable; a DNS name "
             "stands for every A record it resolves to (default SHARDCACHE_ENDPOINT, else "
             "http://127.0.0.1:8600)")


def daemon_addresses(given: list[str] | None, resolver: Callable[[str, int], list[str]] | None = None) -> list[DaemonAddress]:
    """``--daemon`` values (or the environment's default) resolved into daemons; UserError if bad."""
    raw = [part for value in (given or []) for part in value.split(",") if part.strip()]
    if not raw:
        raw = [os.environ.get("SHARDCACHE_ENDPOINT", "").strip() or DEFAULT_DAEMON]
    try:
        return resolve_addresses(raw, resolver) if resolver else resolve_addresses(raw)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    except OSError as exc:  # socket.gaierror
        name = exc.strerror if isinstance(exc, socket.gaierror) and exc.strerror else str(exc)
        raise UserError(f"cannot resolve daemon address {', '.join(raw)}: {name}", EXIT_UNAVAILABLE) from None
