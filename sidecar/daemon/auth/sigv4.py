"""AWS Signature Version 4, for the proofs of ``--auth sigv4`` (and nothing else).

Why not botocore's signers: a proof is signed for a request the daemon rebuilds itself, so both
sides must agree on every byte of it (host, path encoding, signed headers) without botocore's
per-client choices (user agent, ``amz-sdk-*`` headers, checksum modes) in between; and a warm-up
of 200,000 objects carries one proof per object, which botocore signs at ~100 us each (its
``AWSRequest`` machinery) where this takes ~10 us (one SHA-256 and one HMAC; the signing key is
derived once a day). ``tests/tenancy/test_sigv4.py`` checks every signature here against
botocore's for the same request and clock.

The rules are AWS's: https://docs.aws.amazon.com/IAM/latest/UserGuide/reference_sigv.html. S3
signs the path exactly as sent (no normalisation, single encoding); the payload hash of a body-less
request is the SHA-256 of nothing.
"""

from __future__ import annotations

import datetime as dt
import functools
import hashlib
import hmac
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import quote, urlsplit

__all__ = [
    "ALGORITHM", "EMPTY_SHA256", "Credentials", "amz_date", "canonical_host", "encode_key", "encode_query",
    "parse_amz_date", "scope", "signature",
]

ALGORITHM = "AWS4-HMAC-SHA256"
EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()
_DEFAULT_PORTS = {"http": 80, "https": 443}


@dataclass(frozen=True)
class Credentials:
    """One set of AWS credentials (``token`` for temporary ones). ``repr`` hides the secret."""

    access_key: str
    secret_key: str
    token: str | None = None

    def __repr__(self) -> str:
        return f"Credentials(access_key={self.access_key!r}, secret_key=..., token={'...' if self.token else None})"


def amz_date(now: dt.datetime | None = None) -> str:
    """``X-Amz-Date`` of ``now`` (UTC): ``20261201T174500Z``."""
    return (now or dt.datetime.now(dt.UTC)).astimezone(dt.UTC).strftime("%Y%m%dT%H%M%SZ")


def parse_amz_date(value: str) -> dt.datetime:
    """The time of an ``X-Amz-Date``; ``ValueError`` if it is not one."""
    if len(value) != 16:
        raise ValueError(f"not an X-Amz-Date: {value[:40]!r}")
    return dt.datetime.strptime(value, "%Y%m%dT%H%M%SZ").replace(tzinfo=dt.UTC)


def scope(date: str, region: str, service: str) -> str:
    """The credential scope of a signature made on ``date`` (``X-Amz-Date``)."""
    return f"{date[:8]}/{region}/{service}/aws4_request"


def canonical_host(url: str) -> str:
    """The ``host`` header a client sends for ``url``: the port only when it is not the default
    (what http.client sends, and what AWS signs)."""
    parts = urlsplit(url)
    if not parts.hostname:
        raise ValueError(f"not an absolute URL: {url[:200]!r}")
    host = parts.hostname if ":" not in parts.hostname else f"[{parts.hostname}]"
    if parts.port is not None and parts.port != _DEFAULT_PORTS.get(parts.scheme):
        host = f"{host}:{parts.port}"
    return host


def encode_key(key: str) -> str:
    """An object key as S3 wants it in the path: every byte but unreserved ones and ``/``."""
    return quote(key, safe="/~")


def encode_query(params: Mapping[str, str]) -> str:
    """A canonical query string: names and values encoded (``/`` too), sorted by name."""
    return "&".join(f"{quote(k, safe='-_.~')}={quote(v, safe='-_.~')}" for k, v in sorted(params.items()))


@functools.lru_cache(maxsize=64)
def _signing_key(secret: str, day: str, region: str, service: str) -> bytes:
    key = hmac.new(f"AWS4{secret}".encode(), day.encode(), hashlib.sha256).digest()
    for part in (region, service, "aws4_request"):
        key = hmac.new(key, part.encode(), hashlib.sha256).digest()
    return key


def signature(
    creds: Credentials, method: str, url: str, headers: Mapping[str, str], *, region: str, service: str,
    date: str, payload_sha256: str = EMPTY_SHA256,
) -> str:
    """The SigV4 signature of a request to ``url`` (already encoded, query in canonical order)
    whose signed headers are ``headers`` (names lower case, ``host`` among them) made at ``date``."""
    parts = urlsplit(url)
    names = sorted(headers)
    canonical = "\n".join((
        method,
        parts.path or "/",
        parts.query,
        "".join(f"{name}:{' '.join(headers[name].split())}\n" for name in names),
        ";".join(names),
        payload_sha256,
    ))
    to_sign = "\n".join((ALGORITHM, date, scope(date, region, service), hashlib.sha256(canonical.encode()).hexdigest()))
    key = _signing_key(creds.secret_key, date[:8], region, service)
    return hmac.new(key, to_sign.encode(), hashlib.sha256).hexdigest()
