"""Static sharding without a master: pure, seeded functions.

Every rank computes the same epoch order from ``(seed, epoch)`` and takes every
``world_size``-th shard of it, so the ranks' lists are disjoint, together cover the dataset,
and differ in length by at most one. DataLoader workers split their rank's list the same way.

The order is the master's (:class:`wire.shuffle.EpochOrder`), so static and dynamic mode shuffle
alike and the order cannot drift with the Python version (``random.shuffle`` may).
"""

from __future__ import annotations

from loader.errors import ConfigError
from wire.shuffle import EpochOrder

__all__ = ["epoch_order", "rank_shards", "worker_shards"]


def _order(num_shards: int, seed: int, epoch: int, shuffle: bool) -> EpochOrder:
    if num_shards < 0:
        raise ConfigError("num_shards must be >= 0")
    return EpochOrder(num_shards, seed, epoch, shuffle)


def epoch_order(num_shards: int, seed: int, epoch: int, shuffle: bool = True) -> list[int]:
    """The dataset's shard indices in the order of ``epoch`` (a permutation of ``range(num_shards)``)."""
    return list(_order(num_shards, seed, epoch, shuffle))


def rank_shards(num_shards: int, rank: int, world_size: int, seed: int, epoch: int, shuffle: bool = True) -> list[int]:
    """The shard indices ``rank`` reads in ``epoch``: every ``world_size``-th of the epoch order."""
    if world_size < 1:
        raise ConfigError(f"world_size must be >= 1, not {world_size}")
    if not 0 <= rank < world_size:
        raise ConfigError(f"rank must be in [0, world_size={world_size}), not {rank}")
    order = _order(num_shards, seed, epoch, shuffle)
    # Index the positions this rank owns instead of listing the whole epoch: each rank pays
    # for its own share only.
    return [order[i] for i in range(rank, num_shards, world_size)]


def worker_shards(shards: list[int], worker: int, num_workers: int) -> list[int]:
    """Split a rank's shard list between its DataLoader workers (disjoint, covering)."""
    if num_workers < 1 or not 0 <= worker < num_workers:
        raise ConfigError(f"worker {worker} of {num_workers} is out of range")
    return shards[worker::num_workers]
