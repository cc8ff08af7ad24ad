"""The node daemon's side of ``--auth sigv4``: sessions, proofs replayed, decisions cached.

A pod's sidecar first proves who it is (``POST /_shardcache/auth/session``: an STS
``GetCallerIdentity`` signed with the pod's credentials, replayed here against the origin's STS)
and gets a session token. Every later request names the session and carries a proof of the one
thing it asks (:mod:`sidecar.daemon.auth.proofs`). The origin's answer to a replayed proof is
cached per (caller, bucket, key) for ``decision_ttl_s``: a warm read then costs two dictionary
lookups, and the origin sees one ``HEAD`` per object and caller per TTL. Concurrent checks of the
same thing share one replay.

Two names for the caller: ``principal``, exactly what STS reports (an assumed role's session
ARN), keys the decisions, so sessions of one role with different session policies are never
told apart wrongly; ``tenant``, the principal with an assumed role's session name dropped
(``arn:aws:iam::123456789012:role/trainer``), stable across IRSA's hourly key rotation, owns
warm-ups and counts for ``--tenant-quota``.
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
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from sidecar.daemon.auth.proofs import (
    InvalidProof,
    Proof,
    ProofBatch,
    Target,
    identity_request,
    list_url,
    object_url,
    replay_headers,
)
from sidecar.daemon.auth.sigv4 import EMPTY_SHA256, canonical_host, parse_amz_date
from sidecar.errors import NotAuthorized, ObjectNotFound, OriginUnavailable

__all__ = ["AuthSettings", "Authorizer", "Session", "IDENTITIES", "tenant_of"]

log = logging.getLogger(__name__)

IDENTITIES = ("sts", "access-key")
_MAX_SESSIONS = 10_000
_MAX_DECISIONS = 200_000
_ARN = re.compile(r"arn:[a-z0-9-]{1,32}:(?:iam|sts)::\d{12}:[\x21-\x7e]{1,1024}")
_ASSUMED = re.compile(r"arn:([a-z0-9-]+):sts::(\d{12}):assumed-role/([^/]+)/.+")
# What a 403 says when the signature, not the policy, is at fault: no decision to cache.
_BAD_SIGNATURE = ("SignatureDoesNotMatch", "InvalidAccessKeyId", "RequestTimeTooSkewed", "IncompleteSignature",
                  "InvalidClientTokenId", "MissingAuthenticationToken")
_EXPIRED = ("ExpiredToken", "ExpiredTokenException", "InvalidToken", "TokenRefreshRequired")


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

    def __post_init__(self) -> None:
        if self.mode not in ("none", "sigv4"):
            raise ValueError("auth mode must be none or sigv4")
        if self.identity not in IDENTITIES:
            raise ValueError(f"auth identity must be one of {IDENTITIES}")
        if self.decision_ttl_s < 0 or self.session_ttl_s <= 0:
            raise ValueError("auth TTLs must be positive")


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


class Authorizer:
    """Sessions and decisions of one daemon. ``replay`` sends a signed request to the origin."""

    def __init__(self, settings: AuthSettings, replay: Replay, s3_endpoint: str, region: str, style: str) -> None:
        self.settings = settings
        self._replay = replay
        sts = settings.sts_endpoint or (
            s3_endpoint if "amazonaws.com" not in s3_endpoint else f"https://sts.{region}.amazonaws.com"
        )
        self.target = Target(s3_endpoint, region, style, sts, region, secrets.token_hex(8), settings.identity)
        self._sessions: OrderedDict[str, Session] = OrderedDict()
        self._decisions: OrderedDict[tuple[str, str, str, str], tuple[float, bool]] = OrderedDict()
        self._checking: dict[tuple[str, str, str, str], asyncio.Future[bool]] = {}
        self._replays = asyncio.Semaphore(settings.replays_at_once)
        self.counts = {"sessions": 0, "allowed": 0, "denied": 0, "replays": 0, "cached": 0}

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
        self._sessions[session.token] = session
        while len(self._sessions) > _MAX_SESSIONS:
            self._sessions.popitem(last=False)
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
            self._sessions.pop(token, None)
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
            return await self._replay(method, url, headers, body)

    def cached(self, session: Session, bucket: str, key: str | None, prefix: str = "") -> bool | None:
        """The decision still valid for this, if any (no proof needed then)."""
        name = ("o", bucket, key) if key is not None else ("l", bucket, prefix)
        found = self._decisions.get((session.principal, *name))
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
            decided = await self._decide(session, proof, bucket, key, prefix, check_date)
        else:
            self.counts["cached"] += 1
        if not decided:
            what = f"{bucket}/{key}" if key is not None else f"listing {bucket}/{prefix}"
            raise NotAuthorized(f"{what}: the origin refused {session.principal} (its own credentials)")

    async def _decide(self, session: Session, proof: Proof, bucket: str, key: str | None, prefix: str,
                      check_date: bool) -> bool:
        decision = (session.principal, "o" if key is not None else "l", bucket, key if key is not None else prefix)
        running = self._checking.get(decision)
        if running is not None:
            return await asyncio.shield(running)
        if proof.access_key != session.access_key:
            raise NotAuthorized("proof signed with other credentials than the session's: start a new session", renew=True)
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
            self._decisions[decision] = (time.monotonic() + ttl, allowed)
            self._decisions.move_to_end(decision)
            while len(self._decisions) > _MAX_DECISIONS:
                self._decisions.popitem(last=False)
            self.counts["allowed" if allowed else "denied"] += 1
            return allowed
        finally:
            del self._checking[decision]

    async def _replay_proof(self, session: Session, proof: Proof, bucket: str, key: str | None, prefix: str) -> bool:
        if key is not None:
            method, url = "HEAD", object_url(self.target, bucket, key)
        else:
            method, url = "GET", list_url(self.target, bucket, prefix)
        signed = {"host": canonical_host(url), "x-amz-content-sha256": EMPTY_SHA256, "x-amz-date": proof.date}
        if session.security_token:
            signed["x-amz-security-token"] = session.security_token
        status, body = await self._send(method, url, replay_headers(proof, signed), b"")
        if status in (200, 206):
            return True
        if status == 404 and key is not None:
            # Only a caller allowed to list learns that a key is missing (S3's rule): its answer.
            raise ObjectNotFound(f"{bucket}/{key} does not exist")
        if status == 404:
            from sidecar.errors import BucketNotFound

            raise BucketNotFound(f"bucket {bucket!r} does not exist")
        code = _error_code(body)
        if status == 403 and code not in _BAD_SIGNATURE and code not in _EXPIRED:
            return False  # the policy's no (a HEAD's 403 has no body: counted as one too)
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

