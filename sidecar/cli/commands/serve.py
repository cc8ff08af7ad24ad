"""``shardcache serve``: the node cache daemon, or the pod sidecar."""

from __future__ import annotations

import argparse
from pathlib import Path

from cache.eviction import EVICTION_POLICIES
from sidecar.cli.util import (
    EXIT_UNAVAILABLE,
    RawDefaultsFormatter,
    UserError,
    add_connection_flags,
    add_flag,
    connection_limits,
    parse_gid,
    parse_ratio,
    parse_size,
)

EXAMPLES = """\
examples:
  # node daemon (DaemonSet): S3 origin from the standard AWS chain / AWS_ENDPOINT_URL
  shardcache serve --mode node --listen unix:///run/shardcache/daemon.sock \\
      --listen tcp://0.0.0.0:8600 --cache-dir /var/cache/shardcache --cache-size 200GiB --origin s3

  # local dataset tree as the origin (first path component under the root is the bucket)
  shardcache serve --origin file:///data --cache-dir /tmp/cache --cache-size 20GiB

  # pod sidecar: forward to the node daemon, standalone cache if the node has none
  shardcache serve --mode sidecar --upstream unix:///run/shardcache/daemon.sock \\
      --listen tcp://127.0.0.1:8600 --cache-dir /var/cache/shardcache-pod --cache-size 10GiB

  # then read through it with any S3 client
  aws s3 cp --endpoint-url http://127.0.0.1:8600 s3://bucket/train/train-000000.tar .
"""


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "serve",
        help="run the node cache daemon or the pod sidecar",
        description="Serve objects from an SSD cache in front of S3 or a file:// origin, over the S3 read API.",
        epilog=EXAMPLES,
        formatter_class=RawDefaultsFormatter,
    )
    add_flag(parser, "--mode", default="node", choices=["node", "sidecar"], help="node daemon or pod sidecar")
    add_flag(parser, "--listen", action="append", metavar="ADDR",
             help="unix:///path.sock or tcp://host:port; repeatable (default tcp://127.0.0.1:8600)")
    add_flag(parser, "--cache-dir", default="/var/cache/shardcache", help="directory holding the cache")
    add_flag(parser, "--cache-dir-read-only", default=None, metavar="PATH",
             help="the --cache-dir mounted a second time, read-only: the --handles descriptors given to pods are "
                  "opened through it, so that not even a root pod can reopen one for writing through /proc/self/fd "
                  "(node mode; default: through --cache-dir, with a warning)")
    add_flag(parser, "--cache-size", default="100GiB", help="cache capacity, e.g. 200GiB")
    add_flag(parser, "--min-free", default="10%", help="keep this much of the file system free")
    add_flag(parser, "--max-items", default="1000000", help="maximum number of cached objects")
    add_flag(parser, "--eviction", default="lru", choices=list(EVICTION_POLICIES),
             help="lru: evict least recently used; hold: admit until full, then serve misses uncached; planned: "
                  "by the --master's plan (what its trainers read last goes first: Belady's rule), as lru without one")
    add_flag(parser, "--tenant-quota", default=None, metavar="SIZE",
             help="bytes one authenticated tenant may bring into the cache, e.g. 50GiB; past it that "
                  "tenant's own least recently used entries are evicted first (default: no quota)")
    add_flag(parser, "--direct-writes", default="on", choices=["on", "off"],
             help="write fills with O_DIRECT where the file system takes it: no copy into the page cache "
                  "(about half the daemon's CPU per filled GB); off where the cache disk is slower than the "
                  "origin (network block storage), since a fresh fill is then read back from the disk")
    add_flag(parser, "--origin", default="s3", help="s3 or file:///abs/root")
    add_flag(parser, "--s3-endpoint", default=None,
             help="S3 endpoint URL (default: boto3's resolution, including AWS_ENDPOINT_URL)")
    add_flag(parser, "--s3-region", default=None, help="S3 signing region (default: boto3's resolution)")
    add_flag(parser, "--s3-client", default="http", choices=["http", "boto3"],
             help="how the daemon talks to S3: presigned requests on a pooled HTTP client (default) "
                  "or plain boto3 calls; both on worker threads")
    add_flag(parser, "--upstream", default=None, help="node daemon address for --mode sidecar")
    add_flag(parser, "--handles", default=None, metavar="unix:///PATH.sock",
             help="short-circuit reads by file descriptor on this unix socket: node mode, for the pods' sidecars "
                  "(next to daemon.sock); sidecar mode, for the pod's app container (an emptyDir), relayed to the "
                  "node daemon's (default: off)")
    add_flag(parser, "--upstream-handles", default=None, metavar="unix:///PATH.sock",
             help="the node daemon's --handles socket, for --mode sidecar --handles (default: handles.sock next to "
                  "the --upstream unix socket)")
    add_flag(parser, "--socket-group", default=None, metavar="GID",
             help="the unix sockets (--listen unix://, --handles) are mode 0660 and owned by this numeric group: "
                  "only the daemon's user and that group connect (the chart passes it, the injector runs the "
                  "sidecars in it); default: mode 0666, with a warning in node mode")
    add_flag(parser, "--part-size", default="8MiB", help="bytes per ranged GET to the origin")
    add_flag(parser, "--parts-per-object", default="8", help="ranged GETs in flight per object")
    add_flag(parser, "--origin-concurrency", default="32", help="origin requests in flight in total")
    add_flag(parser, "--retries", default="4", help="retries per origin request after the first attempt")
    add_flag(parser, "--prefetch-workers", default="4", help="background fills at once for prefetch/warm-up")
    add_flag(parser, "--direct-range-bytes", default="8MiB",
             help="a ranged GET of at most this many bytes of an object not cached is answered by one ranged GET "
                  "of the origin, the object filled behind it only into free room (0: wait for the whole fill)")
    add_flag(parser, "--verify-etag-md5", default="on", choices=["on", "off"],
             help="verify objects without an S3 additional checksum against their ETag where it is an MD5 "
                  "(single-part, not SSE-KMS/SSE-C); costs ~1.2 CPU-s/GB")
    add_flag(parser, "--scrub-rate", default="32MB",
             help="bytes per second to re-hash cached files at while idle (0: off); each at most daily")
    add_flag(parser, "--auth", default="none", choices=["none", "sigv4"],
             help="sigv4: every read, listing and control call proves the caller's own right to it with the "
                  "pod's AWS credentials (made by the pod's sidecar, checked against the origin); node mode only")
    add_flag(parser, "--auth-identity", default="sts", choices=["sts", "access-key"],
             help="who a caller is under --auth sigv4: the principal STS GetCallerIdentity reports, or the "
                  "access key (object stores without STS)")
    add_flag(parser, "--sts-endpoint", default=None,
             help="STS endpoint for --auth sigv4 (default: the S3 endpoint when it is a custom one, else AWS's "
                  "regional STS)")
    add_flag(parser, "--auth-cache-ttl", default="120",
             help="seconds the origin's yes to (caller, object) is reused before the proof is checked again")
    add_flag(parser, "--peer", action="append", metavar="URL",
             help="another node daemon of the cluster cache, http://HOST:PORT; repeatable (comma-separated in "
                  "the env var). Each object is then filled from the origin once for the cluster, by its owner")
    add_flag(parser, "--peers-dns", default=None, metavar="NAME",
             help="every A record of NAME is a member (re-resolved every 5 s), at the port of --advertise-url; "
                  "the chart gives the DaemonSet's headless Service")
    add_flag(parser, "--advertise-url", default=None, metavar="URL",
             help="how the other daemons reach this one (its identity in the ring); default: a --listen tcp:// "
                  "address that is not 0.0.0.0")
    add_flag(parser, "--peer-secret-file", default=None, metavar="PATH",
             help="the secret every member shares (peers sign their reads with it); without it peer links are "
                  "open, and --auth sigv4 refuses to start")
    add_flag(parser, "--node", default=None, metavar="NAME",
             help="this node's name, shown in /stats and /_shardcache/peers (the chart sets spec.nodeName)")
    add_flag(parser, "--master", default=None, metavar="URL",
             help="a lease master (shardcache master), or several comma-separated (leader and followers): report "
                  "what this node caches to it every few seconds and apply its plan (prefetch what the node's "
                  "trainers will read next; --eviction planned evicts by it). Needs --node (default: no master)")
    add_flag(parser, "--master-token-file", default=None, metavar="PATH",
             help="the master's operator token (its --token-file), sent with every report")
    add_connection_flags(parser, max_connections=1024)
    parser.set_defaults(func=run)


def _int(value: str, flag: str, minimum: int = 0) -> int:
    try:
        number = int(value)
    except ValueError:
        raise UserError(f"{flag} must be an integer, not {value!r}") from None
    if number < minimum:
        raise UserError(f"{flag} must be at least {minimum}")
    return number


def _tenant_quota(value: str | None) -> int | None:
    if value is None or not str(value).strip():
        return None  # SHARDCACHE_TENANT_QUOTA= (empty) means no quota too
    try:
        quota = parse_size(value)
    except UserError as exc:
        raise UserError(f"--tenant-quota: {exc}; leave it out for no quota") from None
    if quota <= 0:
        raise UserError(f"--tenant-quota must be a positive size such as 50GiB, not {value!r}; leave it out for no quota")
    return quota


def build_settings(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from cache import StoreSettings
    from sidecar.daemon.checksums import VerifySettings
    from sidecar.daemon.fills import FetchSettings
    from sidecar.daemon.origins.s3 import S3Settings
    from sidecar.daemon.scrub import ScrubSettings
    from sidecar.daemon.settings import ServeSettings
    from wire.names import parse_listen

    listen = tuple(args.listen or ["tcp://127.0.0.1:8600"])
    for address in listen:
        try:
            parse_listen(address)
        except ValueError as exc:
            raise UserError(str(exc)) from None
    origin = args.origin
    if origin != "s3" and not origin.startswith("file:///"):
        raise UserError(f"--origin must be s3 or file:///abs/root, not {origin!r}")
    if origin.startswith("file://") and not Path(origin[len("file://"):]).is_dir():
        raise UserError(f"--origin {origin}: directory does not exist")
    if args.mode == "sidecar" and not args.upstream:
        raise UserError("--mode sidecar needs --upstream unix:///run/shardcache/daemon.sock")
    handles = args.handles or None  # SHARDCACHE_HANDLES= (empty) means off too
    upstream_handles = args.upstream_handles or None
    for flag, address in (("--handles", handles), ("--upstream-handles", upstream_handles)):
        try:
            unix = address is None or parse_listen(address).kind == "unix"
        except ValueError as exc:
            raise UserError(f"{flag}: {exc}") from None
        if not unix:
            raise UserError(f"{flag} must be unix:///path.sock (descriptors pass over unix sockets only), not {address!r}")
    if upstream_handles is not None and not (args.mode == "sidecar" and handles):
        raise UserError("--upstream-handles is for --mode sidecar --handles unix:///...")
    if args.mode == "sidecar" and handles and not upstream_handles and not str(args.upstream).startswith("unix://"):
        raise UserError("--handles with a TCP --upstream needs --upstream-handles unix:///run/shardcache/handles.sock")
    read_only_view = args.cache_dir_read_only or None  # SHARDCACHE_CACHE_DIR_READ_ONLY= (empty) means none
    if read_only_view is not None and args.mode != "node":
        raise UserError("--cache-dir-read-only is the node daemon's (--mode node --handles): a sidecar hands out "
                        "the node daemon's descriptors")
    concurrency = _int(args.origin_concurrency, "--origin-concurrency", 2)
    auth = _auth_settings(args)
    master = _master_settings(args)
    cluster = _cluster_settings(args, listen, auth.mode)
    try:
        store = StoreSettings(
            root=Path(args.cache_dir),
            capacity_bytes=parse_size(args.cache_size),
            min_free_ratio=parse_ratio(args.min_free),
            max_items=_int(args.max_items, "--max-items", 1),
            eviction=args.eviction,
            direct_writes=args.direct_writes == "on",
            tenant_quota_bytes=_tenant_quota(args.tenant_quota),
            read_only_view=Path(read_only_view) if read_only_view is not None else None,
        )
    except ValueError as exc:
        raise UserError(str(exc)) from None
    return ServeSettings(
        store=store,
        listen=listen,
        origin=origin,
        s3=S3Settings(endpoint_url=args.s3_endpoint, region=args.s3_region, client=args.s3_client),
        fetch=FetchSettings(
            part_size=parse_size(args.part_size),
            parts_per_object=_int(args.parts_per_object, "--parts-per-object", 1),
            origin_concurrency=concurrency,
            demand_reserved=max(1, concurrency // 4),
            retries=_int(args.retries, "--retries"),
            verify=VerifySettings(etag_md5=args.verify_etag_md5 == "on"),
        ),
        scrub=ScrubSettings(bytes_per_s=float(parse_size(args.scrub_rate))),
        mode=args.mode,
        upstream=args.upstream,
        prefetch_workers=_int(args.prefetch_workers, "--prefetch-workers", 1),
        direct_range_bytes=parse_size(args.direct_range_bytes),
        connections=connection_limits(args),
        auth=auth,
        handles=handles,
        upstream_handles=upstream_handles,
        cluster=cluster,
        node=args.node or None,
        master=master,
        socket_group=parse_gid(args.socket_group, "--socket-group"),
    )


def _master_settings(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from sidecar.daemon.settings import MasterLinkSettings

    urls = tuple(url.strip() for url in (args.master or "").split(",") if url.strip())
    if not urls:
        if args.master_token_file:
            raise UserError("--master-token-file is for a lease master: give --master http://master:8700 too")
        return None
    if args.mode != "node":
        raise UserError("--master is the node daemon's (--mode node): a sidecar reads through its node's daemon")
    if not args.node:
        raise UserError("--master needs --node NAME (or SHARDCACHE_NODE; the chart sets spec.nodeName): the master "
                        "plans per node, by the node name its trainers lease with")
    token: str | None = None
    if args.master_token_file:
        try:
            token = Path(args.master_token_file).read_text().strip()
        except (OSError, UnicodeDecodeError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
            raise UserError(f"--master-token-file {args.master_token_file}: {reason}") from None
        if not token:
            raise UserError(f"--master-token-file {args.master_token_file} is empty: put the master's token in it "
                            "(the file the master's --token-file reads)")
    try:
        return MasterLinkSettings(urls=urls, token=token)
    except ValueError as exc:
        raise UserError(str(exc)) from None


def _cluster_settings(args: argparse.Namespace, listen: tuple[str, ...], auth_mode: str):  # type: ignore[no-untyped-def]
    from sidecar.daemon.peers.config import ClusterSettings, advertised_url

    peers = tuple(args.peer or ())
    dns = args.peers_dns or None  # SHARDCACHE_PEERS_DNS= (empty) means none
    if not peers and not dns:
        if args.peer_secret_file or args.advertise_url:
            raise UserError("--peer-secret-file and --advertise-url are for a cluster: give --peer URL or --peers-dns NAME")
        return None
    if args.mode != "node":
        raise UserError("--peer/--peers-dns are the node daemon's (--mode node): a sidecar reads its node's daemon")
    secret: bytes | None = None
    if args.peer_secret_file:
        try:
            secret = Path(args.peer_secret_file).read_bytes().strip()
        except OSError as exc:
            raise UserError(f"--peer-secret-file {args.peer_secret_file}: {exc.strerror or exc}") from None
        if not secret:
            raise UserError(f"--peer-secret-file {args.peer_secret_file} is empty: put the cluster's shared secret in it")
    elif auth_mode != "none":
        raise UserError(
            "--auth sigv4 with --peer/--peers-dns needs --peer-secret-file PATH (the same secret on every daemon): "
            "open peer links would let any pod read through the peer path past the tenant checks"
        )
    try:
        return ClusterSettings(
            peers=peers, peers_dns=dns, advertise_url=advertised_url(args.advertise_url or None, listen), secret=secret,
        )
    except ValueError as exc:
        raise UserError(str(exc)) from None


def _auth_settings(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from sidecar.daemon.auth import AuthSettings

    if args.auth == "none":
        return AuthSettings()
    if args.mode == "sidecar":
        raise UserError("--auth is the node daemon's: a sidecar proves with the pod's credentials by itself")
    if args.origin != "s3":
        raise UserError("--auth sigv4 checks callers against an S3 origin (its IAM and STS): use --origin s3")
    try:
        ttl = float(args.auth_cache_ttl)
    except ValueError:
        raise UserError(f"--auth-cache-ttl must be seconds, not {args.auth_cache_ttl!r}") from None
    if not 0 <= ttl <= 3600:
        raise UserError("--auth-cache-ttl must be between 0 and 3600 seconds")
    if args.sts_endpoint is not None and not args.sts_endpoint.startswith(("http://", "https://")):
        raise UserError(f"--sts-endpoint must be an http(s) URL, not {args.sts_endpoint!r}")
    return AuthSettings(mode="sigv4", identity=args.auth_identity, sts_endpoint=args.sts_endpoint, decision_ttl_s=ttl)


def run(args: argparse.Namespace) -> int:
    from cache import CacheLocked, ReadOnlyViewError
    from sidecar.daemon.server import run_daemon

    settings = build_settings(args)
    try:
        run_daemon(settings)
    except CacheLocked as exc:
        raise UserError(f"{exc}; stop the other daemon or use another --cache-dir", EXIT_UNAVAILABLE) from None
    except ReadOnlyViewError as exc:
        raise UserError(f"--cache-dir-read-only: {exc}") from None
    except OSError as exc:
        if exc.errno in (98, 13):  # EADDRINUSE, EACCES on a listen address
            raise UserError(f"cannot listen: {exc}", EXIT_UNAVAILABLE) from None
        raise
    return 0
