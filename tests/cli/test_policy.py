"""Pure pieces, checked by properties: shard placement, the bandwidth bucket, the progress bar,
address parsing, manifest comparison."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sidecar.cli.commands.warmup import map_dataset, place
from sidecar.cli.control import parse_address, resolve_addresses
from sidecar.cli.datasets import ShardInfo, compare
from sidecar.cli.progress import Progress, ProgressLine, format_eta, render_bar, render_line
from sidecar.daemon.ratelimit import TokenBucket
from wire.dataset import ManifestShard, parse_dataset_url
from wire.names import Address, warmup_id

keys_st = st.lists(st.text(alphabet="abcdefgh0123456789-/.", min_size=1, max_size=12), unique=True, max_size=60)
daemons_st = st.lists(st.sampled_from([f"http://10.0.0.{i}:8600" for i in range(1, 12)]), unique=True, min_size=1, max_size=8)


@given(keys_st, daemons_st)
def test_place_puts_each_key_on_exactly_one_daemon(keys: list[str], daemons: list[str]):
    placed = place(keys, daemons)
    assert set(placed) == set(daemons)
    flat = [key for got in placed.values() for key in got]
    assert sorted(flat) == sorted(keys)
    assert place(keys, list(reversed(daemons))) == {d: placed[d] for d in reversed(daemons)}  # order-free


@given(keys_st, daemons_st.filter(lambda d: len(d) >= 2), st.data())
def test_removing_a_daemon_moves_only_its_keys(keys: list[str], daemons: list[str], data: st.DataObject):
    gone = data.draw(st.sampled_from(daemons))
    before = place(keys, daemons)
    after = place(keys, [d for d in daemons if d != gone])
    for daemon, got in after.items():
        assert set(before[daemon]) <= set(got)  # nobody else's keys moved


def test_place_spreads_evenly_enough():
    keys = [f"train-{i:06d}.tar" for i in range(3000)]
    counts = [len(v) for v in place(keys, [f"http://10.0.0.{i}:8600" for i in range(6)]).values()]
    assert max(counts) < 1.2 * 500 and min(counts) > 0.8 * 500


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        assert seconds >= 0
        self.now += seconds


@settings(max_examples=200, deadline=None)
@given(
    st.floats(min_value=1.0, max_value=1e6),
    st.lists(st.tuples(st.integers(min_value=0, max_value=2_000_000), st.floats(min_value=0, max_value=3)), max_size=40),
)
def test_token_bucket_never_exceeds_its_rate_and_never_waits_needlessly(rate: float, grants: list[tuple[int, float]]):
    clock = FakeClock()

    async def scenario() -> None:
        bucket = TokenBucket(rate, clock=clock, sleep=clock.sleep)
        start = clock.now
        granted = 0
        for amount, pause in grants:
            clock.now += pause
            await bucket.acquire(amount)
            # Everything granted before this one fits in burst + rate * elapsed.
            assert granted <= bucket.burst + rate * (clock.now - start) + 1e-6 * max(granted, 1)
            granted += amount
        # It waits only while in debt: total waiting <= debt / rate.
        waited = clock.now - start - sum(p for _, p in grants)
        debt = sum(a for a, _ in grants[:-1]) - bucket.burst
        assert waited <= max(debt, 0) / rate + 1e-6 * (1 + waited)

    asyncio.run(scenario())


@given(st.floats(min_value=-1, max_value=2, allow_nan=False), st.integers(min_value=1, max_value=200))
def test_bar_has_the_exact_width_and_fills_monotonically(fraction: float, width: int):
    bar = render_bar(fraction, width)
    assert len(bar) == width
    assert render_bar(min(fraction + 0.05, 1), width).count("█") >= bar.count("█")
    if fraction >= 1:
        assert bar == "█" * width
    if fraction <= 0:
        assert bar.strip() == ""


@given(st.integers(min_value=40, max_value=300), st.text(max_size=80), st.integers(0, 10**13), st.integers(0, 10**13))
def test_progress_line_fits_the_terminal(width: int, label: str, done: int, total: int):
    line = render_line(ProgressLine(label, Progress(3, 7, done, total, 1, 1e6, 42.0)), width, width // 4)
    assert len(line) <= width


def test_eta_format():
    assert [format_eta(s) for s in (None, 0, 59.4, 75, 3725, -1, float("nan"))] == [
        "--:--", "0:00", "0:59", "1:15", "1:02:05", "--:--", "--:--"
    ]


@pytest.mark.parametrize(
    ("address", "parsed"),
    [
        ("http://10.1.2.3:8600", Address("tcp", "10.1.2.3", 8600)),
        ("tcp://node:9000/", Address("tcp", "node", 9000)),
        ("node", Address("tcp", "node", 8600)),
        ("[::1]:8600", Address("tcp", "::1", 8600)),
        ("unix:///run/shardcache/daemon.sock", Address("unix", path="/run/shardcache/daemon.sock")),
    ],
)
def test_parse_address(address: str, parsed: Address):
    assert parse_address(address) == parsed


@pytest.mark.parametrize("address", ["ftp://x:1", "unix://relative.sock", "http://", "http://h:1/path"])
def test_parse_address_refuses(address: str):
    with pytest.raises(ValueError):
        parse_address(address)


def test_a_dns_name_stands_for_every_a_record():
    records = {"shardcache-node.ns.svc": ["10.0.0.7", "10.0.0.3", "10.0.0.7"]}
    found = resolve_addresses(
        ["shardcache-node.ns.svc:8600", "http://10.0.0.3:8600", "unix:///s.sock"],
        resolver=lambda host, port: records[host],
    )
    assert [d.url for d in found] == ["http://10.0.0.3:8600", "http://10.0.0.7:8600", "unix:///s.sock"]
    assert found[0].label == "shardcache-node.ns.svc (10.0.0.3:8600)"
    # The real resolver: localhost stays itself.
    assert [d.url for d in resolve_addresses(["localhost:1234"])] == ["http://localhost:1234"]


def test_warmup_ids_depend_on_what_is_asked_not_its_order():
    a = [("b", "k1", None), ("b", "k2", "f" * 32)]
    assert warmup_id(a, "train") == warmup_id(list(reversed(a)), "train")
    assert warmup_id(a) != warmup_id(a[:1])
    assert warmup_id(a, "../../x y") .startswith("x-y-")


def test_map_dataset_onto_a_daemon_origin():
    assert map_dataset(parse_dataset_url("s3://b/train"), "s3") == ("b", "train/")
    assert map_dataset(parse_dataset_url("file:///data/b/train/"), "file:///data") == ("b", "train/")
    assert map_dataset(parse_dataset_url("file:///data/b/"), "file:///data/") == ("b", "")
    for url, origin in [("s3://b/x/", "file:///data"), ("file:///other/b/x/", "file:///data"),
                        ("file:///data/", "file:///data"), ("file:///data/b/x/", "s3")]:
        with pytest.raises(ValueError):
            map_dataset(parse_dataset_url(url), origin)


def test_compare_reports_each_kind_of_mismatch():
    expected = [ManifestShard("a.tar", 10, "a" * 32, 2), ManifestShard("b.tar", 10, "b" * 32, 2),
                ManifestShard("c.tar", None, None, None)]
    found = {"a.tar": ShardInfo("a.tar", 10, "a" * 32, 2), "b.tar": ShardInfo("b.tar", 11, "c" * 32, 3)}
    problems = {(p.key, p.problem) for p in compare(expected, found, ["a.tar", "b.tar", "d.tar"])}
    assert problems == {("b.tar", "size"), ("b.tar", "xxh3_128"), ("b.tar", "samples"), ("c.tar", "missing"),
                        ("d.tar", "unlisted")}
    assert compare(expected[:1], {"a.tar": ShardInfo("a.tar", 10, "a" * 32, 2)}, ["a.tar"]) == []
