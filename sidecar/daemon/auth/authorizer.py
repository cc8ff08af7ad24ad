"""The node daemon's side of ``--auth sigv4``: sessions, proofs replayed, decisions cached.

A pod's sidecar first proves who it is (``POST /_shardcache/auth/session``: an STS
``GetCallerIdentity`` signed with the pod's credentials, replayed here against the origin's STS)
and gets a session token. Every later request names the session and carries a proof of the one
thing it asks (:mod:`sidecar.daemon.auth.proofs`). The origin's answer to a replayed proof is
cached per (credential, bucket, key) for ``decision_ttl_s``: a warm read then costs two dictionary
lookups, and the origin sees one ranged ``GET`` of one byte per object and credential per TTL.
Concurrent checks of the same thing share one replay.

A decision is the origin's judgement of one credential, so the credential keys it: the
``principal`` STS reports (an assumed role's session ARN) *and* the access key id the session was
opened with, which every proof of the session must be signed with. Two sessions that STS names
alike (one role, one session name) may differ in what they may read: a session policy, session
tags, a source identity. Each such session has its own temporary credentials (a new session
policy means a new AssumeRole, so a new access key id), so neither ever uses the other's
decisions. ``tenant``, the principal with an assumed role's session name dropped
(``arn:aws:iam::123456789012:role/trainer``), stable across IRSA's hourly key rotation, counts for
``--tenant-quota``, shares the warm-up slots and bounds what this daemon keeps for a caller.
Warm-ups belong to the exact ``principal`` (:func:`sidecar.daemon.warmups.owner_of`): namespaces
that share a role have different session names, and must not see each other's.

Bounds: sessions and decisions are kept per tenant (at most ``max_sessions_per_tenant`` and
``max_decisions_per_tenant``, the tenant's oldest dropped first) and in all (``max_sessions``,
``max_decisions``, dropped from whichever tenant holds most), so a tenant that opens sessions or
asks for decisions by the thousand drops its own and never another's (:class:`_Owned`). A dropped
session is renewed by its sidecar unnoticed (``renew``), a dropped decision costs one replay.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import re
import secrets
import time
import xml.etree.ElementTree as ET
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from sidecar.daemon.auth.proofs import (
    InvalidProof,
    Proof,
    ProofBatch,
    Target,
    identity_request,
    proof_request,
    replay_headers,
)
from sidecar.daemon.auth.sigv4 import parse_amz_date
from sidecar.errors import BucketNotFound, NotAuthorized, ObjectNotFound, OriginUnavailable

__all__ = ["AuthSettings", "Authorizer", "Session", "IDENTITIES", "tenant_of"]

log = logging.getLogger(__name__)

IDENTITIES = ("sts", "access-key")
_ARN = re.compile(r"arn:[a-z0-9-]{1,32}:(?:iam|sts)::\d{12}:[\x21-\x7e]{1,1024}")
_ASSUMED = re.compile(r"arn:([a-z0-9-]+):sts::(\d{12}):assumed-role/([^/]+)/.+")
# What a 403 says when the signature, not the policy, is at fault: no decision to cache.
_BAD_SIGNATURE = ("SignatureDoesNotMatch", "InvalidAccessKeyId", "RequestTimeTooSkewed", "IncompleteSignature",
                  "InvalidClientTokenId", "MissingAuthenticationToken")
_EXPIRED = ("ExpiredToken", "ExpiredTokenException", "InvalidToken", "TokenRefreshRequired")
# A 403 that says the object cannot be read now (archived), not that the caller may not: no decision.
_NOT_A_DECISION = ("InvalidObjectState",)
_OLD_SIDECAR = (
    "this pod's shardcache sidecar proves reads with signed HEADs, which S3 answers without asking "
    "kms:Decrypt of an SSE-KMS object's key; this node daemon accepts only proofs that are reads (a ranged "
    "GET of one byte). Upgrade the sidecar to the node daemon's shardcache version (restart the pod: the "
    "injector adds the current one)"
)


@dataclass(frozen=True)
class AuthSettings:
    mode: str = "none"
    """``none`` or ``sigv4``: every read, listing and control call proves the caller's right."""

    identity: str = "sts"
    """``sts``: the caller is the principal STS reports; ``access-key``: its access key (no STS)."""

    sts_endpoint: str | None = None
    """STS endpoint; ``None``: the S3 endpoint for a custom one (MinIO, Ceph, moto serve STS
    there), else AWS's regional STS."""

    decision_ttl_s: float = 120.0
    """How long the origin's yes to (caller, object) is reused."""

    denial_ttl_s: float = 5.0
    """How long its no is: short, so a policy just granted works at once, long enough that a
    refused caller cannot turn each of its requests into an origin request."""

    session_ttl_s: float = 900.0
    """Lifetime of a session; the sidecar renews it before."""

    max_proof_age_s: float = 300.0
    """Proofs dated further from the daemon's clock are refused (S3 allows 15 min)."""

    replays_at_once: int = 32
    """Proofs being replayed against the origin at a time."""

    max_sessions: int = 10_000
    """Sessions kept in all (taken from the tenant that holds most when full)."""

    max_sessions_per_tenant: int = 1_000
    """Sessions kept per tenant, its oldest dropped first: more than a node runs pods of one role,
    each with a session renewed every ``session_ttl_s * 2/3``."""

    max_decisions: int = 200_000
    """Decisions kept in all (taken from the tenant that holds most when full)."""

    max_decisions_per_tenant: int = 100_000
    """Decisions kept per tenant, its oldest dropped first (a dropped one costs one replay)."""

    def __post_init__(self) -> None:
        if self.mode not in ("none", "sigv4"):
            raise ValueError("auth mode must be none or sigv4")
        if self.identity not in IDENTITIES:
            raise ValueError(f"auth identity must be one of {IDENTITIES}")
        if self.decision_ttl_s < 0 or self.session_ttl_s <= 0:
            raise ValueError("auth TTLs must be positive")
        if not 0 < self.max_sessions_per_tenant <= self.max_sessions:
            raise ValueError("auth session bounds: 0 < max_sessions_per_tenant <= max_sessions")
        if not 0 < self.max_decisions_per_tenant <= self.max_decisions:
            raise ValueError("auth decision bounds: 0 < max_decisions_per_tenant <= max_decisions")


@dataclass(frozen=True)
class Session:
    token: str
    principal: str
    tenant: str
    access_key: str
    security_token: str | None
    expires: float  # time.monotonic()


def tenant_of(principal: str) -> str:
    """An assumed role's session ARN without the session name (the role); any other as it is."""
    match = _ASSUMED.fullmatch(principal)
    if match:
        return f"arn:{match.group(1)}:iam::{match.group(2)}:role/{match.group(3)}"
    return principal


def _error_code(body: bytes) -> str:
    match = re.search(rb"<Code>([A-Za-z0-9.]{1,64})</Code>", body)
    return match.group(1).decode() if match else ""


def _arn(body: bytes) -> str | None:
    try:
        root = ET.fromstring(body)
    except ET.ParseError:
        return None
    for element in root.iter():
        if element.tag.rsplit("}", 1)[-1] == "Arn" and element.text and _ARN.fullmatch(element.text.strip()):
            return element.text.strip()
    return None


Replay = Callable[[str, str, dict[str, str], bytes], Awaitable[tuple[int, bytes]]]
# (principal, access key id, "o" | "l", bucket, key or prefix): what the origin judged, for whom.
Decision = tuple[str, str, str, str, str]


K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class _Owned(Generic[K, V]):
    """Entries each owned by a tenant, bounded per tenant (its oldest go first) and in all (from the
    tenant holding most), so that one tenant's flood drops only its own. Lookups are one dict get;
    order is insertion (a ``put`` of a present key makes it the newest)."""

    def __init__(self, per_owner: int, total: int) -> None:
        self.per_owner = per_owner
        self.total = total
        self._entries: dict[K, V] = {}
        self._owned: dict[str, OrderedDict[K, None]] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: K) -> V | None:
        return self._entries.get(key)

    def held(self, owner: str) -> int:
        keys = self._owned.get(owner)
        return len(keys) if keys is not None else 0

    def put(self, owner: str, key: K, value: V) -> None:
        keys = self._owned.setdefault(owner, OrderedDict())
        self._entries[key] = value
        keys[key] = None
        keys.move_to_end(key)
        while len(keys) > self.per_owner:
            self._drop_oldest(owner)
        while len(self._entries) > self.total:
            # Rare (only while several tenants are near their bound): a scan of the tenants.
            self._drop_oldest(max(self._owned, key=lambda name: len(self._owned[name])))

    def pop(self, owner: str, key: K) -> None:
        if self._entries.pop(key, None) is not None:
            keys = self._owned[owner]
            del keys[key]
            if not keys:
                del self._owned[owner]

    def _drop_oldest(self, owner: str) -> None:
        keys = self._owned[owner]
        key, _ = keys.popitem(last=False)
        del self._entries[key]
        if not keys:
            del self._owned[owner]


class Authorizer:
    """Sessions and decisions of one daemon. ``replay`` sends a signed request to the origin."""

    def __init__(self, settings: AuthSettings, replay: Replay, s3_endpoint: str, region: str, style: str) -> None:
        self.settings = settings
        self._replay = replay
        sts = settings.sts_endpoint or (
            s3_endpoint if "amazonaws.com" not in s3_endpoint else f"https://sts.{region}.amazonaws.com"
        )
        self.target = Target(s3_endpoint, region, style, sts, region, secrets.token_hex(8), settings.identity)
        self._sessions: _Owned[str, Session] = _Owned(settings.max_sessions_per_tenant, settings.max_sessions)
        self._decisions: _Owned[Decision, tuple[float, bool]] = _Owned(
            settings.max_decisions_per_tenant, settings.max_decisions)
        self._checking: dict[Decision, asyncio.Future[bool]] = {}
        self._replays = asyncio.Semaphore(settings.replays_at_once)
        # replay_us: time spent waiting on the origin's answers to replays (bench.auth_bench reads it).
        self.counts = {"sessions": 0, "allowed": 0, "denied": 0, "replays": 0, "replay_us": 0, "cached": 0}

    def describe(self) -> dict[str, Any]:
        return {"auth": "sigv4", **self.target.to_json(), "session_ttl_s": self.settings.session_ttl_s,
                "decision_ttl_s": self.settings.decision_ttl_s, "max_proof_age_s": self.settings.max_proof_age_s}

    # -- sessions ---------------------------------------------------------------------------

    def check_date(self, proof: Proof) -> None:
        age = abs((dt.datetime.now(dt.UTC) - parse_amz_date(proof.date)).total_seconds())
        if age > self.settings.max_proof_age_s:
            raise InvalidProof(
                f"proof dated {proof.date}, {age:.0f} s from this daemon's clock (at most "
                f"{self.settings.max_proof_age_s:.0f} s): fix the clock of the pod or of the node", renew=True,
            )

    async def open_session(self, body: dict[str, Any]) -> Session:
        """A session for whoever signed ``body['proof']`` (see :func:`proofs.prove_identity`)."""
        if not isinstance(body.get("proof"), str):
            raise InvalidProof("a session needs {'proof': ...}: made by the pod's shardcache sidecar")
        if body.get("object_proof") != self.target.object_proof:
            raise InvalidProof(_OLD_SIDECAR)  # before any replay: a sidecar that retries costs nothing
        token = body.get("security_token")
        if token is not None and (not isinstance(token, str) or not 0 < len(token) <= 8192 or not token.isprintable()):
            raise InvalidProof("'security_token' must be the printable session token of temporary credentials")
        proof = Proof.from_header(body["proof"])
        target = self.target
        if target.identity == "sts":
            proof.check_scope(target.sts_region, "sts")
        else:
            proof.check_scope(target.region, "s3")
        self.check_date(proof)
        method, url, signed, payload = identity_request(target, proof.date, token)
        headers = replay_headers(proof, signed)
        status, answer = await self._send(method, url, headers, payload)
        code = _error_code(answer)
        if target.identity == "sts":
            principal = _arn(answer) if status == 200 else None
            if principal is None:
                raise self._refusal("STS refused the identity proof", status, code)
        else:
            # ListBuckets: AccessDenied still says the signature (so the key) is good.
            if status != 200 and not (status == 403 and code == "AccessDenied"):
                raise self._refusal("the origin refused the identity proof", status, code)
            principal = f"key:{proof.access_key}"
        session = Session(
            token=secrets.token_urlsafe(32), principal=principal, tenant=tenant_of(principal),
            access_key=proof.access_key, security_token=token,
            expires=time.monotonic() + self.settings.session_ttl_s,
        )
        self._sessions.put(session.tenant, session.token, session)
        self.counts["sessions"] += 1
        log.info("session for %s (key %s)", principal, proof.access_key)
        return session

    def session(self, token: str | None) -> Session:
        if not token:
            raise NotAuthorized(
                "this daemon runs with --auth sigv4: read through the pod's shardcache sidecar, which proves "
                "the pod's own AWS credentials (no session given)", renew=True,
            )
        session = self._sessions.get(token)
        if session is None or session.expires < time.monotonic():
            if session is not None:
                self._sessions.pop(session.tenant, token)
            raise NotAuthorized("unknown or expired session: start a new one", renew=True)
        return session

    # -- decisions --------------------------------------------------------------------------

    def _refusal(self, what: str, status: int, code: str) -> Exception:
        if status >= 500 or status == 0:
            return OriginUnavailable(f"{what}: origin answered {status}; retry")
        return NotAuthorized(f"{what} ({status} {code or 'no code'})", renew=code in _EXPIRED or status == 400)

    async def _send(self, method: str, url: str, headers: dict[str, str], body: bytes) -> tuple[int, bytes]:
        async with self._replays:
            self.counts["replays"] += 1
            began = time.perf_counter()
            try:
                return await self._replay(method, url, headers, body)
            finally:
                self.counts["replay_us"] += round((time.perf_counter() - began) * 1e6)

    @staticmethod
    def _decision(session: Session, bucket: str, key: str | None, prefix: str) -> Decision:
        """The one home of what a decision is for: the session's credential and the thing asked."""
        if key is not None:
            return session.principal, session.access_key, "o", bucket, key
        return session.principal, session.access_key, "l", bucket, prefix

    def cached(self, session: Session, bucket: str, key: str | None, prefix: str = "") -> bool | None:
        """The decision still valid for this, if any (no proof needed then)."""
        found = self._decisions.get(self._decision(session, bucket, key, prefix))
        if found is None or found[0] < time.monotonic():
            return None
        return found[1]

    async def authorize(self, session: Session, proof: Proof | str | None, bucket: str, key: str | None,
                        prefix: str = "", check_date: bool = True) -> None:
        """Return if ``session`` may read ``bucket/key`` (or list ``prefix`` when ``key`` is
        None); raise :class:`NotAuthorized` (or ``ObjectNotFound``, ``OriginUnavailable``).
        ``proof`` may be the header's text: parsed only when no decision is cached."""
        decided = self.cached(session, bucket, key, prefix)
        if decided is None:
            if not proof:
                raise NotAuthorized("no proof of access (x-shardcache-proof): read through the pod's shardcache sidecar")
            if isinstance(proof, str):
                proof = Proof.from_header(proof)
            if proof.access_key != session.access_key:
                # Before joining a running check: a decision is for the session's credential only.
                raise NotAuthorized(
                    f"proof signed with access key {proof.access_key}, the session with {session.access_key}: "
                    "a session's proofs are signed with the credentials that opened it; start a new session",
                    renew=True,
                )
            decided = await self._decide(session, proof, bucket, key, prefix, check_date)
        else:
            self.counts["cached"] += 1
        if not decided:
            what = f"{bucket}/{key}" if key is not None else f"listing {bucket}/{prefix}"
            raise NotAuthorized(f"{what}: the origin refused {session.principal} (its own credentials)")

    async def _decide(self, session: Session, proof: Proof, bucket: str, key: str | None, prefix: str,
                      check_date: bool) -> bool:
        decision = self._decision(session, bucket, key, prefix)
        running = self._checking.get(decision)
        if running is not None:
            return await asyncio.shield(running)
        proof.check_scope(self.target.region, "s3")
        if check_date:
            self.check_date(proof)
        future: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._checking[decision] = future
        try:
            allowed = await self._replay_proof(session, proof, bucket, key, prefix)
        except BaseException as exc:
            future.set_exception(exc)
            future.exception()  # retrieved: nobody else may be waiting
            raise
        else:
            future.set_result(allowed)
            ttl = self.settings.decision_ttl_s if allowed else self.settings.denial_ttl_s
            self._decisions.put(session.tenant, decision, (time.monotonic() + ttl, allowed))
            self.counts["allowed" if allowed else "denied"] += 1
            return allowed
        finally:
            del self._checking[decision]

    async def _replay_proof(self, session: Session, proof: Proof, bucket: str, key: str | None, prefix: str) -> bool:
        method, url, signed = proof_request(self.target, proof.date, session.security_token, bucket, key, prefix)
        # The answer's body (one byte of the object, or an error document) is read and dropped.
        status, body = await self._send(method, url, replay_headers(proof, signed), b"")
        if status in (200, 206):
            return True
        code = _error_code(body)
        if status == 416 and key is not None and code in ("InvalidRange", ""):
            return True  # an empty object: the GET was allowed, it has no first byte to return
        if status == 404 and key is not None:
            # Only a caller allowed to list learns that a key is missing (S3's rule): its answer.
            raise ObjectNotFound(f"{bucket}/{key} does not exist")
        if status == 404:
            raise BucketNotFound(f"bucket {bucket!r} does not exist")
        if status == 403 and code not in _BAD_SIGNATURE and code not in _EXPIRED and code not in _NOT_A_DECISION:
            return False  # the policy's no (an answer without a body counted as one too)
        raise self._refusal(f"the origin refused the proof for {bucket}/{key if key is not None else prefix}",
                            status, code)

    async def authorize_batch(self, session: Session, batch: ProofBatch | None,
                              objects: list[tuple[str, str]]) -> list[BaseException | None]:
        """Each object's outcome (``None``: allowed), checked a bounded number at a time. The
        batch's date is checked once, here: checking a million objects may take longer than a
        proof's age allows, and the origin still refuses a signature older than 15 minutes."""
        if batch is not None and objects:
            self.check_date(batch[0])

        async def one(index: int) -> BaseException | None:
            bucket, key = objects[index]
            try:
                proof = batch[index] if batch is not None else None
                await self.authorize(session, proof, bucket, key, check_date=False)
            except (NotAuthorized, ObjectNotFound, OriginUnavailable) as exc:
                return exc
            return None

        results: list[BaseException | None] = [None] * len(objects)
        pending = iter(range(len(objects)))

        async def worker() -> None:
            for index in pending:
                results[index] = await one(index)

        await asyncio.gather(*(worker() for _ in range(min(self.settings.replays_at_once, len(objects)) or 1)))
        return results

