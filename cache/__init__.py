"""shardcache's storage engine: an on-disk store of immutable objects with a byte capacity,
LRU or hold eviction (policies behind one interface: :mod:`cache.eviction`), xxh3-128 integrity
and crash-safe atomic publishing.

No HTTP and no asyncio here: the daemon (``sidecar``) drives it from an executor.
"""

from cache.entry import Entry
from cache.errors import CacheError, CacheLocked, CorruptEntry, EntryNotFound, IntegrityError, NoSpace, ReadOnlyViewError
from cache.eviction import EVICTION_POLICIES, BorrowedFirst, EvictionPolicy, HoldPolicy, LRUPolicy
from cache.settings import StoreSettings
from cache.store import Store, Verifier, Writer, aligned_buffer, entry_id, hash_file

__all__ = [
    "Store",
    "StoreSettings",
    "Entry",
    "Writer",
    "Verifier",
    "entry_id",
    "aligned_buffer",
    "hash_file",
    "EVICTION_POLICIES",
    "EvictionPolicy",
    "LRUPolicy",
    "HoldPolicy",
    "BorrowedFirst",
    "CacheError",
    "CacheLocked",
    "CorruptEntry",
    "EntryNotFound",
    "IntegrityError",
    "NoSpace",
    "ReadOnlyViewError",
]
