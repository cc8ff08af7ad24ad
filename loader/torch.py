"""PyTorch adapter: :class:`ShardDataset`, an ``IterableDataset`` for ``DataLoader(num_workers>0)``,
and :class:`DataLoader`, the drop-in ``torch.utils.data.DataLoader`` that dynamic mode's
guarantee needs.

    from loader.torch import DataLoader, ShardDataset

    ds = ShardDataset("s3://bucket/train/", job="resnet50", master="http://master:8700",
                      transform=decode)
    for batch in DataLoader(ds, batch_size=64, num_workers=4, persistent_workers=True):
        ...

In static mode the rank's shards are split between the workers. In dynamic mode the process that
iterates is the trainer and each worker a lease stream under it. With :class:`DataLoader` the
offsets the master records are what the training loop has received: each batch carries how far
its samples reached into their leases, and the iterating process renews the leases at that offset
and completes each once its last sample arrived. A rank that dies loses no sample: every sample
of every epoch reaches a training loop at least once, and the only duplicates are the samples the
rank received since its last renew (every ``lease_ttl_s / 3`` seconds).

With a plain ``torch.utils.data.DataLoader`` the workers cannot see what the training loop took,
so they report (and complete) what they read: a rank's death may then skip what its DataLoader
had queued, up to ``prefetch_factor * num_workers`` batches (and with ``num_workers=0`` the
samples of a batch being collated). Everything else holds.

Waiting for data (:mod:`loader.stall`): :class:`DataLoader` times each batch the training loop
asks for, from ``__next__`` until it has the batch, in the iterating process; ``dl.wait_stats()``
(or ``ds.loader.wait_stats()``) gives the totals, and in dynamic mode they go to the master with
the trainer's renews and completions. A plain ``torch.utils.data.DataLoader`` cannot be timed
from inside: its workers (and, with ``num_workers=0``, the dataset's iterator) see when a sample
is read, not when the loop takes a batch, so over a :class:`ShardDataset` it reports no wait at
all (``wait_stats()`` stays at zero and the master shows no wait for the trainer) rather than a
figure that would be wrong.

Static mode across epochs: call ``ds.set_epoch(epoch)`` before each epoch (as with
``DistributedSampler``), or use ``persistent_workers=True`` so each worker's loader advances.
In dynamic mode the master says which epoch is current.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import torch.utils.data
from torch.utils.data._utils.pin_memory import pin_memory as _pin_memory

from loader.errors import ConfigError
from loader.master.delivery import Delivery, Ledger, Progress
from loader.shardindex import ShardIndex
from loader.shardloader import ShardLoader

__all__ = ["ShardDataset", "ShardMapDataset", "DataLoader"]


class ShardDataset(torch.utils.data.IterableDataset):
    """``ShardLoader`` as a torch ``IterableDataset``; ``transform`` runs in the workers.

    Takes the :class:`~loader.ShardLoader` arguments (``url``, ``job``/``master`` or
    ``rank``/``world_size``/``seed``/``epoch``, ``endpoint``, ...)."""

    def __init__(
        self, url: str, *, transform: Callable[[dict[str, Any]], Any] | None = None, **loader_args: Any
    ) -> None:
        super().__init__()
        self.loader = ShardLoader(url, **loader_args)
        # Iterating the dataset is not the training loop's step (a batch is): DataLoader times that.
        self.loader._metered = False
        self.transform = transform
        self._worker_loader: ShardLoader | None = None
        self._worker_key: tuple[int, int, int] | None = None

    def set_epoch(self, epoch: int) -> None:
        """The epoch the next iteration reads (static mode; a lower bound in dynamic mode)."""
        self.loader.set_epoch(epoch)
        self._worker_loader = None

    def _loader_for_this_worker(self) -> ShardLoader:
        info = torch.utils.data.get_worker_info()
        if info is None:
            return self.loader
        key = (info.id, info.num_workers, info.seed)
        # A persistent worker keeps its loader (and so its epoch count) across epochs.
        if self._worker_loader is None or self._worker_key != key:
            self._worker_loader = self.loader.for_worker(info.id, info.num_workers)
            self._worker_key = key
        return self._worker_loader

    def __iter__(self) -> Iterator[Any]:
        loader = self._loader_for_this_worker()
        if self.transform is None:
            yield from loader
        else:
            for sample in loader:
                yield self.transform(sample)

    def state_dict(self) -> dict[str, Any]:
        """The loader's state (``ShardLoader.state_dict``): in static mode where this process
        reads (``num_workers=0``), in dynamic mode the job's mark. Under a DataLoader use
        ``loader.torch.DataLoader.state_dict()``, which knows what the training loop received."""
        return self.loader.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loader.load_state_dict(state)


class ShardMapDataset(torch.utils.data.Dataset):
    """A map-style dataset of the samples of the tar shards at ``url``: ``len(ds)`` samples, and
    ``ds[i]`` sample ``i`` with the streaming loader's fields (``__key__``, ``__url__``, one
    ``bytes`` per member), passed through ``transform`` when given. Works with any sampler
    (``DistributedSampler``, weighted, one that skips what a checkpoint saw) and ``num_workers > 0``
    (each worker opens its own shards). ``__getitems__`` reads a sampler's batch grouped by shard.

    Takes :class:`~loader.shardindex.ShardIndex`'s arguments (``endpoint``, ``settings``,
    ``max_open_shards``); ``ds.index`` is that index."""

    def __init__(
        self, url: str, *, transform: Callable[[dict[str, Any]], Any] | None = None, **index_args: Any
    ) -> None:
        super().__init__()
        self.index = ShardIndex(url, **index_args)
        self.transform = transform

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, i: int) -> Any:
        sample = self.index.sample(int(i))
        return sample if self.transform is None else self.transform(sample)

    def __getitems__(self, indices: list[int]) -> list[Any]:
        # torch's fetcher calls this with a whole batch of the sampler's indices (torch >= 2.1).
        samples = self.index.samples([int(i) for i in indices])
        return samples if self.transform is None else [self.transform(s) for s in samples]


Position = tuple[int, int, int, int]
"""Static mode: (worker, epoch, shard of its plan, sample) its reader reached with a batch."""


class _Marked:
    """A batch with what it took from each lease (dynamic mode) or where its worker's reader
    reached (static mode), on its way from a worker to the trainer."""

    __slots__ = ("batch", "progress", "count", "position")

    def __init__(self, batch: Any, progress: Progress, count: int, position: Position | None = None) -> None:
        self.batch = batch
        self.progress = progress
        self.count = count
        self.position = position

    def pin_memory(self) -> _Marked:  # the DataLoader's pin-memory thread calls this
        return _Marked(_pin_memory(self.batch), self.progress, self.count, self.position)


class _MarkingCollate:
    """The user's collate function, then the lease positions reached by this batch's samples, or
    (static mode) the position its reader reached (collation runs right after the batch's last
    sample was taken, in the process that read it)."""

    def __init__(self, collate: Callable[[Any], Any], dataset: ShardDataset, batched: bool, static: bool = False) -> None:
        self.collate = collate
        self.dataset = dataset
        self.batched = batched
        self.static = static

    def __call__(self, samples: Any) -> _Marked:
        batch = self.collate(samples)
        count = len(samples) if self.batched else 1
        if self.static:
            info = torch.utils.data.get_worker_info()
            worker = 0 if info is None else info.id
            return _Marked(batch, {}, count, (worker, *self.dataset._loader_for_this_worker().position()))
        ledger = self.dataset.loader._ledger
        return _Marked(batch, ledger.drain() if ledger is not None else {}, count)


class DataLoader(torch.utils.data.DataLoader):
    """``torch.utils.data.DataLoader`` (same arguments) whose dynamic-mode offsets are what the
    training loop received (see the module's docstring). Over anything but a dynamic-mode
    :class:`ShardDataset` it is the plain DataLoader."""

    def __init__(self, dataset: Any, *args: Any, **kwargs: Any) -> None:
        deferred = isinstance(dataset, ShardDataset) and dataset.loader.mode == "dynamic"
        static = isinstance(dataset, ShardDataset) and dataset.loader.mode == "static"
        self._drop_partial: int | None = None
        if (deferred or static) and kwargs.get("in_order") is False:
            raise ConfigError(
                "in_order=False delivers batches out of order, so the position a checkpoint (or, in dynamic mode, a "
                "lease) records could count a batch the training loop has not received yet: leave in_order at True"
            )
        if deferred:
            if kwargs.get("drop_last"):
                # Dropped here, after its progress is taken: dropped samples count as received.
                kwargs["drop_last"] = False
                self._drop_partial = kwargs.get("batch_size", args[0] if args else 1)
            loader = dataset.loader
            if os.getpid() != loader._creator_pid:
                loader.rebase_trainer()  # a copy made in another process: a trainer of its own
            loader._ledger = Ledger()
        super().__init__(dataset, *args, **kwargs)
        self._deferred: ShardDataset | None = dataset if deferred else None
        self._static = static
        self._delivery: Delivery | None = None
        # Static mode, the iteration in progress (or the last one): per worker, where its reader
        # was when the loop received its last batch; where each worker started (None: where the
        # loader's next iteration starts); whether the loop received its end.
        self._positions: dict[int, tuple[int, int, int]] = {}
        self._starts: dict[int, tuple[int, int, int]] | None = None
        self._ended = False
        self._iteration = 0
        if deferred or static:
            self.collate_fn = _MarkingCollate(self.collate_fn, dataset, batched=self.batch_size is not None, static=static)

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        dataset = self.dataset
        if self._static and isinstance(dataset, ShardDataset):
            self._begin(dataset.loader)  # before the workers start: whether persistent ones run already
        batches = super().__iter__()
        if not isinstance(dataset, ShardDataset):
            return batches
        loader = dataset.loader
        # The workers were made with the positions a loaded state gave them: a later epoch's new
        # workers (persistent_workers=False) start where their epoch starts.
        loader._worker_resume = None
        meter = loader.wait_meter()
        if self._static:
            return meter.timed(self._positioned(batches, self._iteration))
        if self._deferred is None:
            return meter.timed(batches)
        # Timed outside the delivery: what it does per batch is part of the loop's wait.
        return loader.reported(meter.timed(self._delivered(batches, loader)), meter)

    # -- checkpoints -------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """A checkpoint of what the training loop received (the torchdata ``StatefulDataLoader``
        convention, and the ``Stateful`` protocol of ``torch.distributed.checkpoint``).

        Dynamic mode: the job's mark on the master at this trainer's step (this trainer's exact
        positions go with it), which any rank of any world size can load. Static mode: where
        each worker resumes (``num_workers`` 0 or more; loading needs the same count)."""
        dataset = self.dataset
        if not isinstance(dataset, ShardDataset):
            raise ConfigError("state_dict() checkpoints a ShardDataset; this DataLoader reads another dataset")
        loader = dataset.loader
        if self._deferred is not None:
            delivery = self._delivery
            if delivery is None:
                return loader.checkpoint([], between_epochs=True)
            return loader.checkpoint(delivery.positions())
        return _static_state(loader, self.num_workers, self._positions, self._worker_starts(loader), self._ended)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict`, before iterating. Dynamic mode: the job is rewound to
        the saved mark (on every rank, or on one: the same; twice: the same). Static mode: each
        worker resumes at its saved sample (a state of another ``num_workers``, dataset, seed or
        rank is refused and changes nothing): the next ``for`` loop receives the rest of the
        epoch the state was saved in, or, saved after an epoch's ``for`` loop ended, the next
        epoch. ``ds.set_epoch`` of that epoch keeps the state; of another, starts it afresh."""
        dataset = self.dataset
        if not isinstance(dataset, ShardDataset):
            raise ConfigError("load_state_dict() restores a ShardDataset; this DataLoader reads another dataset")
        loader = dataset.loader
        if self._deferred is not None:
            loader.load_state_dict(state)
            self._delivery = None
            return
        if isinstance(state, dict) and state.get("kind") != _STATIC_KIND and self.num_workers == 0:
            loader.load_state_dict(state)  # a ShardLoader state of a num_workers=0 loop
            self._restart({})
            return
        if not isinstance(state, dict) or state.get("kind") != _STATIC_KIND or state.get("version") != 1:
            raise ConfigError("not a loader.torch.DataLoader state: pass what DataLoader.state_dict() returned")
        if state.get("num_workers") != self.num_workers:
            raise ConfigError(
                f"this checkpoint was taken with num_workers={state.get('num_workers')!r} and this DataLoader has "
                f"num_workers={self.num_workers}: a static-mode rank's shards are split between its workers, so "
                "resume with the same num_workers"
            )
        readers = max(self.num_workers, 1)
        try:
            positions = {int(w): (int(p[0]), int(p[1]), int(p[2])) for w, p in state["workers"].items()}
        except (KeyError, TypeError, ValueError, IndexError, AttributeError) as exc:
            raise ConfigError("malformed DataLoader state: workers must map to [epoch, shard, sample]") from exc
        if sorted(positions) != list(range(readers)) or any(min(p) < 0 for p in positions.values()):
            raise ConfigError(
                f"malformed DataLoader state: it must give every one of the {readers} worker(s) a position "
                f"[epoch, shard, sample] >= 0, it gives {state['workers']!r}"
            )
        loader.load_state_dict(state["loader"])  # refuses another dataset, seed, rank, ...: nothing changed then
        loader.resume_workers(self.num_workers, positions)
        self._restart(positions)
        if self._iterator is not None:
            # Persistent workers keep the loaders they made: new ones start where the state says.
            self._iterator = None

    def _restart(self, starts: dict[int, tuple[int, int, int]]) -> None:
        """Static mode: forget the iteration in progress; the next one's workers start at
        ``starts`` (empty: where the loader's copies would)."""
        self._positions = {}
        self._starts = dict(starts) if starts else None
        self._ended = False
        self._iteration += 1  # an iteration in progress no longer records where the loop is

    def _begin(self, loader: ShardLoader) -> None:
        """Static mode: a new iteration; where each worker starts it."""
        running = self.persistent_workers and self.num_workers > 0 and self._iterator is not None
        if running:
            # Persistent workers read their loaders' next epoch, whatever the dataset's loader says.
            epoch = _epoch_of(self._worker_starts(loader)) + 1
            starts = {w: (epoch, 0, 0) for w in range(self.num_workers)}
            self._restart(starts)
        else:
            self._restart({})
            self._starts = self._worker_starts(loader)

    def _worker_starts(self, loader: ShardLoader) -> dict[int, tuple[int, int, int]]:
        """Static mode: where each worker starts the iteration in progress (the next one before
        any): workers made now would start where the loader's ``for_worker`` copies do."""
        if self._starts is not None:
            return self._starts
        if self.num_workers == 0:
            return {0: loader.position()}
        return {w: loader.for_worker(w, self.num_workers).position() for w in range(self.num_workers)}

    def _positioned(self, batches: Iterator[Any], iteration: int) -> Iterator[Any]:
        for item in batches:
            if not isinstance(item, _Marked):
                yield item
                continue
            if item.position is not None and iteration == self._iteration:
                worker, *where = item.position
                self._positions[worker] = (where[0], where[1], where[2])
            yield item.batch
        if iteration == self._iteration:
            self._ended = True  # the loop received the epoch's last batch and its end

    def wait_stats(self) -> dict[str, Any]:
        """How long the training loop waited for its batches (``ShardLoader.wait_stats``); over
        anything but a :class:`ShardDataset`, nothing is timed."""
        if isinstance(self.dataset, ShardDataset):
            return self.dataset.loader.wait_stats()
        raise ConfigError("wait_stats() times a ShardDataset's batches; this DataLoader reads another dataset")

    def _delivered(self, batches: Iterator[Any], loader: ShardLoader) -> Iterator[Any]:
        delivery = Delivery(
            loader._client(), loader.job or "", loader.trainer, loader.settings.renew_fraction, clock=loader._clock
        )
        self._delivery = delivery
        try:
            for item in batches:
                if not isinstance(item, _Marked):
                    yield item
                    continue
                dropped = self._drop_partial is not None and item.count < self._drop_partial
                if item.progress or not dropped:
                    delivery.received(item.progress, tick=not dropped)
                if dropped:
                    continue
                yield item.batch
        finally:
            delivery.close()
            if self._delivery is delivery:
                self._delivery = None


_STATIC_KIND = "shardcache-static-dataloader"


def _epoch_of(starts: dict[int, tuple[int, int, int]]) -> int:
    """The epoch an iteration whose workers start at ``starts`` reads (all read the same one)."""
    return min(p[0] for p in starts.values())


def _static_state(
    loader: ShardLoader,
    num_workers: int,
    seen: dict[int, tuple[int, int, int]],
    starts: dict[int, tuple[int, int, int]],
    ended: bool,
) -> dict[str, Any]:
    """Static mode's DataLoader state: where each worker resumes so that the loop receives next
    exactly what it would have.

    Saved during an iteration (before its first batch too), the state resumes that iteration: a
    worker resumes where its reader was when the loop received its last batch, or, with none
    received yet in this iteration, where it started it; a worker whose reader ran through its
    plan (its last batch was a partial one) resumes at its plan's end, yielding nothing more in
    that epoch, however many batches its siblings still have. Saved after the loop received the
    iteration's end (the ``for`` loop finished), the state starts the next epoch on every worker.
    A loop that received the last batch of every worker but not the end yet resumes an iteration
    with nothing left in it, which ends at once: that epoch's ``for`` loop, then the next's."""
    base = loader.state_dict()
    if num_workers == 0:
        # The loop's own process reads, one batch at a time: the loader is where the loop is.
        workers = {"0": list(loader.position())}
    elif ended and not loader.continuous:
        epoch = _epoch_of(starts) + 1
        workers = {str(w): [epoch, 0, 0] for w in range(num_workers)}
    else:
        workers = {}
        for w in range(num_workers):
            if w not in seen:
                workers[str(w)] = list(starts[w])
                continue
            epoch, shard, offset = seen[w]
            if shard == 0 and offset == 0 and epoch > 0:
                # Only a reader that ran past its epoch's end is at a shard's start after a batch
                # (a batch holds a sample, and a sample handed out moves the offset past it).
                workers[str(w)] = [epoch - 1, loader.plan_length(epoch - 1, w, num_workers), 0]
            else:
                workers[str(w)] = [epoch, shard, offset]
    if num_workers:
        # The dataset's own loader does not read (persistent workers may be epochs ahead of it):
        # loaded, it starts the epoch the workers resume in, should workers be made from it.
        base.update(epoch=min(p[0] for p in workers.values()), shard=0, offset=0)
    return {"kind": _STATIC_KIND, "version": 1, "num_workers": num_workers, "loader": base, "workers": workers}
