"""Small WebDataset image datasets with real JPEGs (Pillow), for ``shardcache demo`` and tests.

Each sample is ``{key}.jpg`` (a real JPEG: a seeded colour gradient with noise, so it compresses
like a photo rather than like random bytes) and ``{key}.cls`` (its class as ASCII digits).
"""

from __future__ import annotations

import io
import random
import tarfile
from dataclasses import dataclass
from pathlib import Path

__all__ = ["DatasetSpec", "jpeg_bytes", "write_image_dataset", "write_shard"]


@dataclass(frozen=True)
class DatasetSpec:
    shards: int = 16
    """Number of tar shards."""

    samples_per_shard: int = 64
    """Samples in each shard."""

    image_size: int = 96
    """Width and height of each JPEG, in pixels."""

    classes: int = 10
    """Number of distinct class labels."""

    seed: int = 0
    """Everything generated follows from this seed."""


def jpeg_bytes(rng: random.Random, size: int, quality: int = 85) -> bytes:
    """A seeded colour gradient with grain: compresses like a photo, not like random bytes."""
    from PIL import (  # imported here: only the demo and tests make images
        Image,
        ImageChops,
    )

    gradient = Image.linear_gradient("L").resize((size, size))
    channels = []
    for _ in range(3):
        offset = rng.randrange(256)
        channel = gradient.rotate(rng.uniform(0, 360)).point(lambda v, o=offset: (v + o) % 256)
        grain = Image.frombytes("L", (size, size), rng.randbytes(size * size)).point(lambda v: v // 8)
        channels.append(ImageChops.add(channel, grain))
    out = io.BytesIO()
    Image.merge("RGB", channels).save(out, format="JPEG", quality=quality)
    return out.getvalue()


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mtime = 1_700_000_000  # fixed: the same spec always gives the same bytes
    info.mode = 0o644
    tar.addfile(info, io.BytesIO(data))


def write_shard(path: Path, first_sample: int, spec: DatasetSpec, rng: random.Random) -> list[str]:
    """Write one shard atomically-enough for a demo (temp + rename); returns its sample keys."""
    keys: list[str] = []
    tmp = path.with_suffix(".tmp")
    with tarfile.open(tmp, "w", format=tarfile.USTAR_FORMAT) as tar:
        for n in range(first_sample, first_sample + spec.samples_per_shard):
            key = f"{n:08d}"
            _add(tar, f"{key}.jpg", jpeg_bytes(rng, spec.image_size))
            _add(tar, f"{key}.cls", str(rng.randrange(spec.classes)).encode())
            keys.append(key)
    tmp.replace(path)
    return keys


def write_image_dataset(directory: Path, spec: DatasetSpec = DatasetSpec(), name: str = "train") -> dict[str, list[str]]:
    """``{directory}/{name}-000000.tar ...``; returns shard file name → the sample keys in it."""
    directory.mkdir(parents=True, exist_ok=True)
    rng = random.Random(spec.seed)
    shards: dict[str, list[str]] = {}
    for i in range(spec.shards):
        shard = f"{name}-{i:06d}.tar"
        shards[shard] = write_shard(directory / shard, i * spec.samples_per_shard, spec, rng)
    return shards
