"""Settings of ``shardcache serve``, built once by the CLI from flags and ``SHARDCACHE_*`` env vars."""

from __future__ import annotations

from dataclasses import dataclass, field

from cache import StoreSettings
from sidecar.daemon.auth.authorizer import AuthSettings
from sidecar.daemon.claims import ClaimSettings
from sidecar.daemon.fills import FetchSettings
from sidecar.daemon.origins.s3 import S3Settings
from sidecar.daemon.scrub import ScrubSettings
from wire.web import ConnectionLimits

__all__ = ["ServeSettings", "MODES"]

MODES = ("node", "sidecar")


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

    prefetch_queue_max: int = 100_000
    """Queued prefetches beyond which ``POST /_shardcache/prefetch`` answers 503 SlowDown."""

    shutdown_timeout_s: float = 10.0
    """On SIGTERM, seconds to let requests in progress finish."""

    auth: AuthSettings = field(default_factory=AuthSettings)
    """``--auth sigv4``: each caller proves its own right to what it reads (sidecar/daemon/auth/)."""

    connections: ConnectionLimits = field(default_factory=ConnectionLimits)
    """Header-read and idle timeouts and connections at once, every listener together."""

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}")
        if self.mode == "sidecar" and not self.upstream:
            raise ValueError("sidecar mode needs an upstream (the node daemon's address)")
        if self.auth.mode != "none" and self.origin != "s3":
            raise ValueError("--auth sigv4 checks callers against an S3 origin (its IAM and STS): use --origin s3")
        if self.auth.mode != "none" and self.mode == "sidecar":
            raise ValueError("--auth is the node daemon's: a sidecar proves with the pod's credentials by itself")
