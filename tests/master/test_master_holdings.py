"""Node daemons' reports of what they cache (issue 32, master side): ``Holdings`` events in the pure
state machine (holders set and cleared, full and delta, journaled and replayed, snapshots), leases
that prefer a shard the trainer's node reported held, and ``POST /v1/nodes/{node}/report`` against
a real master: its plan, ``resend: "full"`` for a delta it cannot apply, hostile bodies (4xx, never
500), the operator-only rule, and the per-node ``cache`` view of the job status and /metrics."""

from __future__ import annotations

import http.client as httpclient
import json
import uuid
from array import array
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from loader.master.errors import BadRequest
from loader.master.server.events import Complete, CreateJob, Holdings, Lease, event_from_json, event_to_text
from loader.master.server.settings import MasterSettings
from loader.master.server.spec import JobSpec, ShardSpec
from loader.master.server.state import MasterState
from tests.support.masters import MasterProcess, http, job_spec
from tests.support.processes import free_port
from tests.support.threads import MasterThread
from wire.nodeplan import MAX_REPORT_BYTES, NodeReport, name_hash, pack_hashes, parse_plan, unpack_hashes
from wire.shuffle import EpochOrder

BUCKET, PREFIX = "bucket", "train/"


def h(i: int, key: str = "shard-{:05d}.tar") -> int:
    """The hash a daemon reports shard ``i`` of the state-machine jobs under."""
    return name_hash(BUCKET, PREFIX + key.format(i))


def hs(*shards: int) -> tuple[int, ...]:
    return tuple(h(i) for i in shards)


class Driver:
    """One windowed job in the pure state machine, every mutating event logged as a store would."""

    def __init__(self, n: int = 64, window: int = 16, epochs: int = 3, name: str = "job") -> None:
        self.state = MasterState()
        self.now = 100.0
        self.ids = 0
        self.log: list[tuple[Any, float]] = []
        shards = tuple(ShardSpec(f"shard-{i:05d}.tar", 1000, 10) for i in range(n))
        self.spec = JobSpec(name, f"s3://{BUCKET}/{PREFIX}", shards, epochs, 7, True, 60.0, 3, window)
        self.apply(CreateJob(self.spec))

    def apply(self, event: Any) -> dict[str, Any]:
        result = self.state.apply(event, self.now)
        if result.mutated:
            self.log.append((result.record, result.now))
        return result.answer

    def lease(self, node: str, trainer: str | None = None) -> dict[str, Any] | None:
        self.ids += 1
        answer = self.apply(Lease(self.spec.name, trainer or f"t-{node}", node, 1, None, (f"lease{self.ids:08d}",)))
        return answer["leases"][0] if answer["status"] == "ok" else None

    def holders(self) -> list[str | None]:
        loc = self.state.jobs[self.spec.name].locality
        assert loc is not None
        return [loc.readers.get(i) for i in range(self.spec.table.__len__())]


# -- the state machine -------------------------------------------------------------------------


def test_a_holdings_event_round_trips_through_the_journal_text() -> None:
    event = Holdings("node-7", False, hs(1, 2, 3) + (2**64 - 1, 0), hs(9))
    record = event_to_text(event)
    assert json.loads(record)["t"] == "holdings"
    assert event_from_json(json.loads(record)) == event
    full = Holdings("n", True, ())
    assert event_from_json(json.loads(event_to_text(full))) == full


def test_full_and_delta_reports_set_and_clear_the_holders_of_windowed_jobs_only() -> None:
    drive = Driver(n=20)
    plain = JobSpec("plain", f"s3://{BUCKET}/{PREFIX}", drive.spec.shards, 1, 7, True, 60.0, 3, 0)
    drive.apply(CreateJob(plain))
    files = JobSpec("files", "file:///data/bucket/train/", drive.spec.shards, 1, 7, True, 60.0, 3, 8)
    drive.apply(CreateJob(files))
    # Hashes no job names are ignored; shards of the windowed s3 job get the node as holder.
    assert drive.apply(Holdings("n1", True, hs(1, 2, 3) + (12345,))) == {"changed": 3}
    assert drive.apply(Holdings("n2", True, hs(3, 4))) == {"changed": 2}  # the last reporter wins shard 3
    assert drive.holders()[:6] == [None, "n1", "n1", "n2", "n2", None]
    assert drive.state.jobs["plain"].locality is None
    files_loc = drive.state.jobs["files"].locality
    assert files_loc is not None and files_loc.readers.known == 0  # a file:// dataset: no daemon names it
    # A delta: dropped first (only where the node is the holder), then held.
    assert drive.apply(Holdings("n1", False, hs(5), hs(3, 2))) == {"changed": 2}
    assert drive.holders()[:6] == [None, "n1", None, "n2", "n2", "n1"]
    # A full report replaces everything the node held, and nothing of the others.
    assert drive.apply(Holdings("n1", True, hs(7))) == {"changed": 3}
    assert drive.holders()[:8] == [None, None, None, "n2", "n2", None, None, "n1"]
    # Nothing changed: not mutated, so nothing to journal.
    before = len(drive.log)
    result = drive.state.apply(Holdings("n1", False, hs(7), ()), drive.now)
    assert not result.mutated and result.answer == {"changed": 0} and len(drive.log) == before
    assert drive.state.status("job", drive.now)["locality"]["readers_known"] == 3


def test_a_holdings_event_is_checked_before_it_changes_anything() -> None:
    drive = Driver(n=8)
    before = drive.state.to_json()
    for bad in (
        Holdings("", True, hs(1)),
        Holdings("n1", 1, hs(1)),  # type: ignore[arg-type]
        Holdings("n1", True, (2**64,)),
        Holdings("n1", True, (-1,)),
        Holdings("n1", False, ("x",)),  # type: ignore[arg-type]
        Holdings("n1", True, hs(1), hs(2)),
        Holdings("n1", True, [h(1)]),  # type: ignore[arg-type]
    ):
        with pytest.raises(BadRequest):
            drive.state.apply(bad, drive.now)
    assert drive.state.to_json() == before


def test_a_lease_prefers_a_shard_the_trainers_node_reported_held_inside_the_window() -> None:
    n, window = 64, 16
    drive = Driver(n=n, window=window)
    order = EpochOrder(n, 7, 0, True)
    inside, outside = order[9], order[40]  # positions 9 (in the first window) and 40 (beyond it)
    drive.apply(Holdings("n1", True, hs(inside, outside)))
    first = drive.lease("n1")
    assert first is not None and first["shard"] == inside  # substituted for position 0
    loc = drive.state.jobs["job"].locality
    assert loc is not None and loc.counts["cached"] == 1
    # Another node's trainer gets the plain order; outside the window n1 gets the plain order too.
    other = drive.lease("n2")
    assert other is not None and other["shard"] == order[0]
    got = drive.lease("n1")
    assert got is not None and got["shard"] == order[1]
    # Once the window reaches it, the far one goes to n1 before its place.
    taken = [drive.lease("n2") for _ in range(30)]
    assert outside not in [g["shard"] for g in taken if g]
    for _ in range(5):
        got = drive.lease("n1")
        assert got is not None
        if got["shard"] == outside:
            break
    else:
        pytest.fail("n1 was never handed the shard it reported held")


def test_every_shard_still_exactly_once_per_epoch_with_reports_interleaved() -> None:
    n = 48
    drive = Driver(n=n, window=8, epochs=2)
    nodes = ("n0", "n1", "n2")
    for epoch in range(2):
        taken: list[int] = []
        step = 0
        while len(taken) < n:
            node = nodes[step % 3]
            step += 1
            if step % 5 == 0:
                drive.apply(Holdings(node, step % 10 == 0, hs(*range(step % n, min(n, step % n + 7)))))
            if step % 7 == 0:
                drive.apply(Holdings(node, False, hs(step % n), hs((step * 3) % n)))
            got = drive.lease(node)
            assert got is not None and got["epoch"] == epoch
            taken.append(got["shard"])
            drive.apply(Complete("job", got["lease"], f"t-{node}"))
        assert sorted(taken) == list(range(n))


def test_journal_replay_and_snapshot_restore_choose_as_the_live_master_after_holdings() -> None:
    drive = Driver(n=80, window=24)
    for node in ("n0", "n1", "n2"):
        drive.lease(node)
    drive.apply(Holdings("n1", True, hs(*range(0, 80, 3))))
    drive.apply(Holdings("n2", True, hs(*range(1, 80, 5))))
    for node in ("n1", "n2", "n0") * 4:
        drive.lease(node)
    drive.apply(Holdings("n1", False, hs(5, 6, 7), hs(0, 3, 9)))
    snapshot = json.loads(json.dumps(drive.state.to_json()))
    restored = MasterState.from_json(snapshot)
    from_text = MasterState.from_text(drive.state.snapshot_text())
    replayed = MasterState()
    for event, at in drive.log:  # the journal, as its text
        assert replayed.apply(event_from_json(json.loads(event_to_text(event))), at).mutated
    for state in (restored, from_text, replayed):
        assert state.to_json() == drive.state.to_json()
    before = len(drive.log)
    for i, node in enumerate(("n2", "n1", "n0", "n1") * 8):
        if i % 6 == 0:
            drive.apply(Holdings(node, i % 12 == 0, hs(*range(i, 80, 7)), ()))
        drive.lease(node)
    for event, at in drive.log[before:]:
        for state in (restored, from_text, replayed):
            state.apply(event, at)
    for state in (restored, from_text, replayed):
        assert state.to_json() == drive.state.to_json()


def test_a_snapshot_of_holders_keeps_the_readers_format_older_masters_wrote() -> None:
    drive = Driver(n=10)
    drive.apply(Holdings("n1", True, hs(1, 2)))
    raw = drive.state.to_json()
    locality = raw["jobs"][0]["locality"]
    assert set(locality) == {"readers", "counts"} and locality["readers"]["nodes"] == ["n1"]
    assert MasterState.from_json(json.loads(json.dumps(raw))).jobs["job"].locality.readers.shards_of("n1") == [1, 2]  # type: ignore[union-attr]


# -- the endpoint against a real master ----------------------------------------------------------


def new_job(master: MasterThread, n: int = 16, window: int = 8, **extra: Any) -> str:
    name = "job-" + uuid.uuid4().hex[:10]
    status, body = http("POST", master.url + "/v1/jobs", job_spec(name, n, locality_window=window, **extra))
    assert status == 201, body
    return name


def key_hash(i: int) -> int:
    """The hash of shard ``i`` of ``job_spec``'s jobs (s3://bucket/train/train-000000.tar...)."""
    return name_hash("bucket", f"train/train-{i:06d}.tar")


def report(daemon: str = "d1", seq: int = 1, base: int | None = None, held: tuple[int, ...] = (), dropped: tuple[int, ...] = (),
           capacity: int = 10_000, jobs: dict[str, dict[str, int]] | None = None) -> dict[str, Any]:
    return NodeReport(daemon=daemon, seq=seq, base=base, held=array("Q", held), dropped=array("Q", dropped),
                      capacity_bytes=capacity, used_bytes=0, mean_entry_bytes=1000, jobs=jobs or {}).to_json()


def post(master: MasterThread, node: str, doc: Any, **kw: Any) -> tuple[int, Any]:
    return http("POST", f"{master.url}/v1/nodes/{node}/report", doc, **kw)


def lease(master: MasterThread, job: str, trainer: str, node: str) -> dict[str, Any]:
    status, body = http("POST", f"{master.url}/v1/jobs/{job}/leases", {"trainer": trainer, "node": node, "count": 1})
    assert status == 200 and body["status"] == "ok", body
    lease: dict[str, Any] = body["leases"][0]
    return lease


def test_a_report_is_answered_with_its_plan_and_a_delta_on_an_unknown_base_with_resend_full(inproc_master: MasterThread) -> None:
    node = "node-" + uuid.uuid4().hex[:6]
    job = new_job(inproc_master, 16)
    first = lease(inproc_master, job, "t1", node)
    # A delta first: the master holds no report of this node.
    status, answer = post(inproc_master, node, report(seq=5, base=4))
    assert status == 200 and answer["resend"] == "full" and answer["prefetch"] == [] and answer["seq"] == 5
    plan = parse_plan(answer)
    assert plan.interval_s >= 1
    status, answer = post(inproc_master, node, report(seq=6, held=(key_hash(3), 999)))
    assert status == 200 and answer["resend"] is None, answer
    plan = parse_plan(answer)
    # Its trainer runs there: capacity 10,000 bytes of ~1,000-byte shards is 9 slots.
    assert 0 < len(plan.prefetch) + len(plan.keep) <= 9
    assert all(item.job == job and item.bucket == "bucket" and item.key.startswith("train/train-") for item in plan.prefetch)
    assert [i.next_use for i in plan.prefetch] == sorted(i.next_use for i in plan.prefetch)
    # handed out: needed next epoch only (the plan reaches into it: the window's shards are not fetched ahead)
    assert all(i.next_use >= 16 for i in plan.prefetch if int(i.key[-10:-4]) == first["shard"])
    # A delta on it applies; one on a report it never saw (a lost one) asks for a full report.
    status, answer = post(inproc_master, node, report(seq=7, base=6, held=(key_hash(4),)))
    assert status == 200 and answer["resend"] is None
    assert set(unpack_hashes(answer["keep"], "keep")) <= {key_hash(3), key_hash(4)}
    status, body = http("GET", f"{inproc_master.url}/v1/jobs/{job}")
    assert body["locality"]["readers_known"] == 2 and body["cache"]["nodes"][0]["held_shards"] == 2
    status, answer = post(inproc_master, node, report(seq=9, base=8))
    assert status == 200 and answer["resend"] == "full"
    # Another daemon instance (restarted): its deltas too, until its full report.
    status, answer = post(inproc_master, node, report(daemon="d2", seq=2, base=1))
    assert answer["resend"] == "full"
    status, answer = post(inproc_master, node, report(daemon="d2", seq=3))
    assert answer["resend"] is None
    status, body = http("GET", f"{inproc_master.url}/v1/jobs/{job}")
    assert body["locality"]["readers_known"] == 0  # the new instance's full report holds nothing


def test_a_job_created_after_the_last_full_report_asks_for_a_full_one(inproc_master: MasterThread) -> None:
    node = "node-" + uuid.uuid4().hex[:6]
    new_job(inproc_master, 8)
    assert post(inproc_master, node, report(seq=1))[1]["resend"] is None
    assert post(inproc_master, node, report(seq=2, base=1))[1]["resend"] is None
    job = new_job(inproc_master, 8)
    assert post(inproc_master, node, report(seq=3, base=2))[1]["resend"] == "full"
    status, answer = post(inproc_master, node, report(seq=4, held=(key_hash(2),)))
    assert status == 200 and answer["resend"] is None
    assert post(inproc_master, node, report(seq=5, base=4))[1]["resend"] is None
    # The new job learned it: a lease from that node, inside the window, takes it.
    assert lease(inproc_master, job, "t9", node)["shard"] == 2  # 8 shards, window 8: the whole epoch


def _raw(master: MasterThread, node: str, body: bytes, headers: dict[str, str] | None = None) -> tuple[int, Any]:
    return http("POST", f"{master.url}/v1/nodes/{node}/report", raw=body, headers=headers)


def test_hostile_report_bodies_are_answered_4xx_never_500(inproc_master: MasterThread) -> None:
    good = report()
    bodies: list[tuple[Any, int]] = [
        (b"", 400), (b"not json", 400), (b"[1, 2]", 400), (b"\xff\xfe", 400), (b"null", 400),
        (json.dumps({**good, "kind": "other"}).encode(), 400),
        (json.dumps({k: v for k, v in good.items() if k != "held"}).encode(), 400),
        (json.dumps({**good, "extra": 1}).encode(), 400),
        (json.dumps({**good, "held": "%%%"}).encode(), 400),
        (json.dumps({**good, "held": "AAAA"}).encode(), 400),  # 3 bytes: not whole hashes
        (json.dumps({**good, "held": 7}).encode(), 400),
        (json.dumps({**good, "dropped": pack_hashes([1])}).encode(), 400),  # a full report drops nothing
        (json.dumps({**good, "seq": 0}).encode(), 400),
        (json.dumps({**good, "seq": True}).encode(), 400),
        (json.dumps({**good, "base": 5, "seq": 5}).encode(), 400),
        (json.dumps({**good, "daemon": "a b"}).encode(), 400),
        (json.dumps({**good, "capacity_bytes": -1}).encode(), 400),
        (json.dumps({**good, "jobs": {"j": {"reads": 1}}}).encode(), 400),
        (json.dumps({**good, "jobs": {"bad job": {}}}).encode(), 400),
        (json.dumps({**good, "jobs": []}).encode(), 400),
        (b"{" * 100_000, 400),
    ]
    for body, expected in bodies:
        status, answer = _raw(inproc_master, "node-hostile", body)
        assert status == expected and isinstance(answer, dict) and answer["error"] == "BadRequest", (body[:80], status, answer)
    # The node's name is checked as a lease's node field is.
    status, answer = post(inproc_master, "n" * 300, good)
    assert status == 400 and "node" in answer["message"]
    status, answer = post(inproc_master, "bad%01node", good)
    assert status == 400
    # Past the limit: refused on the declared length before reading, and on the bytes read when chunked.
    status, answer = _raw(inproc_master, "node-hostile", b" " * (MAX_REPORT_BYTES + 1))
    assert status == 413 and answer["error"] == "BodyTooLarge"
    host, port = inproc_master.url.removeprefix("http://").split(":")
    conn = httpclient.HTTPConnection(host, int(port), timeout=30)
    try:
        def chunks() -> Iterator[bytes]:
            for _ in range(MAX_REPORT_BYTES // (1 << 20) + 2):
                yield b" " * (1 << 20)

        conn.request("POST", "/v1/nodes/node-hostile/report", body=chunks(), encode_chunked=True,
                     headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        assert response.status == 413, response.read()[:200]
    except (BrokenPipeError, ConnectionResetError):
        pass  # the master answered 413 and closed before every chunk went out
    finally:
        conn.close()
    # A wrong method is the usual JSON 405; the master still answers a good report after all that.
    status, answer = http("GET", f"{inproc_master.url}/v1/nodes/node-hostile/report")
    assert status == 405 and answer["error"] == "MethodNotAllowed"
    assert post(inproc_master, "node-hostile", good)[0] == 200
    status, metrics = http("GET", f"{inproc_master.url}/metrics")
    assert 'shardcache_master_node_reports_total{outcome="refused"}' in metrics


OPERATOR_TOKEN = "operator-token-0123456789abcdef"
TENANT_TOKEN = "tenant-a-token-0123456789abcdef"


@pytest.fixture
def guarded(tmp_path: Path) -> Iterator[str]:
    """A master process with the operator's token and a tenant's (a process: the token files are
    looked at on its event loop, which the in-process guard would flag)."""
    (tmp_path / "operator").write_text(OPERATOR_TOKEN)
    tenants = tmp_path / "tenants"
    tenants.mkdir()
    (tenants / "team-a").write_text(TENANT_TOKEN)
    master = MasterProcess(tmp_path, f"sqlite://{tmp_path / 'm.db'}", "--token-file", str(tmp_path / "operator"),
                           "--tenant-tokens", str(tenants), name="m", advertise=False)
    master.start("healthz")
    try:
        yield master.url
    finally:
        master.stop()


def test_only_the_operator_reports(guarded: str) -> None:
    url = f"{guarded}/v1/nodes/n1/report"
    for headers, expected, code in (
        ({}, 401, "Unauthorized"),
        ({"Authorization": "Bearer wrong-token-0123456789"}, 401, "Unauthorized"),
        ({"Authorization": f"Bearer {TENANT_TOKEN}"}, 403, "Forbidden"),
    ):
        status, answer = http("POST", url, report(), headers=headers)
        assert (status, answer["error"]) == (expected, code), (headers, answer)
    # A hostile body from a tenant is refused as a tenant's, before it is read.
    status, answer = http("POST", url, raw=b"garbage", headers={"Authorization": f"Bearer {TENANT_TOKEN}"})
    assert status == 403
    status, answer = http("POST", url, report(), headers={"Authorization": f"Bearer {OPERATOR_TOKEN}"})
    assert status == 200 and answer["kind"] == "shardcache-node-plan-v1"


def test_a_restarted_master_asks_for_a_full_report_and_keeps_the_holdings(tmp_path: Path) -> None:
    settings = MasterSettings(listen=(f"tcp://127.0.0.1:{free_port()}",), state=f"sqlite://{tmp_path}/m.db")
    master = MasterThread(settings).start()
    try:
        job = new_job(master, 32, window=32)
        wanted = EpochOrder(32, 7, 0)[12]  # within the first lease's reach (locality.STEP positions)
        assert post(master, "n1", report(seq=1, held=(key_hash(wanted),)))[1]["resend"] is None
    finally:
        master.stop()
    master = MasterThread(settings).start()
    try:
        assert post(master, "n1", report(seq=2, base=1))[1]["resend"] == "full"
        # The holder was journaled: the first lease on n1 takes it, as the old master would have.
        assert lease(master, job, "t1", "n1")["shard"] == wanted
        status, body = http("GET", f"{master.url}/v1/jobs/{job}")
        assert body["locality"]["leases"]["cached"] == 1
    finally:
        master.stop()


def test_the_job_status_shows_each_nodes_cache_and_metrics_sum_them(inproc_master: MasterThread) -> None:
    job = new_job(inproc_master, 16)
    a, b = "node-" + uuid.uuid4().hex[:6], "node-" + uuid.uuid4().hex[:6]
    url = f"{inproc_master.url}/v1/jobs/{job}"
    granted = lease(inproc_master, job, "trainer-a1", a)
    lease(inproc_master, job, "trainer-a2", a)
    wait = {"seconds": 1.0, "steps": 10, "elapsed_s": 10.0, "buckets": [10] + [0] * 8}
    status, body = http("POST", f"{url}/leases/{granted['lease']}/renew", {"trainer": "trainer-a1", "offset": 1, "wait": wait})
    assert status == 200, body
    counters = {"reads": 10, "hit_bytes": 900, "origin_bytes": 50, "peer_bytes": 50, "prefetch_bytes": 300}
    assert post(inproc_master, a, report(seq=1, held=(key_hash(1), key_hash(2)), capacity=10**6, jobs={job: counters}))[0] == 200
    assert post(inproc_master, b, report(daemon="b1", seq=1, jobs={job: {**counters, "hit_bytes": 0}}))[0] == 200
    # b's daemon restarts: its new counters add to the old instance's last ones.
    assert post(inproc_master, b, report(daemon="b2", seq=1, jobs={job: {**counters, "reads": 1, "hit_bytes": 100}}))[0] == 200
    status, body = http("GET", url)
    cache = body["cache"]
    assert cache["reporting_nodes"] == 2 and cache["nodes_omitted"] == 0
    by_node = {entry["node"]: entry for entry in cache["nodes"]}
    assert [e["node"] for e in cache["nodes"]] == sorted([a, b])
    first = by_node[a]
    assert first["trainers"] == 2 and first["reads"] == 10 and first["hit_bytes"] == 900 and first["hit_rate"] == 0.9
    assert first["held_shards"] == 2 and 2 <= first["planned_shards"] <= 16 and 0 <= first["prefetch_lead_shards"] <= 2
    assert first["wait_fraction"] == 0.1 and 0 <= first["report_age_s"] < 30
    second = by_node[b]
    assert second["trainers"] == 0 and second["reads"] == 11 and second["hit_bytes"] == 100 and second["origin_bytes"] == 100
    assert second["held_shards"] == 0 and second["planned_shards"] == 0 and second["wait_fraction"] is None
    totals = cache["totals"]
    assert totals == {"reads": 21, "hit_bytes": 1000, "origin_bytes": 150, "peer_bytes": 150, "prefetch_bytes": 900,
                      "hit_rate": round(1000 / 1300, 4)}
    status, listing = http("GET", inproc_master.url + "/v1/jobs")
    (listed,) = [j["cache"] for j in listing["jobs"] if j["name"] == job]
    assert listed["totals"] == totals and [e["node"] for e in listed["nodes"]] == sorted([a, b])
    status, text = http("GET", inproc_master.url + "/metrics")
    assert f'shardcache_master_job_cache_bytes_total{{job="{job}",source="hit"}} 1000.0' in text
    assert f'shardcache_master_job_cache_bytes_total{{job="{job}",source="prefetch"}} 900.0' in text
    assert f'shardcache_master_job_cache_hit_ratio{{job="{job}"}} {round(1000 / 1300, 4)}' in text
    assert 'shardcache_master_node_reports_total{outcome="applied"}' in text
    assert f'node="{a}"' not in text  # job labels only
    # The job deleted: its view goes; one created again under the name counts from zero.
    assert http("DELETE", url + "?force=true")[0] == 200
    assert http("POST", inproc_master.url + "/v1/jobs", job_spec(job, 16, locality_window=8))[0] == 201
    status, body = http("GET", url)
    assert body["cache"]["totals"]["reads"] == 0 and all(e["held_shards"] == 0 for e in body["cache"]["nodes"])


def test_a_node_whose_trainers_report_waiting_fetches_through_what_it_kept(inproc_master: MasterThread) -> None:
    # What the trainers on a node report waiting (the renew bodies' "wait") reaches that node's
    # plan: the node holds the next six shards of the order, so the base lead (2 positions, one
    # trainer) fetches nothing; once its trainer waited, the plan fetches past them: two shards, as
    # a node with ROOM_SLOTS_PER_TRAINER slots a trainer or more does (~40 here).
    n, node = 64, "node-" + uuid.uuid4().hex[:6]
    job = new_job(inproc_master, n, window=1)
    granted = lease(inproc_master, job, "t1", node)
    order = EpochOrder(n, 7, 0)
    pending = [order[p] for p in range(n) if order[p] != granted["shard"]]
    run = tuple(key_hash(s) for s in pending[:6])
    capacity = 40 * (1000 + n)  # ~40 slots
    renew = f"{inproc_master.url}/v1/jobs/{job}/leases/{granted['lease']}/renew"
    fetched: list[list[int]] = []
    for seq in range(1, 4):
        answer = post(inproc_master, node, report(seq=seq, held=run, capacity=capacity))[1]
        fetched.append([int(item.key[-10:-4]) for item in parse_plan(answer).prefetch])
        wait = {"seconds": 0.5, "steps": 5, "elapsed_s": 1.0, "buckets": [5] + [0] * 8}  # half the time waiting
        assert http("POST", renew, {"trainer": "t1", "offset": 1, "wait": wait})[0] == 200
    assert fetched == [[], pending[6:8], pending[6:8]]


def test_a_job_without_a_window_still_shows_the_nodes_reads_and_gets_no_plan(inproc_master: MasterThread) -> None:
    name = "job-" + uuid.uuid4().hex[:10]
    assert http("POST", inproc_master.url + "/v1/jobs", job_spec(name, 8))[0] == 201
    node = "node-" + uuid.uuid4().hex[:6]
    lease(inproc_master, name, "t1", node)
    counters = {"reads": 3, "hit_bytes": 0, "origin_bytes": 30, "peer_bytes": 0, "prefetch_bytes": 0}
    status, answer = post(inproc_master, node, report(seq=1, held=(key_hash(1),), jobs={name: counters}))
    assert status == 200 and answer["prefetch"] == [] and unpack_hashes(answer["keep"], "keep") == array("Q")
    status, body = http("GET", f"{inproc_master.url}/v1/jobs/{name}")
    (entry,) = body["cache"]["nodes"]
    assert entry["node"] == node and entry["origin_bytes"] == 30 and entry["hit_rate"] == 0.0 and entry["trainers"] == 1
    assert entry["held_shards"] is None and entry["planned_shards"] is None
    assert body["locality"] is None


@pytest.mark.slow
def test_a_standby_refuses_reports_and_a_new_leader_asks_for_full_ones(etcd_server: Any, tmp_path: Path,
                                                                      master_procs: list[MasterProcess]) -> None:
    """With etcd: a standby answers a report 503 NotLeader naming the leader, as every write; the
    leader's journaled holdings survive its kill -9, and the new leader asks for full reports."""
    from tests.support.waits import http_ok, wait_until

    state = f"etcd://127.0.0.1:{etcd_server.port}/holdings-{uuid.uuid4().hex[:8]}"
    m1 = MasterProcess(tmp_path, state, "--election-ttl", "2", name="m1")
    m2 = MasterProcess(tmp_path, state, "--election-ttl", "2", name="m2")
    master_procs.extend([m1, m2])
    m1.start()
    m2.start(wait="health")
    wait_until(lambda: http("GET", m2.url + "/v1/leader")[1].get("leader") == m1.url, timeout=30, what="the standby")
    status, answer = http("POST", f"{m2.url}/v1/nodes/n1/report", report())
    assert (status, answer["error"], answer["leader"]) == (503, "NotLeader", m1.url)
    name = "job-" + uuid.uuid4().hex[:8]
    assert http("POST", m1.url + "/v1/jobs", job_spec(name, 32, locality_window=32))[0] == 201
    wanted = EpochOrder(32, 7, 0)[12]
    assert http("POST", f"{m1.url}/v1/nodes/n1/report", report(held=(key_hash(wanted),)))[1]["resend"] is None
    m1.kill9()
    wait_until(lambda: http_ok(m2.url + "/readyz"), timeout=20, what="the standby to take over")
    assert http("POST", f"{m2.url}/v1/nodes/n1/report", report(seq=2, base=1))[1]["resend"] == "full"
    status, body = http("POST", f"{m2.url}/v1/jobs/{name}/leases", {"trainer": "t1", "node": "n1", "count": 1})
    assert status == 200 and body["leases"][0]["shard"] == wanted
