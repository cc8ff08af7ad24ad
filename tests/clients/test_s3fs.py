"""s3fs (fsspec, aiobotocore) through the node daemon: ls, info, find, cat, ranged reads through
``open`` and ``exists`` must report what they report against the origin."""

from __future__ import annotations

from typing import Any

import pytest

from tests.support.client_dataset import BIG_SIZES, MANY, Dataset, MiB, sha256
from tests.support.compare import assert_same

pytestmark = pytest.mark.slow

s3fs = pytest.importorskip("s3fs", reason="s3fs is in the test extra")


def filesystem(url: str) -> Any:
    return s3fs.S3FileSystem(endpoint_url=url, use_listings_cache=False, skip_instance_cache=True,
                             config_kwargs={"s3": {"addressing_style": "path"}, "retries": {"total_max_attempts": 1}})


def views(fs: Any, dataset: Dataset) -> dict[str, Any]:
    b = dataset.bucket
    out: dict[str, Any] = {
        "ls top": fs.ls(b, detail=True),
        "ls odd": fs.ls(f"{b}/odd", detail=True),
        "ls nested": fs.ls(f"{b}/nested/", detail=True),
        "find nested": fs.find(f"{b}/nested", detail=True, withdirs=True),
        "many": len(fs.ls(f"{b}/many")),
        "info": {k: fs.info(f"{b}/{k}") for k in ("odd/with space.txt", "odd/plus+sign.txt", "odd/%41%2F literal escapes.txt", "big/six.bin", "nested/deep")},
        "exists": {k: fs.exists(f"{b}/{k}") for k in ("odd/100% sure.txt", "odd/ünïcödé-日本語.txt", "no/such key", "nested/deep", "odd/with space.txt/")},
        "cat": {o.key: sha256(fs.cat(f"{b}/{o.key}")) for o in dataset.under("odd/")},
        "bucket exists": [fs.exists(b), fs.exists(dataset.missing_bucket)],
    }
    ranges = {}
    for key in BIG_SIZES:
        with fs.open(f"{b}/{key}", "rb", block_size=1 * MiB) as f:
            f.seek(3 * MiB + 17)
            first = f.read(2 * MiB)
            f.seek(-1000, 2)
            ranges[key] = [sha256(first), sha256(f.read())]
    out["ranges"] = ranges
    for name, call in (("cat missing key", lambda: fs.cat(f"{b}/no/such key")), ("ls missing bucket", lambda: fs.ls(dataset.missing_bucket))):
        try:
            call()
            out[name] = "no error"
        except Exception as exc:
            out[name] = type(exc).__name__
    return out


def test_s3fs_matches_origin(dataset: Dataset, origin_url: str, daemon_url: str) -> None:
    direct = views(filesystem(origin_url), dataset)
    assert direct["many"] == MANY
    assert direct["cat"] == {o.key: o.sha for o in dataset.under("odd/")}
    assert direct["cat missing key"] == "FileNotFoundError"
    for _ in range(2):  # misses, then the cache
        assert_same(direct, views(filesystem(daemon_url), dataset))
