"""Resuming a shard at sample N by its member index (issue 31): the read starts at sample N's
first byte, through every source (a local file mapped, S3 by a ranged GET, the real daemon over
HTTP and by short-circuit), yields what a full read yields from sample N on, and reads none of the
samples skipped (counted: bytes pulled from the reader, the daemon's served bytes, or the pages a
mapped read brought into the page cache). A damaged or stale index is not used (the shard is read
whole, correctly), a shard whose bytes changed after sample N fails after one recheck without
handing out a wrong sample, and a dataset without a pinned index reads as before."""

from __future__ import annotations

import itertools
import json
import os
import re
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import xxhash

from bench.resume_bench import evict, resident_bytes
from loader import CorruptShard, LoaderSettings, ShardLoader, iter_samples
from loader.dataset import Shard
from loader.members import MEMBER_INDEXES, members_key
from loader.tarindex import TarIndex
from tests.support.daemons import DaemonProcess
from tests.support.shards import Written, write_manifest, write_shards
from tests.support.waits import wait_until

SHARDS, PER_SHARD, RESUME_AT = 3, 12, 8
SLACK = 2 * 4096  # page alignment of a mapped read; the end-of-archive blocks of a stream


@pytest.fixture
def data(tmp_path: Path) -> tuple[str, Written]:
    """A file:// dataset (root/bkt/ds/) whose manifest pins each shard's member index."""
    written = write_shards(tmp_path / "root" / "bkt" / "ds", shards=SHARDS, per_shard=PER_SHARD, sizes=(20_000, 60_000))
    write_manifest(written, members=True)
    return f"file://{tmp_path}/root/bkt/ds/", written


class Counting:
    """The loader's source, with every open recorded (the offset asked for) and, with ``wrap``,
    the bytes pulled from its readers counted (a wrapped file is then streamed, not mapped)."""

    def __init__(self, source: Any, wrap: bool = True) -> None:
        self.source, self.wrap = source, wrap
        self.opens: list[tuple[str, int]] = []
        self.bytes = 0

    def offsets(self, key: str) -> list[int]:
        """Where each open of shard ``key`` started (the next shard's, opened ahead, left out)."""
        return [offset for k, offset in self.opens if k == key]

    def __getattr__(self, name: str) -> Any:
        return getattr(self.source, name)

    def open(self, shard: Shard, recheck: bool = False, on_sent: Any = None, offset: int = 0, **kwargs: Any) -> Any:
        self.opens.append((shard.key, offset))
        reader = self.source.open(shard, recheck, on_sent, offset, **kwargs)
        if not self.wrap:
            return reader
        counting = self

        class Reader:
            def read(self, n: int = -1, /) -> bytes:
                data: bytes = reader.read(n)
                counting.bytes += len(data)
                return data

            def close(self) -> None:
                reader.close()

        return Reader()


def counted(loader: ShardLoader, wrap: bool = True) -> Counting:
    counting = Counting(loader._source(), wrap)
    loader._runtime().source = counting
    return counting


def table(written: Written, key: str) -> TarIndex:
    from loader.members import read_members

    shard = next(s for s in ShardLoader(f"file://{written.root}/", endpoint="").shards if s.key == key)
    return read_members((written.root / members_key(key)).read_bytes(), shard, "test")


def full_read(written: Written, key: str, url: str) -> list[dict[str, Any]]:
    """What a read of the shard from its first byte yields (the streaming loader's parse)."""
    return list(iter_samples((written.root / key).read_bytes(), url=url))


def plain(samples: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: bytes(v) if isinstance(v, memoryview) else v for k, v in s.items()} for s in samples]


def resume(loader: ShardLoader, offset: int, count: int) -> list[dict[str, Any]]:
    """``count`` samples of a static loader resumed (``load_state_dict``) at sample ``offset`` of
    the first shard of its plan."""
    state = loader.state_dict()
    state.update(shard=0, offset=offset)
    loader.load_state_dict(state)
    return plain(list(itertools.islice(iter(loader), count)))


def first_key(loader: ShardLoader) -> str:
    return loader._plan(0)[0].key


def served(endpoint: str) -> int:
    stats = json.load(urllib.request.urlopen(endpoint + "/_shardcache/stats"))
    return sum(int(v) for v in stats["served_bytes"].values())


# -- (a) the resume reads from sample N's offset, through every source -------------------------------


@pytest.mark.parametrize("zero_copy", [False, True])
def test_file_resume_maps_from_the_offset_and_reads_nothing_before(data: tuple[str, Written], zero_copy: bool) -> None:
    url, written = data
    loader = ShardLoader(url, endpoint="", shuffle=False, settings=LoaderSettings(zero_copy=zero_copy))
    key = first_key(loader)
    index = table(written, key)
    path = written.root / key
    if not evict(path):
        pytest.skip("this file system keeps the shard's pages in the page cache")
    opens = counted(loader, wrap=False)
    got = resume(loader, RESUME_AT, PER_SHARD - RESUME_AT)
    loader.close()
    begin = index.start(RESUME_AT)
    before, total = resident_bytes(path, 0, begin - begin % 4096), resident_bytes(path)  # before reading it here
    assert got == full_read(written, key, loader.location.object_url(key))[RESUME_AT:]
    assert opens.offsets(key)[0] == begin
    assert before == 0, f"{before} bytes of the pages before the resumed sample were read"
    assert total <= path.stat().st_size - begin + SLACK


def test_file_resume_streamed_reads_only_the_samples_after(data: tuple[str, Written]) -> None:
    url, written = data
    loader = ShardLoader(url, endpoint="", shuffle=False, settings=LoaderSettings(map_files=False))
    key = first_key(loader)
    index = table(written, key)
    counting = counted(loader)
    got = resume(loader, RESUME_AT, PER_SHARD - RESUME_AT)
    assert got == full_read(written, key, loader.location.object_url(key))[RESUME_AT:]
    assert counting.offsets(key) == [index.start(RESUME_AT)]
    assert counting.bytes == index.ends[-1] - index.start(RESUME_AT)


@pytest.fixture
def s3_data(data: tuple[str, Written], s3_server: Any, bucket: str, monkeypatch: pytest.MonkeyPatch) -> tuple[str, Written]:
    """The same dataset under s3://bucket/ds/ (moto); boto3 finds it through AWS_ENDPOINT_URL."""
    _, written = data
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server.endpoint)
    client = s3_server.client()
    for path in sorted(written.root.iterdir()):
        client.put_object(Bucket=bucket, Key="ds/" + path.name, Body=path.read_bytes())
    return f"s3://{bucket}/ds/", written


def test_s3_resume_is_one_ranged_get_from_the_offset(s3_data: tuple[str, Written]) -> None:
    url, written = s3_data
    loader = ShardLoader(url, endpoint="", shuffle=False)
    key = first_key(loader)
    index = table(written, key)
    counting = counted(loader)
    got = resume(loader, RESUME_AT, PER_SHARD - RESUME_AT)
    assert got == full_read(written, key, loader.location.object_url(key))[RESUME_AT:]
    assert counting.offsets(key) == [index.start(RESUME_AT)]
    assert counting.bytes == index.ends[-1] - index.start(RESUME_AT)


def test_daemon_http_resume_is_served_from_the_offset_cold_and_warm(
    s3_data: tuple[str, Written], s3_server: Any, start_daemon: Callable[..., str]
) -> None:
    url, written = s3_data
    endpoint = start_daemon("s3", env={"AWS_ENDPOINT_URL": s3_server.endpoint})
    for state in ("cold", "warm"):
        MEMBER_INDEXES.clear()
        loader = ShardLoader(url, endpoint=endpoint, shuffle=False, settings=LoaderSettings(short_circuit=False))
        key = first_key(loader)
        index = table(written, key)
        doc = (written.root / members_key(key)).stat().st_size
        counting = counted(loader)
        before = served(endpoint)
        got = resume(loader, RESUME_AT, PER_SHARD - RESUME_AT)
        sent = served(endpoint) - before
        loader.close()
        assert got == full_read(written, key, loader.location.object_url(key))[RESUME_AT:], state
        assert counting.offsets(key) == [index.start(RESUME_AT)], state
        assert counting.bytes == index.ends[-1] - index.start(RESUME_AT), state
        # The daemon sent the member index and the shard from the offset on (its end blocks too).
        rest = (written.root / key).stat().st_size - index.start(RESUME_AT)
        assert doc + rest - SLACK <= sent <= doc + rest, (state, sent, doc, rest)


def test_daemon_short_circuit_resume_maps_from_the_offset(data: tuple[str, Written], start_daemon: Callable[..., str]) -> None:
    url, written = data
    root = url[len("file://") :].split("/bkt/")[0]
    endpoint = start_daemon(f"file://{root}")
    warm = ShardLoader(url, endpoint=endpoint, shuffle=False)
    key = first_key(warm)
    index = table(written, key)
    shard = next(s for s in warm.shards if s.key == key)
    reader = warm._source().open(shard)  # fills the cache; its answer is the cache file
    path = Path(reader.name)  # type: ignore[attr-defined]
    reader.close()
    assert path.stat().st_size == shard.size and not str(path).startswith(str(written.root))
    if not evict(path):
        pytest.skip("this file system keeps the cache file's pages in the page cache")
    loader = ShardLoader(url, endpoint=endpoint, shuffle=False)
    opens = counted(loader, wrap=False)
    got = resume(loader, RESUME_AT, PER_SHARD - RESUME_AT)
    loader.close()
    begin = index.start(RESUME_AT)
    before, total = resident_bytes(path, 0, begin - begin % 4096), resident_bytes(path)  # before reading it here
    assert got == full_read(written, key, loader.location.object_url(key))[RESUME_AT:]
    assert opens.offsets(key)[0] == begin
    assert before == 0, f"{before} bytes of the pages before the resumed sample were read"
    assert total <= path.stat().st_size - begin + SLACK


def test_daemon_handle_resume_maps_the_descriptor_from_the_offset(data: tuple[str, Written], tmp_path: Path) -> None:
    """Short-circuit by descriptor (``shardcache serve --handles``, a real process): the passed
    file is read from the offset, none of its pages before it."""
    url, written = data
    root = url[len("file://") :].split("/bkt/")[0]
    sockets = tmp_path / "node"
    sockets.mkdir()
    daemon = DaemonProcess([
        "--min-free", "0%", "--listen", f"unix://{sockets}/daemon.sock", "--handles", f"unix://{sockets}/handles.sock",
        "--cache-dir", str(tmp_path / "node-cache"), "--cache-size", "1GiB", "--origin", f"file://{root}",
    ], tmp_path / "node.log", ready_path="/healthz").start()
    try:
        wait_until(lambda: (sockets / "handles.sock").exists(), timeout=20, what="the daemon's handle socket")
        settings = LoaderSettings(handles=f"unix://{sockets}/handles.sock")
        warm = ShardLoader(url, endpoint=daemon.url, shuffle=False, settings=settings)
        key = first_key(warm)
        index = table(written, key)
        reader = warm._source().open(next(s for s in warm.shards if s.key == key))  # fills the cache
        path = Path(os.readlink(f"/proc/self/fd/{reader.fileno()}"))  # type: ignore[attr-defined]
        reader.close()
        assert str(path).startswith(str(tmp_path / "node-cache"))
        if not evict(path):
            pytest.skip("this file system keeps the cache file's pages in the page cache")
        loader = ShardLoader(url, endpoint=daemon.url, shuffle=False, settings=settings)
        opens = counted(loader, wrap=False)
        got = resume(loader, RESUME_AT, PER_SHARD - RESUME_AT)
        received = loader._source()._handles.received  # type: ignore[attr-defined]
        loader.close()
        begin = index.start(RESUME_AT)
        before, total = resident_bytes(path, 0, begin - begin % 4096), resident_bytes(path)
    finally:
        daemon.stop()
    assert got == full_read(written, key, loader.location.object_url(key))[RESUME_AT:]
    assert opens.offsets(key) == [begin] and received >= 1
    assert before == 0, f"{before} bytes of the pages before the resumed sample were read"
    assert total <= path.stat().st_size - begin + SLACK


def test_a_lease_resumed_at_an_offset_reads_from_it(data: tuple[str, Written], master: str) -> None:
    """Dynamic mode: a checkpoint loaded in a new trainer makes the master lease the shard again
    at the sample reached, and the read starts there."""
    url, written = data
    first = ShardLoader(url, job="resume-offset", master=master, seed=2, epochs=1, continuous=True)
    it = iter(first)
    taken = plain(list(itertools.islice(it, RESUME_AT)))
    state = first.state_dict()
    it.close()  # type: ignore[attr-defined]
    key = taken[0]["__url__"].rsplit("/", 1)[-1]
    assert {s["__url__"].rsplit("/", 1)[-1] for s in taken} == {key}  # one lease: RESUME_AT < PER_SHARD
    second = ShardLoader(url, job="resume-offset", master=master, seed=2, epochs=1, continuous=True)
    second.load_state_dict(state)
    counting = counted(second)
    rest = plain(list(second))
    index = table(written, key)
    assert [s for s in rest if s["__url__"].endswith("/" + key)] == full_read(written, key, second.location.object_url(key))[RESUME_AT:]
    assert counting.offsets(key) == [index.start(RESUME_AT)]
    assert len(rest) == SHARDS * PER_SHARD - RESUME_AT


def test_resumed_at_the_end_reads_nothing(data: tuple[str, Written]) -> None:
    url, written = data
    loader = ShardLoader(url, endpoint="", shuffle=False)
    counting = counted(loader)
    shard = loader._plan(0)[0]
    assert list(loader._samples(shard, PER_SHARD)) == []
    assert counting.opens == []
    with pytest.raises(CorruptShard, match="ends earlier"):
        list(loader._samples(shard, PER_SHARD + 1))


# -- (b) a damaged or stale index is not used ---------------------------------------------------------


def _repin(written: Written, key: str, doc: bytes, pin: str | None = None) -> None:
    """Put ``doc`` as ``key``'s member index; the manifest pins ``pin`` (default: unchanged)."""
    (written.root / members_key(key)).write_bytes(doc)
    if pin is not None:
        manifest = json.loads((written.root / "manifest.json").read_text())
        next(e for e in manifest["shards"] if e["key"] == key)["members_xxh3_128"] = pin
        (written.root / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize("damage", ["flipped", "stale", "missing"])
def test_an_unusable_index_falls_back_to_the_full_read(
    data: tuple[str, Written], damage: str, caplog: pytest.LogCaptureFixture
) -> None:
    url, written = data
    key = written.keys[0]
    doc = (written.root / members_key(key)).read_bytes()
    if damage == "flipped":
        # One hex digit of a sample's xxh3-64 changed: still a well-formed index, not the pinned one.
        found = re.search(rb'\["000000008",\d+,\d+,"([0-9a-f]{16})"', doc)
        assert found is not None
        at = found.start(1)
        _repin(written, key, doc[:at] + (b"0" if doc[at : at + 1] != b"0" else b"1") + doc[at + 1 :])
    elif damage == "stale":
        # The index of other bytes under this key (another shard's), pinned: it names other bytes.
        other = (written.root / members_key(written.keys[1])).read_bytes()
        _repin(written, key, other, xxhash.xxh3_128_hexdigest(other))
    else:
        (written.root / members_key(key)).unlink()
    loader = ShardLoader(url, endpoint="", shuffle=False, settings=LoaderSettings(map_files=False))
    assert first_key(loader) == key
    counting = counted(loader)
    got = resume(loader, RESUME_AT, PER_SHARD - RESUME_AT)
    assert got == full_read(written, key, loader.location.object_url(key))[RESUME_AT:]
    assert counting.offsets(key) == [0]  # read from its first byte, as without an index
    assert counting.bytes == (written.root / key).stat().st_size
    assert "reading train-000000.tar whole instead" in caplog.text


# -- (c) a shard whose bytes changed after sample N ----------------------------------------------------


def _flip_inside(written: Written, key: str, sample: int) -> None:
    index = table(written, key)
    path = written.root / key
    data = bytearray(path.read_bytes())
    m = index.first[sample]
    data[index.offsets[m] + index.sizes[m] // 2] ^= 0x01  # a byte of the sample's first member's data
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("how", ["mapped", "streamed", "s3"])
def test_changed_bytes_after_the_offset_fail_without_a_wrong_sample(
    data: tuple[str, Written], s3_server: Any, bucket: str, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    url, written = data
    key = written.keys[0]
    expected = full_read(written, key, "")
    index = table(written, key)
    _flip_inside(written, key, RESUME_AT + 1)
    if how == "s3":
        monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server.endpoint)
        for path in sorted(written.root.iterdir()):
            s3_server.client().put_object(Bucket=bucket, Key="ds/" + path.name, Body=path.read_bytes())
        url = f"s3://{bucket}/ds/"
    loader = ShardLoader(url, endpoint="", shuffle=False, settings=LoaderSettings(map_files=how == "mapped"))
    opens = counted(loader, wrap=False)
    state = loader.state_dict()
    state.update(shard=0, offset=RESUME_AT)
    loader.load_state_dict(state)
    got = []
    with pytest.raises(CorruptShard, match=f"sample {RESUME_AT + 1} .*does not match the xxh3_64"):
        for sample in loader:
            got.append(sample)
    assert [s["__key__"] for s in got] == [expected[RESUME_AT]["__key__"]]  # the checked one, nothing after
    assert plain(got)[0]["jpg"] == expected[RESUME_AT]["jpg"]
    # Read once more from the sample reached (a cache would re-hash its copy), then given up.
    assert opens.offsets(key) == [index.start(RESUME_AT), index.start(RESUME_AT + 1)]


# -- (d) without a pinned index ----------------------------------------------------------------------


def test_without_a_pinned_index_the_resume_reads_from_the_first_byte(tmp_path: Path) -> None:
    written = write_shards(tmp_path / "root" / "bkt" / "np", shards=2, per_shard=PER_SHARD, sizes=(20_000, 60_000))
    write_manifest(written, members=True)  # the index files are there ...
    write_manifest(written)  # ... but the manifest pins none
    loader = ShardLoader(f"file://{written.root}/", endpoint="", shuffle=False, settings=LoaderSettings(map_files=False))
    assert all(s.members is None for s in loader.shards)
    key = first_key(loader)
    counting = counted(loader)
    got = resume(loader, RESUME_AT, PER_SHARD - RESUME_AT)
    assert got == full_read(written, key, loader.location.object_url(key))[RESUME_AT:]
    assert counting.offsets(key) == [0] and counting.bytes == (written.root / key).stat().st_size
