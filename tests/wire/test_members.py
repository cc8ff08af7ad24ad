"""wire.members: the member index document. Every hostile document is one ManifestError naming
what is wrong, never another exception; what ``shardcache index --members`` writes reads back as
the same table, for shards tarfile writes in each of its formats (long names, PAX headers) and
for the empty shard."""

from __future__ import annotations

import io
import json
import re
import tarfile
from typing import Any

import pytest
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loader.members import index_shard
from wire import members as wire_members
from wire.errors import ManifestError
from wire.members import MEMBERS_KIND, MemberTable, members_bytes, members_key, parse_members

WHERE = "s3://b/train/s.tar.members.json"


def valid_doc() -> dict[str, Any]:
    """Two samples of two layouts in a 6144-byte shard, every bound met."""
    return {
        "__kind__": MEMBERS_KIND,
        "shard": {"key": "s.tar", "size": 6144, "xxh3_128": "0123456789abcdef" * 2},
        "layouts": [["cls", "jpg"], ["txt"]],
        "samples": [
            ["000000", 0, 2560, "00000000000000ff", 512, 3, 1536, 900],
            ["000001", 1, 4096, "ABCDEF0123456789", 3072, 10],
        ],
    }


def encode(doc: Any) -> bytes:
    return json.dumps(doc).encode()


def mutated(path: tuple[Any, ...], value: Any) -> bytes:
    """The valid document with the value at ``path`` replaced (or deleted, for ``...``)."""
    doc = valid_doc()
    target = doc
    for step in path[:-1]:
        target = target[step]
    if value is ...:
        del target[path[-1]]
    else:
        target[path[-1]] = value
    return encode(doc)


def test_the_valid_document_parses() -> None:
    table = parse_members(encode(valid_doc()), WHERE)
    assert table.samples == 2 and table.shard_key == "s.tar" and table.size == 6144
    assert table.layouts == (("cls", "jpg"), ("txt",))
    assert table.digests == [0xFF, 0xABCDEF0123456789]
    assert table.xxh3_128 == "0123456789abcdef" * 2
    assert (table.start(0), table.start(1)) == (0, 2560)
    assert members_key("dir/s.tar") == "dir/s.tar.members.json"


BAD_NUMBERS = [-1, True, False, 1.5, 2.0, "10", None, [1], {"n": 1}, 1 << 63, 10**30]
BAD_DIGITS_16 = ["0" * 15, "0" * 17, "", "zz" * 8, "+abcdef012345678", " 123456789abcdef", "1_23456789abcdef",
                 "0x3456789abcdef0", "-123456789abcdef", "１２３４５６７８９０１２３４５６", 255, None]

HOSTILE: list[tuple[str, bytes, str]] = [
    ("not JSON", b"{not json", "not valid JSON"),
    ("empty", b"", "not valid JSON"),
    ("not UTF-8", b'{"__kind__": "\xff\xfe"}', "not valid JSON"),
    ("digits past the interpreter's limit", b'{"shard": {"size": ' + b"9" * 5000 + b"}}", "not valid JSON"),
    ("deeply nested", b"[" * 100_000 + b"]" * 100_000, "not valid JSON"),
    ("deeply nested inside", mutated(("shard",), None).replace(b"null", b"[" * 100_000 + b"]" * 100_000),
     "not valid JSON"),
    ("a list", b"[1, 2]", "must be a JSON object"),
    ("a string", b'"shardcache-members-v1"', "must be a JSON object"),
    ("no kind", mutated(("__kind__",), ...), "not a member index"),
    ("another kind", mutated(("__kind__",), "shardcache-members-v2"), "not a member index"),
    ("a manifest", b'{"version": 1, "format": "webdataset", "shards": []}', "not a member index"),
    ("no shard", mutated(("shard",), ...), "'shard' must be an object"),
    ("shard a list", mutated(("shard",), ["s.tar", 1, "0" * 32]), "'shard' must be an object"),
    ("shard key empty", mutated(("shard", "key"), ""), "shard.key"),
    ("shard key a number", mutated(("shard", "key"), 7), "shard.key"),
    ("shard key missing", mutated(("shard", "key"), ...), "shard.key"),
    *[(f"shard size {v!r}", mutated(("shard", "size"), v), "shard.size") for v in BAD_NUMBERS],
    ("shard size inf", mutated(("shard", "size"), 1).replace(b'"size": 1', b'"size": 1e400'), "shard.size"),
    ("shard size NaN", mutated(("shard", "size"), 1).replace(b'"size": 1', b'"size": NaN'), "shard.size"),
    *[(f"shard xxh3_128 {v!r}", mutated(("shard", "xxh3_128"), v), "shard.xxh3_128")
      for v in ["0" * 31, "0" * 33, "g" * 32, "+" + "0" * 31, " " + "0" * 31, "1_" + "0" * 30, 5]],
    ("layouts missing", mutated(("layouts",), ...), "'layouts' must be a list"),
    ("layouts an object", mutated(("layouts",), {"0": ["jpg"]}), "'layouts' must be a list"),
    ("a layout empty", mutated(("layouts", 1), []), "layouts[1] must be a non-empty list"),
    ("a layout a string", mutated(("layouts", 1), "txt"), "layouts[1] must be a non-empty list"),
    ("a field empty", mutated(("layouts", 1), [""]), "layouts[1] must be a non-empty list"),
    ("a field too long", mutated(("layouts", 1), ["x" * 257]), "layouts[1] must be a non-empty list"),
    ("a field a number", mutated(("layouts", 1), [3]), "layouts[1] must be a non-empty list"),
    ("a field named twice", mutated(("layouts", 0), ["jpg", "jpg"]), "layouts[0] names a field twice"),
    ("samples missing", mutated(("samples",), ...), "'samples' must be a list"),
    ("samples an object", mutated(("samples",), {}), "'samples' must be a list"),
    ("a sample an object", mutated(("samples", 0), {"key": "000000"}), "samples[0] must be [key"),
    ("a sample too short", mutated(("samples", 1), ["000001", 1, 4096, "0" * 16, 3072]), "samples[1] must be [key"),
    ("a key empty", mutated(("samples", 0, 0), ""), "samples[0]: the key must be a non-empty string"),
    ("a key too long", mutated(("samples", 0, 0), "k" * 4097), "samples[0]: the key must be a non-empty string"),
    ("a key a number", mutated(("samples", 0, 0), 0), "samples[0]: the key must be a non-empty string"),
    ("a key null", mutated(("samples", 1, 0), None), "samples[1]: the key must be a non-empty string"),
    ("a layout out of range", mutated(("samples", 1, 1), 2), "samples[1]: layout 2 is not in 'layouts'"),
    ("a layout far out of range", mutated(("samples", 1, 1), 1 << 62), "is not in 'layouts'"),
    *[(f"a layout {v!r}", mutated(("samples", 1, 1), v), "samples[1]: layout") for v in BAD_NUMBERS],
    ("a field missing", mutated(("samples", 0), ["000000", 0, 2560, "0" * 16, 512, 3]),
     "layout 0 has 2 fields, the sample gives 1"),
    ("a field too many", mutated(("samples", 1), ["000001", 1, 4096, "0" * 16, 3072, 10, 3584, 1]),
     "layout 1 has 1 fields, the sample gives 2"),
    ("half a field", mutated(("samples", 1), ["000001", 1, 4096, "0" * 16, 3072, 10, 3584]),
     "the sample gives 1.5"),
    *[(f"an end {v!r}", mutated(("samples", 1, 2), v), "samples[1]: end") for v in BAD_NUMBERS],
    ("an end at the one before", mutated(("samples", 1, 2), 2560), "ends at 2560, outside (2560, 6144]"),
    ("an end before the one before", mutated(("samples", 1, 2), 1024), "ends at 1024, outside (2560, 6144]"),
    ("an end zero", mutated(("samples", 0, 2), 0), "samples[0]: ends at 0, outside (0, 6144]"),
    ("an end beyond the shard", mutated(("samples", 1, 2), 6145), "ends at 6145, outside (2560, 6144]"),
    *[(f"an offset {v!r}", mutated(("samples", 0, 4), v), "samples[0]: offset of 'cls'") for v in BAD_NUMBERS],
    *[(f"a size {v!r}", mutated(("samples", 0, 7), v), "samples[0]: size of 'jpg'") for v in BAD_NUMBERS],
    ("a member before its sample", mutated(("samples", 1, 4), 2048),
     "samples[1]: member 'txt' at 2048+10 lies outside its sample [2560, 4096)"),
    ("a member past its sample", mutated(("samples", 1, 5), 1025), "member 'txt' at 3072+1025 lies outside"),
    ("a member past the shard", mutated(("samples", 0, 7), 1 << 62), "lies outside its sample [0, 2560)"),
    *[(f"a digest {v!r}", mutated(("samples", 1, 3), v), "samples[1]: xxh3_64 must be 16 hex digits")
      for v in BAD_DIGITS_16],
]


@pytest.mark.parametrize(("data", "needle"), [(data, needle) for _, data, needle in HOSTILE],
                         ids=[name for name, _, _ in HOSTILE])
def test_a_hostile_document_is_one_clear_manifest_error(data: bytes, needle: str) -> None:
    with pytest.raises(ManifestError) as raised:
        parse_members(data, WHERE)
    message = str(raised.value)
    assert message.startswith(WHERE + ":"), message
    assert needle in message, message
    assert len(message) < 400, message  # a huge value is not echoed whole


def test_a_document_over_the_bound_is_refused_before_it_is_parsed(monkeypatch: pytest.MonkeyPatch) -> None:
    data = encode(valid_doc())
    monkeypatch.setattr(wire_members, "MAX_MEMBERS_BYTES", len(data) - 1)
    with pytest.raises(ManifestError, match="larger than"):
        parse_members(data, WHERE)
    monkeypatch.setattr(wire_members, "MAX_MEMBERS_BYTES", len(data))
    assert parse_members(data, WHERE).samples == 2


def test_the_bound_holds_what_a_real_index_needs() -> None:
    # ~2.5 million samples of two fields fit; a document just past the bound is refused unread.
    assert wire_members.MAX_MEMBERS_BYTES == 256 << 20
    with pytest.raises(ManifestError, match="larger than"):
        parse_members(b" " * (wire_members.MAX_MEMBERS_BYTES + 1), WHERE)


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(1 << 70), max_value=1 << 70)
    | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


def _paths(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    found = [prefix] if prefix else []
    if isinstance(value, dict):
        for key, item in value.items():
            found += _paths(item, (*prefix, key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            found += _paths(item, (*prefix, i))
    return found


PATHS = _paths(valid_doc())


@settings(max_examples=400, deadline=None)
@given(st.sampled_from(PATHS), JSON_VALUES)
def test_any_value_anywhere_parses_or_is_a_manifest_error(path: tuple[Any, ...], value: Any) -> None:
    data = mutated(path, value)
    try:
        table = parse_members(data, WHERE)
    except ManifestError as exc:
        assert str(exc).startswith(WHERE + ":")
        return
    # Accepted: then every bound holds.
    previous = 0
    for i in range(table.samples):
        assert previous < table.ends[i] <= table.size
        for k in range(len(table.layouts[table.layout_of[i]])):
            offset, size = table.offsets[table.first[i] + k], table.sizes[table.first[i] + k]
            assert previous <= offset and offset + size <= table.ends[i]
        assert 0 <= table.digests[i] < 1 << 64
        previous = table.ends[i]


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_any_byte_flipped_parses_or_is_a_manifest_error(data: st.DataObject) -> None:
    raw = bytearray(encode(valid_doc()))
    for _ in range(data.draw(st.integers(1, 4))):
        raw[data.draw(st.integers(0, len(raw) - 1))] = data.draw(st.integers(0, 255))
    try:
        parse_members(bytes(raw), WHERE)
    except ManifestError:
        pass


# -- round trip on real shards -----------------------------------------------------------------------


def tar_bytes(members: list[tuple[str, bytes]], fmt: int, pax: dict[str, str] | None = None) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=fmt, pax_headers=pax) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mtime = 1_700_000_000
            if fmt == tarfile.PAX_FORMAT:
                info.pax_headers = {"comment": "x" * (len(data) % 300)}
            tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


def check_against_tarfile(data: bytes, table: MemberTable) -> None:
    """The table by an independent reader: every field's bytes are tarfile's member, every
    sample's bytes hash to its digest, and the shard is named by its size and xxh3-128."""
    assert table.size == len(data) and table.xxh3_128 == xxhash.xxh3_128_hexdigest(data)
    expected: list[tuple[str, dict[str, bytes]]] = []
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        for member in tar.getmembers():
            base = member.name.rsplit("/", 1)[-1]
            if not member.isfile() or re.match(r"__[^/]*__($|/)", member.name) or "." not in base[1:] \
                    or base.startswith("."):
                continue
            dot = base.index(".")
            key = member.name[: len(member.name) - len(base) + dot]
            field = base[dot + 1 :].lower()
            handle = tar.extractfile(member)
            assert handle is not None
            if not expected or expected[-1][0] != key:
                expected.append((key, {}))
            expected[-1][1][field] = handle.read()
    assert table.keys == [key for key, _ in expected]
    for i, (_, fields) in enumerate(expected):
        names = table.layouts[table.layout_of[i]]
        assert list(names) == list(fields)
        for k, name in enumerate(names):
            offset, size = table.offsets[table.first[i] + k], table.sizes[table.first[i] + k]
            assert data[offset : offset + size] == fields[name]
        assert xxhash.xxh3_64_intdigest(data[table.start(i) : table.ends[i]]) == table.digests[i]


def round_trip(data: bytes, key: str = "dir/s.tar") -> MemberTable:
    table = index_shard(data, key)
    document = members_bytes(table)
    assert parse_members(document, WHERE) == table
    assert members_bytes(parse_members(document, WHERE)) == document
    check_against_tarfile(data, table)
    return table


@pytest.mark.parametrize("fmt", [tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT],
                         ids=["ustar", "gnu", "pax"])
def test_round_trip_of_a_shard_with_long_names_and_pax_headers(fmt: int) -> None:
    deep = "d" * 90 + "/" + "e" * 60 + "/"  # past ustar's 100-byte name: a prefix, an L header or PAX path
    long_key = deep + ("k" * 120 if fmt != tarfile.USTAR_FORMAT else "k" * 80)
    unicode_key = "images/caf\u00e9-\u00fc" if fmt == tarfile.PAX_FORMAT else "images/cafe"
    members = [
        ("000000.jpg", b"\xff" * 1000), ("000000.cls", b"3"),
        (long_key + ".seg.PNG", b"png" * 400), (long_key + ".json", b"{}"),
        ("__meta__/info.json", b"{}"),  # skipped by the loader: its bytes are in the next sample's span
        ("noext", b"x" * 10),
        (unicode_key + ".txt", b""),  # a zero-byte member
        ("000002.cls", b"1"),
    ]
    pax = {"comment": "a global PAX header"} if fmt == tarfile.PAX_FORMAT else None
    table = round_trip(tar_bytes(members, fmt, pax))
    assert table.samples == 4
    assert table.layouts == (("jpg", "cls"), ("seg.png", "json"), ("txt",), ("cls",))


@pytest.mark.parametrize("fmt", [tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT])
def test_round_trip_of_the_empty_shard(fmt: int) -> None:
    data = tar_bytes([], fmt)
    table = round_trip(data)
    assert table.samples == 0 and table.size == len(data) and table.layouts == ()
    assert parse_members(members_bytes(table), WHERE).samples == 0


SAMPLE = st.tuples(
    st.sampled_from(["", "a/", "x" * 120 + "/"]),  # a directory part (a long one needs an L header or PAX)
    st.lists(st.sampled_from(["jpg", "cls", "json", "seg.png", "TXT"]), min_size=1, max_size=3, unique_by=str.lower),
    st.lists(st.integers(0, 1500), min_size=3, max_size=3),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(SAMPLE, max_size=12), st.sampled_from([tarfile.GNU_FORMAT, tarfile.PAX_FORMAT]), st.integers(0, 255))
def test_round_trip_property(samples: list[Any], fmt: int, fill: int) -> None:
    members = []
    for n, (directory, fields, sizes) in enumerate(samples):
        for field, size in zip(fields, sizes, strict=False):
            members.append((f"{directory}{n:06d}.{field}", bytes([(fill + n) % 256]) * size))
    table = round_trip(tar_bytes(members, fmt))
    assert table.samples == len(samples)
