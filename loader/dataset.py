"""Datasets: where a dataset lives (its URL) and which shards it holds (manifest or listing)."""

from __future__ import annotations

import json
import re
import urllib.parse
from dataclasses import dataclass
from typing import Any, Literal

from loader.errors import ConfigError, DatasetNotFound, LoaderError, ManifestError

__all__ = ["Location", "Shard", "parse_dataset_url", "check_key", "parse_manifest", "MANIFEST_NAME"]

MANIFEST_NAME = "manifest.json"
MAX_MANIFEST_BYTES = 256 << 20
_HEX128 = re.compile(r"^[0-9a-fA-F]{32}$")


@dataclass(frozen=True)
class Location:
    """A dataset prefix. ``prefix`` always ends with ``/`` unless empty (the bucket's root)."""

    url: str
    scheme: Literal["s3", "file"]
    bucket: str  # s3 bucket; for file:// the empty string (the root is only known to a daemon)
    prefix: str  # s3 key prefix; for file:// the absolute directory path (with trailing /)

    def shard_url(self, key: str) -> str:
        return self.url + key


@dataclass(frozen=True)
class Shard:
    """One shard of a dataset. ``index`` is its position in the dataset's sorted shard list."""

    index: int
    key: str
    size: int | None = None
    xxh3_128: str | None = None
    samples: int | None = None
    etag: str | None = None

    def spec(self) -> dict[str, Any]:
        """The shard as the master's job spec lists it."""
        return {"key": self.key, "size": self.size, "samples": self.samples}


def parse_dataset_url(url: str) -> Location:
    """``s3://bucket/prefix/`` or ``file:///abs/root/bucket/prefix/`` → :class:`Location`."""
    if not isinstance(url, str) or not url:
        raise ConfigError("dataset URL must be a non-empty string like s3://bucket/train/")
    if "\x00" in url:
        raise ConfigError(f"dataset URL {url!r} contains a NUL byte")
    parts = urllib.parse.urlsplit(url)
    if parts.scheme == "s3":
        bucket = parts.netloc
        if not bucket or "/" in bucket:
            raise ConfigError(f"dataset URL {url!r} has no bucket: use s3://bucket/prefix/")
        prefix = parts.path.lstrip("/")
        if prefix and not prefix.endswith("/"):
            prefix += "/"
        _check_relative(prefix.rstrip("/"), url, allow_empty=True, error=ConfigError)
        return Location(f"s3://{bucket}/{prefix}", "s3", bucket, prefix)
    if parts.scheme == "file":
        if parts.netloc not in ("", "localhost"):
            raise ConfigError(f"dataset URL {url!r}: file URLs need an absolute path, file:///root/bucket/prefix/")
        path = urllib.parse.unquote(parts.path)
        if not path.startswith("/"):
            raise ConfigError(f"dataset URL {url!r}: file URLs need an absolute path, file:///root/bucket/prefix/")
        if not path.endswith("/"):
            path += "/"
        _check_relative(path.strip("/"), url, allow_empty=True, error=ConfigError)
        return Location("file://" + path, "file", "", path)
    raise ConfigError(f"unsupported dataset URL {url!r}: use s3://bucket/prefix/ or file:///root/bucket/prefix/")


def _check_relative(
    path: str, where: str, allow_empty: bool = False, error: type[LoaderError] = ManifestError
) -> None:
    if not path:
        if allow_empty:
            return
        raise error(f"{where}: empty key")
    if "\x00" in path or "\\" in path:
        raise error(f"{where}: key {path!r} contains a NUL byte or a backslash")
    if path.startswith("/") or any(part in ("", ".", "..") for part in path.split("/")):
        raise error(f"{where}: key {path!r} must be a plain relative path (no '..', '.', '//' or leading '/')")


def check_key(key: str, where: str = "shard") -> str:
    """A shard key must stay inside its dataset prefix: relative, no traversal, no NUL."""
    if not isinstance(key, str):
        raise ManifestError(f"{where}: key must be a string, not {type(key).__name__}")
    _check_relative(key, where)
    return key


def parse_manifest(data: bytes, where: str) -> list[Shard]:
    """Validate a version-1 WebDataset manifest; every problem is one clear ManifestError."""
    if len(data) > MAX_MANIFEST_BYTES:
        raise ManifestError(f"{where}: larger than {MAX_MANIFEST_BYTES} bytes")
    try:
        doc = json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ManifestError(f"{where}: not valid JSON ({exc})") from exc
    if not isinstance(doc, dict):
        raise ManifestError(f"{where}: must be a JSON object with version, format and shards")
    if doc.get("version") != 1:
        raise ManifestError(f"{where}: unsupported version {doc.get('version')!r} (this loader reads version 1)")
    if doc.get("format", "webdataset") != "webdataset":
        raise ManifestError(f"{where}: unsupported format {doc.get('format')!r} (this loader reads webdataset)")
    entries = doc.get("shards")
    if not isinstance(entries, list):
        raise ManifestError(f"{where}: 'shards' must be a list")
    if not entries:
        raise DatasetNotFound(f"{where}: the manifest lists no shards")
    shards: list[Shard] = []
    seen: set[str] = set()
    for i, entry in enumerate(entries):
        at = f"{where}: shards[{i}]"
        if not isinstance(entry, dict):
            raise ManifestError(f"{at} must be an object")
        key = check_key(entry.get("key"), at)  # type: ignore[arg-type]
        if key in seen:
            raise ManifestError(f"{at}: key {key!r} is listed twice")
        seen.add(key)
        size = _opt_count(entry.get("size"), f"{at}.size")
        samples = _opt_count(entry.get("samples"), f"{at}.samples")
        digest = entry.get("xxh3_128")
        if digest is not None and (not isinstance(digest, str) or not _HEX128.match(digest)):
            raise ManifestError(f"{at}.xxh3_128 must be 32 hex digits")
        shards.append(Shard(i, key, size, digest.lower() if digest else None, samples))
    return shards


def _opt_count(value: Any, where: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ManifestError(f"{where} must be a non-negative integer or null, not {value!r}")
    return value
