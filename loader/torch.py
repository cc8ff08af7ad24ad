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
from loader.shardloader import ShardLoader

__all__ = ["ShardDataset", "DataLoader"]


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
        """Static mode, ``num_workers=0`` only (worker positions live in the worker processes)."""
        return self.loader.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loader.load_state_dict(state)


class _Marked:
    """A batch with what it took from each lease, on its way from a worker to the trainer."""

    __slots__ = ("batch", "progress", "count")

    def __init__(self, batch: Any, progress: Progress, count: int) -> None:
        self.batch = batch
        self.progress = progress
        self.count = count

    def pin_memory(self) -> _Marked:  # the DataLoader's pin-memory thread calls this
        return _Marked(_pin_memory(self.batch), self.progress, self.count)


class _MarkingCollate:
    """The user's collate function, then the lease positions reached by this batch's samples
    (collation runs right after the batch's last sample was taken, in the process that read it)."""

    def __init__(self, collate: Callable[[Any], Any], dataset: ShardDataset, batched: bool) -> None:
        self.collate = collate
        self.dataset = dataset
        self.batched = batched

    def __call__(self, samples: Any) -> _Marked:
        batch = self.collate(samples)
        ledger = self.dataset.loader._ledger
        count = len(samples) if self.batched else 1
        return _Marked(batch, ledger.drain() if ledger is not None else {}, count)


class DataLoader(torch.utils.data.DataLoader):
    """``torch.utils.data.DataLoader`` (same arguments) whose dynamic-mode offsets are what the
    training loop received (see the module's docstring). Over anything but a dynamic-mode
    :class:`ShardDataset` it is the plain DataLoader."""

    def __init__(self, dataset: Any, *args: Any, **kwargs: Any) -> None:
        deferred = isinstance(dataset, ShardDataset) and dataset.loader.mode == "dynamic"
        self._drop_partial: int | None = None
        if deferred:
            if kwargs.get("in_order") is False:
                raise ConfigError(
                    "in_order=False delivers batches out of order, so the offset a lease reached could "
                    "count a batch the training loop has not received yet: leave in_order at True"
                )
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
        if deferred:
            self.collate_fn = _MarkingCollate(self.collate_fn, dataset, batched=self.batch_size is not None)

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        batches = super().__iter__()
        dataset = self.dataset
        if not isinstance(dataset, ShardDataset):
            return batches
        loader = dataset.loader
        meter = loader.wait_meter()
        if self._deferred is None:
            return meter.timed(batches)
        # Timed outside the delivery: what it does per batch is part of the loop's wait.
        return loader.reported(meter.timed(self._delivered(batches, loader)), meter)

    def wait_stats(self) -> dict[str, Any]:
        """How long the training loop waited for its batches (``ShardLoader.wait_stats``); over
        anything but a :class:`ShardDataset`, nothing is timed."""
        if isinstance(self.dataset, ShardDataset):
            return self.dataset.loader.wait_stats()
        raise ConfigError("wait_stats() times a ShardDataset's batches; this DataLoader reads another dataset")

    def _delivered(self, batches: Iterator[Any], loader: ShardLoader) -> Iterator[Any]:
        delivery = Delivery(loader._client(), loader.job or "", loader.trainer, loader.settings.renew_fraction)
        try:
            for item in batches:
                if not isinstance(item, _Marked):
                    yield item
                    continue
                if item.progress:
                    delivery.received(item.progress)
                if self._drop_partial is not None and item.count < self._drop_partial:
                    continue
                yield item.batch
        finally:
            delivery.close()
