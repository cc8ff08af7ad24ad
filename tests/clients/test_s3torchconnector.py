"""s3torchconnector (the AWS CRT client PyTorch users read S3 with) through the node daemon:
S3IterableDataset.from_prefix lists and reads every object, and S3Reader seeks and reads
ranges, as against the origin."""

from __future__ import annotations

import re
from typing import Any

import pytest

from tests.support.client_dataset import MANY, Dataset, MiB, sha256
from tests.support.compare import assert_same

pytestmark = pytest.mark.slow

s3tc = pytest.importorskip("s3torchconnector", reason="s3torchconnector is in the bench extra")

CONFIG = s3tc.S3ClientConfig(force_path_style=True, max_attempts=1)


def content(reader: Any) -> str:
    """The object's hash, or the S3 error code the CRT client reported for it."""
    try:
        return sha256(reader.read())
    except Exception as exc:
        found = re.search(r"<Code>(\w+)</Code>|response_status: (\d+)", str(exc))
        return f"error {found.group(1) or found.group(2) if found else type(exc).__name__}"


def views(url: str, dataset: Dataset) -> dict[str, Any]:
    b = dataset.bucket
    out: dict[str, Any] = {}
    for prefix in ("odd/", "nested/", "many/"):
        data = s3tc.S3IterableDataset.from_prefix(f"s3://{b}/{prefix}", region="us-east-1", endpoint=url, s3client_config=CONFIG)
        out[prefix] = sorted((r.key, content(r)) for r in data)
    ranges = {}
    data = s3tc.S3MapDataset.from_objects([f"s3://{b}/big/seventeen.bin", f"s3://{b}/big/six.bin"], region="us-east-1", endpoint=url, s3client_config=CONFIG)
    for i in range(len(data)):
        reader = data[i]
        reader.seek(5 * MiB + 1)
        middle = reader.read(3 * MiB)
        reader.seek(-100, 2)
        ranges[reader.key] = [sha256(middle), sha256(reader.read()), reader.tell()]
    out["ranges"] = ranges
    missing = s3tc.S3MapDataset.from_objects([f"s3://{b}/no/such key", f"s3://{dataset.missing_bucket}/k"], region="us-east-1", endpoint=url, s3client_config=CONFIG)
    out["missing"] = [content(missing[i]) for i in range(len(missing))]
    return out


def test_s3torchconnector_matches_origin(dataset: Dataset, origin_url: str, daemon_url: str) -> None:
    direct = views(origin_url, dataset)
    assert len(direct["many/"]) == MANY
    assert direct["odd/"] == sorted((o.key, o.sha) for o in dataset.under("odd/"))
    for _ in range(2):
        assert_same(direct, views(daemon_url, dataset))
