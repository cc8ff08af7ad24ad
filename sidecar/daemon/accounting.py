"""Byte accounting of the daemon's answers: the one place that decides which counters a read adds to.

Every byte a client is sent counts twice: by how it was sent (``served_bytes``: hit, miss,
coalesced, passthrough, short_circuit) and by where it came from (``client_bytes``, the node's
figures, :data:`~sidecar.daemon.metrics.NODE_SOURCES`): a hit, or a join of a fill already running
here, is ``local``; a miss is where its fill reads (the owner, ``peer``, or the ``origin``); a read
streamed uncached is where its body came from (:attr:`~sidecar.daemon.origins.base.Body.source`).
What a peer daemon is sent counts as served to peers only: the asking node counts it for its client.
"""

from __future__ import annotations

from sidecar.daemon.metrics import Metrics

__all__ = ["Tally", "miss_source"]


class Tally:
    """The counters of one answer, for a client's read or (``peer``) another daemon's."""

    __slots__ = ("_metrics", "_peer")

    def __init__(self, metrics: Metrics, peer: bool) -> None:
        self._metrics = metrics
        self._peer = peer

    def read(self, came_from: str) -> None:
        """One read with a body, counted once under where its first byte came from (nothing for
        a peer's: the asking node counts it)."""
        if not self._peer:
            self._metrics.client_read[came_from].inc()

    def served(self, how: str, count: int, came_from: str) -> None:
        """``count`` bytes sent: under ``how`` (hit, miss, ...) and ``came_from`` (``local``,
        ``peer``, ``origin``) for a client, under ``peer`` only for a peer."""
        metrics = self._metrics
        if self._peer:
            metrics.peer_bytes_out.inc(count)
            metrics.served["peer"].inc(count)
            return
        metrics.served[how].inc(count)
        metrics.client[came_from].inc(count)


def miss_source(state: str, fill_source: str) -> str:
    """Where a miss's bytes come from for this node's figures: a join of a fill in progress here
    (``coalesced``) reads this node's copy; a miss, wherever its fill reads (peer or origin)."""
    return "local" if state == "coalesced" else fill_source
