"""The ``shardcache`` command line: one dispatcher, one module per subcommand.

Each subcommand lives in ``sidecar/cli/commands/<name>.py`` and exposes
``register(subparsers)``; the module only describes its flags and imports the heavy
machinery inside its ``run`` function, so ``shardcache --help`` stays fast and a broken
optional dependency of one command never breaks the others.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence

from sidecar.cli.util import EXIT_INTERRUPTED, EXIT_USAGE, RawDefaultsFormatter, UserError

__all__ = ["main", "build_parser"]

# Order is the order shown by --help.
COMMANDS: tuple[str, ...] = (
    "serve",
    "master",
    "webhook",
    "inject",
    "index",
    "warmup",
    "status",
    "demo",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="shardcache",
        description="Node-local SSD cache and elastic shard leases for deep-learning training.",
        formatter_class=RawDefaultsFormatter,
        epilog="Run 'shardcache COMMAND --help' for a command's flags and examples. "
        "Every flag also reads a SHARDCACHE_<FLAG> environment variable.",
    )
    parser.add_argument("--log-level", default="INFO", help="logging level (DEBUG, INFO, WARNING, ERROR)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        # Every command is part of the package: a missing one is a broken install, and says so.
        importlib.import_module(f"sidecar.cli.commands.{name}").register(sub)
    for command_parser in sub.choices.values():
        # accepted after the command too (shardcache serve --log-level DEBUG); SUPPRESS keeps the
        # top-level value when it is not given there
        command_parser.add_argument("--log-level", default=argparse.SUPPRESS, help="logging level")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return EXIT_USAGE
    logging.basicConfig(
        level=getattr(logging, str(args.log_level).upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        return int(args.func(args) or 0)
    except UserError as exc:
        # One clear line with what to do; tracebacks are for bugs, not for user errors.
        print(f"shardcache {args.command}: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print(f"shardcache {args.command}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
