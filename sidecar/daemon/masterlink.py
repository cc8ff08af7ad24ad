"""The node daemon's link to a lease master (``serve --master URL``): reports of what this node
caches, and the plan the master answers with, applied.

Every plan ``interval_s`` (:attr:`MasterLinkSettings.first_interval_s` before the first plan) the
daemon posts a report (:class:`wire.nodeplan.NodeReport`) to ``POST {master}/v1/nodes/{node}/report``:
first a full one (every cached object's name, once whatever its versions), then deltas on the last
report the master took (``base``): the names cached and dropped since. What changed is kept by a
watcher on the store (:class:`HeldNames`, O(1) a change); past :data:`~wire.nodeplan.MAX_HASHES`
changes pending it stops keeping them and the next report is full. A report that fails gives its
changes back, so the next delta covers them; an answer ``resend: "full"`` (the master does not hold
the base: restarted, newly elected, a report lost) makes the next report full, at once. Each report
carries the store's capacity, use and mean entry size, and the per-job counters
(:mod:`sidecar.daemon.jobstats`). The daemon's instance id is random per start.

The plan is applied as it comes (:meth:`MasterLink.apply`): its ``keep`` ranks the cached objects
(soonest needed first; the plan's prefetch list after it, so that what the plan fills is not the
next fill's victim before the master ranks it) for ``--eviction planned``
(:meth:`cache.Store.set_plan`); its ``prefetch`` list goes to the prefetcher at lease priority, in
order (:meth:`~sidecar.daemon.prefetch.Prefetcher.submit_plan`), under every policy.

Several masters (``--master URL1,URL2``): the one that answered last is asked first; an unreachable
one or a 5xx passes to the next; a follower's ``NotLeader`` answer is followed to the leader it
names, but only to one of the URLs given (the report carries the master's token: it goes nowhere
else). Whatever goes wrong (master unreachable, 5xx, the token refused, an answer that is not a
plan or is larger than :data:`~wire.nodeplan.MAX_PLAN_BYTES`) is counted
(``shardcache_master_reports{outcome}``), logged at most once a minute while it lasts, shown in
``/_shardcache/stats`` (``master``), and retried with backoff: serving never waits on the master.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import secrets
import threading
import time
import urllib.parse
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web

from cache import Entry, Store
from sidecar.daemon.jobstats import JobStats
from sidecar.daemon.metrics import Metrics
from sidecar.daemon.prefetch import Prefetcher, PrefetchItem
from sidecar.daemon.settings import MasterLinkSettings
from sidecar.errors import SidecarError
from wire import jsontext
from wire.errors import WireError
from wire.names import Address, parse_connect, validate_bucket, validate_key
from wire.nodeplan import MAX_HASHES, MAX_PLAN_BYTES, NodePlan, NodeReport, name_hash, parse_plan

__all__ = ["MASTERLINK", "HeldNames", "MasterLink", "start_masterlink"]

log = logging.getLogger(__name__)

_USER_AGENT = "shardcache-daemon/1"
_LOG_EVERY_S = 60.0  # a failure that lasts is logged this often, not every report
_MAX_ERROR_BYTES = 64 * 1024  # an error answer's body: read this far, for NotLeader's leader


class HeldNames:
    """What the store holds, by name (:func:`wire.nodeplan.name_hash`), and the names cached and
    dropped since the last report the master took: the store's watcher (:meth:`cache.Store.watch`,
    called under the store's lock, O(1) an entry). Reports take from it on worker threads."""

    def __init__(self, max_pending: int = MAX_HASHES) -> None:
        self.max_pending = max_pending
        self._lock = threading.Lock()
        self._versions: dict[int, int] = {}  # name -> versions cached
        self._added: set[int] = set()
        self._dropped: set[int] = set()
        self._untracked = True  # changes not kept: the next report is full (until the first)

    def __call__(self, added: Sequence[Entry], removed: Sequence[Entry]) -> None:
        with self._lock:
            for entry in added:
                name = name_hash(entry.bucket, entry.key)
                versions = self._versions.get(name, 0)
                self._versions[name] = versions + 1
                if not versions:
                    self._change(name, self._added, self._dropped)
            for entry in removed:
                name = name_hash(entry.bucket, entry.key)
                versions = self._versions.get(name, 0)
                if versions > 1:
                    self._versions[name] = versions - 1
                elif versions:
                    del self._versions[name]
                    self._change(name, self._dropped, self._added)

    def _change(self, name: int, into: set[int], undoes: set[int]) -> None:
        """``name`` came (``into`` added) or went (``into`` dropped) since the base: a change
        that undoes a pending one cancels it."""
        if self._untracked:
            return
        if name in undoes:
            undoes.discard(name)
        else:
            into.add(name)
            if len(self._added) + len(self._dropped) > self.max_pending:
                self._untracked = True  # too many to send as a delta: the next report is full
                self._added, self._dropped = set(), set()

    def __len__(self) -> int:
        return len(self._versions)

    def take_full(self) -> array[int]:
        """Every name held, for a full report; changes are kept from now on, relative to it."""
        with self._lock:
            self._untracked = False
            self._added, self._dropped = set(), set()
            return array("Q", self._versions)

    def take(self, full: bool) -> tuple[bool, array[int], array[int]]:
        """(full, held, dropped) for the next report: a delta unless ``full`` is asked for or no
        delta is kept, else every name held (dropped empty)."""
        delta = None if full else self.take_delta()
        if delta is None:
            return True, self.take_full(), array("Q")
        return False, delta[0], delta[1]

    def take_delta(self) -> tuple[array[int], array[int]] | None:
        """The names cached and dropped since the last report taken, or ``None``: not kept (the
        next report must be full)."""
        with self._lock:
            if self._untracked:
                return None
            added, dropped = self._added, self._dropped
            self._added, self._dropped = set(), set()
        return array("Q", added), array("Q", dropped)

    def give_back(self, delta: tuple[array[int], array[int]] | None) -> None:
        """A report the master did not take: its changes (``None``: it was full) go into the next
        one, before those made since."""
        with self._lock:
            if delta is None:
                self._untracked = True
                self._added, self._dropped = set(), set()
                return
            if self._untracked:
                return
            added, dropped = set(delta[0]), set(delta[1])
            for name in self._added:  # the later changes, applied on the earlier ones
                if name in dropped:
                    dropped.discard(name)
                else:
                    added.add(name)
            for name in self._dropped:
                if name in added:
                    added.discard(name)
                else:
                    dropped.add(name)
            self._added, self._dropped = added, dropped
            if len(added) + len(dropped) > self.max_pending:
                self._untracked = True
                self._added, self._dropped = set(), set()


@dataclass
class _Built:
    """A report, encoded, with what to give back if the master does not take it."""

    seq: int
    full: bool
    body: bytes
    held: int
    dropped: int
    delta: tuple[array[int], array[int]] | None


class _Failure(SidecarError):
    """A report the master did not take (``outcome``: the metric's label), never seen outside the link."""

    def __init__(self, outcome: str, message: str, leader: str | None = None) -> None:
        super().__init__(message)
        self.outcome = outcome
        self.leader = leader


class MasterLink:
    """Reports to the master and applies its plans (module docstring): :meth:`start` and
    :meth:`stop` on the daemon's loop."""

    def __init__(
        self, settings: MasterLinkSettings, node: str, store: Store, prefetcher: Prefetcher, jobs: JobStats,
        metrics: Metrics, *, ranks: bool,
    ) -> None:
        self.settings = settings
        self.node = node
        self.store = store
        self.prefetcher = prefetcher
        self.jobs = jobs
        self.metrics = metrics
        self.ranks = ranks
        """Whether the store evicts by plan (``--eviction planned``): only then are ranks handed to it."""
        self.daemon = secrets.token_hex(8)
        self.held = HeldNames()
        self._masters = [(url, parse_connect(url, schemes=("http", "https"), base_path=True)) for url in settings.urls]
        self._path = f"/v1/nodes/{urllib.parse.quote(node, safe='')}/report"
        self._preferred = 0
        self._seq = 0
        self._acked: int | None = None  # the last report the master took: the next delta's base
        self._full_next = True
        self._sessions: dict[str, aiohttp.ClientSession] = {}
        self._task: asyncio.Task[None] | None = None
        self._unwatch: Callable[[], None] | None = None
        self.interval_s = settings.first_interval_s
        # What /_shardcache/stats shows.
        self.failures = 0  # in a row
        self.last_ok: float | None = None
        self.last_error: str | None = None
        self.last_error_at: float | None = None
        self._logged_at = 0.0
        self.reports = {"full": 0, "delta": 0}
        self.last_report: dict[str, Any] | None = None
        self.plan: dict[str, Any] | None = None
        # The order last handed to the store (start() hands it the empty one): a plan that ranks
        # alike is not handed again.
        self._ranked: array[int] = array("Q")

    # -- life cycle -------------------------------------------------------------------------

    async def start(self) -> None:
        # The store tells the watcher of every entry it holds now, then of every change: one pass
        # over the index, off the loop.
        self._unwatch = await asyncio.to_thread(self.store.watch, self.held)
        if self.ranks:
            # The policy indexes every entry by name at its first plan, under the store's lock:
            # now, at start-up, rather than at the master's first answer.
            await asyncio.to_thread(self.store.set_plan, (), name_hash)
        self._task = asyncio.create_task(self._run(), name="master-link")
        log.info("reporting node %s to the lease master at %s (daemon %s)", self.node, ", ".join(self.settings.urls),
                 self.daemon)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._unwatch is not None:
            await asyncio.to_thread(self._unwatch)
            self._unwatch = None
        for session in self._sessions.values():
            await session.close()
        self._sessions.clear()

    async def _run(self) -> None:
        while True:
            delay = await self.report_once()
            await asyncio.sleep(delay)

    # -- one report ---------------------------------------------------------------------------

    async def report_once(self) -> float:
        """Send one report and apply the answer; returns how long to wait before the next."""
        try:
            built = await asyncio.to_thread(self._build)
        except Exception as exc:  # a bug of ours: never the end of the link, nor of serving
            log.exception("building the report to the master failed")
            self._failed("error", f"building the report failed: {exc}")
            return self._backoff()
        try:
            plan = await self._send(built)
        except _Failure as failure:
            self.held.give_back(built.delta)
            self._failed(failure.outcome, str(failure))
            return self._backoff()
        except Exception as exc:
            log.exception("sending the report to the master failed")
            self.held.give_back(built.delta)
            self._failed("error", f"sending the report failed: {exc}")
            return self._backoff()
        self.metrics.master_outcome["ok" if plan.resend is None else "resend"].inc()
        self._acked = built.seq
        self.reports["full" if built.full else "delta"] += 1
        self.last_report = {"seq": built.seq, "full": built.full, "held": built.held, "dropped": built.dropped,
                            "bytes": len(built.body)}
        self._succeeded()
        self.interval_s = plan.interval_s
        if plan.resend == "full":
            # The master does not hold this report's base: a full one, at once (after a full one
            # asked again, at the interval). Its plan was made without knowing this node's cache.
            self._full_next = True
            return 0.0 if not built.full else self.interval_s
        self._full_next = False
        try:
            await self.apply(plan)
        except Exception as exc:
            log.exception("applying the master's plan %d failed", plan.seq)
            self._failed("error", f"applying plan {plan.seq} failed: {exc}")
        return self.interval_s

    def _build(self) -> _Built:
        """The next report (a worker thread: a full one packs every name held)."""
        full, held, dropped = self.held.take(self._full_next or self._acked is None)
        self._seq += 1
        capacity, used, items = self.store.usage()
        report = NodeReport(
            daemon=self.daemon, seq=self._seq, base=None if full else self._acked, held=held, dropped=dropped,
            capacity_bytes=capacity, used_bytes=used, mean_entry_bytes=used // items if items else 0,
            jobs=self.jobs.snapshot(),
        )
        body = json.dumps(report.to_json(), separators=(",", ":")).encode()
        return _Built(self._seq, full, body, len(held), len(dropped), None if full else (held, dropped))

    async def _send(self, built: _Built) -> NodePlan:
        """Post ``built`` to the masters in turn until one answers a plan; :class:`_Failure` with
        the last failure when none does. Each attempt's failure is counted."""
        count = len(self._masters)
        tried: set[int] = set()
        index: int | None = self._preferred
        failure: _Failure | None = None
        while index is not None:
            tried.add(index)
            url, address = self._masters[index]
            try:
                plan = await self._post(address, built)
            except _Failure as exc:
                self.metrics.master_outcome[exc.outcome].inc()
                failure = _Failure(exc.outcome, f"{url}: {exc}")
                if exc.outcome not in ("unreachable", "server_error", "not_leader"):
                    raise failure from None  # another master would answer the same: back off
                leader = self._index_of(exc.leader) if exc.leader else None
                if leader is not None and leader not in tried:
                    index = leader
                else:
                    index = next((i % count for i in range(index + 1, index + count) if i % count not in tried), None)
                continue
            self._preferred = index
            return plan
        assert failure is not None
        raise failure

    def _index_of(self, leader: str) -> int | None:
        """The index of the master a follower names as its leader, if it is one of ours."""
        try:
            named = parse_connect(leader, schemes=("http", "https"), base_path=True)
        except WireError:
            return None
        return next((i for i, (_, address) in enumerate(self._masters) if address == named), None)

    def _session(self, address: Address) -> tuple[aiohttp.ClientSession, str]:
        """The session for ``address`` and the URL prefix of its requests."""
        key = address.path if address.kind == "unix" else "tcp"
        session = self._sessions.get(key)
        if session is None:
            connector: aiohttp.BaseConnector = (
                aiohttp.UnixConnector(path=address.path) if address.kind == "unix" else aiohttp.TCPConnector(limit=4)
            )
            session = aiohttp.ClientSession(
                connector=connector, timeout=aiohttp.ClientTimeout(total=self.settings.timeout_s),
                auto_decompress=True,
            )
            self._sessions[key] = session
        prefix = "http://master" if address.kind == "unix" else address.url  # url: with its base path
        return session, prefix

    async def _post(self, address: Address, built: _Built) -> NodePlan:
        session, prefix = self._session(address)
        headers = {"Content-Type": "application/json", "User-Agent": _USER_AGENT, "Accept": "application/json"}
        if self.settings.token:
            headers["Authorization"] = f"Bearer {self.settings.token}"
        try:
            # No redirects: the token goes to the masters given, nowhere a redirect points.
            async with session.post(prefix + self._path, data=built.body, headers=headers, allow_redirects=False) as resp:
                if resp.status != 200:
                    raise _answer_failure(resp.status, await _read_bounded(resp, _MAX_ERROR_BYTES))
                if resp.content_length is not None and resp.content_length > MAX_PLAN_BYTES:
                    raise _Failure("too_large", f"a plan of {resp.content_length} bytes (at most {MAX_PLAN_BYTES})")
                raw = await _read_bounded(resp, MAX_PLAN_BYTES)
        except (aiohttp.ClientError, OSError) as exc:
            raise _Failure("unreachable", f"{type(exc).__name__}: {exc}") from None
        except TimeoutError:
            raise _Failure("unreachable", f"no answer within {self.settings.timeout_s:g} s") from None
        if raw is None:
            raise _Failure("too_large", f"an answer of more than {MAX_PLAN_BYTES} bytes: not a plan")
        try:
            plan = await asyncio.to_thread(_parse_plan, raw)
        except ValueError as exc:  # wire.errors.BadRequest too
            raise _Failure("bad_answer", f"not a plan: {exc}") from None
        if plan.seq != built.seq:
            raise _Failure("bad_answer", f"a plan for report {plan.seq}, not for report {built.seq}")
        return plan

    # -- the plan -------------------------------------------------------------------------------

    async def apply(self, plan: NodePlan) -> None:
        """The plan's ranks to the store (``--eviction planned``), its prefetches to the prefetcher."""
        items: list[PrefetchItem] = []
        skipped = 0
        for item in plan.prefetch:
            try:
                items.append(PrefetchItem(validate_bucket(item.bucket), validate_key(item.key), job=item.job, plan=True))
            except WireError:
                skipped += 1  # a name this daemon would refuse from a client too
        figures: dict[str, int] = {}
        if self.ranks:
            # The prefetches after the kept objects: ranked, so not evicted by the next plan
            # prefetch before the master has them in its order.
            order = array("Q", plan.keep)
            order.extend(name_hash(item.bucket, item.key) for item in items)
            if order != self._ranked:
                figures = await asyncio.to_thread(self.store.set_plan, order, name_hash)
                self._ranked = order
            else:  # a plan like the last (most, between leases) changes no rank: only its figures
                figures = self.store.plan_figures()
        queued = self.prefetcher.submit_plan(items)
        self.plan = {
            "seq": plan.seq, "interval_s": plan.interval_s, "prefetch": len(plan.prefetch), "keep": len(plan.keep),
            "queued": queued, "skipped": skipped, **figures,
        }
        if plan.prefetch:
            log.debug("plan %d: %d to prefetch (%d queued; next %s/%s, use %d), %d to keep", plan.seq,
                      len(plan.prefetch), queued, plan.prefetch[0].bucket, plan.prefetch[0].key, plan.prefetch[0].next_use,
                      len(plan.keep))

    # -- status -------------------------------------------------------------------------------

    def _succeeded(self) -> None:
        if self.failures:
            log.info("the lease master takes this node's reports again (after %d failures)", self.failures)
        self.failures = 0
        self.last_ok = time.monotonic()

    def _failed(self, outcome: str, message: str) -> None:
        if outcome == "error":
            self.metrics.master_outcome["error"].inc()
        self.failures += 1
        self.last_error = message
        now = time.monotonic()
        self.last_error_at = now
        if self.failures == 1 or now - self._logged_at >= _LOG_EVERY_S:
            self._logged_at = now
            log.warning("report to the lease master failed (%s): %s%s; retrying with backoff, serving goes on", outcome,
                        message, _advice(outcome))

    def _backoff(self) -> float:
        """The wait after a failure: the interval, doubled per failure in a row, jittered."""
        ceiling = min(self.settings.backoff_max_s, self.interval_s * 2 ** min(self.failures, 16))
        return random.uniform(ceiling / 2, ceiling)

    def describe(self) -> dict[str, Any]:
        """The ``master`` section of ``/_shardcache/stats``."""
        now = time.monotonic()
        return {
            "url": self.settings.urls[self._preferred],
            "urls": list(self.settings.urls),
            "node": self.node,
            "daemon": self.daemon,
            "interval_s": self.interval_s,
            "last_ok_age_s": round(now - self.last_ok, 3) if self.last_ok is not None else None,
            "last_error": self.last_error,
            "last_error_age_s": round(now - self.last_error_at, 3) if self.last_error_at is not None else None,
            "failures_in_a_row": self.failures,
            "reports": dict(self.reports),
            "last_report": self.last_report,
            "plan": self.plan,
            "held_names": len(self.held),
        }


def _advice(outcome: str) -> str:
    return {
        "refused": " (check --master-token-file: the master's --token-file)",
        "unreachable": " (check --master and that `shardcache master` runs there)",
        "not_leader": " (give every master's URL to --master, comma-separated)",
        "rejected": " (is the master older than this daemon?)",
    }.get(outcome, "")


def _answer_failure(status: int, raw: bytes | None) -> _Failure:
    """What an error answer of the master means for the link."""
    doc: Any = None
    with contextlib.suppress(ValueError):
        doc = jsontext.loads(raw or b"")
    code = doc.get("error") if isinstance(doc, dict) else None
    message = doc.get("message") if isinstance(doc, dict) else None
    said = f"{status} {code or ''}{': ' + str(message)[:300] if message else ''}".strip()
    if code == "NotLeader":
        leader = doc.get("leader") if isinstance(doc, dict) else None
        return _Failure("not_leader", f"a follower ({said})", leader if isinstance(leader, str) else None)
    if status in (401, 403):
        return _Failure("refused", f"the token was refused ({said})")
    if status >= 500:
        return _Failure("server_error", said)
    if status < 400:
        return _Failure("bad_answer", f"{said}: not a plan (redirects are not followed)")
    return _Failure("rejected", said)


async def _read_bounded(resp: aiohttp.ClientResponse, limit: int) -> bytes | None:
    """The body, or ``None`` once it is past ``limit`` bytes (the rest is not read)."""
    chunks: list[bytes] = []
    size = 0
    async for chunk in resp.content.iter_chunked(256 * 1024):
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
    return b"".join(chunks)


def _parse_plan(raw: bytes) -> NodePlan:
    """The plan in ``raw``; ``ValueError`` (``wire.errors.BadRequest``) when it is not one."""
    return parse_plan(jsontext.loads(raw))


MASTERLINK = web.AppKey("masterlink", MasterLink)


async def start_masterlink(app: web.Application, settings: MasterLinkSettings, node: str, store: Store,
                           prefetcher: Prefetcher, jobs: JobStats, metrics: Metrics, eviction: str) -> MasterLink:
    """The link, started and kept in ``app`` (:data:`MASTERLINK`)."""
    link = MasterLink(settings, node, store, prefetcher, jobs, metrics, ranks=eviction == "planned")
    await link.start()
    app[MASTERLINK] = link
    return link
