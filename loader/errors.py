"""Exceptions of the loader: one root, subclasses that also inherit the matching builtin.

Third-party errors (botocore, http.client, OSError from the file system) are wrapped at the
boundary with ``raise ... from`` so a training script needs to know only these. Errors of the
master protocol live in :mod:`loader.master.errors`, under their own ``MasterError``, itself a
:class:`LoaderError`. What both sides mean alike is defined once in :mod:`wire.errors`; the
classes here of the same name (``ManifestError``, ``AccessDenied``) are those, under
:class:`LoaderError` too.
"""

from __future__ import annotations

from wire.errors import AccessDenied as WireAccessDenied
from wire.errors import ManifestError as WireManifestError

__all__ = [
    "LoaderError",
    "ConfigError",
    "ManifestError",
    "DatasetNotFound",
    "ShardNotFound",
    "CorruptShard",
    "SourceError",
    "AccessDenied",
]


class LoaderError(Exception):
    """Root of every error raised by :mod:`loader`, the master protocol's included."""


class ConfigError(LoaderError, ValueError):
    """Arguments or settings that cannot work together (fix the call)."""


class ManifestError(LoaderError, WireManifestError):
    """``manifest.json`` exists but is not a valid version-1 WebDataset manifest (also wire's
    ``ManifestError``, the rule's own error, so code catching either catches it)."""


class DatasetNotFound(LoaderError, FileNotFoundError):
    """The dataset prefix holds neither a manifest nor any ``*.tar`` shard."""


class ShardNotFound(LoaderError, FileNotFoundError):
    """A shard listed by the manifest (or the master) does not exist at the origin."""


class CorruptShard(LoaderError, ValueError):
    """A shard is not a valid tar (bad header checksum, truncated data, size or hash mismatch).

    ``url`` names the shard and ``position`` the byte offset where the problem was found."""

    def __init__(self, message: str, *, url: str = "", position: int | None = None) -> None:
        where = f"{url}" + (f" at byte {position}" if position is not None else "")
        super().__init__(f"{where}: {message}" if where else message)
        self.url = url
        self.position = position


class SourceError(LoaderError, OSError):
    """Reading from the origin or the cache daemon failed after the bounded retries."""


class AccessDenied(SourceError, WireAccessDenied):
    """The origin or the daemon refused access (credentials, bucket policy, file permissions)."""
