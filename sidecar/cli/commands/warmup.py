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
import re
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import xxhash

from sidecar.cli.control import (
    DEFAULT_DAEMON,
    ControlClient,
    DaemonAddress,
    DaemonAPIError,
    DaemonClientError,
    DaemonUnavailable,
    PeerView,
    RingMember,
)
from sidecar.cli.daemons import add_daemon_flag, daemon_addresses
from sidecar.cli.datasets import dataset_errors, list_shards, open_store, quiet_libraries
from sidecar.cli.progress import Display, Progress, ProgressLine, format_bytes, format_rate
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
from wire.dataset import MANIFEST_NAME, MAX_MANIFEST_BYTES, DatasetURL, parse_dataset_url, parse_manifest
from wire.names import split_origin_path, warmup_id
from wire.rendezvous import owner

__all__ = [
    "PlannedShard",
    "Ring",
    "WarmupOptions",
    "build_options",
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


# -- what to warm ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class PlannedShard:
    key: str  # relative to the dataset prefix
    size: int | None
    xxh3_128: str | None


def load_shards(dataset: DatasetURL, s3_endpoint: str | None) -> tuple[list[PlannedShard], str]:
    """The dataset's shards from its manifest (with checksums), else from a listing of ``*.tar``."""
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
    member: str = ""  # what placement hashes: its ring member id, or its address without a ring
    given: bool = True  # named by --daemon (False: a ring member found through the others)

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


# -- the cluster's ring ---------------------------------------------------------------------------


@dataclass
class Ring:
    """Where ``--spread`` puts each shard: on its owner among the live members of the daemons' ring
    (``wire.rendezvous``, the rule the daemons use to find it), or, when no daemon answers a ring
    (older daemons), by the ``--daemon`` addresses given (:func:`place`)."""

    targets: list[Target]
    """Every daemon to talk to: the ring's live members (one per member, however it was spelled),
    daemons that answer no ring, and unreachable ones (to report them)."""

    members: list[str]
    """Live ring member ids (plus the addresses of ring-less daemons when some answer a ring)."""

    has_ring: bool
    """Some daemon answered ``/_shardcache/peers``: placement and cluster coverage follow it."""

    bucket: str = ""
    prefix: str = ""  # how the ring's daemons name the dataset (the owner hashes bucket/key)
    owners: dict[str, str] = field(default_factory=dict)  # shard key -> member

    def place(self, shards: list[PlannedShard]) -> dict[str, list[PlannedShard]]:
        """Each shard on exactly one member: member -> its shards (also kept in ``owners``)."""
        if self.has_ring:
            for shard in shards:
                found = owner(self.members, f"{self.bucket}/{self.prefix}{shard.key}")
                if found is not None:
                    self.owners[shard.key] = found
        else:
            for member, keys in place([s.key for s in shards], self.members).items():
                self.owners.update((key, member) for key in keys)
        placed: dict[str, list[PlannedShard]] = {member: [] for member in self.members}
        for shard in shards:
            if shard.key in self.owners:
                placed[self.owners[shard.key]].append(shard)
        return placed


def _read_ring(targets: list[Target], dataset: DatasetURL, out: Output, warn: bool) -> Ring:
    """Ask each reachable daemon for its ring and turn the answers into the daemons to warm."""
    views: list[tuple[Target, PeerView]] = []
    ringless: list[Target] = []
    for target in targets:
        if target.problem is not None:
            continue
        try:
            view = target.client.peers()
        except DaemonClientError as exc:
            target.problem = str(exc) if isinstance(exc, DaemonUnavailable) else f"daemon at {target.label}: {exc}"
            target.unreachable = isinstance(exc, DaemonUnavailable)
            continue
        if view is None:
            target.member = target.address.url
            ringless.append(target)
        else:
            target.member = view.self_id
            views.append((target, view))
    if not views:
        if ringless and warn:
            out.warning(
                f"{', '.join(t.label for t in ringless)} answer no ring (GET /_shardcache/peers: not found; a "
                "shardcache without the cluster cache): --spread places shards by the --daemon addresses as "
                "given, which no daemon uses to find them; upgrade the daemons to place each shard on its owner"
            )
        return Ring(targets, [t.member for t in ringless], has_ring=False)

    # The union of the live members each daemon sees: views differ only for the seconds a health
    # check takes to notice a member come or go, or when the daemons given are separate clusters.
    members: dict[str, RingMember] = {}
    for _, view in views:
        for member in view.live:
            members.setdefault(member.id, member)
    live_sets = {frozenset(m.id for m in view.live) for _, view in views}
    if len(live_sets) > 1 and warn:
        out.warning(
            "the daemons see different live members ("
            + "; ".join(f"{t.label}: {len(v.live)}" for t, v in views)
            + "): placing over all of them; run again in a few seconds if a member just joined or left"
        )
    kept: list[Target] = []
    by_member: dict[str, Target] = {}
    for target in targets:
        if target.problem is None and target.member in members:
            if target.member in by_member:
                target.client.close()  # the same daemon under another name: warmed once
                continue
            by_member[target.member] = target
        kept.append(target)
    found: list[Target] = []
    for ident, member in members.items():
        if ident in by_member:
            continue
        name = member.node or member.url  # shown as "node (host:port)"
        try:
            client = ControlClient(member.url, timeout=10.0)
        except ValueError as exc:
            # Never called (the target has a problem): a client only so every target has one.
            target = Target(DaemonAddress(member.url, name), ControlClient(DEFAULT_DAEMON), member=ident,
                            given=False, problem=f"ring member {member.url} cannot be reached from here: {exc}")
        else:
            target = Target(DaemonAddress(member.url, name), client, member=ident, given=False)
        found.append(target)
    _connect([t for t in found if t.problem is None], dataset)
    if ringless and warn:
        out.warning(
            f"{', '.join(t.label for t in ringless)} answer no ring (an older shardcache?): placed by "
            "address alongside the ring's members, where the ring's daemons will not look for them"
        )
    reference = views[0][0]
    ids = list(members) + [t.member for t in ringless]
    return Ring(kept + found, ids, has_ring=True, bucket=reference.bucket, prefix=reference.prefix)


def _seconds(text: str | None, flag: str) -> float:
    try:
        value = float(text) if text is not None else 0.0
    except ValueError:
        raise UserError(f"{flag} must be a number of seconds, not {text!r}") from None
    if value < 0:
        raise UserError(f"{flag} must not be negative")
    return value


def build_options(args: argparse.Namespace) -> WarmupOptions:
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
        out = Output(args.json)
        ring: Ring | None = None
        if options.spread or args.check:
            ring = _read_ring(targets, dataset, out, warn=options.spread)
            targets = ring.targets
        live = [t for t in targets if t.problem is None]
        if options.spread:
            assert ring is not None
            placed = ring.place(shards)
            for target in live:
                target.shards = placed.get(target.member, [])
        else:
            given = [t for t in live if t.given]
            for target in given:
                target.shards = list(shards)
        name = dataset.url.rstrip("/").rsplit("/", 1)[-1]
        for target in live:
            if not target.given and not options.spread:
                continue  # a ring member asked only for --check's cluster coverage
            target.job_id = options.job_id or warmup_id(
                ((target.bucket, target.prefix + s.key, s.xxh3_128) for s in target.shards), name
            )
        if source == "listing" and not args.json:
            print(f"note: {dataset.url} has no manifest.json; shards are cached without checksum verification "
                  f"(build one with `shardcache index {dataset.url}`)", file=sys.stderr)
        if args.check:
            return _check(targets, dataset, out, shards, ring, options.spread)
        if args.dry_run:
            return _dry_run(targets, dataset, source, out, options.spread, ring)
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

    def warning(self, message: str) -> None:
        if self.json:
            self.event("warning", message=message)
        else:
            print(f"shardcache warmup: warning: {message}", file=sys.stderr)

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


def _dry_run(targets: list[Target], dataset: DatasetURL, source: str, out: Output, spread: bool,
             ring: Ring | None) -> int:
    out.problems(targets)
    for target in targets:
        if target.problem is not None:
            continue
        size = sum(s.size or 0 for s in target.shards)
        verified = sum(1 for s in target.shards if s.xxh3_128)
        if out.json:
            out.event("plan", daemon=target.label, url=target.address.url, member=target.member or None,
                      id=target.job_id, files=len(target.shards), bytes=size, checksummed=verified,
                      keys=[target.prefix + s.key for s in target.shards], bucket=target.bucket)
        else:
            print(f"would warm {len(target.shards)} shards ({format_bytes(size)}, {verified} with checksums from "
                  f"the {source}) of {dataset.url} on {target.label} as job {target.job_id}")
    if not out.json:
        if not spread:
            how = "every shard on every daemon"
        elif ring is not None and ring.has_ring:
            how = f"--spread: each shard on its owner among the ring's {len(ring.members)} live members"
        else:
            how = "--spread: one daemon per shard, by the --daemon addresses"
        print(f"dry run: nothing was fetched ({how})")
    return _exit_for_problems(targets)


def _holdings(target: Target, dataset: DatasetURL, shards: list[PlannedShard]) -> set[str]:
    """Which of ``shards`` (relative keys) ``target`` has cached (with their checksums)."""
    answer = target.client.cached(dataset.url)
    missing = set(answer.get("missing", []))
    complete = len(missing) >= int(answer["objects"]) - int(answer["cached"])
    held: set[str] = set()
    for shard in shards:
        key = target.prefix + shard.key
        if complete:
            hit = key not in missing
        else:  # the daemon lists at most 1000 missing keys: ask about each shard instead
            hit = target.client.head_object(target.bucket, key, shard.xxh3_128) == "hit"
        if hit:
            held.add(shard.key)
    return held


def _fraction(done_bytes: int, total_bytes: int, done_files: int, files: int) -> float:
    if total_bytes:
        return round(done_bytes / total_bytes, 6)
    return 1.0 if done_files == files else 0.0


def _check(targets: list[Target], dataset: DatasetURL, out: Output, shards: list[PlannedShard],
           ring: Ring | None, spread: bool) -> int:
    cluster = ring is not None and ring.has_ring
    if cluster:
        assert ring is not None
        if not ring.owners:
            ring.place(shards)
    # Without --spread only the daemons given get a row; the ring's other members are asked only
    # so that the cluster's coverage counts what they hold.
    shown = {id(t) for t in targets if t.given or spread}
    held: dict[str, set[str]] = {}  # member (or address) -> shard keys it has
    rows: list[dict[str, Any]] = []
    for target in targets:
        if target.problem is not None or not (id(target) in shown or cluster):
            continue
        try:
            have = _holdings(target, dataset, shards if cluster else target.shards)
        except DaemonClientError as exc:
            target.problem, target.unreachable = str(exc), True
            continue
        held[target.member or target.address.url] = have
        if id(target) not in shown:
            continue
        total = sum(s.size or 0 for s in target.shards)
        mine = [s for s in target.shards if s.key in have]
        cached_bytes = sum(s.size or 0 for s in mine)
        rows.append({"daemon": target.label, "files": len(target.shards), "cached_files": len(mine),
                     "bytes": total, "cached_bytes": cached_bytes,
                     "fraction": _fraction(cached_bytes, total, len(mine), len(target.shards))})
    out.problems([t for t in targets if id(t) in shown or t.problem is not None])
    summary: dict[str, Any] | None = None
    if cluster:
        assert ring is not None
        # A shard is covered when its owner has it: that is where every daemon of the ring reads it.
        total = sum(s.size or 0 for s in shards)
        owned = [s for s in shards if s.key in held.get(ring.owners.get(s.key, ""), set())]
        anywhere = [s for s in shards if any(s.key in have for have in held.values())]
        owned_bytes, anywhere_bytes = sum(s.size or 0 for s in owned), sum(s.size or 0 for s in anywhere)
        summary = {
            "members": len(ring.members), "answered": len(held), "files": len(shards), "bytes": total,
            "covered_files": len(owned), "covered_bytes": owned_bytes,
            "fraction": _fraction(owned_bytes, total, len(owned), len(shards)),
            "anywhere_files": len(anywhere), "anywhere_bytes": anywhere_bytes,
            "anywhere_fraction": _fraction(anywhere_bytes, total, len(anywhere), len(shards)),
        }
    if out.json:
        for row in rows:
            out.event("check", **row)
        if summary is not None:
            out.event("cluster", **summary)
    else:
        label = f"cluster ({summary['members']} members)" if summary is not None else ""
        width = max([len(r["daemon"]) for r in rows] + [6, len(label)])
        print(f"{'DAEMON':<{width}}  {'CACHED':>7}  {'FILES':>13}  BYTES")
        for row in rows:
            print(f"{row['daemon']:<{width}}  {row['fraction'] * 100:6.1f}%  "
                  f"{row['cached_files']:>6}/{row['files']:<6}  "
                  f"{format_bytes(row['cached_bytes'])} / {format_bytes(row['bytes'])}")
        if summary is not None:
            print(f"{label:<{width}}  {summary['fraction'] * 100:6.1f}%  "
                  f"{summary['covered_files']:>6}/{summary['files']:<6}  "
                  f"{format_bytes(summary['covered_bytes'])} / {format_bytes(summary['bytes'])}  on their owners")
            print(f"{'':<{width}}  {summary['anywhere_fraction'] * 100:6.1f}%  "
                  f"{summary['anywhere_files']:>6}/{summary['files']:<6}  "
                  f"{format_bytes(summary['anywhere_bytes'])} / {format_bytes(summary['bytes'])}  anywhere in the cluster")
    code = _exit_for_problems([t for t in targets if id(t) in shown])
    if code == EXIT_OK and any(row["cached_files"] < row["files"] for row in rows):
        return EXIT_FAILED
    return code


def _cancel(targets: list[Target], out: Output) -> int:
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
    files, size = status["files"], status["bytes"]
    return Progress(
        files_done=files["done"], files_total=files["total"],
        bytes_done=min(size["done"] + size["in_flight"], size["total"]) if size["total"] else size["done"],
        bytes_total=size["total"], failed=files["failed"],
        rate_bytes_per_s=status.get("rate_bytes_per_s"), eta_s=status.get("eta_s"), state=status["state"],
    )


def _lines(targets: list[Target], dataset: DatasetURL) -> list[Any]:
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
