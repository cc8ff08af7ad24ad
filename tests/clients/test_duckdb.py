"""duckdb's httpfs extension through the node daemon: globbing (ListObjectsV2), Parquet reads
(ranged GETs) and read_blob of the odd keys must give the origin's rows.

httpfs is an extension duckdb downloads on first use; offline machines get it from the
``duckdb-ext-httpfs`` wheel (test extra), whose directory this points duckdb at. Without it the
test skips and says so."""

from __future__ import annotations

import os
from typing import Any

import pytest

from tests.support.client_dataset import Dataset
from tests.support.compare import assert_same, scrub

pytestmark = pytest.mark.slow

duckdb = pytest.importorskip("duckdb", reason="duckdb is in the test extra")


def connect(url: str) -> Any:
    con = duckdb.connect()
    try:
        import duckdb_ext  # the duckdb-ext-httpfs wheel: extensions/<version>/<platform>/httpfs.duckdb_extension

        con.execute(f"SET extension_directory = '{os.path.join(list(duckdb_ext.__path__)[0], 'extensions')}'")
    except ImportError:
        pass
    try:
        con.execute("LOAD httpfs")
    except duckdb.Error as exc:
        pytest.skip(f"duckdb's httpfs extension cannot be loaded offline: {exc}")
    con.execute(f"""CREATE SECRET (TYPE s3, KEY_ID 'testing', SECRET 'testing', SESSION_TOKEN 'testing', REGION 'us-east-1',
                    ENDPOINT '{url.split("://", 1)[1]}', URL_STYLE 'path', USE_SSL false)""")
    return con


def views(url: str, dataset: Dataset) -> dict[str, Any]:
    con, b = connect(url), dataset.bucket
    out: dict[str, Any] = {
        "glob odd": con.execute(f"SELECT file FROM glob('s3://{b}/odd/*') ORDER BY file").fetchall(),
        "glob many": con.execute(f"SELECT count(*) FROM glob('s3://{b}/many/*')").fetchall(),
        "parquet": con.execute(f"SELECT count(*), sum(x), min(name) FROM read_parquet('s3://{b}/tables/*.parquet')").fetchall(),
        "blobs": con.execute(f"SELECT filename, size, md5(content), last_modified FROM read_blob('s3://{b}/odd/*') ORDER BY filename").fetchall(),
        "nested": con.execute(f"SELECT filename, size FROM read_blob('s3://{b}/nested/**') ORDER BY filename").fetchall(),
    }
    for name, sql in (("missing key", f"SELECT * FROM read_blob('s3://{b}/no/such key')"), ("missing bucket", f"SELECT * FROM glob('s3://{dataset.missing_bucket}/*')")):
        try:
            out[name] = con.execute(sql).fetchall()
        except duckdb.Error as exc:
            # lower case: moto's reason phrases are werkzeug's ("NOT FOUND"), S3's and the daemon's "Not Found"
            out[name] = [type(exc).__name__, scrub(str(exc), url).lower()]
    return out


def test_duckdb_httpfs_matches_origin(dataset: Dataset, origin_url: str, daemon_url: str) -> None:
    direct = views(origin_url, dataset)
    assert len(direct["glob odd"]) == len(dataset.under("odd/"))
    assert direct["parquet"][0][:2] == (200, sum(range(200)))
    for _ in range(2):
        assert_same(direct, views(daemon_url, dataset))
