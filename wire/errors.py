"""Exceptions of the shared rules: one root, subclasses that also inherit the matching builtin.

Each side maps them at its own boundary: the daemon answers ``InvalidName`` with S3's
``InvalidArgument`` (400) in its one error map (:mod:`sidecar.errors`), the loader and the CLI
report it as a configuration error.
"""

from __future__ import annotations

__all__ = ["WireError", "InvalidName", "ManifestError"]


class WireError(Exception):
    """Root of every error raised by :mod:`wire`."""


class InvalidName(WireError, ValueError):
    """A bucket, key, prefix, URL, address or id is malformed or hostile; nothing was touched."""


class ManifestError(WireError, ValueError):
    """A dataset's ``manifest.json`` is malformed."""
