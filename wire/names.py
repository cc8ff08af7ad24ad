"""Validation of bucket names and object keys arriving from the network.

Everything hostile is refused here, before any origin or file system is touched: NUL and control
characters, ``.``/``..`` path segments (traversal on ``file://`` origins), absolute paths and
over-long names.
"""

from __future__ import annotations

import re

from wire.errors import InvalidName

__all__ = ["validate_bucket", "validate_key", "validate_prefix", "parse_object_url"]

# S3's rules, plus underscores and upper case that MinIO/Ceph legacy buckets allow.
_BUCKET_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{1,254}$")
_MAX_KEY_BYTES = 1024


def validate_bucket(bucket: str) -> str:
    if not _BUCKET_RE.match(bucket) or ".." in bucket:
        raise InvalidName(f"invalid bucket name {bucket[:80]!r}: use 2-255 letters, digits, '.', '-' or '_'")
    return bucket


def _check_text(text: str, what: str, allow_empty: bool) -> None:
    if not text and not allow_empty:
        raise InvalidName(f"empty {what}")
    if len(text.encode("utf-8", "surrogatepass")) > _MAX_KEY_BYTES:
        raise InvalidName(f"{what} longer than {_MAX_KEY_BYTES} bytes")
    if any(ord(ch) < 0x20 or ord(ch) == 0x7F for ch in text):
        raise InvalidName(f"{what} contains NUL or control characters")
    if "\\" in text:
        raise InvalidName(f"{what} contains a backslash")
    if text.startswith("/"):
        raise InvalidName(f"{what} must not start with '/'")
    if any(part in (".", "..") for part in text.split("/")):
        raise InvalidName(f"{what} contains a '.' or '..' path segment")


def validate_key(key: str) -> str:
    _check_text(key, "object key", allow_empty=False)
    if key.endswith("/"):
        raise InvalidName("object key must not end with '/'")
    return key


def validate_prefix(prefix: str) -> str:
    _check_text(prefix, "prefix", allow_empty=True)
    return prefix


def parse_object_url(url: str, file_root: str | None = None) -> tuple[str, str]:
    """``s3://bucket/key`` (or ``file:///root/bucket/key`` under ``file_root``) → (bucket, key)."""
    if url.startswith("s3://"):
        rest = url[5:]
    elif url.startswith("file://") and file_root is not None:
        path = url[7:]
        root = file_root.rstrip("/") + "/"
        if not path.startswith(root):
            raise InvalidName(f"{url!r} is not under this daemon's origin {file_root!r}")
        rest = path[len(root):]
    else:
        raise InvalidName(f"unsupported object URL {url[:120]!r}: use s3://bucket/key")
    bucket, _, key = rest.partition("/")
    return validate_bucket(bucket), key
