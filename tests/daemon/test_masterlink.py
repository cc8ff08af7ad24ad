"""The node daemon's link to a lease master (``serve --master``, issue 32): reports of what it
caches (full, then deltas on the last report the master took), the plan it answers applied
(prefetch in order, ranks for ``--eviction planned``), and a master that misbehaves in every way
never touching what the daemon serves.

The master here is a stub (an aiohttp server on a thread of this process) that checks every
report with the master's own parser (:func:`wire.nodeplan.parse_report`) and answers plans
(:class:`wire.nodeplan.NodePlan`), or garbage on demand; the daemon is the real app, in this
process (``DaemonThread``), on a ``file://`` origin. ``test_against_a_real_master`` runs
``shardcache serve --master`` against ``shardcache master`` processes.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import re
import threading
import time
from array import array
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from cache import Entry, Store, StoreSettings
from sidecar.cli.util import UserError
from sidecar.daemon.masterlink import HeldNames
from sidecar.daemon.prefetch import _room_for_plan
from sidecar.daemon.settings import MasterLinkSettings
from tests.support.daemons import DaemonProcess, HeldOrigin, http_get, make_settings, post_prefetch
from tests.support.masters import running_master
from tests.support.processes import free_port
from tests.support.threads import DaemonThread, ServerThread
from tests.support.waits import wait_until
from wire.nodeplan import JOB_HEADER, MAX_PLAN_BYTES, NodePlan, NodeReport, PrefetchItem, name_hash, parse_report

SIZE = 40_000
KEYS = [f"shard-{i}.tar" for i in range(6)]
TOKEN = "operator-token-123"

Answer = Callable[[NodeReport, web.Request], Awaitable[web.StreamResponse]]


def h(key: str) -> int:
    return name_hash("bkt", key)


class StubMaster(ServerThread):
    """``POST /v1/nodes/{node}/report``: each report parsed as the master does and kept; answered
    by ``answer``: by default :meth:`plan`, which applies the report as a master does (a delta on
    another report than the last it applied: ``resend: "full"``)."""

    def __init__(self) -> None:
        super().__init__("stub-master")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.reports: list[NodeReport] = []
        self.seen: list[tuple[str, str | None]] = []  # path, Authorization
        self.lock = threading.Lock()
        self.answer: Answer = self.plan
        self.applied: list[NodeReport] = []

    async def plan(self, report: NodeReport, request: web.Request | None = None, interval_s: float = 0.1,
                   **fields: Any) -> web.StreamResponse:
        with self.lock:
            if not report.full and (not self.applied or self.applied[-1].seq != report.base
                                    or self.applied[-1].daemon != report.daemon):
                return web.json_response(NodePlan(seq=report.seq, resend="full", interval_s=0.1).to_json())
            self.applied.append(report)
        return web.json_response(NodePlan(seq=report.seq, interval_s=interval_s, **fields).to_json())

    def view(self) -> set[int]:
        """What the reports applied say the node holds."""
        with self.lock:
            return masters_view(self.applied)

    async def serve(self, stop: asyncio.Event, on_ready: Callable[[], None]) -> None:
        app = web.Application(client_max_size=64 << 20)
        app.router.add_post("/v1/nodes/{node}/report", self._report)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", self.port).start()
        on_ready()
        try:
            await stop.wait()
        finally:
            await runner.cleanup()

    async def _report(self, request: web.Request) -> web.StreamResponse:
        report = parse_report(json.loads(await request.read()))
        with self.lock:
            self.reports.append(report)
            self.seen.append((request.path, request.headers.get("Authorization")))
        return await self.answer(report, request)

    def taken(self) -> list[NodeReport]:
        with self.lock:
            return list(self.reports)


@pytest.fixture
def origin(tmp_path: Path) -> Path:
    root = tmp_path / "origin"
    (root / "bkt").mkdir(parents=True)
    for i, key in enumerate(KEYS):
        (root / "bkt" / key).write_bytes(os.urandom(SIZE + i))
    return root


@pytest.fixture
def stub() -> Any:
    master = StubMaster().start()
    yield master
    master.stop()


def settings_for(tmp_path: Path, origin: Path, urls: tuple[str, ...] | None, capacity: int = 3 * SIZE + 100,
                 eviction: str = "planned", **link: Any) -> Any:
    master = None
    if urls is not None:
        options = {"first_interval_s": 0.1, "timeout_s": 1.0, "backoff_max_s": 0.3, "token": TOKEN, **link}
        master = MasterLinkSettings(urls=urls, **options)
    return make_settings(tmp_path / "cache", f"file://{origin}", capacity=capacity, eviction=eviction, node="node-a",
                         master=master)


def read(daemon: DaemonThread, key: str, job: str | None = None) -> bytes:
    status, body = http_get(f"{daemon.url}/bkt/{key}", {JOB_HEADER: job} if job else None)
    assert status == 200, body[:300]
    return body


def cached_names(tmp_path: Path) -> set[int]:
    """The names of the entries published in the daemon's cache directory."""
    names = set()
    for meta in (tmp_path / "cache" / "v1" / "meta").rglob("*.json"):
        doc = json.loads(meta.read_text())
        names.add(name_hash(doc["bucket"], doc["key"]))
    return names


def masters_view(reports: list[NodeReport]) -> set[int]:
    """What a master that applied ``reports`` in order believes the node holds."""
    view: set[int] = set()
    for report in reports:
        if report.full:
            view = set(report.held)
        else:
            view = (view - set(report.dropped)) | set(report.held)
    return view


def outcome(daemon: DaemonThread, name: str) -> float:
    match = re.search(rf'^shardcache_master_reports_total\{{outcome="{name}"\}} (\S+)$', daemon.metrics(), re.M)
    return float(match.group(1)) if match else 0.0


def test_a_full_report_then_deltas(tmp_path: Path, origin: Path, stub: StubMaster, start_daemon: Any):
    before = start_daemon(settings_for(tmp_path, origin, None))  # no master: fills the cache
    read(before, KEYS[0])
    read(before, KEYS[1])
    before.settle()
    before.stop()
    daemon = start_daemon(settings_for(tmp_path, origin, (stub.url,)))
    wait_until(lambda: len(stub.taken()) >= 2, timeout=20, what="two reports")
    first, second = stub.taken()[:2]
    assert first.full and first.seq == 1 and sorted(first.held) == sorted([h(KEYS[0]), h(KEYS[1])])
    assert first.capacity_bytes == 3 * SIZE + 100 and first.used_bytes == 2 * SIZE + 1
    assert first.mean_entry_bytes == (2 * SIZE + 1) // 2
    assert (second.base, second.seq, list(second.held), list(second.dropped)) == (1, 2, [], [])
    assert stub.seen[0] == ("/v1/nodes/node-a/report", f"Bearer {TOKEN}")

    read(daemon, KEYS[2], job="train")  # cached: in the next delta
    wait_until(lambda: h(KEYS[2]) in stub.view(), timeout=20, what="the delta naming the new entry")
    delta = next(r for r in stub.taken() if h(KEYS[2]) in r.held)
    assert not delta.full and delta.base == delta.seq - 1
    read(daemon, KEYS[3])  # the cache holds three: one goes, dropped in a delta
    daemon.settle()
    wait_until(lambda: stub.view() == cached_names(tmp_path), timeout=20,
               what="the master's view to be the cache")
    assert len(cached_names(tmp_path)) == 3 and any(r.dropped for r in stub.taken())
    last = stub.taken()[-1]
    assert last.jobs["train"]["reads"] == 1 and last.jobs["train"]["origin_bytes"] == SIZE + 2
    assert all(r.daemon == first.daemon for r in stub.taken())
    stats = daemon.stats()["master"]
    assert stats["url"] == stub.url and stats["failures_in_a_row"] == 0 and stats["last_ok_age_s"] < 5
    assert stats["reports"]["full"] == 1 and stats["reports"]["delta"] >= 3
    assert outcome(daemon, "ok") >= 4


def test_resend_full_makes_the_next_report_full(tmp_path: Path, origin: Path, stub: StubMaster, start_daemon: Any):
    async def answer(report: NodeReport, request: web.Request) -> web.StreamResponse:
        if report.seq == 3:
            return web.json_response(NodePlan(seq=report.seq, resend="full", interval_s=5.0).to_json())
        return await stub.plan(report, request)

    stub.answer = answer
    daemon = start_daemon(settings_for(tmp_path, origin, (stub.url,)))
    read(daemon, KEYS[0])
    wait_until(lambda: len(stub.taken()) >= 5, timeout=20, what="five reports")
    reports = stub.taken()
    assert [r.full for r in reports[:5]] == [True, False, False, True, False]
    assert reports[3].seq == 4 and reports[4].base == 4  # at once, not after the 5 s the answer said
    assert outcome(daemon, "resend") == 1
    daemon.settle()
    wait_until(lambda: stub.view() == cached_names(tmp_path), timeout=20, what="the view")


def test_reports_the_master_missed_are_carried_by_the_next_delta(tmp_path: Path, origin: Path, stub: StubMaster,
                                                                 start_daemon: Any):
    failing = threading.Event()

    async def answer(report: NodeReport, request: web.Request) -> web.StreamResponse:
        if failing.is_set():
            return web.json_response({"error": "StateUnavailable", "message": "etcd is down"}, status=503)
        return await stub.plan(report, request)

    stub.answer = answer
    daemon = start_daemon(settings_for(tmp_path, origin, (stub.url,), capacity=2 * SIZE + 100))
    read(daemon, KEYS[0])
    read(daemon, KEYS[1])
    daemon.settle()
    wait_until(lambda: stub.view() == cached_names(tmp_path), timeout=20, what="the view")
    failing.set()
    seen = len(stub.taken())
    read(daemon, KEYS[2])  # evicts one, while no report goes through
    read(daemon, KEYS[3])
    daemon.settle()
    wait_until(lambda: len(stub.taken()) >= seen + 3, timeout=20, what="reports refused")
    failing.clear()
    wait_until(lambda: outcome(daemon, "server_error") >= 3 and daemon.stats()["master"]["failures_in_a_row"] == 0,
               timeout=20, what="the master back")
    wait_until(lambda: stub.view() == cached_names(tmp_path), timeout=20, what="the view")
    assert [r.full for r in stub.applied].count(True) == 1  # one delta carried it all: no full report again
    assert "503" in daemon.stats()["master"]["last_error"]


def test_the_plan_is_prefetched_in_order_for_its_job(tmp_path: Path, origin: Path, stub: StubMaster,
                                                     start_daemon: Any):
    async def answer(report: NodeReport, request: web.Request) -> web.StreamResponse:
        items = tuple(PrefetchItem("train", "bkt", key, 100 + i) for i, key in enumerate(KEYS[1:3]))
        return await stub.plan(report, request, prefetch=items, keep=array("Q", [h(KEYS[0])]))

    stub.answer = answer
    daemon = start_daemon(settings_for(tmp_path, origin, (stub.url,)))
    read(daemon, KEYS[0])
    wait_until(lambda: len(cached_names(tmp_path)) == 3, timeout=20, what="the plan's prefetches")
    assert cached_names(tmp_path) == {h(k) for k in KEYS[:3]}
    daemon.settle()
    stats = daemon.stats()
    assert stats["jobs"]["train"]["prefetch_bytes"] == (SIZE + 1) + (SIZE + 2)
    assert stats["jobs"]["train"]["reads"] == 0  # filled for it, not read by it (yet)
    assert stats["prefetch"]["plan"]["filled"] == 2
    assert stats["cache"]["policy"]["ranked_items"] == 3  # kept, and the prefetched ones after it
    wait_until(lambda: daemon.stats()["master"]["plan"]["ranked_items"] == 3, timeout=20, what="a plan since")
    plan = daemon.stats()["master"]["plan"]
    assert plan["prefetch"] == 2 and plan["keep"] == 1 and plan["queued"] == 0  # cached: not queued again


def test_a_plan_prefetch_never_evicts_what_the_plan_keeps(tmp_path: Path, origin: Path, stub: StubMaster,
                                                           start_daemon: Any):
    plan: dict[str, Any] = {"keep": [KEYS[0], KEYS[1]], "prefetch": []}

    async def answer(report: NodeReport, request: web.Request) -> web.StreamResponse:
        items = tuple(PrefetchItem("train", "bkt", key, 7) for key in plan["prefetch"])
        return await stub.plan(report, request, prefetch=items, keep=array("Q", [h(k) for k in plan["keep"]]))

    stub.answer = answer
    daemon = start_daemon(settings_for(tmp_path, origin, (stub.url,), capacity=2 * SIZE + 100))
    read(daemon, KEYS[0])
    read(daemon, KEYS[1])
    daemon.settle()
    plan["prefetch"] = [KEYS[2]]  # no room but what the plan keeps
    wait_until(lambda: daemon.stats()["prefetch"]["plan"]["no_room"] >= 2, timeout=20, what="prefetches refused room")
    assert cached_names(tmp_path) == {h(KEYS[0]), h(KEYS[1])}
    plan["keep"] = [KEYS[0]]  # KEYS[1] no longer needed: its room is the plan's to take
    wait_until(lambda: cached_names(tmp_path) == {h(KEYS[0]), h(KEYS[2])}, timeout=20, what="the prefetch")
    assert daemon.stats()["cache"]["evictions"] == 1


def awaited_kept_then_read(daemon: DaemonThread, tmp_path: Path) -> None:
    """The cache full with KEYS[0] ranked and KEYS[1] awaited (filled for a reader, unread): two
    demand fills evict the newer unranked KEYS[2], not KEYS[1]; once read, KEYS[1] waits no more."""
    assert daemon.stats()["cache"]["policy"]["awaited_items"] == 1
    read(daemon, KEYS[2])  # the cache is full: KEYS[0] ranked, KEYS[1] awaited, KEYS[2]
    daemon.settle()
    read(daemon, KEYS[3])  # evicts KEYS[2], unranked, though KEYS[1] is older
    daemon.settle()
    assert cached_names(tmp_path) == {h(KEYS[0]), h(KEYS[1]), h(KEYS[3])}
    read(daemon, KEYS[1])
    daemon.settle()
    assert daemon.stats()["cache"]["policy"]["awaited_items"] == 0


def test_a_hints_fill_is_kept_until_its_reader_reads_it(tmp_path: Path, origin: Path, stub: StubMaster,
                                                        start_daemon: Any):
    """A reader's hint (a trainer's next shard) fills an entry the plan cannot rank before the
    master has heard of it. Under ``planned`` it is kept from the fills that come meanwhile, after
    even the ranked entries, until it is read. It was the first to go: unranked, and older than
    the demand fill that evicted it."""
    slow = threading.Event()  # the master answers "next report in 30 s": no plan decides meanwhile

    async def answer(report: NodeReport, request: web.Request) -> web.StreamResponse:
        return await stub.plan(report, request, interval_s=30.0 if slow.is_set() else 0.1,
                               keep=array("Q", [h(KEYS[0])]))

    stub.answer = answer
    daemon = start_daemon(settings_for(tmp_path, origin, (stub.url,)))
    read(daemon, KEYS[0])
    wait_until(lambda: daemon.stats()["cache"]["policy"]["ranked_items"] == 1, timeout=20, what="a plan ranking it")
    slow.set()
    seen = len(stub.taken())
    wait_until(lambda: len(stub.taken()) > seen, timeout=20, what="the slow plan")
    post_prefetch(daemon.url, [KEYS[1]])
    wait_until(lambda: h(KEYS[1]) in cached_names(tmp_path), timeout=20, what="the hint's fill")
    daemon.settle()
    awaited_kept_then_read(daemon, tmp_path)  # read: awaited no longer, an unranked entry like any other
    for key in KEYS[4:]:  # each evicts the least recently used unranked one: KEYS[3], then KEYS[1]
        read(daemon, key)
        daemon.settle()
    assert cached_names(tmp_path) == {h(KEYS[0]), h(KEYS[4]), h(KEYS[5])}
    assert daemon.stats()["prefetch"]["evicted_unread"]["evicted"]["hint"] == 0
    assert len(stub.taken()) == seen + 1  # no plan came in between


def test_a_plan_fill_the_next_plan_no_longer_lists_is_kept_until_read(tmp_path: Path, origin: Path, stub: StubMaster,
                                                                      start_daemon: Any, monkeypatch: Any):
    """A plan's prefetch that lands after a plan that no longer lists it: its shard was leased
    meanwhile (the master's planner leaves out what is handed out and not held), and the master
    learns of the entry only from the node's next report. It is awaited like a hint's until then,
    not the first entry to go: the capacity bed's logs showed such fills evicted 24 ms after they
    landed by the next plan fill, and fetched again when their trainer read them 0.4 s later."""
    phase = {"prefetch": False, "slow": False}
    answered_slow = threading.Event()
    held = HeldOrigin(monkeypatch, KEYS[1])  # the origin's first answer for KEYS[1] waits

    async def answer(report: NodeReport, request: web.Request) -> web.StreamResponse:
        items = (PrefetchItem("train", "bkt", KEYS[1], 3),) if phase["prefetch"] else ()
        if phase["slow"]:
            answered_slow.set()
        return await stub.plan(report, request, interval_s=30.0 if phase["slow"] else 0.1, prefetch=items,
                               keep=array("Q", [h(KEYS[0])]))

    stub.answer = answer
    daemon = start_daemon(settings_for(tmp_path, origin, (stub.url,)))
    read(daemon, KEYS[0])
    wait_until(lambda: daemon.stats()["cache"]["policy"]["ranked_items"] == 1, timeout=20, what="a plan ranking it")
    phase["prefetch"] = True
    wait_until(lambda: held.opened[KEYS[1]] == 1, timeout=20, what="the plan's fill of KEYS[1]")
    phase["prefetch"], phase["slow"] = False, True  # the next plan lists it no more
    assert answered_slow.wait(20)
    seen = len(stub.taken())
    held.release()
    wait_until(lambda: h(KEYS[1]) in cached_names(tmp_path), timeout=20, what="the plan's fill")
    daemon.settle()
    assert daemon.stats()["prefetch"]["plan"]["filled"] == 1
    awaited_kept_then_read(daemon, tmp_path)
    assert daemon.stats()["prefetch"]["evicted_unread"]["evicted"]["plan"] == 0
    assert len(stub.taken()) == seen  # no plan came in between


def test_a_plan_fill_counts_the_room_of_prefetches_not_admitted_yet(tmp_path: Path) -> None:
    """Two plan fills that each saw room for one started on the room of one: the later was refused
    at its begin, its first bytes fetched in vain. Those started and not admitted yet count."""
    store = Store(StoreSettings(root=tmp_path, capacity_bytes=4 * SIZE, min_free_ratio=0.0, eviction="planned"))
    store.open()
    for key in KEYS[:4]:
        writer = store.begin("bkt", key, f'"{key}"', SIZE)
        assert writer is not None
        writer.write_at(0, os.urandom(SIZE))
        writer.commit()
    store.set_plan([h(KEYS[0]), h(KEYS[1])], name_hash)  # two entries the plan does not keep
    assert _room_for_plan(store, 0) and _room_for_plan(store, 1)
    assert not _room_for_plan(store, 2)  # two starting: their room is taken
    store.close()


@pytest.mark.parametrize("eviction", ["lru", "hold"])
def test_the_plans_prefetches_are_applied_under_every_policy(tmp_path: Path, origin: Path, stub: StubMaster,
                                                            start_daemon: Any, eviction: str):
    async def answer(report: NodeReport, request: web.Request) -> web.StreamResponse:
        return await stub.plan(report, request, prefetch=(PrefetchItem("j", "bkt", KEYS[4], 1),), keep=array("Q", [h(KEYS[0])]))

    stub.answer = answer
    daemon = start_daemon(settings_for(tmp_path, origin, (stub.url,), eviction=eviction))
    wait_until(lambda: h(KEYS[4]) in cached_names(tmp_path), timeout=20, what="the prefetch")
    stats = daemon.stats()
    assert stats["cache"]["policy"] == {}  # ranks are planned's only
    assert "ranked_items" not in stats["master"]["plan"]


def test_a_follower_leads_to_the_leader(tmp_path: Path, origin: Path, stub: StubMaster, start_daemon: Any):
    follower = StubMaster().start()
    outsider = StubMaster().start()  # named by the follower too, but not one of --master: never asked
    try:
        async def not_leader(report: NodeReport, request: web.Request) -> web.StreamResponse:
            return web.json_response({"error": "NotLeader", "message": "standby", "leader": stub.url}, status=503)

        async def elsewhere(report: NodeReport, request: web.Request) -> web.StreamResponse:
            return web.json_response({"error": "NotLeader", "message": "standby", "leader": outsider.url}, status=503)

        follower.answer = not_leader
        daemon = start_daemon(settings_for(tmp_path, origin, (follower.url, stub.url)))
        wait_until(lambda: len(stub.taken()) >= 3, timeout=20, what="reports at the leader")
        assert len(follower.taken()) == 1  # asked once, then the leader it named, from then on
        assert stub.taken()[0].full and daemon.stats()["master"]["url"] == stub.url
        assert outcome(daemon, "not_leader") == 1
        follower.answer = elsewhere
        stub.answer = elsewhere  # both standbys now, naming a master not given: nobody to report to
        wait_until(lambda: outcome(daemon, "not_leader") >= 5, timeout=20, what="standbys")
        assert outsider.taken() == []  # the token goes to the masters given only
        read(daemon, KEYS[0])
    finally:
        follower.stop()
        outsider.stop()


HOSTILE: dict[str, tuple[str, Answer]] = {}


def hostile(name: str, outcome_: str) -> Callable[[Answer], Answer]:
    def register(answer: Answer) -> Answer:
        HOSTILE[name] = (outcome_, answer)
        return answer
    return register


@hostile("garbage", "bad_answer")
async def _garbage(report: NodeReport, request: web.Request) -> web.StreamResponse:
    return web.Response(body=b"\x00not json{{", content_type="application/json")


@hostile("not a plan", "bad_answer")
async def _not_a_plan(report: NodeReport, request: web.Request) -> web.StreamResponse:
    return web.json_response({"kind": "shardcache-node-plan-v1", "seq": report.seq, "prefetch": "everything"})


@hostile("deep", "bad_answer")
async def _deep(report: NodeReport, request: web.Request) -> web.StreamResponse:
    return web.Response(body=b"[" * 100_000, content_type="application/json")


@hostile("another report's plan", "bad_answer")
async def _wrong_seq(report: NodeReport, request: web.Request) -> web.StreamResponse:
    return web.json_response(NodePlan(seq=report.seq + 7).to_json())


@hostile("huge", "too_large")
async def _huge(report: NodeReport, request: web.Request) -> web.StreamResponse:
    return web.Response(body=b" " * (MAX_PLAN_BYTES + 1), content_type="application/json")


@hostile("huge, streamed", "too_large")
async def _huge_chunked(report: NodeReport, request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse()
    response.enable_chunked_encoding()
    await response.prepare(request)
    with contextlib.suppress(ConnectionError):
        for _ in range(MAX_PLAN_BYTES // (1 << 20) + 2):
            await response.write(b" " * (1 << 20))
    return response


@hostile("redirect", "bad_answer")
async def _redirect(report: NodeReport, request: web.Request) -> web.StreamResponse:
    return web.Response(status=307, headers={"Location": "http://127.0.0.1:1/v1/nodes/node-a/report"})


@hostile("500", "server_error")
async def _error(report: NodeReport, request: web.Request) -> web.StreamResponse:
    return web.Response(status=500, text="boom")


@hostile("token refused", "refused")
async def _refused(report: NodeReport, request: web.Request) -> web.StreamResponse:
    return web.json_response({"error": "Unauthorized", "message": "bad token"}, status=401)


@hostile("report refused", "rejected")
async def _rejected(report: NodeReport, request: web.Request) -> web.StreamResponse:
    return web.json_response({"error": "BadRequest", "message": "report.held: not base64"}, status=400)


@hostile("slow", "unreachable")
async def _slow(report: NodeReport, request: web.Request) -> web.StreamResponse:
    await asyncio.sleep(3)  # past the link's 1 s
    return web.json_response(NodePlan(seq=report.seq).to_json())


@hostile("stalled body", "unreachable")
async def _stalled(report: NodeReport, request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Length": "1000"})
    await response.prepare(request)
    await response.write(b"{")
    await asyncio.sleep(3)
    return response


def test_a_hostile_master_never_touches_serving(tmp_path: Path, origin: Path, stub: StubMaster, start_daemon: Any):
    daemon = start_daemon(settings_for(tmp_path, origin, (stub.url,)))
    wait_until(lambda: outcome(daemon, "ok") >= 1, timeout=20, what="a first plan")
    for name, (expected, answer) in HOSTILE.items():
        stub.answer = answer
        before = outcome(daemon, expected)
        for key in KEYS[:3]:  # reads go on, answered at once, whatever the master does
            began = time.monotonic()
            assert read(daemon, key) == (origin / "bkt" / key).read_bytes()
            assert time.monotonic() - began < 5, name
        wait_until(lambda e=expected, b=before: outcome(daemon, e) > b, timeout=30, what=f"{name}: {expected} counted")
        stats = daemon.stats()["master"]
        assert stats["failures_in_a_row"] >= 1 and stats["last_error"], (name, stats)
    stub.answer = stub.plan
    wait_until(lambda: daemon.stats()["master"]["failures_in_a_row"] == 0, timeout=30, what="the master back")
    assert outcome(daemon, "error") == 0  # nothing of it was a failure of the daemon's own
    daemon.settle()
    wait_until(lambda: stub.view() == cached_names(tmp_path), timeout=20, what="the view")


def test_held_names_count_versions_and_carry_what_was_not_taken():
    held = HeldNames(max_pending=4)

    def entry(key: str, etag: str = "e") -> Entry:
        return Entry(id=f"{key}:{etag}", bucket="bkt", key=key, etag=etag, size=1, xxh3_128="", created=0)

    a1, a2, b, c = entry("a"), entry("a", "f"), entry("b"), entry("c")
    held([a1, a2], [])
    assert sorted(held.take_full()) == [h("a")]  # a name once, whatever its versions
    held([b], [a1])  # a's other version stays: not dropped
    sent = held.take_delta()
    assert sent is not None and (list(sent[0]), list(sent[1])) == ([h("b")], [])
    held([c], [b])  # while that report is out: b goes again, c comes
    held.give_back(sent)  # the report was lost: its changes and the later ones, together
    delta = held.take_delta()
    assert delta is not None and (sorted(delta[0]), list(delta[1])) == ([h("c")], [])
    held([entry(k) for k in "defgh"], [])  # more changes than kept: the next report is full
    assert held.take_delta() is None
    assert len(held.take_full()) == 7
    held.give_back(None)  # a full report lost: the next is full again
    assert held.take_delta() is None


def test_serve_refuses_a_master_without_a_node(tmp_path: Path):
    from sidecar.cli import build_parser
    from sidecar.cli.commands.serve import build_settings

    def settings(*args: str) -> Any:
        return build_settings(build_parser().parse_args(["serve", "--origin", f"file://{tmp_path}", *args]))

    with pytest.raises(UserError, match="--master needs --node"):
        settings("--master", "http://m:8700")
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(UserError, match="is empty"):
        settings("--master", "http://m:8700", "--node", "n1", "--master-token-file", str(tmp_path / "empty"))
    with pytest.raises(UserError, match="invalid address"):
        settings("--master", "ftp://m", "--node", "n1")
    with pytest.raises(UserError, match="give --master"):
        settings("--master-token-file", str(tmp_path / "empty"))
    (tmp_path / "token").write_text(f"{TOKEN}\n")
    built = settings("--master", "http://m1:8700, http://m2:8700", "--node", "n1", "--master-token-file",
                     str(tmp_path / "token"), "--eviction", "planned")
    assert built.master == MasterLinkSettings(urls=("http://m1:8700", "http://m2:8700"), token=TOKEN)
    assert built.store.eviction == "planned"
    with pytest.raises(ValueError, match="--master needs --node"):
        dataclasses.replace(built, node=None)


@pytest.mark.slow
def test_against_a_real_master(tmp_path: Path, origin: Path):
    """``shardcache serve --master`` and ``shardcache master``, real processes: the master takes the
    daemon's reports (its own parser), and its plan for a job whose trainer leases on the daemon's
    node is applied: the shards the trainer will be leased next are prefetched, for that job."""
    from loader.master.client import MasterClient

    with running_master(tmp_path) as master:
        daemon = DaemonProcess([
            "--origin", f"file://{origin}", "--cache-dir", str(tmp_path / "cache"), "--cache-size", "1GiB",
            "--min-free", "0", "--node", "node-a", "--master", master, "--eviction", "planned",
        ], tmp_path / "daemon.log")
        daemon.start()
        client = MasterClient(master)
        try:
            def stats() -> dict[str, Any]:
                status, body = http_get(daemon.url + "/_shardcache/stats")
                answer: dict[str, Any] = json.loads(body)
                return answer

            wait_until(lambda: stats()["master"]["reports"]["delta"] >= 1 and stats()["master"]["failures_in_a_row"] == 0,
                       timeout=30, what="the master to take a full report and a delta")
            assert stats()["master"]["last_error"] is None
            _, text = http_get(master + "/metrics")
            assert re.search(rb'node_reports_total\{[^}]*"applied"\} [1-9]', text), text[-2000:]

            shards = [{"key": key, "size": SIZE + i, "samples": 1} for i, key in enumerate(KEYS)]
            client.create_job({"name": "train", "dataset": "s3://bkt/", "shards": shards, "seed": 3, "epochs": 2,
                               "locality_window": 1})
            lease = client.lease("train", "t1", "node-a", 1)["leases"][0]
            assert http_get(f"{daemon.url}/bkt/{lease['key']}", {JOB_HEADER: "train"})[0] == 200
            wait_until(lambda: stats()["jobs"].get("train", {}).get("prefetch_bytes", 0) > 0, timeout=30,
                       what="the plan's prefetches for the job")
            jobs = stats()["jobs"]["train"]
            assert jobs["reads"] == 1 and jobs["origin_bytes"] + jobs["hit_bytes"] == SIZE + KEYS.index(lease["key"])
            assert stats()["cache"]["policy"]["ranked_items"] >= 1
        finally:
            client.close()
            daemon.stop()
