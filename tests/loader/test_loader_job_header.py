"""The loader names its job to the cache (issue 32): a ShardLoader with ``job=`` sends
``x-shardcache-job`` on every request to its daemon, which counts the job's reads
(``/_shardcache/stats`` ``jobs``); a reader without a job sends nothing. Real ``shardcache serve``
and ``shardcache master`` processes."""

from __future__ import annotations

import json
import logging
import urllib.request
from typing import Any

from loader import LoaderSettings, ShardLoader
from loader.daemon import DaemonClient
from tests.support.shards import Written


def jobs_of(endpoint: str) -> dict[str, Any]:
    with urllib.request.urlopen(endpoint + "/_shardcache/stats", timeout=10) as resp:
        jobs: dict[str, Any] = json.loads(resp.read())["jobs"]
    return jobs


def test_a_loader_with_a_job_names_it_on_its_reads(dataset: tuple[str, Written], master: str, start_daemon: Any) -> None:
    url, written = dataset
    root = url[len("file://"):].split("/bkt/")[0]
    endpoint = start_daemon(f"file://{root}")
    static = list(ShardLoader(url, endpoint=endpoint, shuffle=False))  # no job: counted for none
    assert len(static) == written.total()
    assert jobs_of(endpoint) == {}
    samples = list(ShardLoader(url, job="resnet-7", master=master, epochs=1, endpoint=endpoint))
    assert len(samples) == written.total()
    jobs = jobs_of(endpoint)
    assert set(jobs) == {"resnet-7"}
    counted = jobs["resnet-7"]
    assert counted["reads"] >= len(written.keys)  # every shard read through the daemon, for the job
    shard_bytes = sum((written.root / key).stat().st_size for key in written.keys)
    assert counted["hit_bytes"] >= shard_bytes  # cached by the static pass: every byte a hit


def test_a_job_the_daemon_would_refuse_is_not_sent(caplog: Any) -> None:
    with caplog.at_level(logging.WARNING, logger="loader.daemon"):
        client = DaemonClient("http://127.0.0.1:1", LoaderSettings(), job="has spaces")
    assert client._job_headers == {} and "not naming job 'has spaces'" in caplog.text
    assert DaemonClient("http://127.0.0.1:1", LoaderSettings(), job="ok.job")._job_headers == {"x-shardcache-job": "ok.job"}
