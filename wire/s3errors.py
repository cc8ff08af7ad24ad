"""What an S3 error answer means, whoever received it.

Three clients talk S3 (the daemon's origin, the CLI's dataset tooling, the loader's direct
source) and the loader also reads the daemon's S3-shaped answers. Each raises its own exception
types, but what an answer means is one rule, here: :func:`classify` turns an HTTP status and an
S3 error code into an :class:`S3ErrorKind`, and each client maps kinds to its exceptions in one
table. The answer comes from a botocore ``ClientError`` (:func:`from_client_error`, read
duck-typed through its ``response`` dict, so this module needs no botocore) or from a raw HTTP
answer (:func:`from_http`, the code read from the XML body).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from wire.s3xml import parse_error

__all__ = ["S3ErrorKind", "S3ErrorAnswer", "S3_MESSAGES", "TRANSIENT", "classify", "from_client_error", "from_http"]


class S3ErrorKind(enum.Enum):
    NOT_FOUND_BUCKET = "not_found_bucket"
    NOT_FOUND_KEY = "not_found_key"
    ACCESS_DENIED = "access_denied"
    INVALID_RANGE = "invalid_range"
    PRECONDITION_FAILED = "precondition_failed"
    """``If-Match`` failed: the object changed since its ETag was taken."""
    BAD_REQUEST = "bad_request"
    THROTTLED = "throttled"
    UNAVAILABLE = "unavailable"
    """A server-side fault (500, 502, 504): worth retrying."""
    CHECKSUM_MISMATCH = "checksum_mismatch"
    """shardcache's own ``409 ChecksumMismatch``: the caller's xxh3-128 is not the object's."""
    UNEXPECTED = "unexpected"
    """Any other answer (a 405, 409, 501, a redirect): not S3 behaving as a read path expects."""


TRANSIENT = frozenset({S3ErrorKind.THROTTLED, S3ErrorKind.UNAVAILABLE})
"""The kinds a later attempt may not get."""

S3_MESSAGES = {
    "NoSuchKey": "The specified key does not exist.",
    "NoSuchBucket": "The specified bucket does not exist",
    "InvalidRange": "The requested range is not satisfiable",
    "PreconditionFailed": "At least one of the pre-conditions you specified did not hold",
}
"""S3's own ``<Message>`` for the errors a cache answers in the origin's place. Clients show it
as it is (``aws s3 cp``: "An error occurred (NoSuchKey) ...: The specified key does not exist."),
so an answer through the cache reads as the origin's; the daemon's own detail goes to its log."""

_NOT_FOUND_CODES = frozenset({"NoSuchKey", "NotFound", "404"})
# Refused credentials are answered 403 by S3, but ExpiredToken comes with a 400; and a HEAD (no
# body) carries the status as its code in botocore.
_DENIED_CODES = frozenset({"AccessDenied", "403", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken"})


@dataclass(frozen=True)
class S3ErrorAnswer:
    status: int
    code: str
    message: str
    kind: S3ErrorKind

    @property
    def detail(self) -> str:
        """The code, or the status when the answer had no code (a HEAD)."""
        return self.code or str(self.status)


def classify(status: int, code: str) -> S3ErrorKind:
    """The meaning of an error answer: the code where it says more than the status (a 404 may be
    a missing bucket or key), the status otherwise."""
    if code == "NoSuchBucket":
        return S3ErrorKind.NOT_FOUND_BUCKET
    if code == "ChecksumMismatch":
        return S3ErrorKind.CHECKSUM_MISMATCH
    if status == 404 or code in _NOT_FOUND_CODES:
        return S3ErrorKind.NOT_FOUND_KEY
    if status == 403 or code in _DENIED_CODES:
        return S3ErrorKind.ACCESS_DENIED
    if status == 416 or code == "InvalidRange":
        return S3ErrorKind.INVALID_RANGE
    if status == 412 or code == "PreconditionFailed":
        return S3ErrorKind.PRECONDITION_FAILED
    if status == 400:
        return S3ErrorKind.BAD_REQUEST
    if status == 503 or code == "SlowDown":
        return S3ErrorKind.THROTTLED
    if status in (500, 502, 504):
        return S3ErrorKind.UNAVAILABLE
    return S3ErrorKind.UNEXPECTED


def from_client_error(exc: BaseException) -> S3ErrorAnswer:
    """The answer inside a botocore ``ClientError`` (its ``response`` dict)."""
    response: Any = getattr(exc, "response", None)
    if not isinstance(response, dict):
        response = {}
    error = response.get("Error")
    error = error if isinstance(error, dict) else {}
    meta = response.get("ResponseMetadata")
    meta = meta if isinstance(meta, dict) else {}
    try:
        status = int(meta.get("HTTPStatusCode", 0))
    except (TypeError, ValueError):
        status = 0
    code = str(error.get("Code") or "")
    if not status and code.isdigit():  # botocore's code of a bodiless answer is its status
        status = int(code)
    message = str(error.get("Message") or "")
    return S3ErrorAnswer(status, code, message, classify(status, code))


def from_http(status: int, body: bytes) -> S3ErrorAnswer:
    """The answer of a raw HTTP exchange: its status and the code in its XML body."""
    parsed = parse_error(body)
    return S3ErrorAnswer(status, parsed.code, parsed.message, classify(status, parsed.code))
