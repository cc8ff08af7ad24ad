"""``shardcache warmup``: fill node daemons' caches with a dataset before training starts.

The warm-up runs as a job inside each daemon (``POST /_shardcache/warmups``); this command only
submits it and watches it, so Ctrl-C (or a lost SSH session) does not stop it, and running the
same command again attaches to the job in progress (its id is a hash of what it asks for).
"Done" means every shard asked for is in the cache and verified (against the manifest's
xxh3-128 when there is one): the exit status is 0 only then.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from sidecar.cli.util import (
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_UNAVAILABLE,
    RawDefaultsFormatter,
    UserError,
    add_flag,
    parse_size,
)
from wire.names import split_origin_path, warmup_id

if TYPE_CHECKING:
    from sidecar.cli.control import ControlClient, DaemonAddress
    from wire.dataset import DatasetURL

__all__ = [
    "PlannedShard",
    "WarmupOptions",
    "build_options",
    "daemon_addresses",
    "load_shards",
    "map_dataset",
    "place",
    "register",
    "run",
]

EXAMPLES = """\
examples:
  # warm the local node daemon (SHARDCACHE_ENDPOINT, default http://127.0.0.1:8600)
  shardcache warmup s3://bucket/train/

  # every node daemon behind a headless Service (each A record is one daemon)
  shardcache warmup s3://bucket/train/ --daemon shardcache-node.shardcache.svc:8600

  # a dataset larger than one node's cache: each shard on one daemon only
  shardcache warmup s3://bucket/train/ --daemon d1:8600 --daemon d2:8600 --spread

  # limit origin traffic to 200 MiB/s per daemon, return at once (the job keeps running)
  shardcache warmup s3://bucket/train/ --bandwidth 200MiB --detach
  shardcache warmup s3://bucket/train/            # later: attaches to it and shows progress

  # how much is cached already, per daemon (fetches nothing; exit 0 only when 100%)
  shardcache warmup s3://bucket/train/ --check

  # what would be warmed where, and machine-readable progress for a pipeline
  shardcache warmup file:///data/bucket/train/ --daemon unix:///run/shardcache/daemon.sock --dry-run
  shardcache warmup s3://bucket/train/ --json | jq -c 'select(.event == "summary")'

exit status: 0 all shards verified in cache; 1 some failed (listed); 2 usage;
69 a daemon or the origin could not be reached; 130 interrupted (the warm-up goes on).
"""


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "warmup",
        help="fill node daemons' caches with a dataset (progress, verify, resumable)",
        description="Warm one or more node daemons with a dataset's shards. The warm-up runs inside each "
        "daemon and survives this command being interrupted; running it again re-attaches. Shards are "
        "verified against manifest.json (xxh3-128) when the dataset has one.",
        epilog=EXAMPLES,
        formatter_class=RawDefaultsFormatter,
    )
    parser.add_argument("url", metavar="URL", help="dataset prefix: s3://bucket/prefix/ or file:///root/bucket/prefix/")
    add_daemon_flag(parser)
    add_flag(parser, "--spread", action="store_true", default=False,
             help="place each shard on one daemon (rendezvous hashing) instead of on every daemon")
    add_flag(parser, "--bandwidth", default=None, metavar="SIZE",
             help="origin bytes per second per daemon, e.g. 200MiB (enforced inside the daemon, per shard)")
    add_flag(parser, "--concurrency", default=None, metavar="N",
             help="shards filled at once per daemon (default: the daemon's --prefetch-workers)")
    add_flag(parser, "--check", action="store_true", default=False,
             help="print the cached percentage per daemon and exit (0 when 100%%); fetches nothing")
    add_flag(parser, "--dry-run", action="store_true", default=False,
             help="print which shards would be warmed on which daemon; change nothing")
    add_flag(parser, "--detach", action="store_true", default=False,
             help="start (or find) the warm-up jobs and return at once")
    add_flag(parser, "--cancel", action="store_true", default=False, help="stop this dataset's warm-up jobs")
    add_flag(parser, "--json", action="store_true", default=False,
             help="JSON lines on stdout (progress events, then a summary) instead of a progress bar")
    add_flag(parser, "--id", default=None, metavar="NAME",
             help="job id to use on every daemon (default: derived from the dataset and its shards)")
    add_flag(parser, "--s3-endpoint", default=None, metavar="URL",
             help="S3 endpoint for reading the manifest/listing (default: boto3's, incl. AWS_ENDPOINT_URL)")
    add_flag(parser, "--timeout", default="0", metavar="SECONDS",
             help="give up watching after this long (exit 1; the jobs go on); 0 waits for the end")
    add_flag(parser, "--unreachable-timeout", default="30", metavar="SECONDS",
             help="stop waiting for a daemon that stays unreachable this long while watching")
    parser.set_defaults(func=run)


def add_daemon_flag(parser: argparse.ArgumentParser) -> None:
    add_flag(parser, "--daemon", action="append", default=None, metavar="ADDR",
             help="node daemon: http://host:port, host:port or unix:///path.sock; repeatable; a DNS name "
             "stands for every A record it resolves to (default SHARDCACHE_ENDPOINT, else "
             "http://127.0.0.1:8600)")


def daemon_addresses(given: list[str] | None, resolver: Callable[[str, int], list[str]] | None = None) -> list[DaemonAddress]:
    """``--daemon`` values (or the environment's default) resolved into daemons; UserError if bad."""
    import socket

    from sidecar.cli.control import DEFAULT_DAEMON, resolve_addresses

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


# -- what to warm ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class PlannedShard:
    key: str  # relative to the dataset prefix
    size: int | None
    xxh3_128: str | None


def load_shards(dataset: DatasetURL, s3_endpoint: str | None) -> tuple[list[PlannedShard], str]:
    """The dataset's shards from its manifest (with checksums), else from a listing of ``*.tar``."""
    from sidecar.cli.commands.index import dataset_errors
    from sidecar.cli.datasets import list_shards, open_store
    from wire.dataset import MANIFEST_NAME, MAX_MANIFEST_BYTES, parse_manifest

    with dataset_errors():
        store = open_store(dataset, s3_endpoint)
        data = store.read_small(MANIFEST_NAME, MAX_MANIFEST_BYTES)
        if data is not None:
            try:
                entries = parse_manifest(data, dataset.object_url(MANIFEST_NAME))
            except ValueError as exc:
                raise UserError(f"{exc}; rebuild it with `shardcache index {dataset.url}`", EXIT_FAILED) from None
            shards = [PlannedShard(e.key, e.size, e.xxh3_128) for e in entries]
            if any(shard.size is None for shard in shards):
                sizes = {obj.key: obj.size for obj in store.list()}
                shards = [PlannedShard(s.key, s.size if s.size is not None else sizes.get(s.key), s.xxh3_128) for s in shards]
            source = "manifest"
        else:
            shards = [PlannedShard(obj.key, obj.size, None) for obj in list_shards(store)]
            source = "listing"
    if not shards:
        raise UserError(f"no shards under {dataset.url}: no manifest.json and no *.tar objects (check the URL)")
    return shards, source


def place(keys: list[str], daemons: list[str]) -> dict[str, list[str]]:
    """Rendezvous (highest-random-weight) placement: each key on exactly one daemon; the same
    daemons always give the same placement, and adding or removing one daemon moves only the keys
    that land on (or were on) it."""
    import xxhash

    placed: dict[str, list[str]] = {daemon: [] for daemon in daemons}
    if not daemons:
        return placed
    for key in keys:
        best = max(daemons, key=lambda daemon: (xxhash.xxh3_64_intdigest(f"{daemon}\0{key}".encode()), daemon))
        placed[best].append(key)
    return placed


def map_dataset(dataset: DatasetURL, origin_url: str) -> tuple[str, str]:
    """(bucket, key prefix) of ``dataset`` on a daemon whose origin is ``origin_url``."""
    if dataset.scheme == "s3":
        if origin_url != "s3":
            raise ValueError(f"serves origin {origin_url}, not S3: warm it with a file:// URL under that root")
        return dataset.bucket, dataset.prefix
    if not origin_url.startswith("file://"):
        raise ValueError(f"serves origin {origin_url}, not a directory: warm it with an s3:// URL")
    split = split_origin_path(dataset.path, origin_url[len("file://"):])
    if split is None:
        raise ValueError(f"serves origin {origin_url}; {dataset.url} is not under it")
    bucket, prefix = split
    if not bucket:
        raise ValueError(f"{dataset.url} names no bucket under {origin_url} (the first directory is the bucket)")
    return bucket, prefix


@dataclass(frozen=True)
class WarmupOptions:
    """How to warm, built once from the flags (and their SHARDCACHE_* variables)."""

    bandwidth_bytes_per_s: int | None = None
    """Origin bytes per second per daemon (enforced by the daemon's job), or no limit."""

    concurrency: int | None = None
    """Shards filled at once per daemon; None: the daemon's --prefetch-workers."""

    job_id: str | None = None
    """Job id on every daemon; None: derived from the dataset name and what is asked."""

    spread: bool = False
    """Each shard on one daemon (rendezvous hashing) instead of on every daemon."""

    detach: bool = False
    """Submit (or find) the jobs and return."""

    timeout_s: float = 0.0
    """Stop watching after this long (the jobs go on); 0: until they end."""

    unreachable_timeout_s: float = 30.0
    """Stop waiting for a daemon that stays unreachable this long."""


# -- talking to the daemons -----------------------------------------------------------------------


@dataclass
class Target:
    """One daemon and its part of the warm-up."""

    address: DaemonAddress
    client: ControlClient
    bucket: str = ""
    prefix: str = ""
    shards: list[PlannedShard] = field(default_factory=list)
    job_id: str = ""
    status: dict[str, Any] | None = None
    problem: str | None = None  # why this daemon is not being warmed (unreachable, wrong origin)
    unreachable: bool = False
    down_since: float | None = None
    last_event: str = ""

    @property
    def label(self) -> str:
        return self.address.label

    def body(self, options: WarmupOptions) -> dict[str, Any]:
        objects = []
        for shard in self.shards:
            obj: dict[str, Any] = {"bucket": self.bucket, "key": self.prefix + shard.key}
            if shard.xxh3_128:
                obj["xxh3_128"] = shard.xxh3_128
            if shard.size is not None:
                obj["size"] = shard.size
            objects.append(obj)
        body: dict[str, Any] = {"id": self.job_id, "objects": objects, "priority": "warmup"}
        if options.bandwidth_bytes_per_s:
            body["bandwidth_bytes_per_s"] = options.bandwidth_bytes_per_s
        if options.concurrency:
            body["concurrency"] = options.concurrency
        return body

    @property
    def final(self) -> bool:
        return self.problem is not None or (self.status is not None and self.status["state"] != "running")


def _connect(targets: list[Target], dataset: DatasetURL) -> None:
    from sidecar.cli.control import DaemonClientError, DaemonUnavailable

    for target in targets:
        try:
            stats = target.client.stats()
        except DaemonClientError as exc:
            target.problem = str(exc) if isinstance(exc, DaemonUnavailable) else f"daemon at {target.label}: {exc}"
            target.unreachable = isinstance(exc, DaemonUnavailable)
            continue
        try:
            target.bucket, target.prefix = map_dataset(dataset, str(stats.get("origin_url") or stats.get("origin")))
        except ValueError as exc:
            target.problem = f"daemon at {target.label} {exc}"


def _seconds(text: str | None, flag: str) -> float:
    try:
        value = float(text) if text is not None else 0.0
    except ValueError:
        raise UserError(f"{flag} must be a number of seconds, not {text!r}") from None
    if value < 0:
        raise UserError(f"{flag} must not be negative")
    return value


def build_options(args: argparse.Namespace) -> WarmupOptions:
    import re

    modes = [flag for flag in ("check", "dry_run", "cancel") if getattr(args, flag)]
    if len(modes) > 1:
        raise UserError(f"--{modes[0].replace('_', '-')} and --{modes[1].replace('_', '-')} do not go together")
    bandwidth = parse_size(args.bandwidth) if args.bandwidth else None
    if bandwidth is not None and bandwidth < 1:
        raise UserError("--bandwidth must be positive, e.g. 100MiB")
    concurrency = None
    if args.concurrency is not None:
        try:
            concurrency = int(args.concurrency)
        except ValueError:
            raise UserError(f"--concurrency must be an integer, not {args.concurrency!r}") from None
        if not 1 <= concurrency <= 64:
            raise UserError("--concurrency must be between 1 and 64")
    if args.id is not None and not re.match(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$", args.id):
        raise UserError("--id must be 1-128 of [A-Za-z0-9._-], starting with a letter or digit")
    return WarmupOptions(
        bandwidth_bytes_per_s=bandwidth, concurrency=concurrency, job_id=args.id, spread=args.spread,
        detach=args.detach, timeout_s=_seconds(args.timeout, "--timeout"),
        unreachable_timeout_s=_seconds(args.unreachable_timeout, "--unreachable-timeout"),
    )


def run(args: argparse.Namespace) -> int:
    from sidecar.cli.commands.index import quiet_libraries
    from sidecar.cli.control import ControlClient
    from wire.dataset import parse_dataset_url

    quiet_libraries()
    try:
        dataset = parse_dataset_url(args.url)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    options = build_options(args)

    addresses = daemon_addresses(args.daemon)
    shards, source = load_shards(dataset, args.s3_endpoint)
    targets = [Target(address, ControlClient(address.url, timeout=10.0)) for address in addresses]
    try:
        _connect(targets, dataset)
        live = [t for t in targets if t.problem is None]
        if options.spread:
            placed = place([s.key for s in shards], [t.address.url for t in live])
            by_key = {s.key: s for s in shards}
            for target in live:
                target.shards = [by_key[key] for key in placed[target.address.url]]
        else:
            for target in live:
                target.shards = list(shards)
        name = dataset.url.rstrip("/").rsplit("/", 1)[-1]
        for target in live:
            target.job_id = options.job_id or warmup_id(
                ((target.bucket, target.prefix + s.key, s.xxh3_128) for s in target.shards), name
            )
        out = Output(args.json)
        if source == "listing" and not args.json:
            print(f"note: {dataset.url} has no manifest.json; shards are cached without checksum verification "
                  f"(build one with `shardcache index {dataset.url}`)", file=sys.stderr)
        if args.check:
            return _check(targets, dataset, out)
        if args.dry_run:
            return _dry_run(targets, dataset, source, out, options.spread)
        if args.cancel:
            return _cancel(targets, out)
        return _warm(targets, dataset, args.url, options, out)
    finally:
        for target in targets:
            target.client.close()


class Output:
    """Where results go: human text, or JSON lines on stdout."""

    def __init__(self, json_lines: bool) -> None:
        self.json = json_lines

    def event(self, event: str, **fields: Any) -> None:
        print(json.dumps({"event": event, "time": round(time.time(), 3), **fields}), flush=True)

    def problems(self, targets: list[Target]) -> None:
        for target in targets:
            if target.problem is None:
                continue
            if self.json:
                self.event("daemon_error", daemon=target.label, error=target.problem, unreachable=target.unreachable)
            else:
                where = "" if target.address.url in target.problem else f"{target.label}: "
                print(f"shardcache warmup: {where}{target.problem}", file=sys.stderr)


def _exit_for_problems(targets: list[Target]) -> int:
    if any(t.problem is not None and not t.unreachable for t in targets):
        return EXIT_FAILED
    if any(t.unreachable for t in targets):
        return EXIT_UNAVAILABLE
    return EXIT_OK


# -- --dry-run, --check, --cancel -----------------------------------------------------------------


def _dry_run(targets: list[Target], dataset: DatasetURL, source: str, out: Output, spread: bool) -> int:
    from sidecar.cli.progress import format_bytes

    out.problems(targets)
    for target in targets:
        if target.problem is not None:
            continue
        size = sum(s.size or 0 for s in target.shards)
        verified = sum(1 for s in target.shards if s.xxh3_128)
        if out.json:
            out.event("plan", daemon=target.label, id=target.job_id, files=len(target.shards), bytes=size,
                      checksummed=verified, keys=[target.prefix + s.key for s in target.shards], bucket=target.bucket)
        else:
            print(f"would warm {len(target.shards)} shards ({format_bytes(size)}, {verified} with checksums from "
                  f"the {source}) of {dataset.url} on {target.label} as job {target.job_id}")
    if not out.json:
        print(f"dry run: nothing was fetched ({'--spread: one daemon per shard' if spread else 'every shard on every daemon'})")
    return _exit_for_problems(targets)


def _check(targets: list[Target], dataset: DatasetURL, out: Output) -> int:
    from sidecar.cli.control import DaemonClientError
    from sidecar.cli.progress import format_bytes

    rows: list[dict[str, Any]] = []
    for target in targets:
        if target.problem is not None:
            continue
        try:
            answer = target.client.cached(dataset.url)
            missing = set(answer.get("missing", []))
            complete = len(missing) >= int(answer["objects"]) - int(answer["cached"])
            cached_files = cached_bytes = 0
            for shard in target.shards:
                key = target.prefix + shard.key
                if complete:
                    hit = key not in missing
                else:  # the daemon lists at most 1000 missing keys: ask about each shard instead
                    hit = target.client.head_object(target.bucket, key, shard.xxh3_128) == "hit"
                if hit:
                    cached_files += 1
                    cached_bytes += shard.size or 0
        except DaemonClientError as exc:
            target.problem, target.unreachable = str(exc), True
            continue
        total = sum(s.size or 0 for s in target.shards)
        fraction = cached_bytes / total if total else (1.0 if cached_files == len(target.shards) else 0.0)
        rows.append({"daemon": target.label, "files": len(target.shards), "cached_files": cached_files,
                     "bytes": total, "cached_bytes": cached_bytes, "fraction": round(fraction, 6)})
    out.problems(targets)
    if out.json:
        for row in rows:
            out.event("check", **row)
    else:
        width = max([len(r["daemon"]) for r in rows] + [6])
        print(f"{'DAEMON':<{width}}  {'CACHED':>7}  {'FILES':>13}  BYTES")
        for row in rows:
            print(f"{row['daemon']:<{width}}  {row['fraction'] * 100:6.1f}%  "
                  f"{row['cached_files']:>6}/{row['files']:<6}  "
                  f"{format_bytes(row['cached_bytes'])} / {format_bytes(row['bytes'])}")
    code = _exit_for_problems(targets)
    if code == EXIT_OK and any(row["cached_files"] < row["files"] for row in rows):
        return EXIT_FAILED
    return code


def _cancel(targets: list[Target], out: Output) -> int:
    from sidecar.cli.control import DaemonAPIError, DaemonClientError

    for target in targets:
        if target.problem is not None:
            continue
        try:
            status = target.client.cancel_warmup(target.job_id)
            message = f"warm-up {target.job_id} on {target.label}: {status['state']}"
        except DaemonAPIError as exc:
            if exc.status != 404:
                target.problem = str(exc)
                continue
            status, message = None, f"no warm-up {target.job_id} on {target.label}"
        except DaemonClientError as exc:
            target.problem, target.unreachable = str(exc), True
            continue
        if out.json:
            out.event("cancel", daemon=target.label, id=target.job_id, state=status["state"] if status else None)
        else:
            print(message)
    out.problems(targets)
    return _exit_for_problems(targets)


# -- warming --------------------------------------------------------------------------------------


def _submit(target: Target, options: WarmupOptions) -> bool:
    """Create (or attach to) the job on one daemon; returns whether it attached."""
    created, status = target.client.create_warmup(target.body(options))
    target.status = status
    return not created


def _progress_of(status: dict[str, Any]) -> Any:
    from sidecar.cli.progress import Progress

    files, size = status["files"], status["bytes"]
    return Progress(
        files_done=files["done"], files_total=files["total"],
        bytes_done=min(size["done"] + size["in_flight"], size["total"]) if size["total"] else size["done"],
        bytes_total=size["total"], failed=files["failed"],
        rate_bytes_per_s=status.get("rate_bytes_per_s"), eta_s=status.get("eta_s"), state=status["state"],
    )


def _lines(targets: list[Target], dataset: DatasetURL) -> list[Any]:
    from sidecar.cli.progress import Progress, ProgressLine

    lines = []
    total = Progress(state="running")
    etas: list[float] = []
    rate = 0.0
    watched = [t for t in targets if t.status is not None]
    for target in watched:
        progress = _progress_of(target.status)  # type: ignore[arg-type]
        if target.down_since is not None and progress.state == "running":
            progress.state = "unreachable"
        lines.append(ProgressLine(target.label, progress))
        total.files_done += progress.files_done
        total.files_total += progress.files_total
        total.bytes_done += progress.bytes_done
        total.bytes_total += progress.bytes_total
        total.failed += progress.failed
        rate += progress.rate_bytes_per_s or 0.0
        if progress.state == "running" and progress.eta_s is not None:
            etas.append(progress.eta_s)
    if len(lines) == 1:
        lines[0].label = ""  # the line above the bar said which dataset and daemon
        return lines
    total.rate_bytes_per_s = rate or None
    total.eta_s = max(etas) if etas else None
    total.state = "running" if any(not t.final for t in watched) else "done"
    lines.append(ProgressLine("total", total))
    return lines


def _poll(target: Target, options: WarmupOptions, out: Output) -> None:
    from sidecar.cli.control import (
        DaemonAPIError,
        DaemonClientError,
        DaemonUnavailable,
    )

    try:
        try:
            target.status = target.client.warmup(target.job_id)
        except DaemonAPIError as exc:
            if exc.status != 404:
                raise
            # The daemon restarted and forgot the job: submit it again (cached shards count at once).
            _submit(target, options)
            if out.json:
                out.event("resubmitted", daemon=target.label, id=target.job_id)
        target.down_since = None
    except DaemonUnavailable as exc:
        now = time.monotonic()
        if target.down_since is None:
            target.down_since = now
        elif now - target.down_since > options.unreachable_timeout_s:
            target.problem = f"{exc} (for {now - target.down_since:.0f}s; gave up watching)"
            target.unreachable = True
    except DaemonClientError as exc:
        target.problem = str(exc)


def _warm(targets: list[Target], dataset: DatasetURL, url: str, options: WarmupOptions, out: Output) -> int:
    from sidecar.cli.control import DaemonClientError, DaemonUnavailable
    from sidecar.cli.progress import Display

    for target in targets:
        if target.problem is not None:
            continue
        if not target.shards:
            target.status = None
            continue
        try:
            attached = _submit(target, options)
        except DaemonClientError as exc:
            target.problem = str(exc)
            target.unreachable = isinstance(exc, DaemonUnavailable)
            continue
        assert target.status is not None
        verb = "attached to" if attached else "started"
        if out.json:
            out.event("attached" if attached else "started", daemon=target.label, id=target.job_id,
                      files=target.status["files"]["total"], bytes=target.status["bytes"]["total"])
        elif options.detach or not sys.stderr.isatty():
            print(f"{verb} warm-up {target.job_id} on {target.label}: {target.status['files']['total']} shards")
        else:
            print(f"{verb} warm-up {target.job_id} of {dataset.url} on {target.label}", file=sys.stderr)
    out.problems(targets)
    watched = [t for t in targets if t.problem is None and t.status is not None]
    if options.detach:
        if not out.json and watched:
            print(f"detached: watch with `shardcache warmup {url}` (same flags), stop with --cancel")
        return _exit_for_problems(targets)

    display = None if out.json else Display(sys.stderr)
    started = time.monotonic()
    last_json = 0.0
    try:
        while True:
            for target in watched:
                if not target.final:
                    _poll(target, options, out)
            now = time.monotonic()
            if out.json:
                if now - last_json >= 1.0 or all(t.final for t in watched):
                    last_json = now
                    for target in watched:
                        if target.status is None:
                            continue
                        event = json.dumps(_progress_event(target), sort_keys=True)
                        if event != target.last_event:  # unchanged progress is not news
                            target.last_event = event
                            out.event("progress", **_progress_event(target))
            elif display is not None and watched:
                display.update(_lines(watched, dataset), force=all(t.final for t in watched))
            if all(t.final for t in watched):
                break
            if options.timeout_s and now - started > options.timeout_s:
                return _summary(targets, dataset, out, timed_out=True)
            time.sleep(0.25 if display is not None and display.tty else 0.5)
    except KeyboardInterrupt:
        message = ("interrupted: the warm-up goes on inside the daemons; run the same command to re-attach, "
                   "or add --cancel to stop it")
        if out.json:
            out.event("interrupted", message=message)
        print(f"shardcache warmup: {message}", file=sys.stderr)
        return EXIT_INTERRUPTED
    return _summary(targets, dataset, out)


def _progress_event(target: Target) -> dict[str, Any]:
    status = target.status or {}
    return {
        "daemon": target.label, "id": target.job_id, "state": status.get("state"),
        "files": status.get("files"), "bytes": status.get("bytes"),
        "rate_bytes_per_s": status.get("rate_bytes_per_s"), "eta_s": status.get("eta_s"),
        "unreachable": target.down_since is not None,
    }


def _summary(targets: list[Target], dataset: DatasetURL, out: Output, timed_out: bool = False) -> int:
    from sidecar.cli.progress import format_bytes, format_rate

    failed: list[dict[str, str]] = []
    daemons: list[dict[str, Any]] = []
    for target in targets:
        status = target.status
        if target.problem is None and not target.shards:
            continue  # --spread placed nothing on it
        if target.problem is not None or status is None:
            daemons.append({"daemon": target.label, "state": "unreachable" if target.unreachable else "error",
                            "error": target.problem, "files": len(target.shards)})
            continue
        for item in status.get("failed", []):
            failed.append({"daemon": target.label, "key": item["key"], "bucket": item["bucket"],
                           "reason": item["reason"]})
        daemons.append({"daemon": target.label, "id": target.job_id, "state": status["state"],
                        "files": status["files"], "bytes": status["bytes"], "verified": status["verified"],
                        "elapsed_s": status["elapsed_s"], "rate_bytes_per_s": status.get("rate_bytes_per_s"),
                        "error": status.get("error")})
    ok = not timed_out and all(d["state"] == "done" for d in daemons) and not failed
    if out.json:
        out.event("summary", ok=ok, dataset=dataset.url, daemons=daemons, failed=failed, timed_out=timed_out)
    else:
        for d in daemons:
            if "id" not in d:
                print(f"{d['daemon']}: not warmed ({'unreachable' if d['state'] == 'unreachable' else d['error']})")
                continue
            files, size = d["files"], d["bytes"]
            print(f"{d['daemon']}: {d['state']}: {files['done']}/{files['total']} shards verified in cache "
                  f"({format_bytes(size['done'])} of {format_bytes(size['total'])}; "
                  f"{files['cached_before']} were cached already), {files['failed']} failed, "
                  f"{format_bytes(size['fetched'])} fetched in {d['elapsed_s']:.1f}s "
                  f"({format_rate(d['rate_bytes_per_s'])})")
            if d.get("error"):
                print(f"{d['daemon']}: {d['error']}")
        for item in failed:
            print(f"FAILED {item['daemon']} {item['bucket']}/{item['key']}: {item['reason']}")
        if timed_out:
            print("shardcache warmup: --timeout reached; the warm-up goes on inside the daemons", file=sys.stderr)
        elif failed:
            print(f"shardcache warmup: {len(failed)} shards failed (listed above); fix them and run the same "
                  "command again (shards already cached are not fetched again)", file=sys.stderr)
    if failed or timed_out or any(d["state"] in ("failed", "cancelled", "error") for d in daemons):
        return EXIT_FAILED
    if any(d["state"] == "unreachable" for d in daemons):
        if not out.json:
            print("shardcache warmup: some daemons could not be reached (see above); run again when they are up",
                  file=sys.stderr)
        return EXIT_UNAVAILABLE
    return EXIT_OK
