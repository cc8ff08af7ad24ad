"""The next shard opened while the current one is read (loader.ahead), and prefetch hints sent
from their own thread (loader.hints): same samples, no descriptor left open, errors where the
shard is read."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import pytest

from loader import CorruptShard, LoaderSettings, ShardLoader
from loader.ahead import Opener
from loader.hints import HintSender
from loader.sources import FileSource
from tests.support.shards import delivered, write_manifest, write_shards
from tests.support.waits import wait_until


def _dataset(tmp_path: Path, shards: int = 5) -> tuple[str, Any]:
    written = write_shards(tmp_path / "root" / "bkt" / "ds", shards=shards, per_shard=6)
    write_manifest(written)
    return f"file://{tmp_path}/root/bkt/ds/", written


def _open_shards(root: Path) -> int:
    """Shard files this process holds open (a mapping holds a descriptor of its own: one file)."""
    paths = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(str(root)):
            paths.add(target)
    return len(paths)


def _until_closed(root: Path, count: int) -> None:
    # An open still under way when it was abandoned closes its reader as it ends, on its thread.
    wait_until(lambda: _open_shards(root) == count, timeout=10, interval=0.01, what=f"{count} shards open")


def test_each_shard_is_opened_once_and_the_next_one_ahead(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    url, written = _dataset(tmp_path)
    opened: list[tuple[str, str]] = []
    real = FileSource.open

    def recording(self: FileSource, shard: Any, *args: Any, **kwargs: Any) -> Any:
        opened.append((shard.key, threading.current_thread().name))
        return real(self, shard, *args, **kwargs)

    monkeypatch.setattr(FileSource, "open", recording)
    loader = ShardLoader(url, shuffle=False, endpoint="")
    assert delivered(list(loader)) == written.samples
    assert [key for key, _ in opened] == written.keys
    assert [thread for _, thread in opened[1:]] == ["shardcache-open-ahead"] * (len(written.keys) - 1)
    # lease_ahead=0: nothing beyond the shard being read, opened ahead or hinted
    opened.clear()
    list(ShardLoader(url, shuffle=False, endpoint="", settings=LoaderSettings(lease_ahead=0)))
    assert {thread for _, thread in opened} == {threading.current_thread().name}


def test_a_loop_that_stops_early_leaves_no_shard_open(tmp_path: Path) -> None:
    url, written = _dataset(tmp_path)
    before = _open_shards(written.root)
    loader = ShardLoader(url, shuffle=False, endpoint="")
    stream = iter(loader)
    for _ in range(8):  # into the second shard: the third is open ahead
        next(stream)
    # the shard being read, the next one ahead
    wait_until(lambda: _open_shards(written.root) == before + 2, timeout=10, interval=0.01, what="two shards open")
    stream.close()
    _until_closed(written.root, before)
    # close() of a loader whose iteration was dropped without closing does it too
    stream = iter(loader)
    next(stream)
    loader.close()
    del stream
    _until_closed(written.root, before)


def test_an_error_opening_ahead_is_the_shards_and_is_retried(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    url, written = _dataset(tmp_path)
    real = FileSource.open
    failed: list[str] = []

    def flaky(self: FileSource, shard: Any, *args: Any, **kwargs: Any) -> Any:
        if shard.key == written.keys[2] and not failed:
            failed.append(threading.current_thread().name)
            raise CorruptShard("the cache's copy does not match", url=shard.key)
        return real(self, shard, *args, **kwargs)

    monkeypatch.setattr(FileSource, "open", flaky)
    assert delivered(list(ShardLoader(url, shuffle=False, endpoint=""))) == written.samples
    assert failed == ["shardcache-open-ahead"]


def test_an_abandoned_open_closes_its_reader_when_it_ends(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"x")
    release = threading.Event()
    handles: list[Any] = []

    def slow_open() -> Any:
        release.wait(10)
        handles.append(open(path, "rb"))
        return handles[-1]

    opener = Opener()
    ahead = opener.submit("shard", slow_open)
    wait_until(lambda: opener._queue == [], timeout=10, interval=0.01, what="the open to begin")
    ahead.abandon()
    release.set()
    wait_until(lambda: bool(handles and handles[0].closed), timeout=10, interval=0.01, what="the abandoned open's reader to close")
    taken = opener.submit("shard", lambda: open(path, "rb"))
    reader = taken.take()
    taken.abandon()  # taken already: not closed under its new owner
    assert not reader.closed
    reader.close()
    opener.close()
    late = opener.submit("shard", lambda: open(path, "rb"))  # after close: never opened
    assert late.take() is None


def test_hints_go_out_in_order_merged_and_survive_failures() -> None:
    sent: list[list[str]] = []
    gate = threading.Event()
    entered = threading.Event()

    def send(batch: list[str]) -> None:
        entered.set()
        gate.wait(10)
        sent.append(batch)
        if batch == ["boom"]:
            raise OSError("the daemon is gone")

    hints: HintSender[str] = HintSender(send, name="test-hints")
    hints.put(["boom"])
    assert entered.wait(10)
    hints.put(["a", "b"])  # queued while the first is in flight: merged into one request
    hints.put(["b", "c"])
    gate.set()
    assert hints.flush(10)
    assert sent == [["boom"], ["a", "b", "c"]]
    hints.put(["d"])
    hints.close(timeout=10)  # what is queued still goes out
    hints.put(["e"])  # after close: dropped
    assert sent[-1] == ["d"] and ["e"] not in sent
