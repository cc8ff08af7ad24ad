"""The HTTP API of a real master (in this process, on its own thread and event loop, over real
sockets) and the trainer-side client: the contract of docs/master-api.md, and hostile input
answered with a clear 4xx that leaves the state unchanged."""

from __future__ import annotations

import http.client as httpclient
import json
import socket
import threading
import uuid
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest

from loader.master.client import (
    BadRequest,
    JobConflict,
    LeaseLost,
    MasterClient,
    MasterUnavailable,
    NoSuchJob,
    NotLeaseHolder,
)
from tests.support.masters import http, job_spec
from tests.support.processes import free_port
from tests.support.threads import MasterThread
from tests.support.waits import wait_until


def new_job(master: MasterThread, n: int = 8, **extra: Any) -> str:
    name = "job-" + uuid.uuid4().hex[:10]
    status, body = http("POST", master.url + "/v1/jobs", job_spec(name, n, **extra))
    assert status == 201, body
    return name


def durable_view(master: MasterThread, job: str) -> dict[str, Any]:
    """The job's state as seen through the API, without the presence/rate fields that move."""
    status, body = http("GET", f"{master.url}/v1/jobs/{job}")
    assert status == 200, body
    return {k: body[k] for k in ("epoch", "finished", "shards", "failed_shards", "totals")}


def lease_one(master: MasterThread, job: str, trainer: str = "t1") -> dict[str, Any]:
    status, body = http("POST", f"{master.url}/v1/jobs/{job}/leases", {"trainer": trainer, "node": "n1", "count": 1})
    assert status == 200 and body["status"] == "ok", body
    return body["leases"][0]


# -- the contract ------------------------------------------------------------------------------


def test_create_is_idempotent_and_409_on_a_different_spec(inproc_master: MasterThread) -> None:
    name = "job-" + uuid.uuid4().hex[:10]
    status, first = http("POST", inproc_master.url + "/v1/jobs", job_spec(name, 4, epochs=2))
    assert status == 201 and first["name"] == name and first["shards"]["todo"] == 4
    status, again = http("POST", inproc_master.url + "/v1/jobs", job_spec(name, 4, epochs=2))
    assert status == 200 and again["spec"] == first["spec"]
    status, conflict = http("POST", inproc_master.url + "/v1/jobs", job_spec(name, 4, epochs=3))
    assert status == 409 and conflict["error"] == "JobConflict" and conflict["differs"] == ["epochs"]
    status, listing = http("GET", inproc_master.url + "/v1/jobs")
    assert status == 200 and name in [j["name"] for j in listing["jobs"]]


def test_lease_renew_complete_and_status(inproc_master: MasterThread) -> None:
    job = new_job(inproc_master, 3, epochs=1)
    url = f"{inproc_master.url}/v1/jobs/{job}"
    status, answer = http("POST", url + "/leases", {"trainer": "t1", "node": "n1", "count": 2})
    assert status == 200 and answer["status"] == "ok" and len(answer["leases"]) == 2
    first = answer["leases"][0]
    assert first["offset"] == 0 and first["ttl_s"] == 30 and first["samples"] == 10 and first["key"].startswith("train-")
    status, renewed = http("POST", f"{url}/leases/{first['lease']}/renew", {"trainer": "t1", "offset": 4})
    assert (status, renewed) == (200, {"ttl_s": 30.0, "offset": 4})
    status, done = http("POST", f"{url}/leases/{first['lease']}/complete", {"trainer": "t1"})
    assert (status, done) == (200, {"status": "done", "epoch": 0, "already": False})
    # Completing again (a retry after a lost answer) is answered, and counted once.
    status, done = http("POST", f"{url}/leases/{first['lease']}/complete", {"trainer": "t1"})
    assert status == 200 and done["already"] is True
    status, body = http("GET", url)
    assert status == 200
    assert body["shards"] == {"total": 3, "todo": 1, "leased": 1, "done": 1, "failed": 0}
    assert body["trainers"][0]["trainer"] == "t1" and body["trainers"][0]["node"] == "n1"
    assert body["trainers"][0]["leases"] == 1 and body["trainers"][0]["last_seen_s_ago"] < 5
    assert body["samples_per_s"] > 0 and body["totals"]["completed"] == 1


def test_fail_then_failed_after_max_failures(inproc_master: MasterThread) -> None:
    job = new_job(inproc_master, 1, max_failures=2, epochs=1)
    url = f"{inproc_master.url}/v1/jobs/{job}"
    first = lease_one(inproc_master, job)
    status, answer = http("POST", f"{url}/leases/{first['lease']}/fail", {"trainer": "t1", "error": "bad tar"})
    assert (status, answer) == (200, {"shard_state": "todo", "already": False})
    second = lease_one(inproc_master, job, "t2")
    assert second["shard"] == first["shard"]
    status, answer = http("POST", f"{url}/leases/{second['lease']}/fail", {"trainer": "t2", "error": "bad tar"})
    assert answer["shard_state"] == "failed"
    status, body = http("GET", url)
    assert body["finished"] is True and body["failed_shards"][0]["failures"] == 2
    status, answer = http("POST", url + "/leases", {"trainer": "t1", "node": "n1", "count": 1})
    assert answer["status"] == "finished"


def test_wait_while_others_hold_the_last_leases_then_epoch_done(inproc_master: MasterThread) -> None:
    job = new_job(inproc_master, 1, epochs=2)
    url = f"{inproc_master.url}/v1/jobs/{job}"
    held = lease_one(inproc_master, job, "t1")
    status, answer = http("POST", url + "/leases", {"trainer": "t2", "node": "n2", "count": 1, "epoch": 0})
    assert answer["status"] == "wait" and 0 < answer["retry_after_s"] <= 1
    http("POST", f"{url}/leases/{held['lease']}/complete", {"trainer": "t1"})
    status, answer = http("POST", url + "/leases", {"trainer": "t2", "node": "n2", "count": 1, "epoch": 0})
    assert answer["status"] == "epoch_done" and answer["epoch"] == 1


def test_a_long_poll_answers_when_the_last_lease_completes(inproc_master: MasterThread) -> None:
    """``wait_s``: with nothing to hand out the master holds the request, and the completion of the
    last lease of the epoch answers it (not the end of ``wait_s``, nor the next retry hint)."""
    job = new_job(inproc_master, 1, epochs=2, lease_ttl_s=60)
    url = f"{inproc_master.url}/v1/jobs/{job}"
    held = lease_one(inproc_master, job, "t1")
    _, quick = http("POST", url + "/leases", {"trainer": "t2", "node": "n2", "count": 1, "epoch": 0, "wait_s": 0.2})
    assert quick["status"] == "wait" and quick["waited_s"] >= 0.15  # held up to the wait, nothing changed
    polled: list[dict[str, Any]] = []
    poller = threading.Thread(target=lambda: polled.append(
        http("POST", url + "/leases", {"trainer": "t2", "node": "n2", "count": 1, "epoch": 0, "wait_s": 30})[1]))
    poller.start()
    # The master's hint caps a poll at 1 s here (the next expiry is 60 s away): complete while the
    # poll is parked. Without the wake-up it would end at 1 s with "wait" again.
    wait_until(lambda: "shardcache_master_lease_polls_waiting 1.0" in metrics(inproc_master), 10, 0.01,
               "the lease request to be parked")
    assert http("POST", f"{url}/leases/{held['lease']}/complete", {"trainer": "t1"})[0] == 200
    poller.join(10)
    assert polled and polled[0]["status"] == "epoch_done" and polled[0]["epoch"] == 1, polled
    assert polled[0]["waited_s"] < 0.95, polled
    text = metrics(inproc_master)
    assert "shardcache_master_lease_polls_waiting 0.0" in text
    assert "shardcache_master_lease_poll_wait_seconds_count 2.0" in text  # the 0.2 s one, then this one
    # The holds are not request latency: every lease request answered within the 0.1 s bucket.
    route = 'route="/v1/jobs/{job}/leases"'
    count = _sample(text, f"shardcache_master_request_duration_seconds_count{{{route}}}")
    assert _sample(text, f'shardcache_master_request_duration_seconds_bucket{{le="0.1",{route}}}') == count


def test_release_hands_the_shard_out_again_at_once(inproc_master: MasterThread) -> None:
    """A lease given back is re-issued right away (not after its 60 s TTL) at the offset reached;
    the old lease is dead for its holder, and a repeated release is answered, not counted twice."""
    job = new_job(inproc_master, 1, epochs=1, lease_ttl_s=60)
    url = f"{inproc_master.url}/v1/jobs/{job}"
    held = lease_one(inproc_master, job, "t1")
    assert http("POST", f"{url}/leases/{held['lease']}/renew", {"trainer": "t1", "offset": 4})[0] == 200
    release = f"{url}/leases/{held['lease']}/release"
    assert http("POST", release, {"trainer": "t2", "offset": 6})[1]["error"] == "NotLeaseHolder"
    assert http("POST", release, {"trainer": "t1", "offset": 99})[1]["error"] == "BadRequest"  # past samples
    status, answer = http("POST", release, {"trainer": "t1", "offset": 6})
    assert status == 200 and answer == {"shard_state": "todo", "offset": 6, "already": False}
    status, answer = http("POST", release, {"trainer": "t1", "offset": 6})
    assert status == 200 and answer == {"shard_state": "todo", "already": True}
    again = lease_one(inproc_master, job, "t2")
    assert again["shard"] == held["shard"] and again["offset"] == 6
    assert http("POST", f"{url}/leases/{held['lease']}/complete", {"trainer": "t1"})[1]["error"] == "LeaseLost"
    assert http("POST", f"{url}/leases/{again['lease']}/complete", {"trainer": "t2"})[0] == 200
    totals = http("GET", url)[1]["totals"]
    assert totals["released"] == 1 and totals["reissued"] == 1 and totals["completed"] == 1
    other = new_job(inproc_master, 2)
    with MasterClient(inproc_master.url) as client:
        lease = client.lease(other, "t3", "n3")["leases"][0]
        assert client.release(other, lease["lease"], "t3", 0) == "todo"
        with pytest.raises(LeaseLost):
            client.renew(other, lease["lease"], "t3", 1)


def test_lease_request_id_makes_retries_safe(inproc_master: MasterThread) -> None:
    job = new_job(inproc_master, 4)
    body = {"trainer": "t1", "node": "n1", "count": 2, "request_id": "abc-1"}
    _, first = http("POST", f"{inproc_master.url}/v1/jobs/{job}/leases", body)
    _, again = http("POST", f"{inproc_master.url}/v1/jobs/{job}/leases", body)
    assert [g["lease"] for g in again["leases"]] == [g["lease"] for g in first["leases"]]
    assert durable_view(inproc_master, job)["shards"]["leased"] == 2


def metrics(master: MasterThread) -> str:
    status, text = http("GET", master.url + "/metrics")
    assert status == 200
    return str(text)


def _sample(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in the metrics")


def test_operations_endpoints(inproc_master: MasterThread) -> None:
    job = new_job(inproc_master, 2)
    lease_one(inproc_master, job)
    assert http("GET", inproc_master.url + "/healthz") == (200, {"ok": True, "role": "leader"})
    assert http("GET", inproc_master.url + "/readyz")[0] == 200
    status, leader = http("GET", inproc_master.url + "/v1/leader")
    assert status == 200 and leader["role"] == "leader"
    status, text = http("GET", inproc_master.url + "/metrics")
    assert status == 200
    assert 'shardcache_master_requests_total{code="200",route="/v1/jobs/{job}/leases"}' in text
    assert f'shardcache_master_job_shards{{job="{job}",state="leased"}} 1.0' in text
    assert "shardcache_master_commit_duration_seconds_bucket" in text
    assert "shardcache_master_leader 1.0" in text


def test_unix_socket_listener(inproc_master: MasterThread, clients: Callable[..., MasterClient]) -> None:
    sock_path = [a for a in inproc_master.settings.listen if a.startswith("unix://")][0]
    client = clients(sock_path)
    job = new_job(inproc_master, 2)
    assert client.status(job)["shards"]["total"] == 2


# -- hostile input: clear 4xx, state unchanged ---------------------------------------------------


@pytest.mark.parametrize(
    ("path", "body", "code", "error"),
    [
        ("/leases", b"{not json", 400, "BadRequest"),
        ("/leases", b"[1, 2]", 400, "BadRequest"),
        ("/leases", b"", 400, "BadRequest"),
        ("/leases", b"\xff\xfe\x00garbage", 400, "BadRequest"),
        ("/leases", b"[" * 100_000 + b"]" * 100_000, 413, "BodyTooLarge"),
        ("/leases", json.dumps({"trainer": "t9", "node": "n", "count": -1}).encode(), 400, "BadRequest"),
        ("/leases", json.dumps({"trainer": "t9", "node": "n", "count": 0}).encode(), 400, "BadRequest"),
        ("/leases", json.dumps({"trainer": "t9", "node": "n", "count": 5000}).encode(), 400, "BadRequest"),
        ("/leases", json.dumps({"trainer": "t9", "node": "n", "count": "2"}).encode(), 400, "BadRequest"),
        ("/leases", json.dumps({"trainer": "t9", "node": "n", "count": True}).encode(), 400, "BadRequest"),
        ("/leases", json.dumps({"trainer": "t9", "node": "n", "count": 1, "epoch": -3}).encode(), 400, "BadRequest"),
        ("/leases", json.dumps({"trainer": "t9", "node": "n", "count": 1, "wait_s": -1}).encode(), 400, "BadRequest"),
        ("/leases", json.dumps({"trainer": "t9", "node": "n", "count": 1, "wait_s": 1e9}).encode(), 400, "BadRequest"),
        ("/leases", json.dumps({"trainer": "t9", "node": "n", "count": 1, "wait_s": "5"}).encode(), 400, "BadRequest"),
        ("/leases", json.dumps({"trainer": "t9", "node": "n", "count": 1, "wait_s": True}).encode(), 400, "BadRequest"),
        ("/leases", json.dumps({"trainer": "", "node": "n", "count": 1}).encode(), 400, "BadRequest"),
        ("/leases", json.dumps({"trainer": 5, "node": "n", "count": 1}).encode(), 400, "BadRequest"),
        ("/leases", json.dumps({"trainer": "t\x00", "node": "n", "count": 1}).encode(), 400, "BadRequest"),
        ("/leases", json.dumps({"node": "n", "count": 1}).encode(), 400, "BadRequest"),
        ("/leases", json.dumps({"trainer": "t9", "node": "n", "cnt": 1}).encode(), 400, "BadRequest"),
        ("/leases", json.dumps({"trainer": "t9", "node": "n", "count": 1, "x": "y" * 70_000}).encode(), 413, "BodyTooLarge"),
        ("/leases/not!valid/complete", b'{"trainer": "t1"}', 400, "BadRequest"),
        ("/leases/AAAAAAAAAAAAAAAA/complete", b'{"trainer": "t1"}', 409, "LeaseLost"),
        ("/leases/AAAAAAAAAAAAAAAA/renew", b'{"trainer": "t1", "offset": 1}', 409, "LeaseLost"),
        ("/leases/AAAAAAAAAAAAAAAA/fail", b'{"trainer": "t1", "error": "x"}', 409, "LeaseLost"),
        ("/leases/AAAAAAAAAAAAAAAA/release", b'{"trainer": "t1", "offset": 1}', 409, "LeaseLost"),
        ("/leases/AAAAAAAAAAAAAAAA/release", b'{"trainer": "t1", "offset": -1}', 400, "BadRequest"),
        ("/leases/AAAAAAAAAAAAAAAA/release", b'{"trainer": "t1", "offset": "3"}', 400, "BadRequest"),
        ("/leases/AAAAAAAAAAAAAAAA/release", b'{"trainer": "t1", "offset": 1, "why": "x"}', 400, "BadRequest"),
        ("/leases/AAAAAAAAAAAAAAAA/release", b'{"offset": 1}', 400, "BadRequest"),
        ("/leases/AAAAAAAAAAAAAAAA/complete", b"{bad", 400, "BadRequest"),
        ("/leases/AAAAAAAAAAAAAAAA/cancel", b"{}", 404, "NotFound"),
    ],
)
def test_hostile_lease_requests(inproc_master: MasterThread, path: str, body: bytes, code: int, error: str) -> None:
    job = new_job(inproc_master, 4)
    held = lease_one(inproc_master, job)
    before = durable_view(inproc_master, job)
    status, answer = http("POST", f"{inproc_master.url}/v1/jobs/{job}{path}", raw=body)
    assert status == code, answer
    assert answer["error"] == error and answer["message"]
    assert durable_view(inproc_master, job) == before
    # The master still works for well-behaved trainers.
    assert http("POST", f"{inproc_master.url}/v1/jobs/{job}/leases/{held['lease']}/complete", {"trainer": "t1"})[0] == 200


def test_someone_elses_lease_is_403_and_changes_nothing(inproc_master: MasterThread) -> None:
    job = new_job(inproc_master, 2)
    url = f"{inproc_master.url}/v1/jobs/{job}/leases"
    held = lease_one(inproc_master, job, "owner")
    before = durable_view(inproc_master, job)
    for action, body in (
        ("complete", {"trainer": "thief"}),
        ("renew", {"trainer": "thief", "offset": 9}),
        ("fail", {"trainer": "thief", "error": "x"}),
    ):
        status, answer = http("POST", f"{url}/{held['lease']}/{action}", body)
        assert (status, answer["error"]) == (403, "NotLeaseHolder"), answer
    assert durable_view(inproc_master, job) == before
    status, answer = http("POST", f"{url}/{held['lease']}/renew", {"trainer": "owner", "offset": 11})
    assert (status, answer["error"]) == (400, "BadRequest")  # past the shard's 10 samples
    status, answer = http("POST", f"{url}/{held['lease']}/renew", {"trainer": "owner", "offset": -1})
    assert status == 400
    assert durable_view(inproc_master, job) == before


def test_unknown_job_is_404_everywhere(inproc_master: MasterThread) -> None:
    url = f"{inproc_master.url}/v1/jobs/no-such-job"
    assert http("GET", url)[1]["error"] == "NoSuchJob"
    for path, body in (
        ("/leases", {"trainer": "t", "node": "n", "count": 1}),
        ("/leases/AAAAAAAAAAAAAAAA/renew", {"trainer": "t", "offset": 1}),
        ("/leases/AAAAAAAAAAAAAAAA/complete", {"trainer": "t"}),
        ("/leases/AAAAAAAAAAAAAAAA/fail", {"trainer": "t", "error": "e"}),
    ):
        status, answer = http("POST", url + path, body)
        assert (status, answer["error"]) == (404, "NoSuchJob"), answer
    status, answer = http("GET", f"{inproc_master.url}/v1/jobs/..%2F..%2Fetc")
    assert (status, answer["error"]) == (400, "BadRequest")
    status, answer = http("GET", f"{inproc_master.url}/v1/nothing-here")
    assert (status, answer["error"]) == (404, "NotFound")
    status, answer = http("DELETE", f"{inproc_master.url}/v1/jobs")
    assert (status, answer["error"]) == (405, "MethodNotAllowed")


@pytest.mark.parametrize(
    ("spec_change", "fragment"),
    [
        ({"shards": []}, "shards"),
        ({"shards": [{"key": "a"}, {"key": "a"}]}, "twice"),
        ({"shards": [{"key": "a", "size": -1}]}, "size"),
        ({"shards": [{"key": "a", "extra": 1}]}, "shards[0]"),
        ({"name": "bad name!"}, "job name"),
        ({"name": "x" * 200}, "job name"),
        ({"epochs": 0}, "epochs"),
        ({"lease_ttl_s": 0}, "lease_ttl_s"),
        ({"lease_ttl_s": "30"}, "lease_ttl_s"),
        ({"max_failures": 0}, "max_failures"),
        ({"shuffle": "yes"}, "shuffle"),
        ({"seed": 2**70}, "seed"),
        ({"colour": "blue"}, "unknown"),
        ({"dataset": ""}, "dataset"),
    ],
)
def test_hostile_job_specs(inproc_master: MasterThread, spec_change: dict[str, Any], fragment: str) -> None:
    name = "job-" + uuid.uuid4().hex[:10]
    spec = {**job_spec(name, 2), **spec_change}
    status, answer = http("POST", inproc_master.url + "/v1/jobs", spec)
    assert status == 400 and answer["error"] == "BadRequest" and fragment in answer["message"], answer
    assert http("GET", f"{inproc_master.url}/v1/jobs/{name}")[0] in (404, 400)


def test_huge_create_body_and_lying_content_length(inproc_master: MasterThread) -> None:
    limit = inproc_master.settings.max_body_bytes
    name = "job-" + uuid.uuid4().hex[:10]
    spec = job_spec(name, limit // 40)
    status, answer = http("POST", inproc_master.url + "/v1/jobs", spec)
    assert (status, answer["error"]) == (413, "BodyTooLarge")
    assert http("GET", f"{inproc_master.url}/v1/jobs/{name}")[0] == 404
    # A chunked body gives no Content-Length: the limit still holds while reading.
    conn = httpclient.HTTPConnection("127.0.0.1", inproc_master.port, timeout=10)
    try:
        conn.putrequest("POST", f"/v1/jobs/{name}/leases")
        conn.putheader("Transfer-Encoding", "chunked")
        conn.putheader("Content-Type", "application/json")
        conn.endheaders()
        chunk = b"x" * 32768
        try:
            for _ in range(8):
                conn.send(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            conn.send(b"0\r\n\r\n")
        except OSError:
            pass  # the server may answer and close before reading it all
        resp = conn.getresponse()
        assert resp.status == 413 and json.loads(resp.read())["error"] == "BodyTooLarge"
    finally:
        conn.close()


def test_huge_headers_are_refused(inproc_master: MasterThread) -> None:
    with socket.create_connection(("127.0.0.1", inproc_master.port), timeout=10) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 100_000 + b"\r\n\r\n")
        reply = sock.recv(4096)
    assert reply.split(b" ", 2)[1] in (b"400", b"431"), reply[:100]
    assert http("GET", inproc_master.url + "/healthz")[0] == 200


# -- the client --------------------------------------------------------------------------------


def test_client_typed_errors(inproc_master: MasterThread, clients: Callable[..., MasterClient]) -> None:
    client = clients(inproc_master.url)
    name = "job-" + uuid.uuid4().hex[:10]
    status = client.create_job(job_spec(name, 2, epochs=1))
    assert status["name"] == name
    assert client.create_job(job_spec(name, 2, epochs=1))["name"] == name
    with pytest.raises(JobConflict):
        client.create_job(job_spec(name, 3, epochs=1))
    with pytest.raises(NoSuchJob):
        client.status("missing-job")
    with pytest.raises(BadRequest):
        client.lease(name, "t1", "n1", count=0)
    answer = client.lease(name, "t1", "n1", count=1)
    lease = answer["leases"][0]["lease"]
    with pytest.raises(NotLeaseHolder):
        client.complete(name, lease, "t2")
    assert client.renew(name, lease, "t1", 3) == 30.0
    client.complete(name, lease, "t1")
    client.complete(name, lease, "t1")  # idempotent for its holder
    with pytest.raises(LeaseLost):
        client.renew(name, lease, "t1", 4)
    second = client.lease(name, "t1", "n1", count=1)["leases"][0]["lease"]
    assert client.fail(name, second, "t1", "corrupt") == "todo"
    assert isinstance(LeaseLost("x"), Exception) and issubclass(MasterUnavailable, ConnectionError)


def test_client_skips_a_dead_master_in_its_list(inproc_master: MasterThread, clients: Callable[..., MasterClient]) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    client = clients(f"{dead},{inproc_master.url}", retry_deadline_s=10)
    job = new_job(inproc_master, 2)
    assert client.status(job)["name"] == job


def test_client_gives_up_with_master_unavailable(clients: Callable[..., MasterClient]) -> None:
    client = clients(f"http://127.0.0.1:{free_port()}", retry_deadline_s=0.5)
    with pytest.raises(MasterUnavailable, match="no master answered"):
        client.status("anything")


def test_client_is_thread_safe_and_leases_exactly_once(inproc_master: MasterThread) -> None:
    job = new_job(inproc_master, 60, epochs=1)
    client = MasterClient(inproc_master.url)
    completed: list[int] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def trainer(idx: int) -> None:
        try:
            for _ in range(200):
                answer = client.lease(job, f"t{idx}", "n1", count=2)
                if answer["status"] == "finished":
                    return
                for lease in answer["leases"]:
                    client.renew(job, lease["lease"], f"t{idx}", 5)
                    client.complete(job, lease["lease"], f"t{idx}")
                    with lock:
                        completed.append(lease["shard"])
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=trainer, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert sorted(completed) == list(range(60)), Counter(completed).most_common(3)
    status = client.status(job)
    assert status["finished"] and status["shards"]["done"] == 60
    opened = set(client._conns._open)
    assert len(opened) == 9  # one kept-alive connection per thread, this one's included
    client.close()  # ends all nine, not only this thread's
    assert all(conn.sock is None for conn in opened)
