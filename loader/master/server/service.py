"""The master's service layer: the pure state machine, its journal and store, and leadership.

One event loop owns the :class:`~loader.master.server.state.MasterState`; each API call applies its
event synchronously (so events are totally ordered) and, when the state changed, waits until
the journal made the event durable before answering. A master serves only while it holds the
state: at once with SQLite, after winning the election with etcd (standbys answer
``NotLeader`` naming the leader). Whenever the store fails, the in-memory state may be ahead of
it, so it is thrown away: reloaded from SQLite, or leadership given up with etcd.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import secrets
import time
import uuid
from collections import deque
from collections.abc import AsyncIterable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from loader.master.errors import Forbidden, MasterError, NotLeader, StateError, TooManyJobs
from loader.master.server.auth import OPERATOR, Caller
from loader.master.server.events import CreateJob, Event, Holdings, Resume, create_head, event_from_json, event_to_text
from loader.master.server.holdings import TRAINER_RECENT_S, NodeBook, Planner, plan_interval, resolve_report
from loader.master.server.journal import Journal, Store
from loader.master.server.metrics import MasterMetrics
from loader.master.server.settings import MasterSettings, parse_state
from loader.master.server.spec import JobSpec, ShardTable, read_log_spec
from loader.master.server.spec_stream import SpecStream, read_spec
from loader.master.server.state import JobState, MasterState, Result
from loader.master.server.wait import JobWaits, WaitTotals
from wire.nodeplan import NodePlan, NodeReport
from wire.retry import Backoff
from wire.stall import WaitReport

if TYPE_CHECKING:
    from loader.master.server.placement import PlacementPoller

__all__ = ["MasterService"]

log = logging.getLogger(__name__)

_RATE_WINDOW_S = 30.0
_PRESENCE_KEEP_S = 600.0
# Create bodies up to this size are parsed on the event loop (a thread hop costs more); above
# it, or of unknown size, on a thread, and their shard lists built one at a time.
_INLINE_BODY_BYTES = 64 * 1024
_GATED_BODY_BYTES = 1024 * 1024
# Reloading the state after a store failure: until it works or the role changes.
_RECOVER_BACKOFF = Backoff(initial_s=0.1, max_s=5.0)
# A node report with more hashes than this, or naming a job whose hash index is still to build
# and holds more shards than that, is resolved on a thread (~1 µs a hash and job; ~2.5 µs a shard).
_INLINE_HASHES = 4096
_INLINE_INDEX_SHARDS = 4096
# Jobs with more live leases than this find their trainers' nodes from presence alone.
_LEASES_SCANNED = 50_000


class _Rate:
    """Samples processed over a sliding window (not durable: a rate, not an account), counted in
    one-second buckets: its memory is the window's length, however many completions arrive and
    whether or not anyone reads the rate."""

    def __init__(self) -> None:
        self._points: deque[list[int]] = deque()  # [second, samples]
        self._started = time.monotonic()

    def _trim(self, now: float) -> None:
        while self._points and self._points[0][0] < now - _RATE_WINDOW_S:
            self._points.popleft()

    def add(self, samples: int) -> None:
        if samples <= 0:
            return
        now = time.monotonic()
        second = int(now)
        if self._points and self._points[-1][0] == second:
            self._points[-1][1] += samples
        else:
            self._points.append([second, samples])
            self._trim(now)

    def per_s(self) -> float:
        now = time.monotonic()
        self._trim(now)
        span = min(_RATE_WINDOW_S, max(now - self._started, 1.0))
        return round(sum(n for _, n in self._points) / span, 1)


class MasterService:
    def __init__(self, settings: MasterSettings, *, clock: Callable[[], float] = time.time, metrics: MasterMetrics | None = None) -> None:
        self.settings = settings
        self.clock = clock
        self.metrics = metrics or MasterMetrics()
        self.identity = {"id": uuid.uuid4().hex, "url": settings.resolved_advertise_url()}
        self.role = "starting"
        self.state: MasterState | None = None
        self._store: Store | None = None
        self._journal: Journal | None = None
        self._seq = 0
        self._snap_seq = 0
        self._presence: dict[str, dict[str, tuple[str, float]]] = {}
        self._rates: dict[str, _Rate] = {}
        # job -> its trainers' wait-for-data reports (in memory only, as presence and the rate).
        self._waits: dict[str, JobWaits] = {}
        self._etcd: Any = None
        self._election: Any = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._term: asyncio.Task[None] | None = None
        # job -> an event set (and dropped) at the job's next change: what long-polling lease
        # requests wait on instead of the client sleeping a fixed retry interval.
        self._changes: dict[str, asyncio.Event] = {}
        # What node daemons reported (holdings.py): the bookkeeping of their reports, and their
        # plans' layouts. In memory only: a new master asks every node for a full report.
        self.nodes = NodeBook()
        self.planner = Planner()
        self._report_locks: dict[str, asyncio.Lock] = {}
        self._trainer_nodes_cache: dict[str, tuple[JobState, float, dict[str, set[str]]]] = {}
        self.placement: PlacementPoller | None = None
        if settings.cluster:
            from loader.master.server.placement import PlacementPoller

            self.placement = PlacementPoller(self, settings.cluster, settings.cluster_poll_s)

    # -- lifecycle --

    async def start(self) -> None:
        if self.placement is not None:
            self._spawn(self.placement.run(), "master-placement")
        kind, where = parse_state(self.settings.state)
        if kind == "sqlite":
            from loader.master.server.store_sqlite import SqliteStore

            store = SqliteStore(Path(where))
            await store.open()
            self._store = store
            await self._take_over(store)
            return
        from loader.master.server.election import Election
        from loader.master.server.etcd import EtcdClient, parse_etcd_url
        from loader.master.server.store_etcd import EtcdStore

        endpoints, prefix = parse_etcd_url(where)
        self._etcd = EtcdClient(endpoints, timeout_s=self.settings.etcd_timeout_s)
        self.role = "standby"
        election = Election(
            self._etcd,
            (prefix.rstrip("/") + "/leader").encode(),
            self.identity,
            ttl_s=self.settings.election_ttl_s,
            poll_s=self.settings.election_poll_s,
            on_elected=self._on_elected,
            on_deposed=self._on_deposed,
        )
        self._election = election
        self._store = EtcdStore(
            self._etcd, prefix, lambda: election.revision, compact=self.settings.etcd_compact
        )
        self._spawn(election.run(), "master-election")

    async def stop(self) -> None:
        if self._journal is not None:
            await self._journal.stop()
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            try:
                await task
            except (asyncio.CancelledError, Exception):
                pass
        self._tasks.clear()
        self.role = "stopped"
        self.metrics.leader.set(0)
        if self._store is not None:
            await self._store.close()
        if self._etcd is not None:
            await self._etcd.close()

    def _spawn(self, coro: Any, name: str) -> asyncio.Task[Any]:
        """A named, guarded background task: a crash is logged, never silently lost."""
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)

        def done(t: asyncio.Task[Any]) -> None:
            self._tasks.discard(t)
            if not t.cancelled() and t.exception() is not None:
                log.error("background task %s crashed", name, exc_info=t.exception())

        task.add_done_callback(done)
        return task

    async def _take_over(self, store: Store) -> None:
        """Load the state (snapshot + replayed log), start a journal, resume the leases."""
        # Handed to the replay thread, which lets go of the snapshot's text once it is read.
        loaded = [await store.load_text()]
        head = ',"ev":' + create_head(None)
        owned_head = ',"ev":{"t":"create","owner":'
        decoder = json.JSONDecoder()

        def read(text: str) -> tuple[Event, float]:
            # A create record as submit() writes it is read in place: its spec straight into
            # columns (json.loads of a 1M-shard job's 73 MB record made ~600 MB of dicts).
            if text.startswith('{"now":'):
                now, i = decoder.raw_decode(text, 7)
                owner: str | None = None
                start = i + len(head) if text.startswith(head, i) else -1
                if start < 0 and text.startswith(owned_head, i):
                    with contextlib.suppress(ValueError):
                        owner, j = decoder.raw_decode(text, i + len(owned_head))
                        if isinstance(owner, str) and text.startswith(',"spec":', j):
                            start = j + len(',"spec":')
                if start >= 0:
                    with contextlib.suppress(ValueError):
                        spec, end = read_log_spec(text, start)
                        if text.endswith("}}") and end == len(text) - 2:
                            return CreateJob(spec, owner), float(now)
            raw = json.loads(text)
            return event_from_json(raw["ev"]), raw["now"]

        def replay() -> tuple[MasterState, int, int, int]:
            snap, snap_seq, records = loaded.pop()
            state = MasterState.from_text(snap) if snap is not None else MasterState()
            del snap
            seq, replayed = snap_seq, 0
            for seq, text in records:
                event, now = read(text)
                if not state.apply(event, now).mutated:
                    raise StateError(f"the state log does not replay at record {seq}: refusing to serve inconsistent state")
                replayed += 1
            state.warm()  # cache-aware jobs' windows placed here, not in the first leases' handlers
            return state, seq, snap_seq, replayed

        # On a thread: a large state takes seconds to read, and an etcd leader's election keeps
        # its lease alive on the event loop meanwhile. Nothing else touches this state yet.
        state, seq, snap_seq, replayed = await asyncio.to_thread(replay)
        self.state = state
        self._seq = seq
        self._snap_seq = snap_seq
        self._journal = Journal(
            store,
            max_batch=self.settings.max_batch,
            snapshot_due=self._snapshot_due,
            on_failure=self._on_store_failure,
            observe=self.metrics.observe_commit,
        )
        self._journal.start()
        self.role = "leader"
        self.metrics.leader.set(1)
        log.info("serving %d job(s) from %s (replayed %d events after snapshot %d)", len(state.jobs), store, replayed, snap_seq)
        await self.submit(Resume(), OPERATOR)

    def _snapshot_due(self) -> tuple[int, str] | None:
        state = self.state
        if state is None:
            return None
        shards = sum(job.n for job in state.jobs.values())
        if self._seq - self._snap_seq < max(self.settings.snapshot_min_events, 2 * shards):
            return None
        self._snap_seq = self._seq
        return self._seq, state.snapshot_text()

    def _drop_state(self, role: str, reason: BaseException) -> None:
        self.role = role
        self.state = None
        self.nodes.lost_state()
        self._trainer_nodes_cache.clear()
        self.metrics.leader.set(0)
        if self._journal is not None:
            self._journal.abort(reason if isinstance(reason, MasterError) else StateError(str(reason)))
            self._journal = None

    async def _on_store_failure(self, exc: BaseException) -> None:
        self.metrics.store_failures.inc()
        if self._election is not None:
            self._election.resign()
            return
        self._drop_state("recovering", StateError(f"state store failed: {exc}"))
        self._spawn(self._recover(), "master-recover")

    async def _recover(self) -> None:
        delays = _RECOVER_BACKOFF.delays()
        while self.role == "recovering":
            try:
                assert self._store is not None
                await self._take_over(self._store)
                log.info("state reloaded after a store failure")
                return
            except MasterError as exc:
                log.error("cannot reload the state yet: %s", exc)
                self.role = "recovering"
                await asyncio.sleep(next(delays))

    async def _on_elected(self, revision: int) -> None:
        # Load in a task: the election must keep its lease alive meanwhile.
        self.role = "loading"
        self._term = self._spawn(self._load_term(), "master-takeover")

    async def _load_term(self) -> None:
        try:
            assert self._store is not None
            await self._take_over(self._store)
            log.info("leading with advertise URL %s", self.identity["url"])
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.error("cannot take over the state: %s; giving up leadership", exc)
            self._election.resign()

    async def _on_deposed(self) -> None:
        if self._term is not None and not self._term.done():
            self._term.cancel()
        self._term = None
        self._drop_state("standby", NotLeader("this master lost leadership; retry against the new leader", leader=None))

    # -- API --

    def leader_url(self) -> str | None:
        if self.role == "leader":
            return self.identity["url"]
        if self._election is not None and self._election.leader:
            url = self._election.leader.get("url")
            return url if isinstance(url, str) and url != self.identity["url"] else None
        return None

    def require_state(self) -> MasterState:
        if self.role == "leader" and self.state is not None:
            return self.state
        if self._election is not None:
            raise NotLeader("this master is a standby: send requests to the leader", leader=self.leader_url())
        raise StateError(f"the master is {self.role}; retry shortly")

    def authorize(self, job: str, caller: Caller) -> None:
        """:class:`Forbidden` unless ``caller`` may see and act on ``job`` (a job that does not
        exist is the state's NoSuchJob to say). The owner is not named: it is no one else's business."""
        state = self.require_state()
        found = state.jobs.get(job)
        if found is not None and not caller.may(found.owner):
            raise Forbidden(
                f"job {job!r} belongs to another tenant: only its owner and the operator may see or change it. Job "
                "names are shared by every tenant of this master: name yours differently (a prefix of your namespace)",
                job=job,
            )

    async def submit(self, event: Event, caller: Caller) -> Result:
        """Apply ``event`` for ``caller`` and make it durable. The ownership check and the apply
        happen with nothing awaited between them, so a job deleted and created again by another
        tenant while a request was read is judged as it is now."""
        state = self.require_state()
        job = _event_job(event)
        if job and not isinstance(event, CreateJob):
            self.authorize(job, caller)
        result = state.apply(event, self.clock())
        if result.mutated:
            assert self._journal is not None and result.record is not None
            self._seq += 1
            record = '{"now":' + repr(float(result.now)) + ',"ev":' + event_to_text(result.record) + "}"
            # If this handler is cancelled the write still happens (the journal owns the batch);
            # only this wait ends.
            await self._journal.append((self._seq, record))
            changed = self._changes.pop(_event_job(event), None)
            if changed is not None:
                changed.set()
        return result

    async def wait_for_change(self, job: str, timeout_s: float) -> None:
        """Wait until an event changes ``job`` (a lease completed, failed, granted...) or
        ``timeout_s`` passes."""
        changed = self._changes.setdefault(job, asyncio.Event())
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(changed.wait(), timeout_s)

    def forget(self, job: str) -> None:
        """Drop what the service keeps of a deleted job in memory (presence, rate, waits, what
        nodes hold of it and their plans' layouts)."""
        self._presence.pop(job, None)
        self._rates.pop(job, None)
        self._waits.pop(job, None)
        self._trainer_nodes_cache.pop(job, None)
        self.nodes.forget_job(job)
        self.planner.forget(job)

    # -- node daemons' reports (holdings.py) --

    async def node_report(self, node: str, report: NodeReport) -> NodePlan:
        """Take a node daemon's report (checked: ``wire.nodeplan.parse_report``) and answer its
        plan. The holdings it changes are journaled (a ``Holdings`` event) before the answer; the
        rest is memory. A delta the master cannot apply is answered ``resend: "full"``, nothing
        taken of it but its counters. One report of a node at a time."""
        lock = self._report_locks.get(node)
        if lock is None:
            lock = self._report_locks[node] = asyncio.Lock()
        async with lock:
            state = self.require_state()
            now = self.clock()
            book = self.nodes
            rec = book.take(node, report, now)
            if len(self._report_locks) > 2 * len(book.records) + 64:  # nodes forgotten (RECORD_KEEP_S)
                for name in [n for n, held in self._report_locks.items() if not held.locked() and n not in book.records]:
                    del self._report_locks[name]
            windowed = [(name, job.spec, job.created_at, job.locality) for name, job in state.jobs.items()
                        if job.locality is not None and job.locality.names is not None]
            key = frozenset((name, created) for name, _, created, _ in windowed)
            interval = plan_interval(book.reporting(now))
            if book.needs_full(rec, report, key):
                self.metrics.node_reports.labels("resend").inc()
                return NodePlan(report.seq, resend="full", interval_s=interval)
            heavy = len(report.held) + len(report.dropped) > _INLINE_HASHES or any(
                loc.index is None and len(spec.shards) > _INLINE_INDEX_SHARDS for _, spec, _, loc in windowed
            )
            resolution = await asyncio.to_thread(resolve_report, windowed, report) if heavy else resolve_report(windowed, report)
            if report.full or resolution.held or resolution.dropped:
                event = Holdings(node, report.full, tuple(resolution.held), tuple(resolution.dropped), resolution.hint())
                await self.submit(event, OPERATOR)
            state = self.require_state()
            book.applied(rec, report, resolution, key, now)
            self.metrics.node_reports.labels("applied").inc()
            trainers = {name: self._trainer_nodes(name, state.jobs[name], now) for name, *_ in windowed if name in state.jobs}
            waited = {name: w.waited(trainers[name].get(node, ())) for name, w in self._waits.items() if name in trainers}
            return self.planner.plan(state, rec, report.seq, trainers, plan_interval(book.reporting(now), rec.turnover_s()),
                                     waited)

    def _trainer_nodes(self, name: str, job: JobState, now: float) -> dict[str, set[str]]:
        """node -> the job's trainers on it: holding a live lease leased from it, or seen within
        TRAINER_RECENT_S after leasing from it (presence). Cached for a second."""
        cached = self._trainer_nodes_cache.get(name)
        if cached is not None and cached[0] is job and 0.0 <= now - cached[1] < 1.0:
            return cached[2]
        out: dict[str, set[str]] = {}
        for trainer, (node, seen) in self._presence.get(name, {}).items():
            if node and now - seen <= TRAINER_RECENT_S:
                out.setdefault(node, set()).add(trainer)
        if len(job.leases) <= _LEASES_SCANNED:
            for rec in job.leases.values():
                if rec.node and rec.expires_at > now:
                    out.setdefault(rec.node, set()).add(rec.trainer)
        self._trainer_nodes_cache[name] = (job, now, out)
        return out

    def note(self, job: str, trainer: str | None, node: str | None, progress: int = 0) -> None:
        """Trainer presence and throughput for the status (in memory only)."""
        if trainer is not None:
            if node is not None and node:
                self._trainer_nodes_cache.pop(job, None)  # a lease: where the job's trainers are may have changed
            seen = self._presence.setdefault(job, {})
            old = seen.get(trainer)
            seen[trainer] = (node if node is not None else (old[0] if old else ""), self.clock())
        if progress:
            self._rates.setdefault(job, _Rate()).add(progress)

    def wait_epoch(self, job: str, trainer: str, lease: str | None = None) -> int:
        """The epoch a wait report is counted in: the reporting lease's (read before the call
        closes it), else the epoch of the trainer's latest report, else the job's current one."""
        state = self.require_state()
        found = state.jobs.get(job)
        rec = found.leases.get(lease) if found is not None and lease is not None else None
        if rec is not None:
            return int(rec.epoch)
        waits = self._waits.get(job)
        last = waits.current_epoch(trainer) if waits is not None else None
        if last is not None:
            return last
        return int(found.epoch) if found is not None else 0

    def report_wait(self, job: str, trainer: str, epoch: int, report: WaitReport) -> None:
        """Count a trainer's wait report (not journaled: a restarted master starts from zero)."""
        self._waits.setdefault(job, JobWaits()).add(trainer, epoch, report, self.clock())

    def _wait_figures(self) -> list[tuple[str, WaitTotals, float | None]]:
        """(job, its wait totals, its wait fraction of the last 60 s) for the metrics."""
        state = self.state
        if state is None or self.role != "leader":
            return []
        now = self.clock()
        return [(job, w.totals, w.job(now)["fraction_60s"]) for job, w in sorted(self._waits.items()) if job in state.jobs]

    # One large shard list built at a time (see spec_stream.read_spec); made on first use, in
    # the service's event loop.
    _create_gate: asyncio.Semaphore | None = None

    async def create_job(
        self, body: dict[str, Any] | AsyncIterable[bytes], caller: Caller, *, length: int | None = None
    ) -> tuple[dict[str, Any], bool]:
        """Create a job or join the identical one: (its status, created). ``body`` is the decoded
        spec, or a create body's chunks, parsed as they arrive (``length``: the body's size when
        known, decompressed; small bodies are parsed on the loop, unknown or large ones on a
        thread, their shard lists built one at a time)."""
        settings = self.settings
        if isinstance(body, dict):
            def validate() -> JobSpec:
                spec = JobSpec.from_json(
                    body,
                    default_ttl_s=settings.lease_ttl_s,
                    default_max_failures=settings.max_failures,
                    max_shards=settings.max_shards,
                )
                spec.encode()  # its JSON text, made here, not on the event loop
                return spec

            shards = body.get("shards")
            spec = await asyncio.to_thread(validate) if isinstance(shards, list) and len(shards) > 2000 else validate()
        else:
            if self._create_gate is None:
                self._create_gate = asyncio.Semaphore(1)
            parser = SpecStream(
                default_ttl_s=settings.lease_ttl_s,
                default_max_failures=settings.max_failures,
                max_shards=settings.max_shards,
                existing=self._job_shards,
            )
            small = length is not None and length <= _INLINE_BODY_BYTES
            spec = await read_spec(
                body, parser, self._create_gate, inline=small, gated=length is None or length > _GATED_BODY_BYTES
            )
        # Checked here, not in the state machine: a replay must accept what was accepted, whatever
        # --max-jobs is now. Nothing awaits between this check and the event's apply in submit().
        state = self.require_state()
        self.authorize(spec.name, caller)  # joining another tenant's job is acting on it
        if spec.name not in state.jobs and len(state.jobs) >= settings.max_jobs:
            raise TooManyJobs(
                f"this master holds {len(state.jobs)} jobs, its limit (--max-jobs {settings.max_jobs}); finished jobs "
                "count too until they are deleted: delete the jobs you are done with (DELETE /v1/jobs/{name}, "
                "MasterClient.delete_job), start the master with a higher --max-jobs, or give new jobs another master "
                "(its own --state)",
                jobs=len(state.jobs), max_jobs=settings.max_jobs,
            )
        result = await self.submit(CreateJob(spec, caller.owner), caller)
        return self.status(spec.name, caller), result.created

    def _job_shards(self, name: str) -> ShardTable | None:
        """The shard list of the job named ``name``, if it exists (read by a parse thread: a
        join then compares instead of building)."""
        state = self.state
        job = state.jobs.get(name) if state is not None else None
        return job.spec.table if job is not None else None

    def new_lease_ids(self, count: int) -> tuple[str, ...]:
        # 96 random bits each, URL-safe: unguessable, and meaning nothing (the state maps it).
        count = max(0, min(count, 1024))
        raw = base64.urlsafe_b64encode(secrets.token_bytes(12 * count)).decode()
        return tuple(raw[16 * i : 16 * i + 16] for i in range(count))

    def status(self, name: str, caller: Caller) -> dict[str, Any]:
        self.authorize(name, caller)
        state = self.require_state()
        now = self.clock()
        out = state.status(name, now)
        by_trainer: dict[str, dict[str, int]] = out.pop("leases_by_trainer")
        seen = self._presence.get(name, {})
        waits = self._waits.get(name) or JobWaits()
        for trainer, (_, last) in list(seen.items()):
            if now - last > _PRESENCE_KEEP_S and trainer not in by_trainer:
                del seen[trainer]
                waits.forget(trainer)
        trainers = []
        for trainer in sorted(set(seen) | set(by_trainer)):
            node, last_seen = seen[trainer] if trainer in seen else ("", None)
            streams = by_trainer.get(trainer, {})
            trainers.append(
                {
                    "trainer": trainer,
                    "node": node,
                    "last_seen_s_ago": None if last_seen is None else round(max(now - last_seen, 0.0), 3),
                    "leases": sum(streams.values()),
                    # The trainer's DataLoader workers, each its own lease stream ("" = the trainer itself).
                    "streams": [{"stream": s, "leases": n} for s, n in sorted(streams.items())],
                    # How long its training loop waited for data (null: it never reported).
                    "wait": waits.trainer(trainer, now),
                }
            )
        out["trainers"] = trainers
        rate = self._rates.get(name)
        out["samples_per_s"] = rate.per_s() if rate else 0.0
        out["wait"] = waits.job(now)
        job = state.jobs[name]
        windowed = job.locality is not None and job.locality.names is not None

        def wait_of(trainer: str) -> float | None:
            report = waits.trainer(trainer, now)
            return report["fraction_60s"] if report is not None else None

        out["cache"] = self.nodes.view(name, now, windowed, self._trainer_nodes(name, job, now), wait_of)
        if out.get("locality") is not None:
            out["locality"]["ring"]["source"] = self.placement.status() if self.placement is not None else None
        return out

    def cluster(self) -> dict[str, Any]:
        state = self.require_state()
        ring = state.ring
        return {
            "version": ring.version,
            "members": [{"id": m, "node": n or None} for m, n in sorted(ring.node_of.items())],
            "nodes": ring.nodes,
            "source": self.placement.status() if self.placement is not None else None,
        }

    def jobs(self, caller: Caller) -> list[dict[str, Any]]:
        """The status of every job ``caller`` may see."""
        state = self.require_state()
        return [self.status(name, caller) for name, job in sorted(state.jobs.items()) if caller.may(job.owner)]

    def metrics_text(self, caller: Caller) -> bytes:
        """``/metrics`` for ``caller``: the master's own series, and those of the jobs it may see
        (none for an anonymous scrape)."""
        try:
            statuses = self.jobs(caller)
        except MasterError:  # a standby, or loading: no jobs to show
            statuses = []
        shown = {status["name"] for status in statuses}
        return self.metrics.render(statuses, [w for w in self._wait_figures() if w[0] in shown])


def _event_job(event: Event) -> str:
    return event.spec.name if isinstance(event, CreateJob) else getattr(event, "job", "")
