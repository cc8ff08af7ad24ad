"""Member indexes on the loader's side: built from a shard, read into a member table, and checked.

The document and its checks are :mod:`wire.members` (shared with ``shardcache index``). Here:

- :func:`index_shard`: a shard's bytes → its :class:`~wire.members.MemberTable` (parsed as the
  loader reads it, with every sample's xxh3-64);
- :func:`tar_index`: a table → the :class:`~loader.tarindex.TarIndex` that ``ShardIndex`` and the
  streaming loader slice samples by, with the per-sample checksums;
- :func:`usable`: whether an index may be used for a shard: the manifest pins the document's
  checksum, and the document names the shard's size and checksum (a stale index, for other bytes
  under the same key, is never used).
"""

from __future__ import annotations

import logging
import threading
from array import array
from collections import OrderedDict
from typing import Any, Protocol

import xxhash

from loader.dataset import Shard
from loader.errors import CorruptShard, ManifestError
from loader.tar import MemberLog, iter_samples
from loader.tarindex import TarIndex
from wire import members as wire_members
from wire.errors import ManifestError as WireManifestError
from wire.members import MemberTable, members_key

__all__ = ["index_shard", "member_table", "tar_index", "read_members", "usable", "sample_bytes_ok", "members_key",
           "load_members", "cache_members", "MEMBER_INDEXES"]

log = logging.getLogger(__name__)


class _ReadsNames(Protocol):
    def read_manifest(self, name: str = ..., /) -> bytes | None: ...


def member_table(index: TarIndex, buf: Any, shard_key: str, xxh3_128: str) -> MemberTable:
    """The member table of a shard whose :class:`TarIndex` is ``index`` and bytes ``buf``,
    each sample's bytes hashed."""
    view = memoryview(buf)
    try:
        digests: list[int] = []
        start = 0
        for end in index.ends:
            digests.append(xxhash.xxh3_64_intdigest(view[start:end]))
            start = end
    finally:
        view.release()
    keys = index.keys
    key_ends = index.key_ends
    names = [keys[key_ends[i - 1] if i else 0 : key_ends[i]] for i in range(len(key_ends))]
    return MemberTable(shard_key, index.size, xxh3_128, names, index.layouts, list(index.layout_of),
                       list(index.ends), digests, list(index.first), list(index.offsets), list(index.sizes))


def index_shard(buf: Any, shard_key: str, *, url: str = "", max_member_bytes: int = 1 << 31,
                xxh3_128: str | None = None) -> MemberTable:
    """Parse the whole shard in ``buf`` (bytes or a mapping) as the loader reads it and index it
    (``xxh3_128``: the checksum of ``buf`` when the caller just computed it).
    :class:`~loader.errors.CorruptShard` when it cannot be read by sample (not a tar, a sparse
    member)."""
    log = MemberLog()
    if xxh3_128 is None:
        xxh3_128 = xxhash.xxh3_128_hexdigest(memoryview(buf))
    for _ in iter_samples(buf, url=url or shard_key, max_member_bytes=max_member_bytes, map_files=False, log=log):
        pass
    index = TarIndex.from_log(log, len(buf))
    if index is None:
        why = ("it holds a sparse member (tar --sparse), whose bytes are not a slice of the shard"
               if not log.sliced else "its members could not be indexed")
        raise CorruptShard(f"cannot be indexed by sample: {why}", url=url or shard_key)
    return member_table(index, buf, shard_key, xxh3_128)


def tar_index(table: MemberTable) -> TarIndex:
    """The slicing table of ``table``, with its per-sample checksums (``TarIndex.digests``)."""
    keys = "".join(table.keys)
    key_ends = array("q")
    end = 0
    for key in table.keys:
        end += len(key)
        key_ends.append(end)
    return TarIndex(table.size, keys, key_ends, table.layouts, array("I", table.layout_of), array("q", table.first),
                    array("q", table.offsets), array("q", table.sizes), array("q", table.ends),
                    digests=array("Q", table.digests))


def read_members(data: bytes, shard: Shard, where: str) -> TarIndex:
    """The member index document ``data`` of ``shard``, checked against the manifest's pin and the
    shard's size and checksum; :class:`~loader.errors.ManifestError` saying what is wrong."""
    if shard.members is None:
        raise ManifestError(f"{where}: the manifest pins no member index for {shard.key}")
    digest = xxhash.xxh3_128_hexdigest(data)
    if digest != shard.members:
        raise ManifestError(f"{where}: xxh3_128 is {digest}, the manifest pins {shard.members} (a stale or damaged "
                            "index: rebuild it with `shardcache index --members`)")
    try:
        table = wire_members.parse_members(data, where)
    except WireManifestError as exc:
        raise ManifestError(str(exc)) from None
    if not usable(table, shard):
        raise ManifestError(f"{where}: indexes {table.shard_key} of {table.size} bytes, xxh3_128 {table.xxh3_128}; "
                            f"the manifest lists {shard.key} of {shard.size} bytes, xxh3_128 {shard.xxh3_128}")
    if shard.samples is not None and table.samples != shard.samples:
        raise ManifestError(f"{where}: indexes {table.samples} samples, the manifest says {shard.samples}")
    return tar_index(table)


def usable(table: MemberTable, shard: Shard) -> bool:
    """Whether ``table`` describes ``shard``'s bytes as the manifest lists them."""
    return (table.shard_key == shard.key and shard.size is not None and table.size == shard.size
            and shard.xxh3_128 is not None and table.xxh3_128 == shard.xxh3_128)


def sample_bytes_ok(index: TarIndex, i: int, data: Any) -> bool:
    """Whether ``data`` (sample ``i``'s bytes, ``[ends[i-1], ends[i])``) has its checksum."""
    assert index.digests is not None
    return xxhash.xxh3_64_intdigest(data) == index.digests[i]


class _Tables:
    """Member indexes read by this process, by the checksum the manifest pins (so a new manifest
    for new bytes never finds an old table), least recently used dropped past ``budget`` bytes;
    a shard whose index could not be used is remembered too, and not asked for again."""

    def __init__(self, budget: int = 64 << 20) -> None:
        self.budget = budget
        self._lock = threading.Lock()
        self._tables: OrderedDict[str, TarIndex | None] = OrderedDict()
        self._bytes = 0

    def get(self, digest: str) -> tuple[bool, TarIndex | None]:
        with self._lock:
            if digest not in self._tables:
                return False, None
            self._tables.move_to_end(digest)
            return True, self._tables[digest]

    def put(self, digest: str, table: TarIndex | None) -> None:
        with self._lock:
            old = self._tables.pop(digest, None)
            self._bytes -= old.nbytes if old is not None else 0
            self._tables[digest] = table
            self._bytes += table.nbytes if table is not None else 64
            while self._bytes > self.budget and len(self._tables) > 1:
                _, dropped = self._tables.popitem(last=False)
                self._bytes -= dropped.nbytes if dropped is not None else 64

    def clear(self) -> None:
        with self._lock:
            self._tables.clear()
            self._bytes = 0


MEMBER_INDEXES = _Tables()
"""This process's member indexes (what cold samples and resumed shards are read by)."""


def load_members(source: _ReadsNames, shard: Shard, url: str, ask_cache: bool = False) -> TarIndex | None:
    """``shard``'s (at ``url``) member index, read through ``source`` once per process and checked
    (:func:`read_members`); None when the manifest pins none, or when the one there cannot be
    used (missing, stale, damaged: logged once, and the shard is then read whole, never by a
    wrong table).

    ``ask_cache``: without a pinned one, the index a node cache in between builds of its copy of
    the shard (:func:`cache_members`), if it holds the shard."""
    if shard.members is None:
        return cache_members(source, shard, url) if ask_cache else None
    found, table = MEMBER_INDEXES.get(shard.members)
    if found:
        return table
    name = members_key(shard.key)
    where = members_key(url)  # the shard's URL: the index lies next to it
    try:
        data = source.read_manifest(name)
        if data is None:
            raise ManifestError(f"{where}: no such object (the manifest pins a member index; write it with "
                                "`shardcache index --members`)")
        table = read_members(data, shard, where)
    except ManifestError as exc:
        log.warning("%s; reading %s whole instead", exc, shard.key)
        table = None
    MEMBER_INDEXES.put(shard.members, table)
    return table


def cache_members(source: Any, shard: Shard, url: str) -> TarIndex | None:
    """The member index the node cache builds of its copy of ``shard`` (``source.cache_members``:
    a daemon's), or None: no such source, the shard not cached there, or an index that does not
    name the manifest's size and checksum of the shard (never used). Kept per process by the
    shard's checksum; a miss is asked again next time (the shard may be cached by then).

    The cache vouches for these sample boundaries as it does for the bytes it hands out: it built
    the index from its verified copy, and each sample read by it is still checked against the
    index's checksum of it."""
    ask = getattr(source, "cache_members", None)
    if ask is None or shard.xxh3_128 is None or shard.size is None:
        return None
    pin = "cache:" + shard.xxh3_128
    found, table = MEMBER_INDEXES.get(pin)
    if found:
        return table
    data = ask(shard)
    if data is None:
        return None
    where = f"{members_key(url)} (built by the cache)"
    try:
        parsed = wire_members.parse_members(data, where)
    except WireManifestError as exc:
        log.warning("%s; reading %s whole instead", exc, shard.key)
        return None
    # Its key is the cache's object key (the dataset's prefix and the shard's): bound to the shard
    # by the manifest's size and checksum of it.
    if (parsed.size, parsed.xxh3_128) != (shard.size, shard.xxh3_128) or (
            shard.samples is not None and parsed.samples != shard.samples):
        log.warning("%s: indexes %s of %d bytes, xxh3_128 %s, not the manifest's; reading %s whole instead",
                    where, parsed.shard_key, parsed.size, parsed.xxh3_128, shard.key)
        return None
    table = tar_index(parsed)
    MEMBER_INDEXES.put(pin, table)
    return table
