"""Prefetched entries the cache lets go before anyone reads them are counted, by cause
(sidecar/daemon/unread.py): the over-fetch a prefetch policy costs the origin, told apart from its
misses. A daemon in this process on a ``file://`` origin, a cache of two objects, LRU."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.support.daemons import HeldOrigin, http_get, make_settings, post_prefetch
from tests.support.threads import DaemonThread
from tests.support.waits import wait_until

SIZE = 50_000


def test_a_prefetch_evicted_unread_is_counted_and_a_read_one_is_not(
    tmp_path: Path, start_daemon: Callable[..., DaemonThread]
) -> None:
    root = tmp_path / "origin"
    (root / "bkt").mkdir(parents=True)
    for name in "abcd":
        (root / "bkt" / f"{name}.tar").write_bytes(os.urandom(SIZE))
    daemon = start_daemon(make_settings(tmp_path / "cache", f"file://{root}", capacity=2 * SIZE + SIZE // 2))
    assert post_prefetch(daemon.url, ["a.tar", "b.tar"]) == 2
    wait_until(lambda: daemon.stats()["cache"]["items"] == 2, timeout=20, what="the hints' fills")
    assert daemon.stats()["prefetch"]["evicted_unread"]["waiting"] == 2
    assert http_get(daemon.url + "/bkt/a.tar")[0] == 200  # a is read: b is the least recently used
    for name in "cd":  # two demand fills: b goes unread, then a, which was read
        assert http_get(daemon.url + f"/bkt/{name}.tar")[0] == 200
        daemon.settle()
    unread = daemon.stats()["prefetch"]["evicted_unread"]
    assert unread == {"evicted": {"hint": 1, "plan": 0}, "evicted_bytes": {"hint": SIZE, "plan": 0}, "waiting": 0}
    metrics = daemon.metrics()
    assert 'shardcache_prefetch_evicted_unread_total{cause="hint"} 1.0' in metrics
    # A prefetch whose fill fails (no such object) leaves no mark behind.
    post_prefetch(daemon.url, ["missing.tar"])
    wait_until(lambda: daemon.stats()["prefetch"]["failed"] + daemon.stats()["prefetch"]["done"] >= 3, timeout=20,
               what="the failed prefetch")
    assert daemon.stats()["prefetch"]["evicted_unread"]["waiting"] == 0
    assert f'shardcache_prefetch_evicted_unread_bytes_total{{cause="hint"}} {float(SIZE)}' in metrics


def test_a_prefetch_whose_object_was_read_while_it_waited_fetches_nothing(
    tmp_path: Path, start_daemon: Callable[..., DaemonThread], monkeypatch: Any
) -> None:
    """A prefetch waits while a reader's fill runs (``Prefetcher.DEMAND_YIELD_MAX_S``). A reader
    that asked for its object meanwhile read it: the prefetch is dropped, not started on an object
    the cache has let go since. The capacity bed's daemon logs showed hints and plan prefetches
    that fetched a shard again seconds after its trainer had read it."""
    root = tmp_path / "origin"
    (root / "bkt").mkdir(parents=True)
    for name in ("a", "b", "c", "slow"):
        (root / "bkt" / f"{name}.tar").write_bytes(os.urandom(SIZE))
    origin = HeldOrigin(monkeypatch, "slow.tar")  # a reader's fill in flight: prefetches wait for it
    daemon = start_daemon(make_settings(tmp_path / "cache", f"file://{root}", capacity=2 * SIZE + SIZE // 2))
    slow = threading.Thread(target=http_get, args=(daemon.url + "/bkt/slow.tar",), daemon=True)
    slow.start()
    wait_until(lambda: origin.opened["slow.tar"] == 1, timeout=20, what="the slow read's fill")
    assert post_prefetch(daemon.url, ["a.tar"]) == 1
    for name in "abc":  # a is read (its hint still waiting), then evicted by b and c
        assert http_get(daemon.url + f"/bkt/{name}.tar")[0] == 200
    wait_until(lambda: daemon.stats()["fills_in_flight"] == 1, timeout=20, what="the fills but the slow one")
    queued = daemon.stats()["prefetch"]["queued"]["lease"]  # the hint, waiting for the slow fill (1)
    origin.release()
    slow.join(20)
    wait_until(lambda: (p := daemon.stats()["prefetch"])["read_first"] + p["done"] == 1, timeout=20,
               what="the hint's end")
    daemon.settle()
    assert origin.opened["a.tar"] == 1  # read once, and not fetched again for the hint
    assert daemon.stats()["prefetch"]["read_first"] == 1 and queued == 1
