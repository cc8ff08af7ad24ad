"""Exceptions of the daemon and its origins, and their one mapping to S3 error answers.

Origin errors inherit the matching builtin (``ObjectNotFound`` is a ``FileNotFoundError``) so
callers that only know the builtins still handle them; third-party errors (botocore, aiohttp)
are wrapped with ``raise ... from`` at the origin boundary and never leak past it. What both sides
mean alike (a malformed request, access refused) is defined once in :mod:`wire.errors`; the
classes here of the same name are those, under :class:`SidecarError` too.
"""

from __future__ import annotations

from wire import errors as wire_errors
from wire.errors import BodyTooLarge, InvalidBody, InvalidName

__all__ = [
    "SidecarError",
    "BadRequest",
    "PreconditionFailed",
    "OriginError",
    "ObjectNotFound",
    "BucketNotFound",
    "AccessDenied",
    "NotAuthorized",
    "InvalidRange",
    "OriginUnavailable",
    "OriginThrottled",
    "OriginBadResponse",
    "WarmupConflict",
    "NoSuchWarmup",
    "Busy",
    "ChecksumMismatch",
    "S3_ERRORS",
    "s3_error_for",
]


class SidecarError(Exception):
    """Root of every error raised by :mod:`sidecar`."""


class BadRequest(SidecarError, wire_errors.BadRequest):
    """The request is malformed or hostile (traversal, NUL, bad JSON); nothing was touched."""


class PreconditionFailed(SidecarError):
    """An ``If-Match`` or ``If-Unmodified-Since`` of the request does not hold for the object
    (:func:`wire.s3headers.precondition`); ``condition`` names the header, as S3's error
    document does in its ``<Condition>``."""

    def __init__(self, message: str, condition: str) -> None:
        super().__init__(message)
        self.condition = condition


class WarmupConflict(SidecarError, ValueError):
    """A warm-up with that id is running with other objects."""


class NoSuchWarmup(SidecarError, LookupError):
    """No warm-up with that id on this daemon (finished long ago, or the daemon restarted)."""


class Busy(SidecarError):
    """Too much work in progress; the client retries after ``retry_after`` seconds."""

    def __init__(self, message: str, retry_after: int | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class NotAuthorized(SidecarError, PermissionError):
    """A request ``--auth sigv4`` refuses: no session or proof, a malformed one, or one the origin
    refused. ``renew``: a new session would cure it (expired, unknown after a daemon restart,
    rotated credentials); the sidecar then starts one and retries once."""

    def __init__(self, message: str, renew: bool = False) -> None:
        super().__init__(message)
        self.renew = renew


class ChecksumMismatch(SidecarError):
    """The caller's xxh3-128 (``x-shardcache-xxh3-128``: its manifest's) is not the object's, and
    the daemon's copy checks out: its own file re-hashed, and the origin vouched for it (or it was
    fetched again for this claim). A stale or wrong manifest, never a reason to purge the copy
    other callers read."""


class OriginError(SidecarError):
    """Root of errors talking to the object store behind the cache."""


class ObjectNotFound(OriginError, FileNotFoundError):
    pass


class BucketNotFound(OriginError, FileNotFoundError):
    pass


class AccessDenied(OriginError, wire_errors.AccessDenied):
    """The origin refused access (credentials, bucket policy, file permissions)."""


class InvalidRange(OriginError, ValueError):
    def __init__(self, message: str, size: int | None = None) -> None:
        super().__init__(message)
        self.size = size


class OriginUnavailable(OriginError, ConnectionError):
    """The origin could not be reached, or kept failing after bounded retries."""


class OriginThrottled(OriginUnavailable):
    """The origin kept answering SlowDown/503 after bounded retries."""


class OriginBadResponse(OriginError, IOError):
    """The origin answered, but with a truncated or corrupt body (after retries)."""


# exception type -> (HTTP status, S3 error code). The only place errors become HTTP answers.
S3_ERRORS: list[tuple[type[BaseException], int, str]] = [
    (BadRequest, 400, "InvalidArgument"),
    (PreconditionFailed, 412, "PreconditionFailed"),
    (InvalidName, 400, "InvalidArgument"),
    (BodyTooLarge, 413, "BodyTooLarge"),
    (InvalidBody, 400, "InvalidArgument"),
    (WarmupConflict, 409, "WarmupConflict"),
    (NoSuchWarmup, 404, "NoSuchWarmup"),
    (Busy, 503, "SlowDown"),
    (ChecksumMismatch, 409, "ChecksumMismatch"),
    (ObjectNotFound, 404, "NoSuchKey"),
    (BucketNotFound, 404, "NoSuchBucket"),
    (NotAuthorized, 403, "AccessDenied"),
    (AccessDenied, 403, "AccessDenied"),
    (InvalidRange, 416, "InvalidRange"),
    (OriginThrottled, 503, "SlowDown"),
    (OriginUnavailable, 503, "ServiceUnavailable"),
    (OriginBadResponse, 502, "BadGateway"),
]


def s3_error_for(exc: BaseException) -> tuple[int, str]:
    for exc_type, status, code in S3_ERRORS:
        if isinstance(exc, exc_type):
            return status, code
    # Imported lazily: cache errors map too, without sidecar's import graph depending on order.
    from cache import IntegrityError

    if isinstance(exc, IntegrityError):
        return 502, "BadDigest"
    return 500, "InternalError"
