"""Prometheus metrics of the master, on a registry of its own (several masters in one test
process must not collide on the global one)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from loader.master.server.wait import WaitTotals
from wire.stall import WAIT_BUCKETS_S

__all__ = ["MasterMetrics"]

_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


class _JobCollector(Collector):
    """Per-job gauges read from the live state at scrape time (nothing to keep in sync)."""

    def __init__(self, source: Callable[[], list[dict[str, Any]]]) -> None:
        self._source = source

    def collect(self) -> Iterator[Any]:
        shards = GaugeMetricFamily("shardcache_master_job_shards", "Shards of the current epoch by state", labels=["job", "state"])
        epoch = GaugeMetricFamily("shardcache_master_job_epoch", "Current epoch of the job", labels=["job"])
        rate = GaugeMetricFamily("shardcache_master_job_samples_per_second", "Samples processed per second (last 30 s)", labels=["job"])
        events = CounterMetricFamily("shardcache_master_job_events", "Lease events of the job", labels=["job", "event"])
        # Cache-aware leases (jobs with a locality_window only).
        placed = CounterMetricFamily(
            "shardcache_master_job_leases_by_locality",
            "Leases granted by how the shard stood to the trainer's node: owner (its cluster-cache owner is there), "
            "cached (last read there), other, unplaced (nothing known)",
            labels=["job", "locality"],
        )
        local = GaugeMetricFamily(
            "shardcache_master_job_local_lease_ratio",
            "Share of the job's placed leases whose shard was on the trainer's node (0..1)", labels=["job"],
        )
        moved = GaugeMetricFamily(
            "shardcache_master_job_order_displacement_positions",
            "Mean distance, in positions, between a shard's place in the seeded order and when it was handed out "
            "(the newest epoch)", labels=["job"],
        )
        # The node daemons' reads for the job (their reports' counters, summed over nodes; never
        # down: a restarted daemon's earlier counts are kept, a node gone quiet stays counted).
        # Labels job and source only, never node: a thousand nodes are not a thousand series.
        cache_bytes = CounterMetricFamily(
            "shardcache_master_job_cache_bytes",
            "Bytes the node daemons served to the job's readers, by source: hit (from the node's cache), origin "
            "(the object store), peer (another node's cache), prefetch (filled ahead on the master's plan)",
            labels=["job", "source"],
        )
        hit_ratio = GaugeMetricFamily(
            "shardcache_master_job_cache_hit_ratio",
            "Share of the job's bytes read from the nodes' caches: hit / (hit + origin + peer)", labels=["job"],
        )
        rho = GaugeMetricFamily(
            "shardcache_master_job_order_spearman",
            "Rank correlation of the handed-out order with the seeded order (the newest epoch; 1: unchanged)",
            labels=["job"],
        )
        for status in self._source():
            name = status["name"]
            for state in ("todo", "leased", "done", "failed"):
                shards.add_metric([name, state], status["shards"][state])
            epoch.add_metric([name], status["epoch"])
            rate.add_metric([name], status.get("samples_per_s") or 0.0)
            for event, value in status.get("totals", {}).items():
                events.add_metric([name, event], value)
            locality = status.get("locality")
            if locality:
                for kind, value in locality["leases"].items():
                    placed.add_metric([name, kind], value)
                if locality["local_share"] is not None:
                    local.add_metric([name], locality["local_share"])
                newest = locality["epochs"][-1] if locality["epochs"] else None
                if newest is not None and newest["mean_displacement"] is not None:
                    moved.add_metric([name], newest["mean_displacement"])
                if newest is not None and newest["spearman"] is not None:
                    rho.add_metric([name], newest["spearman"])
            cache = status.get("cache")
            if cache:
                totals = cache["totals"]
                for source in ("hit", "origin", "peer", "prefetch"):
                    cache_bytes.add_metric([name, source], totals[f"{source}_bytes"])
                if totals["hit_rate"] is not None:
                    hit_ratio.add_metric([name], totals["hit_rate"])
        yield from (placed, local, moved, rho, cache_bytes, hit_ratio)
        yield shards
        yield epoch
        yield rate
        yield events


class _WaitCollector(Collector):
    """The trainers' waits for data per job, read at scrape time from the reports' totals. A
    histogram built from the buckets the trainers counted (the master never sees single waits):
    its ``_count`` is steps, its ``_sum`` the seconds waited; label ``job`` only, so the series
    stay few however many trainers a job has."""

    def __init__(self, source: Callable[[], list[tuple[str, WaitTotals, float | None]]]) -> None:
        self._source = source

    def collect(self) -> Iterator[Any]:
        waits = HistogramMetricFamily(
            "shardcache_master_wait_seconds",
            "Time a trainer's training loop waited for its next sample or batch, one observation per step",
            labels=["job"],
        )
        ratio = GaugeMetricFamily(
            "shardcache_master_wait_ratio",
            "Share of the trainers' wall time spent waiting for data over the last 60 s (0..1, all trainers)",
            labels=["job"],
        )
        for job, totals, fraction in self._source():
            cumulative, running = [], 0
            for bound, count in zip(WAIT_BUCKETS_S, totals.buckets, strict=True):
                running += count
                cumulative.append(("+Inf" if math.isinf(bound) else repr(bound), float(running)))
            waits.add_metric([job], cumulative, totals.seconds)
            ratio.add_metric([job], fraction or 0.0)
        yield waits
        yield ratio


class MasterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "shardcache_master_requests_total", "API requests by route and HTTP status", ["route", "code"], registry=self.registry
        )
        self.latency = Histogram(
            "shardcache_master_request_duration_seconds", "API request latency", ["route"],
            buckets=_LATENCY_BUCKETS, registry=self.registry,
        )
        self.commit_latency = Histogram(
            "shardcache_master_commit_duration_seconds", "Duration of one group commit to the state store",
            buckets=_LATENCY_BUCKETS, registry=self.registry,
        )
        self.commit_batch = Histogram(
            "shardcache_master_commit_batch_events", "Events made durable per group commit",
            buckets=_BATCH_BUCKETS, registry=self.registry,
        )
        self.refused = Counter(
            "shardcache_master_lease_refusals_total", "Renew/complete/fail refused because the lease was lost",
            ["action"], registry=self.registry,
        )
        self.lease_polls = Gauge(
            "shardcache_master_lease_polls_waiting",
            "Lease requests held in a long poll now: trainers with nothing to read until the job changes",
            registry=self.registry,
        )
        self.lease_poll_wait = Histogram(
            "shardcache_master_lease_poll_wait_seconds",
            "How long a long-polled lease request was held (not counted in the request duration)",
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0), registry=self.registry,
        )
        self.leader = Gauge("shardcache_master_leader", "1 while this master leads and serves", registry=self.registry)
        self.node_reports = Counter(
            "shardcache_master_node_reports_total",
            "Node daemons' reports (POST /v1/nodes/{node}/report) by outcome: applied, resend (a delta the master "
            "could not apply: a full report asked for), refused (a 4xx or 503 answer)",
            ["outcome"], registry=self.registry,
        )
        for outcome in ("applied", "resend", "refused"):
            self.node_reports.labels(outcome)
        self.store_failures = Counter(
            "shardcache_master_store_failures_total", "State store writes that failed", registry=self.registry
        )

        self._request_children: dict[tuple[str, int], tuple[Any, Any]] = {}

    def observe_request(self, route: str, status: int, seconds: float) -> None:
        # labels() hashes and locks on every call: keep the children per (route, status).
        children = self._request_children.get((route, status))
        if children is None:
            children = (self.requests.labels(route, str(status)), self.latency.labels(route))
            self._request_children[(route, status)] = children
        children[0].inc()
        children[1].observe(seconds)

    def render(self, jobs: list[dict[str, Any]], waits: list[tuple[str, WaitTotals, float | None]]) -> bytes:
        """The exposition text: this master's own series, then the per-job ones of ``jobs`` and
        ``waits`` (statuses and wait figures the caller may see, read from the live state now).
        The job series are built per scrape, not registered: who asks decides which jobs appear."""
        scrape = CollectorRegistry(auto_describe=False)
        scrape.register(_JobCollector(lambda: jobs))
        scrape.register(_WaitCollector(lambda: waits))
        return generate_latest(self.registry) + generate_latest(scrape)

    def observe_commit(self, events: int, seconds: float) -> None:
        self.commit_batch.observe(events)
        self.commit_latency.observe(seconds)
