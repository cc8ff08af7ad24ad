"""A cache directory is one origin's: reused with another origin (another S3 endpoint, another
``file://`` root) it never answers the first origin's bytes, whatever names the two share."""

from __future__ import annotations

import os

import pytest

from tests.support.daemons import DaemonProcess
from tests.support.s3 import s3_client
from tests.support.waits import wait_until


def _serve(endpoint: str, cache_dir, log) -> DaemonProcess:
    return DaemonProcess(
        ["--origin", "s3", "--s3-endpoint", endpoint, "--cache-dir", str(cache_dir), "--cache-size", "1GiB", "--min-free", "0"],
        log,
    ).start()


def _get(daemon: DaemonProcess, bucket: str, key: str) -> tuple[bytes, str, str]:
    resp = s3_client(daemon.url).get_object(Bucket=bucket, Key=key)
    headers = resp["ResponseMetadata"]["HTTPHeaders"]
    return resp["Body"].read(), headers["x-shardcache-cache"], headers["etag"]


@pytest.mark.slow
def test_a_cache_dir_reused_with_another_origin_never_answers_the_first_origins_bytes(
    s3_server, second_s3_server, tmp_path
):
    bucket = s3_server.new_bucket()
    second_s3_server.client().create_bucket(Bucket=bucket)
    key = "train/0.tar"
    first_body, second_body = os.urandom(100_000), os.urandom(100_000)  # same bucket, key and size
    s3_server.client().put_object(Bucket=bucket, Key=key, Body=first_body)
    second_s3_server.client().put_object(Bucket=bucket, Key=key, Body=second_body)
    cache_dir = tmp_path / "cache"

    daemon = _serve(s3_server.endpoint, cache_dir, tmp_path / "first.log")
    try:
        assert _get(daemon, bucket, key)[:2] == (first_body, "miss")
        wait_until(lambda: daemon.stats()["fills_in_flight"] == 0, what="the fill to be published")
        assert _get(daemon, bucket, key)[:2] == (first_body, "hit")  # cached: the case the bug needs
    finally:
        daemon.stop()

    # The same cache directory, restarted against the second endpoint.
    daemon = _serve(second_s3_server.endpoint, cache_dir, tmp_path / "second.log")
    try:
        second_etag = second_s3_server.client().head_object(Bucket=bucket, Key=key)["ETag"]
        body, cache, etag = _get(daemon, bucket, key)
        assert (body == first_body, body == second_body, cache) == (False, True, "miss")
        assert etag == second_etag
        wait_until(lambda: daemon.stats()["fills_in_flight"] == 0, what="the fill to be published")
        assert _get(daemon, bucket, key)[:2] == (second_body, "hit")  # the second origin's own entry
        head = s3_client(daemon.url).head_object(Bucket=bucket, Key=key)
        assert head["ETag"] == second_etag and head["ContentLength"] == len(second_body)
    finally:
        daemon.stop()
