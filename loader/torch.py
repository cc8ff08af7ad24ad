"""PyTorch adapter: :class:`ShardDataset`, an ``IterableDataset`` that works with
``DataLoader(num_workers>0)``: in static mode the rank's shards are split between the workers;
in dynamic mode each worker is a trainer of its own with its own lease stream. Either way no
sample is delivered twice and none is missed.

    from torch.utils.data import DataLoader
    from loader.torch import ShardDataset

    ds = ShardDataset("s3://bucket/train/", job="resnet50", master="http://master:8700",
                      transform=decode)
    for batch in DataLoader(ds, batch_size=64, num_workers=4, persistent_workers=True):
        ...

Static mode across epochs: call ``ds.set_epoch(epoch)`` before each epoch (as with
``DistributedSampler``), or use ``persistent_workers=True`` so each worker's loader advances.
In dynamic mode the master says which epoch is current.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch.utils.data

from loader.shardloader import ShardLoader

__all__ = ["ShardDataset"]


class ShardDataset(torch.utils.data.IterableDataset):
    """``ShardLoader`` as a torch ``IterableDataset``; ``transform`` runs in the workers.

    Takes the :class:`~loader.ShardLoader` arguments (``url``, ``job``/``master`` or
    ``rank``/``world_size``/``seed``/``epoch``, ``endpoint``, ...)."""

    def __init__(
        self, url: str, *, transform: Callable[[dict[str, Any]], Any] | None = None, **loader_args: Any
    ) -> None:
        super().__init__()
        self.loader = ShardLoader(url, **loader_args)
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
