"""``shardcache status``'s view of each job's cache: the ``cache`` section of the master's job
status (summed from what node daemons started with ``--master`` report, wire/nodeplan.py) as a line
per job, a table of its nodes with ``--job`` (worst first, 50 at most), a WARNING when the hit rate
is low while the trainers wait, and ``--json`` passing the section through unchanged.

The renderer is fed the section's shapes directly: full, null and missing figures, no nodes, no
section (an older master), 2,000 nodes, nodes the master left out (``nodes_omitted``). The CLI
itself runs against a real ``shardcache master``: with sections a real master makes only with
many daemons reporting (or, for an older master, not at all) added to its real answers at the
client's HTTP exchange (``MasterClient._exchange``, the CLI run in this process), as the page test
adds them at the browser's ``fetch``; and end to end, with a node report posted to the master
(``POST /v1/nodes/{node}/report``) and the section it makes."""

from __future__ import annotations

import copy
import json
import os
import re
from array import array
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from loader.master.client import MasterClient
from sidecar.cli import main
from sidecar.cli.commands.status import CACHE_NODE_ROWS, cache_line, cache_node_lines, cache_warnings
from tests.support.cli import run_cli
from tests.support.masters import MasterProcess, http
from wire.nodeplan import NodeReport
from wire.stall import WAIT_BUCKETS_S, encode_wait

GiB = 1 << 30
HEADER = ["NODE", "TRAINERS", "HIT RATE", "ORIGIN", "PEER", "PREFETCHED", "HELD/PLANNED", "LEAD", "WAIT", "REPORT AGE"]


def _node(node: str, **figures: Any) -> dict[str, Any]:
    """One node of a section, the figures of the section's documented example; ``figures`` override."""
    row = {"node": node, "report_age_s": 1.2, "trainers": 2, "reads": 10, "hit_bytes": 1000, "origin_bytes": 100,
           "peer_bytes": 0, "prefetch_bytes": 500, "hit_rate": 0.909, "held_shards": 12, "planned_shards": 20,
           "prefetch_lead_shards": 5, "wait_fraction": 0.01}
    row.update(figures)
    return row


def _section(nodes: list[dict[str, Any]], **totals: Any) -> dict[str, Any]:
    base = {"reads": 0, "hit_bytes": 0, "origin_bytes": 0, "peer_bytes": 0, "prefetch_bytes": 0, "hit_rate": None}
    return {"reporting_nodes": len(nodes), "totals": {**base, **totals}, "nodes": nodes, "nodes_omitted": 0}


def _job(name: str, cache: Any = None, wait: float | None = None) -> dict[str, Any]:
    job: dict[str, Any] = {"name": name, "wait": {"fraction_60s": wait, "trainers_waiting": 0}}
    if cache is not None:
        job["cache"] = cache
    return job


def _cells(line: str) -> list[str]:
    return re.split(r"\s{2,}", line.strip())


def _column_starts(line: str, cells: list[str]) -> list[int]:
    starts, at = [], 0
    for cell in cells:
        at = line.index(cell, at)
        starts.append(at)
        at += len(cell)
    return starts


# -- the renderer, fed the section's shapes --------------------------------------------------------


def test_a_jobs_cache_line_from_each_shape_of_the_section() -> None:
    example = _section([_node("n1"), _node("n2")], reads=20, hit_bytes=2000, origin_bytes=3 * GiB, peer_bytes=1536,
                       prefetch_bytes=1000, hit_rate=0.909)
    assert cache_line(_job("resnet50", example)) == (
        "resnet50: cache hit rate 90.9%, origin 3.0 GiB, peer 1.5 KiB, prefetched 1000 B, 20 reads; 2 node(s) reporting")
    # An older master (no section, or not an object): nothing, the output stays as it was.
    assert cache_line(_job("old")) is None
    assert cache_line({"name": "old", "cache": None}) is None
    assert cache_line({"name": "old", "cache": [1, 2]}) is None
    # A section with no report yet.
    quiet = cache_line(_job("quiet", _section([])))
    assert quiet is not None and quiet.startswith("quiet: cache: no node reports yet (node daemons started with --master")
    assert cache_line(_job("quiet", {"reporting_nodes": 0})) == quiet
    # Null, missing and mistyped figures are "-", never a made-up 0.
    assert cache_line(_job("j", {"reporting_nodes": 1, "totals": {"hit_rate": None, "reads": True, "origin_bytes": "x"},
                                 "nodes": [{"node": "n1"}]})) == (
        "j: cache hit rate -, origin -, peer -, prefetched -, - reads; 1 node(s) reporting")
    assert cache_line(_job("j", {"reporting_nodes": 3, "totals": None, "nodes": None})) == (
        "j: cache hit rate -, origin -, peer -, prefetched -, - reads; 3 node(s) reporting")


def test_the_node_table_puts_the_worst_first_with_null_figures_as_dashes() -> None:
    nodes = [
        _node("n1"),  # the documented example
        _node("n2", hit_rate=0.2, wait_fraction=0.3, origin_bytes=3 * GiB, prefetch_bytes=None, report_age_s=125.0,
              prefetch_lead_shards=2, fetching_through=True),  # its plans fetch through: marked
        _node("n3", hit_rate=None, wait_fraction=None, trainers=0, held_shards=None, report_age_s=7300.0),
        _node("n4\x1b[2J", hit_rate=0.5, wait_fraction=0.01),  # names come from daemons: printed safe
        {"node": "n5", "trainers": float("inf"), "origin_bytes": float("nan")},  # left out, or not a number
        "not a node",
    ]
    lines = cache_node_lines(_job("resnet50", _section(nodes)))
    assert [_cells(line) for line in lines] == [
        HEADER,
        ["n2", "2", "20.0%", "3.0 GiB", "0 B", "-", "12/20", "2 through", "30.0%", "2m05s"],
        ["n4?[2J", "2", "50.0%", "100 B", "0 B", "500 B", "12/20", "5", "1.0%", "1.2s"],
        ["n1", "2", "90.9%", "100 B", "0 B", "500 B", "12/20", "5", "1.0%", "1.2s"],
        ["n3", "0", "-", "100 B", "0 B", "500 B", "-/20", "5", "-", "2.0h"],
        ["n5", "-", "-", "-", "-", "-", "-/-", "-", "-", "-"],
    ]
    # Aligned: every row's cells start where the header's do.
    starts = _column_starts(lines[0], HEADER)
    for line in lines[1:]:
        assert _column_starts(line, _cells(line)) == starts, line
    # Nothing to show: no table.
    assert cache_node_lines(_job("old")) == []
    assert cache_node_lines(_job("quiet", _section([]))) == []


def test_a_job_on_2000_nodes_shows_the_worst_50_and_counts_the_rest() -> None:
    nodes = [_node(f"node-{i:04d}", wait_fraction=(i % 100) / 1000, hit_rate=0.5 + (i % 7) / 20) for i in range(2000)]
    lines = cache_node_lines(_job("big", _section(nodes)))
    assert len(lines) == 1 + CACHE_NODE_ROWS + 1 and CACHE_NODE_ROWS == 50
    assert lines[-1] == "... and 1950 more nodes (shardcache status --job big --json lists them all)"
    rows = [_cells(line) for line in lines[1:-1]]
    expected = sorted(nodes, key=lambda n: (-n["wait_fraction"], n["hit_rate"], n["node"]))[:50]
    assert [r[0] for r in rows] == [n["node"] for n in expected]
    assert rows[0] == ["node-0399", "2", "50.0%", "100 B", "0 B", "500 B", "12/20", "5", "9.9%", "1.2s"]
    assert cache_line(_job("big", _section(nodes, hit_rate=0.6))) is not None
    # The master lists a job's nodes up to a cap (cache.nodes_omitted counts the rest, in the totals).
    capped = {**_section(nodes[:1000]), "reporting_nodes": 2000, "nodes_omitted": 1000}
    assert cache_node_lines(_job("big", capped))[-1] == (
        "... and 1950 more nodes (950 in shardcache status --job big --json, 1000 not listed by the master, "
        "counted in the totals)")
    few = {**_section(nodes[:3]), "reporting_nodes": 5, "nodes_omitted": 2}
    assert cache_node_lines(_job("few", few))[-1] == (
        "... and 2 more nodes (2 not listed by the master, counted in the totals)")
    assert "5 node(s) reporting" in str(cache_line(_job("few", few)))


def test_a_low_hit_rate_while_trainers_wait_is_warned_about() -> None:
    nodes = [_node("n1"), _node("n2", hit_rate=0.1, wait_fraction=0.4, held_shards=2, planned_shards=20),
             _node("n3", hit_rate=0.3, wait_fraction=0.2)]
    low = _section(nodes, hit_rate=0.2, origin_bytes=2 * GiB, peer_bytes=0, prefetch_bytes=0)
    (line,) = cache_warnings([_job("slow", low, wait=0.35)], 0.10, 0.50)
    assert line.startswith("WARNING job slow: cache hit rate 20.0% while trainers waited 35% of the last 60 s for data "
                           "(origin 2.0 GiB, peer 0 B; n2 hit 10.0% wait 40.0%, n3 hit 30.0% wait 20.0%): "), line
    # What to do, from what the nodes report: nothing prefetched, n2 behind its plan.
    assert "start the node daemons with --master" in line
    assert "2 node(s) hold fewer shards than planned for them (n2: 2/20)" in line and "--cache-size" in line
    assert "shardcache warmup" in line
    # Prefetching and nodes holding their plan: only the warm-up advice.
    fed = _section([_node("n1", hit_rate=0.3, wait_fraction=0.3, held_shards=20)], hit_rate=0.3, prefetch_bytes=GiB)
    (line,) = cache_warnings([_job("fed", fed, wait=0.3)], 0.10, 0.50)
    assert "--master" not in line and "planned" not in line and line.endswith("Warm the cache before the epoch (shardcache warmup)")
    # No warning: hit rate high enough, trainers not waiting, figures unknown, no section.
    quiet = [_job("hits", _section(nodes, hit_rate=0.9), wait=0.5), _job("nowait", low, wait=0.05),
             _job("unknown", _section(nodes), wait=0.5), _job("unreported", low), _job("older", wait=0.9)]
    assert cache_warnings(quiet, 0.10, 0.50) == []
    # The thresholds move it.
    assert cache_warnings([_job("hits", _section(nodes, hit_rate=0.9), wait=0.5)], 0.10, 0.95) != []
    assert cache_warnings([_job("slow", low, wait=0.35)], 0.40, 0.50) == []


# -- the CLI against a real master -----------------------------------------------------------------


@pytest.fixture
def master(tmp_path: Path) -> Iterator[MasterProcess]:
    m = MasterProcess(tmp_path, f"sqlite://{tmp_path}/master.db", advertise=False).start()
    try:
        yield m
    finally:
        m.stop()


def _post(master: MasterProcess, path: str, body: dict[str, Any], expect: int = 200) -> Any:
    status, answer = http("POST", master.url + path, body)
    assert status == expect, (path, status, answer)
    return answer


def _jobs(master: MasterProcess, *names: str) -> None:
    shards = [{"key": f"s-{i}.tar", "size": 10, "samples": 4} for i in range(8)]
    for name in names:
        _post(master, "/v1/jobs", {"name": name, "dataset": "s3://b/p/", "shards": shards}, expect=201)


def _wait_report(master: MasterProcess, job: str, trainer: str, seconds: float) -> None:
    """``trainer`` waited ``seconds`` of its last 10 s (``POST /v1/jobs/{job}/wait``)."""
    buckets = [30 if i == 6 else 0 for i in range(len(WAIT_BUCKETS_S))]
    _post(master, f"/v1/jobs/{job}/wait", {"trainer": trainer, "wait": encode_wait(seconds, 30, 10, buckets)}, expect=204)


def _add_sections(monkeypatch: pytest.MonkeyPatch, sections: dict[str, dict[str, Any] | None]) -> None:
    """The master's real answers to ``GET /v1/jobs`` and ``GET /v1/jobs/{job}``, each job named in
    ``sections`` given that section (a copy: the CLI must pass what it got, not share the test's;
    ``None``: no section, as from a master older than it)."""
    real = MasterClient._exchange

    def exchange(self: MasterClient, url: str, method: str, path: str, payload: bytes | None,
                 extra: Any = None) -> tuple[int, Any]:
        status, answer = real(self, url, method, path, payload, extra)
        if method == "GET" and status == 200 and isinstance(answer, dict) and path.startswith("/v1/jobs"):
            for job in answer["jobs"] if path == "/v1/jobs" else [answer]:
                if job.get("name") not in sections:
                    continue
                section = sections[job["name"]]
                if section is None:
                    job.pop("cache", None)
                else:
                    job["cache"] = copy.deepcopy(section)
        return status, answer

    monkeypatch.setattr(MasterClient, "_exchange", exchange)


def _status(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    """``shardcache status ARGS`` in this process (where the sections are added): (exit, stdout)."""
    capsys.readouterr()
    code = main(["status", *args])
    return code, capsys.readouterr().out


def test_status_shows_and_passes_through_the_cache_sections(master: MasterProcess, capsys: pytest.CaptureFixture[str],
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [k for k in os.environ if k.startswith("SHARDCACHE_")]:
        monkeypatch.delenv(name)  # the developer's own settings are no part of the test
    _jobs(master, "slow", "older", "quiet", "big")
    _post(master, "/v1/jobs/slow/leases", {"trainer": "t1", "node": "n2", "count": 1})
    _wait_report(master, "slow", "t1", 4.0)  # 40% of its last 10 s
    slow = _section([_node("n1"), _node("n2", hit_rate=0.1, wait_fraction=0.4, held_shards=2, origin_bytes=GiB)],
                    reads=20, hit_bytes=2000, origin_bytes=GiB + 100, prefetch_bytes=1000, hit_rate=0.2)
    big = _section([_node(f"node-{i:04d}", wait_fraction=(i % 100) / 1000, hit_rate=None if i % 9 == 0 else 0.9)
                    for i in range(2000)], hit_rate=0.9)
    sections: dict[str, dict[str, Any] | None] = {"slow": slow, "quiet": _section([]), "big": big}
    _add_sections(monkeypatch, {**sections, "older": None})

    # --json: each job's section as the master gave it, the warnings as printed; "older" has none.
    code, out = _status(capsys, "--master", master.url, "--json")
    assert code == 0
    doc = json.loads(out)["master"]
    by_name = {job["name"]: job for job in doc["jobs"]}
    for name, section in sections.items():
        assert by_name[name]["cache"] == section, name
    assert "cache" not in by_name["older"]
    (warning,) = doc["cache_warnings"]
    assert warning.startswith("WARNING job slow: cache hit rate 20.0% while trainers waited 40% ")
    code, out = _status(capsys, "--master", master.url, "--job", "big", "--json")
    assert code == 0 and json.loads(out)["master"]["jobs"][0]["cache"] == big

    # The human output: a cache line per job with a section, the warning, no per-node table.
    code, out = _status(capsys, "--master", master.url)
    assert code == 0, out
    lines = out.splitlines()
    assert [line for line in lines if ": cache" in line and not line.startswith("WARNING")] == [
        "big: cache hit rate 90.0%, origin 0 B, peer 0 B, prefetched 0 B, 0 reads; 2000 node(s) reporting",
        "quiet: cache: no node reports yet (node daemons started with --master report what their trainers read "
        "every few seconds)",
        "slow: cache hit rate 20.0%, origin 1.0 GiB, peer 0 B, prefetched 1000 B, 20 reads; 2 node(s) reporting",
    ]
    assert [line for line in lines if line.startswith("WARNING")] == [
        next(line for line in lines if line.startswith("WARNING job slow: trainers waited")), warning]
    assert not any(_cells(line) == HEADER for line in lines)

    # --job: the table of its nodes, worst first; a job on 2,000 nodes shows 50 and counts the rest.
    code, out = _status(capsys, "--master", master.url, "--job", "slow")
    assert code == 0, out
    lines = out.splitlines()
    top = lines.index(next(line for line in lines if _cells(line) == HEADER))
    assert [_cells(line)[0] for line in lines[top + 1:top + 3]] == ["n2", "n1"]
    assert _cells(lines[top + 1]) == ["n2", "2", "10.0%", "1.0 GiB", "0 B", "500 B", "2/20", "5", "40.0%", "1.2s"]
    code, out = _status(capsys, "--master", master.url, "--job", "big")
    lines = out.splitlines()
    top = lines.index(next(line for line in lines if _cells(line) == HEADER))
    assert len([line for line in lines[top + 1:] if line.startswith("node-")]) == 50
    assert "... and 1950 more nodes (shardcache status --job big --json lists them all)" in lines
    code, out = _status(capsys, "--master", master.url, "--job", "older")
    assert code == 0 and "cache" not in out and "NODE" not in out

    # The threshold is a flag of its own; the exit status stays that of what answered.
    code, out = _status(capsys, "--master", master.url, "--warn-hit-rate", "10%")
    assert code == 0 and "cache hit rate 20.0% while" not in out
    code = main(["status", "--master", master.url, "--warn-hit-rate", "most"])
    assert code == 2 and "--warn-hit-rate must be a percentage such as 50 or 50%" in capsys.readouterr().err
    assert _status(capsys, "--master", master.url, "--job", "nope")[0] == 1


def _without_ages(cache: Any) -> Any:
    """A section without its report ages, which move between two reads of it."""
    if not isinstance(cache, dict):
        return cache
    nodes = [{k: v for k, v in n.items() if k != "report_age_s"} for n in cache.get("nodes") or []]
    return {**cache, "nodes": nodes}


def test_status_passes_the_real_masters_own_answer_through(master: MasterProcess) -> None:
    """Nothing added: what ``--json`` gives for the job's cache is what the master's API says, a
    section or none (a master without node reports), and the human output agrees."""
    _jobs(master, "plain")
    result = run_cli(["status", "--master", master.url, "--job", "plain", "--json"])
    assert result.returncode == 0, result.stderr
    (job,) = json.loads(result.stdout)["master"]["jobs"]
    status, own = http("GET", f"{master.url}/v1/jobs/plain")
    assert status == 200
    assert _without_ages(job.get("cache")) == _without_ages(own.get("cache"))
    human = run_cli(["status", "--master", master.url, "--job", "plain"])
    assert human.returncode == 0, human.stderr
    assert ("plain: cache" in human.stdout) == isinstance(own.get("cache"), dict), human.stdout


def test_status_shows_a_node_report_posted_to_the_master(master: MasterProcess) -> None:
    """End to end: a node daemon's report (wire/nodeplan.py) for the job, posted to the master,
    shows in the job's cache line and node table."""
    _jobs(master, "resnet")
    _post(master, "/v1/jobs/resnet/leases", {"trainer": "t1", "node": "n1", "count": 2})
    counters = {"reads": 10, "hit_bytes": 1000, "origin_bytes": 100, "peer_bytes": 0, "prefetch_bytes": 500}
    report = NodeReport(daemon="daemon-n1", seq=1, base=None, held=array("Q"), dropped=array("Q"), capacity_bytes=GiB,
                        used_bytes=1100, mean_entry_bytes=1100, jobs={"resnet": counters})
    status, body = http("POST", f"{master.url}/v1/nodes/n1/report", report.to_json())
    assert status == 200, (status, body)
    result = run_cli(["status", "--master", master.url, "--job", "resnet", "--json"])
    assert result.returncode == 0, result.stderr
    (job,) = json.loads(result.stdout)["master"]["jobs"]
    own = http("GET", f"{master.url}/v1/jobs/resnet")[1]
    assert _without_ages(job["cache"]) == _without_ages(own["cache"]) and job["cache"]["reporting_nodes"] == 1
    human = run_cli(["status", "--master", master.url, "--job", "resnet"])
    lines = human.stdout.splitlines()
    assert any(line.startswith("resnet: cache hit rate") and "1 node(s) reporting" in line for line in lines), human.stdout
    row = _cells(next(line for line in lines if line.startswith("n1 ")))
    assert row[0] == "n1" and row[3] == "100 B" and row[5] == "500 B", row
