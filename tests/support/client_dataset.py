"""The data set every client test reads, and the small helpers the comparisons share.

The keys are the ones S3 clients get wrong: spaces, ``+`` (which form encoding turns into a
space), ``%`` and a literal ``%41`` (which a second decoding turns into ``A``), unicode, S3's
other legal punctuation, a nested prefix, more than 1,000 keys under one prefix (every listing
takes a second page) and a few objects large enough that the clients split them into ranged GETs.
Objects carry a Content-Type, user metadata and Cache-Control, which a client must see unchanged.
"""

from __future__ import annotations

import hashlib
import io
import random
import uuid
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

__all__ = ["BIG_SIZES", "Dataset", "MANY", "MiB", "NESTED_KEYS", "ODD_KEYS", "Obj", "TAR", "TEXT", "build_objects", "parquet_parts", "sha256", "upload"]

MiB = 1024 * 1024
# More than S3's page of 1,000 keys: a listing of this prefix needs a continuation token / marker.
MANY = 1050

ODD_KEYS = (
    "odd/with space.txt",
    "odd/plus+sign.txt",
    "odd/100% sure.txt",
    "odd/%41%2F literal escapes.txt",
    "odd/ünïcödé-日本語.txt",
    "odd/a=b&c~d!(e)'f*g,h;i$j@k.txt",
    "odd/space at end .txt",
)
NESTED_KEYS = ("nested/top.txt", "nested/deep/er/leaf.txt", "nested/deep/sibling.txt")
BIG_SIZES = {"big/six.bin": 6 * MiB, "big/seventeen.bin": 17 * MiB}
TEXT = "text/plain; charset=utf-8"
TAR = "application/x-tar"


@dataclass(frozen=True)
class Obj:
    key: str
    data: bytes
    content_type: str | None = None
    metadata: dict[str, str] = field(default_factory=dict)
    cache_control: str | None = None

    @property
    def sha(self) -> str:
        return sha256(self.data)


@dataclass(frozen=True)
class Dataset:
    bucket: str
    objects: dict[str, Obj]
    # a bucket that does not exist, for the error comparisons
    missing_bucket: str = "no-such-bucket-" + uuid.uuid4().hex[:8]

    def under(self, prefix: str) -> list[Obj]:
        return [o for k, o in sorted(self.objects.items()) if k.startswith(prefix)]


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def build_objects() -> list[Obj]:
    rng = random.Random(12)
    objects = [
        Obj(k, f"{k}\n".encode() * 3, TEXT, {"purpose": "client-test", "index": str(i)}, "max-age=3600")
        for i, k in enumerate(ODD_KEYS)
    ]
    objects += [Obj(k, rng.randbytes(100 + i), "application/octet-stream", {"level": str(k.count("/"))}) for i, k in enumerate(NESTED_KEYS)]
    # The small keys carry no headers of their own: the origin's defaults must come through too.
    objects += [Obj(f"many/k-{i:05d}", rng.randbytes(16 + i % 64)) for i in range(MANY)]
    objects += [Obj(k, rng.randbytes(n), TAR, {"shard": k}, "no-cache") for k, n in BIG_SIZES.items()]
    # A folder marker, as the S3 console, s3fs and rclone create them: a key ending in "/".
    objects.append(Obj("nested/marker/", b"", "application/x-directory"))
    objects += parquet_parts()
    return objects


def parquet_parts() -> list[Obj]:
    """A two-file Parquet data set for the table readers (pyarrow.dataset, duckdb)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    parts = []
    for part in range(2):
        table = pa.table({"x": list(range(part * 100, part * 100 + 100)), "name": [f"row {i} ü" for i in range(100)]})
        sink = io.BytesIO()
        pq.write_table(table, sink)
        parts.append(Obj(f"tables/part-{part}.parquet", sink.getvalue(), "application/vnd.apache.parquet"))
    return parts


def upload(client: Any, bucket: str, objects: Iterable[Obj]) -> None:
    def put(obj: Obj) -> None:
        extra: dict[str, Any] = {"Metadata": obj.metadata}
        if obj.content_type:
            extra["ContentType"] = obj.content_type
        if obj.cache_control:
            extra["CacheControl"] = obj.cache_control
        client.put_object(Bucket=bucket, Key=obj.key, Body=obj.data, **extra)

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(put, objects))
