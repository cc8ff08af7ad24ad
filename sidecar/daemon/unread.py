"""Prefetched entries that left the cache before anyone read them: what a prefetch cost for nothing.

A prefetch spends origin bytes on a guess: a reader's hint of its next shards (``hint``) or the
lease master's plan (``plan``). When the cache is smaller than what its readers read, a fill can
evict a prefetched entry before its reader comes, and that reader's read fetches it again: the
origin pays twice. :class:`Unread` counts those, by cause, so that a policy's over-fetch can be
told apart from its misses (``/_shardcache/stats`` ``prefetch.evicted_unread``; Prometheus
``shardcache_prefetch_evicted_unread_total{cause}`` and ``..._bytes_total``).

A name is marked when a prefetch starts a fill of its own (joining a running fill is not a guess),
and unmarked by any read of it (:meth:`Unread.read`: a GET, a short-circuit open, a handle, a
peer's read), the reads of the fill in flight included. The store tells it each entry that leaves
the index (:meth:`cache.Store.watch`); a marked one is counted. At most one mark per cached or
filling object, so the marks are bounded by the cache.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from cache import Entry
from sidecar.daemon.metrics import PREFETCH_CAUSES, Metrics, counter_value

__all__ = ["Unread"]


class Unread:
    """Marks of prefetched objects not read yet; those evicted unread are counted in the
    daemon's metrics. Marked and read on the event loop, told of evictions on the store's
    threads: a lock guards the marks."""

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics
        self._lock = threading.Lock()
        self._marks: dict[tuple[str, str], str] = {}

    def started(self, bucket: str, key: str, cause: str) -> None:
        """A prefetch for ``cause`` started the fill of ``bucket/key``."""
        with self._lock:
            self._marks[(bucket, key)] = cause

    def read(self, bucket: str, key: str) -> None:
        """Someone read ``bucket/key`` (or joined its fill)."""
        if self._marks:  # no lock for the common case: nothing prefetched is waiting
            with self._lock:
                self._marks.pop((bucket, key), None)

    def watch(self, added: Sequence[Entry], removed: Sequence[Entry]) -> None:
        """The store's :data:`~cache.Watcher`: count the marked entries that left."""
        if not removed or not self._marks:
            return
        with self._lock:
            for entry in removed:
                cause = self._marks.pop((entry.bucket, entry.key), None)
                if cause is not None:
                    self._metrics.prefetch_evicted_unread.labels(cause=cause).inc()
                    self._metrics.prefetch_evicted_unread_bytes.labels(cause=cause).inc(entry.size)

    def forget(self, bucket: str, key: str) -> None:
        """A prefetch's fill ended without an entry (failed, refused, never cached)."""
        with self._lock:
            self._marks.pop((bucket, key), None)

    def stats(self) -> dict[str, object]:
        metrics = self._metrics
        return {
            "evicted": {c: int(counter_value(metrics.prefetch_evicted_unread, cause=c)) for c in PREFETCH_CAUSES},
            "evicted_bytes": {c: int(counter_value(metrics.prefetch_evicted_unread_bytes, cause=c))
                              for c in PREFETCH_CAUSES},
            "waiting": len(self._marks),
        }
