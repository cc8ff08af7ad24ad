"""What a request handler tells the fills it starts, through context variables: a fill's task
inherits its creator's context, and :meth:`ClusterOrigin.call` carries it onto the worker thread.

A peer's request sets :data:`PEER_CALLER` (and so :data:`ORIGIN_ONLY`) before it joins or starts
a fill: that fill reads the real origin only, so two daemons whose views of the ring differ can
never forward a read to each other in a loop.
"""

from __future__ import annotations

from contextvars import ContextVar

from sidecar.daemon.metrics import Metrics

__all__ = ["ORIGIN_ONLY", "PEER_CALLER", "count_served"]

ORIGIN_ONLY: ContextVar[bool] = ContextVar("shardcache_origin_only", default=False)
"""Reads started here go to the real origin, never to a peer."""

PEER_CALLER: ContextVar[str | None] = ContextVar("shardcache_peer_caller", default=None)
"""The member id of the peer this request is for, ``None`` for a client's."""


def count_served(metrics: Metrics, source: str, count: int) -> None:
    """Count ``count`` bytes sent: under ``source`` for a client, under ``peer`` for a peer."""
    if PEER_CALLER.get() is not None:
        metrics.peer_bytes_out.inc(count)
        source = "peer"
    metrics.served_bytes.labels(source=source).inc(count)
