"""Samples by index: sample ``i`` of a dataset of tar shards, read through the node cache.

The dataset is a prefix (its ``manifest.json``, else a listing) or an index at a prefix named by
its URL (``s3://bucket/train/shardindex.json``): a manifest, or webdataset's ``wids`` shard index
(``wids-shard-index-v1``), so a dataset indexed by either tool works with both.

:class:`ShardIndex` is the framework-neutral half of map-style datasets (``loader.torch``'s
``ShardMapDataset``, a ``tf.data`` pipeline of indices): ``len()`` is the dataset's sample count,
from the per-shard counts its manifest keeps (``shardcache index`` writes them), and
``sample(i)`` is sample ``i`` with the fields the streaming loader yields
(``{"__key__", "__url__", field: bytes, ...}``), in the dataset's order (shards sorted, samples
in tar order).

How a sample is found: ``i`` names a shard (a bisection of the cumulative counts) and a sample in
it. The shard is opened once through the source the streaming loader uses (the node cache's
descriptor when it serves one, the local file, else the bytes), read and checked whole the first
time (size, checksum, sample count: what the manifest says), and its member table
(:class:`~loader.tarindex.TarIndex`: each sample's members, offset and size) kept; every sample of
it is then a slice of the mapping, no header parsed, in any order. Open shards are kept per
process, least recently used dropped past ``max_open_shards``; the tables by file identity in the
process's registry (:data:`~loader.tarindex.INDEXES`), so a shard opened again by the same file
costs no parse.

:meth:`ShardIndex.samples` reads a batch of indices grouped by shard: a sampler's batch that falls
in a few shards costs a few opens, not one per sample.

A cold sample by itself: when the manifest pins the shard's member index (``shardcache index
--members``: each sample's byte range and xxh3-64, :mod:`loader.members`), a shard not yet open
is read by ranges, the batch's samples of it in as few ranged reads as their places allow
(:data:`SPAN_GAP_BYTES`, :data:`SPAN_MAX_BYTES`), each sample checked against its own checksum.
Through the node cache such a read of a shard it does not hold is answered from the origin by
range while the cache fills the shard behind it when it has room (``shardcache serve
--direct-range-bytes``); once an answer says the shard is cached whole, the shard is opened and
mapped as above. Without a member index a cold shard is read whole first, as webdataset's
``wids`` does. A sample whose bytes fail their checksum is read again by opening its shard whole
(with the cache's recheck), never returned.
"""

from __future__ import annotations

import bisect
import concurrent.futures
import contextlib
import logging
import mmap
import os
import threading
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, replace
from itertools import accumulate
from typing import Any

from loader.dataset import DatasetURL, Shard, parse_dataset_url, parse_index
from loader.errors import ConfigError, CorruptShard, DatasetNotFound, ManifestError
from loader.heap import keep_freed_heap
from loader.members import load_members, sample_bytes_ok
from loader.settings import LoaderSettings
from loader.sources import Reader, Source, make_source, resolve_shards
from loader.tar import MemberLog, iter_samples
from loader.tarindex import INDEXES, TarIndex, file_identity

__all__ = ["ShardIndex"]

log = logging.getLogger(__name__)

DEFAULT_OPEN_SHARDS = 64
"""Shards a process keeps open (mapped, or in memory when the source gives no file)."""

SPAN_GAP_BYTES = 256 << 10
"""Samples of one shard in a batch whose byte ranges lie closer than this are read by one range
(the bytes between are read and dropped: cheaper than another request's latency)."""

SPAN_MAX_BYTES = 8 << 20
"""The longest range read for a batch (the node cache answers a cold range up to its
``--direct-range-bytes``, 8 MiB by default, from the origin without waiting for its fill)."""

RANGE_READERS = 16
"""Ranged reads a process has in flight at once for one batch (each waits one origin round trip)."""


_PROCESS = [os.getpid()]
"""This process's id, kept current in forked children: the warm path compares it without a
system call per sample."""
if hasattr(os, "register_at_fork"):  # where there is no fork, no child to tell
    os.register_at_fork(after_in_child=lambda: _PROCESS.__setitem__(0, os.getpid()))


@dataclass
class _Open:
    shard: Shard
    buf: Any  # mmap.mmap of the shard's file, or its bytes
    table: TarIndex
    reader: Reader | None
    url: str  # the shard's URL, each sample's __url__ (made once, not per sample)


class ShardIndex:
    """Sample ``i`` of the dataset at ``url`` (``s3://bucket/prefix/`` or ``file:///...``).

    ``endpoint``: the node cache's URL (default ``SHARDCACHE_ENDPOINT``; ``""`` reads the origin
    directly); ``settings``: a :class:`~loader.settings.LoaderSettings` (default: from the
    environment); ``max_open_shards``: shards kept open by each process; ``by_range``: read a
    cold shard's samples by ranges when the manifest pins its member index (False: open every
    shard whole first, as without one).

    Picklable (DataLoader workers, ``tf.data``): a copy opens its own source and shards."""

    def __init__(
        self,
        url: str,
        *,
        endpoint: str | None = None,
        settings: LoaderSettings | None = None,
        max_open_shards: int = DEFAULT_OPEN_SHARDS,
        by_range: bool = True,
    ) -> None:
        base = settings if settings is not None else LoaderSettings.from_env()
        self.settings = replace(base, endpoint=endpoint) if endpoint is not None else base
        # A URL naming a .json is an index at the dataset's prefix: a manifest, or a wids index.
        prefix, _, name = url.rpartition("/")
        self.index_name = name if name.endswith(".json") else None
        self.location: DatasetURL = parse_dataset_url(prefix + "/" if self.index_name else url)
        if max_open_shards < 1:
            raise ConfigError(f"max_open_shards must be at least 1, not {max_open_shards}")
        self.max_open_shards = max_open_shards
        self.by_range = by_range
        self._pid = os.getpid()
        self._source: Source | None = None
        self._open: OrderedDict[int, _Open] = OrderedDict()
        self._lock = threading.Lock()
        self._in_place: set[int] = set()  # shards a ranged read found cached whole: open them next time
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self.shards: list[Shard] = self._resolve()
        missing = [s.key for s in self.shards if s.samples is None]
        if missing:
            raise ManifestError(
                f"{self.location.url}: {len(missing)} shard(s) without a sample count ({missing[0]}, ...): samples by "
                "index need the count of every shard; write the manifest with `shardcache index` (it counts them)"
            )
        self._ends = list(accumulate(s.samples or 0 for s in self.shards))

    def _resolve(self) -> list[Shard]:
        source = self._get_source()
        if self.index_name is None:
            return resolve_shards(source)
        where = self.location.object_url(self.index_name)
        data = source.read_manifest(self.index_name)
        if data is None:
            raise DatasetNotFound(f"{where}: no such index (write one with `shardcache index --wids NAME`)")
        return parse_index(data, where, self.location)

    # -- pickling: a copy in another process opens its own --

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_source"] = None
        state["_open"] = OrderedDict()
        state["_lock"] = None
        state["_pool"] = None
        state["_in_place"] = set()
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def _get_source(self) -> Source:
        if self._source is None or self._pid != os.getpid():
            # A forked child (a DataLoader worker) must not share its parent's sockets or mappings'
            # bookkeeping, nor a lock a parent's thread may have held at the fork.
            self._pid = os.getpid()
            self._lock = threading.Lock()
            self._open = OrderedDict()
            self._pool = None
            self._in_place = set()
            keep_freed_heap(self.settings.heap_trim_threshold_bytes)
            self._source = make_source(self.location, self.settings)
        return self._source

    # -- lookups --

    def __len__(self) -> int:
        return self._ends[-1] if self._ends else 0

    def locate(self, i: int) -> tuple[Shard, int]:
        """The shard holding sample ``i`` and the sample's position in it (negative ``i`` counts
        from the end, as a sequence's)."""
        n = len(self)
        if type(i) is int and 0 <= i < n:  # the common case, checked in one step
            s = bisect.bisect_right(self._ends, i)
            return self.shards[s], i - (self._ends[s - 1] if s else 0)
        if isinstance(i, bool) or not isinstance(i, int):
            raise TypeError(f"sample indices are integers, not {type(i).__name__}")
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"sample {i} is out of range: the dataset has {n} samples")
        s = bisect.bisect_right(self._ends, i)
        return self.shards[s], i - (self._ends[s - 1] if s else 0)

    def sample(self, i: int) -> dict[str, Any]:
        shard, j = self.locate(i)
        # A warm sample takes 9-14 us, most of it the copy: the lookup takes no lock (one dict
        # read is atomic under the GIL), no system call (the process id is kept at fork), and
        # marks the shard used only as a hint (a close on another thread may have dropped it
        # meanwhile; its mapping stays valid while held). 95-103k samples/s before, 111-115k
        # after (110 KB samples, local file, this VM).
        opened = self._open.get(shard.index)
        if opened is not None and self._pid == _PROCESS[0]:
            try:
                self._open.move_to_end(shard.index)
            except KeyError:
                pass
            return self._read(opened, j)
        if opened is None:
            ranged = self._ranged([(shard, [j])]).get(shard.index)
            if ranged is not None:
                return ranged[j]
        return self._read(self._shard(shard), j)

    def samples(self, indices: Iterable[int]) -> list[dict[str, Any]]:
        """Samples ``indices``, in that order: each shard opened once for the batch, or the
        batch's samples of a cold shard read by ranges (several shards' at once)."""
        located = [self.locate(i) for i in indices]
        by_shard: dict[int, list[int]] = {}
        for n, (shard, _) in enumerate(located):
            by_shard.setdefault(shard.index, []).append(n)
        out: list[dict[str, Any]] = [{} for _ in located]
        with self._lock:
            cold = [located[positions[0]][0] for index, positions in by_shard.items() if index not in self._open]
        ranged: dict[int, dict[int, dict[str, Any]]] = {}
        if cold:
            ranged = self._ranged([(shard, [located[n][1] for n in by_shard[shard.index]]) for shard in cold])
            whole = [shard for shard in cold if shard.index not in ranged]
            if len(whole) > 1:
                # The batch's other shards fill while the first is read (the daemon's prefetch
                # hints; nothing for a local file). Only this batch's: a random reader never asks
                # the cache for more than it is about to read.
                self._get_source().prefetch(whole[1:])
        for index, positions in by_shard.items():
            got = ranged.get(index)
            if got is not None:
                for n in positions:
                    out[n] = got[located[n][1]]
                continue
            opened = self._shard(located[positions[0]][0])
            for n in positions:
                out[n] = self._read(opened, located[n][1])
        return out

    # -- cold samples by range --

    def _ranged_table(self, shard: Shard) -> TarIndex | None:
        """The member index to read ``shard`` by ranges, or None: read it whole (a local file, a
        shard a ranged read found cached, a dataset without member indexes)."""
        source = self._get_source()
        if not self.by_range or source.via == "file" or shard.members is None or shard.index in self._in_place:
            return None
        return load_members(source, shard, self.location.object_url(shard.key))

    def _ranged(self, wanted: list[tuple[Shard, list[int]]]) -> dict[int, dict[int, dict[str, Any]]]:
        """Samples ``js`` of each shard not open, by ranged reads checked against its member
        index, every range of the batch in flight at once (:data:`RANGE_READERS`), by shard index;
        a shard without a member index is left out (the caller opens it whole)."""
        url_of = self.location.object_url
        plans: list[tuple[Shard, TarIndex, list[int]]] = []
        for shard, js in wanted:
            table = self._ranged_table(shard)
            if table is None or table.digests is None:
                continue
            chosen = sorted(set(js))
            if chosen[-1] >= table.samples:
                raise CorruptShard(f"has {table.samples} samples, sample {chosen[-1]} was asked for", url=url_of(shard.key))
            spans: list[list[int]] = [[chosen[0]]]
            for j in chosen[1:]:
                first = spans[-1][0]
                if (table.start(j) - table.ends[spans[-1][-1]] <= SPAN_GAP_BYTES
                        and table.ends[j] - table.start(first) <= SPAN_MAX_BYTES):
                    spans[-1].append(j)
                else:
                    spans.append([j])
            plans += [(shard, table, span) for span in spans]
        if not plans:
            return {}
        source = self._get_source()

        def read(plan: tuple[Shard, TarIndex, list[int]]) -> tuple[bytes, bool]:
            shard, table, span = plan
            return source.read_range(shard, table.start(span[0]), table.ends[span[-1]])

        out: dict[int, dict[int, dict[str, Any]]] = {}
        bad: dict[int, tuple[Shard, list[int]]] = {}
        for (shard, table, span), (data, in_place) in zip(plans, self._map(read, plans), strict=True):
            if in_place:
                self._in_place.add(shard.index)
            url = url_of(shard.key)
            base = table.start(span[0])
            view = memoryview(data)
            got = out.setdefault(shard.index, {})
            for j in span:
                if not sample_bytes_ok(table, j, view[table.start(j) - base : table.ends[j] - base]):
                    bad.setdefault(shard.index, (shard, []))[1].append(j)
                    continue
                got[j] = table.sample(j, view if self.settings.zero_copy else data, url, base)
        for shard, js in bad.values():
            log.warning("%s: sample %d read by range does not match its checksum; opening the shard whole",
                        url_of(shard.key), js[0])
            opened = self._shard(shard)
            for j in js:
                out[shard.index][j] = self._read(opened, j)
        return out

    def _map(self, fn: Any, items: list[Any]) -> list[Any]:
        if len(items) == 1:
            return [fn(items[0])]
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(RANGE_READERS, thread_name_prefix="shardcache-ranges")
        return list(self._pool.map(fn, items))

    def close(self) -> None:
        with self._lock:
            opened, self._open = list(self._open.values()), OrderedDict()
        for item in opened:
            _close(item)
        if self._pool is not None and self._pid == os.getpid():
            self._pool.shutdown(wait=False)
        self._pool = None
        if self._source is not None and self._pid == os.getpid():
            self._source.close()
        self._source = None

    # -- shards --

    def _shard(self, shard: Shard) -> _Open:
        source = self._get_source()
        with self._lock:
            found = self._open.get(shard.index)
            if found is not None:
                self._open.move_to_end(shard.index)
                return found
        opened = self._load(source, shard)
        dropped: list[_Open] = []
        with self._lock:
            raced = self._open.get(shard.index)
            if raced is not None:  # another thread opened it meanwhile: keep one
                dropped.append(opened)
                opened = raced
            else:
                self._open[shard.index] = opened
            while len(self._open) > self.max_open_shards:
                dropped.append(self._open.popitem(last=False)[1])
        for item in dropped:
            _close(item)
        return opened

    def _load(self, source: Source, shard: Shard) -> _Open:
        """Open ``shard``, check it whole the first time this process sees its file, and map it."""
        url = self.location.object_url(shard.key)
        for attempt in range(2):
            reader = source.open(shard, recheck=attempt > 0)
            try:
                return self._check(reader, shard, url)
            except CorruptShard as exc:
                reader.close()
                if attempt:
                    raise
                # As the streaming loader does: a cache in between re-hashes its copy on a recheck.
                log.warning("%s; reading it again", exc)
            except BaseException:
                reader.close()
                raise
        raise AssertionError("unreachable")

    def _check(self, reader: Reader, shard: Shard, url: str) -> _Open:
        verify = self.settings.verify
        identity = file_identity(reader)
        if identity is not None:
            fd = reader.fileno()  # type: ignore[attr-defined]
            buf: Any = mmap.mmap(fd, 0, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
            table = INDEXES.get(identity)
            if table is not None and (table.checked_xxh3_128 == shard.xxh3_128 or not verify):
                _random_access(buf)
                return _Open(shard, buf, table, reader, url)
        else:
            buf = _read_all(reader)
            reader.close()
            reader = None  # type: ignore[assignment]
        members = MemberLog()
        count = 0
        expected_xxh3_128 = shard.xxh3_128 if verify else None
        for _ in iter_samples(buf, url=url, max_member_bytes=self.settings.max_member_bytes,
                              expected_size=shard.size if verify else None,
                              expected_xxh3_128=expected_xxh3_128, map_files=False, log=members):
            count += 1
        if shard.samples is not None and count != shard.samples:
            raise CorruptShard(f"holds {count} samples, the manifest says {shard.samples}", url=url)
        table = TarIndex.from_log(members, len(buf))
        if table is None:
            why = ("it holds a sparse member (tar --sparse), whose bytes are not a slice of the shard: write it "
                   "without --sparse (webdataset's writers never make one)") if not members.sliced else (
                  "its members could not be indexed")
            raise CorruptShard(f"cannot be read by sample index: {why}", url=url)
        table = replace(table, checked_xxh3_128=expected_xxh3_128)
        if identity is not None:
            INDEXES.put(identity, table)
            # Only now: the whole read above wants the kernel's read-ahead. (Advised before it, a
            # fresh shard the cache wrote past the page cache, --direct-writes, was read a page
            # per fault: 0.69 s for 64 MiB after a 0.24 s fill, measured.)
            _random_access(buf)
        return _Open(shard, buf, table, reader, url)

    def _read(self, opened: _Open, j: int) -> dict[str, Any]:
        table, buf = opened.table, opened.buf
        if j >= table.samples:
            raise CorruptShard(f"has {table.samples} samples, sample {j} was asked for", url=opened.url)
        # zero_copy (LoaderSettings): views of the mapping, as the streaming loader yields them;
        # else bytes (slices of a mapping or of bytes are), which a caller may keep after the
        # shard is closed.
        data = memoryview(buf) if self.settings.zero_copy and isinstance(buf, mmap.mmap) else buf
        return table.sample(j, data, opened.url)

    def __repr__(self) -> str:
        return f"ShardIndex({self.location.url!r}, {len(self)} samples in {len(self.shards)} shards)"


def _random_access(buf: mmap.mmap) -> None:
    """A sample at a time, anywhere: no read-ahead around each fault."""
    with contextlib.suppress(AttributeError, OSError):
        buf.madvise(mmap.MADV_RANDOM)


def _read_all(reader: Reader) -> bytes:
    parts: list[bytes] = []
    while True:
        chunk = reader.read(1 << 20)
        if not chunk:
            return b"".join(parts)
        parts.append(chunk)


def _close(item: _Open) -> None:
    if isinstance(item.buf, mmap.mmap):
        with contextlib.suppress(BufferError):  # a sample's view still held: the GC unmaps it
            item.buf.close()
    if item.reader is not None:
        with contextlib.suppress(OSError):
            item.reader.close()

