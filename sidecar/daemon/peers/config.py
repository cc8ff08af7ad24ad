"""Settings of the cluster cache, built once by the CLI (``shardcache serve --peer ...``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from urllib.parse import urlsplit

from wire.rendezvous import member_id

__all__ = ["ClusterSettings", "advertised_url"]


@dataclass(frozen=True)
class ClusterSettings:
    peers: tuple[str, ...] = ()
    """Member URLs given by ``--peer`` (this daemon's own may be among them: it is skipped)."""

    peers_dns: str | None = None
    """A name whose every A/AAAA record is a member (``http://IP:PORT``, PORT from ``advertise_url``)."""

    advertise_url: str = ""
    """How the other members reach this daemon; its :func:`~wire.rendezvous.member_id` is this
    daemon's identity in the ring."""

    secret: bytes | None = field(default=None, repr=False)
    """The shared secret peers sign their requests with; ``None``: peer links are open."""

    health_interval_s: float = 2.0
    """Seconds between two ``GET /readyz`` of each member."""

    health_timeout_s: float = 1.0
    """Seconds a member has to answer a health check."""

    dead_after: int = 2
    """Failed health checks in a row after which a member leaves the ring (it is back at the first success)."""

    dns_interval_s: float = 5.0
    """Seconds between two resolutions of ``peers_dns``."""

    max_skew_s: float = 60.0
    """How far a peer request's timestamp may be from this daemon's clock."""

    replay_cache_entries: int = 100_000
    """Nonces of peer requests remembered (a signed request is taken once): about 180 bytes each;
    see :mod:`sidecar.daemon.peers.replay` for what happens beyond."""

    peer_connect_timeout_s: float = 1.0
    """Seconds to connect to a peer before trying the next candidate (or the origin)."""

    peer_read_timeout_s: float = 10.0
    """Seconds without a byte from a peer before the read goes on from the next candidate."""

    def __post_init__(self) -> None:
        if not self.peers and not self.peers_dns:
            raise ValueError("a cluster needs --peer URL or --peers-dns NAME")
        member_id(self.advertise_url)  # raises ValueError: not http(s)://host:port
        for url in self.peers:
            member_id(url)
        if self.replay_cache_entries < 1:
            raise ValueError("replay_cache_entries must be at least 1")
        if self.secret is not None and len(self.secret) < 16:
            raise ValueError("the peer secret must be at least 16 bytes (e.g. `openssl rand -hex 32`)")

    @property
    def self_id(self) -> str:
        return member_id(self.advertise_url)

    @property
    def port(self) -> int:
        """The port every member listens on (that of ``advertise_url``): DNS records carry none."""
        return int(self.self_id.rsplit(":", 1)[1])

    @property
    def links(self) -> str:
        return "authenticated" if self.secret is not None else "open"


def advertised_url(advertise_url: str | None, listen: tuple[str, ...]) -> str:
    """``--advertise-url``, or the first ``tcp://`` listen address that names a host peers can
    reach (not 0.0.0.0 nor ``::``); ValueError saying what to give when there is none."""
    if advertise_url:
        return advertise_url
    for address in listen:
        if address.startswith("tcp://"):
            parts = urlsplit("http://" + address[len("tcp://"):])
            if parts.hostname and parts.hostname not in ("0.0.0.0", "::") and parts.port:
                return f"http://{address[len('tcp://'):]}"
    raise ValueError(
        "--peer/--peers-dns need --advertise-url http://HOST:PORT (how the other daemons reach this one) "
        "unless a --listen tcp:// address names a reachable host (not 0.0.0.0)"
    )
