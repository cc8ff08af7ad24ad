"""A shard's member index: where each sample of a tar shard lies, and a checksum of each.

``shardcache index --members`` writes one per shard, as ``<shard key>.members.json`` next to it,
and pins it in the manifest (the shard entry's ``members_xxh3_128``: the index file's xxh3-128).
A reader with the index reads any sample of a shard by itself (one ranged read of its bytes,
checked against its own checksum) and resumes a shard at any sample without reading the ones
before it.

The document (JSON, one sample per line)::

    {"__kind__": "shardcache-members-v1",
     "shard": {"key": "train-000000.tar", "size": 10240, "xxh3_128": "<32 hex>"},
     "layouts": [["cls", "jpg"]],
     "samples": [
      ["000000", 0, 4608, "<16 hex>", 512, 3, 1536, 2900],
      ...]}

Each sample is ``[key, layout, end, xxh3_64, offset, size, offset, size, ...]``: its fields are
``layouts[layout]`` in that order, each with the offset and size of its data in the shard. A
sample's bytes are ``[end of the sample before (0 for the first), end)``: its headers, data and
padding, and anything between it and the sample before; ``xxh3_64`` is their checksum. What
follows the last sample (the end-of-archive blocks) belongs to no sample.

Nothing here is trusted: :func:`parse_members` checks the document's shape, bounds and order
(each member inside its sample, samples in order inside the shard), and a reader uses an index
only when the manifest pins its checksum and it names the shard's size and checksum; every
sample read by it is checked against its ``xxh3_64``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from wire.dataset import json_object
from wire.errors import ManifestError

__all__ = ["MEMBERS_KIND", "MEMBERS_SUFFIX", "MAX_MEMBERS_BYTES", "MemberTable", "members_key", "parse_members",
           "members_bytes"]

MEMBERS_KIND = "shardcache-members-v1"
MEMBERS_SUFFIX = ".members.json"
MAX_MEMBERS_BYTES = 256 << 20
"""The largest member index read: about 2.5 million samples."""

_MAX_FIELD = 256
_MAX_KEY = 4096
_HEX = re.compile("[0-9a-fA-F]+")


def members_key(shard_key: str) -> str:
    """Where a shard's member index lies: next to it."""
    return shard_key + MEMBERS_SUFFIX


@dataclass(frozen=True)
class MemberTable:
    """One shard's samples: sample ``i`` is ``keys[i]`` with the fields ``layouts[layout_of[i]]``,
    whose data are ``offsets[first[i] + k]``/``sizes[first[i] + k]``; its bytes end at ``ends[i]``
    and their xxh3-64 is ``digests[i]``."""

    shard_key: str
    size: int
    xxh3_128: str
    keys: list[str]
    layouts: tuple[tuple[str, ...], ...]
    layout_of: list[int]
    ends: list[int]
    digests: list[int]
    first: list[int]
    offsets: list[int]
    sizes: list[int]

    @property
    def samples(self) -> int:
        return len(self.keys)

    def start(self, i: int) -> int:
        return self.ends[i - 1] if i else 0


_MAX_INT = (1 << 63) - 1  # the largest file offset (the tables keep them as int64)


def _int(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= _MAX_INT:
        raise ManifestError(f"{where} must be an integer from 0 to 2**63-1, not {repr(value)[:40]}")
    return value


def _hex(value: Any, digits: int, where: str) -> str:
    if not isinstance(value, str) or len(value) != digits or _HEX.fullmatch(value) is None:
        raise ManifestError(f"{where} must be {digits} hex digits")
    return value.lower()


def parse_members(data: bytes, where: str) -> MemberTable:
    """A member index document, checked; every problem is one :class:`~wire.errors.ManifestError`
    naming where it is (a reader then reads the shard whole instead)."""
    doc = json_object(data, where, "__kind__, shard, layouts and samples", MAX_MEMBERS_BYTES)
    if doc.get("__kind__") != MEMBERS_KIND:
        raise ManifestError(f"{where}: not a member index ({MEMBERS_KIND}); rebuild it with `shardcache index --members`")
    shard = doc.get("shard")
    if not isinstance(shard, dict):
        raise ManifestError(f"{where}: 'shard' must be an object with key, size and xxh3_128")
    key = shard.get("key")
    if not isinstance(key, str) or not key:
        raise ManifestError(f"{where}: shard.key must be a non-empty string")
    size = _int(shard.get("size"), f"{where}: shard.size")
    xxh3_128 = _hex(shard.get("xxh3_128"), 32, f"{where}: shard.xxh3_128")
    raw_layouts = doc.get("layouts")
    if not isinstance(raw_layouts, list):
        raise ManifestError(f"{where}: 'layouts' must be a list of lists of field names")
    layouts: list[tuple[str, ...]] = []
    for n, layout in enumerate(raw_layouts):
        if not isinstance(layout, list) or not layout or not all(
            isinstance(f, str) and 0 < len(f) <= _MAX_FIELD for f in layout
        ):
            raise ManifestError(f"{where}: layouts[{n}] must be a non-empty list of field names")
        if len(set(layout)) != len(layout):
            raise ManifestError(f"{where}: layouts[{n}] names a field twice")
        layouts.append(tuple(layout))
    raw_samples = doc.get("samples")
    if not isinstance(raw_samples, list):
        raise ManifestError(f"{where}: 'samples' must be a list")
    keys: list[str] = []
    layout_of: list[int] = []
    ends: list[int] = []
    digests: list[int] = []
    first: list[int] = []
    offsets: list[int] = []
    sizes: list[int] = []
    previous = 0
    for i, sample in enumerate(raw_samples):
        at = f"{where}: samples[{i}]"
        if not isinstance(sample, list) or len(sample) < 6:
            raise ManifestError(f"{at} must be [key, layout, end, xxh3_64, offset, size, ...]")
        name, layout, end, digest = sample[0], sample[1], sample[2], sample[3]
        if not isinstance(name, str) or not 0 < len(name) <= _MAX_KEY:
            raise ManifestError(f"{at}: the key must be a non-empty string")
        layout = _int(layout, f"{at}: layout")
        if layout >= len(layouts):
            raise ManifestError(f"{at}: layout {layout} is not in 'layouts'")
        fields = layouts[layout]
        if len(sample) != 4 + 2 * len(fields):
            raise ManifestError(f"{at}: layout {layout} has {len(fields)} fields, the sample gives {(len(sample) - 4) / 2:g}")
        end = _int(end, f"{at}: end")
        if not previous < end <= size:
            raise ManifestError(f"{at}: ends at {end}, outside ({previous}, {size}]")
        first.append(len(offsets))
        for k in range(len(fields)):
            offset = _int(sample[4 + 2 * k], f"{at}: offset of {fields[k]!r}")
            length = _int(sample[5 + 2 * k], f"{at}: size of {fields[k]!r}")
            if offset < previous or offset + length > end:
                raise ManifestError(f"{at}: member {fields[k]!r} at {offset}+{length} lies outside its sample [{previous}, {end})")
            offsets.append(offset)
            sizes.append(length)
        keys.append(name)
        layout_of.append(layout)
        ends.append(end)
        digests.append(int(_hex(digest, 16, f"{at}: xxh3_64"), 16))
        previous = end
    return MemberTable(key, size, xxh3_128, keys, tuple(layouts), layout_of, ends, digests, first, offsets, sizes)


def members_bytes(table: MemberTable) -> bytes:
    """The document of ``table`` (one sample per line: diffable, still plain JSON)."""
    head = {"__kind__": MEMBERS_KIND, "shard": {"key": table.shard_key, "size": table.size, "xxh3_128": table.xxh3_128},
            "layouts": [list(layout) for layout in table.layouts]}
    lines = []
    for i, key in enumerate(table.keys):
        row: list[Any] = [key, table.layout_of[i], table.ends[i], f"{table.digests[i]:016x}"]
        m = table.first[i]
        for k in range(len(table.layouts[table.layout_of[i]])):
            row += [table.offsets[m + k], table.sizes[m + k]]
        lines.append(json.dumps(row, separators=(",", ":")))
    text = json.dumps(head)[:-1] + ', "samples": [' + ("\n " + ",\n ".join(lines) + "\n" if lines else "") + "]}\n"
    return text.encode()
