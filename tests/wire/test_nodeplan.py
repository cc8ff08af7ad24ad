"""The node report and plan documents: round trips, and every malformed document refused with a
message naming where it is wrong (never another exception)."""

from __future__ import annotations

import copy
import json
import random
from array import array
from typing import Any

import pytest
import xxhash

from wire.errors import BadRequest
from wire.nodeplan import (
    JOB_COUNTERS,
    MAX_PREFETCH,
    NodePlan,
    NodeReport,
    PrefetchItem,
    name_hash,
    pack_hashes,
    parse_plan,
    parse_report,
    unpack_hashes,
)


def _report(**over: Any) -> dict[str, Any]:
    doc = NodeReport(
        daemon="d1", seq=3, base=2, held=array("Q", [1, 2**64 - 1]), dropped=array("Q", [7]),
        capacity_bytes=100, used_bytes=50, mean_entry_bytes=10,
        jobs={"job-a": dict.fromkeys(JOB_COUNTERS, 1)},
    ).to_json()
    doc.update(over)
    return doc


def test_report_round_trip() -> None:
    doc = json.loads(json.dumps(_report()))
    report = parse_report(doc)
    assert list(report.held) == [1, 2**64 - 1] and list(report.dropped) == [7]
    assert not report.full and report.jobs["job-a"]["hit_bytes"] == 1
    assert parse_report(report.to_json()) == report


def test_plan_round_trip() -> None:
    plan = NodePlan(seq=4, prefetch=(PrefetchItem("j", "b", "k/1.tar", 12),), keep=array("Q", [5, 6]))
    again = parse_plan(json.loads(json.dumps(plan.to_json())))
    assert again == plan


def test_name_hash_is_bucket_slash_key() -> None:
    assert name_hash("b", "k") == xxhash.xxh3_64_intdigest(b"b/k") != name_hash("b", "k2")
    assert list(unpack_hashes(pack_hashes([name_hash("b", "k")]), "x")) == [name_hash("b", "k")]


@pytest.mark.parametrize(("change", "where"), [
    ({"kind": "x"}, "kind"),
    ({"daemon": ""}, "report.daemon"),
    ({"daemon": "a b"}, "report.daemon"),
    ({"seq": 0}, "report.seq"),
    ({"seq": True}, "report.seq"),
    ({"base": 3}, "report.base"),
    ({"held": "!!"}, "report.held"),
    ({"held": "AAAA"}, "report.held"),
    ({"held": 5}, "report.held"),
    ({"dropped": pack_hashes([1]), "base": None}, "report.dropped"),
    ({"capacity_bytes": -1}, "report.capacity_bytes"),
    ({"used_bytes": 1.5}, "report.used_bytes"),
    ({"jobs": []}, "report.jobs"),
    ({"jobs": {"": dict.fromkeys(JOB_COUNTERS, 0)}}, "report.jobs"),
    ({"jobs": {"a": {"reads": 1}}}, "report.jobs['a']"),
    ({"jobs": {"a": {**dict.fromkeys(JOB_COUNTERS, 0), "x": 1}}}, "report.jobs['a']"),
    ({"extra": 1}, "extra"),
])
def test_bad_reports_are_named(change: dict[str, Any], where: str) -> None:
    with pytest.raises(BadRequest, match=rf"^{where.replace('[', '.').replace(']', '.')}|{where}"):
        parse_report(_report(**change))


def test_missing_report_field() -> None:
    doc = _report()
    del doc["jobs"]
    with pytest.raises(BadRequest, match="missing field 'jobs'"):
        parse_report(doc)


@pytest.mark.parametrize(("change", "where"), [
    ({"kind": "shardcache-node-report-v1"}, "plan: kind"),
    ({"resend": "partial"}, "plan.resend"),
    ({"interval_s": 0}, "plan.interval_s"),
    ({"interval_s": "2"}, "plan.interval_s"),
    ({"prefetch": {}}, "plan.prefetch"),
    ({"prefetch": [{"job": "j", "bucket": "b", "key": "k"}] * 1}, r"plan.prefetch\[0\]"),
    ({"prefetch": [{"job": "j", "bucket": "", "key": "k", "next_use": 1}]}, r"plan.prefetch\[0\].bucket"),
    ({"prefetch": [{"job": "j", "bucket": "b", "key": "k", "next_use": 1}] * (MAX_PREFETCH + 1)}, "plan.prefetch"),
    ({"keep": "A"}, "plan.keep"),
    ({"seq": -1}, "plan.seq"),
])
def test_bad_plans_are_named(change: dict[str, Any], where: str) -> None:
    doc = NodePlan(seq=1).to_json()
    doc.update(change)
    with pytest.raises(BadRequest, match=where):
        parse_plan(doc)


def _mutations(doc: Any, rng: random.Random) -> Any:
    values: list[Any] = [None, True, -1, 0, 2**70, 1.5, "", "x" * 300, [], {}, [1], {"a": 1}, "AAAAAAAAAAA="]
    out = copy.deepcopy(doc)
    if isinstance(out, dict) and out:
        key = rng.choice(sorted(out))
        out[key] = _mutations(out[key], rng) if rng.random() < 0.4 else rng.choice(values)
        return out
    if isinstance(out, list) and out:
        i = rng.randrange(len(out))
        out[i] = _mutations(out[i], rng) if rng.random() < 0.4 else rng.choice(values)
        return out
    return rng.choice(values)


def test_fuzzed_documents_raise_only_bad_request() -> None:
    rng = random.Random(32)
    plan = NodePlan(seq=2, prefetch=(PrefetchItem("j", "b", "k", 1),), keep=array("Q", [3])).to_json()
    for _ in range(3000):
        for parse, doc in ((parse_report, _report()), (parse_plan, plan)):
            try:
                parse(_mutations(doc, rng))
            except BadRequest:
                pass
