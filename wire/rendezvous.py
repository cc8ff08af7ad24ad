"""Rendezvous (highest-random-weight) hashing: which member of a set owns an object.

One rule for the node daemons (which peer fills an object from the origin) and the CLI
(``shardcache warmup --spread``, which daemon to warm a shard on), so both place every object on
the same member. A member's identity is its normalized URL (:func:`member_id`); an object's name
is ``bucket/key``. Adding or removing a member moves only the objects that land on (or were on)
it. The score is xxh3-64 of ``member + NUL + name``; ties (never seen in practice) go to the
greater identity so every caller agrees.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from urllib.parse import urlsplit

import xxhash

__all__ = ["best", "member_id", "owner", "prefixed", "ranked", "score"]


def member_id(url: str) -> str:
    """The identity of a daemon reached at ``url``: ``scheme://host:port``, lower case, with the
    port always written (so ``http://10.0.0.1`` and ``http://10.0.0.1:80/`` are one member)."""
    parts = urlsplit(url if "://" in url else f"http://{url}")
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"a member is http(s)://host:port, not {url!r}")
    port = parts.port or (443 if parts.scheme == "https" else 80)
    host = parts.hostname.lower()
    if ":" in host:
        host = f"[{host}]"
    return f"{parts.scheme}://{host}:{port}"


def score(member: str, name: str) -> int:
    """``member``'s weight for ``name``: the owner has the greatest (ties: the greater member)."""
    return xxhash.xxh3_64_intdigest(f"{member}\0{name}".encode("utf-8", "surrogatepass"))


def prefixed(members: Iterable[str]) -> list[tuple[bytes, str]]:
    """Each member with its hashing prefix (``member + NUL`` encoded), for :func:`best`."""
    return [(f"{member}\0".encode("utf-8", "surrogatepass"), member) for member in members]


def best(members: Sequence[tuple[bytes, str]], name: str) -> tuple[int, str]:
    """The owner of ``name`` among ``members`` (from :func:`prefixed`, not empty) with its score:
    :func:`owner`'s choice, for a caller placing many names over many members (the lease master),
    without re-encoding each member per name."""
    data = name.encode("utf-8", "surrogatepass")
    digest = xxhash.xxh3_64_intdigest
    return max((digest(prefix + data), member) for prefix, member in members)


def _score(member: str, name: str) -> tuple[int, str]:
    return score(member, name), member


def ranked(members: Iterable[str], name: str) -> list[str]:
    """``members`` from the owner of ``name`` down: the order to try them in."""
    return sorted(members, key=lambda member: _score(member, name), reverse=True)


def owner(members: Sequence[str], name: str) -> str | None:
    """The member that owns ``name``, or None when there are none."""
    return max(members, key=lambda member: _score(member, name)) if members else None
