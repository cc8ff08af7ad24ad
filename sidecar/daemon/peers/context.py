"""What a request handler tells the fills it starts, through context variables: a fill's task
inherits its creator's context, and :meth:`ClusterOrigin.call` carries it onto the worker thread.

A peer's request sets :data:`PEER_CALLER` (and so :data:`ORIGIN_ONLY`) before it joins or starts
a fill: that fill reads the real origin only, so two daemons whose views of the ring differ can
never forward a read to each other in a loop.

The byte counts of a request are here too: what a peer is served counts as served to peers, what
a client is served counts as served, and as this node's client bytes by where the bytes came from
(:data:`~sidecar.daemon.metrics.NODE_SOURCES`). A read streamed without caching learns where its
bytes came from through :data:`READ_SOURCE`: the route is chosen on a worker thread, in a copy of
the handler's context that holds the same :class:`ReadSource`.
"""

from __future__ import annotations

from contextvars import ContextVar

from sidecar.daemon.metrics import Metrics

__all__ = ["ORIGIN_ONLY", "PEER_CALLER", "READ_SOURCE", "ReadSource", "count_read", "count_served", "current_source",
           "miss_source", "note_source", "track_source"]

ORIGIN_ONLY: ContextVar[bool] = ContextVar("shardcache_origin_only", default=False)
"""Reads started here go to the real origin, never to a peer."""

PEER_CALLER: ContextVar[str | None] = ContextVar("shardcache_peer_caller", default=None)
"""The member id of the peer this request is for, ``None`` for a client's."""


class ReadSource:
    """Where the body opened last for this request came from: ``origin`` or ``peer``."""

    __slots__ = ("source",)

    def __init__(self) -> None:
        self.source = "origin"


READ_SOURCE: ContextVar[ReadSource | None] = ContextVar("shardcache_read_source", default=None)
"""Set by :func:`track_source` before a read that is streamed without caching (passthrough)."""


def track_source() -> ReadSource:
    """A fresh :class:`ReadSource` for the bodies this request opens from now on. Set just before
    the streamed read: a fill this request started earlier keeps its own (its task copied the
    context then), so the fill's part requests cannot move it."""
    holder = ReadSource()
    READ_SOURCE.set(holder)
    return holder


def note_source(source: str) -> None:
    """Called where the route is chosen (any thread): the body just opened comes from ``source``."""
    holder = READ_SOURCE.get()
    if holder is not None:
        holder.source = source


def current_source() -> str:
    """Where the body opened last for this request came from (``origin`` when nothing noted it):
    for the fetcher's streamed reads, whose origin-or-peer byte counter depends on it."""
    holder = READ_SOURCE.get()
    return holder.source if holder is not None else "origin"


def count_served(metrics: Metrics, source: str, count: int, *, came_from: str) -> None:
    """Count ``count`` bytes sent: under ``source`` (how: hit, miss, ...) and ``came_from``
    (``local``, ``peer``, ``origin``) for a client, under ``peer`` only for a peer."""
    if PEER_CALLER.get() is not None:
        metrics.peer_bytes_out.inc(count)
        metrics.served["peer"].inc(count)
        return
    metrics.served[source].inc(count)
    metrics.client[came_from].inc(count)


def miss_source(state: str, fill_source: str) -> str:
    """Where a miss's bytes come from for this node's figures: a join of a fill in progress here
    (``coalesced``) reads this node's copy; a miss, wherever its fill reads (peer or origin)."""
    return "local" if state == "coalesced" else fill_source


def count_read(metrics: Metrics, came_from: str) -> None:
    """Count one read of a client's (nothing for a peer's: the asking node counts it), once per
    answer with a body, under where its first byte came from."""
    if PEER_CALLER.get() is None:
        metrics.client_read[came_from].inc()
