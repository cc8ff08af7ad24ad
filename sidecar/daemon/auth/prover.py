"""The pod sidecar's side of ``--auth sigv4``: prove each forwarded request with the pod's own
credentials (boto3's standard chain in the sidecar container: env keys, a mounted profile, IRSA
web identity, EKS Pod Identity), never sending the secret anywhere.

The sidecar learns from the node daemon whether it checks proofs, and where to sign for
(``GET /_shardcache/auth``), opens a session with an identity proof, then adds to each request
the proof of what it asks (:mod:`sidecar.daemon.auth.proofs`): one header for an object read (a
signed ranged GET of its first byte) or a listing, one signature per object in a prefetch or
warm-up body. Signing is CPU only (~10 us). It signs what the daemon says it checks: an older daemon
(HEADs) still works with a newer sidecar during a rolling upgrade, never the other way round.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any

import aiohttp
from aiohttp import web

from sidecar.daemon.auth.proofs import (
    AUTH_PATH,
    PROOF_HEADER,
    SESSION_HEADER,
    SESSION_PATH,
    Target,
    prove,
    prove_batch,
    prove_identity,
)
from sidecar.daemon.auth.sigv4 import Credentials, amz_date
from sidecar.errors import NotAuthorized, OriginUnavailable
from wire import jsontext
from wire.errors import InvalidName
from wire.names import parse_object_url, validate_bucket, validate_key

__all__ = ["Prover", "PROVED_BODIES"]

log = logging.getLogger(__name__)

PROVED_BODIES = frozenset({"/_shardcache/prefetch", "/_shardcache/warmups"})
"""Control calls whose body names objects: each gets a proof in ``proofs``."""

_RECHECK_NONE_S = 30.0  # how long "the daemon checks nothing" is believed
_CREDENTIALS_S = 30.0  # how often the credential chain is asked again (it refreshes as needed)


class Prover:
    def __init__(self, base: str) -> None:
        self.base = base
        self._target: Target | None = None
        self._none_until = 0.0
        self._session: str | None = None
        self._session_key: str | None = None
        self._renew_at = 0.0
        self._creds: Credentials | None = None
        self._creds_at = -1e9
        self._chain: Any = None
        self._lock = asyncio.Lock()
        self._ready: tuple[Target, str, Credentials] | None = None  # what _prepare last returned, while valid

    def invalidate(self) -> None:
        """The daemon asked for a new session (or changed its mind about checking proofs)."""
        self._session = None
        self._target = None
        self._none_until = 0.0
        self._ready = None

    async def _credentials(self) -> Credentials:
        now = time.monotonic()
        if self._creds is None or now - self._creds_at > _CREDENTIALS_S:
            self._creds = await asyncio.to_thread(self._resolve)
            self._creds_at = now
        return self._creds

    def _resolve(self) -> Credentials:
        import boto3

        if self._chain is None:
            self._chain = boto3.session.Session().get_credentials()
        if self._chain is None:
            raise NotAuthorized(
                "the node daemon checks each pod's own AWS credentials (--auth sigv4) and this sidecar found none "
                "(no AWS_* env, profile, IRSA or Pod Identity in the sidecar container)"
            )
        frozen = self._chain.get_frozen_credentials()
        return Credentials(frozen.access_key, frozen.secret_key, frozen.token)

    async def _prepare(self, http: aiohttp.ClientSession) -> tuple[Target, str, Credentials] | None:
        """(target, session token, credentials), or None when the daemon checks no proofs."""
        now = time.monotonic()
        if now < self._none_until:
            return None
        ready = self._ready
        if ready is not None and now < self._renew_at and now - self._creds_at <= _CREDENTIALS_S:
            return ready  # every request but one in a few minutes: no lock, no await
        async with self._lock:
            try:
                return await self._prepare_locked(http)
            except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError):
                raise  # the daemon is not there: the sidecar serves from its standalone cache
            except (aiohttp.ClientError, ValueError, KeyError, TypeError) as exc:
                self.invalidate()
                raise OriginUnavailable(f"the node daemon's auth answer was unusable ({exc!r}); retry") from exc

    async def _prepare_locked(self, http: aiohttp.ClientSession) -> tuple[Target, str, Credentials] | None:
        if self._target is None:
            async with http.get(self.base + AUTH_PATH) as resp:
                described = await resp.json(content_type=None) if resp.status == 200 else {"auth": "none"}
            if described.get("auth") != "sigv4":
                self._none_until = time.monotonic() + _RECHECK_NONE_S
                return None
            self._target = Target.from_json(described)
            self._session = None
            if self._target.object_proof != "GET":
                log.warning("the node daemon is older than this sidecar: it checks reads with signed HEADs, which "
                            "S3 answers without asking kms:Decrypt of SSE-KMS objects; upgrade the node daemon")
        # Only now: a sidecar without credentials works with a daemon that checks nothing.
        creds = await self._credentials()
        if self._session is None or self._session_key != creds.access_key or time.monotonic() >= self._renew_at:
            body = prove_identity(creds, self._target, amz_date())
            async with http.post(self.base + SESSION_PATH, json=body) as resp:
                answer = await resp.json(content_type=None)
                if resp.status != 201:
                    message = answer.get("message", resp.reason) if isinstance(answer, dict) else resp.reason
                    error = OriginUnavailable if resp.status >= 500 else NotAuthorized
                    raise error(f"the node daemon refused this pod's identity: {message}")
            self._session = str(answer["session"])
            self._session_key = creds.access_key
            # Renewed at two thirds of its life: never used past it.
            self._renew_at = time.monotonic() + float(answer.get("expires_in_s", 900)) * 2 / 3
            log.info("auth session with the node daemon as %s", answer.get("tenant"))
        self._ready = (self._target, self._session, creds)
        return self._ready

    async def prove(self, http: aiohttp.ClientSession, request: web.Request, data: bytes | None
                    ) -> tuple[dict[str, str], bytes | None]:
        """Headers to add to ``request`` forwarded upstream, and its body (with proofs where it
        names objects)."""
        prepared = await self._prepare(http)
        if prepared is None:
            return {}, data
        target, session, creds = prepared
        headers = {SESSION_HEADER: session}
        date = amz_date()
        path = request.path
        if path.startswith("/_shardcache/"):
            if request.method == "POST" and path in PROVED_BODIES and data:
                data = await asyncio.to_thread(_with_proofs, data, creds, target, date)
            elif path == "/_shardcache/cached":
                with_url = _url_proof(request.query.get("url", ""), creds, target, date)
                if with_url:
                    headers[PROOF_HEADER] = with_url
            return headers, data
        bucket, _, key = request.match_info.get("path", "").partition("/")
        try:
            validate_bucket(bucket)
            if key:
                validate_key(key)
        except InvalidName:
            return headers, data  # the daemon answers it (400) without looking at proofs
        if request.method not in ("GET", "HEAD"):
            return headers, data
        if key:
            headers[PROOF_HEADER] = prove(creds, target, date, bucket, key).to_header()
        else:
            query = request.query
            prefix = "" if request.method == "HEAD" or "location" in query else query.get("prefix", "")
            headers[PROOF_HEADER] = prove(creds, target, date, bucket, prefix=prefix).to_header()
        return headers, data

    async def object_proof(self, http: aiohttp.ClientSession, bucket: str, key: str) -> dict[str, str]:
        """What a handle request (:mod:`wire.handles`) for ``bucket/key`` adds to prove the read:
        ``{"session", "proof"}`` as the headers of an object GET, or ``{}`` when the daemon
        checks no proofs. ``bucket``/``key`` are valid names (the caller checked them)."""
        prepared = await self._prepare(http)
        if prepared is None:
            return {}
        target, session, creds = prepared
        return {"session": session, "proof": prove(creds, target, amz_date(), bucket, key).to_header()}


def _objects_of(body: dict[str, Any]) -> list[tuple[str, str]]:
    """The objects a prefetch or warm-up body names, in the order the daemon reads them."""
    found: list[tuple[str, str]] = []
    for obj in body.get("objects", []) or []:
        if isinstance(obj, dict) and isinstance(obj.get("bucket"), str) and isinstance(obj.get("key"), str):
            found.append((obj["bucket"], obj["key"]))
        else:
            raise ValueError("malformed object")
    for url in body.get("urls", []) or []:
        found.append(parse_object_url(url) if isinstance(url, str) else ("", ""))
    return found


def _with_proofs(data: bytes, creds: Credentials, target: Target, date: str) -> bytes:
    try:
        body = jsontext.loads(data)
        objects = _objects_of(body) if isinstance(body, dict) else None
    except (ValueError, InvalidName, TypeError):
        objects = None
    if objects is None:
        return data  # the daemon refuses it with its own words (400)
    body["proofs"] = prove_batch(creds, target, date, objects).to_json()
    return json.dumps(body).encode()


def _url_proof(url: str, creds: Credentials, target: Target, date: str) -> str | None:
    try:
        bucket, prefix = parse_object_url(url)
    except InvalidName:
        return None
    return prove(creds, target, date, bucket, prefix=prefix).to_header()

