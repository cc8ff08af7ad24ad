"""Where each sample of a shard lies: the member table of a tar shard, kept between epochs.

A warm epoch of a mapped shard spent most of its time parsing tar headers again (8-10 us of
Python per ~110 KB sample of two members, against 3-4 us to hash and copy its bytes: 1 GiB on a
2-core VM). The parse of the first read already knows every member's offset and size, so it
records them (:class:`~loader.tar.MemberLog`), and later reads of the same file slice the members
straight out of the mapping (:func:`iter_indexed`), starting at any sample without reading the
ones before it.

Nothing is trusted that was not checked: a table is kept only after a read that parsed the whole
shard and passed its size and checksum checks, for that very file (device, inode, size, mtime);
an indexed read still hashes every byte of the file, headers included, and checks the size and
checksum at the end exactly as a parse does. A file that changed is a new identity, and a table
whose members do not fit the file is refused (:class:`~loader.errors.CorruptShard`; the caller
reads the shard again by parsing it).

Tables live in memory, in this process, in a least-recently-used registry bounded by bytes
(:data:`DEFAULT_BUDGET_BYTES`; ~60 bytes a sample of two members, keys included).
"""

from __future__ import annotations

import contextlib
import functools
import mmap
import os
import stat
import threading
from array import array
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from loader.errors import CorruptShard
from loader.hashing import HashBehind
from loader.tar import BLOCK, UNMAP_EVERY_BYTES, MemberLog, map_source, release_pages

__all__ = ["TarIndex", "FileIdentity", "file_identity", "iter_indexed", "IndexRegistry", "INDEXES",
           "DEFAULT_BUDGET_BYTES"]

DEFAULT_BUDGET_BYTES = 64 << 20
"""Bytes of member tables one process keeps: about a million samples of two members."""

FileIdentity = tuple[int, int, int, int, int]
"""``(st_dev, st_ino, st_size, st_mtime_ns, st_ctime_ns)`` of an open file: any write to it, or a
new file in its place, makes another (a ctime cannot be set back, an mtime can)."""


def file_identity(reader: Any) -> FileIdentity | None:
    """The identity of a regular file behind ``reader`` (read from its start), or None for a
    stream or anything else that is not mapped."""
    fileno = getattr(reader, "fileno", None)
    tell = getattr(reader, "tell", None)
    if fileno is None or tell is None:
        return None
    try:
        info = os.fstat(fileno())
        if tell() != 0:
            return None
    except (OSError, ValueError):
        return None
    if not stat.S_ISREG(info.st_mode):
        return None
    return info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns


@dataclass(frozen=True)
class TarIndex:
    """The samples of one shard: sample ``i`` has key ``keys[key_ends[i-1]:key_ends[i]]`` and the
    fields ``layouts[layout_of[i]]``, whose data are the members ``first[i]...`` in order
    (``offsets``/``sizes``: the data's offset in the shard and its length); its last member's
    padding ends at ``ends[i]``."""

    size: int
    keys: str
    key_ends: array
    layouts: tuple[tuple[str, ...], ...]
    layout_of: array
    first: array
    offsets: array
    sizes: array
    ends: array
    checked_xxh3_128: str | None = None
    """The checksum the read that made this table verified the whole file against (None: no
    checksum checked); see ``LoaderSettings.rehash_warm``."""
    digests: array | None = None
    """Each sample's xxh3-64, of its bytes ``[ends[i-1] (0 for the first), ends[i])``, when the
    table came from a member index (:mod:`loader.members`): a sample can then be checked alone."""

    def start(self, i: int) -> int:
        """Where sample ``i``'s bytes begin (the end of the one before)."""
        return self.ends[i - 1] if i else 0

    def key(self, i: int) -> str:
        return self.keys[self.key_ends[i - 1] if i else 0 : self.key_ends[i]]

    def sample(self, i: int, data: Any, url: str, base: int = 0) -> dict[str, Any]:
        """Sample ``i`` as the loader yields it, its fields sliced out of ``data`` (the shard's
        bytes from offset ``base`` on: a mapping, bytes, or a view for zero-copy fields)."""
        sample: dict[str, Any] = {"__key__": self.key(i), "__url__": url}
        offsets, sizes = self.offsets, self.sizes
        m = self.first[i]
        for field in self.layouts[self.layout_of[i]]:
            at = offsets[m] - base
            sample[field] = data[at : at + sizes[m]]
            m += 1
        return sample

    @property
    def samples(self) -> int:
        return len(self.key_ends)

    @property
    def nbytes(self) -> int:
        arrays = (self.key_ends, self.layout_of, self.first, self.offsets, self.sizes, self.ends)
        extra = 8 * len(self.digests) if self.digests is not None else 0
        return extra + len(self.keys) + sum(a.itemsize * len(a) for a in arrays) + 64 * len(self.layouts) + 200

    @classmethod
    def from_log(cls, log: MemberLog, size: int) -> TarIndex | None:
        """The table of a parse that logged every member it yielded; None when it could not."""
        if not log.complete:
            return None
        keys: list[str] = []
        key_ends = array("q")
        layouts: dict[tuple[str, ...], int] = {}
        layout_of = array("I")
        first = array("q")
        offsets = array("q")
        sizes = array("q")
        ends = array("q")
        end = 0
        fields: list[str] = []
        current: str | None = None

        def close_sample() -> None:
            layout = tuple(fields)
            layout_of.append(layouts.setdefault(layout, len(layouts)))
            ends.append(min(size, offsets[-1] + (sizes[-1] + BLOCK - 1) // BLOCK * BLOCK))

        for key, field, offset, length in log.members:
            if key != current:
                if current is not None:
                    close_sample()
                current = key
                fields = []
                keys.append(key)
                end += len(key)
                key_ends.append(end)
                first.append(len(offsets))
            fields.append(field)
            offsets.append(offset)
            sizes.append(length)
        if current is not None:
            close_sample()
        return cls(size, "".join(keys), key_ends, tuple(layouts), layout_of, first, offsets, sizes, ends)


def iter_indexed(
    raw: Any,
    index: TarIndex,
    *,
    url: str = "",
    start: int = 0,
    expected_size: int | None = None,
    expected_xxh3_128: str | None = None,
    zero_copy: bool = False,
) -> Iterator[dict[str, Any]]:
    """:func:`~loader.tar.iter_samples` of ``raw`` (a regular file, read from its start) by its
    member table: the same samples, the same checks of size and checksum, no header parsed."""
    if start < 0:
        raise ValueError("start must be >= 0")
    mapping = map_source(raw, True)
    if mapping is None or mapping[1] != 0:
        raise CorruptShard("the shard's member table is for a mapped file read from its start", url=url)
    buf, _, owned = mapping
    size = len(buf)
    view = memoryview(buf)
    members = view if zero_copy else buf
    hasher: Any = None
    if expected_xxh3_128 is not None:
        import xxhash

        hasher = xxhash.xxh3_128()
    unmap = isinstance(buf, mmap.mmap) and hasattr(buf, "madvise")
    every = UNMAP_EVERY_BYTES
    behind: HashBehind | None = None
    try:
        if size != index.size or (index.offsets and index.offsets[-1] + index.sizes[-1] > size):
            raise CorruptShard(f"the shard's member table is for {index.size} bytes, the file has {size}", url=url)
        keys, key_ends, layouts, layout_of = index.keys, index.key_ends, index.layouts, index.layout_of
        offsets, sizes, first, ends = index.offsets, index.sizes, index.first, index.ends
        if hasher is not None and zero_copy:
            # Nothing here touches a zero-copy read's bytes: the hash runs on another core.
            behind = HashBehind(hasher, view, size, read_from=ends[min(start, len(ends)) - 1] if start and ends else 0,
                                release=functools.partial(release_pages, buf) if unmap else None)
        update = hasher.update if hasher is not None and behind is None else None
        hashed = 0
        unmapped = 0
        next_release = 0
        for i in range(start, len(key_ends)):
            if update is not None:
                # The sample's bytes, headers included, up to its last member's padding, before
                # they are copied: the copy then reads what the hash has just brought into the
                # CPU cache. (Hashed on a thread of its own instead, the copy read memory and a
                # warm epoch was 15-20% slower.)
                end = ends[i]
                update(view[hashed:end])
                hashed = end
            m = first[i]
            sample: dict[str, Any] = {"__key__": keys[key_ends[i - 1] if i else 0 : key_ends[i]], "__url__": url}
            for field in layouts[layout_of[i]]:
                at = offsets[m]
                sample[field] = members[at : at + sizes[m]]
                m += 1
            if ends[i] >= next_release:
                next_release = ends[i] + every
                if behind is not None:
                    behind.read_to(ends[i])  # its thread releases the pages behind both
                elif unmap:
                    # A mapped file's pages count in the reader's RSS once touched (see loader.tar).
                    unmapped = release_pages(buf, unmapped, ends[i])
            yield sample
        if expected_size is not None and size != expected_size:
            raise CorruptShard(f"size mismatch: read {size} bytes, the manifest says {expected_size}", url=url)
        if hasher is not None and expected_xxh3_128 is not None:
            if behind is not None:
                digest = behind.digest()
            else:
                if size > hashed:
                    hasher.update(view[hashed:size])
                digest = hasher.hexdigest()
            if digest != expected_xxh3_128.lower():
                raise CorruptShard(
                    f"checksum mismatch: xxh3_128 is {digest}, the manifest says {expected_xxh3_128}", url=url
                )
    finally:
        if behind is not None:
            behind.cancel()  # a read abandoned early: the thread stops reading the mapping first
        if not zero_copy:
            view.release()
        if owned:
            with contextlib.suppress(BufferError):  # a caller still holds a view: the GC unmaps it
                buf.close()  # type: ignore[union-attr]


class IndexRegistry:
    """Member tables by file identity, least recently used dropped first past ``budget`` bytes.
    Thread-safe; a forked child keeps its parent's tables (they describe files, not sockets)."""

    def __init__(self, budget: int = DEFAULT_BUDGET_BYTES) -> None:
        self.budget = budget
        self._lock = threading.Lock()
        self._tables: OrderedDict[FileIdentity, TarIndex] = OrderedDict()
        self._bytes = 0

    def get(self, identity: FileIdentity) -> TarIndex | None:
        with self._lock:
            index = self._tables.get(identity)
            if index is not None:
                self._tables.move_to_end(identity)
            return index

    def put(self, identity: FileIdentity, index: TarIndex) -> None:
        with self._lock:
            old = self._tables.pop(identity, None)
            if old is not None:
                self._bytes -= old.nbytes
            if index.nbytes > self.budget:
                return
            self._tables[identity] = index
            self._bytes += index.nbytes
            while self._bytes > self.budget:
                _, dropped = self._tables.popitem(last=False)
                self._bytes -= dropped.nbytes

    def forget(self, identity: FileIdentity) -> None:
        with self._lock:
            old = self._tables.pop(identity, None)
            if old is not None:
                self._bytes -= old.nbytes

    def __len__(self) -> int:
        return len(self._tables)

    @property
    def nbytes(self) -> int:
        return self._bytes


INDEXES = IndexRegistry()
"""This process's member tables (what :class:`~loader.ShardLoader` reads warm shards by)."""
