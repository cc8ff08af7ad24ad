"""Per-epoch shard order: a seeded pseudo-random permutation, reproducible from (seed, epoch).

The one shuffle of the project: the master hands out shards in this order (dynamic mode) and
every rank of a static job takes its share of it (``loader.static``). Both modes resume from
positions in this order (a restarted master, a static ``state_dict()`` checkpoint), so a changed
order would duplicate and skip shards; ``test_master_shuffle`` pins exact values.

The order is a keyed Feistel network on the smallest ``2**(2h)`` domain holding ``n``, with
cycle walking back into ``[0, n)`` (the format-preserving-encryption construction). Position
``i`` maps to its shard in O(1) time and memory, so an epoch starts instantly even for a
million shards (materialising and shuffling a list would stall the master's event loop at
every epoch boundary), and nothing about the order needs storing: it is recomputed from
(seed, epoch) after a restart. The round keys come from BLAKE2b and the round function is
the splitmix64 finaliser, both fully specified, so the order is the same on every Python
version and machine (``random.shuffle`` promises no such thing).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator

__all__ = ["EpochOrder", "permutation"]

_MASK64 = (1 << 64) - 1
_ROUNDS = 6


def _mix64(x: int) -> int:
    """splitmix64's finaliser: a fast bijective 64-bit mixer with full avalanche."""
    z = (x + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


class EpochOrder:
    """The order of ``n`` shards in one epoch: ``order[i]`` is the shard handed out i-th."""

    __slots__ = ("n", "seed", "epoch", "shuffle", "_half_bits", "_mask", "_keys")

    def __init__(self, n: int, seed: int, epoch: int, shuffle: bool = True) -> None:
        if n < 0:
            raise ValueError("n must be >= 0")
        self.n = n
        self.seed = seed
        self.epoch = epoch
        self.shuffle = shuffle
        bits = max(2, (max(n - 1, 1)).bit_length())
        self._half_bits = (bits + 1) // 2
        self._mask = (1 << self._half_bits) - 1
        digest = hashlib.blake2b(f"shardcache-shuffle:{seed}:{epoch}".encode(), digest_size=8 * _ROUNDS).digest()
        self._keys = tuple(int.from_bytes(digest[8 * r : 8 * r + 8], "little") for r in range(_ROUNDS))

    def __len__(self) -> int:
        return self.n

    def _encrypt(self, x: int) -> int:
        hb, mask = self._half_bits, self._mask
        left, right = x >> hb, x & mask
        for key in self._keys:
            left, right = right, left ^ (_mix64(key ^ right) & mask)
        return (left << hb) | right

    def _decrypt(self, x: int) -> int:
        hb, mask = self._half_bits, self._mask
        left, right = x >> hb, x & mask
        for key in reversed(self._keys):
            left, right = right ^ (_mix64(key ^ left) & mask), left
        return (left << hb) | right

    def index(self, shard: int) -> int:
        """The position of ``shard`` in the order (the inverse of ``order[i]``), also O(1): the
        master finds where a shard stands in another open epoch without a table per epoch."""
        if not 0 <= shard < self.n:
            raise IndexError(shard)
        if not self.shuffle:
            return shard
        # Cycle walking backwards: the inverse network leads back through the same cycle.
        x = self._decrypt(shard)
        while x >= self.n:
            x = self._decrypt(x)
        return x

    def __getitem__(self, index: int) -> int:
        if not 0 <= index < self.n:
            raise IndexError(index)
        if not self.shuffle:
            return index
        # Cycle walking: the network permutes [0, 4**half_bits) and at most 3/4 of that lies
        # outside [0, n), so the expected number of steps is below 4.
        x = self._encrypt(index)
        while x >= self.n:
            x = self._encrypt(x)
        return x

    def __iter__(self) -> Iterator[int]:
        return (self[i] for i in range(self.n))


def permutation(n: int, seed: int, epoch: int, shuffle: bool = True) -> list[int]:
    """The whole order of an epoch as a list (for tests and tools; the master indexes lazily)."""
    return list(EpochOrder(n, seed, epoch, shuffle))
