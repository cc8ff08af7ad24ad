"""Test data for the loader: WebDataset shards written by the ``webdataset`` package, manifests,
and the bookkeeping to compare what a loader yields with what was written."""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import xxhash

__all__ = ["Expected", "Written", "delivered", "env_without_shardcache", "member_table", "write_manifest",
           "write_shards"]

Expected = dict[tuple[str, str], dict[str, bytes]]


@dataclass
class Written:
    """Shards on disk and what a reader must yield from them."""

    root: Path  # the directory holding the shards
    keys: list[str]  # shard keys in sorted order
    samples: Expected = field(default_factory=dict)  # (shard key, sample key) -> fields
    order: dict[str, list[str]] = field(default_factory=dict)  # shard key -> sample keys in order

    def total(self) -> int:
        return len(self.samples)


def write_shards(
    directory: Path, shards: int = 4, per_shard: int = 10, seed: int = 0, prefix: str = "train", sizes: tuple[int, int] = (10, 3000)
) -> Written:
    """Write shards with ``webdataset.ShardWriter`` (its default encoder: ints, dicts, strings)."""
    import webdataset as wds

    directory.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    written = Written(directory, [])
    pattern = str(directory / f"{prefix}-%06d.tar")
    with wds.ShardWriter(pattern, maxcount=per_shard, verbose=0) as writer:
        for i in range(shards * per_shard):
            key = f"{seed:03d}{i:06d}"
            payload = rng.randbytes(rng.randint(*sizes))
            label = i % 7
            meta = {"i": i, "seed": seed}
            writer.write({"__key__": key, "jpg": payload, "cls": label, "json": meta})
            shard_key = f"{prefix}-{i // per_shard:06d}.tar"
            written.samples[(shard_key, key)] = {
                "jpg": payload,
                "cls": str(label).encode(),
                "json": json.dumps(meta).encode(),
            }
            written.order.setdefault(shard_key, []).append(key)
    written.keys = sorted(written.order)
    return written


def write_manifest(written: Written, *, hashes: bool = True, samples: bool = True, name: str = "manifest.json",
                   members: bool = False) -> dict[str, Any]:
    """The dataset's manifest; with ``members``, each shard's member index next to it
    (``<key>.members.json``, as ``shardcache index --members`` writes it), pinned in its entry."""
    entries = []
    for key in written.keys:
        data = (written.root / key).read_bytes()
        entry: dict[str, Any] = {"key": key, "size": len(data)}
        if hashes:
            entry["xxh3_128"] = xxhash.xxh3_128_hexdigest(data)
        entry["samples"] = len(written.order[key]) if samples else None
        if members:
            from loader.members import index_shard, members_key
            from wire.members import members_bytes

            doc_bytes = members_bytes(index_shard(data, key))
            (written.root / members_key(key)).write_bytes(doc_bytes)
            entry["members_xxh3_128"] = xxhash.xxh3_128_hexdigest(doc_bytes)
        entries.append(entry)
    doc = {"version": 1, "format": "webdataset", "shards": entries}
    (written.root / name).write_text(json.dumps(doc))
    return doc


def delivered(samples: list[dict[str, Any]]) -> Expected:
    """Samples as yielded by a loader, keyed like :class:`Written` (fails on a duplicate)."""
    out: Expected = {}
    for sample in samples:
        ident = (sample["__url__"].rsplit("/", 1)[-1], sample["__key__"])
        assert ident not in out, f"duplicate sample {ident}"
        out[ident] = {k: v for k, v in sample.items() if not k.startswith("__")}
    return out


def env_without_shardcache() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("SHARDCACHE_")}


def member_table(path: Path) -> Any:
    """The member table (``loader.tarindex.TarIndex``) of the shard at ``path``, recorded by one
    parse of it, as a first read in the loader records it."""
    from loader import iter_samples
    from loader.tar import MemberLog
    from loader.tarindex import TarIndex

    members = MemberLog()
    with open(path, "rb", buffering=0) as handle:
        for _ in iter_samples(handle, log=members):
            pass
    table = TarIndex.from_log(members, path.stat().st_size)
    assert table is not None
    return table
