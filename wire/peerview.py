"""A daemon's view of its cluster: the answer of ``GET /_shardcache/peers``, parsed.

Read by the CLI (``shardcache warmup --spread``, ``shardcache status``) and by the lease master
(``shardcache master --cluster``, which places shards with the same ring), so both read the
document one way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from wire.rendezvous import member_id

__all__ = ["RingMember", "PeerView", "parse_peers"]


@dataclass(frozen=True)
class RingMember:
    """One member of a daemon's cluster, as ``GET /_shardcache/peers`` lists it."""

    id: str  # wire.rendezvous.member_id of its URL: what the ring hashes
    url: str  # where to reach it
    live: bool
    node: str | None
    self: bool


@dataclass(frozen=True)
class PeerView:
    """A daemon's view of its cluster (``GET /_shardcache/peers``)."""

    self_id: str
    node: str | None
    peer_links: str  # "authenticated" or "open"
    members: tuple[RingMember, ...]

    @property
    def live(self) -> list[RingMember]:
        return [m for m in self.members if m.live]


def parse_peers(doc: Any) -> PeerView:
    """The answer of ``/_shardcache/peers``; ValueError when it is not that document."""
    if not isinstance(doc, dict) or not isinstance(doc.get("members"), list) or not isinstance(doc.get("self"), str):
        raise ValueError("not a /_shardcache/peers answer (no self/members)")
    members = []
    for item in doc["members"]:
        if not isinstance(item, dict) or not isinstance(item.get("url"), str):
            raise ValueError(f"a member without a url: {item!r}")
        url = item["url"]
        # The id is what the ring hashes; a daemon that omits it means its URL's normalized form.
        ident = str(item.get("id") or member_id(url))
        node = item.get("node")
        members.append(RingMember(ident, url, bool(item.get("live", True)), str(node) if node else None,
                                  bool(item.get("self", ident == doc["self"]))))
    node = doc.get("node")
    return PeerView(doc["self"], str(node) if node else None, str(doc.get("peer_links") or "open"), tuple(members))
