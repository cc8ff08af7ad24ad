"""Reads attributed to jobs (issue 32): a request naming its job (``x-shardcache-job``) counts for
it, by where its bytes came from, in ``/_shardcache/stats`` (``jobs``) and Prometheus
(``shardcache_job_*``); a malformed name is a 400 ``InvalidArgument`` on the S3 and the control
API alike; at most ``MAX_JOBS`` jobs are counted apart, the least recently seen folded into
``(other)``. A daemon in this process on a ``file://`` origin."""

from __future__ import annotations

import http.client
import json
import os
import re
from collections.abc import Callable
from pathlib import Path

import pytest

from sidecar.daemon.jobstats import JobStats
from tests.support.daemons import http_get, make_settings
from tests.support.handles import read_handle
from tests.support.threads import DaemonThread
from wire.nodeplan import JOB_COUNTERS, JOB_HEADER, MAX_JOBS, OTHER_JOB

SIZE = 50_000


@pytest.fixture
def origin(tmp_path: Path) -> Path:
    root = tmp_path / "origin"
    (root / "bkt").mkdir(parents=True)
    for i in range(3):
        (root / "bkt" / f"shard-{i}.tar").write_bytes(os.urandom(SIZE + i))
    return root


@pytest.fixture
def daemon(tmp_path: Path, origin: Path, start_daemon: Callable[..., DaemonThread]) -> DaemonThread:
    return start_daemon(make_settings(tmp_path / "cache", f"file://{origin}", handles=f"unix://{tmp_path}/handles.sock"))


def get(daemon: DaemonThread, path: str, job: str | None, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    return http_get(daemon.url + path, {**({JOB_HEADER: job} if job is not None else {}), **(headers or {})})


def metric(text: str, name: str, **labels: str) -> float | None:
    wanted = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        match = re.fullmatch(rf"{name}\{{(.*)\}} (\S+)", line)
        if match and ",".join(sorted(match.group(1).split(","))) == wanted:
            return float(match.group(2))
    return None


def test_reads_count_for_their_job_by_where_the_bytes_came_from(daemon: DaemonThread, tmp_path: Path):
    assert get(daemon, "/bkt/shard-0.tar", "train-a")[0] == 200  # a miss, filled from the origin
    daemon.settle()
    assert get(daemon, "/bkt/shard-0.tar", "train-a")[0] == 200  # a hit
    status, body = get(daemon, "/bkt/shard-0.tar", "train-a", {"Range": "bytes=10-109"})
    assert status == 206 and len(body) == 100  # a ranged hit: the range counts
    status, body = get(daemon, "/bkt/shard-0.tar", "train-a", {"x-shardcache-short-circuit": "1"})
    assert status == 200 and body == b""  # a path: the whole entry counts, when it is handed out
    assert get(daemon, "/bkt/shard-1.tar", "eval/b")[0] == 200  # another job
    assert get(daemon, "/bkt/shard-2.tar", None)[0] == 200  # no job: counted for none
    reply, data = read_handle(tmp_path / "handles.sock", "bkt", "shard-0.tar", job="train-a")  # a descriptor
    assert len(data) == SIZE and reply["cache"] == "hit"
    assert get(daemon, "/bkt/shard-0.tar", "train-a", {"Range": "bytes=0-0"}) == (206, data[:1])
    daemon.settle()

    jobs = daemon.stats()["jobs"]
    assert jobs == {
        "train-a": {"reads": 6, "hit_bytes": SIZE + 100 + SIZE + SIZE + 1, "origin_bytes": SIZE, "peer_bytes": 0,
                    "prefetch_bytes": 0},
        "eval/b": {"reads": 1, "hit_bytes": 0, "origin_bytes": SIZE + 1, "peer_bytes": 0, "prefetch_bytes": 0},
    }
    text = daemon.metrics()
    assert metric(text, "shardcache_job_served_bytes_total", job="train-a", source="hit") == 3 * SIZE + 101
    assert metric(text, "shardcache_job_served_bytes_total", job="train-a", source="origin") == SIZE
    assert metric(text, "shardcache_job_served_bytes_total", job="eval/b", source="origin") == SIZE + 1
    assert metric(text, "shardcache_job_reads_total", job="train-a") == 6
    assert metric(text, "shardcache_job_prefetch_bytes_total", job="eval/b") == 0


@pytest.mark.parametrize("value", ["", "bad name", "-leading", "x" * 129, "naïve", "a\tb"])
def test_a_malformed_job_is_a_400_on_every_api(daemon: DaemonThread, value: str):
    status, body = get(daemon, "/bkt/shard-0.tar", value)  # the S3 API: S3's XML error
    assert status == 400, body
    assert b"<Code>InvalidArgument</Code>" in body and b"job name is 1-128 characters" in body
    for method, path in (("GET", "/_shardcache/stats"), ("POST", "/_shardcache/prefetch"), ("GET", "/metrics")):
        conn = http.client.HTTPConnection("127.0.0.1", daemon.port, timeout=10)
        try:
            conn.putrequest(method, path)
            conn.putheader(JOB_HEADER, value.encode("utf-8"))
            conn.putheader("Content-Length", "2")
            conn.endheaders(b"{}")
            resp = conn.getresponse()
            answer = json.loads(resp.read())
        finally:
            conn.close()
        assert resp.status == 400 and answer["error"] == "InvalidArgument", (path, answer)
        assert "x-shardcache-job" in answer["message"]
    assert daemon.stats()["jobs"] == {}


def test_two_job_headers_are_refused(daemon: DaemonThread):
    conn = http.client.HTTPConnection("127.0.0.1", daemon.port, timeout=10)
    try:
        conn.putrequest("GET", "/bkt/shard-0.tar")
        conn.putheader(JOB_HEADER, "a")
        conn.putheader(JOB_HEADER, "b")
        conn.endheaders()
        resp = conn.getresponse()
        assert resp.status == 400 and b"one job per request" in resp.read()
    finally:
        conn.close()


def test_a_bad_job_in_a_handle_request_is_refused(daemon: DaemonThread, tmp_path: Path):
    from tests.support.handles import refused

    reply = refused(tmp_path / "handles.sock", "bkt", "shard-0.tar", job="no spaces allowed")
    assert reply["status"] == 400 and "job name" in reply["message"]


def test_more_jobs_than_counted_apart_fold_into_other(daemon: DaemonThread):
    conn = http.client.HTTPConnection("127.0.0.1", daemon.port, timeout=30)
    try:
        for i in range(MAX_JOBS + 10):
            conn.request("GET", "/bkt/shard-0.tar", headers={JOB_HEADER: f"job-{i}", "Range": "bytes=0-9"})
            resp = conn.getresponse()
            assert resp.status == 206 and len(resp.read()) == 10
    finally:
        conn.close()
    daemon.settle()
    jobs = daemon.stats()["jobs"]
    assert len(jobs) == MAX_JOBS + 1 and OTHER_JOB in jobs
    assert "job-0" not in jobs and f"job-{MAX_JOBS + 9}" in jobs  # the least recently seen went first
    assert sum(c["reads"] for c in jobs.values()) == MAX_JOBS + 10  # nothing lost
    assert jobs[OTHER_JOB]["reads"] == 10
    served = [line for line in daemon.metrics().splitlines() if line.startswith("shardcache_job_served_bytes_total{")]
    assert len({re.search(r'job="([^"]*)"', line).group(1) for line in served}) == MAX_JOBS + 1
    assert "shardcache_jobs_folded_total 10.0" in daemon.metrics().splitlines()


def test_job_stats_fold_the_least_recently_seen():
    jobs = JobStats(max_jobs=2)
    jobs.count("a", "reads")
    jobs.served("b", "origin", 10)
    jobs.served("a", "local", 5)  # a seen after b: b goes first
    jobs.served("c", "peer", 7)
    assert jobs.snapshot() == {
        "a": dict.fromkeys(JOB_COUNTERS, 0) | {"reads": 1, "hit_bytes": 5},
        "c": dict.fromkeys(JOB_COUNTERS, 0) | {"peer_bytes": 7},
        OTHER_JOB: dict.fromkeys(JOB_COUNTERS, 0) | {"origin_bytes": 10},
    }
    jobs.count(OTHER_JOB, "reads")  # a reader may name "(other)" itself: counted there, not apart
    assert jobs.snapshot()[OTHER_JOB]["reads"] == 1 and jobs.folded == 1


def test_tenants_naming_one_job_count_apart():
    """Under --auth each (tenant, job) is a row of its own: a tenant sees its own rows (with the
    plan's prefetches for its jobs), the master's report adds a job's rows up, and rows of any
    tenant fold as jobs do."""
    jobs = JobStats(max_jobs=4)
    jobs.served("train", "origin", 10, tenant="role/a")
    jobs.served("train", "local", 4, tenant="role/b")  # b names a's job
    jobs.count("train", "prefetch_bytes", 100)  # the plan's fill for the job: no caller's
    jobs.count("eval", "reads", tenant="role/b")
    zero = dict.fromkeys(JOB_COUNTERS, 0)
    assert jobs.snapshot_of("role/a") == {"train": zero | {"origin_bytes": 10, "prefetch_bytes": 100}}
    assert jobs.snapshot_of("role/b") == {"train": zero | {"hit_bytes": 4, "prefetch_bytes": 100},
                                          "eval": zero | {"reads": 1}}
    assert jobs.snapshot_of("role/c") == {}
    assert jobs.snapshot() == {"train": zero | {"origin_bytes": 10, "hit_bytes": 4, "prefetch_bytes": 100},
                               "eval": zero | {"reads": 1}}
    jobs.count("other", "reads", tenant="role/c")  # a fifth row: a's, the least recently seen, folds
    assert jobs.folded == 1
    assert jobs.snapshot_of("role/a") == {}
    assert jobs.snapshot()[OTHER_JOB]["origin_bytes"] == 10
