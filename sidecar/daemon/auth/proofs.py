"""What a proof is, on the wire between a pod's sidecar and the node daemon (``--auth sigv4``).

A proof is an origin request, signed by the pod with its own credentials, that the daemon replays
against the origin: the origin's answer says whether the pod may do what it asks. The pod never
hands its secret over; the daemon never trusts a claim it did not have the origin check.

Three requests are proved, each rebuilt by the daemon from what the request names (never from a
URL the pod sends, so a proof cannot point the daemon elsewhere), with the same functions here:

* reading an object: ``GET /{bucket}/{key}`` with ``Range: bytes=0-0`` signed (:data:`OBJECT_RANGE`).
  A read, not a ``HEAD``: S3 asks ``s3:GetObject`` of both, but ``kms:Decrypt`` on the key of an
  SSE-KMS object only of a request that returns its bytes, and the daemon decrypts with its own
  credentials, so a HEAD would let a caller without the key read the plaintext. One byte, the
  range signed: the answer costs nothing to read (the daemon reads and drops it), and a proof that
  leaks (a log) is good for that byte only, for 15 minutes. An empty object answers ``416``: the
  GET was allowed, there is no byte to return;
* listing: ``GET /{bucket}?list-type=2&max-keys=0&prefix={prefix}`` (``s3:ListBucket``, with the
  prefix a policy's ``s3:prefix`` condition sees);
* who the caller is: STS ``GetCallerIdentity`` (a form POST); or, with ``--auth-identity
  access-key``, S3 ``ListBuckets`` (``GET /``), whose answer says the signature is good even when
  it is ``AccessDenied``. Either with the daemon's ``audience`` as a signed header, so the proof is
  good for that daemon only: one captured at another daemon (a log, a hostile pod on that node)
  opens no session here, because this daemon rebuilds the request with its own audience.

Signed headers are fixed: ``host;x-amz-content-sha256;x-amz-date`` (``host;range;...`` for an
object, plus ``x-amz-security-token`` for temporary credentials), so an object proof travels as one short
header, ``x-shardcache-proof: {credential};{x-amz-date};{signature}``, and a warm-up of many
objects as one date and one signature per object (:class:`ProofBatch`). The security token
travels once, with the identity proof, and the daemon keeps it with the session.

Which request proves a read is :attr:`Target.object_proof`: ``GET`` (:data:`OBJECT_RANGE`) for a
daemon of this version, which publishes it, ``HEAD`` for an older one, which publishes nothing (so a
newer sidecar still works with it during a rolling upgrade). The sidecar names what it signs when it
opens a session, and a daemon of this version refuses one that signs HEADs, before any replay, with
an answer that says to upgrade the sidecar (:func:`prove_identity`, ``Authorizer.open_session``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from sidecar.daemon.auth.sigv4 import (
    EMPTY_SHA256,
    Credentials,
    canonical_host,
    encode_key,
    encode_query,
    scope,
    signature,
)
from sidecar.errors import NotAuthorized

__all__ = [
    "AUTH_PATH", "SESSION_PATH", "SESSION_HEADER", "PROOF_HEADER", "RENEW_HEADER", "STS_BODY", "OBJECT_PROOFS",
    "OBJECT_RANGE", "InvalidProof", "Proof", "ProofBatch", "Target", "identity_request", "list_url", "object_url",
    "proof_request", "prove", "prove_batch", "prove_identity", "replay_headers",
]

AUTH_PATH = "/_shardcache/auth"
SESSION_PATH = "/_shardcache/auth/session"
SESSION_HEADER = "x-shardcache-session"
PROOF_HEADER = "x-shardcache-proof"
RENEW_HEADER = "x-shardcache-auth"
"""Set to ``renew`` on a 403 that a new session would cure (expired, rotated credentials)."""

STS_BODY = b"Action=GetCallerIdentity&Version=2011-06-15"
OBJECT_RANGE = "bytes=0-0"
"""The ``Range`` an object proof signs: the first byte (see the module's docstring)."""
OBJECT_PROOFS = ("GET", "HEAD")
"""What may prove a read (:attr:`Target.object_proof`): ``GET`` of :data:`OBJECT_RANGE`, what this
version's daemon checks; ``HEAD``, what a daemon before it checked (a sidecar still signs it for one)."""
_STS_CONTENT_TYPE = "application/x-www-form-urlencoded; charset=utf-8"
AUDIENCE_HEADER = "x-shardcache-audience"

# AWS's key ids are [A-Z0-9]{16,128}; MinIO's and Ceph's may be any printable name ("minioadmin").
# No "/", ";", "," or space: they delimit the credential, the proof and the Authorization header.
_ACCESS_KEY = re.compile(r"[!-+\-.0-:<-~]{3,128}")
_SIGNATURE = re.compile(r"[0-9a-f]{64}")
_DATE = re.compile(r"\d{8}T\d{6}Z")
_DNS_BUCKET = re.compile(r"[a-z0-9][a-z0-9-]{1,61}[a-z0-9]")


class InvalidProof(NotAuthorized):
    """A proof that is malformed, or made for another request, region or credentials."""


@dataclass(frozen=True)
class Target:
    """Where proofs are replayed: the daemon's S3 endpoint (as its own client resolved it) and
    STS endpoint, published by ``GET /_shardcache/auth`` so the sidecar signs for the same."""

    s3_endpoint: str
    region: str
    addressing_style: str  # path | virtual
    sts_endpoint: str
    sts_region: str
    audience: str
    identity: str = "sts"  # sts | access-key
    object_proof: str = "GET"  # OBJECT_PROOFS: GET for this version's daemon

    def __post_init__(self) -> None:
        if self.object_proof not in OBJECT_PROOFS:
            raise ValueError(f"object_proof must be one of {OBJECT_PROOFS}, not {self.object_proof[:20]!r}")

    def to_json(self) -> dict[str, Any]:
        return {
            "identity": self.identity, "audience": self.audience, "object_proof": self.object_proof,
            "s3": {"endpoint_url": self.s3_endpoint, "region": self.region, "addressing_style": self.addressing_style},
            "sts": {"endpoint_url": self.sts_endpoint, "region": self.sts_region},
        }

    @classmethod
    def from_json(cls, data: Any) -> Target:
        try:
            s3, sts = data["s3"], data["sts"]
            # No object_proof: a daemon older than it, which replays HEADs.
            return cls(str(s3["endpoint_url"]), str(s3["region"]), str(s3["addressing_style"]),
                       str(sts["endpoint_url"]), str(sts["region"]), str(data["audience"]),
                       str(data.get("identity", "sts")), str(data.get("object_proof", "HEAD")))
        except (KeyError, TypeError) as exc:
            raise ValueError(f"not a shardcache auth description: {exc}") from exc

    def _bucket_url(self, bucket: str) -> tuple[str, str]:
        """(scheme://host, path prefix) for ``bucket``: virtual-hosted when the style says so and the
        name is one TLS and DNS can carry (no dots over https), else path style, as botocore."""
        parts = urlsplit(self.s3_endpoint)
        base = f"{parts.scheme}://{parts.netloc}"
        if self.addressing_style == "virtual" and _DNS_BUCKET.fullmatch(bucket) and "." not in bucket:
            return f"{parts.scheme}://{bucket}.{parts.netloc}", ""
        return base, f"/{encode_key(bucket)}"


def object_url(target: Target, bucket: str, key: str) -> str:
    base, prefix = target._bucket_url(bucket)
    return f"{base}{prefix}/{encode_key(key)}"


def list_url(target: Target, bucket: str, prefix: str) -> str:
    base, path = target._bucket_url(bucket)
    return f"{base}{path or '/'}?{encode_query({'list-type': '2', 'max-keys': '0', 'prefix': prefix})}"


def _identity_url(target: Target) -> str:
    if target.identity == "sts":
        return target.sts_endpoint.rstrip("/") + "/"
    parts = urlsplit(target.s3_endpoint)
    return f"{parts.scheme}://{parts.netloc}/"


@dataclass(frozen=True)
class Proof:
    """One signed request: ``{credential};{x-amz-date};{signature}``."""

    credential: str  # AKID/20261201/us-east-1/s3/aws4_request
    date: str
    signature: str

    @property
    def access_key(self) -> str:
        return self.credential.split("/", 1)[0]

    def to_header(self) -> str:
        return f"{self.credential};{self.date};{self.signature}"

    @classmethod
    def from_header(cls, value: str) -> Proof:
        parts = value.split(";")
        if len(parts) != 3 or len(value) > 512:
            raise InvalidProof(f"{PROOF_HEADER} must be credential;x-amz-date;signature")
        return cls.parse(*parts)

    @classmethod
    def parse(cls, credential: str, date: str, sig: str) -> Proof:
        fields = credential.split("/")
        if fields and not _ACCESS_KEY.fullmatch(fields[0]):
            raise InvalidProof(f"malformed proof: access key id {fields[0][:40]!r} is not 3-128 printable characters "
                               "without '/', ';', ',' or spaces")
        if (
            len(fields) != 5 or fields[4] != "aws4_request"
            or not _DATE.fullmatch(date) or fields[1] != date[:8] or not _SIGNATURE.fullmatch(sig)
        ):
            raise InvalidProof("malformed proof: credential AKID/yyyymmdd/region/service/aws4_request, "
                               "x-amz-date yyyymmddThhmmssZ of the same day, 64 hex digits of signature")
        return cls(credential, date, sig)

    def check_scope(self, region: str, service: str) -> None:
        _, _, got_region, got_service, _ = self.credential.split("/")
        if (got_region, got_service) != (region, service):
            raise InvalidProof(f"proof signed for {got_service} in {got_region}; this daemon checks "
                               f"{service} in {region} (read GET {AUTH_PATH})")


@dataclass(frozen=True)
class ProofBatch:
    """Proofs of many object reads made at one moment: one credential and date, a signature each
    (concatenated: 64 hex digits per object, in the order of the request's objects)."""

    credential: str
    date: str
    signatures: str

    def __len__(self) -> int:
        return len(self.signatures) // 64

    def to_json(self) -> dict[str, str]:
        return {"credential": self.credential, "date": self.date, "signatures": self.signatures}

    @classmethod
    def from_json(cls, data: Any, count: int) -> ProofBatch:
        if not isinstance(data, dict) or not all(isinstance(data.get(k), str) for k in ("credential", "date", "signatures")):
            raise InvalidProof("'proofs' must be {credential, date, signatures}: send it through the pod's sidecar")
        sigs = data["signatures"]
        if len(sigs) != 64 * count:
            raise InvalidProof(f"'proofs' holds {len(sigs) // 64} signatures for {count} objects")
        Proof.parse(data["credential"], data["date"], sigs[:64] if sigs else "0" * 64)
        return cls(data["credential"], data["date"], sigs)

    def __getitem__(self, index: int) -> Proof:
        sig = self.signatures[64 * index: 64 * index + 64]
        if not _SIGNATURE.fullmatch(sig):
            raise InvalidProof(f"signature {index} of 'proofs' is not 64 hex digits")
        return Proof(self.credential, self.date, sig)


def _signed_headers(url: str, date: str, token: str | None) -> dict[str, str]:
    headers = {"host": canonical_host(url), "x-amz-content-sha256": EMPTY_SHA256, "x-amz-date": date}
    if token:
        headers["x-amz-security-token"] = token
    return headers


def proof_request(target: Target, date: str, token: str | None, bucket: str, key: str | None = None,
                  prefix: str = "") -> tuple[str, str, dict[str, str]]:
    """(method, url, signed headers) of the request that proves reading ``bucket/key`` (``key``
    given) or listing ``prefix`` in ``bucket``: what the sidecar signs and the daemon replays."""
    if key is None:
        url = list_url(target, bucket, prefix)
        return "GET", url, _signed_headers(url, date, token)
    url = object_url(target, bucket, key)
    headers = _signed_headers(url, date, token)
    if target.object_proof == "GET":
        headers["range"] = OBJECT_RANGE
    return target.object_proof, url, headers


def _sign(creds: Credentials, target: Target, date: str, bucket: str, key: str | None, prefix: str = "") -> str:
    method, url, headers = proof_request(target, date, creds.token, bucket, key, prefix)
    return signature(creds, method, url, headers, region=target.region, service="s3", date=date)


def prove(creds: Credentials, target: Target, date: str, bucket: str, key: str | None = None,
          prefix: str = "") -> Proof:
    """The proof of reading ``bucket/key`` (``key`` given) or of listing ``prefix`` in ``bucket``."""
    return Proof(f"{creds.access_key}/{scope(date, target.region, 's3')}", date,
                 _sign(creds, target, date, bucket, key, prefix))


def prove_batch(creds: Credentials, target: Target, date: str, objects: list[tuple[str, str]]) -> ProofBatch:
    sigs = "".join(_sign(creds, target, date, b, k) for b, k in objects)
    return ProofBatch(f"{creds.access_key}/{scope(date, target.region, 's3')}", date, sigs)


def identity_request(target: Target, date: str, token: str | None) -> tuple[str, str, dict[str, str], bytes]:
    """(method, url, signed headers, body) of the identity proof's request."""
    url = _identity_url(target)
    if target.identity == "sts":
        headers = {"content-type": _STS_CONTENT_TYPE, "host": canonical_host(url), "x-amz-date": date,
                   AUDIENCE_HEADER: target.audience}
        if token:
            headers["x-amz-security-token"] = token
        return "POST", url, headers, STS_BODY
    signed = _signed_headers(url, date, token)
    # S3 checks a signed header's value and acts on none it does not know: the audience binds the
    # proof to one daemon as for STS. A daemon before issue 29 (it publishes no object_proof, read
    # as HEAD) rebuilt ListBuckets without it, and a newer sidecar signs what that one replays;
    # every daemon of this version builds its own Target, so it always asks for the audience.
    if target.object_proof == "GET":
        signed[AUDIENCE_HEADER] = target.audience
    return "GET", url, signed, b""


def prove_identity(creds: Credentials, target: Target, date: str) -> dict[str, Any]:
    """The body of ``POST /_shardcache/auth/session``: the identity proof, the security token, and
    what this sidecar signs to prove a read (``object_proof``: a daemon refuses a session whose
    reads it would not accept, with words instead of failed signatures later)."""
    import hashlib

    method, url, headers, body = identity_request(target, date, creds.token)
    service, region = ("sts", target.sts_region) if target.identity == "sts" else ("s3", target.region)
    payload = hashlib.sha256(body).hexdigest() if target.identity == "sts" else EMPTY_SHA256
    sig = signature(creds, method, url, headers, region=region, service=service, date=date, payload_sha256=payload)
    proof = Proof(f"{creds.access_key}/{scope(date, region, service)}", date, sig)
    return {"proof": proof.to_header(), "security_token": creds.token, "object_proof": target.object_proof}


def replay_headers(proof: Proof, signed: dict[str, str]) -> dict[str, str]:
    """The headers to send with ``proof``'s request: its signed headers but ``host`` (the HTTP
    client sends that one from the URL), and the Authorization they make."""
    names = ";".join(sorted(signed))
    headers = {name: value for name, value in signed.items() if name != "host"}
    headers["authorization"] = (
        f"AWS4-HMAC-SHA256 Credential={proof.credential}, SignedHeaders={names}, Signature={proof.signature}"
    )
    return headers
