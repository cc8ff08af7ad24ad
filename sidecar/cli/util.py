"""Helpers shared by the subcommands: env-var defaults, sizes, exit codes, user errors."""

from __future__ import annotations

import argparse
import os
import re
from typing import Any

from sidecar.errors import SidecarError

__all__ = [
    "EXIT_OK",
    "EXIT_FAILED",
    "EXIT_USAGE",
    "EXIT_UNAVAILABLE",
    "EXIT_INTERRUPTED",
    "UserError",
    "RawDefaultsFormatter",
    "env_name",
    "add_flag",
    "parse_size",
    "parse_ratio",
]

EXIT_OK = 0
EXIT_FAILED = 1  # the command ran and something it was asked to do failed
EXIT_USAGE = 2  # bad flags or input (argparse uses 2 as well)
EXIT_UNAVAILABLE = 69  # EX_UNAVAILABLE: a daemon, master or origin could not be reached
EXIT_INTERRUPTED = 130  # Ctrl-C


class UserError(SidecarError):
    """An error the user can fix; printed as one line without a traceback."""

    def __init__(self, message: str, exit_code: int = EXIT_USAGE) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class RawDefaultsFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Keeps example blocks in epilogs as written and shows defaults."""


def env_name(flag: str) -> str:
    return "SHARDCACHE_" + flag.lstrip("-").upper().replace("-", "_")


def add_flag(parser: argparse.ArgumentParser, flag: str, *, default: Any = None, env: bool = True, **kwargs: Any) -> None:
    """Add ``flag`` whose default comes from ``SHARDCACHE_<FLAG>`` when set.

    Repeatable flags (``action="append"``) read a comma-separated list from the env var.
    """
    name = env_name(flag)
    if env and name in os.environ:
        raw = os.environ[name]
        if kwargs.get("action") == "append":
            default = [part.strip() for part in raw.split(",") if part.strip()]
        elif kwargs.get("action") == "store_true":
            default = raw.strip().lower() in {"1", "true", "yes", "on"}
        else:
            default = raw
    help_text = kwargs.pop("help", "")
    if env:
        help_text = f"{help_text} [env {name}]".strip()
    parser.add_argument(flag, default=default, help=help_text, **kwargs)


_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgtp]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "ki": 1024, "kib": 1024,
    "m": 1000**2, "mb": 1000**2, "mi": 1024**2, "mib": 1024**2,
    "g": 1000**3, "gb": 1000**3, "gi": 1024**3, "gib": 1024**3,
    "t": 1000**4, "tb": 1000**4, "ti": 1024**4, "tib": 1024**4,
    "p": 1000**5, "pb": 1000**5, "pi": 1024**5, "pib": 1024**5,
}


def parse_size(text: str | int) -> int:
    """``"200GiB"`` → bytes. Accepts SI (GB) and IEC (GiB) units."""
    if isinstance(text, int):
        return text
    match = _SIZE_RE.match(str(text))
    if not match or (match.group(2) or "").lower() not in _UNITS:
        raise UserError(f"invalid size {text!r}: use a number with an optional unit, e.g. 200GiB or 500MB")
    return int(float(match.group(1)) * _UNITS[(match.group(2) or "").lower()])


def parse_gid(value: str | None, flag: str) -> int | None:
    """A numeric group id (``--socket-group``), None for none or empty (an env var set to ``""``).
    Numeric only: a name means nothing across containers, whose /etc/group files differ."""
    from wire.names import MAX_GID

    raw = "" if value is None else str(value).strip()
    if not raw:
        return None
    if not raw.isascii() or not raw.isdigit() or len(raw) > 10 or int(raw) > MAX_GID:
        raise UserError(f"{flag} must be a numeric group id (0 to {MAX_GID}) such as 8600, or '' for none, not {value!r}")
    return int(raw)


def parse_ratio(text: str | float) -> float:
    """``"10%"`` or ``"0.1"`` → 0.1."""
    raw = str(text).strip()
    try:
        value = float(raw[:-1]) / 100 if raw.endswith("%") else float(raw)
    except ValueError:
        raise UserError(f"invalid ratio {text!r}: use a percentage like 10% or a fraction like 0.1") from None
    if not 0 <= value < 1:
        raise UserError(f"invalid ratio {text!r}: must be between 0% and 100%")
    return value


def add_connection_flags(parser: argparse.ArgumentParser, max_connections: int) -> None:
    """The flags of a server's :class:`wire.web.ConnectionLimits` (daemon, master, webhook)."""
    add_flag(parser, "--header-timeout", default="30", metavar="SECONDS",
             help="close a connection that has not sent its first request's headers within this time")
    add_flag(parser, "--idle-timeout", default="75", metavar="SECONDS",
             help="close a kept-alive connection idle (or half-way through a request head) this long")
    add_flag(parser, "--max-connections", default=str(max_connections), metavar="N",
             help="connections served at once; beyond, new ones get 503 and are closed")


def connection_limits(args: argparse.Namespace) -> Any:
    """The ``ConnectionLimits`` of :func:`add_connection_flags`' flags, or :class:`UserError`."""
    from wire.web import ConnectionLimits  # aiohttp: only once a server runs

    def number(text: str, flag: str, cast: type) -> Any:
        try:
            value = cast(text)
        except ValueError:
            raise UserError(f"{flag} must be a {'whole ' if cast is int else ''}number, not {text!r}") from None
        if not value > 0:
            raise UserError(f"{flag} must be positive, not {text!r}")
        return value

    return ConnectionLimits(
        header_timeout_s=number(args.header_timeout, "--header-timeout", float),
        idle_timeout_s=number(args.idle_timeout, "--idle-timeout", float),
        max_connections=number(args.max_connections, "--max-connections", int),
    )
