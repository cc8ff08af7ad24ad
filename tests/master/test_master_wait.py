"""The trainers' wait for data on a real master (issue 19, master side): ``wait`` reports on renew,
release and complete and on ``POST /v1/jobs/{job}/wait``, the figures the job status and the
metrics show after known reports, the 60 s window ageing out, hostile reports refused with a
400 that changes nothing, and a restarted master starting from zero (the figures are not journaled)."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from loader.master.server.settings import MasterSettings
from tests.support.masters import MasterProcess, http, job_spec
from tests.support.processes import free_port
from tests.support.threads import MasterThread, ServerThread
from wire.stall import WAIT_BUCKETS_S, encode_wait, knows_wait

pytestmark = pytest.mark.timeout(60)


def wait_field(seconds: float, elapsed_s: float, buckets: dict[int, int]) -> dict[str, Any]:
    counts = [buckets.get(i, 0) for i in range(len(WAIT_BUCKETS_S))]
    return encode_wait(seconds, sum(counts), elapsed_s, counts)


def new_job(url: str, n: int = 4, **extra: Any) -> str:
    name = "job-" + uuid.uuid4().hex[:10]
    status, body = http("POST", url + "/v1/jobs", job_spec(name, n, **extra))
    assert status == 201, body
    return name


def lease(url: str, job: str, trainer: str, count: int = 1, **extra: Any) -> list[dict[str, Any]]:
    status, body = http("POST", f"{url}/v1/jobs/{job}/leases", {"trainer": trainer, "node": "n1", "count": count, **extra})
    assert status == 200 and body["status"] == "ok", body
    return list(body["leases"])


def trainer_of(status: dict[str, Any], name: str) -> dict[str, Any]:
    return next(t for t in status["trainers"] if t["trainer"] == name)


def job_status(url: str, job: str) -> dict[str, Any]:
    status, body = http("GET", f"{url}/v1/jobs/{job}")
    assert status == 200, body
    return dict(body)


class ClockMaster(ServerThread):
    """A master in this process whose clock a test moves forward (the window's 60 s without
    waiting 60 s): everything else about it is the real server over real sockets."""

    def __init__(self, settings: MasterSettings) -> None:
        super().__init__("clock-master")
        self.settings = settings
        self.url = f"http://127.0.0.1:{int(settings.listen[0].rsplit(':', 1)[1])}"
        self.skew = 0.0

    def now(self) -> float:
        return time.time() + self.skew

    async def serve(self, stop: asyncio.Event, on_ready: Callable[[], None]) -> None:
        from loader.master.server.app import serve

        await serve(self.settings, stop=stop, on_ready=on_ready, clock=self.now)


@pytest.fixture
def clock_master(tmp_path: Path) -> Iterator[ClockMaster]:
    settings = MasterSettings(listen=(f"tcp://127.0.0.1:{free_port()}",), state=f"sqlite://{tmp_path}/master.db")
    master = ClockMaster(settings).start()
    try:
        yield master
    finally:
        master.stop()


def test_the_master_says_it_takes_wait_reports(inproc_master: MasterThread) -> None:
    status, body = http("GET", inproc_master.url + "/v1/version")
    assert status == 200 and body["api"] == "v1" and knows_wait(body), body


def test_figures_after_known_reports(inproc_master: MasterThread) -> None:
    url = inproc_master.url
    job = new_job(url, 4, epochs=2)
    first, second, third = lease(url, job, "t1", 3)
    base = f"{url}/v1/jobs/{job}/leases"
    # 3 s waited of 10 s over 100 steps: 90 quick ones (<= 1 ms), 9 of at most 50 ms, 1 of 1 s.
    status, body = http("POST", f"{base}/{first['lease']}/renew",
                        {"trainer": "t1", "offset": 2, "wait": wait_field(3.0, 10.0, {0: 90, 3: 9, 6: 1})})
    assert (status, body) == (200, {"ttl_s": 30.0, "offset": 2})
    status, body = http("POST", f"{base}/{first['lease']}/complete",
                        {"trainer": "t1", "wait": wait_field(1.0, 10.0, {0: 50})})
    assert status == 200 and body["status"] == "done", body
    status, body = http("POST", f"{base}/{second['lease']}/release",
                        {"trainer": "t1", "offset": 1, "wait": wait_field(0.0, 5.0, {})})
    assert status == 200 and body["shard_state"] == "todo", body
    # A trainer with no lease reports on its own route; a second trainer too.
    status, body = http("POST", f"{url}/v1/jobs/{job}/wait", {"trainer": "t2", "wait": wait_field(4.0, 5.0, {7: 4})})
    assert (status, body) == (204, None)
    # One in another epoch (the trainer names it): counted there.
    status, body = http("POST", f"{url}/v1/jobs/{job}/wait",
                        {"trainer": "t1", "epoch": 1, "wait": wait_field(0.5, 5.0, {1: 10})})
    assert (status, body) == (204, None)

    doc = job_status(url, job)
    t1 = trainer_of(doc, "t1")["wait"]
    assert t1["seconds"] == 4.5 and t1["steps"] == 160
    assert t1["fraction_60s"] == pytest.approx(4.5 / 30.0, abs=1e-4)
    assert t1["p50_s"] == 0.001 and t1["p99_s"] == 0.05  # the 159th wait of 160 is in the 50 ms bucket
    assert t1["epochs"] == {"0": {"seconds": 4.0, "steps": 150, "fraction": round(4.0 / 25.0, 4)},
                            "1": {"seconds": 0.5, "steps": 10, "fraction": 0.1}}
    t2 = trainer_of(doc, "t2")
    assert t2["leases"] == 0 and t2["last_seen_s_ago"] is not None  # present through its report
    assert t2["wait"]["fraction_60s"] == 0.8 and t2["wait"]["p50_s"] == 5.0  # the (1 s, 5 s] bucket
    assert t2["wait"]["epochs"] == {"0": {"seconds": 4.0, "steps": 4, "fraction": 0.8}}
    assert doc["wait"] == {"fraction_60s": round(8.5 / 35.0, 4), "trainers_waiting": 2}
    # A trainer that never reported has no figures; the third lease's holder is t1 itself.
    assert third["epoch"] == 0

    text = http("GET", url + "/metrics")[1]
    assert f'shardcache_master_wait_seconds_bucket{{job="{job}",le="0.001"}} 140.0' in text
    assert f'shardcache_master_wait_seconds_bucket{{job="{job}",le="1.0"}} 160.0' in text
    assert f'shardcache_master_wait_seconds_bucket{{job="{job}",le="5.0"}} 164.0' in text
    assert f'shardcache_master_wait_seconds_bucket{{job="{job}",le="+Inf"}} 164.0' in text
    assert f'shardcache_master_wait_seconds_count{{job="{job}"}} 164.0' in text
    assert f'shardcache_master_wait_seconds_sum{{job="{job}"}} 8.5' in text
    assert f'shardcache_master_wait_ratio{{job="{job}"}} {round(8.5 / 35.0, 4)}' in text
    assert "# TYPE shardcache_master_wait_seconds histogram" in text
    assert "# TYPE shardcache_master_wait_ratio gauge" in text


def test_a_report_on_a_lost_lease_still_counts(inproc_master: MasterThread) -> None:
    url = inproc_master.url
    job = new_job(url, 2)
    (held,) = lease(url, job, "t1")
    base = f"{url}/v1/jobs/{job}/leases/{held['lease']}"
    assert http("POST", base + "/complete", {"trainer": "t1"})[0] == 200
    # Renewing a completed lease is refused (409); the wait it carries was read and is counted,
    # so the trainer must not send it again.
    status, body = http("POST", base + "/renew", {"trainer": "t1", "offset": 3, "wait": wait_field(1.0, 2.0, {5: 2})})
    assert status == 409 and body["error"] == "LeaseLost", body
    assert trainer_of(job_status(url, job), "t1")["wait"]["steps"] == 2


HOSTILE: list[tuple[Any, str]] = [
    ("soon", "'wait' must be an object"),
    ([], "'wait' must be an object"),
    (None, "'wait' must be an object"),
    ({}, "wait.elapsed_s"),
    ({"seconds": 1, "steps": 1, "elapsed_s": 2, "buckets": [1, 0, 0, 0, 0, 0, 0, 0, 0], "extra": 1}, "unknown 'wait'"),
    ({"seconds": -1, "steps": 0, "elapsed_s": 2, "buckets": [0] * 9}, "wait.seconds"),
    ({"seconds": 1e308, "steps": 0, "elapsed_s": 1e308, "buckets": [0] * 9}, "wait.elapsed_s"),
    ({"seconds": 50, "steps": 0, "elapsed_s": 2, "buckets": [0] * 9}, "cannot exceed"),
    ({"seconds": True, "steps": 0, "elapsed_s": 2, "buckets": [0] * 9}, "wait.seconds"),
    ({"seconds": 1, "steps": "1", "elapsed_s": 2, "buckets": [1] + [0] * 8}, "wait.steps"),
    ({"seconds": 1, "steps": 10**12, "elapsed_s": 2, "buckets": [10**12] + [0] * 8}, "wait.steps"),
    ({"seconds": 1, "steps": 1, "elapsed_s": 2, "buckets": [1] * 8}, "wait.buckets"),
    ({"seconds": 1, "steps": 1, "elapsed_s": 2, "buckets": [-1, 2] + [0] * 7}, "wait.buckets"),
    ({"seconds": 1, "steps": 1, "elapsed_s": 2, "buckets": [1.5] + [0] * 8}, "wait.buckets"),
    ({"seconds": 1, "steps": 1, "elapsed_s": 2, "buckets": "111111111"}, "wait.buckets"),
    ({"seconds": 1, "steps": 5, "elapsed_s": 2, "buckets": [1] + [0] * 8}, "add up to"),
]


@pytest.mark.parametrize(("wait", "says"), HOSTILE, ids=[str(i) for i in range(len(HOSTILE))])
def test_hostile_wait_bodies_are_a_400_that_changes_nothing(inproc_master: MasterThread, wait: Any, says: str) -> None:
    url = inproc_master.url
    job = new_job(url, 2)
    (held,) = lease(url, job, "t1")
    base = f"{url}/v1/jobs/{job}/leases/{held['lease']}"
    for path, body in (
        (base + "/renew", {"trainer": "t1", "offset": 3, "wait": wait}),
        (base + "/release", {"trainer": "t1", "offset": 3, "wait": wait}),
        (base + "/complete", {"trainer": "t1", "wait": wait}),
        (f"{url}/v1/jobs/{job}/wait", {"trainer": "t1", "wait": wait}),
    ):
        status, answer = http("POST", path, body)
        assert status == 400 and answer["error"] == "BadRequest" and says in answer["message"], (path, answer)
    doc = job_status(url, job)
    assert doc["shards"]["leased"] == 1 and doc["totals"]["completed"] == 0 and doc["totals"]["released"] == 0
    assert trainer_of(doc, "t1")["wait"] is None
    # The lease was not renewed either: its offset is still the one it was granted with.
    assert http("POST", base + "/renew", {"trainer": "t1", "offset": 0})[1]["offset"] == 0


def test_the_wait_route_refuses_what_it_cannot_count(inproc_master: MasterThread) -> None:
    url = inproc_master.url
    job = new_job(url, 2)
    good = wait_field(0.1, 1.0, {2: 1})
    route = f"{url}/v1/jobs/{job}/wait"
    cases: list[tuple[Any, int, str]] = [
        ({"trainer": "t1"}, 400, "'wait' is required"),
        ({"wait": good}, 400, "'trainer'"),
        ({"trainer": "", "wait": good}, 400, "'trainer'"),
        ({"trainer": "t\n1", "wait": good}, 400, "'trainer'"),
        ({"trainer": "t1", "epoch": -1, "wait": good}, 400, "'epoch'"),
        ({"trainer": "t1", "epoch": "0", "wait": good}, 400, "'epoch'"),
        ({"trainer": "t1", "wait": good, "node": "n1"}, 400, "unknown field"),
    ]
    for body, code, says in cases:
        status, answer = http("POST", route, body)
        assert status == code and says in answer["message"], (body, answer)
    status, answer = http("POST", route, raw=b"{not json")
    assert status == 400 and answer["error"] == "BadRequest", answer
    status, answer = http("POST", f"{url}/v1/jobs/no-such-job/wait", {"trainer": "t1", "wait": good})
    assert status == 404 and answer["error"] == "NoSuchJob", answer
    # `wait` rides only on renew, release and complete: fail refuses it as any unknown field.
    (held,) = lease(url, job, "t1")
    status, answer = http("POST", f"{url}/v1/jobs/{job}/leases/{held['lease']}/fail",
                          {"trainer": "t1", "error": "x", "wait": good})
    assert status == 400 and "unknown field" in answer["message"], answer
    assert job_status(url, job)["wait"] == {"fraction_60s": None, "trainers_waiting": 0}


def test_the_60s_window_ages_out_and_the_totals_stay(clock_master: ClockMaster) -> None:
    url = clock_master.url
    job = new_job(url, 2)
    route = f"{url}/v1/jobs/{job}/wait"
    assert http("POST", route, {"trainer": "t1", "wait": wait_field(2.5, 5.0, {6: 3})})[0] == 204
    assert trainer_of(job_status(url, job), "t1")["wait"]["fraction_60s"] == 0.5
    clock_master.skew += 30.0
    assert http("POST", route, {"trainer": "t1", "wait": wait_field(0.0, 5.0, {0: 7})})[0] == 204
    doc = job_status(url, job)
    assert trainer_of(doc, "t1")["wait"]["fraction_60s"] == 0.25 and doc["wait"]["trainers_waiting"] == 1
    clock_master.skew += 31.0  # the first report is now 61 s old: out of the window
    doc = job_status(url, job)
    wait = trainer_of(doc, "t1")["wait"]
    assert wait["fraction_60s"] == 0.0 and doc["wait"] == {"fraction_60s": 0.0, "trainers_waiting": 0}
    assert wait["seconds"] == 2.5 and wait["steps"] == 10  # the totals do not age
    clock_master.skew += 60.0  # nothing reported in the last 60 s: no share to tell
    assert trainer_of(job_status(url, job), "t1")["wait"]["fraction_60s"] is None
    assert f'shardcache_master_wait_ratio{{job="{job}"}} 0.0' in http("GET", url + "/metrics")[1]


def test_a_restarted_master_starts_from_zero_and_auth_guards_the_route(tmp_path: Path,
                                                                        master_procs: list[MasterProcess]) -> None:
    token = tmp_path / "token"
    token.write_text("wait-token-0123456789\n")
    auth = {"Authorization": "Bearer wait-token-0123456789"}
    master = MasterProcess(tmp_path, f"sqlite://{tmp_path}/m.db", "--token-file", str(token))
    master_procs.append(master)
    master.start()
    name = "job-" + uuid.uuid4().hex[:10]
    assert http("POST", master.url + "/v1/jobs", job_spec(name, 2), headers=auth)[0] == 201
    body = {"trainer": "t1", "wait": wait_field(1.0, 2.0, {4: 1})}
    status, answer = http("POST", f"{master.url}/v1/jobs/{name}/wait", body)
    assert status == 401 and answer["error"] == "Unauthorized", answer
    assert http("POST", f"{master.url}/v1/jobs/{name}/wait", body, headers=auth)[0] == 204
    doc = http("GET", f"{master.url}/v1/jobs/{name}", headers=auth)[1]
    assert trainer_of(doc, "t1")["wait"]["steps"] == 1
    master.stop()
    master.start()
    doc = http("GET", f"{master.url}/v1/jobs/{name}", headers=auth)[1]
    assert doc["trainers"] == [] and doc["wait"] == {"fraction_60s": None, "trainers_waiting": 0}
