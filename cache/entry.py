"""A cached object version as the store indexes it: :class:`Entry`, and the layout version its
meta files are written in. A module of its own so that what only names entries (the eviction
policies) needs nothing of the store."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

__all__ = ["LAYOUT", "Entry"]

LAYOUT = "v1"
"""The on-disk layout's version: the cache's top directory, and a field of every meta file."""


@dataclass
class Entry:
    """One published object version."""

    id: str
    bucket: str
    key: str
    etag: str
    size: int
    xxh3_128: str
    created: float
    last_access: float = 0.0
    pins: int = field(default=0, compare=False)
    # What the origin answered with the bytes, answered again on every hit: its Last-Modified
    # (an HTTP date) and the headers S3 stores with an object (Content-Type, x-amz-meta-*, ...).
    # Meta files written before the daemon kept them have neither: such entries load with
    # ``None`` and ``()``, and are answered without them until they are refetched.
    last_modified: str | None = None
    headers: tuple[tuple[str, str], ...] = ()
    # How the origin vouched for the bytes when they were filled: the checksum algorithm they
    # were verified against (``crc32``, ``md5``, ...), or "" when the origin vouched for nothing
    # checkable (the entry is *unverified*), and the checksum headers it sent, answered again to
    # clients that ask. Older meta files have neither: unverified.
    verified: str = ""
    checksums: tuple[tuple[str, str], ...] = ()
    # Whose request caused the fill (an IAM principal ARN, ``key:AKIA...``): the entry's bytes
    # count against that tenant's quota. "" (no auth, or a meta file older than tenants): nobody's.
    tenant: str = ""
    # A copy of an object another daemon of the cluster owned when it was filled: evicted first.
    borrowed: bool = False

    def meta(self) -> dict[str, object]:
        data = asdict(self)
        data.pop("pins")
        data.pop("last_access")
        data["layout"] = LAYOUT
        return data
