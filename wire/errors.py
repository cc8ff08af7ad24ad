"""Exceptions of the shared rules: one root, subclasses that also inherit the matching builtin.

Each side maps them at its own boundary: the daemon answers ``InvalidName`` with S3's
``InvalidArgument`` (400) in its one error map (:mod:`sidecar.errors`), the loader and the CLI
report it as a configuration error.

What both sides mean alike has its one class here: a malformed request (:class:`BadRequest`), a
body too large (:class:`BodyTooLarge`), access refused (:class:`AccessDenied`). A package whose
callers catch its own root derives its class of that name from this one and its root
(``sidecar.errors.BadRequest``, ``loader.errors.AccessDenied``...), so that an ``except`` of
either catches it.
"""

from __future__ import annotations

__all__ = [
    "WireError",
    "InvalidName",
    "ManifestError",
    "EmptyManifest",
    "BadRequest",
    "InvalidBody",
    "BodyTooLarge",
    "HeadersTooLarge",
    "AccessDenied",
]


class WireError(Exception):
    """Root of every error raised by :mod:`wire`."""


class InvalidName(WireError, ValueError):
    """A bucket, key, prefix, URL, address or id is malformed or hostile; nothing was touched."""


class ManifestError(WireError, ValueError):
    """A dataset's ``manifest.json`` is malformed."""


class EmptyManifest(ManifestError):
    """A dataset's ``manifest.json`` lists no shards: well-formed, but nothing to train on (the
    loader reports it as its ``DatasetNotFound``)."""


class BadRequest(WireError, ValueError):
    """A request is malformed or hostile (bad JSON, a missing or out-of-range field, traversal,
    NUL); nothing was touched. Every server answers it with 400."""


class InvalidBody(BadRequest):
    """A request body is not what the route takes: not JSON, not UTF-8, not an object, empty."""


class BodyTooLarge(InvalidBody):
    """A request body is larger than the route accepts (counted as read, not only as declared);
    ``limit``: the bound in bytes, when the raiser knows it. Every server answers it with 413."""

    def __init__(self, message: str, limit: int | None = None) -> None:
        super().__init__(message)
        self.limit = limit


class HeadersTooLarge(WireError, ValueError):
    """An origin's answer carries more object headers than S3 could ever have stored with an
    object (:data:`wire.s3headers.MAX_OBJECT_HEADER_BYTES`): nothing of it is kept or forwarded."""


class AccessDenied(WireError, PermissionError):
    """The object store (or the daemon in front of it) refused access: credentials, bucket policy,
    file permissions."""
