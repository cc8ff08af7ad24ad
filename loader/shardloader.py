"""``ShardLoader``: WebDataset samples from a dataset prefix, statically sharded or leased from a
master, read through the node cache when there is one.

Static mode (no master)::

    for sample in ShardLoader("s3://bucket/train/", rank=0, world_size=8, seed=1, epoch=0): ...

Dynamic mode (elastic; every shard read once per epoch across all trainers)::

    for sample in ShardLoader("s3://bucket/train/", job="resnet50", master="http://master:8700"): ...

Iterating yields one epoch; iterating again yields the next. ``continuous=True`` yields across
epochs without end (static) or until the job's last epoch (dynamic), for synchronous DDP where
every rank runs a fixed number of steps: ``itertools.islice(loader, steps * batch)``.

The loader times how long the loop iterating it waits for each sample (:mod:`loader.stall`):
``loader.wait_stats()`` gives the totals, and in dynamic mode they go to the master with the
trainer's renews, releases and completions (the job status shows them per trainer). A loop that
reads the loader ahead on a thread of its own has its own steps timed instead:
``for batch in loader.timed(batches): ...``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import mmap
import os
import socket
import uuid
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Literal, TypeVar

from loader.ahead import OpenAhead, Opener
from loader.checkpoint import Clock, DynamicState
from loader.dataset import DatasetURL, Shard, parse_dataset_url
from loader.errors import ConfigError, CorruptShard, LoaderError
from loader.heap import keep_freed_heap
from loader.master.protocol import shards_sha256
from loader.members import load_members, sample_bytes_ok
from loader.settings import LoaderSettings, check_locality_window
from loader.sources import Reader, Source, make_source, resolve_shards
from loader.stall import WaitMeter, WaitReporter
from loader.static import rank_shards, worker_shards
from loader.tar import UNMAP_EVERY_BYTES, MemberLog, iter_samples, map_source, release_pages
from loader.tarindex import INDEXES, TarIndex, file_identity, iter_indexed

__all__ = ["ShardLoader"]

log = logging.getLogger("loader")

OnError = Literal["raise", "skip"]

T = TypeVar("T")

# The version of state_dict(). 2: the static epoch order became wire.shuffle's (version 1's was
# random.shuffle's), so a version 1 position points into an order this loader no longer produces.
_STATE_VERSION = 2


@dataclasses.dataclass
class _Position:
    """Static mode: the next sample to hand out is sample ``offset`` of the ``shard``-th shard of
    this rank's (and worker's) plan for ``epoch``."""

    epoch: int
    shard: int = 0
    offset: int = 0


class _Runtime:
    """Per-process resources (sockets, boto3 clients, ids): never pickled, rebuilt after a fork."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.source: Source | None = None
        self.client: Any = None
        self.trainer: str | None = None
        # Prefetch hints held back until the shard being read has opened (see _hint).
        self.pending_hints: list[Shard] = []
        # Static mode: the next shard of the plan, opened while this one is read (loader.ahead).
        self.opener = Opener()
        self.ahead: OpenAhead | None = None
        # Dynamic mode, a bare loop: the renewer of the iteration in progress (state_dict's positions).
        self.renewer: Any = None
        # The loop's wait for data in this process (kept across close(): see ShardLoader.close).
        self.meter: WaitMeter | None = None
        # Whether this process has opened a shard yet: its first is read as the cache fills it.
        self.opened_first = False


class ShardLoader:
    """An iterable of WebDataset samples (``{"__key__": ..., "__url__": ..., "jpg": b"...", ...}``).

    Arguments:
        url: dataset prefix, ``s3://bucket/prefix/`` or ``file:///root/bucket/prefix/``.
        job, master: dynamic mode. The job is created on the master if it does not exist (the
            same arguments join the same job). ``master`` defaults to ``SHARDCACHE_MASTER``.
        rank, world_size, seed, epoch, shuffle: static mode (defaults: rank 0 of 1, epoch 0).
            ``seed`` and ``shuffle`` also go into a dynamic job's spec.
        continuous: iterate across epochs without stopping at epoch ends.
        epochs, lease_ttl_s, max_failures: the job spec in dynamic mode (``epochs=None``:
            unbounded).
        locality_window: dynamic mode: cache-aware leases. The master hands this trainer, from
            the next ``locality_window`` shards of the epoch's seeded order, the first one owned
            by or cached on its node (``SHARDCACHE_NODE``), so most reads stay on the node; 0 is
            the plain seeded shuffle. Part of the job spec, like ``seed``. Default: the settings'
            (env ``SHARDCACHE_LOCALITY_WINDOW``, else 0).
        trainer: this trainer's id for the master (default: host-pid-random).
        endpoint: cache daemon/sidecar URL; default ``SHARDCACHE_ENDPOINT``; ``""`` reads the
            origin directly even when the variable is set.
        on_error: ``"raise"`` (default) raises a shard's read error (after reporting it to the
            master with ``fail``); ``"skip"`` logs it and goes on with the next shard.
        settings: a :class:`~loader.settings.LoaderSettings` (default: from the environment).
    """

    def __init__(
        self,
        url: str,
        *,
        job: str | None = None,
        master: str | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        seed: int = 0,
        epoch: int | None = None,
        shuffle: bool = True,
        continuous: bool = False,
        epochs: int | None = None,
        lease_ttl_s: float = 30.0,
        max_failures: int = 3,
        locality_window: int | None = None,
        trainer: str | None = None,
        endpoint: str | None = None,
        on_error: OnError = "raise",
        settings: LoaderSettings | None = None,
    ) -> None:
        base = settings if settings is not None else LoaderSettings.from_env()
        changes: dict[str, Any] = {}
        if endpoint is not None:
            changes["endpoint"] = endpoint
        if master is not None:
            changes["master"] = master
        self.settings = dataclasses.replace(base, **changes) if changes else base
        self.location: DatasetURL = parse_dataset_url(url)
        if on_error not in ("raise", "skip"):
            raise ConfigError(f"on_error must be 'raise' or 'skip', not {on_error!r}")
        self.on_error: OnError = on_error
        self.seed = int(seed)
        self.shuffle = bool(shuffle)
        self.continuous = bool(continuous)
        if master is not None and job is None:
            raise ConfigError("master= needs job= (the job's name, shared by every trainer of the job)")
        self.job = job
        if job is not None:
            if not isinstance(job, str) or not job.strip():
                raise ConfigError("job must be a non-empty name")
            if rank is not None or world_size is not None:
                raise ConfigError("rank/world_size are for static mode; with job= the master hands out shards")
            if not self.settings.master:
                raise ConfigError(
                    f"job={job!r} needs a master: pass master='http://host:8700' or set SHARDCACHE_MASTER"
                )
            if epochs is not None and epochs < 1:
                raise ConfigError("epochs must be >= 1 (or None for unbounded)")
            if lease_ttl_s <= 0 or max_failures < 1:
                raise ConfigError("lease_ttl_s must be > 0 and max_failures >= 1")
        else:
            world_size = 1 if world_size is None else int(world_size)
            rank = 0 if rank is None else int(rank)
            if world_size < 1 or not 0 <= rank < world_size:
                raise ConfigError(
                    f"rank must be in [0, world_size) and world_size >= 1, got rank={rank}, world_size={world_size}"
                )
        if locality_window is None:
            locality_window = self.settings.locality_window
        check_locality_window(locality_window)
        self.mode: Literal["static", "dynamic"] = "dynamic" if job is not None else "static"
        self.rank = rank
        self.world_size = world_size
        self.epochs = epochs
        self.lease_ttl_s = float(lease_ttl_s)
        self.max_failures = int(max_failures)
        self.locality_window = int(locality_window)
        # Fixed here, in the process that builds the loader, so that DataLoader workers (forked or
        # pickled copies) share it: siblings are "<base>-w<i>" and can recognise each other.
        self._trainer_base = trainer or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self._creator_pid = os.getpid()
        self._worker = (0, 1)
        # A DataLoader worker's lease stream under this trainer ("w0", "w1", ...); None: the trainer itself.
        self._stream: str | None = None
        # Set by loader.torch's DataLoader: this process reads, the iterating one reports and completes.
        self._ledger: Any = None
        # Whether iterating this loader is what the training loop does (times its waits). False
        # under a ShardDataset: there the drop-in DataLoader times the loop's batches instead.
        self._metered = True
        # Whether the loader's own iteration is what is timed. False after :meth:`timed`: the loop
        # times its own steps (it reads ahead of them on another thread).
        self._self_timed = True
        self._shards: list[Shard] | None = None
        # static progress
        self._pos = _Position(0 if epoch is None else int(epoch))
        self._in_progress = False
        self._resume: _Position | None = None
        # Static mode under loader.torch.DataLoader: where each of its num_workers workers resumes.
        self._worker_resume: tuple[int, dict[int, _Position]] | None = None
        self._generation = 0
        # dynamic progress
        self._next_epoch: int | None = epoch
        self._current_epoch: int | None = None
        self._finished = False
        self._joined = False
        self._by_key: dict[str, Shard] = {}
        # What this trainer's loop received (checkpoint marks, loader/checkpoint.py); explicit
        # epochs restart it each epoch.
        self._clock = Clock(laps=not self.continuous)
        self._digest: str | None = None
        self._last_state: dict[str, Any] | None = None
        self._rt = _Runtime()

    # -- pickling (DataLoader workers) and per-process resources ------------------------------

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_rt"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._rt = _Runtime()

    def _runtime(self) -> _Runtime:
        if self._rt.pid != os.getpid():  # forked: sockets and threads of the parent are not ours
            self._rt = _Runtime()
        return self._rt

    def _source(self) -> Source:
        rt = self._runtime()
        if rt.source is None:
            # A DataLoader's batch of samples is freed together: kept for the next (loader.heap).
            keep_freed_heap(self.settings.heap_trim_threshold_bytes)
            rt.source = make_source(self.location, self.settings, job=self.job)
        return rt.source

    def _client(self) -> Any:
        rt = self._runtime()
        if rt.client is None:
            from loader.master.client import MasterClient

            rt.client = MasterClient(self.settings.master or "", retry_deadline_s=self.settings.master_deadline_s)
        return rt.client

    @property
    def trainer(self) -> str:
        """This trainer's id for the master: the process that iterates, shared by its DataLoader
        workers (each a lease ``stream`` under it)."""
        rt = self._runtime()
        if rt.trainer is None:
            base = self._trainer_base
            if self._stream is not None:
                rt.trainer = base
            elif os.getpid() != self._creator_pid:
                rt.trainer = f"{base}-p{os.getpid()}"  # a copy iterated in another process: its own trainer
            else:
                rt.trainer = base
        return rt.trainer

    def rebase_trainer(self) -> None:
        """Make this process the trainer (a copy iterated by a DataLoader in another process than
        the one that built the loader): its own id, which its DataLoader workers share."""
        pid = os.getpid()
        if pid != self._creator_pid:
            self._trainer_base = f"{self._trainer_base}-p{pid}"
            self._creator_pid = pid
            self._runtime().trainer = None

    def _siblings_hold_leases(self) -> bool:
        """Whether another DataLoader worker of this trainer still holds a lease of the job."""
        if self._worker[1] <= 1:
            return False
        try:
            trainers = self._client().status(self.job).get("trainers") or []
        except Exception:
            log.debug("job status for the sibling check failed", exc_info=True)
            return False
        for t in trainers:
            if isinstance(t, dict) and t.get("trainer") == self.trainer:
                return any(
                    isinstance(s, dict) and s.get("stream") != self._stream and int(s.get("leases") or 0) > 0
                    for s in t.get("streams") or []
                )
        return False

    def close(self) -> None:
        """Release sockets and clients (the loader can still be iterated afterwards)."""
        rt = self._runtime()
        self._drop_ahead()
        rt.opener.close()
        if rt.source is not None:
            rt.source.close()
        if rt.client is not None:
            rt.client.close()
        meter = rt.meter
        self._rt = _Runtime()
        self._rt.meter = meter  # wait_stats() survives close()

    def __enter__(self) -> ShardLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- public state ---------------------------------------------------------------------

    @property
    def url(self) -> str:
        return self.location.url

    @property
    def shards(self) -> list[Shard]:
        """The dataset's shards (manifest or listing), resolved on first use."""
        if self._shards is None:
            self._shards = resolve_shards(self._source())
        return self._shards

    @property
    def epoch(self) -> int | None:
        """Static: the epoch being (or next to be) iterated. Dynamic: the epoch of the shard being
        read (None before the first lease)."""
        if self.mode == "static":
            return self._pos.epoch
        return self._current_epoch if self._current_epoch is not None else self._next_epoch

    def wait_meter(self) -> WaitMeter:
        """This process's :class:`~loader.stall.WaitMeter` of the loop iterating this loader (or
        the drop-in DataLoader over it)."""
        rt = self._runtime()
        if rt.meter is None:
            rt.meter = WaitMeter()
        return rt.meter

    def wait_stats(self) -> dict[str, Any]:
        """How long the training loop of this process waited for data, since its first step:
        ``seconds``, ``steps`` (samples, or batches with ``loader.torch.DataLoader``),
        ``elapsed_s``, ``fraction`` (of ``elapsed_s`` spent waiting), ``buckets`` (counts of single
        waits up to each of ``bucket_bounds_s``), ``p50_s``/``p99_s``. All zero in a DataLoader
        worker and under a plain ``torch.utils.data.DataLoader``, which cannot see the loop."""
        return self.wait_meter().stats()

    @property
    def finished(self) -> bool:
        """Dynamic mode: the master reported that the job ran all its epochs."""
        return self._finished

    def set_epoch(self, epoch: int) -> None:
        """Start the next iteration at ``epoch`` (like ``DistributedSampler.set_epoch``). A state
        loaded for that very epoch is kept (a loop that calls ``set_epoch(epoch)`` for the epoch
        it resumes in continues where the state says); any other epoch starts afresh."""
        if self.mode == "static":
            epoch = int(epoch)
            resume = self._resume if self._resume is not None and self._resume.epoch == epoch else None
            workers = self._worker_resume
            if workers is not None and any(p.epoch != epoch for p in workers[1].values()):
                workers = None
            self._pos = _Position(epoch)
            self._in_progress = False
            self._resume = resume
            self._worker_resume = workers
        else:
            self._next_epoch = int(epoch)

    def for_worker(self, worker: int, num_workers: int) -> ShardLoader:
        """A copy for DataLoader worker ``worker`` of ``num_workers``: static mode splits this
        rank's shards between workers, dynamic mode gives each worker its own lease stream."""
        if num_workers < 1 or not 0 <= worker < num_workers:
            raise ConfigError(f"worker {worker} of {num_workers} is out of range")
        clone = ShardLoader.__new__(ShardLoader)
        clone.__setstate__(self.__getstate__())
        clone._pos = dataclasses.replace(self._pos)
        # Its own copy: iterating the clone moves its position, never this loader's.
        clone._resume = dataclasses.replace(self._resume) if self._resume is not None else None
        clone._worker_resume = None
        if self._worker_resume is not None and self._worker_resume[0] == num_workers and worker in self._worker_resume[1]:
            clone._resume = dataclasses.replace(self._worker_resume[1][worker])
        elif self.mode == "static" and num_workers > 1 and clone._resume is not None and (
            clone._resume.shard or clone._resume.offset
        ):
            pos = clone._resume
            raise ConfigError(
                f"this loader resumes at sample {pos.offset} of shard {pos.shard} of its plan for epoch {pos.epoch} (a "
                "ShardLoader state, from a loop that read without DataLoader workers); DataLoader workers split that "
                f"plan between them, so the position means nothing to worker {worker} of {num_workers}. Resume it with "
                "num_workers=0, or checkpoint with loader.torch.DataLoader.state_dict(), which saves each worker's"
            )
        clone._worker = (worker, num_workers)
        clone._stream = f"w{worker}"
        return clone

    def state_dict(self) -> dict[str, Any]:
        """A checkpoint of this loader, a small picklable dict.

        Static mode: where to resume (epoch, shard, sample). Dynamic mode: a mark on the master,
        the job as every trainer's loop had received it now (this trainer's exact positions are
        sent with it); loading it, on any trainer of any world size, makes the master hand out
        exactly what had not been received (``load_state_dict``). Call it where the model is
        checkpointed, every rank at the same step (``torch.distributed.checkpoint``), or on one
        rank only (then the others' samples since their last renew are trained again)."""
        if self.mode != "static":
            renewer = self._runtime().renewer
            if renewer is None:
                return self.checkpoint([], between_epochs=True)
            return self.checkpoint(renewer.positions())
        pos = self._resume or self._pos
        return {
            "version": _STATE_VERSION,
            "url": self.url,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "rank": self.rank,
            "world_size": self.world_size,
            "worker": list(self._worker),
            "num_shards": len(self.shards),
            "epoch": pos.epoch,
            "shard": pos.shard,
            "offset": pos.offset,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict`, before iterating: static mode continues at the saved
        sample; dynamic mode rewinds the job to the saved mark (idempotent: loading it on every
        rank, or twice, is one rewind while nobody read in between), so that the master hands
        out, from then on, exactly what the loops had not received at that checkpoint. Leases
        held then are revoked (their trainers drop those shards and lease again). A state of
        another job, dataset, seed or shard list is refused, saying what differs."""
        if self.mode != "static":
            self._rewind(state)
            return
        if isinstance(state, dict) and state.get("version") == 1:
            raise ConfigError(
                f"this checkpoint is a version 1 ShardLoader state (epoch {state.get('epoch')!r}), from a "
                "shardcache release whose static mode shuffled epochs in a different order; resuming its "
                "position on the current order would duplicate some samples and skip others. Restart that "
                "epoch from its beginning (pass epoch= and do not load this state), or resume with the "
                "shardcache version that wrote it"
            )
        if not isinstance(state, dict) or state.get("version") != _STATE_VERSION:
            raise ConfigError(f"not a ShardLoader state (expected version {_STATE_VERSION} from state_dict())")
        expected = {
            "url": self.url, "seed": self.seed, "shuffle": self.shuffle, "rank": self.rank,
            "world_size": self.world_size, "worker": list(self._worker), "num_shards": len(self.shards),
        }
        for name, value in expected.items():
            if state.get(name) != value:
                raise ConfigError(
                    f"checkpoint was taken with {name}={state.get(name)!r} but this loader has {name}={value!r}; "
                    "resume with the same dataset and arguments"
                )
        try:
            pos = _Position(int(state["epoch"]), int(state["shard"]), int(state["offset"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError("malformed ShardLoader state: epoch, shard and offset must be integers") from exc
        if pos.epoch < 0 or pos.shard < 0 or pos.offset < 0:
            raise ConfigError("malformed ShardLoader state: negative position")
        self._resume = pos

    # -- dynamic-mode checkpoints (loader/checkpoint.py) -----------------------------------

    def _identity(self, mark: int = 0, clock: int = 0, created: float = 0.0) -> DynamicState:
        if self._digest is None:
            self._digest = shards_sha256([s.spec() for s in self.shards])
        assert self.job is not None
        return DynamicState(
            job=self.job, dataset=self.url, seed=self.seed, shuffle=self.shuffle, shards=len(self.shards),
            shards_sha256=self._digest, mark=mark, clock=clock, job_created=created,
        )

    def checkpoint(self, positions: list[tuple[str, int]], between_epochs: bool = False) -> dict[str, Any]:
        """Dynamic mode's ``state_dict()``: report ``positions`` (each lease this trainer's loop
        received samples of, at the sample reached) at this trainer's clock, and name the mark.
        ``between_epochs``: no iteration is in progress; with explicit epochs the clock moves to
        the job's current epoch, so every rank checkpointing after an epoch (a barrier after
        it) has the same clock, whatever each received in it."""
        if between_epochs and not self.continuous and self._clock.value:
            if not self._joined:
                self._join()
            assert self.job is not None
            self._clock.start_lap(int(self._client().status(self.job).get("epoch") or 0))
        clock = self._clock.value
        last = self._last_state
        if not positions and last is not None and last["clock"] == clock:
            return dict(last)  # nothing received since the state saved or loaded last: the same mark
        if not positions and clock == 0:
            # Nothing received yet (a fresh loader, or torch.distributed.checkpoint asking for the
            # state's shape before loading into it): mark 0, the job's beginning; no master call.
            return self._identity().to_dict()
        if not self._joined:
            self._join()
        assert self.job is not None
        answer = self._client().mark(self.job, self.trainer, clock, positions)
        if answer.lost:
            log.warning("checkpoint at clock %d: %d lease(s) had expired and were re-issued; their samples since the "
                        "last renew will be read again", clock, len(answer.lost))
        log.info("checkpoint of job %s: mark %d at clock %d (%d trainer(s) reported)", self.job, answer.mark, clock,
                 answer.trainers)
        state = self._identity(answer.mark, clock, answer.job_created).to_dict()
        self._last_state = state
        return dict(state)

    def _rewind(self, raw: Any) -> None:
        from loader.master.errors import NoSuchJob

        state = DynamicState.from_dict(raw)
        state.check(self._identity(state.mark, state.clock, state.job_created))
        assert self.job is not None
        try:
            answer = self._client().rewind(self.job, self.trainer, state.mark, state.clock, state.job_created or None)
        except NoSuchJob as exc:
            raise ConfigError(
                f"job {self.job!r} is not on the master any more (deleted, or the master's state was lost): its "
                f"checkpoint mark {state.mark} is gone with it; start fresh without loading this state"
            ) from exc
        self._clock.restore(state.clock)
        self._last_state = state.to_dict()
        self._finished = answer.finished
        self._next_epoch = answer.epoch if not self.continuous else None
        self._current_epoch = None
        self._generation += 1  # an iteration in progress (same process) stops: its leases were revoked
        log.info("job %s resumed from checkpoint mark %d (clock %d): %d shard(s) to read again, %d lease(s) revoked, "
                 "epoch %d", self.job, answer.mark, answer.clock, answer.undone, answer.revoked, answer.epoch)

    # -- iteration ------------------------------------------------------------------------

    def __iter__(self) -> Iterator[dict[str, Any]]:
        self._generation += 1
        if self.mode == "static":
            items = self._iter_static(self._generation)
        else:
            items = self._iter_dynamic(self._generation)
        # A DataLoader worker's copy (its own stream) is not the loop: its waits are the worker's.
        if not self._metered or self._stream is not None or not self._self_timed:
            return items
        return self._loop_timed(items)

    def _loop_timed(self, steps: Iterable[T]) -> Iterator[T]:
        """``steps`` timed as the training loop's, and in dynamic mode reported to the master."""
        meter = self.wait_meter()
        if self.mode == "static":
            return meter.timed(steps)
        return self.reported(meter.timed(steps), meter, lambda: self._current_epoch)

    def timed(self, steps: Iterable[T]) -> Iterator[T]:
        """The training loop's own ``steps``, timed as this loader's waits (``wait_stats()``, the
        master's job status, the status page, and the master's plans that follow them), for a
        loop that does not take its samples from this loader directly: a thread that reads the
        loader ahead into a queue of batches, a pipeline of its own. Iterating the loader itself
        is then not timed, since a thread that reads ahead waits for samples the loop does not
        wait for yet (the capacity bed's trainers: 70-84% waited by the reading thread against
        8-45% by the loop).

            batches = loader.timed(iter(queue.get, None))   # before the reading thread starts
            for batch in batches: step(batch)

        Call it before the loader's iteration starts: one begun earlier is timed already. Each
        ``__next__`` of ``steps`` is one step; in dynamic mode the waits go to the master, as
        when the loop iterates the loader."""
        if not self._metered and self._self_timed:
            raise ConfigError("this loader is read by a loader.torch.DataLoader, which times the training loop's "
                              "batches itself: iterate the DataLoader instead of calling timed()")
        self._self_timed = False
        return self._loop_timed(steps)

    def reported(
        self, items: Iterator[Any], meter: WaitMeter, epoch: Callable[[], int | None] = lambda: None
    ) -> Iterator[Any]:
        """``items`` (timed by ``meter``) while this trainer's wait goes to the master: with the
        requests its client sends, and every few seconds on its own when none carried it (for
        ``epoch()``; None: the master counts it to the trainer's current epoch)."""
        client = self._client()
        client.wait_source = meter
        job = self.job or ""
        trainer = self.trainer
        reporter = WaitReporter(
            meter, lambda: bool(client.report_wait(job, trainer, epoch())), name=f"shardcache-wait-{job}"
        ).start()
        try:
            yield from items
        finally:
            reporter.stop(flush=True)  # the last steps' wait, also after the job's last epoch

    def _hint(self, shards: list[Shard], replace: bool = False) -> None:
        """Queue prefetch hints for the next shards; they go to the daemon once the shard about
        to be read has opened. Sent earlier, their fills would share a bandwidth-capped origin with
        that shard's own fill and delay the first batch (bench/stall_bench.py measured it)."""
        rt = self._runtime()
        if replace:
            rt.pending_hints = list(shards)
        else:
            rt.pending_hints.extend(shards)

    def _flush_hints(self) -> None:
        rt = self._runtime()
        if rt.pending_hints:
            hints, rt.pending_hints = rt.pending_hints, []
            self._source().prefetch(hints)

    def _drop_ahead(self) -> None:
        rt = self._runtime()
        if rt.ahead is not None:
            rt.ahead.abandon()
            rt.ahead = None

    def _open(self, shard: Shard, recheck: bool, offset: int = 0, by_sample: bool = False) -> tuple[Reader, bool]:
        """The shard's reader (from byte ``offset``): the one opened ahead for it, else a new one
        (the prefetch hints queued go out once its request has); and whether it was opened
        ``by_sample`` (see :meth:`Source.open`: not one opened ahead)."""
        rt = self._runtime()
        ahead = rt.ahead
        if ahead is not None and (ahead.shard == shard or not recheck):
            # Taken if it is this shard's; else stale (a shard skipped, a plan changed). A
            # re-read (recheck) opens anew, and leaves the next shard's in place; so does a read
            # from an offset (one opened ahead is from the first byte).
            rt.ahead = None
            if ahead.shard == shard and not recheck and not offset:
                return ahead.take(), False
            ahead.abandon()
        if by_sample:
            return self._source().open(shard, recheck=recheck, on_sent=self._flush_hints, offset=offset,
                                       by_sample=True), True
        if offset:
            return self._source().open(shard, recheck=recheck, on_sent=self._flush_hints, offset=offset), False
        return self._source().open(shard, recheck=recheck, on_sent=self._flush_hints), False

    def _member_index(self, shard: Shard, start: int, url: str, ask_cache: bool = False) -> TarIndex | None:
        """The member index to resume ``shard`` at sample ``start`` by (reading nothing before
        it), or None: the shard is read from its first byte, as without one (a read from the
        start, a dataset without member indexes, one that could not be used). ``ask_cache``:
        without one pinned in the manifest, the one the node cache builds of a shard it holds."""
        if start <= 0 or (shard.members is None and not ask_cache):
            return None
        try:
            index = load_members(self._source(), shard, url, ask_cache=ask_cache)
        except LoaderError as exc:  # the index could not be read (a ManifestError is load_members' own)
            log.warning("%s: the member index could not be read (%s); reading the shard from its start", url, exc)
            return None
        return index if index is not None and index.digests is not None else None

    def _samples(self, shard: Shard, start: int, then: Shard | None = None) -> Iterator[dict[str, Any]]:
        """The shard's samples from sample ``start``, verified against what the manifest says.

        A read that does not match (a checksum, a size, a broken tar) is read once more, from the
        sample it reached, with ``recheck``: a cache in between re-hashes its copy first and drops
        it if it went bad, so a bad copy heals instead of failing every later run. A second
        mismatch is the shard's (or the manifest's) own: ``CorruptShard``.

        Resumed at a ``start`` past the first sample of a shard whose member index the manifest
        pins (:mod:`loader.members`), the read begins at that sample's first byte (a file mapped
        from there, a stream opened there): nothing before it is read, and each sample is checked
        against its own xxh3-64 before it is handed out, in place of the whole shard's checksum
        (a mismatch as above). Without a usable index, the shard is read from its first byte.

        ``then``: the shard read next, opened (:mod:`loader.ahead`) once this one has opened."""
        settings = self.settings
        url = self.location.object_url(shard.key)
        position = start  # samples yielded so far, counting the skipped ones
        # Resumed past the first sample with a member index (loader.members): read from the byte
        # sample ``start`` begins at, nothing before it, each sample checked against its own
        # checksum (the whole shard's cannot be, without the bytes skipped).
        by_members = self._member_index(shard, start, url, ask_cache=True)
        # The first shard this process reads, from its first sample, through a cache that can
        # stream a shard it is still filling: if not cached, it is read as its bytes land, each
        # sample checked by its member index, so the first sample need not wait for the whole
        # shard (a cached one is read as always). Only the first: later shards' fills are hidden
        # by the prefetch of the next, and reading them as they land measured slower than the
        # short-circuit read of the filled file (1.13-1.62 s against 0.96-0.99 s for 260 MiB,
        # first sample 0.16 s against 0.28-0.30 s; moto behind 20 ms).
        streams_fills = bool(getattr(self._source(), "streams_fills", False))
        first = not self._runtime().opened_first
        self._runtime().opened_first = True
        landing = (self._member_index(shard, 1, url) if first and start == 0 and settings.verify and streams_fills
                   else None)
        if by_members is not None and start >= by_members.samples:
            self._flush_hints()  # as after an open: the next shards' hints go out now
            if start > by_members.samples:
                raise CorruptShard(f"asked to resume at sample {start} but the shard ends earlier", url=url)
            return  # resumed at its end: nothing left to read
        for attempt in range(2):
            try:
                # The hints of the next shards go out as soon as this read's request has: the daemon
                # then fills them in this one's tail, not after its answer.
                offset = by_members.start(position) if by_members is not None else 0
                reader, by_sample = self._open(shard, recheck=attempt > 0, offset=offset,
                                               by_sample=streams_fills and (by_members is not None or landing is not None))
                if by_sample and by_members is None and landing is not None and file_identity(reader) is None:
                    by_members = landing  # a stream of the fill as it lands
            except CorruptShard as exc:
                if attempt:
                    raise
                log.warning("%s; reading it again", exc)
                continue
            finally:
                if not attempt:
                    self._flush_hints()  # after the first open attempt, whatever its outcome
            # Ahead only after an open answered from bytes in place (a hit, a local file): what it
            # saves is a warm open's latency; a cold shard's open only waits for the fill its
            # prefetch hint started. (Cold 1 GiB epochs with and without opening ahead measured
            # 353-469 MB/s either way on a 2-core VM: no difference beyond its spread.)
            if then is not None and self._runtime().ahead is None and self._source().last_open_in_place:
                rt = self._runtime()
                rt.ahead = rt.opener.submit(then, functools.partial(self._source().open, then))
            # A mapped file read before in this process is read by its member table
            # (loader.tarindex): no header parsed, any sample first; a first read records one.
            identity = file_identity(reader) if settings.map_files and by_members is None else None
            index = INDEXES.get(identity) if identity is not None else None
            members = MemberLog() if identity is not None and index is None and not position else None
            expected_size = shard.size if settings.verify else None
            expected_xxh3_128 = shard.xxh3_128 if settings.verify else None
            if index is not None and not settings.rehash_warm and index.checked_xxh3_128 == expected_xxh3_128:
                expected_xxh3_128 = None  # this very file was hashed and checked by an earlier read
            try:
                count = position
                if by_members is not None:
                    samples = _by_members(reader, by_members, position, url=url, verify=settings.verify,
                                          map_files=settings.map_files, zero_copy=settings.zero_copy)
                elif index is not None:
                    samples = iter_indexed(reader, index, url=url, start=position, expected_size=expected_size,
                                           expected_xxh3_128=expected_xxh3_128, zero_copy=settings.zero_copy)
                else:
                    samples = iter_samples(
                        reader,
                        url=url,
                        start=position,
                        chunk=settings.read_chunk_bytes,
                        max_member_bytes=settings.max_member_bytes,
                        expected_size=expected_size,
                        expected_xxh3_128=expected_xxh3_128,
                        map_files=settings.map_files,
                        zero_copy=settings.zero_copy,
                        log=members,
                    )
                for sample in samples:
                    count += 1
                    position = count
                    yield sample
                if settings.verify and shard.samples is not None and count != shard.samples:
                    if count < start:
                        raise CorruptShard(f"asked to resume at sample {start} but the shard ends earlier", url=url)
                    raise CorruptShard(f"holds {count} samples, the manifest says {shard.samples}", url=url)
                if members is not None and identity is not None and (table := TarIndex.from_log(members, identity[2])):
                    INDEXES.put(identity, dataclasses.replace(table, checked_xxh3_128=expected_xxh3_128))
                return
            except CorruptShard as exc:
                if identity is not None:
                    INDEXES.forget(identity)
                if attempt:
                    raise
                log.warning("%s; reading it again from sample %d", exc, position)
            finally:
                reader.close()

    # static --------------------------------------------------------------------------------

    def _plan(self, epoch: int) -> list[Shard]:
        shards = self.shards
        assert self.rank is not None and self.world_size is not None
        indices = rank_shards(len(shards), self.rank, self.world_size, self.seed, epoch, self.shuffle)
        indices = worker_shards(indices, *self._worker)
        return [shards[i] for i in indices]

    def position(self) -> tuple[int, int, int]:
        """Static mode: (epoch, shard of the plan, sample) of the next sample to hand out."""
        pos = self._resume or self._pos
        return pos.epoch, pos.shard, pos.offset

    def plan_length(self, epoch: int, worker: int, num_workers: int) -> int:
        """Static mode: how many shards worker ``worker`` of ``num_workers`` reads in ``epoch``."""
        clone = self.for_worker(worker, num_workers)
        return len(clone._plan(epoch))

    def resume_workers(self, num_workers: int, positions: dict[int, tuple[int, int, int]]) -> None:
        """Static mode: the next iteration's ``num_workers`` DataLoader workers resume each at its
        (epoch, shard, sample)."""
        self._worker_resume = (num_workers, {w: _Position(*p) for w, p in positions.items()})
        if num_workers == 0 and 0 in positions:
            self._resume = _Position(*positions[0])

    def _iter_static(self, generation: int) -> Iterator[dict[str, Any]]:
        if self._resume is not None:
            self._pos, self._resume = self._resume, None
        elif self._in_progress:
            self._pos = _Position(self._pos.epoch + 1)
        pos = self._pos
        self._in_progress = True
        # One generator, not two: every sample passes each layer (a warm epoch hands out 60,000 a second).
        try:
            while True:
                plan = self._plan(pos.epoch)
                while pos.shard < len(plan):
                    shard = plan[pos.shard]
                    ahead = plan[pos.shard + 1 : pos.shard + 1 + self.settings.lease_ahead]
                    self._hint(ahead, replace=True)
                    try:
                        for sample in self._samples(shard, pos.offset, ahead[0] if ahead else None):
                            if self._generation != generation:
                                return  # a newer iteration took over this loader
                            pos.offset += 1
                            yield sample
                    except LoaderError as exc:
                        if self.on_error == "raise":
                            raise
                        log.warning("skipping shard %s: %s", shard.key, exc)
                    if self._generation != generation:
                        return
                    pos.shard += 1
                    pos.offset = 0
                log.debug("static epoch %d done: %d shards", pos.epoch, len(plan))
                pos.epoch += 1
                pos.shard = 0
                pos.offset = 0
                if not self.continuous:
                    self._in_progress = False
                    return
        finally:
            if self._generation == generation:  # not a newer iteration's
                self._drop_ahead()

    # dynamic -------------------------------------------------------------------------------

    def _job_spec(self) -> dict[str, Any]:
        return {
            "name": self.job,
            "dataset": self.url,
            "shards": [s.spec() for s in self.shards],
            "epochs": self.epochs,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "lease_ttl_s": self.lease_ttl_s,
            "max_failures": self.max_failures,
            # Sent only when set: a job without it is the spec it always was (an older master too).
            **({"locality_window": self.locality_window} if self.locality_window else {}),
        }

    def _join(self) -> dict[str, Any]:
        """Create the job, or join the identical one other trainers created."""
        from loader.master.errors import JobConflict

        client = self._client()
        try:
            status: dict[str, Any] = client.create_job(self._job_spec())
        except JobConflict as exc:
            differs = exc.details.get("differs")
            fields = f" (it differs in {', '.join(map(str, differs))})" if isinstance(differs, list) and differs else ""
            raise JobConflict(
                f"job {self.job!r} exists on the master with a different spec{fields}: {exc.message}; start every "
                "trainer of a job with the same dataset and arguments (and SHARDCACHE_LOCALITY_WINDOW), or use a "
                "new job name",
                **exc.details,
            ) from exc
        self._joined = True
        self._by_key = {s.key: s for s in self.shards}
        return status

    def _iter_dynamic(self, generation: int) -> Iterator[dict[str, Any]]:
        from loader.master.stream import LeaseStream, Renewer

        client = self._client()
        job = self.job
        assert job is not None  # dynamic mode
        status = self._join() if not self._joined else client.status(job)
        if status.get("finished"):
            self._finished = True
        if self._finished:
            return
        epoch: int | None = None
        if not self.continuous:
            current = int(status.get("epoch") or 0)
            # A fresh DataLoader worker starts from a stale copy: never go back before the
            # master's current epoch, and never re-enter an epoch this loader already finished.
            epoch = max(current, self._next_epoch or 0)
            self._next_epoch = epoch
        trainer = self.trainer
        renewer = Renewer(client, job, trainer, self.settings.renew_fraction)
        # Made before the first lease: a bad endpoint fails here, not with shards already leased.
        self._source()
        stream = LeaseStream(
            client,
            job,
            trainer,
            self.settings.node,
            epoch,
            self.settings.lease_ahead,
            renewer,
            self.settings.wait_max_s,
            on_granted=lambda held: self._hint([self._shard_for(h) for h in held]),
            should_stop=lambda: self._generation != generation,
            # A DataLoader takes results from its workers in order: a worker blocked waiting for
            # its siblings' last shards would stall them (their samples are never taken, so they
            # never complete). It ends its epoch instead; the last sibling waits for the others.
            yield_to_siblings=self._siblings_hold_leases if self._worker[1] > 1 else None,
            stream=self._stream,
            deferred=self._ledger is not None,
        )
        clean = False
        loop_clock = self._loop_clock()
        self._runtime().renewer = renewer
        try:
            for held in stream:
                self._current_epoch = held.epoch
                yield from self._read_leased(held, renewer, generation)
                if self._generation != generation:
                    return
            clean = True
        finally:
            # Not a clean end (the trainer stopped iterating, or an error): what it holds goes
            # back to the master now, at the sample reached, instead of after the lease TTL.
            renewer.stop(give_back=not clean)
            self._runtime().renewer = None
        if stream.finished:
            self._finished = True
        if epoch is not None:
            self._next_epoch = max(epoch + 1, stream.next_epoch or 0)
            if loop_clock is not None:
                loop_clock.start_lap(self._next_epoch)
        self._current_epoch = None

    def _loop_clock(self) -> Clock | None:
        """The clock this process ticks per sample: when its own loop iterates this loader (not
        a DataLoader's worker, nor under a DataLoader, whose iterating process ticks per batch)."""
        return self._clock if self._ledger is None and self._metered and self._stream is None else None

    def _shard_for(self, held: Any) -> Shard:
        shard = self._by_key.get(held.key)
        if shard is None:
            # Not in our listing (the job was created from another listing): read it unverified.
            shard = Shard(held.shard, held.key)
        return shard

    def _read_leased(self, held: Any, renewer: Any, generation: int) -> Iterator[dict[str, Any]]:
        from loader.master.errors import LeaseLost, MasterError

        shard = self._shard_for(held)
        ledger = self._ledger
        loop_clock = self._loop_clock()
        try:
            samples: Iterator[Any] = self._samples(shard, held.start)
            if ledger is not None:
                # One sample ahead: the last one is known as last when it is handed out, so the
                # batch that carries it says the lease is read through.
                samples = _with_last(samples)
            for item in samples:
                if held.stale() and not held.lost:
                    renewer.renew(held)  # paused past the TTL: make sure the shard is still ours
                if held.lost or self._generation != generation:
                    log.info("stopped reading %s at sample %d: lease lost", held.key, held.position)
                    return
                if loop_clock is not None:
                    held.reach(held.position + 1, loop_clock.tick(held.epoch))
                else:
                    held.position += 1
                last = isinstance(item, _Last)
                sample: dict[str, Any] = item.sample if last else item
                if ledger is not None:
                    held.read_through = last
                    ledger.note(held, finished=last)
                yield sample
        except LoaderError as exc:
            held.done = True
            renewer.discard(held)
            try:
                state = renewer.calls.fail(held, str(exc))
            except MasterError as fail_exc:
                state = f"unreported ({fail_exc})"
            log.warning("shard %s (epoch %d) failed, now %s: %s", held.key, held.epoch, state, exc)
            if self.on_error == "raise":
                raise
            return
        if held.lost:
            return
        if held.read_through:
            # The iterating process completes it once it has received the last sample; until
            # then this process keeps it alive. (A lease that yielded nothing, an empty shard or
            # one resumed at its end, has nothing to deliver: completed here.)
            return
        held.done = True
        renewer.discard(held)
        try:
            renewer.calls.complete(held)
        except LeaseLost as exc:
            log.warning("completion of %s (epoch %d) refused: %s", held.key, held.epoch, exc)
            return
        except MasterError as exc:
            # The lease will expire and be re-issued at the last renewed offset.
            log.error("could not complete %s (epoch %d): %s", held.key, held.epoch, exc)
            return
        log.debug("completed shard %s epoch %d lease %s", held.key, held.epoch, held.lease)


def _by_members(
    reader: Reader, index: TarIndex, start: int, *, url: str, verify: bool, map_files: bool, zero_copy: bool
) -> Iterator[dict[str, Any]]:
    """Samples ``start...`` of a shard by its member index (``index.digests``), from ``reader``
    opened at ``index.start(start)``: a regular file is mapped and sliced from there, a stream
    read sample by sample. With ``verify``, each sample's bytes (headers, data, padding) are
    checked against its xxh3-64 before it is yielded; a mismatch, or a shard that ends early, is
    :class:`~loader.errors.CorruptShard`. The bytes before the offset are never read."""
    ends = index.ends
    begin = index.start(start)

    def check(i: int, data: Any) -> None:
        if verify and not sample_bytes_ok(index, i, data):
            raise CorruptShard(f"checksum mismatch: sample {i} ({index.key(i)!r}, bytes {index.start(i)}-{ends[i] - 1}) "
                               "does not match the xxh3_64 its member index gives", url=url)

    mapping = map_source(reader, map_files)
    if mapping is not None:
        buf, at, owned = mapping
        view = memoryview(buf)
        unmap = owned and isinstance(buf, mmap.mmap) and hasattr(buf, "madvise")
        unmapped = begin - begin % mmap.PAGESIZE
        try:
            if len(buf) != index.size or at != begin:
                raise CorruptShard(f"the shard's member index is for {index.size} bytes read from byte {begin}, the "
                                   f"file has {len(buf)} read from byte {at}", url=url)
            members = view if zero_copy else buf
            for i in range(start, index.samples):
                check(i, view[index.start(i) : ends[i]])
                sample = index.sample(i, members, url)
                if unmap and ends[i] - unmapped >= UNMAP_EVERY_BYTES:
                    # A mapped file's pages count in the reader's RSS once touched (see loader.tar).
                    unmapped = release_pages(buf, unmapped, ends[i])
                yield sample
        finally:
            if not zero_copy:
                view.release()
            if owned:
                with contextlib.suppress(BufferError):  # a caller still holds a view: the GC unmaps it
                    buf.close()  # type: ignore[union-attr]
        return
    position = begin
    for i in range(start, index.samples):
        data = _read_exactly(reader, ends[i] - position)
        if len(data) != ends[i] - position:
            raise CorruptShard(f"truncated: the shard ends at byte {position + len(data)}, inside sample {i}, which "
                               f"its member index says ends at byte {ends[i]}", url=url)
        check(i, data)
        yield index.sample(i, memoryview(data) if zero_copy else data, url, position)
        position = ends[i]


def _read_exactly(reader: Reader, n: int) -> bytes:
    """``n`` bytes of ``reader``, fewer only at its end."""
    data = reader.read(n)
    if len(data) >= n or not data:
        return data
    parts = [data]
    got = len(data)
    while got < n:
        data = reader.read(n - got)
        if not data:
            break
        parts.append(data)
        got += len(data)
    return b"".join(parts)


class _Last:
    """A shard's last sample, wrapped by :func:`_with_last`."""

    __slots__ = ("sample",)

    def __init__(self, sample: dict[str, Any]) -> None:
        self.sample = sample



def _with_last(samples: Iterator[dict[str, Any]]) -> Iterator[Any]:
    """``samples`` with the last one wrapped in :class:`_Last` (read one ahead)."""
    it = iter(samples)
    try:
        pending = next(it)
    except StopIteration:
        return
    for sample in it:
        yield pending
        pending = sample
    yield _Last(pending)
