"""What a job is: its validated spec (the shard list and the settings every trainer agrees on).

A spec never changes once accepted: two creations with equal specs are the same job. Every rule
about what a spec may hold lives here; the state machine (``state.py``) only reads specs.

The shard list is held in columns (:class:`ShardTable`), not as a million Python objects: the
keys' UTF-8 bytes in one blob, less the prefix and suffix every key shares (a dataset's keys
mostly differ in a counter: ``train/shard-000123.tar`` keeps ``000123``), their end offsets,
and sizes and sample counts in the narrowest integer array that holds them (-1: unknown). A
1,000,000-shard list of such keys takes 16 MB this way, where a tuple of frozen dataclasses took
208 MB (its JSON text as well, 73 MB, where it now keeps 11 MB compressed). :class:`ShardSpec` objects are built on demand by ``spec.shards[i]``.

The spec's canonical JSON text (journal records and snapshots splice it, ``json_text``) is kept
compressed for large specs (~11 MB for 1M shards; ISA-L inflates it in ~0.1 s) and plain for
small ones. Create bodies are parsed straight into the columns by
:mod:`loader.master.server.spec_stream`; ``JobSpec.from_json`` validates an already decoded dict
with the same rules and messages.
"""

from __future__ import annotations

import hashlib
import json
import math
from array import array
from bisect import bisect_right
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import accumulate
from json.encoder import encode_basestring_ascii
from operator import itemgetter
from typing import Any, overload

from isal import isal_zlib

from loader.master.errors import BadRequest
from loader.master.protocol import SPEC_FIELDS
from wire.names import ID_RULE, is_id

__all__ = [
    "ShardSpec",
    "ShardTable",
    "TableBuilder",
    "JobSpec",
    "read_log_spec",
    "spec_diff",
    "validate_job_name",
    "check_ident",
    "check_int",
    "check_opt_int",
    "check_head",
    "check_tail",
    "check_shard",
    "shard_key_error",
    "shard_shape_error",
    "duplicate_key_error",
    "shards_type_error",
    "too_many_shards_error",
    "unknown_fields_error",
    "MAX_INT",
    "MAX_KEY",
    "SPEC_FIELDS",
    "MAX_LOCALITY_WINDOW",
]

MAX_INT = 2**63 - 1
MAX_KEY = 1024
"""Longest shard key, in characters."""
_MAX_IDENT = 256
MAX_LOCALITY_WINDOW = 65_536
"""Largest ``locality_window``: how far ahead of the seeded order a lease may look for a shard
local to the trainer's node (each epoch holds at most this many positions in its index)."""
_SHARD_FIELDS = frozenset({"key", "size", "samples"})
# Below this many shards the spec's JSON text is kept as it is; above, compressed (a 1M-shard
# text is ~70 MB, compressed ~11 MB).
_PLAIN_TEXT_SHARDS = 4096
_TEXT_BLOCK = 8192
_SP = "surrogatepass"  # keys are str; a lone surrogate (legal in a Python str) must round-trip
# A logged shard list is decoded this many characters at a time (~3,000 shards): a few MB of
# dicts at once, where the whole list decoded at once was ~600 MB for 1M shards.
_LOG_BLOCK_CHARS = 1 << 18
_DECODER = json.JSONDecoder()


def validate_job_name(name: Any) -> str:
    if not is_id(name):
        raise BadRequest(f"invalid job name {str(name)[:80]!r}: use {ID_RULE}")
    return name


def check_ident(value: Any, what: str) -> str:
    if not isinstance(value, str) or not value or len(value) > _MAX_IDENT or not value.isprintable():
        raise BadRequest(f"'{what}' must be a non-empty printable string of at most {_MAX_IDENT} characters")
    return value


def check_int(value: Any, what: str, lo: int = 0, hi: int = MAX_INT) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise BadRequest(f"'{what}' must be an integer in [{lo}, {hi}], got {str(value)[:40]!r}")
    return value


def check_opt_int(value: Any, what: str, lo: int = 0, hi: int = MAX_INT) -> int | None:
    return None if value is None else check_int(value, what, lo, hi)


def shard_key_error(i: int) -> BadRequest:
    return BadRequest(f"shards[{i}].key must be a non-empty string of at most {MAX_KEY} characters")


def shard_shape_error(i: int) -> BadRequest:
    return BadRequest(f"shards[{i}] must be an object with 'key' and optional 'size', 'samples'")


def duplicate_key_error(i: int, key: str) -> BadRequest:
    return BadRequest(f"shards[{i}].key {key[:80]!r} appears twice")


def shards_type_error() -> BadRequest:
    return BadRequest("'shards' must be a non-empty list of {\"key\", \"size\", \"samples\"}")


def too_many_shards_error(count: int, max_shards: int) -> BadRequest:
    return BadRequest(f"too many shards ({count}): this master accepts at most {max_shards} per job")


def unknown_fields_error(unknown: Iterable[str]) -> BadRequest:
    return BadRequest(f"unknown job spec field(s) {sorted(unknown)}: expected some of {sorted(SPEC_FIELDS)}")


# -- one shard -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ShardSpec:
    key: str
    """Object key relative to the job's dataset URL."""
    size: int | None = None
    """Bytes, when known."""
    samples: int | None = None
    """Samples in the shard, when known (bounds the offsets a renew may report)."""

    def to_json(self) -> dict[str, Any]:
        return {"key": self.key, "size": self.size, "samples": self.samples}


# -- the shard list, in columns ----------------------------------------------------------------


def _narrow(values: array) -> array:
    """The same integers (all >= -1) in the smallest signed array type that holds them: sizes of
    ~1e8 fit 4 bytes, sample counts of ~1000 fit 2. Deterministic, so equal lists stay equal."""
    if not values:
        return array("b")
    top = max(values)
    for code, limit in (("b", 2**7), ("h", 2**15), ("i", 2**31)):
        if top < limit and array(code).itemsize < values.itemsize:
            return array(code, values)
    return values


def _ends_array(ends: Iterable[int], blob_len: int) -> array:
    return array("I" if blob_len < 2**32 else "Q", ends)


class ShardTable(Sequence[ShardSpec]):
    """A job's shard list in columns (see the module docstring); an immutable sequence of
    :class:`ShardSpec` built on demand. Equal lists give equal columns, compared at C speed."""

    __slots__ = ("_prefix", "_suffix", "_blob", "_ends", "_sizes", "_samples", "_sha256", "_ascii")

    def __init__(self, prefix: bytes, suffix: bytes, blob: bytes, ends: array, sizes: array, samples: array) -> None:
        if not len(ends) == len(sizes) == len(samples):
            raise ValueError("shard columns of different lengths")
        self._prefix, self._suffix, self._blob = prefix, suffix, blob
        self._ends, self._sizes, self._samples = ends, sizes, samples
        self._sha256: str | None = None
        self._ascii = prefix.isascii() and suffix.isascii() and blob.isascii()

    @classmethod
    def of(cls, shards: Iterable[ShardSpec | tuple[str, int | None, int | None]]) -> ShardTable:
        """A table of already validated shards (no checks: a spec's own constructor, the log)."""
        builder = TableBuilder(dedupe=False)
        for item in shards:
            if isinstance(item, ShardSpec):
                builder.add(item.key, item.size, item.samples)
            else:
                builder.add(*item)
        return builder.build()

    # -- the sequence --

    def __len__(self) -> int:
        return len(self._ends)

    @overload
    def __getitem__(self, i: int) -> ShardSpec: ...

    @overload
    def __getitem__(self, i: slice) -> tuple[ShardSpec, ...]: ...

    def __getitem__(self, i: int | slice) -> ShardSpec | tuple[ShardSpec, ...]:
        if isinstance(i, slice):
            return tuple(self[j] for j in range(*i.indices(len(self))))
        n = len(self._ends)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"shard {i} out of range (the job has {n})")
        size, samples = self._sizes[i], self._samples[i]
        return ShardSpec(self.key(i), None if size < 0 else size, None if samples < 0 else samples)

    def __iter__(self) -> Iterator[ShardSpec]:
        for i in range(len(self._ends)):
            yield self[i]

    def key(self, i: int) -> str:
        start = self._ends[i - 1] if i else 0
        return (self._prefix + self._blob[start : self._ends[i]] + self._suffix).decode("utf-8", _SP)

    def size(self, i: int) -> int | None:
        value = self._sizes[i]
        return None if value < 0 else value

    def samples(self, i: int) -> int | None:
        value = self._samples[i]
        return None if value < 0 else value

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if isinstance(other, ShardTable):
            return (
                self._blob == other._blob and self._prefix == other._prefix and self._suffix == other._suffix
                and self._ends == other._ends and self._sizes == other._sizes and self._samples == other._samples
            )
        if isinstance(other, (tuple, list)):
            return len(other) == len(self) and all(a == b for a, b in zip(self, other, strict=True))
        return NotImplemented

    def __hash__(self) -> int:
        return hash((len(self._ends), self._prefix, self._suffix, self._blob))

    def __repr__(self) -> str:
        head = ", ".join(repr(s) for s in self[:3])
        return f"ShardTable({len(self)} shards: {head}{', ...' if len(self) > 3 else ''})"

    @property
    def nbytes(self) -> int:
        """Bytes the columns take (what the shard list costs in memory, less object headers)."""
        arrays = (self._ends, self._sizes, self._samples)
        return len(self._blob) + len(self._prefix) + len(self._suffix) + sum(a.itemsize * len(a) for a in arrays)

    # -- canonical JSON --

    def json_chunks(self) -> Iterator[str]:
        """The shard list as compact JSON (``json.dumps([s.to_json() ...], separators=(",", ":"))``),
        in pieces of a few thousand shards, so that a large list never exists as one string."""
        n = len(self._ends)
        ends, sizes, samples = self._ends, self._sizes, self._samples
        esc = encode_basestring_ascii
        yield "["
        for block in range(0, n, _TEXT_BLOCK):
            last = min(n, block + _TEXT_BLOCK)
            base = ends[block - 1] if block else 0
            parts = []
            if self._ascii:
                # One decode per block; byte offsets are character offsets in ASCII.
                pre, suf = self._prefix.decode("ascii"), self._suffix.decode("ascii")
                text = self._blob[base : ends[last - 1]].decode("ascii")
                start = 0
                for i in range(block, last):
                    end = ends[i] - base
                    size, count = sizes[i], samples[i]
                    parts.append(
                        f'{{"key":{esc(pre + text[start:end] + suf)},"size":{"null" if size < 0 else size},'
                        f'"samples":{"null" if count < 0 else count}}}'
                    )
                    start = end
            else:
                for i in range(block, last):
                    size, count = sizes[i], samples[i]
                    parts.append(
                        f'{{"key":{esc(self.key(i))},"size":{"null" if size < 0 else size},'
                        f'"samples":{"null" if count < 0 else count}}}'
                    )
            yield ("," if block else "") + ",".join(parts)
        yield "]"

    @property
    def sha256(self) -> str:
        """SHA-256 (hex) of :meth:`json_chunks`: what a client compares with the shard list it
        would send, to join a job without sending it (``summary()["shards_sha256"]``)."""
        if self._sha256 is None:
            digest = hashlib.sha256()
            for chunk in self.json_chunks():
                digest.update(chunk.encode("ascii"))
            self._sha256 = digest.hexdigest()
        return self._sha256

    def _note_sha256(self, value: str) -> None:
        self._sha256 = value


class TableBuilder:
    """Collects shards into columns, in blocks: the per-key work (encoding, hashing, finding the
    shared prefix and suffix) runs over each block of keys in C (``map``, ``min``/``max``,
    ``str.join``), a few hundred nanoseconds a shard less than a Python loop.

    :meth:`add` takes shards already validated but for uniqueness; with ``dedupe``,
    :meth:`first_duplicate` says which key first repeats an earlier one. Duplicates are found by
    the keys' hashes (a set of ints, ~64 bytes a shard while building, not the ~130 of a set of
    the keys); a repeated hash is checked against the keys themselves."""

    __slots__ = ("keys", "sizes", "samples", "_blob", "_ends", "_sizes", "_samples", "_prefix", "_suffix", "_min_len",
                 "_hashes", "_dup", "_count")

    BLOCK = 4096

    def __init__(self, *, dedupe: bool) -> None:
        self.keys: list[str] = []
        """The pending block (appended to directly by hot loops, then :meth:`flush`)."""
        self.sizes: list[int] = []
        """Pending sizes, -1 for unknown."""
        self.samples: list[int] = []
        """Pending sample counts, -1 for unknown."""
        self._blob = bytearray()
        self._ends = array("Q")
        self._sizes = array("q")
        self._samples = array("q")
        self._prefix: str | None = None
        self._suffix = ""
        self._min_len = 0
        self._hashes: set[int] | None = set() if dedupe else None
        self._dup: tuple[int, str] | None = None
        self._count = 0

    def __len__(self) -> int:
        return self._count + len(self.keys)

    def add(self, key: str, size: int | None, samples: int | None) -> None:
        self.keys.append(key)
        self.sizes.append(-1 if size is None else size)
        self.samples.append(-1 if samples is None else samples)
        if len(self.keys) >= self.BLOCK:
            self.flush()

    def first_duplicate(self) -> tuple[int, str] | None:
        """(index, key) of the first shard whose key an earlier shard has (with ``dedupe``)."""
        return self.flush()

    def duplicate_error(self, i: int, exc: BadRequest) -> BadRequest:
        """The error to answer when shard ``i`` is bad (``exc``): a repeated key before it (or
        at it: its key was added) is reported first, as a one-pass check would have."""
        dup = self.first_duplicate()
        return duplicate_key_error(*dup) if dup is not None and dup[0] <= i else exc

    def flush(self) -> tuple[int, str] | None:
        """Move the pending block into the columns; returns :meth:`first_duplicate` so far."""
        keys = self.keys
        if not keys or self._dup is not None:
            keys.clear()
            self.sizes.clear()
            self.samples.clear()
            return self._dup
        base = self._count
        hashes = self._hashes
        if hashes is not None:
            block = list(map(hash, keys))
            if hashes.isdisjoint(block) and len(set(block)) == len(block):
                hashes.update(block)
            else:
                self._dup = self._find_duplicate(keys, block, base)
                if self._dup is not None:
                    return self.flush()
        text = "".join(keys)
        data = text.encode("utf-8", _SP)
        if len(data) == len(text):  # ASCII: a key's bytes are its characters
            lengths: Iterable[int] = map(len, keys)
            shortest = min(map(len, keys))
        else:
            byte_lengths = [len(k.encode("utf-8", _SP)) for k in keys]
            lengths, shortest = byte_lengths, min(byte_lengths)
        offsets = accumulate(lengths, initial=len(self._blob))
        next(offsets)
        self._blob += data
        self._ends.extend(offsets)
        self._sizes.extend(self.sizes)
        self._samples.extend(self.samples)
        # The prefix every key shares is that of the least and the greatest; the suffix, that of
        # the least and greatest reversed keys.
        lo, hi = min(keys), max(keys)
        block_prefix = lo[: _common_len(lo, hi)]
        backwards = list(map(_REVERSED, keys))
        rlo, rhi = min(backwards), max(backwards)
        block_suffix = rlo[: _common_len(rlo, rhi)][::-1]
        if self._prefix is None:
            self._prefix, self._suffix, self._min_len = block_prefix, block_suffix, shortest
        else:
            self._prefix = self._prefix[: _common_len(self._prefix, block_prefix)]
            self._suffix = _common_suffix(self._suffix, block_suffix)
            self._min_len = min(self._min_len, shortest)
        self._count += len(keys)
        keys.clear()
        self.sizes.clear()
        self.samples.clear()
        return None

    def _find_duplicate(self, keys: list[str], block: list[int], base: int) -> tuple[int, str] | None:
        """The slow path of a repeated hash: which key (if any) really repeats an earlier one."""
        hashes = self._hashes
        assert hashes is not None
        mine: dict[int, list[str]] = {}
        for j, (key, h) in enumerate(zip(keys, block, strict=True)):
            if key in mine.get(h, ()) or (h in hashes and self._contains(key.encode("utf-8", _SP))):
                return base + j, key
            mine.setdefault(h, []).append(key)
        hashes.update(block)  # hash collisions only: no key repeats
        return None

    def _contains(self, data: bytes) -> bool:
        blob, ends = self._blob, self._ends
        pos = blob.find(data)
        while pos != -1:
            j = bisect_right(ends, pos)
            start = ends[j - 1] if j else 0
            if start == pos and j < len(ends) and ends[j] - pos == len(data):
                return True
            pos = blob.find(data, pos + 1)
        return False

    def extend_from(self, table: ShardTable, count: int) -> None:
        """Append the first ``count`` shards of ``table`` (a parse that matched a job's list so far)."""
        for i in range(count):
            self.add(table.key(i), table.size(i), table.samples(i))

    def build(self) -> ShardTable:
        """The table; the builder is spent (its buffers are released as it goes)."""
        if self.first_duplicate() is not None:
            raise ValueError("the shard list repeats a key: check first_duplicate() before build()")
        self._hashes = None  # first: the largest transient, not needed to build
        prefix = (self._prefix or "").encode("utf-8", _SP)
        suffix_full = self._suffix.encode("utf-8", _SP)
        p = len(prefix)
        q = max(0, min(len(suffix_full), self._min_len - p))
        suffix = suffix_full[len(suffix_full) - q :] if q else b""
        blob, ends = self._blob, self._ends
        self._blob, self._ends = bytearray(), array("Q")
        if p or q:
            # Strip what every key shares: one pass, the stripped copy built next to the original.
            stripped = bytearray()
            out_ends = array("I" if len(blob) < 2**32 else "Q")
            view = memoryview(blob)
            start = 0
            for end in ends:
                stripped += view[start + p : end - q]
                out_ends.append(len(stripped))
                start = end
            view.release()
            del blob, ends
            final_blob = bytes(stripped)
            del stripped
        else:
            final_blob = bytes(blob)
            out_ends = _ends_array(ends, len(final_blob))
        return ShardTable(prefix, suffix, final_blob, out_ends, _narrow(self._sizes), _narrow(self._samples))


_REVERSED = itemgetter(slice(None, None, -1))


def _common_len(a: str, b: str) -> int:
    """Length of the longest common prefix of ``a`` and ``b`` (bisected with C comparisons)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _common_suffix(a: str, b: str) -> str:
    n = _common_len(a[::-1], b[::-1])
    return a[len(a) - n :] if n else ""


# -- validation of a decoded spec ------------------------------------------------------------


def _bad_count(value: Any) -> bool:
    """Not a valid size or sample count (None, or an int in [0, MAX_INT])."""
    return value is not None and (isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_INT)


def check_shard(i: int, item: Any) -> tuple[str, int | None, int | None]:
    """One entry of ``shards`` (a dict or a bare key string), validated; uniqueness is the
    builder's."""
    if isinstance(item, str):
        item = {"key": item}
    if not isinstance(item, dict) or set(item) - _SHARD_FIELDS:
        raise shard_shape_error(i)
    key = item.get("key")
    if not isinstance(key, str) or not key or len(key) > MAX_KEY or "\x00" in key:
        raise shard_key_error(i)
    return key, item.get("size"), item.get("samples")


def check_head(raw: dict[str, Any]) -> tuple[str, str]:
    """``name`` and ``dataset`` of a decoded spec, checked first (before the shard list)."""
    name = validate_job_name(raw.get("name"))
    dataset = raw.get("dataset")
    if not isinstance(dataset, str) or not dataset or len(dataset) > 4096 or "\x00" in dataset:
        raise BadRequest("'dataset' must be the dataset URL, e.g. s3://bucket/train/")
    return name, dataset


def check_tail(
    name: str, dataset: str, raw: dict[str, Any], shards: ShardTable, *, default_ttl_s: float, default_max_failures: int
) -> JobSpec:
    """The spec from its checked head and shard list and the other fields of ``raw``, checked
    after the shard list, in the order (and with the messages) they always were."""
    epochs = check_opt_int(raw.get("epochs"), "epochs", 1, 1_000_000_000)
    seed = check_int(raw.get("seed", 0), "seed", -MAX_INT, MAX_INT)
    shuffle = raw.get("shuffle", True)
    if not isinstance(shuffle, bool):
        raise BadRequest("'shuffle' must be true or false")
    ttl = raw.get("lease_ttl_s", default_ttl_s)
    if ttl is None:
        ttl = default_ttl_s
    if isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not math.isfinite(ttl) or not 1 <= ttl <= 86400:
        raise BadRequest("'lease_ttl_s' must be a number of seconds in [1, 86400]")
    max_failures = raw.get("max_failures", default_max_failures)
    if max_failures is None:
        max_failures = default_max_failures
    max_failures = check_int(max_failures, "max_failures", 1, 1_000_000)
    window = raw.get("locality_window", 0)
    window = check_int(0 if window is None else window, "locality_window", 0, MAX_LOCALITY_WINDOW)
    return JobSpec(name, dataset, shards, epochs, seed, shuffle, float(ttl), max_failures, window)


# -- the spec --------------------------------------------------------------------------------


@dataclass(frozen=True)
class JobSpec:
    """What a job is; two creations with equal specs are the same job (idempotent create)."""

    name: str
    dataset: str
    shards: Sequence[ShardSpec]
    """A :class:`ShardTable` (a tuple of :class:`ShardSpec` given to the constructor becomes one)."""
    epochs: int | None = None
    """Epochs to run; None runs until stopped."""
    seed: int = 0
    shuffle: bool = True
    lease_ttl_s: float = 30.0
    max_failures: int = 3
    locality_window: int = 0
    """Positions of the epoch's seeded order a lease looks ahead for a shard on the trainer's node
    (0: the plain seeded order). Written into the spec's JSON only when set, so the text (and the
    journal) of a job without it is what it always was."""
    _cache: dict[str, Any] = field(default_factory=dict, init=False, repr=False, compare=False, hash=False)
    """The canonical JSON text, plain ("text") or compressed ("z"), made once."""

    def __post_init__(self) -> None:
        if not isinstance(self.shards, ShardTable):
            object.__setattr__(self, "shards", ShardTable.of(self.shards))

    @property
    def table(self) -> ShardTable:
        assert isinstance(self.shards, ShardTable)
        return self.shards

    @classmethod
    def from_json(
        cls, raw: Any, *, default_ttl_s: float = 30.0, default_max_failures: int = 3, max_shards: int = 1_000_000
    ) -> JobSpec:
        """Validate a decoded create-job body; every problem is a :class:`BadRequest` naming the
        field. (The server parses bodies with :mod:`~loader.master.server.spec_stream` instead,
        with the same rules and messages, without decoding the shard list into objects.)"""
        if not isinstance(raw, dict):
            raise BadRequest("the job spec must be a JSON object")
        unknown = set(raw) - SPEC_FIELDS
        if unknown:
            raise unknown_fields_error(unknown)
        name, dataset = check_head(raw)
        shards_raw = raw.get("shards")
        if not isinstance(shards_raw, list) or not shards_raw:
            raise shards_type_error()
        if len(shards_raw) > max_shards:
            raise too_many_shards_error(len(shards_raw), max_shards)
        builder = TableBuilder(dedupe=True)
        for i, item in enumerate(shards_raw):
            try:
                key, size, samples = check_shard(i, item)
            except BadRequest as exc:
                raise builder.duplicate_error(i, exc) from None
            if _bad_count(size) or _bad_count(samples):
                builder.add(key, None, None)  # its key still counts for a repeat before its error
            else:
                builder.add(key, size, samples)
            try:
                check_opt_int(size, f"shards[{i}].size")
                check_opt_int(samples, f"shards[{i}].samples")
            except BadRequest as exc:
                raise builder.duplicate_error(i, exc) from None
        dup = builder.first_duplicate()
        if dup is not None:
            raise duplicate_key_error(*dup)
        return check_tail(
            name, dataset, raw, builder.build(), default_ttl_s=default_ttl_s, default_max_failures=default_max_failures
        )

    def _tail(self) -> dict[str, Any]:
        """The fields after the shard list, in their logged order (``locality_window`` only when set)."""
        tail: dict[str, Any] = {"epochs": self.epochs, "seed": self.seed, "shuffle": self.shuffle,
                                "lease_ttl_s": self.lease_ttl_s, "max_failures": self.max_failures}
        if self.locality_window:
            tail["locality_window"] = self.locality_window
        return tail

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "dataset": self.dataset, "shards": [s.to_json() for s in self.shards], **self._tail()}

    def _text_parts(self) -> tuple[str, str]:
        head = '{"name":' + json.dumps(self.name) + ',"dataset":' + json.dumps(self.dataset) + ',"shards":'
        rest = json.dumps(self._tail(), separators=(",", ":"))
        return head, "," + rest[1:]

    def encode(self) -> None:
        """Make the canonical JSON text (and the shard list's digest) now: a large spec's takes
        ~1 s per million shards, so callers do it off the event loop, once."""
        if self._cache:
            return
        table = self.table
        head, tail = self._text_parts()
        digest = hashlib.sha256()
        if len(table) <= _PLAIN_TEXT_SHARDS:
            body = "".join(table.json_chunks())
            digest.update(body.encode("ascii"))
            self._cache["text"] = head + body + tail
        else:
            # Level 1: 6.5x smaller, ~0.1 s per 70 MB with ISA-L; higher levels gain little.
            packer = isal_zlib.compressobj(1)
            out = [packer.compress(head.encode("ascii"))]
            for chunk in table.json_chunks():
                data = chunk.encode("ascii")
                digest.update(data)
                out.append(packer.compress(data))
            out.append(packer.compress(tail.encode("ascii")))
            out.append(packer.flush())
            self._cache["z"] = b"".join(out)
        table._note_sha256(digest.hexdigest())

    @property
    def json_text(self) -> str:
        """The spec as compact JSON (``json.dumps(self.to_json(), separators=(",", ":"))``), for
        journal records and snapshots: kept compressed when large (inflating 1M shards' text
        takes ~0.1 s), made once."""
        self.encode()
        text = self._cache.get("text")
        if text is not None:
            return str(text)
        return isal_zlib.decompress(self._cache["z"]).decode("ascii")

    def summary(self) -> dict[str, Any]:
        """The spec without its shard list (status answers stay small): ``shards`` is the count,
        ``shards_sha256`` the digest of the list's canonical JSON."""
        return {
            "name": self.name,
            "dataset": self.dataset,
            "shards": len(self.shards),
            "epochs": self.epochs,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "lease_ttl_s": self.lease_ttl_s,
            "max_failures": self.max_failures,
            "locality_window": self.locality_window,
            "shards_sha256": self.table.sha256,
        }

    @classmethod
    def from_log_text(cls, text: str) -> JobSpec:
        """:meth:`from_log` of the spec's JSON text (:attr:`json_text`), read in place; see
        :func:`read_log_spec`."""
        spec, end = read_log_spec(text)
        if end != len(text):
            raise ValueError("trailing text after the job spec")
        return spec

    @classmethod
    def from_log(cls, s: dict[str, Any]) -> JobSpec:
        """A spec from the journal or a snapshot: it was validated when it was accepted, so it is
        rebuilt as it was, without defaults applied again. Its text is made now (replay runs
        before serving), not at the first snapshot."""
        table = ShardTable.of((x["key"], x["size"], x["samples"]) for x in s["shards"])
        spec = cls(s["name"], s["dataset"], table, s["epochs"], s["seed"], s["shuffle"], float(s["lease_ttl_s"]),
                   s["max_failures"], int(s.get("locality_window") or 0))
        spec.encode()
        return spec


def read_log_spec(text: str, pos: int = 0) -> tuple[JobSpec, int]:
    """The spec whose JSON text, as :attr:`JobSpec.json_text` writes it, starts at ``text[pos]``
    (in a journal record or a snapshot), and the index just after it.

    The text is read in place: the fields one by one, the shard list a block at a time into the
    columns, never a dict per shard. Like :meth:`JobSpec.from_log` (what the log holds was
    validated when it was accepted) nothing is checked again or defaulted. ValueError for text
    not laid out as ``json_text`` lays it out (the caller decodes it whole instead)."""
    i = _expect(text, pos, '{"name":')
    name, i = _DECODER.raw_decode(text, i)
    dataset, i = _DECODER.raw_decode(text, _expect(text, i, ',"dataset":'))
    table, i = _read_log_shards(text, _expect(text, i, ',"shards":['))
    epochs, i = _DECODER.raw_decode(text, _expect(text, i, ',"epochs":'))
    seed, i = _DECODER.raw_decode(text, _expect(text, i, ',"seed":'))
    shuffle, i = _DECODER.raw_decode(text, _expect(text, i, ',"shuffle":'))
    ttl, i = _DECODER.raw_decode(text, _expect(text, i, ',"lease_ttl_s":'))
    max_failures, i = _DECODER.raw_decode(text, _expect(text, i, ',"max_failures":'))
    window = 0
    if text.startswith(',"locality_window":', i):  # written only when set
        window, i = _DECODER.raw_decode(text, i + len(',"locality_window":'))
    end = _expect(text, i, "}")
    if not isinstance(name, str) or not isinstance(dataset, str) or not isinstance(shuffle, bool):
        raise ValueError("not a logged job spec")
    spec = JobSpec(name, dataset, table, epochs, seed, shuffle, float(ttl), max_failures, int(window))
    spec.encode()  # as from_log: made now, before serving, not at the first snapshot
    return spec, end


def _read_log_shards(text: str, i: int) -> tuple[ShardTable, int]:
    """The shard list starting at ``text[i]`` (just after its ``[``) and the index after its ``]``.

    Its end is the first ``],"epochs":`` from there: in JSON text a ``"`` inside a string is
    always escaped, so that sequence is never part of a key, and nothing else in a spec's list
    puts a ``]`` before a ``,"``. Blocks end between two shards (``},{"key":``, structural for
    the same reason)."""
    close = text.find('],"epochs":', i)
    if close < 0:
        raise ValueError("not a logged shard list")
    builder = TableBuilder(dedupe=False)
    keys, sizes, samples = builder.keys, builder.sizes, builder.samples
    while i < close:
        cut = text.find('},{"key":', min(i + _LOG_BLOCK_CHARS, close), close)
        last = close if cut < 0 else cut + 1
        block = json.loads("[" + text[i:last] + "]")
        keys.extend([item["key"] for item in block])
        sizes.extend([-1 if item["size"] is None else item["size"] for item in block])
        samples.extend([-1 if item["samples"] is None else item["samples"] for item in block])
        del block
        builder.flush()
        i = last + 1  # past the comma between two shards, or onto the list's `]`
    return builder.build(), close + 1


def _expect(text: str, i: int, literal: str) -> int:
    """The index after ``literal``, which must be at ``text[i]`` (ValueError otherwise)."""
    if not text.startswith(literal, i):
        raise ValueError(f"expected {literal!r} at {i}")
    return i + len(literal)


_DIFF_FIELDS = ("name", "dataset", "shards", "epochs", "seed", "shuffle", "lease_ttl_s", "max_failures", "locality_window")


def spec_diff(a: JobSpec, b: JobSpec) -> list[str]:
    """The fields in which two specs differ (sorted), without expanding their shard lists."""
    return sorted(k for k in _DIFF_FIELDS if getattr(a, k) != getattr(b, k))
