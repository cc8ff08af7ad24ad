"""One module per ``shardcache`` subcommand, each exposing ``register(subparsers)`` and ``run(args)``;
:mod:`sidecar.cli.dispatch` lists them. A module imports its heavy machinery (aiohttp, boto3, the
loader, PyYAML) inside ``run``, so that ``shardcache --help`` stays fast. No subcommand imports
another (``.importlinter`` holds it): what two share lives beside them in :mod:`sidecar.cli`."""

__all__: list[str] = []
