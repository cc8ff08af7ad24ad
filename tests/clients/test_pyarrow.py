"""pyarrow's S3FileSystem (the AWS C++ SDK) through the node daemon: file infos from selectors,
random-access reads from open_input_file, and a Parquet data set discovered by listing."""

from __future__ import annotations

from typing import Any

import pytest

from tests.support.client_dataset import BIG_SIZES, MANY, Dataset, MiB, sha256
from tests.support.compare import assert_same

pafs = pytest.importorskip("pyarrow.fs", reason="pyarrow is in the test extra")
ds = pytest.importorskip("pyarrow.dataset")


def filesystem(url: str) -> Any:
    host = url.split("://", 1)[1]
    return pafs.S3FileSystem(access_key="testing", secret_key="testing", session_token="testing", region="us-east-1",
                             endpoint_override=host, scheme="http", allow_bucket_creation=False, retry_strategy=pafs.AwsStandardS3RetryStrategy(max_attempts=1))


def info(i: Any) -> dict[str, Any]:
    return {"path": i.path, "type": str(i.type), "size": i.size, "mtime": i.mtime}


def views(fs: Any, dataset: Dataset) -> dict[str, Any]:
    b = dataset.bucket
    out: dict[str, Any] = {
        "odd": [info(i) for i in fs.get_file_info(pafs.FileSelector(f"{b}/odd"))],
        "nested recursive": [info(i) for i in fs.get_file_info(pafs.FileSelector(f"{b}/nested", recursive=True))],
        "top": [info(i) for i in fs.get_file_info(pafs.FileSelector(b))],
        "many": len(fs.get_file_info(pafs.FileSelector(f"{b}/many"))),
        "paths": [info(i) for i in fs.get_file_info([f"{b}/odd/with space.txt", f"{b}/no/such key", f"{b}/nested/deep", f"{b}/big/six.bin", dataset.missing_bucket])],
    }
    reads = {}
    for key in BIG_SIZES:
        with fs.open_input_file(f"{b}/{key}") as f:
            reads[key] = [f.size(), sha256(f.read_at(2 * MiB, 5 * MiB + 3)), sha256(f.read_at(1000, f.size() - 1000))]
    out["reads"] = reads
    table = ds.dataset(f"{b}/tables/", filesystem=fs, format="parquet").to_table()
    out["table"] = [table.num_rows, sum(table.column("x").to_pylist()), table.schema.names]
    try:
        fs.open_input_file(f"{b}/no/such key")
        out["missing"] = "no error"
    except Exception as exc:
        out["missing"] = type(exc).__name__
    return out


def test_pyarrow_matches_origin(dataset: Dataset, origin_url: str, daemon_url: str) -> None:
    direct = views(filesystem(origin_url), dataset)
    assert direct["many"] == MANY
    assert direct["table"][:2] == [200, sum(range(200))]
    for _ in range(2):
        assert_same(direct, views(filesystem(daemon_url), dataset))
