"""Datasets of WebDataset shards for the tests: random ``.bin`` + ``.cls`` samples packed as tar
shards, uploaded to S3 or written under a ``file://`` origin, and where they were put."""

from __future__ import annotations

import io
import random
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xxhash

__all__ = ["Dataset", "make_shards", "make_tar", "put_dataset", "write_dataset", "xxh3"]


@dataclass
class Dataset:
    """Shards put somewhere: the dataset's URL, its bucket and prefix, the shards' bytes by key."""

    url: str
    bucket: str
    prefix: str
    shards: dict[str, bytes]

    @property
    def total_bytes(self) -> int:
        return sum(len(data) for data in self.shards.values())


def xxh3(data: bytes) -> str:
    return xxhash.xxh3_128_hexdigest(data)


def make_tar(samples: int, member_bytes: int, seed: int, first: int = 0) -> bytes:
    """A WebDataset shard: ``samples`` samples of ``.bin`` + ``.cls`` members (random bytes)."""
    rng = random.Random(seed)
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for n in range(first, first + samples):
            for ext, data in ((".bin", rng.randbytes(member_bytes)), (".cls", str(n % 7).encode())):
                info = tarfile.TarInfo(f"{n:06d}{ext}")
                info.size = len(data)
                info.mtime = 1_700_000_000
                tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


def make_shards(count: int, samples: int = 4, member_bytes: int = 4096, seed: int = 0) -> dict[str, bytes]:
    return {
        f"train-{i:06d}.tar": make_tar(samples, member_bytes, seed * 1000 + i, first=i * samples)
        for i in range(count)
    }


def put_dataset(client: Any, bucket: str, prefix: str, shards: dict[str, bytes]) -> None:
    for key, data in shards.items():
        client.put_object(Bucket=bucket, Key=prefix + key, Body=data)


def write_dataset(directory: Path, shards: dict[str, bytes]) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for key, data in shards.items():
        (directory / key).write_bytes(data)
