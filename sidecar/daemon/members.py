"""Member indexes of cached shards, built by the daemon from its own verified copy.

A dataset indexed ahead (``shardcache index --members``) pins each shard's member index in its
manifest. For one that was not, the daemon builds the index of a shard it holds
(``GET /_shardcache/members?bucket=B&key=K``): from the entry's file (opened verified, as every
read of it), parsed as the loader parses it, and checked to hash to the entry's xxh3-128, so the
index is of the bytes the cache vouches for. It is kept with the entry, in memory, by the entry's
identity (bucket, key, ETag, checksum: a new version is a new index), least recently used dropped
past a budget; a restart builds it again from the file (a 64 MiB shard in tens of milliseconds).

A loader resuming a cached shard at sample N then reads from sample N's offset without a member
index of the dataset's own, each sample checked against the daemon's per-sample checksums (the
document names the shard's checksum, which the loader compares with its manifest's). The index is
built on request, not during the fill: a fill nobody resumes or indexes costs nothing more.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import mmap
import os
from collections import OrderedDict

from cache import Entry, Store
from sidecar.errors import SidecarError

__all__ = ["MemberIndexes", "NotIndexable", "DEFAULT_BUDGET_BYTES"]

log = logging.getLogger(__name__)

DEFAULT_BUDGET_BYTES = 64 << 20
"""Bytes of member index documents kept: about 700,000 samples of two members."""

_Identity = tuple[str, str, str, str]


class NotIndexable(SidecarError):
    """The cached object cannot be indexed by sample (not a tar, a sparse member...)."""


class MemberIndexes:
    """Documents (:mod:`wire.members`) of cached shards by entry identity. Loop-only; builds run on
    threads, at most ``builds`` at once, one per entry however many ask."""

    def __init__(self, store: Store, budget: int = DEFAULT_BUDGET_BYTES, builds: int = 2) -> None:
        self.store = store
        self.budget = budget
        self._docs: OrderedDict[_Identity, bytes] = OrderedDict()
        self._bytes = 0
        self._building: dict[_Identity, asyncio.Future[bytes]] = {}
        self._slots = asyncio.Semaphore(builds)
        self.built = 0

    async def document(self, entry: Entry) -> bytes:
        """The member index of ``entry``'s bytes: kept, being built, or built now."""
        identity = (entry.bucket, entry.key, entry.etag, entry.xxh3_128)
        doc = self._docs.get(identity)
        if doc is not None:
            self._docs.move_to_end(identity)
            return doc
        building = self._building.get(identity)
        if building is None:
            building = asyncio.ensure_future(self._build(entry))
            self._building[identity] = building
            building.add_done_callback(lambda _: self._building.pop(identity, None))
        doc = await asyncio.shield(building)
        self._keep(identity, doc)
        return doc

    async def _build(self, entry: Entry) -> bytes:
        async with self._slots:
            return await asyncio.to_thread(self._build_blocking, entry)

    def _build_blocking(self, entry: Entry) -> bytes:
        from loader.errors import CorruptShard
        from loader.members import index_shard
        from wire.members import members_bytes

        fd, info = self.store.open_verified(entry)
        try:
            if info.st_size != entry.size:
                raise NotIndexable(f"{entry.bucket}/{entry.key}: the cached file has {info.st_size} bytes, "
                                   f"the entry {entry.size}")
            buf: mmap.mmap | bytes = mmap.mmap(fd, 0, access=mmap.ACCESS_READ) if info.st_size else b""
            try:
                table = index_shard(buf, entry.key, url=f"{entry.bucket}/{entry.key}")
            except CorruptShard as exc:
                raise NotIndexable(str(exc)) from None
            finally:
                if isinstance(buf, mmap.mmap):
                    with contextlib.suppress(BufferError):
                        buf.close()
        finally:
            os.close(fd)
        if table.xxh3_128 != entry.xxh3_128:
            # The file changed under its stamp: never an index of other bytes than the entry's.
            raise NotIndexable(f"{entry.bucket}/{entry.key}: the cached file hashes to {table.xxh3_128}, the "
                               f"entry says {entry.xxh3_128}")
        self.built += 1
        return members_bytes(table)

    def _keep(self, identity: _Identity, doc: bytes) -> None:
        if identity in self._docs or len(doc) > self.budget:
            return
        self._docs[identity] = doc
        self._bytes += len(doc)
        while self._bytes > self.budget:
            _, dropped = self._docs.popitem(last=False)
            self._bytes -= len(dropped)

    @property
    def nbytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._docs)
