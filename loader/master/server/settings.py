"""Settings of ``shardcache master``, built once by the CLI and passed down."""

from __future__ import annotations

import socket
from dataclasses import dataclass, field
from pathlib import Path

from wire.errors import InvalidName
from wire.names import Address, parse_listen
from wire.web import ConnectionLimits

__all__ = ["MasterSettings", "listen_address", "parse_state"]


@dataclass(frozen=True)
class MasterSettings:
    listen: tuple[str, ...] = ("tcp://0.0.0.0:8700",)
    """Addresses to serve the API on: ``tcp://host:port`` or ``unix:///path/to.sock``."""

    state: str = "sqlite:///var/lib/shardcache/master.db"
    """Where the state lives: ``sqlite:///path`` (one master) or ``etcd://host:2379[,host2:2379]/prefix``
    (several masters, one leader elected through etcd)."""

    advertise_url: str | None = None
    """URL other masters tell clients to use to reach this one when it leads (etcd mode).
    Default: ``http://<hostname>:<port>`` of the first TCP listener."""

    lease_ttl_s: float = 30.0
    """Lease TTL of jobs whose spec does not set ``lease_ttl_s``."""

    max_failures: int = 3
    """``max_failures`` of jobs whose spec does not set it."""

    election_ttl_s: int = 3
    """TTL of the etcd lease behind leadership: a dead leader is replaced within about this long."""

    election_poll_s: float = 0.5
    """How often a standby checks whether the leader key is gone."""

    etcd_timeout_s: float = 5.0
    """Per-request timeout towards etcd."""

    etcd_compact: bool = True
    """Compact etcd's key history after each snapshot (the master writes often; without compaction
    etcd's database grows until its quota stops the cluster)."""

    max_body_bytes: int = 256 * 1024 * 1024
    """Largest create-job body (it carries the shard list), counted decompressed when sent with
    ``Content-Encoding: gzip``. The body is parsed as it arrives, never held whole: the limit
    bounds the parse's CPU; memory is bounded by the shard count. 256 MiB holds a
    1,000,000-shard spec with keys of up to ~190 characters."""

    token_file: Path | None = None
    """File holding the operator's bearer token (``--token-file``): it may see and do everything."""

    tenant_tokens_dir: Path | None = None
    """Directory of the tenants' tokens (``--tenant-tokens``), one file per tenant named after it:
    a tenant sees and changes only the jobs it created. Neither this nor ``token_file``: open."""

    max_small_body_bytes: int = 64 * 1024
    """Largest body of every other request."""

    max_shards: int = 1_000_000
    """Most shards one job may have."""

    max_jobs: int = 100
    """Most jobs the master holds; creating one more is refused (``TooManyJobs``), joining an
    existing one still works. Nothing deletes jobs yet: finished jobs count."""

    max_batch: int = 512
    """Most events in one group commit (1 commits every event on its own)."""

    snapshot_min_events: int = 10_000
    """Snapshot the state after at least this many logged events (and at least twice the shard
    count, so snapshots cost O(1) per event), then drop the log below it."""

    cluster: tuple[str, ...] = ()
    """``--cluster URL``: daemons of the cluster cache to learn its ring from
    (``GET /_shardcache/peers``, the first that answers), for jobs with a ``locality_window``."""

    cluster_poll_s: float = 5.0
    """How often the leader asks for the ring."""

    connections: ConnectionLimits = field(default_factory=lambda: ConnectionLimits(max_connections=4096))
    """Header-read and idle timeouts and connections at once; every trainer process keeps one
    connection, hence the higher limit."""

    def __post_init__(self) -> None:
        for address in self.listen:
            listen_address(address)
        parse_state(self.state)
        if not 1 <= self.lease_ttl_s <= 86400:
            raise ValueError("lease_ttl_s must be in [1, 86400] seconds")
        if self.max_failures < 1:
            raise ValueError("max_failures must be >= 1")
        if self.election_ttl_s < 2:
            raise ValueError("election_ttl_s must be >= 2 seconds")
        if self.snapshot_min_events < 1:
            raise ValueError("snapshot_min_events must be >= 1")
        if self.max_jobs < 1:
            raise ValueError("max_jobs must be >= 1")
        if not 0.1 <= self.cluster_poll_s <= 3600:
            raise ValueError("cluster_poll_s must be in [0.1, 3600] seconds")
        for url in self.cluster:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"--cluster takes a daemon's URL, http://host:8600, not {url!r}")
        if self.max_batch < 1 or self.max_body_bytes < 1024 or self.max_small_body_bytes < 1024:
            raise ValueError("max_batch, max_body_bytes and max_small_body_bytes must be positive (bodies >= 1 KiB)")

    @property
    def is_etcd(self) -> bool:
        return parse_state(self.state)[0] == "etcd"

    def resolved_advertise_url(self) -> str | None:
        if self.advertise_url:
            return self.advertise_url.rstrip("/")
        for address in self.listen:
            listen = listen_address(address)
            host, port = listen.host, listen.port
            if listen.kind == "tcp":
                if host in ("", "0.0.0.0", "::"):
                    host = socket.gethostname()
                if ":" in host:
                    host = f"[{host}]"
                return f"http://{host}:{port}"
        return None


def listen_address(address: str) -> Address:
    """:func:`wire.names.parse_listen`, refusing with the master's own example addresses."""
    try:
        return parse_listen(address)
    except InvalidName:
        raise ValueError(
            f"invalid listen address {address!r}: use tcp://0.0.0.0:8700 or unix:///run/shardcache/master.sock"
        ) from None


def parse_state(url: str) -> tuple[str, str]:
    """``sqlite:///var/x.db`` -> ("sqlite", "/var/x.db"); ``etcd://h:2379/p`` -> ("etcd", url)."""
    if url.startswith("sqlite://"):
        path = url[len("sqlite://") :]
        if not path:
            raise ValueError(f"invalid state URL {url!r}: use sqlite:///var/lib/shardcache/master.db")
        return "sqlite", str(Path(path))
    if url.startswith(("etcd://", "etcd+http://", "etcd+https://")):
        from loader.master.server.etcd import parse_etcd_url

        parse_etcd_url(url)
        return "etcd", url
    raise ValueError(f"invalid state URL {url!r}: use sqlite:///path/to/master.db or etcd://host:2379/prefix")
