"""Datasets as both sides name them: the dataset URL and the ``manifest.json`` format.

A dataset is a prefix, ``s3://bucket/prefix/`` or ``file:///root/bucket/prefix/``, holding
WebDataset ``*.tar`` shards and, ideally, a ``manifest.json`` listing them (the **contract**
format, written by ``shardcache index``, read by the CLI and by trainers)::

    {"version": 1, "format": "webdataset",
     "shards": [{"key": "train-000000.tar", "size": 123, "xxh3_128": "<hex>", "samples": 100}, ...]}

Keys are relative to the dataset prefix; ``size``, ``xxh3_128`` and ``samples`` may be null or
absent. The writer emits lower-case digests; the reader accepts either case and normalises.

The webdataset project's indexed reader (``wids``) has a shard index of its own, the same facts
in another shape, read and written here too (:func:`parse_wids_index`, :func:`wids_index_bytes`)::

    {"__kind__": "wids-shard-index-v1", "wids_version": 1,
     "shardlist": [{"url": "train-000000.tar", "nsamples": 100, "filesize": 123}, ...]}

Its ``url`` is relative to the index's own location (here, the dataset prefix: an absolute URL
must lie under it); sub-datasets (``datasets``, ``source_url``) are not read.

Problems are :class:`~wire.errors.InvalidName` (the URL) and :class:`~wire.errors.ManifestError`
(the manifest, :class:`~wire.errors.EmptyManifest` when it lists no shards); each side wraps them
into its own errors at its boundary.
"""

from __future__ import annotations

import json
import urllib.parse
from dataclasses import dataclass
from typing import Any, Literal

from wire import jsontext
from wire.errors import EmptyManifest, InvalidName, ManifestError
from wire.names import is_xxh3_128

__all__ = [
    "MANIFEST_FORMAT",
    "MANIFEST_NAME",
    "MANIFEST_VERSION",
    "WIDS_KIND",
    "parse_index",
    "parse_wids_index",
    "wids_index_bytes",
    "MAX_MANIFEST_BYTES",
    "DatasetURL",
    "ManifestShard",
    "check_key",
    "parse_dataset_url",
    "parse_manifest",
    "json_object",
]

MANIFEST_NAME = "manifest.json"
MANIFEST_VERSION = 1
MANIFEST_FORMAT = "webdataset"
MAX_MANIFEST_BYTES = 256 << 20
"""A 200k-shard manifest is tens of MiB; anything far larger is not a manifest."""

_URL_HINT = "use s3://bucket/prefix/ or file:///root/bucket/prefix/"


# -- where a dataset is ---------------------------------------------------------------------------


@dataclass(frozen=True)
class DatasetURL:
    """A dataset prefix. ``url`` is canonical (it ends with ``/`` unless it is a bucket's root).

    ``s3``: ``bucket`` and the key ``prefix`` ("" or ending with ``/``). ``file``: ``path``, the
    absolute directory with a trailing ``/`` (which part of it is the bucket only a daemon knows,
    from its origin root: :func:`wire.names.split_origin_path`).
    """

    url: str
    scheme: Literal["s3", "file"]
    bucket: str = ""
    prefix: str = ""
    path: str = ""

    def object_url(self, key: str) -> str:
        return self.url + key


def parse_dataset_url(url: object) -> DatasetURL:
    """``s3://bucket/prefix/`` or ``file:///abs/root/bucket/prefix/`` → :class:`DatasetURL`; a
    prefix without its trailing slash is still a prefix."""
    if not isinstance(url, str) or not url:
        raise InvalidName(f"dataset URL must be a non-empty string like s3://bucket/train/: {_URL_HINT}")
    if "\x00" in url:
        raise InvalidName(f"dataset URL {url!r} contains a NUL byte")
    parts = urllib.parse.urlsplit(url)
    if parts.scheme == "s3":
        bucket = parts.netloc
        if not bucket:
            raise InvalidName(f"dataset URL {url!r} has no bucket: use s3://bucket/prefix/")
        prefix = parts.path.lstrip("/")
        if prefix and not prefix.endswith("/"):
            prefix += "/"
        _check_relative(prefix.rstrip("/"), f"dataset URL {url!r}", InvalidName, allow_empty=True)
        return DatasetURL(f"s3://{bucket}/{prefix}", "s3", bucket=bucket, prefix=prefix)
    if parts.scheme == "file":
        path = urllib.parse.unquote(parts.path)
        if parts.netloc not in ("", "localhost") or not path.startswith("/"):
            raise InvalidName(f"dataset URL {url!r}: file URLs need an absolute path, file:///root/bucket/prefix/")
        if not path.endswith("/"):
            path += "/"
        _check_relative(path.strip("/"), f"dataset URL {url!r}", InvalidName, allow_empty=True)
        return DatasetURL("file://" + path, "file", path=path)
    raise InvalidName(f"unsupported dataset URL {url!r}: {_URL_HINT}")


# -- shard keys -----------------------------------------------------------------------------------


def _check_relative(path: str, where: str, error: type[Exception], allow_empty: bool = False) -> None:
    if not path:
        if allow_empty:
            return
        raise error(f"{where}: empty key")
    if "\x00" in path or "\\" in path:
        raise error(f"{where}: key {path!r} contains a NUL byte or a backslash")
    if path.startswith("/") or any(part in ("", ".", "..") for part in path.split("/")):
        raise error(f"{where}: key {path!r} must be a plain relative path (no '..', '.', '//' or leading '/')")


def check_key(key: object, where: str = "shard") -> str:
    """A shard key stays inside its dataset prefix: a relative path, no traversal, no NUL."""
    if not isinstance(key, str):
        raise ManifestError(f"{where}: key must be a string, not {type(key).__name__}")
    _check_relative(key, where, ManifestError)
    return key


# -- the manifest ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class ManifestShard:
    """One entry of a manifest; ``xxh3_128`` is lower case."""

    key: str
    size: int | None
    xxh3_128: str | None
    samples: int | None
    members: str | None = None
    """The xxh3-128 of the shard's member index (:mod:`wire.members`), when one was written."""


def parse_manifest(data: bytes, where: str) -> list[ManifestShard]:
    """Validate a version-1 WebDataset manifest; every problem is one clear ManifestError.

    A manifest that lists no shards is an error (:class:`EmptyManifest`): ``shardcache index``
    never writes one, and training on nothing is never what was meant.
    """
    doc = json_object(data, where, "version, format and shards")
    if doc.get("version") != MANIFEST_VERSION:
        raise ManifestError(
            f"{where}: unsupported version {doc.get('version')!r} (this shardcache reads version {MANIFEST_VERSION}; "
            "rebuild it with `shardcache index`)"
        )
    if doc.get("format", MANIFEST_FORMAT) != MANIFEST_FORMAT:
        raise ManifestError(f"{where}: unsupported format {doc.get('format')!r} (this shardcache reads {MANIFEST_FORMAT})")
    entries = doc.get("shards")
    if not isinstance(entries, list):
        raise ManifestError(f"{where}: 'shards' must be a list")
    if not entries:
        raise EmptyManifest(f"{where}: manifest lists no shards; run `shardcache index` on the dataset")
    shards: list[ManifestShard] = []
    seen: set[str] = set()
    for i, entry in enumerate(entries):
        at = f"{where}: shards[{i}]"
        if not isinstance(entry, dict):
            raise ManifestError(f"{at} must be an object")
        key = check_key(entry.get("key"), at)
        if key in seen:
            raise ManifestError(f"{at}: key {key!r} is listed twice")
        seen.add(key)
        size = _opt_count(entry.get("size"), f"{at}.size")
        samples = _opt_count(entry.get("samples"), f"{at}.samples")
        digest = entry.get("xxh3_128")
        if digest is not None and not is_xxh3_128(digest):
            raise ManifestError(f"{at}.xxh3_128 must be 32 hex digits")
        members = entry.get("members_xxh3_128")
        if members is not None and not is_xxh3_128(members):
            raise ManifestError(f"{at}.members_xxh3_128 must be 32 hex digits")
        shards.append(ManifestShard(key, size, digest.lower() if digest else None, samples,
                                    members.lower() if members else None))
    return shards


def json_object(data: bytes, where: str, holding: str, limit: int = MAX_MANIFEST_BYTES) -> dict[str, Any]:
    """An index's document: at most ``limit`` bytes, JSON, an object; else one ManifestError
    saying which."""
    if len(data) > limit:
        raise ManifestError(f"{where}: larger than {limit} bytes")
    try:
        doc = jsontext.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ManifestError(f"{where}: not valid JSON ({exc})") from exc
    if not isinstance(doc, dict):
        raise ManifestError(f"{where}: must be a JSON object with {holding}")
    return doc


def _opt_count(value: Any, where: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ManifestError(f"{where} must be a non-negative integer or null, not {value!r}")
    return value


WIDS_KIND = "wids-shard-index-v1"
"""The ``__kind__`` of a wids shard index (webdataset's ``wids``)."""


def parse_index(data: bytes, where: str, dataset_url: str) -> list[ManifestShard]:
    """A manifest or a wids shard index (told apart by its fields), as manifest entries."""
    head = data[:4096]
    if b'"__kind__"' in head or b'"wids_version"' in head or b'"shardlist"' in head:
        return parse_wids_index(data, where, dataset_url)
    return parse_manifest(data, where)


def parse_wids_index(data: bytes, where: str, dataset_url: str) -> list[ManifestShard]:
    """A wids shard index of the dataset at ``dataset_url`` (where the index lies) as manifest
    entries: key from ``url``, ``samples`` from ``nsamples``, ``size`` from ``filesize``; no
    checksum (wids' ``md5sum`` is not the loader's xxh3-128). Every problem is one ManifestError."""
    doc = json_object(data, where, "a shardlist (a wids shard index)")
    kind = doc.get("__kind__", WIDS_KIND)
    if kind != WIDS_KIND or doc.get("wids_version", 1) != 1:
        raise ManifestError(f"{where}: unsupported wids index (__kind__ {str(kind)[:60]!r}, wids_version "
                            f"{str(doc.get('wids_version'))[:20]!r}); this shardcache reads {WIDS_KIND}, wids_version 1")
    if doc.get("datasets"):
        raise ManifestError(f"{where}: a wids index with sub-datasets ('datasets') is not read here: index each "
                            "dataset prefix on its own (`shardcache index --wids`) and read them separately")
    entries = doc.get("shardlist")
    if not isinstance(entries, list):
        raise ManifestError(f"{where}: 'shardlist' must be a list of {{url, nsamples}} objects")
    if not entries:
        raise EmptyManifest(f"{where}: the wids index lists no shards; run `shardcache index --wids` on the dataset")
    base = doc.get("base")
    if base is not None and (not isinstance(base, str) or base.rstrip("/") + "/" != dataset_url):
        raise ManifestError(f"{where}: its 'base' {str(base)[:200]!r} is not the dataset prefix {dataset_url}: keep "
                            "the index next to its shards")
    shards: list[ManifestShard] = []
    seen: set[str] = set()
    for i, entry in enumerate(entries):
        at = f"{where}: shardlist[{i}]"
        if not isinstance(entry, dict):
            raise ManifestError(f"{at} must be an object")
        url = entry.get("url")
        if not isinstance(url, str) or not url:
            raise ManifestError(f"{at}.url must be the shard's URL, relative to the index")
        if url.startswith(("/", "file:")):  # a local path (wids writes them as given) or file URL
            base = urllib.parse.unquote(urllib.parse.urlsplit(dataset_url).path) if dataset_url.startswith("file:") else None
            path = urllib.parse.unquote(urllib.parse.urlsplit(url).path) if url.startswith("file:") else url
            if base is None or not path.startswith(base):
                raise ManifestError(f"{at}.url {url[:200]!r} is not under the dataset prefix {dataset_url}")
            url = path[len(base):]
        elif "://" in url:
            if not url.startswith(dataset_url):
                raise ManifestError(f"{at}.url {url[:200]!r} is not under the dataset prefix {dataset_url}")
            url = url[len(dataset_url):]
        key = check_key(url, at)
        if key in seen:
            raise ManifestError(f"{at}: shard {key!r} is listed twice")
        seen.add(key)
        samples = _opt_count(entry.get("nsamples"), f"{at}.nsamples")
        if samples is None:
            raise ManifestError(f"{at}.nsamples is required (the shard's sample count)")
        shards.append(ManifestShard(key, _opt_count(entry.get("filesize"), f"{at}.filesize"), None, samples))
    return shards


def wids_index_bytes(shards: list[ManifestShard], name: str | None = None) -> bytes:
    """A wids shard index of ``shards`` (each with its sample count), URLs relative to the prefix."""
    listed = []
    for shard in shards:
        if shard.samples is None:
            raise ManifestError(f"{shard.key}: a wids index needs every shard's sample count")
        item: dict[str, Any] = {"url": shard.key, "nsamples": shard.samples}
        if shard.size is not None:
            item["filesize"] = shard.size
        listed.append(item)
    doc: dict[str, Any] = {"__kind__": WIDS_KIND, "wids_version": 1, "shardlist": listed}
    if name:
        doc["name"] = name
    # One shard per line, as the manifest: diffable, greppable, and still plain JSON.
    head = {k: v for k, v in doc.items() if k != "shardlist"}
    lines = ",\n  ".join(json.dumps(item) for item in listed)
    return (json.dumps(head)[:-1] + ', "shardlist": [\n  ' + lines + "\n]}\n").encode()
