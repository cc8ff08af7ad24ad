"""``shardcache master``: the shard-lease master (HTTP JSON API, state in SQLite or etcd)."""

from __future__ import annotations

import argparse
from pathlib import Path

from sidecar.cli.util import EXIT_UNAVAILABLE, RawDefaultsFormatter, UserError, add_connection_flags, add_flag, connection_limits

__all__ = ["register", "run"]

_EXAMPLES = """\
examples:
  # one master, state in an embedded SQLite file
  shardcache master --listen tcp://0.0.0.0:8700 --state sqlite:///var/lib/shardcache/master.db

  # high availability: run this on several machines; one leads, the others stand by
  shardcache master --listen tcp://0.0.0.0:8700 --state etcd://etcd-0:2379,etcd-1:2379/shardcache \\
      --advertise-url http://$(hostname -f):8700

  # trainers then use: ShardLoader(..., job="resnet50", master="http://m1:8700,http://m2:8700")
  # and operators:     curl -s http://m1:8700/v1/jobs/resnet50 | python -m json.tool

The API is documented in docs/master-api.md.
"""


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "master",
        help="hand out shard leases to trainers (exactly once per epoch)",
        description="Serve the shard-lease master: jobs, epochs with a seeded shuffle, leases with TTL that "
        "resume at the last reported sample offset, exactly-once completion, durable state in SQLite or etcd "
        "(with leader election).",
        formatter_class=RawDefaultsFormatter,
        epilog=_EXAMPLES,
    )
    add_flag(parser, "--listen", action="append", default=None, metavar="ADDR",
             help="address to serve on, tcp://HOST:PORT or unix:///PATH (repeatable; default tcp://0.0.0.0:8700)")
    add_flag(parser, "--state", default="sqlite:///var/lib/shardcache/master.db", metavar="URL",
             help="where the state lives: sqlite:///PATH or etcd://HOST:PORT[,HOST:PORT]/PREFIX")
    add_flag(parser, "--advertise-url", default=None, metavar="URL",
             help="URL clients should use for this master when it leads (etcd mode); "
             "default http://<hostname>:<port of the first tcp listener>")
    add_flag(parser, "--lease-ttl", default="30", metavar="SECONDS",
             help="lease TTL for jobs whose spec does not set lease_ttl_s")
    add_flag(parser, "--max-failures", default="3", metavar="N",
             help="failures after which a shard is skipped for the epoch, for jobs that do not set it")
    add_flag(parser, "--election-ttl", default="3", metavar="SECONDS",
             help="etcd mode: a dead leader is replaced within about this long")
    add_flag(parser, "--max-batch", default="512", metavar="N",
             help="most state changes made durable in one group commit (1 = commit each on its own)")
    add_flag(parser, "--max-body", default="256MiB", metavar="SIZE",
             help="largest create-job request body (it carries the shard list), counted decompressed; "
             "256MiB holds 1,000,000 shards with keys of up to ~190 characters")
    add_flag(parser, "--max-jobs", default="100", metavar="N",
             help="most jobs this master holds; creating one more is refused (TooManyJobs), joining one still "
             "works. Nothing deletes jobs yet: finished jobs count")
    add_flag(parser, "--token-file", default=None, metavar="PATH",
             help="refuse API calls without 'Authorization: Bearer <token>'; this file's content is the "
             "operator's token, which may see and do everything (re-read when it changes; trainers send "
             "SHARDCACHE_MASTER_TOKEN); /healthz, /readyz and /metrics stay open")
    add_flag(parser, "--tenant-tokens", default=None, metavar="DIR",
             help="one token per tenant: each file of DIR is named after a tenant (a training namespace) and "
             "holds its token (a mounted Secret); a tenant's jobs are its own, other tenants get 403 "
             "(re-read when the files change; the chart's master.auth.tenants makes them)")
    add_flag(parser, "--snapshot-events", default="10000", metavar="N",
             help="snapshot the state (and drop the log below it) after at least N logged changes "
             "and twice the total shard count")
    add_flag(parser, "--cluster", action="append", default=None, metavar="URL",
             help="a daemon of the cluster cache, http://HOST:8600 (repeatable; the first that answers is asked): "
             "the master reads the ring from its /_shardcache/peers so that jobs with a locality_window are "
             "handed the shards owned by their trainers' nodes (the chart: the daemons' Service)")
    add_flag(parser, "--cluster-poll", default="5", metavar="SECONDS",
             help="how often the leader asks --cluster for the ring")
    add_connection_flags(parser, max_connections=4096)
    parser.set_defaults(func=run)


def _number(text: str, flag: str, cast: type = float) -> float:
    try:
        return cast(text)
    except (TypeError, ValueError):
        raise UserError(f"invalid {flag} {text!r}: expected a number") from None


def _token_file(path: str | None) -> Path | None:
    """The token file, checked now (readable, not empty) so that a bad one stops the start."""
    if not path:
        return None
    from loader.master.server.auth import TokenFile

    TokenFile(Path(path))  # raises ValueError saying what is wrong
    return Path(path)


def _tenant_tokens(path: str | None) -> Path | None:
    """The tenants' token directory, checked now (readable, one token per tenant)."""
    if not path:
        return None
    from loader.master.server.auth import TenantTokens

    TenantTokens(Path(path))  # raises ValueError saying what is wrong
    return Path(path)


def run(args: argparse.Namespace) -> int:
    from loader.master.errors import MasterError
    from loader.master.server.settings import MasterSettings
    from sidecar.cli.util import parse_size

    try:
        settings = MasterSettings(
            listen=tuple(args.listen or ["tcp://0.0.0.0:8700"]),
            state=args.state,
            advertise_url=args.advertise_url or None,
            lease_ttl_s=_number(args.lease_ttl, "--lease-ttl"),
            max_failures=int(_number(args.max_failures, "--max-failures", int)),
            election_ttl_s=int(_number(args.election_ttl, "--election-ttl", int)),
            max_batch=int(_number(args.max_batch, "--max-batch", int)),
            max_body_bytes=parse_size(args.max_body),
            max_jobs=int(_number(args.max_jobs, "--max-jobs", int)),
            snapshot_min_events=int(_number(args.snapshot_events, "--snapshot-events", int)),
            token_file=_token_file(args.token_file),
            tenant_tokens_dir=_tenant_tokens(args.tenant_tokens),
            cluster=tuple(args.cluster or ()),
            cluster_poll_s=_number(args.cluster_poll, "--cluster-poll"),
            connections=connection_limits(args),
        )
    except ValueError as exc:
        raise UserError(str(exc)) from None

    from loader.master.server.app import run_forever

    try:
        run_forever(settings)
    except MasterError as exc:
        raise UserError(exc.message, EXIT_UNAVAILABLE) from None
    except OSError as exc:  # e.g. the listen port is taken
        raise UserError(f"cannot serve: {exc}; pick another --listen address", EXIT_UNAVAILABLE) from None
    return 0
