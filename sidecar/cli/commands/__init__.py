"""One module per ``shardcache`` subcommand, each exposing ``register(subparsers)`` and ``run(args)``;
:mod:`sidecar.cli.dispatch` lists them. A module imports its machinery inside ``run``."""

__all__: list[str] = []
