"""Job specs held in columns and create bodies parsed as they stream (spec.py, spec_stream.py):
the columns round-trip, the streaming parser refuses exactly what the decoded-dict validation
refuses, with the same messages, a join compares instead of building, and the bounds hold
over HTTP on a real master process: body size (gzip counted decompressed), gzip bombs, jobs per
master; what a large spec costs in memory; and what reading it back costs on a restart (journal
records and snapshots read in place, the journal and SQLite letting go of the last record)."""

from __future__ import annotations

import asyncio
import gzip
import http.client as httpclient
import json
import random
import sys
import threading
import tracemalloc
import uuid
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loader.master.client import MasterClient
from loader.master.errors import BadRequest, JobConflict, TooManyJobs
from loader.master.server.events import Complete, CreateJob, Fail, Lease, event_from_json, event_to_text
from loader.master.server.journal import Journal
from loader.master.server.spec import JobSpec, ShardSpec, ShardTable, TableBuilder, read_log_spec, spec_diff
from loader.master.server.spec_stream import SpecStream
from loader.master.server.state import MasterState
from loader.master.server.store_sqlite import SqliteStore
from tests.support.masters import MasterProcess, http, job_spec
from tests.support.proxies import TcpForwarder
from wire.errors import InvalidBody
from wire.web import decode_json_object

pytestmark = pytest.mark.timeout(120)

MAX_INT = 2**63 - 1


def realistic(n: int, seed: int = 1, prefix: str = "imagenet/train/shard-") -> list[dict[str, Any]]:
    rng = random.Random(seed)
    return [{"key": f"{prefix}{i:06d}.tar", "size": rng.randint(80_000_000, 120_000_000), "samples": rng.randint(900, 1100)}
            for i in range(n)]


def canonical(spec: JobSpec) -> str:
    return json.dumps(spec.to_json(), separators=(",", ":"))


def stream(body: bytes, *, chunk: int = 0, existing: ShardTable | None = None, max_shards: int = 1_000_000) -> JobSpec:
    """The body through the server's parser, ``chunk`` bytes at a time (0: whole)."""
    parser = SpecStream(max_shards=max_shards, existing=lambda name: existing)
    try:
        step = chunk or max(1, len(body))
        for i in range(0, len(body), step):
            parser.feed(body[i : i + step])
            parser.resume()
        return parser.finish()
    finally:
        parser.close()


def decoded(body: bytes, max_shards: int = 1_000_000) -> JobSpec:
    """The body as the master validated it before streaming: decoded, then JobSpec.from_json."""
    try:
        raw = decode_json_object(body)
    except InvalidBody as exc:
        raise BadRequest(str(exc)) from None
    return JobSpec.from_json(raw, max_shards=max_shards)


# -- the columns ---------------------------------------------------------------------------------


def test_a_spec_round_trips_through_its_text_and_the_log() -> None:
    cases = [
        realistic(10),
        realistic(5000),  # over the plain-text threshold: kept compressed
        ["bare-key", {"key": "b", "size": None, "samples": 3}, {"key": "c"}],
        [{"key": k, "size": i, "samples": None} for i, k in enumerate(["é/ü.tar", "日本/データ.tar", "x\"y\\z", "tab\there", "a"])],
        [{"key": "same-prefix-and-suffix", "size": 0, "samples": 0}],  # one key: all prefix
        [{"key": "ab"}, {"key": "abab"}, {"key": "ab" * 3}],  # prefix and suffix would overlap
        [{"key": "a\ud800b"}],  # a lone surrogate is a legal str
    ]
    for shards in cases:
        spec = JobSpec.from_json({"name": "rt", "dataset": "s3://b/", "shards": shards, "epochs": 2, "lease_ttl_s": 7})
        assert spec.json_text == canonical(spec)
        again = JobSpec.from_log(json.loads(spec.json_text))
        assert again == spec and again.json_text == spec.json_text and spec_diff(again, spec) == []
        assert [s.to_json() for s in again.shards] == [s.to_json() for s in spec.shards]
        event = event_from_json(json.loads(event_to_text(CreateJob(spec))))
        assert isinstance(event, CreateJob) and event.spec == spec


def test_the_state_machine_snapshots_and_reloads_a_columnar_spec() -> None:
    state = MasterState()
    spec = JobSpec.from_json({"name": "snap", "dataset": "s3://b/", "shards": realistic(6000)})
    assert state.apply(CreateJob(spec), 1.0).created
    reloaded = MasterState.from_json(json.loads(state.snapshot_text()))
    assert reloaded.jobs["snap"].spec == spec


_ODD_KEYS = [
    '},{"key":"x"}', '}],"epochs":1', '"quoted"', "back\\slash\\", "new\nline", "é/ü.tar", "a\ud800b", "[", "]",
]


def test_a_logged_spec_is_read_in_place_as_it_was_logged() -> None:
    """read_log_spec (a restart's reader of create records and snapshots) gives what
    JobSpec.from_log of the decoded text gives, for keys that hold the very sequences it looks for."""
    cases = [
        realistic(20_000),  # several of its blocks
        [{"key": k, "size": None if i % 2 else i, "samples": i if i % 3 else None} for i, k in enumerate(_ODD_KEYS)],
        ["only"],
    ]
    for shards in cases:
        spec = JobSpec.from_json({"name": "log", "dataset": 's3://b/"x"/', "shards": shards, "epochs": None, "seed": -5,
                                  "shuffle": False, "lease_ttl_s": 2.5, "max_failures": 9})
        text = spec.json_text
        again = JobSpec.from_log_text(text)
        assert again == JobSpec.from_log(json.loads(text)) == spec
        assert again.json_text == text and again.table.sha256 == spec.table.sha256
        assert (again.epochs, again.seed, again.shuffle, again.lease_ttl_s, again.max_failures) == (None, -5, False, 2.5, 9)
        # In place, inside a longer text (a record or a snapshot): it says where the spec ends.
        inner, end = read_log_spec("xy" + text + ',"next":1}', 2)
        assert inner == spec and end == 2 + len(text)


def test_text_not_laid_out_as_json_text_is_left_to_the_json_decoder() -> None:
    spec = JobSpec.from_json({"name": "v", "dataset": "s3://b/", "shards": realistic(50)})
    spaced = json.dumps(spec.to_json())  # an older writer's layout: the same JSON, other bytes
    with pytest.raises(ValueError):
        JobSpec.from_log_text(spaced)
    with pytest.raises(ValueError):
        JobSpec.from_log_text(spec.json_text + " ")
    state = MasterState()
    state.apply(CreateJob(spec), 1.0)
    for text in (json.dumps(state.to_json()), json.dumps(state.to_json(), separators=(",", ":"))):
        assert MasterState.from_text(text).to_json() == state.to_json()


def test_a_snapshot_text_is_read_back_with_its_specs_in_columns() -> None:
    state = MasterState()
    tricky = [{"key": k} for k in _ODD_KEYS]
    for name, shards in (("a", realistic(9000)), ("b", tricky), ("c", ["one"])):
        state.apply(CreateJob(JobSpec.from_json({"name": name, "dataset": "s3://b/", "shards": shards, "max_failures": 1})), 1.0)
    granted = state.apply(Lease("b", "t", "n", 4, None, tuple(f"lease{i:011d}" for i in range(4))), 2.0).answer["leases"]
    # A failure's error text may hold anything, the sequences the reader splits on included.
    state.apply(Fail("b", granted[0]["lease"], "t", 'boom },{"spec": ],"epochs": \" ☃'), 3.0)
    state.apply(Complete("b", granted[1]["lease"], "t"), 3.0)
    text = state.snapshot_text()
    again = MasterState.from_text(text)
    assert again.to_json() == state.to_json() == MasterState.from_json(json.loads(text)).to_json()
    assert again.snapshot_text() == text
    assert MasterState.from_text(MasterState().snapshot_text()).jobs == {}


@pytest.mark.slow
def test_reading_a_200k_shard_spec_back_costs_a_bounded_number_of_bytes_per_shard() -> None:
    """What a restart pays for a logged spec (tracemalloc), beyond the text it read: under 100 B a
    shard at its peak (the columns as they are collected), where ``json.loads`` made ~600 B."""
    n = 200_000
    text = JobSpec.from_json({"name": "m", "dataset": "s3://b/", "shards": realistic(n)}).json_text
    record = '{"now":1.5,"ev":{"t":"create","spec":' + text + "}}"
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        spec, end = read_log_spec(record, len('{"now":1.5,"ev":{"t":"create","spec":'))
        peak = tracemalloc.get_traced_memory()[1] - base
        held = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    assert end == len(record) - 2 and len(spec.shards) == n
    assert peak < 100 * n, f"reading peaked at {peak / n:.0f} B/shard"
    assert held < 40 * n, f"the spec holds {held / n:.0f} B/shard"


def test_the_journal_and_sqlite_let_go_of_the_last_record(tmp_path: Path) -> None:
    """Once a batch is durable nothing of it stays referenced: not the journal's writer (its loop
    variables), not the store. A 1M-shard job's create record is 73 MB of text."""
    async def main() -> None:
        store = SqliteStore(tmp_path / "m.db")
        await store.open()
        journal = Journal(store)
        journal.start()
        try:
            record = "x" * 5_000_000 + str(uuid.uuid4())  # its own object: nothing else shares it
            alone = sys.getrefcount(record)
            await journal.append((1, record))
            for _ in range(200):  # until the journal lets go of it once written (bounded: 2 s)
                if sys.getrefcount(record) == alone:
                    break
                await asyncio.sleep(0.01)
            assert sys.getrefcount(record) == alone, "the journal still holds the last record it wrote"
            await journal.append((2, "y"))
            assert (await store.load())[2] == [(1, record), (2, "y")]
        finally:
            await journal.stop()
            await store.close()

    asyncio.run(main())


def test_a_tuple_of_shard_specs_still_makes_a_spec() -> None:
    spec = JobSpec("t", "s3://b/", (ShardSpec("k0", 1, 10), ShardSpec("k1", None, None)), None, 3, False, 10.0, 2)
    assert isinstance(spec.shards, ShardTable) and len(spec.shards) == 2
    assert spec.shards[1] == ShardSpec("k1") and spec.shards[-1].key == "k1" and spec.shards[0].samples == 10
    assert list(spec.shards) == [ShardSpec("k0", 1, 10), ShardSpec("k1")] and spec.shards == (ShardSpec("k0", 1, 10), ShardSpec("k1"))
    with pytest.raises(IndexError):
        spec.shards[2]
    assert spec.summary()["shards"] == 2 and len(spec.summary()["shards_sha256"]) == 64


_keys = st.lists(st.text(st.characters(codec="utf-8", exclude_characters="\x00"), min_size=1, max_size=12),
                 min_size=1, max_size=40, unique=True)
_count = st.one_of(st.none(), st.integers(0, MAX_INT))


@settings(max_examples=150, deadline=None)
@given(keys=_keys, data=st.data())
def test_columns_hold_any_list_and_equal_lists_give_equal_columns(keys: list[str], data: st.DataObject) -> None:
    rows = [(k, data.draw(_count), data.draw(_count)) for k in keys]
    table = ShardTable.of(rows)
    assert [(s.key, s.size, s.samples) for s in table] == rows
    assert table == ShardTable.of(rows) and hash(table) == hash(ShardTable.of(rows))
    assert "".join(table.json_chunks()) == json.dumps([{"key": k, "size": a, "samples": b} for k, a, b in rows], separators=(",", ":"))
    if len(rows) > 1:
        assert table != ShardTable.of(rows[:-1]) and table != ShardTable.of([rows[-1], *rows[:-1]])


def test_duplicates_are_found_across_blocks_and_hash_collisions_are_not_duplicates() -> None:
    builder = TableBuilder(dedupe=True)
    for i in range(TableBuilder.BLOCK * 2 + 5):
        builder.add(f"k{i}", None, None)
    assert builder.first_duplicate() is None
    builder.add("k3", 1, 1)  # repeats a key of the first block
    assert builder.first_duplicate() == (TableBuilder.BLOCK * 2 + 5, "k3")


# -- the streaming parser refuses what the dict validation refuses -----------------------------


def _body(**change: Any) -> bytes:
    spec: dict[str, Any] = {"name": "job", "dataset": "s3://b/", "shards": [{"key": "a", "size": 1, "samples": 2}, "b", {"key": "c"}],
                            "seed": 1}
    for key, value in change.items():
        if value is _DROP:
            spec.pop(key, None)
        else:
            spec[key] = value
    return json.dumps(spec).encode()


_DROP = object()
_BAD = {"shards": [{"key": "a"}, {"key": "b"}]}

# (body, fragment of the message): the messages are the ones the master always gave.
HOSTILE: list[tuple[bytes, str]] = [
    (_body(shards=[]), "'shards' must be a non-empty list"),
    (_body(shards="x"), "'shards' must be a non-empty list"),
    (_body(shards={"key": "a"}), "'shards' must be a non-empty list"),
    (_body(shards=_DROP), "'shards' must be a non-empty list"),
    (_body(shards=[{"key": "a"}, {"key": "a"}]), "shards[1].key 'a' appears twice"),
    (_body(shards=[{"key": "a"}, {"key": "b"}, {"key": "a", "size": -1}]), "shards[2].key 'a' appears twice"),
    (_body(shards=[{"key": "a", "size": -1}, {"key": "a"}]), "'shards[0].size' must be an integer in [0, 9223372036854775807], got '-1'"),
    (_body(shards=[{"key": "a", "size": 1.5}]), "'shards[0].size' must be an integer"),
    (_body(shards=[{"key": "a", "size": True}]), "'shards[0].size' must be an integer"),
    (_body(shards=[{"key": "a", "size": "3"}]), "'shards[0].size' must be an integer"),
    (_body(shards=[{"key": "a", "size": [1, 2]}]), "'shards[0].size' must be an integer in [0, 9223372036854775807], got '[1, 2]'"),
    (_body(shards=[{"key": "a", "samples": -2}]), "'shards[0].samples' must be an integer"),
    (_body(shards=[{"key": "a", "size": 1, "samples": {"n": 1}}]), "'shards[0].samples' must be an integer"),
    (_body(shards=[{"key": "a", "extra": 1}]), "shards[0] must be an object with 'key' and optional 'size', 'samples'"),
    (_body(shards=["a", 5]), "shards[1] must be an object"),
    (_body(shards=["a", None]), "shards[1] must be an object"),
    (_body(shards=["a", [1]]), "shards[1] must be an object"),
    (_body(shards=[{"size": 1}]), "shards[0].key must be a non-empty string of at most 1024 characters"),
    (_body(shards=[{"key": ""}]), "shards[0].key must be a non-empty string"),
    (_body(shards=[""]), "shards[0].key must be a non-empty string"),
    (_body(shards=[{"key": "x" * 1025}]), "shards[0].key must be a non-empty string"),
    (_body(shards=[{"key": 5}]), "shards[0].key must be a non-empty string"),
    (_body(shards=[{"key": "a\x00b"}]), "shards[0].key must be a non-empty string"),
    (_body(name="bad name!"), "invalid job name 'bad name!'"),
    (_body(name="x" * 200), "invalid job name"),
    (_body(name=5), "invalid job name"),
    (_body(name=_DROP), "invalid job name"),
    (_body(dataset=""), "'dataset' must be the dataset URL"),
    (_body(dataset=_DROP), "'dataset' must be the dataset URL"),
    (_body(dataset="a\x00"), "'dataset' must be the dataset URL"),
    (_body(epochs=0), "'epochs' must be an integer in [1, 1000000000], got '0'"),
    (_body(epochs="3"), "'epochs' must be an integer"),
    (_body(epochs=True), "'epochs' must be an integer"),
    (_body(epochs=1.5), "'epochs' must be an integer"),
    (_body(epochs=1_000_000_001), "'epochs' must be an integer"),
    (_body(seed="1"), "'seed' must be an integer in [-9223372036854775807, 9223372036854775807], got '1'"),
    (_body(seed=True), "'seed' must be an integer"),
    (_body(seed=[1] * 1000), "'seed' must be an integer"),  # a large container: not kept whole
    (_body(shuffle="yes"), "'shuffle' must be true or false"),
    (_body(shuffle=None), "'shuffle' must be true or false"),
    (_body(shuffle=1), "'shuffle' must be true or false"),
    (_body(lease_ttl_s=0), "'lease_ttl_s' must be a number of seconds in [1, 86400]"),
    (_body(lease_ttl_s="30"), "'lease_ttl_s' must be a number"),
    (_body(lease_ttl_s=True), "'lease_ttl_s' must be a number"),
    (_body(lease_ttl_s=86401), "'lease_ttl_s' must be a number"),
    (_body(max_failures=0), "'max_failures' must be an integer in [1, 1000000]"),
    (_body(max_failures="3"), "'max_failures' must be an integer"),
    (_body(max_failures=True), "'max_failures' must be an integer"),
    (_body(colour="blue"), "unknown job spec field(s) ['colour']: expected some of"),
    (_body(b=1, a={"deep": [1, 2]}), "unknown job spec field(s) ['a', 'b']"),
    # Which error wins when there are several: the order the checks always ran in.
    (_body(colour="blue", name="bad name!"), "unknown job spec field(s)"),
    (_body(name="bad name!", shards=[]), "invalid job name"),
    (_body(shards=[{"key": ""}], epochs=0), "shards[0].key"),
    (_body(dataset="", shards=[]), "'dataset' must be"),
    (_body(shards=[{"key": "a", "size": -1}, "b", "c"], max_failures=0), "'shards[0].size'"),
    (b"[1, 2]", "request body must be a JSON object"),
    (b'"x"', "request body must be a JSON object"),
    (b"null", "request body must be a JSON object"),
    (b"", "request body is empty: send a JSON object"),
    (b"{bad", "request body is not JSON"),
    (b'{"name": "j"', "request body is not JSON"),
    (b'{"name": "j"} {}', "request body is not JSON"),
    (b'{"name": "\xff"}', "request body is not JSON: it is not UTF-8"),
    (b'{"shards": [1, 2}', "request body is not JSON"),  # a syntax error wins over everything
]


@pytest.mark.parametrize(("body", "fragment"), HOSTILE, ids=[f"{i}" for i in range(len(HOSTILE))])
def test_the_stream_refuses_what_the_decoded_spec_refuses_with_the_same_message(body: bytes, fragment: str) -> None:
    with pytest.raises(BadRequest) as old:
        decoded(body)
    assert fragment in old.value.message, old.value.message
    # Whole, byte by byte, in odd chunks; and while a job of that name exists (a join that
    # turns out to differ, or to be invalid, must say the same).
    existing = stream(_body()).table
    for chunk, job in ((0, None), (1, None), (7, None), (0, existing), (5, existing)):
        with pytest.raises(BadRequest) as new:
            stream(body, chunk=chunk, existing=job)
        if "not JSON" in fragment:  # yajl words syntax errors its own way
            assert new.value.message.startswith(fragment), new.value.message
        else:
            assert new.value.message == old.value.message, (chunk, job)


def test_too_many_shards_is_counted_before_the_shards_are_checked() -> None:
    body = _body(shards=["a", "b", {"key": ""}])
    for check in (decoded, stream):
        with pytest.raises(BadRequest, match=r"too many shards \(3\): this master accepts at most 2 per job"):
            check(body, max_shards=2)


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        # Where the stream answers differently, and why: each field once (json.loads kept the
        # last); numbers beyond 64 bits stop yajl (no valid spec holds one): the field is named;
        # NaN and Infinity are not JSON.
        (b'{"name": "a", "name": "b"}', "job spec field(s) ['name'] given twice: send each field once"),
        (_body(seed=2**70), "'seed' must be an integer in [-9223372036854775807, 9223372036854775807], got 'a number out of range'"),
        (_body(seed=-(2**63)), "'seed' must be an integer"),
        (_body(epochs=2**64), "'epochs' must be an integer"),
        (_body(colour=2**64), "unknown job spec field(s) ['colour']"),
        (_body(shards=["a", {"key": "b", "size": 2**64}]), "shards[1]: a number is out of range"),
        (b'{"name": "job", "dataset": "s3://b/", "shards": ["a"], "lease_ttl_s": 1e400}', "'lease_ttl_s' must be a number"),
        (b'{"name": "job", "dataset": "s3://b/", "shards": ["a"], "lease_ttl_s": NaN}', "request body is not JSON"),
    ],
)
def test_what_only_the_stream_refuses_is_still_a_400_naming_the_field(body: bytes, fragment: str) -> None:
    for chunk in (0, 3):
        with pytest.raises(BadRequest) as info:
            stream(body, chunk=chunk)
        assert fragment in info.value.message, info.value.message


def test_the_stream_accepts_what_the_decoded_spec_accepts() -> None:
    for body in (_body(), _body(lease_ttl_s=None, max_failures=None, epochs=None, shuffle=False, seed=-5),
                 json.dumps(job_spec("x", 300, epochs=3)).encode()):
        assert stream(body, chunk=11) == decoded(body)


def test_a_join_compares_as_it_streams_and_a_difference_builds_the_list() -> None:
    shards = realistic(3 * TableBuilder.BLOCK)
    job = stream(json.dumps({"name": "j", "dataset": "s3://b/", "shards": shards}).encode())

    def parse(spec_shards: list[Any], **extra: Any) -> tuple[JobSpec, SpecStream]:
        parser = SpecStream(existing=lambda name: job.table if name == "j" else None)
        body = json.dumps({"name": "j", "dataset": "s3://b/", "shards": spec_shards, **extra}).encode()
        for i in range(0, len(body), 65536):
            parser.feed(body[i : i + 65536])
            assert not parser.needs_gate or parser.building is False
            parser.resume()
        spec = parser.finish()
        parser.close()
        return spec, parser

    same, parser = parse(shards)
    assert same.table is job.table and not parser.building and same == job
    epochs, parser = parse(shards, epochs=4)  # same list, another field: the list is still shared
    assert epochs.table is job.table and spec_diff(epochs, job) == ["epochs"]
    changed = [dict(s) for s in shards]
    changed[-1]["size"] += 1
    for other in (changed, shards[:-1], [*shards, {"key": "one-more"}], [s["key"] for s in shards]):
        spec, parser = parse(other)
        assert parser.building and spec.table is not job.table and spec_diff(spec, job) == ["shards"]
        assert list(spec.shards) == list(JobSpec.from_json({"name": "j", "dataset": "s3://b/", "shards": other}).shards)
    with pytest.raises(BadRequest, match=r"shards\[12288\].key 'imagenet/train/shard-000000.tar' appears twice"):
        parse([*shards, shards[0]])


def test_a_new_job_pauses_for_the_build_gate_before_its_shard_list() -> None:
    parser = SpecStream()
    body = _body()
    parser.feed(body[: body.index(b'"shards"') + 12])
    assert parser.needs_gate and not parser.building
    parser.resume()
    assert parser.building and not parser.needs_gate
    parser.feed(body[body.index(b'"shards"') + 12 :])
    assert parser.finish() == decoded(body)
    parser.close()


# -- memory ----------------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_200k_shard_spec_costs_a_bounded_number_of_bytes_per_shard() -> None:
    """Bounds, per shard of realistic 31-character keys, measured by tracemalloc:

    - parsing peaks under 200 B: the key's bytes (31) and three 8-byte columns while collected,
      plus the duplicate check's set of hashes (a 32-byte int and a 16-byte slot at most 60% full,
      ~64); ``json.loads`` of the same body alone peaks at ~600 B (a dict and three objects);
    - the spec then holds under 40 B: the stripped keys (6), 4-byte ends and sizes, 2-byte sample
      counts, and its compressed JSON text (~11);
    - a join holds nothing per shard: it compares as the body streams by."""
    n = 200_000
    body = json.dumps({"name": "m", "dataset": "s3://b/", "shards": realistic(n)}).encode()
    pieces = [body[i : i + (1 << 20)] for i in range(0, len(body), 1 << 20)]

    def parse(existing: ShardTable | None) -> tuple[JobSpec, int]:
        tracemalloc.start()
        try:
            parser = SpecStream(existing=lambda name: existing)
            for piece in pieces:
                parser.feed(piece)
                parser.resume()
            spec = parser.finish()
            parser.close()
            return spec, tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()

    tracemalloc.start()
    spec, peak = parse(None)
    held = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    assert peak < 200 * n, f"parse peak {peak / n:.0f} B/shard"
    assert held < 40 * n, f"the spec holds {held / n:.0f} B/shard"
    assert spec.table.nbytes < 20 * n
    joined, join_peak = parse(spec.table)
    assert joined.table is spec.table
    assert join_peak < 8 << 20, f"a join peaked at {join_peak / 1e6:.1f} MB"


# -- over HTTP, on a real master process ---------------------------------------------------------


def _vm(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no {field} for {pid}")


@pytest.fixture(scope="module")
def limited_master(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MasterProcess]:
    workdir = tmp_path_factory.mktemp("spec-master")
    master = MasterProcess(workdir, f"sqlite://{workdir}/master.db", "--max-body", "4MiB", "--max-jobs", "1000")
    master.start()
    try:
        yield master
    finally:
        master.stop()


def _post(master: MasterProcess, body: bytes, headers: dict[str, str]) -> tuple[int, dict[str, Any]]:
    """POST a create body that the master may refuse before reading it all (a 413 mid-body)."""
    conn = httpclient.HTTPConnection("127.0.0.1", master.port, timeout=60)
    try:
        conn.putrequest("POST", "/v1/jobs")
        for name, value in {"Content-Type": "application/json", "Content-Length": str(len(body)), **headers}.items():
            conn.putheader(name, value)
        conn.endheaders()
        try:
            for i in range(0, len(body), 65536):
                conn.send(body[i : i + 65536])
        except OSError:
            pass  # answered and closed before the end
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


def test_a_create_body_over_the_limit_is_413_counted_decompressed(limited_master: MasterProcess) -> None:
    name = "big-" + uuid.uuid4().hex[:8]
    plain = json.dumps(job_spec(name, 80_000)).encode()  # ~5 MiB: over the 4 MiB limit
    assert len(plain) > 4 << 20
    status, answer = _post(limited_master, plain, {})
    assert (status, answer["error"]) == (413, "BodyTooLarge") and "--max-body" in answer["message"], answer
    packed = gzip.compress(plain)  # ~0.5 MiB on the wire: still over, once decompressed
    assert len(packed) < 1 << 20
    status, answer = _post(limited_master, packed, {"Content-Encoding": "gzip"})
    assert (status, answer["error"]) == (413, "BodyTooLarge"), answer
    assert http("GET", f"{limited_master.url}/v1/jobs/{name}")[0] == 404
    # Under the limit, gzip is taken like plain JSON, and the two are the same spec.
    small = json.dumps(job_spec(name, 20_000)).encode()
    assert _post(limited_master, gzip.compress(small), {"Content-Encoding": "gzip"})[0] == 201
    assert _post(limited_master, small, {})[0] == 200


@pytest.mark.slow
def test_a_gzip_bomb_is_413_and_the_master_stays_up(limited_master: MasterProcess) -> None:
    packer = zlib.compressobj(9, zlib.DEFLATED, 31)
    block = b'{"name": "bomb", "dataset": "s3://b/", "shards": [' + b" " * (1 << 20)
    parts = [packer.compress(block)] + [packer.compress(b" " * (1 << 20)) for _ in range(1023)]
    bomb = b"".join(parts) + packer.flush()  # 1 GiB of JSON whitespace in ~1 MiB
    assert len(bomb) < 2 << 20
    assert limited_master.proc is not None
    pid = limited_master.proc.pid
    before = _vm(pid, "VmHWM")
    status, answer = _post(limited_master, bomb, {"Content-Encoding": "gzip"})
    assert (status, answer["error"]) == (413, "BodyTooLarge"), answer
    assert http("GET", limited_master.url + "/healthz")[0] == 200
    assert _vm(pid, "VmHWM") - before < 64 << 20, "the bomb was inflated in memory"
    status, answer = _post(limited_master, b"\x1f\x8b\x08\x00garbage" * 10, {"Content-Encoding": "gzip"})
    assert (status, answer["error"]) == (400, "BadRequest"), answer


def test_a_chunked_create_body_is_bounded_too(limited_master: MasterProcess) -> None:
    conn = httpclient.HTTPConnection("127.0.0.1", limited_master.port, timeout=30)
    try:
        conn.putrequest("POST", "/v1/jobs")
        conn.putheader("Transfer-Encoding", "chunked")
        conn.putheader("Content-Type", "application/json")
        conn.endheaders()
        chunk = b" " * 65536
        try:
            head = b'{"shards": ['
            conn.send(b"%x\r\n%s\r\n" % (len(head), head))
            for _ in range(100):  # 6.5 MiB of whitespace
                conn.send(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            conn.send(b"0\r\n\r\n")
        except OSError:
            pass
        resp = conn.getresponse()
        assert resp.status == 413 and json.loads(resp.read())["error"] == "BodyTooLarge"
    finally:
        conn.close()


def test_concurrent_creates_of_one_new_job_make_it_once_and_join_it(limited_master: MasterProcess) -> None:
    name = "many-" + uuid.uuid4().hex[:8]
    body = json.dumps(job_spec(name, 30_000)).encode()  # over 1 MiB: parsed on threads, built under the gate
    results: list[int] = []

    def create() -> None:
        results.append(_post(limited_master, body, {})[0])

    threads = [threading.Thread(target=create) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(results) == [200] * 5 + [201], results


class _CountingProxy(TcpForwarder):
    """A TCP forwarder between a client and a real master that counts what the client sends and
    keeps its request heads: what went over the wire, seen from outside both."""

    def __init__(self, port: int) -> None:
        self.sent = 0
        self.heads: list[bytes] = []
        self._lock = threading.Lock()
        super().__init__(port)

    def seen(self, data: bytes) -> None:
        with self._lock:
            self.sent += len(data)
            if data[:5] in (b"POST ", b"GET /"):
                self.heads.append(data[: data.find(b"\r\n\r\n")])


def test_the_client_sends_gzip_and_joins_by_digest_without_the_list(
    limited_master: MasterProcess, clients: Callable[..., MasterClient]
) -> None:
    proxy = _CountingProxy(limited_master.port)
    try:
        client = clients(proxy.url)
        shards = realistic(40_000)
        spec: dict[str, Any] = {"name": "digest-" + uuid.uuid4().hex[:8], "dataset": "s3://b/", "shards": shards, "epochs": 2,
                                "seed": 3, "shuffle": True, "lease_ttl_s": 30, "max_failures": 3}
        plain = len(json.dumps(spec, separators=(",", ":")))
        created = client.create_job(spec)
        assert created["shards"]["total"] == 40_000
        assert proxy.sent < plain / 4 and any(b"Content-Encoding: gzip" in h for h in proxy.heads), (proxy.sent, plain)
        sent, heads = proxy.sent, len(proxy.heads)
        joined = client.create_job(spec)
        assert joined["spec"] == created["spec"]
        assert proxy.sent - sent < 4096 and [h.split(b" ")[0] for h in proxy.heads[heads:]] == [b"GET"], "the join sent the spec"
        # Anything different is sent, and answered as a create answers it.
        with pytest.raises(JobConflict) as conflict:
            client.create_job({**spec, "epochs": 3})
        assert conflict.value.details["differs"] == ["epochs"]
        other = [dict(s) for s in shards]
        other[7]["samples"] = 1
        with pytest.raises(JobConflict) as conflict:
            client.create_job({**spec, "shards": other})
        assert conflict.value.details["differs"] == ["shards"]
    finally:
        proxy.close()


def test_past_max_jobs_a_new_job_is_refused_and_joining_still_works(
    tmp_path: Path, clients: Callable[..., MasterClient], master_procs: list[MasterProcess]
) -> None:
    master = MasterProcess(tmp_path, f"sqlite://{tmp_path}/master.db", "--max-jobs", "2")
    master_procs.append(master)
    master.start()
    for name in ("first", "second"):
        assert http("POST", master.url + "/v1/jobs", job_spec(name, 3))[0] == 201
    status, answer = http("POST", master.url + "/v1/jobs", job_spec("third", 3))
    assert (status, answer["error"]) == (409, "TooManyJobs"), answer
    assert "--max-jobs 2" in answer["message"] and "finished jobs count too" in answer["message"]
    assert (answer["jobs"], answer["max_jobs"]) == (2, 2)
    assert http("POST", master.url + "/v1/jobs", job_spec("first", 3))[0] == 200  # joining an existing job
    with pytest.raises(TooManyJobs):
        clients(master.url).create_job(job_spec("third", 3))
    # The limit is the master's, not the state's: with a higher one the same state takes more.
    master.stop()
    master.args = ["--max-jobs", "3"]
    master.start()
    assert http("POST", master.url + "/v1/jobs", job_spec("third", 3))[0] == 201


@pytest.mark.slow
def test_a_master_restarted_on_large_jobs_reads_them_without_decoding_them_whole(
    tmp_path: Path, master_procs: list[MasterProcess]
) -> None:
    """A real master started on a snapshot holding a 200k-shard job and a journal whose record
    creates a second: its peak (VmHWM) stays far below what decoding them with ``json.loads``
    took (~600 B a shard, ~240 MB here)."""
    n = 200_000
    state = MasterState()
    state.apply(CreateJob(JobSpec.from_json({"name": "snapped", "dataset": "s3://b/", "shards": realistic(n)})), 1.0)
    state.apply(Lease("snapped", "t", "n", 3, None, ("lease-aaaaaaaa", "lease-bbbbbbbb", "lease-cccccccc")), 2.0)
    logged = JobSpec.from_json({"name": "logged", "dataset": "s3://b/", "shards": realistic(n, seed=2, prefix="other/")})
    record = '{"now":3.0,"ev":' + event_to_text(CreateJob(logged)) + "}"

    async def write() -> None:
        store = SqliteStore(tmp_path / "big.db")
        await store.open()
        await store.write([(1, '{"now":1.0,"ev":{"t":"resume"}}')], (1, state.snapshot_text()))
        await store.write([(2, record)], None)
        await store.close()

    asyncio.run(write())
    empty = MasterProcess(tmp_path, f"sqlite://{tmp_path}/empty.db", name="empty")
    big = MasterProcess(tmp_path, f"sqlite://{tmp_path}/big.db", name="big")
    master_procs.extend([empty, big])
    assert empty.start().proc is not None and big.start().proc is not None
    idle, loaded = _vm(empty.proc.pid, "VmHWM"), _vm(big.proc.pid, "VmHWM")
    assert loaded - idle < 120 << 20, f"loading two {n}-shard jobs peaked {(loaded - idle) >> 20} MiB above an idle master"
    jobs = {j["name"]: j for j in http("GET", big.url + "/v1/jobs")[1]["jobs"]}
    assert jobs["snapped"]["shards"]["leased"] == 3 and jobs["logged"]["shards"]["total"] == n
    assert jobs["logged"]["spec"]["shards_sha256"] == logged.table.sha256
