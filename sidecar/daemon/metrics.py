"""Prometheus metrics of the daemon, on a registry of its own (several daemons may share a process
in tests). Store-level figures are read from :meth:`cache.Store.stats` at scrape time, so the
storage engine stays free of any metrics library."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

__all__ = ["LOOKUP_RESULTS", "MASTER_OUTCOMES", "NODE_SOURCES", "RANGE_FILL_OUTCOMES", "SERVED_SOURCES", "Metrics", "counter_value",
           "counter_by", "node_reads"]

LOOKUP_RESULTS = ("hit", "miss", "coalesced")
"""The ``result`` labels of ``shardcache_cache_lookups``."""
SERVED_SOURCES = ("hit", "miss", "coalesced", "passthrough", "short_circuit", "range_origin", "peer")
"""The ``source`` labels of ``shardcache_served_bytes`` (``range_origin``: small ranges of objects
not cached, each read by one ranged GET of the origin; ``peer``: bytes served to other daemons of
the cluster, counted there and not under hit or miss)."""
RANGE_FILL_OUTCOMES = ("started", "no_room", "busy")
"""The ``outcome`` labels of ``shardcache_range_fills``: what became of filling an object behind a
range read straight from the origin (started; no free room, since it never evicts; enough of them
running already)."""
MASTER_OUTCOMES = ("ok", "resend", "unreachable", "server_error", "not_leader", "refused", "rejected", "bad_answer",
                   "too_large", "error")
"""The ``outcome`` labels of ``shardcache_master_reports`` (:mod:`sidecar.daemon.masterlink`): ok (a
plan, applied), resend (the master asked for a full report), unreachable (no connection, or no
answer in time), server_error (5xx), not_leader (a follower answered), refused (401/403: the
token), rejected (another 4xx: the master refused the report), bad_answer (not a plan),
too_large (an answer past ``MAX_PLAN_BYTES``), error (this daemon failed to build or apply one)."""
NODE_SOURCES = ("local", "peer", "origin")
"""The ``source`` labels of ``shardcache_client_bytes`` and ``shardcache_client_reads``: where the
bytes this daemon's own clients (never its peers) read came from. ``local``: this node's cache (a
hit, by HTTP, path or descriptor, or a join of a fill already running here); ``peer``: another
daemon of the cluster (a miss, or an uncached read, served by the owner); ``origin``: the object
store (a miss this daemon filled from it, or an uncached read streamed from it)."""

PREFETCH_CAUSES = ("hint", "plan")
"""Why an object was prefetched (:mod:`sidecar.daemon.unread`): a reader's hint of its next
shards, the lease master's plan."""


def counter_value(counter: Counter, **labels: str) -> float:
    """What ``counter`` (its child with ``labels``) has counted, read through the public
    ``collect()``: the same figure Prometheus scrapes, for ``/_shardcache/stats``."""
    for family in counter.collect():
        for sample in family.samples:
            if sample.name.endswith("_total") and sample.labels == labels:
                return float(sample.value)
    return 0.0


def counter_by(counter: Counter, label: str) -> dict[str, float]:
    """What ``counter`` has counted per value of ``label`` (summed over its other labels)."""
    totals: dict[str, float] = {}
    for family in counter.collect():
        for sample in family.samples:
            if sample.name.endswith("_total"):
                value = sample.labels.get(label, "")
                totals[value] = totals.get(value, 0.0) + float(sample.value)
    return totals


def node_reads(metrics: Metrics) -> dict[str, object]:
    """The ``node_reads`` block of ``/_shardcache/stats``: this node's clients' bytes and reads
    by :data:`NODE_SOURCES`, and byte-weighted shares of each (``None`` before the first byte)."""
    counted, counted_reads = counter_by(metrics.client_bytes, "source"), counter_by(metrics.client_reads, "source")
    by_bytes = {source: counted.get(source, 0.0) for source in NODE_SOURCES}
    reads = {source: counted_reads.get(source, 0.0) for source in NODE_SOURCES}
    total = sum(by_bytes.values())

    def share(source: str) -> float | None:
        return round(by_bytes[source] / total, 4) if total else None

    return {"bytes": by_bytes, "reads": reads, "local_hit_ratio": share("local"),
            "peer_ratio": share("peer"), "origin_ratio": share("origin")}


class _StoreCollector(Collector):
    def __init__(self, stats: Callable[[], dict[str, object]]) -> None:
        self._stats = stats

    def describe(self) -> list[GaugeMetricFamily]:
        # Without this the registry calls collect() at registration, on the event loop; stats()
        # asks the file system for free space.
        return []

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        stats = self._stats()
        gauges = {
            "shardcache_cache_used_bytes": ("used_bytes", "Bytes of published cache entries"),
            "shardcache_cache_capacity_bytes": ("capacity_bytes", "Configured cache capacity"),
            "shardcache_cache_reserved_bytes": ("reserved_bytes", "Bytes reserved by fills in progress"),
            "shardcache_cache_items": ("items", "Published cache entries"),
            "shardcache_cache_unverified_items": ("unverified_items", "Entries the origin vouched for in no checkable way"),
            "shardcache_cache_unverified_bytes": ("unverified_bytes", "Bytes of entries the origin vouched for in no checkable way"),
            "shardcache_cache_filling_items": ("filling", "Fills in progress"),
            "shardcache_cache_fs_free_bytes": ("fs_free_bytes", "Free bytes on the cache file system"),
        }
        for name, (field, doc) in gauges.items():
            yield GaugeMetricFamily(name, doc, value=float(stats.get(field, 0)))  # type: ignore[arg-type]
        counters = {
            "shardcache_cache_evictions": ("evictions", "Entries evicted to make room"),
            "shardcache_cache_evicted_bytes": ("evicted_bytes", "Bytes evicted to make room"),
            "shardcache_cache_admitted": ("admitted", "Entries published"),
            "shardcache_cache_rejected_full": ("rejected_full", "Objects not cached for lack of room"),
            "shardcache_cache_integrity_failures": ("integrity_failures", "Fills whose checksum mismatched"),
            "shardcache_cache_corrupt_removed": ("corrupt_removed", "Cached files found corrupt and removed"),
            "shardcache_cache_no_space": ("no_space", "Writes refused by a full file system"),
        }
        for name, (field, doc) in counters.items():
            yield CounterMetricFamily(name, doc, value=float(stats.get(field, 0)))  # type: ignore[arg-type]
        yield from _tenant_families(stats.get("tenants"))


def _tenant_families(block: object) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
    """The store's ``tenants`` block (per-tenant quota): totals only, no tenant label, since a
    label per IAM principal would grow the series without bound and show every name to anyone
    who can scrape."""
    tenants = block if isinstance(block, dict) else {}
    quota = tenants.get("quota_bytes")
    yield GaugeMetricFamily(
        "shardcache_tenant_quota_bytes", "Bytes one tenant may bring into the cache (0: no quota)",
        value=float(quota or 0),
    )
    gauges = {
        "shardcache_tenants": ("count", "Tenants with entries in the cache"),
        "shardcache_tenants_over_quota": ("over_quota", "Tenants whose entries and fills exceed the quota"),
    }
    for name, (field, doc) in gauges.items():
        yield GaugeMetricFamily(name, doc, value=float(tenants.get(field, 0)))
    counters = {
        "shardcache_tenant_quota_evictions": ("quota_evictions", "Entries evicted to keep a tenant within its quota"),
        "shardcache_tenant_quota_evicted_bytes": ("quota_evicted_bytes", "Bytes evicted to keep a tenant within its quota"),
        "shardcache_tenant_quota_rejections": ("rejected_quota", "Objects not cached because the tenant's quota had no room"),
    }
    for name, (field, doc) in counters.items():
        yield CounterMetricFamily(name, doc, value=float(tenants.get(field, 0)))


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "shardcache_requests", "HTTP requests answered", ["method", "status"], registry=r
        )
        self.cache_lookups = Counter(
            "shardcache_cache_lookups", "Object reads by cache outcome", ["result"], registry=r
        )
        self.served_bytes = Counter(
            "shardcache_served_bytes", "Bytes sent to clients, by where they came from", ["source"], registry=r
        )
        # Every series from the start, at 0: a scrape (and /stats) sees each outcome before its first.
        for result in LOOKUP_RESULTS:
            self.cache_lookups.labels(result=result)
        # The children, made once: counting a chunk takes no labels() lookup (a lock and a tuple).
        self.served = {source: self.served_bytes.labels(source=source) for source in SERVED_SOURCES}
        # Per node (issue 18): what this node's own clients read, by where the bytes came from.
        # served_bytes says how they were sent (hit, miss, sendfile, path, ...); these say whether
        # they crossed the network to get here, and which network.
        self.client_bytes = Counter(
            "shardcache_client_bytes",
            "Bytes this daemon's own clients (not its peers) read, by where they came from: local (this "
            "node's cache), peer (another daemon of the cluster), origin (the object store)",
            ["source"], registry=r,
        )
        self.client_reads = Counter(
            "shardcache_client_reads",
            "Object reads of this daemon's own clients (not its peers), by where their first byte came from",
            ["source"], registry=r,
        )
        self.client = {source: self.client_bytes.labels(source=source) for source in NODE_SOURCES}
        self.client_read = {source: self.client_reads.labels(source=source) for source in NODE_SOURCES}
        self.origin_latency = Histogram(
            "shardcache_origin_request_duration_seconds",
            "Time from sending an origin request to its response headers",
            ["op"],
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
            registry=r,
        )
        self.origin_bytes = Counter("shardcache_origin_read_bytes", "Bytes read from the origin", registry=r)
        self.origin_errors = Counter(
            "shardcache_origin_errors", "Failed origin attempts, by kind", ["kind"], registry=r
        )
        self.origin_retries = Counter("shardcache_origin_retries", "Origin attempts retried", registry=r)
        self.fills = Counter(
            "shardcache_fills", "Object fills finished, by outcome and where their bytes came from (origin, peer)",
            ["outcome", "source"], registry=r,
        )
        # The cluster cache (sidecar/daemon/peers/): bytes read from peers (in) and served to them (out).
        self.peer_bytes = Counter(
            "shardcache_peer_bytes", "Object bytes exchanged with other daemons of the cluster", ["direction"], registry=r
        )
        self.peer_bytes_in = self.peer_bytes.labels(direction="in")
        self.peer_bytes_out = self.peer_bytes.labels(direction="out")
        self.cluster_members = Gauge(
            "shardcache_cluster_members", "Members of the cluster cache by health, this daemon included",
            ["state"], registry=r,
        )
        for state in ("live", "dead"):
            self.cluster_members.labels(state=state)
        # A security signal for the platform team's alert: peer requests not signed with a secret.
        self.peer_links_open = Gauge(
            "shardcache_cluster_peer_links_open",
            "1 when this daemon is a cluster member whose peer links are open (no --peer-secret-file: peer "
            "requests are not authenticated), else 0",
            registry=r,
        )
        for source in ("origin", "peer"):
            self.fills.labels(outcome="cached", source=source)
        self.fill_checks = Counter(
            "shardcache_fill_checks",
            "Fills checked against what the origin vouches for: verified, unverified (nothing to check) "
            "or failed (bytes that did not match; nothing cached), by checksum algorithm",
            ["result", "algorithm"], registry=r,
        )
        self.claim_outcomes = Counter(
            "shardcache_claim_disputes",
            "Reads whose caller's xxh3-128 disagreed with the cached copy, by what the daemon did: "
            "refetched (an unverified or corrupt copy), mismatch (answered 409 ChecksumMismatch)",
            ["outcome"], registry=r,
        )
        self.range_fills = Counter(
            "shardcache_range_fills",
            "Fills of whole objects considered behind ranges read straight from the origin, by outcome: "
            "started, no_room (such a fill never evicts), busy (enough of them running)",
            ["outcome"], registry=r,
        )
        for outcome in RANGE_FILL_OUTCOMES:
            self.range_fills.labels(outcome=outcome)
        self.master_reports = Counter(
            "shardcache_master_reports",
            "Reports to the lease master (--master), by outcome: ok, resend (a full report asked for), unreachable, "
            "server_error, not_leader, refused (the token), rejected (the report), bad_answer (not a plan), "
            "too_large, error",
            ["outcome"], registry=r,
        )
        self.master_outcome = {outcome: self.master_reports.labels(outcome=outcome) for outcome in MASTER_OUTCOMES}
        self.prefetch_queued = Gauge(
            "shardcache_prefetch_queue_items", "Prefetches waiting, by priority", ["priority"], registry=r
        )
        # sidecar/daemon/unread.py: prefetches the cache let go before anyone read them.
        self.prefetch_evicted_unread = Counter(
            "shardcache_prefetch_evicted_unread",
            "Prefetched entries that left the cache before anyone read them, by why they were prefetched "
            "(hint: a reader's next shards; plan: the lease master's plan)", ["cause"], registry=r,
        )
        self.prefetch_evicted_unread_bytes = Counter(
            "shardcache_prefetch_evicted_unread_bytes", "Bytes of prefetched entries that left the cache unread, by cause",
            ["cause"], registry=r,
        )
        for cause in PREFETCH_CAUSES:
            self.prefetch_evicted_unread.labels(cause=cause)
            self.prefetch_evicted_unread_bytes.labels(cause=cause)
        self.request_duration = Histogram(
            "shardcache_request_duration_seconds",
            "Time to answer object requests (to the last byte)",
            ["cache"],
            buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 30),
            registry=r,
        )

    @contextlib.contextmanager
    def origin_request(self, op: str) -> Iterator[None]:
        """Times one origin request (``op``: get, head, list, ...) from its sending to its response
        headers, when it succeeds: the one place the origin's latency is measured."""
        began = time.perf_counter()
        yield
        self.origin_latency.labels(op=op).observe(time.perf_counter() - began)

    def watch_store(self, stats: Callable[[], dict[str, object]]) -> None:
        self.registry.register(_StoreCollector(stats))
