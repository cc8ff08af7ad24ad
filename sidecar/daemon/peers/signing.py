"""Peer links, both ends: a signed request that names who asks and whom, and a signed answer.

A request: ``x-shardcache-peer: m=<asker>,r=<recipient>,t=<unix seconds>,n=<nonce>,sig=<hex>``,
the HMAC-SHA256 with the cluster's secret of ``request``, ``t``, ``n``, the method, the raw path and
query, the headers of :data:`SIGNED_REQUEST_HEADERS`, the asker's and the recipient's member id
(:func:`wire.rendezvous.member_id`). The recipient refuses a request addressed to another member
(a header captured on the way to A is worth nothing at B), one more than ``max_skew_s`` off its
clock, and a nonce it has seen (:class:`~sidecar.daemon.peers.replay.Nonces`): a captured header
is good for one read, at one member, of one range, once.

An answer: ``x-shardcache-peer-answer: m=<responder>,sig=<hex>``, the HMAC of ``answer``, the
request's nonce, the responder's and the asker's id, the status and the headers of
:data:`BOUND_ANSWER_HEADERS` (what the object is: ETag, length, range, the checksums it claims).
The asker refuses an answer without it (the peer is then unavailable: the next candidate, or the
origin), so whoever answers at a member's address without the secret (a reused pod IP behind a
stale DNS record) is not a member, and an answer is not replayed from another request. The body is
not covered: a fill checks a peer's bytes against the origin's checksum (:mod:`.origin`).

Without a secret (open links): ``m=<asker>,open``, and answers are not signed.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol

from sidecar.daemon.checksums import CHECKSUM_HEADERS
from sidecar.daemon.peers.replay import Nonces, Replayed
from sidecar.errors import SidecarError

__all__ = [
    "ANSWER_HEADER",
    "Headers",
    "BOUND_ANSWER_HEADERS",
    "IF_CACHED_HEADER",
    "PEER_HEADER",
    "SIGNED_REQUEST_HEADERS",
    "PeerAsk",
    "PeerRefused",
    "check_answer",
    "new_nonce",
    "sign",
    "sign_answer",
    "verify",
]

PEER_HEADER = "x-shardcache-peer"
ANSWER_HEADER = "x-shardcache-peer-answer"
IF_CACHED_HEADER = "x-shardcache-peer-if-cached"
"""On a peer's read, ``1``: answer from the cache only, never fill (``503 NotCached`` otherwise). The
new owner of an object asks the member that owned it before (a hand-off)."""

SIGNED_REQUEST_HEADERS = ("range", IF_CACHED_HEADER)
"""Request headers the signature covers: which bytes, and whether the recipient may fill."""

BOUND_ANSWER_HEADERS = ("etag", "content-length", "content-range", "x-shardcache-xxh3-128", *sorted(CHECKSUM_HEADERS))
"""Answer headers the answer's signature covers: what the object is, as the responder claims it."""

_NONCE_HEX = 24  # 96 random bits: unique among every request a member takes within the window


class PeerRefused(SidecarError, PermissionError):
    """A peer header or answer that proves nothing; the message says why (for the log and the 403)."""


@dataclass(frozen=True)
class PeerAsk:
    """One peer request: who asked whom, and its nonce (``""`` on open links). The asker keeps it
    to check the answer; the recipient signs the answer with it."""

    asker: str
    recipient: str
    nonce: str


def new_nonce() -> str:
    return secrets.token_hex(_NONCE_HEX // 2)


class Headers(Protocol):
    """Any header map: a dict, aiohttp's multidicts, http.client's message."""

    def items(self) -> Iterable[tuple[str, str]]: ...


def _fields(headers: Headers, names: Iterable[str]) -> str:
    """``name:value`` lines of ``names`` (lower case) from ``headers``, the first value of each, so
    that both ends (aiohttp's and http.client's header maps, in any case) bind the same text."""
    found: dict[str, str] = {}
    for name, value in headers.items():
        found.setdefault(name.lower(), value.strip())
    return "\n".join(f"{name}:{found.get(name, '')}" for name in names)


def _mac(secret: bytes, *parts: str) -> str:
    return hmac.new(secret, "\n".join(parts).encode("utf-8", "surrogateescape"), hashlib.sha256).hexdigest()


def _parse(value: str) -> dict[str, str]:
    fields: dict[str, str] = {}
    for part in value.split(",")[:8]:  # bounded: a header of thousands of commas is not parsed
        name, sep, field_value = part.strip().partition("=")
        fields.setdefault(name, field_value if sep else "")
    return fields


def sign(secret: bytes | None, ask: PeerAsk, method: str, target: str, headers: Mapping[str, str] | None = None,
         now: float | None = None) -> str:
    """The peer header of ``ask``'s request of ``method`` on ``target`` (raw path and query) with
    ``headers`` (those of :data:`SIGNED_REQUEST_HEADERS` are covered)."""
    if secret is None:
        return f"m={ask.asker},open"
    t = str(int(time.time() if now is None else now))
    bound = _fields(headers or {}, SIGNED_REQUEST_HEADERS)
    sig = _mac(secret, "request", t, ask.nonce, method, target, bound, ask.asker, ask.recipient)
    return f"m={ask.asker},r={ask.recipient},t={t},n={ask.nonce},sig={sig}"


def verify(secret: bytes | None, value: str, method: str, target: str, headers: Headers, recipient: str,
           nonces: Nonces | None, max_skew_s: float = 60.0, now: float | None = None) -> PeerAsk:
    """The request's :class:`PeerAsk` if it proves a member asked this daemon (``recipient``, its
    own id), else :class:`PeerRefused`. Without a secret anyone is a peer (open links). A valid
    nonce is remembered in ``nonces``: the same header again is refused."""
    fields = _parse(value)
    member = fields.get("m", "")
    if not member or len(member) > 300:
        raise PeerRefused("the peer header names no member")
    if secret is None:
        return PeerAsk(member, recipient, "")
    t, nonce, sig, to = fields.get("t", ""), fields.get("n", ""), fields.get("sig", ""), fields.get("r", "")
    if not t or not sig or not nonce:
        raise PeerRefused(f"{member}: unsigned peer request (or one from an older daemon), and this daemon has a "
                          "--peer-secret-file: give every member the same version and secret")
    if not t.isascii() or not t.isdigit() or len(t) > 12:
        raise PeerRefused(f"{member}: malformed peer timestamp")
    if len(nonce) != _NONCE_HEX or not nonce.isascii() or not all(c in "0123456789abcdef" for c in nonce):
        raise PeerRefused(f"{member}: malformed peer nonce")
    clock = time.time() if now is None else now
    skew = abs(clock - int(t))
    if skew > max_skew_s:
        raise PeerRefused(f"{member}: peer request {skew:.0f} s off this daemon's clock (at most {max_skew_s:g} s)")
    bound = _fields(headers, SIGNED_REQUEST_HEADERS)
    if not hmac.compare_digest(sig, _mac(secret, "request", t, nonce, method, target, bound, member, to)):
        raise PeerRefused(f"{member}: wrong peer signature (another --peer-secret-file, or the request was changed)")
    if to != recipient:
        raise PeerRefused(f"{member}: request addressed to {to[:300]}, and this daemon is {recipient}: "
                          "a member is named by the URL it advertises (--advertise-url)")
    if nonces is not None:
        try:
            nonces.admit(member, nonce, int(t), clock)
        except Replayed as exc:
            raise PeerRefused(str(exc)) from None
    return PeerAsk(member, recipient, nonce)


def _answer_mac(secret: bytes, ask: PeerAsk, status: int, headers: Headers) -> str:
    return _mac(secret, "answer", ask.nonce, ask.recipient, ask.asker, str(status), _fields(headers, BOUND_ANSWER_HEADERS))


def sign_answer(secret: bytes | None, ask: PeerAsk, status: int, headers: Headers) -> str | None:
    """The answer header a responder (``ask.recipient``) sends with ``status`` and ``headers``;
    ``None`` on open links."""
    if secret is None:
        return None
    return f"m={ask.recipient},sig={_answer_mac(secret, ask, status, headers)}"


def check_answer(secret: bytes | None, value: str | None, ask: PeerAsk, status: int,
                 headers: Headers) -> None:
    """:class:`PeerRefused` unless the answer to ``ask`` (``value``: its answer header) was signed
    by the member asked, for this request, with this status and these object headers."""
    if secret is None:
        return
    if not value:
        raise PeerRefused(f"{ask.recipient} answered {status} without a member's signature: whatever answers at "
                          "that address has not the --peer-secret-file (or is an older daemon)")
    sig = _parse(value).get("sig", "")
    if not hmac.compare_digest(sig, _answer_mac(secret, ask, status, headers)):
        raise PeerRefused(f"{ask.recipient} answered {status} with a signature that is not the member's for this "
                          "request (another --peer-secret-file, a replayed answer, or headers changed on the way)")
