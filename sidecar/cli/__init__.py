"""The ``shardcache`` command line: the dispatcher (:mod:`sidecar.cli.dispatch`), one module per
subcommand (:mod:`sidecar.cli.commands`), and what only the CLI needs: the progress display, the
daemon control-API client, dataset tooling for ``index`` and ``warmup``, the demo's data.

Importing it is light: each subcommand's module, and aiohttp with it, loads only when it runs.
"""

from sidecar.cli.dispatch import build_parser, main

__all__ = ["main", "build_parser"]
