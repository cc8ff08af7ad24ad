"""Settings of ``shardcache serve``, built once by the CLI from flags and ``SHARDCACHE_*`` env vars."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from cache import StoreSettings
from sidecar.daemon.auth.authorizer import AuthSettings
from sidecar.daemon.claims import ClaimSettings
from sidecar.daemon.fills import FetchSettings
from sidecar.daemon.origins.s3 import S3Settings
from sidecar.daemon.peers.config import ClusterSettings
from sidecar.daemon.scrub import ScrubSettings
from wire.errors import InvalidName
from wire.names import MAX_GID, parse_connect, parse_listen
from wire.web import ConnectionLimits

__all__ = ["ServeSettings", "MasterLinkSettings", "MODES"]

MODES = ("node", "sidecar")


@dataclass(frozen=True)
class MasterLinkSettings:
    """``--master``: the node daemon reports what it caches to a lease master and takes its plan
    (:mod:`sidecar.daemon.masterlink`)."""

    urls: tuple[str, ...]
    """The master's URL, or several (its leader and followers: the leader answers reports, a
    follower names it), tried in turn: ``http(s)://host:port[/base]`` or ``unix:///path.sock``."""

    token: str | None = None
    """The master's operator token (``--master-token-file``), sent as ``Authorization: Bearer``."""

    first_interval_s: float = 2.0
    """Seconds between reports until the first plan says otherwise (its ``interval_s``)."""

    timeout_s: float = 10.0
    """Seconds one report may take, sent and answered; a master slower than that counts as down."""

    backoff_max_s: float = 60.0
    """Longest wait before reporting again after failures (doubling from the interval)."""

    def __post_init__(self) -> None:
        if not self.urls:
            raise ValueError("--master needs a URL: http://master:8700 (several comma-separated: leader and followers)")
        for url in self.urls:
            try:
                parse_connect(url, schemes=("http", "https"), base_path=True)
            except InvalidName as exc:
                raise ValueError(f"--master: {exc}") from None
        if self.token is not None and (not self.token or any(c.isspace() for c in self.token)):
            raise ValueError("--master-token-file: the token is one word, without spaces or line breaks inside")
        if not (self.first_interval_s > 0 and self.timeout_s > 0 and self.backoff_max_s >= self.first_interval_s):
            raise ValueError("the master link's interval, timeout and backoff must be positive seconds")


@dataclass(frozen=True)
class ServeSettings:
    store: StoreSettings
    """Where and how much to cache."""

    listen: tuple[str, ...] = ("tcp://127.0.0.1:8600",)
    """Addresses to serve on: ``unix:///path.sock`` and/or ``tcp://host:port``."""

    origin: str = "s3"
    """``s3`` (boto3 credential chain and endpoint) or ``file:///root``."""

    s3: S3Settings = field(default_factory=S3Settings)
    """S3 client settings, used when ``origin`` is ``s3``."""

    fetch: FetchSettings = field(default_factory=FetchSettings)
    """Parallelism, retries and backoff of origin fetches."""

    claims: ClaimSettings = field(default_factory=ClaimSettings)
    """What a caller's disagreeing checksum may make the daemon do."""

    scrub: ScrubSettings = field(default_factory=ScrubSettings)
    """Idle-time re-hashing of cached files."""

    mode: str = "node"
    """``node``: the per-node daemon. ``sidecar``: forward to ``upstream``, or cache standalone when
    the node has no daemon."""

    upstream: str | None = None
    """The node daemon, for sidecar mode (``unix:///run/shardcache/daemon.sock``)."""

    prefetch_workers: int = 4
    """Background fills running at once for prefetch and warm-up requests."""

    direct_range_bytes: int = 8 * 1024 * 1024
    """``--direct-range-bytes``: a ranged GET of at most this many bytes of an object not cached
    (nor filled as far as the range's start) is answered by one ranged GET of the origin, and the
    object filled behind it only into free room (:mod:`sidecar.daemon.reads`). 0: every ranged
    read of an object not cached waits for the whole object's fill, as before."""

    prefetch_queue_max: int = 100_000
    """Queued prefetches beyond which ``POST /_shardcache/prefetch`` answers 503 SlowDown."""

    shutdown_timeout_s: float = 10.0
    """On SIGTERM, seconds to let requests in progress finish."""

    auth: AuthSettings = field(default_factory=AuthSettings)
    """``--auth sigv4``: each caller proves its own right to what it reads (sidecar/daemon/auth/)."""

    connections: ConnectionLimits = field(default_factory=ConnectionLimits)
    """Header-read and idle timeouts and connections at once, every listener together."""

    handles: str | None = None
    """``--handles unix:///PATH.sock``: short-circuit reads by file descriptor
    (:mod:`sidecar.daemon.handles`). Node mode: where the pods' sidecars ask for them (next to
    ``daemon.sock``); sidecar mode: where the pod's app container does (an ``emptyDir``)."""

    upstream_handles: str | None = None
    """Sidecar mode: the node daemon's handle socket; ``None``: ``handles.sock`` next to the
    ``upstream`` unix socket (see :meth:`upstream_handles_path`)."""

    cluster: ClusterSettings | None = None
    """``--peer``/``--peers-dns``: this node daemon is one member of a cluster cache
    (:mod:`sidecar.daemon.peers`); ``None``: a cache of its own."""

    node: str | None = None
    """``--node``/``SHARDCACHE_NODE``: the node's name (the chart sets ``spec.nodeName``), in
    ``/stats``, ``/readyz`` and ``/_shardcache/peers``."""

    master: MasterLinkSettings | None = None
    """``--master URL``: report what this node caches to a lease master and apply its plan
    (prefetch what its trainers will read next; with ``--eviction planned``, evict by when they
    will); needs ``node``, the name the master knows this node by. ``None``: no master."""

    socket_group: int | None = None
    """``--socket-group GID``: the unix sockets (``--listen unix://``, ``--handles``) are mode 0660
    and owned by this group, so only processes in it (the injected sidecars, given it as
    ``runAsGroup``) and the daemon's own user connect. ``None``: mode 0666, anyone who sees the
    socket directory connects (a warning in node mode, whose directory is the node's; a sidecar's
    sockets sit in its pod's own ``emptyDir``, for the pod's containers, whichever user they run as)."""

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}")
        if self.direct_range_bytes < 0:
            raise ValueError(f"--direct-range-bytes must be 0 (off) or more, not {self.direct_range_bytes}")
        if self.mode == "sidecar" and not self.upstream:
            raise ValueError("sidecar mode needs an upstream (the node daemon's address)")
        if self.auth.mode != "none" and self.origin != "s3":
            raise ValueError("--auth sigv4 checks callers against an S3 origin (its IAM and STS): use --origin s3")
        if self.auth.mode != "none" and self.mode == "sidecar":
            raise ValueError("--auth is the node daemon's: a sidecar proves with the pod's credentials by itself")
        if self.cluster is not None and self.mode != "node":
            raise ValueError("--peer/--peers-dns are the node daemon's (--mode node): a sidecar reads its node's daemon")
        if self.cluster is not None and self.auth.mode != "none" and self.cluster.secret is None:
            raise ValueError(
                "--auth sigv4 with peers needs --peer-secret-file: open peer links would let any pod read "
                "through the peer path past the tenant checks"
            )
        if self.master is not None and self.mode != "node":
            raise ValueError("--master is the node daemon's (--mode node): a sidecar reads through its node's daemon")
        if self.master is not None and not self.node:
            raise ValueError(
                "--master needs --node NAME (SHARDCACHE_NODE; the chart sets spec.nodeName): the master plans per "
                "node, by the name its trainers give in their leases"
            )
        if self.socket_group is not None and not 0 <= self.socket_group <= MAX_GID:
            raise ValueError(f"--socket-group must be a numeric group id from 0 to {MAX_GID}, not {self.socket_group}")
        if self.handles is not None and _unix_path(self.handles, "--handles", listen=True) is None:
            raise ValueError(f"--handles must be unix:///path.sock (descriptors pass over unix sockets only), not {self.handles!r}")
        if self.handles is not None and self.mode == "sidecar":
            self.upstream_handles_path()  # raises if there is none to find
        elif self.upstream_handles is not None:
            raise ValueError("--upstream-handles is the sidecar's (--mode sidecar --handles ...)")

    def upstream_handles_path(self) -> str:
        """The node daemon's handle socket, for a sidecar: ``upstream_handles``, or
        ``handles.sock`` in the directory of the ``upstream`` unix socket."""
        if self.upstream_handles is not None:
            path = _unix_path(self.upstream_handles, "--upstream-handles", listen=False)
            if path is None:
                raise ValueError(f"--upstream-handles must be unix:///path.sock, not {self.upstream_handles!r}")
            return path
        upstream = _unix_path(self.upstream or "", "--upstream", listen=False)
        if upstream is None:
            raise ValueError(
                f"--handles in sidecar mode with a TCP --upstream ({self.upstream!r}) needs --upstream-handles "
                "unix:///run/shardcache/handles.sock (descriptors pass over unix sockets only)"
            )
        return os.path.join(os.path.dirname(upstream), "handles.sock")


def _unix_path(address: str, flag: str, listen: bool) -> str | None:
    """The socket path of a ``unix://`` address; ``None`` for a TCP one; ValueError if malformed."""
    try:
        where = parse_listen(address) if listen else parse_connect(address)
    except InvalidName as exc:
        raise ValueError(f"{flag}: {exc}") from None
    return where.path if where.kind == "unix" else None
