"""The peer header: who asks, when, and an HMAC that proves it knows the cluster's secret.

``x-shardcache-peer: m=<member id>,t=<unix seconds>,sig=<hex HMAC-SHA256(secret,
"{t}\\n{method}\\n{raw path and query}\\n{m}")>``, or ``m=<member id>,open`` without a secret.
The signature covers the method and the exact path and query, so a captured header is good for
that one read, for ``max_skew_s`` at most.
"""

from __future__ import annotations

import hashlib
import hmac
import time

from sidecar.errors import SidecarError

__all__ = ["IF_CACHED_HEADER", "PEER_HEADER", "PeerRefused", "sign", "verify"]

PEER_HEADER = "x-shardcache-peer"
IF_CACHED_HEADER = "x-shardcache-peer-if-cached"
"""On a peer's read, ``1``: answer from the cache only, never fill (``503 NotCached`` otherwise). The
new owner of an object asks the member that owned it before (a hand-off); unsigned, since it only
narrows what the answer may do."""


class PeerRefused(SidecarError, PermissionError):
    """A peer header that does not prove a peer; the message says why (for the log and the 403)."""


def _mac(secret: bytes, t: str, method: str, target: str, member: str) -> str:
    return hmac.new(secret, f"{t}\n{method}\n{target}\n{member}".encode("utf-8", "surrogateescape"),
                    hashlib.sha256).hexdigest()


def sign(secret: bytes | None, member: str, method: str, target: str, now: float | None = None) -> str:
    """The header value for a request of ``method`` on ``target`` (raw path and query) by ``member``."""
    if secret is None:
        return f"m={member},open"
    t = str(int(time.time() if now is None else now))
    return f"m={member},t={t},sig={_mac(secret, t, method, target, member)}"


def verify(secret: bytes | None, value: str, method: str, target: str, max_skew_s: float = 60.0,
           now: float | None = None) -> str:
    """The asking member's id, or :class:`PeerRefused`. Without a secret anyone is a peer (open links)."""
    fields: dict[str, str] = {}
    for part in value.split(","):
        name, sep, field_value = part.strip().partition("=")
        fields[name] = field_value if sep else ""
    member = fields.get("m", "")
    if not member or len(member) > 300:
        raise PeerRefused("the peer header names no member")
    if secret is None:
        return member
    t, sig = fields.get("t", ""), fields.get("sig", "")
    if not t or not sig:
        raise PeerRefused(f"{member}: unsigned peer request, and this daemon has a --peer-secret-file")
    if not t.isascii() or not t.isdigit():
        raise PeerRefused(f"{member}: malformed peer timestamp")
    skew = abs((time.time() if now is None else now) - int(t))
    if skew > max_skew_s:
        raise PeerRefused(f"{member}: peer request {skew:.0f} s off this daemon's clock (at most {max_skew_s:g} s)")
    if not hmac.compare_digest(sig, _mac(secret, t, method, target, member)):
        raise PeerRefused(f"{member}: wrong peer signature (another --peer-secret-file?)")
    return member
