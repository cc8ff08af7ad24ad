"""Reads attributed to jobs: what each job's readers read, and from where.

A reader names its job with the ``x-shardcache-job`` header (:data:`wire.nodeplan.JOB_HEADER`;
the loader sends it when it has a job), on any request: :func:`job_header` checks it on every
route of the daemon's app, S3 and control API alike, and answers a malformed one 400
``InvalidArgument`` saying what a job name is. A read that names a job is counted for it here, by
:class:`JobTally`, where the daemon's other byte counters are kept
(:class:`~sidecar.daemon.accounting.Tally`, from :meth:`~sidecar.daemon.reads.ReadService.tally`):

- ``reads``: reads answered with a body (one each, as ``shardcache_client_reads`` counts them);
- ``hit_bytes``: bytes from this node's cache (a hit, by HTTP, path or descriptor, counted whole
  when a path or descriptor is handed out; a join of a fill running here);
- ``origin_bytes``: from the object store (a miss this daemon filled, a range read straight from
  it, a read streamed uncached);
- ``peer_bytes``: from another daemon of the cluster;
- ``prefetch_bytes``: bytes the lease master's plan had filled ahead for the job
  (:mod:`sidecar.daemon.prefetch`).

Under ``--auth sigv4`` a read is counted for its job *and its tenant* (the caller the daemon
checked): a tenant that names another's job counts in a row of its own, never in the other's.
``/_shardcache/stats`` then shows a caller only its own tenant's jobs (none to a caller without a
session), and ``/metrics`` carries no per-job series (:class:`JobCollector` with ``by_job`` off):
job names are a tenant's to know. The per-job view of a multi-tenant cluster is the lease
master's, which checks tenants (``shardcache status --job``, its page, its ``/metrics`` with the
operator's token). The reports to the master add a job's rows of every tenant up by job name, as
the master keys jobs by name: a tenant that names another's job on a node adds its own reads to
that job's figures there, and learns nothing by it.

A peer daemon's read is counted by the node that asked, never here. At most
:data:`~wire.nodeplan.MAX_JOBS` jobs are counted apart: a new job past that many takes the place
of the job seen least recently, whose counts are folded into :data:`~wire.nodeplan.OTHER_JOB`, so
that the totals never go down and the report's ``jobs`` stays bounded (a finished job's name goes
first, a running one's stays). The counters go into every report to the master
(:mod:`sidecar.daemon.masterlink`), ``/_shardcache/stats`` (``jobs``) and Prometheus
(``shardcache_job_*``, one series per job and source: at most MAX_JOBS + 1 job label values).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterator

from aiohttp import web
from aiohttp.typedefs import Handler
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from sidecar.daemon.accounting import Tally
from sidecar.daemon.metrics import Metrics
from sidecar.errors import BadRequest
from wire import errors as wire_errors
from wire.nodeplan import JOB_COUNTERS, JOB_HEADER, MAX_JOBS, OTHER_JOB, job_name

__all__ = ["JOBS", "JobCollector", "JobStats", "JobTally", "job_header", "request_job"]

_INDEX = {name: index for index, name in enumerate(JOB_COUNTERS)}
_BY_SOURCE = {"local": _INDEX["hit_bytes"], "origin": _INDEX["origin_bytes"], "peer": _INDEX["peer_bytes"]}
"""The counter of a :data:`~sidecar.daemon.metrics.NODE_SOURCES` source."""
_SERVED = (("hit", "hit_bytes"), ("origin", "origin_bytes"), ("peer", "peer_bytes"))
"""``shardcache_job_served_bytes``'s ``source`` labels and their counters."""


class JobStats:
    """Per-job counters (:data:`~wire.nodeplan.JOB_COUNTERS`), cumulative since the daemon
    started. Counted on the event loop, read by scrapes and reports on worker threads: a lock
    guards dict operations only (an RLock, as the store's: never held across anything slow)."""

    def __init__(self, max_jobs: int = MAX_JOBS) -> None:
        self.max_jobs = max_jobs
        self.folded = 0
        """Jobs whose counts went into :data:`OTHER_JOB` to make room for a newer one."""
        self._lock = threading.RLock()
        # (tenant, job) -> counters, least recently seen first; the tenant is "" without --auth
        # and for the plan's prefetches (the master names the job, no caller does).
        self._jobs: OrderedDict[tuple[str, str], list[int]] = OrderedDict()
        self._other = [0] * len(JOB_COUNTERS)

    def _row(self, tenant: str, job: str) -> list[int]:
        """The counters of ``tenant``'s ``job``, now the most recently seen; the caller holds the lock."""
        row = self._jobs.get((tenant, job))
        if row is not None:
            self._jobs.move_to_end((tenant, job))
            return row
        if job == OTHER_JOB:
            return self._other
        if len(self._jobs) >= self.max_jobs:
            _, oldest = self._jobs.popitem(last=False)
            for index, value in enumerate(oldest):
                self._other[index] += value
            self.folded += 1
        row = self._jobs[(tenant, job)] = [0] * len(JOB_COUNTERS)
        return row

    def count(self, job: str, counter: str, amount: int = 1, tenant: str = "") -> None:
        """Add ``amount`` to ``counter`` (one of :data:`JOB_COUNTERS`) of ``tenant``'s ``job``."""
        index = _INDEX[counter]
        with self._lock:
            self._row(tenant, job)[index] += amount

    def served(self, job: str, came_from: str, amount: int, tenant: str = "") -> None:
        """``amount`` bytes of a read of ``tenant``'s ``job``, from ``came_from`` (local, origin, peer)."""
        index = _BY_SOURCE[came_from]
        with self._lock:
            self._row(tenant, job)[index] += amount

    def snapshot(self) -> dict[str, dict[str, int]]:
        """Every job's counters, every tenant's rows of it added up (and :data:`OTHER_JOB`'s, once
        anything is counted there), as a report's ``jobs`` carries them."""
        merged: dict[str, list[int]] = {}
        with self._lock:
            for (_, job), row in self._jobs.items():
                into = merged.get(job)
                if into is None:
                    merged[job] = list(row)
                else:
                    for index, value in enumerate(row):
                        into[index] += value
            if any(self._other):
                merged[OTHER_JOB] = list(self._other)
        return {job: dict(zip(JOB_COUNTERS, row, strict=True)) for job, row in merged.items()}

    def snapshot_of(self, tenant: str) -> dict[str, dict[str, int]]:
        """``tenant``'s jobs only: its own rows, with the plan's prefetches for those jobs (a job's
        name is a tenant's to know; :data:`OTHER_JOB` holds other tenants' reads too)."""
        with self._lock:
            rows = {job: list(row) for (owner, job), row in self._jobs.items() if owner == tenant}
            for job, row in rows.items():
                planned = self._jobs.get(("", job))
                if planned is not None and tenant:
                    row[_INDEX["prefetch_bytes"]] += planned[_INDEX["prefetch_bytes"]]
        return {job: dict(zip(JOB_COUNTERS, row, strict=True)) for job, row in rows.items()}


class JobTally(Tally):
    """A read's counters (:class:`Tally`), also counted for the job its reader named."""

    __slots__ = ("_jobs", "_job", "_tenant", "_counted")

    def __init__(self, metrics: Metrics, peer: bool, jobs: JobStats, job: str, tenant: str = "") -> None:
        super().__init__(metrics, peer)
        self._jobs = jobs
        self._job = job
        self._tenant = tenant
        self._counted = not peer  # a peer's read is counted by the node that asked

    def read(self, came_from: str) -> None:
        super().read(came_from)
        if self._counted:
            self._jobs.count(self._job, "reads", tenant=self._tenant)

    def served(self, how: str, count: int, came_from: str) -> None:
        super().served(how, count, came_from)
        if self._counted:
            self._jobs.served(self._job, came_from, count, tenant=self._tenant)


JOBS = web.AppKey("jobs", JobStats)
_JOB: web.RequestKey[str] = web.RequestKey("job")


@web.middleware
async def job_header(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Check a request's ``x-shardcache-job``: a malformed one is a 400 ``InvalidArgument`` (on
    the control API as on the S3 API: inside the error middleware), before anything is read."""
    values = request.headers.getall(JOB_HEADER, [])
    if len(values) > 1:
        raise BadRequest(f"{JOB_HEADER}: give one job per request, not {len(values)} headers")
    if values:
        try:
            request[_JOB] = job_name(values[0], JOB_HEADER)
        except wire_errors.BadRequest as exc:
            raise BadRequest(f"{exc} (the loader sends its job= here; leave the header out to count for no job)") from None
    return await handler(request)


def request_job(request: web.Request) -> str:
    """The job the request names, checked by :func:`job_header` ("" for none)."""
    return request.get(_JOB, "")


class JobCollector(Collector):
    """``shardcache_job_*`` at scrape time, from :class:`JobStats` (one series per job and source);
    with ``by_job`` off (``--auth sigv4``: job names are their tenants'), none but the fold count."""

    def __init__(self, jobs: JobStats, by_job: bool = True) -> None:
        self._jobs = jobs
        self._by_job = by_job

    def describe(self) -> list[CounterMetricFamily]:
        return []  # no collect() at registration (it would run on the event loop)

    def collect(self) -> Iterator[CounterMetricFamily]:
        jobs = self._jobs.snapshot() if self._by_job else {}
        served = CounterMetricFamily(
            "shardcache_job_served_bytes",
            "Bytes read by the readers of each job (x-shardcache-job), by where they came from: hit (this node's "
            "cache), origin (the object store), peer (another daemon of the cluster)",
            labels=["job", "source"],
        )
        reads = CounterMetricFamily("shardcache_job_reads", "Reads of each job's readers (x-shardcache-job)",
                                    labels=["job"])
        prefetched = CounterMetricFamily(
            "shardcache_job_prefetch_bytes", "Bytes the lease master's plan had filled ahead for each job", labels=["job"],
        )
        for job, counters in jobs.items():
            for source, counter in _SERVED:
                served.add_metric([job, source], float(counters[counter]))
            reads.add_metric([job], float(counters["reads"]))
            prefetched.add_metric([job], float(counters["prefetch_bytes"]))
        yield served
        yield reads
        yield prefetched
        yield CounterMetricFamily(
            "shardcache_jobs_folded", f"Jobs whose counts were folded into {OTHER_JOB} to keep at most {self._jobs.max_jobs} apart",
            value=float(self._jobs.folded),
        )
