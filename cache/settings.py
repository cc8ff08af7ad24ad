"""Settings of the cache engine, built once by the caller (the CLI) and passed down."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from cache.eviction import EVICTION_POLICIES

__all__ = ["StoreSettings", "EVICTION_POLICIES"]


@dataclass(frozen=True)
class StoreSettings:
    root: Path
    """Directory holding the cache; created if missing. One process owns it at a time."""

    capacity_bytes: int = 100 * 1024**3
    """Upper bound on the bytes of published entries plus fills in progress."""

    min_free_ratio: float = 0.10
    """Keep at least this fraction of the file system free, whatever ``capacity_bytes`` allows."""

    max_items: int = 1_000_000
    """Upper bound on the number of entries (bounds the in-memory index and inode use)."""

    eviction: str = "lru"
    """``lru`` evicts the least recently used entry to admit a new one. ``hold`` admits until
    full and then serves misses without caching: with shuffled epochs over a dataset larger than
    the cache, LRU evicts each shard just before it is needed again and gets almost no hits,
    while ``hold`` keeps a fixed cache/dataset fraction of hits every epoch. ``planned`` evicts by a
    lease master's plan (the order in which its trainers will read the cached objects: Belady's
    rule over it, :class:`cache.eviction.PlannedPolicy`), and as ``lru`` without one. Each name is
    a policy of :mod:`cache.eviction` (``POLICIES``)."""

    namespace: str = ""
    """Identity of the origin (e.g. ``s3`` + endpoint, or ``file:///root``). Part of every entry id,
    so a cache directory reused with another origin never serves the other origin's bytes."""

    tenant_quota_bytes: int | None = None
    """Upper bound on the bytes one tenant (the authenticated caller whose request caused a fill)
    brings into the cache: its published entries plus its fills in progress. A fill that would
    pass it evicts that tenant's own least recently used entries first, whatever ``eviction``
    says; one that cannot fit (larger than the quota, or the tenant's entries are in use) is
    served uncached. Entries filled without a tenant count for nobody. ``None``: no quota."""

    read_only_view: Path | None = None
    """The cache directory mounted read-only a second time: descriptors handed to other processes
    are opened through it (:meth:`cache.Store.open_verified` with ``for_others``). A reopen of a
    descriptor through ``/proc/<pid>/fd/N`` goes through the mount it was opened on, so on a
    read-only mount it cannot be for writing, not even by root with ``CAP_DAC_OVERRIDE``.
    :meth:`cache.Store.open` checks it is ``root`` itself and read-only. ``None``: descriptors are
    opened through ``root``."""

    direct_writes: bool = True
    """Write fills with ``O_DIRECT`` where the file system takes it (ext4, xfs; not tmpfs): the
    bytes go from the fill's buffer to the disk without a copy into the page cache and without
    the writeback that copy causes later. Measured on the suite's cold epoch (two cores, moto
    behind a 20 ms proxy): the daemon's CPU per filled GB fell from 0.9-1.9 s to 0.56-0.95 s, the
    kernel's copy into the page cache having been 38% of it (perf). Bytes a reader streams from a
    fill in progress (over HTTP, by ``sendfile`` from the temp file) are written the same way and
    read back from the disk (they went through the page cache until 2026-12-07: 1.5-2.8 CPU-s/GB
    of the daemon's against 1.1-1.4, ``bench.daemon_bench``'s ``daemon_cold_buffered``). The
    price: a reader of a fresh fill reads it from the disk instead of memory, so on a disk slower than the origin (network
    block storage such as EBS gp3 at 125 MB/s) turn it off (``--direct-writes off``)."""

    def __post_init__(self) -> None:
        if self.eviction not in EVICTION_POLICIES:
            raise ValueError(f"eviction must be one of {EVICTION_POLICIES}, not {self.eviction!r}")
        if not 0 <= self.min_free_ratio < 1:
            raise ValueError("min_free_ratio must be in [0, 1)")
        if self.capacity_bytes <= 0 or self.max_items <= 0:
            raise ValueError("capacity_bytes and max_items must be positive")
        if self.tenant_quota_bytes is not None and self.tenant_quota_bytes <= 0:
            raise ValueError("tenant_quota_bytes must be positive (None for no quota)")
