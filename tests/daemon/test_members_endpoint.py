"""``GET /_shardcache/members``: the member index a daemon builds of a shard it holds (issue 31),
from its own verified copy, kept with the entry; and a loader resuming a cached shard by it when
the dataset has no member index of its own (no skipped sample read)."""

from __future__ import annotations

import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import xxhash

from loader import ShardLoader
from loader.members import MEMBER_INDEXES, index_shard
from tests.support.daemons import Daemon, daemon_stats
from tests.support.shards import write_manifest, write_shards
from tests.support.waits import wait_until
from wire.members import members_bytes, parse_members

pytestmark = pytest.mark.timeout(180)


def _get(endpoint: str, path: str) -> tuple[int, dict[str, str], bytes]:
    try:
        with urllib.request.urlopen(endpoint + path, timeout=30) as resp:
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


def _members(endpoint: str, bucket: str, key: str) -> tuple[int, dict[str, str], bytes]:
    return _get(endpoint, "/_shardcache/members?" + urllib.parse.urlencode({"bucket": bucket, "key": key}))


@pytest.fixture
def node(tmp_path: Path) -> Any:
    written = write_shards(tmp_path / "root" / "bkt" / "ds", shards=2, per_shard=9)
    write_manifest(written)  # no member indexes of its own
    (written.root / "notatar.tar").write_bytes(b"not a tar at all" * 100)
    proc = Daemon(tmp_path, f"file://{tmp_path / 'root'}").start()
    try:
        yield written, proc.url
    finally:
        proc.stop()


def test_the_daemon_indexes_a_shard_it_holds_and_only_then(node: Any) -> None:
    written, endpoint = node
    key = written.keys[0]
    data = (written.root / key).read_bytes()
    status, _, body = _members(endpoint, "bkt", "ds/" + key)
    assert status == 404 and b"NotCached" in body
    assert daemon_stats(endpoint)["cache"]["items"] == 0  # asking fills nothing
    assert _get(endpoint, f"/bkt/ds/{key}")[2] == data
    wait_until(lambda: daemon_stats(endpoint)["fills_in_flight"] == 0, timeout=30, what="the fill published")
    status, headers, body = _members(endpoint, "bkt", "ds/" + key)
    assert status == 200 and headers["x-shardcache-xxh3-128"] == xxhash.xxh3_128_hexdigest(data)
    table = parse_members(body, "answer")
    expected = index_shard(data, "ds/" + key)
    assert table == expected and body == members_bytes(expected)
    assert _members(endpoint, "bkt", "ds/" + key)[2] == body  # kept: the same document again


def test_what_cannot_be_indexed_and_hostile_parameters(node: Any) -> None:
    written, endpoint = node
    assert _get(endpoint, "/bkt/ds/notatar.tar")[0] == 200
    wait_until(lambda: daemon_stats(endpoint)["fills_in_flight"] == 0, timeout=30, what="the fill published")
    status, _, body = _members(endpoint, "bkt", "ds/notatar.tar")
    assert status == 422 and b"NotIndexable" in body
    for query in ("", "?bucket=bkt", "?key=x", "?bucket=..&key=x", "?bucket=bkt&key=../../etc/passwd",
                  "?bucket=bkt&key=%00", "?bucket=" + "b" * 300 + "&key=x", "?bucket=bkt&key=" + "k" * 5000):
        status, _, body = _get(endpoint, "/_shardcache/members" + query)
        assert status == 400, (query, status, body[:200])


def test_a_cached_shard_resumes_by_the_daemons_index(node: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    written, endpoint = node
    MEMBER_INDEXES.clear()
    key = written.keys[0]
    full = list(ShardLoader("s3://bkt/ds/", endpoint=endpoint, shuffle=False))
    wait_until(lambda: daemon_stats(endpoint)["fills_in_flight"] == 0, timeout=30, what="the fills published")
    per = len(written.order[key])
    loader = ShardLoader("s3://bkt/ds/", endpoint=endpoint, shuffle=False)
    state = loader.state_dict()
    state.update(shard=0, offset=per - 2)
    loader.load_state_dict(state)
    source = loader._source()
    offsets: list[int] = []
    real = source.open

    def open_(shard: Any, *args: Any, offset: int = 0, **kwargs: Any) -> Any:
        if shard.key == key:
            offsets.append(offset)
        return real(shard, *args, offset=offset, **kwargs)

    monkeypatch.setattr(source, "open", open_)
    got = []
    for sample in loader:
        got.append(sample)
        if len(got) == 2:
            break
    assert [s["__key__"] for s in got] == [s["__key__"] for s in full[per - 2 : per]]
    assert [{k: bytes(v) for k, v in s.items() if not k.startswith("__")} for s in got] == [
        {k: bytes(v) for k, v in s.items() if not k.startswith("__")} for s in full[per - 2 : per]]
    table = index_shard((written.root / key).read_bytes(), "ds/" + key)
    assert offsets == [table.ends[per - 3]]  # opened at the resumed sample's first byte
