"""Exceptions of the cache engine: one root, subclasses that also inherit the matching builtin."""

from __future__ import annotations

__all__ = ["CacheError", "CacheLocked", "EntryNotFound", "CorruptEntry", "IntegrityError", "NoSpace", "ReadOnlyViewError"]


class CacheError(Exception):
    """Root of every error raised by :mod:`cache`."""


class CacheLocked(CacheError, BlockingIOError):
    """Another process already owns this cache directory."""


class EntryNotFound(CacheError, FileNotFoundError):
    """The entry is not (or no longer) in the cache."""


class CorruptEntry(CacheError, ValueError):
    """A published file no longer matches the checksum it was published with; it was removed."""


class IntegrityError(CacheError, ValueError):
    """Bytes written for an entry do not match the expected size or xxh3-128 checksum."""


class NoSpace(CacheError, OSError):
    """The file system ran out of space (or quota) while writing an entry."""


class ReadOnlyViewError(CacheError, PermissionError):
    """``StoreSettings.read_only_view`` is not the cache directory mounted read-only (at start-up,
    or no longer: remounted, unmounted). The message says what to mount."""
