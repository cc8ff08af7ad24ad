"""Datasets as the trainer side sees them: :mod:`wire.dataset`'s URL and manifest rules, with
their errors as the loader's (``ConfigError`` for a URL, ``ManifestError`` for a manifest,
``DatasetNotFound`` for a manifest that lists no shards), and the loader's :class:`Shard`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from loader.errors import ConfigError, DatasetNotFound, ManifestError
from wire import dataset as wire_dataset
from wire.dataset import MANIFEST_NAME, MAX_MANIFEST_BYTES, DatasetURL
from wire.errors import EmptyManifest, InvalidName
from wire.errors import ManifestError as WireManifestError

__all__ = ["DatasetURL", "Shard", "parse_dataset_url", "check_key", "parse_manifest", "parse_index", "MANIFEST_NAME",
           "MAX_MANIFEST_BYTES"]


@dataclass(frozen=True)
class Shard:
    """One shard of a dataset. ``index`` is its position in the dataset's sorted shard list."""

    index: int
    key: str
    size: int | None = None
    xxh3_128: str | None = None
    samples: int | None = None
    etag: str | None = None
    members: str | None = None
    """The xxh3-128 of the shard's member index (``<key>.members.json``, :mod:`wire.members`) as
    the manifest pins it; None when the dataset has none."""

    def spec(self) -> dict[str, Any]:
        """The shard as the master's job spec lists it."""
        return {"key": self.key, "size": self.size, "samples": self.samples}


def parse_dataset_url(url: str) -> DatasetURL:
    """``s3://bucket/prefix/`` or ``file:///abs/root/bucket/prefix/`` → :class:`DatasetURL`."""
    try:
        return wire_dataset.parse_dataset_url(url)
    except InvalidName as exc:
        raise ConfigError(str(exc)) from None


def check_key(key: str, where: str = "shard") -> str:
    """A shard key must stay inside its dataset prefix: relative, no traversal, no NUL."""
    try:
        return wire_dataset.check_key(key, where)
    except WireManifestError as exc:
        raise ManifestError(str(exc)) from None


def parse_manifest(data: bytes, where: str) -> list[Shard]:
    """Validate a version-1 WebDataset manifest; every problem is one clear ManifestError (and
    one that lists no shards a DatasetNotFound: there is nothing to train on)."""
    try:
        entries = wire_dataset.parse_manifest(data, where)
    except EmptyManifest as exc:
        raise DatasetNotFound(str(exc)) from None
    except WireManifestError as exc:
        raise ManifestError(str(exc)) from None
    return [Shard(i, e.key, e.size, e.xxh3_128, e.samples, members=e.members) for i, e in enumerate(entries)]


def parse_index(data: bytes, where: str, location: DatasetURL) -> list[Shard]:
    """A manifest or a wids shard index (``wids-shard-index-v1``) of the dataset at ``location``."""
    try:
        entries = wire_dataset.parse_index(data, where, location.url)
    except EmptyManifest as exc:
        raise DatasetNotFound(str(exc)) from None
    except WireManifestError as exc:
        raise ManifestError(str(exc)) from None
    return [Shard(i, e.key, e.size, e.xxh3_128, e.samples, members=e.members) for i, e in enumerate(entries)]
