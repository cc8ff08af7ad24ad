"""The tar reader on what GNU tar writes beyond plain members: sparse files (``--sparse``, in the
gnu format and the three pax variants) and compressed streams (``-z`` and the other compressors).

Every shard here is written by the real ``/usr/bin/tar`` from files that really have holes; the
hostile cases are those shards with their sparse maps edited. Each shard is read every way the
reader has (streamed, in short reads, from a buffer, from a mapped file, zero-copy) and all of
them must give the same samples or the same error.
"""

from __future__ import annotations

import contextlib
import io
import os
import random
import shutil
import subprocess
import tarfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loader import CorruptShard, iter_samples
from loader.tar import MemberLog
from loader.tarindex import TarIndex, iter_indexed

pytestmark = pytest.mark.timeout(120)

TAR = "/usr/bin/tar"
BLOCK = 512
SPARSE_FORMATS = {
    "gnu": ["--format=gnu"],
    "pax-0.0": ["--format=posix", "--sparse-version=0.0"],
    "pax-0.1": ["--format=posix", "--sparse-version=0.1"],
    "pax-1.0": ["--format=posix", "--sparse-version=1.0"],
}
LONG_DIR = "d" * 70 + "/" + "e" * 60  # > 100 characters: a GNU 'L' name or a PAX path


class Trickle:
    """A raw reader returning short reads of random sizes (as sockets do)."""

    def __init__(self, data: bytes, seed: int) -> None:
        self._data = data
        self._pos = 0
        self._rng = random.Random(seed)

    def read(self, n: int = -1) -> bytes:
        size = min(len(self._data) if n < 0 else n, self._rng.randint(1, 1500))
        out = self._data[self._pos : self._pos + size]
        self._pos += len(out)
        return out


def _outcome(read: Callable[[], list[dict[str, Any]]]) -> tuple[str, Any]:
    try:
        samples = read()
    except CorruptShard as exc:
        return "error", (str(exc), exc.position)
    # zero-copy reads give memoryviews: compare contents
    return "samples", [{k: bytes(v) if isinstance(v, memoryview) else v for k, v in s.items()} for s in samples]


def read_every_way(data: bytes, tmp_path: Path, **kwargs: Any) -> list[dict[str, Any]]:
    """The samples of ``data`` read streamed, in short reads, from bytes, from a mapped file and
    zero-copy (mapped and streamed): all must agree, on the samples or on the error and its place."""
    path = tmp_path / "read-every-way.tar"
    path.write_bytes(data)

    def from_file(**extra: Any) -> list[dict[str, Any]]:
        with open(path, "rb", buffering=0) as handle:
            return list(iter_samples(handle, url="mem://x.tar", **kwargs, **extra))

    def indexed(**extra: Any) -> list[dict[str, Any]]:
        # A warm epoch: the member table of a first read (loader.tarindex); where that read
        # could make none (a sparse member, an error), the parse, as ShardLoader does.
        members = MemberLog()
        with contextlib.suppress(CorruptShard), open(path, "rb", buffering=0) as handle:
            for _ in iter_samples(handle, log=members):
                pass
        table = TarIndex.from_log(members, len(data))
        if table is None:
            return from_file(**extra)
        checks = {k: v for k, v in kwargs.items() if k in ("start", "expected_size", "expected_xxh3_128")}
        with open(path, "rb", buffering=0) as handle:
            return list(iter_indexed(handle, table, url="mem://x.tar", **checks, **extra))

    ways: dict[str, Callable[[], list[dict[str, Any]]]] = {
        "file-indexed": indexed,
        "file-indexed-zero-copy": lambda: indexed(zero_copy=True),
        "stream": lambda: list(iter_samples(io.BytesIO(data), url="mem://x.tar", **kwargs)),
        "trickle": lambda: list(iter_samples(Trickle(data, 7), url="mem://x.tar", chunk=4096, **kwargs)),
        "buffer": lambda: list(iter_samples(data, url="mem://x.tar", **kwargs)),
        "file": from_file,
        "file-zero-copy": lambda: from_file(zero_copy=True),
        "stream-zero-copy": lambda: list(iter_samples(io.BytesIO(data), url="mem://x.tar", zero_copy=True, **kwargs)),
    }
    outcomes = {way: _outcome(read) for way, read in ways.items()}
    first = outcomes["stream"]
    for way, outcome in outcomes.items():
        assert outcome == first, f"{way} disagrees with stream"
    kind, value = first
    if kind == "error":
        error = CorruptShard(value[0])  # the message already says where
        error.position = value[1]
        raise error
    return value


def make_sparse(path: Path, size: int, writes: list[tuple[int, bytes]]) -> bytes:
    """A file of ``size`` bytes holding ``writes`` at their offsets and holes elsewhere; returns
    its content as read back (what the shard must give)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as handle:
        handle.truncate(size)
        for offset, data in writes:
            os.pwrite(handle.fileno(), data, offset)
    return path.read_bytes()


def gnu_tar(src: Path, names: list[str], *options: str) -> bytes:
    """``tar -c`` of ``names`` (in that order) under ``src`` with ``options``; the archive bytes."""
    out = src.parent / f"{src.name}.out"
    subprocess.run([TAR, "-C", str(src), "-cf", str(out), *options, *names], check=True, timeout=60, capture_output=True)
    data = out.read_bytes()
    out.unlink()
    return data


def sparse_dataset(src: Path) -> dict[str, bytes]:
    """Normal and sparse members in WebDataset order; name -> content."""
    rng = random.Random(3)
    files: dict[str, bytes] = {}

    def normal(name: str, data: bytes) -> None:
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        (src / name).write_bytes(data)
        files[name] = data

    def sparse(name: str, size: int, writes: list[tuple[int, bytes]]) -> None:
        files[name] = make_sparse(src / name, size, writes)

    normal("0001.jpg", rng.randbytes(3000))
    sparse("0001.bin", 1 << 20, [(4096, b"hello"), (700_000, rng.randbytes(5000))])  # ends in a hole
    normal("0001.cls", b"1")
    # 100 islands: more than the 4 map entries of a gnu header (5 extension headers) and a
    # pax 1.0 map over more than one block
    sparse("0002.img", 100 * 65536, [(i * 65536 + (i % 7) * 100, rng.randbytes(600 + i)) for i in range(100)])
    sparse("0003.bin", 256 * 1024, [(0, rng.randbytes(10_000)), (250_000, rng.randbytes(6144))])  # data at both ends
    sparse("0004.bin", 3 << 20, [])  # nothing but a hole
    normal("0004.txt", b"all hole")
    sparse(f"{LONG_DIR}/0005.bin", 200_000, [(131072, b"long name")])  # a name that needs 'L' / PAX
    normal("0006.jpg", b"")
    # a sparse file whose bytes hold gzip's magic and a tar header's look: data, not structure
    sparse("0007.bin", 100_000, [(0, b"\x1f\x8b\x08" + bytes(509)), (90_112, b"ustar\x0000")])
    skip_without_holes(src / "0004.bin")
    return files


def skip_without_holes(path: Path) -> None:
    """Skip when the file system allocated a file written with holes (GNU tar would archive it
    as a plain member: nothing sparse to test)."""
    info = os.stat(path)
    if info.st_blocks * 512 >= info.st_size:
        pytest.skip(f"the file system under {path.parent} does not keep holes: no sparse file to archive")


def expected_samples(files: dict[str, bytes]) -> list[dict[str, Any]]:
    """WebDataset's grouping of ``files``: key up to the first dot of the base name."""
    samples: list[dict[str, Any]] = []
    for name, data in files.items():
        dot = name.index(".", name.rfind("/") + 1)
        key, field = name[:dot], name[dot + 1 :]
        if not samples or samples[-1]["__key__"] != key:
            samples.append({"__key__": key, "__url__": "mem://x.tar"})
        samples[-1][field] = data
    return samples


def assert_really_sparse(shard: bytes, fmt: str) -> None:
    """The archive holds sparse members in ``fmt``, not plain copies: else the test tests nothing."""
    if fmt == "gnu":
        headers = [shard[i : i + BLOCK] for i in range(0, len(shard), BLOCK)]
        assert any(h[156:157] == b"S" and h[257:265] == b"ustar  \x00" for h in headers), "no GNU 'S' member"
    else:
        marker = {"pax-0.0": b"GNU.sparse.offset=", "pax-0.1": b"GNU.sparse.map=", "pax-1.0": b"GNU.sparse.major=1"}[fmt]
        assert marker in shard, f"no {marker!r} in the archive"


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, bytes], dict[str, bytes]]:
    """The dataset's files and, per format, the shard GNU tar writes of them with ``--sparse``."""
    src = tmp_path_factory.mktemp("sparse") / "src"
    files = sparse_dataset(src)
    written = {fmt: gnu_tar(src, list(files), "--sparse", *options) for fmt, options in SPARSE_FORMATS.items()}
    return files, written


@pytest.mark.parametrize("fmt", list(SPARSE_FORMATS))
@pytest.mark.slow
def test_sparse_members_read_as_the_files_they_stand_for(
    fmt: str, shards: tuple[dict[str, bytes], dict[str, bytes]], tmp_path: Path
) -> None:
    """Holes as zeros, exactly the original bytes, under the real name, next to normal members;
    every read path agrees, and the manifest's size and hash still check the whole shard."""
    files, written = shards
    shard = written[fmt]
    assert_really_sparse(shard, fmt)
    got = read_every_way(shard, tmp_path, expected_size=len(shard), expected_xxh3_128=xxhash.xxh3_128_hexdigest(shard))
    assert [s["__key__"] for s in got] == [s["__key__"] for s in expected_samples(files)]
    assert got == expected_samples(files)
    # and so does the reference reader, on every member's bytes (by position: for 0.1 with a long
    # name, tarfile takes the placeholder ``path`` over GNU.sparse.name)
    with tarfile.open(fileobj=io.BytesIO(shard)) as ref:
        contents = [ref.extractfile(m).read() for m in ref.getmembers() if m.isfile()]  # type: ignore[union-attr]
    assert contents == list(files.values())
    # zero-copy: the sparse members are views as well, like every other member
    path = tmp_path / "shard.tar"
    path.write_bytes(shard)
    with open(path, "rb", buffering=0) as handle:
        views = [v for s in iter_samples(handle, zero_copy=True) for k, v in s.items() if not k.startswith("__")]
    assert len(views) == len(files) and all(isinstance(v, memoryview) for v in views)


@pytest.mark.parametrize("fmt", list(SPARSE_FORMATS))
def test_resuming_skips_sparse_samples(fmt: str, shards: tuple[dict[str, bytes], dict[str, bytes]], tmp_path: Path) -> None:
    files, written = shards
    full = expected_samples(files)
    for start in (1, 2, 4, len(full) - 1, len(full)):
        assert read_every_way(written[fmt], tmp_path, start=start) == full[start:]


@pytest.mark.parametrize("fmt", list(SPARSE_FORMATS))
@pytest.mark.slow
def test_max_member_bytes_applies_to_the_real_size(fmt: str, tmp_path: Path) -> None:
    """A 64 MiB sparse file stores 4 KiB: still refused under a 1 MiB limit, by its name."""
    src = tmp_path / "src"
    make_sparse(src / "0001.bin", 64 << 20, [(1 << 20, b"x" * 4096)])
    skip_without_holes(src / "0001.bin")
    shard = gnu_tar(src, ["0001.bin"], "--sparse", *SPARSE_FORMATS[fmt])
    assert_really_sparse(shard, fmt)
    with pytest.raises(CorruptShard, match=r"'0001\.bin'.*67108864 bytes.*max_member_bytes=1048576"):
        read_every_way(shard, tmp_path, max_member_bytes=1 << 20)
    assert read_every_way(shard, tmp_path, max_member_bytes=64 << 20)[0]["bin"] == (src / "0001.bin").read_bytes()


# --- hostile sparse maps: GNU tar's shards with the map edited --------------------------------


def _rechecksum(block: bytearray) -> None:
    block[148:156] = b"        "
    block[148:156] = b"%06o\x00 " % sum(block)


def _number(value: int) -> bytes:
    """A 12-byte tar number field: octal, or GNU base-256 when it does not fit."""
    if value < 8**11:
        return b"%011o\x00" % value
    return b"\x80" + value.to_bytes(11, "big")


@pytest.fixture(scope="module")
def small_sparse(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    """One sparse member ``0001.bin`` (1 MiB, data at 4 KiB and 696 KiB, 3 map entries with the
    final empty one) then a normal ``0002.jpg``, in each format."""
    src = tmp_path_factory.mktemp("small") / "src"
    make_sparse(src / "0001.bin", 1 << 20, [(4096, b"a" * 4096), (696_320, b"b" * 4096)])
    (src / "0002.jpg").write_bytes(b"jpeg")
    skip_without_holes(src / "0001.bin")
    return {fmt: gnu_tar(src, ["0001.bin", "0002.jpg"], "--sparse", *opts) for fmt, opts in SPARSE_FORMATS.items()}


def _gnu_entries(shard: bytes, entries: list[tuple[int, int]], realsize: int | None = None) -> bytes:
    """The gnu shard with its header's map replaced by ``entries`` (at most 4)."""
    head = bytearray(shard[:BLOCK])
    assert head[156:157] == b"S"
    head[386:482] = b"".join(_number(off) + _number(num) for off, num in entries).ljust(96, b"\x00")
    if realsize is not None:
        head[483:495] = _number(realsize)
    _rechecksum(head)
    return bytes(head) + shard[BLOCK:]


def _pax_records(shard: bytes, edit: Callable[[list[tuple[str, str]]], list[tuple[str, str]]]) -> bytes:
    """The pax shard with the first member's extended records passed through ``edit``."""
    head = shard[:BLOCK]
    assert head[156:157] == b"x"
    size = int(head[124:136].strip(b"\x00 "), 8)
    padded = (size + BLOCK - 1) // BLOCK * BLOCK
    records = []
    for line in shard[BLOCK : BLOCK + size].decode().splitlines():
        _, _, text = line.partition(" ")
        key, _, value = text.partition("=")
        records.append((key, value))
    body = b""
    for key, value in edit(records):
        record = f" {key}={value}\n".encode()
        length = len(record) + len(str(len(record)))
        length = len(record) + len(str(length))
        body += str(length).encode() + record
    new_head = bytearray(head)
    new_head[124:136] = _number(len(body))
    _rechecksum(new_head)
    return bytes(new_head) + body.ljust((len(body) + BLOCK - 1) // BLOCK * BLOCK, b"\x00") + shard[BLOCK + padded :]


def _gnu_extended(shard: bytes, entries: list[tuple[int, int]], cut: bool) -> bytes:
    """The gnu shard with the header's map replaced and an extension header announced; the
    shard ending right there when ``cut``."""
    head = bytearray(_gnu_entries(shard, entries)[:BLOCK])
    head[482] = 1
    _rechecksum(head)
    return bytes(head) + (b"" if cut else shard[BLOCK:])


def _gnu_magic(shard: bytes, magic: bytes) -> bytes:
    """The gnu shard with the sparse member's header magic replaced (POSIX's, say)."""
    head = bytearray(shard[:BLOCK])
    head[257:265] = magic
    _rechecksum(head)
    return bytes(head) + shard[BLOCK:]


def _set(key: str, value: str) -> Callable[[list[tuple[str, str]]], list[tuple[str, str]]]:
    return lambda records: [(k, value if k == key else v) for k, v in records]


def _pax_data_start(shard: bytes) -> int:
    """Where the first member's data begins in a pax shard (after the 'x' record and the header)."""
    size = int(shard[124:136].strip(b"\x00 "), 8)
    return BLOCK + (size + BLOCK - 1) // BLOCK * BLOCK + BLOCK


def _pax10_map(shard: bytes, text: bytes) -> bytes:
    """The pax 1.0 shard with the map block at the start of the first member's data replaced."""
    at = _pax_data_start(shard)
    assert shard[at : at + 2] == b"3\n"
    return shard[:at] + text.ljust(BLOCK, b"\x00")[:BLOCK] + shard[at + BLOCK :]


def _offset_records(pairs: list[tuple[str, str]]) -> Callable[[list[tuple[str, str]]], list[tuple[str, str]]]:
    def edit(records: list[tuple[str, str]]) -> list[tuple[str, str]]:
        kept = [(k, v) for k, v in records if k not in ("GNU.sparse.offset", "GNU.sparse.numbytes")]
        return kept[:2] + pairs + kept[2:]

    return edit


HOSTILE: list[tuple[str, Callable[[bytes], bytes], str]] = [
    # gnu: entries overlapping, out of order, past the real size, not adding up to the stored size
    ("gnu", lambda s: _gnu_entries(s, [(4096, 4096), (6000, 4096), (1 << 20, 0)]), "gnu.*overlap|gnu.*order"),
    ("gnu", lambda s: _gnu_entries(s, [(696_320, 4096), (4096, 4096), (1 << 20, 0)]), "gnu.*overlap|gnu.*order"),
    ("gnu", lambda s: _gnu_entries(s, [(4096, 4096), (696_320, 4096)], realsize=500_000), "gnu.*real size"),
    ("gnu", lambda s: _gnu_entries(s, [(4096, 4096), (696_320, 8192), (1 << 20, 0)]), "gnu.*stored|gnu.*size"),
    ("gnu", lambda s: _gnu_entries(s, [(4096, 4096), (696_320, 4096)], realsize=1 << 44), "max_member_bytes"),
    # gnu: an extension header announced but the shard ends there
    ("gnu", lambda s: _gnu_extended(s, [(4096, 2048), (6144, 2048), (696_320, 4096), (1 << 20, 0)], cut=True), "truncated.*extension header"),
    ("gnu", lambda s: _gnu_extended(s, [(4096, 4096), (696_320, 4096), (1 << 20, 0)], cut=False), "gnu.*after the end of the map"),
    # pax 0.1: the same faults in GNU.sparse.map
    ("pax-0.1", lambda s: _pax_records(s, _set("GNU.sparse.map", "4096,4096,6000,4096,1048576,0")), "0[.]1.*overlap|0[.]1.*order"),
    ("pax-0.1", lambda s: _pax_records(s, _set("GNU.sparse.map", "4096,4096,696320")), "0[.]1.*map"),
    ("pax-0.1", lambda s: _pax_records(s, _set("GNU.sparse.map", "4096,4096,696320,x,1048576,0")), "0[.]1.*map"),
    ("pax-0.1", lambda s: _pax_records(s, _set("GNU.sparse.numblocks", "7")), "0[.]1.*numblocks"),
    ("pax-0.1", lambda s: _pax_records(s, _set("GNU.sparse.size", "99999999999999")), "max_member_bytes"),
    ("pax-0.1", lambda s: _pax_records(s, _set("GNU.sparse.size", "700000")), "0[.]1.*real size"),
    ("pax-0.1", lambda s: _pax_records(s, lambda r: [(k, v) for k, v in r if k != "GNU.sparse.size"]), "0[.]1.*real size"),
    ("pax-0.1", lambda s: _pax_records(s, lambda r: [(k, v) for k, v in r if k != "GNU.sparse.map"]), "unknown version.*without a sparse map"),
    # gnu: an 'S' member in a header that is not GNU's (star lays its map out differently)
    ("gnu", lambda s: _gnu_magic(s, b"ustar\x0000"), "gnu.*GNU header magic"),
    # pax 0.0: repeated keywords out of step
    ("pax-0.0", lambda s: _pax_records(s, _offset_records([("GNU.sparse.offset", "4096"), ("GNU.sparse.offset", "696320"),
                                                           ("GNU.sparse.numbytes", "4096"), ("GNU.sparse.numbytes", "4096"),
                                                           ("GNU.sparse.offset", "1048576"), ("GNU.sparse.numbytes", "0")])), "0[.]0.*offset"),
    ("pax-0.0", lambda s: _pax_records(s, _offset_records([("GNU.sparse.offset", "696320"), ("GNU.sparse.numbytes", "4096"),
                                                           ("GNU.sparse.offset", "4096"), ("GNU.sparse.numbytes", "4096"),
                                                           ("GNU.sparse.offset", "1048576"), ("GNU.sparse.numbytes", "0")])), "0[.]0.*overlap|0[.]0.*order"),
    # pax 1.0: the map in the data block
    ("pax-1.0", lambda s: _pax10_map(s, b"3\n4096\n4096\n6000\n4096\n1048576\n0\n"), "1[.]0.*overlap|1[.]0.*order"),
    ("pax-1.0", lambda s: _pax10_map(s, b"3\n4096\n4096\n696320\nabc\n1048576\n0\n"), "1[.]0.*map"),
    ("pax-1.0", lambda s: _pax10_map(s, b"99999999999999999\n4096\n"), "1[.]0.*map"),
    ("pax-1.0", lambda s: _pax10_map(s, b"300\n" + b"1\n" * 254), "1[.]0.*map"),  # runs past the member
    ("pax-1.0", lambda s: _pax10_map(s, b"2\n4096\n4096\n696320\n2048\n"), "1[.]0.*stored|1[.]0.*size"),
    ("pax-1.0", lambda s: _pax_records(s, _set("GNU.sparse.major", "2")), "GNU sparse format 2[.]0"),
    ("pax-1.0", lambda s: _pax_records(s, _set("GNU.sparse.realsize", "1099511627776")), "max_member_bytes"),
    ("pax-1.0", lambda s: _pax_records(s, _set("GNU.sparse.realsize", "-5")), "1[.]0.*real size"),
]


@pytest.mark.parametrize("fmt, edit, match", HOSTILE, ids=[f"{fmt}-{i}" for i, (fmt, _, _) in enumerate(HOSTILE)])
def test_hostile_sparse_maps_are_refused(
    fmt: str, edit: Callable[[bytes], bytes], match: str, small_sparse: dict[str, bytes], tmp_path: Path
) -> None:
    """A bad map is CorruptShard naming the member (and the format), never a wrong sample, and
    never an allocation of the claimed size."""
    shard = small_sparse[fmt]
    assert_really_sparse(shard, fmt)
    assert [s.get("bin", b"")[4096:4100] for s in read_every_way(shard, tmp_path)] == [b"aaaa", b""]
    with pytest.raises(CorruptShard, match=match) as raised:
        read_every_way(edit(shard), tmp_path)
    assert "0001.bin" in str(raised.value) or "truncated" in str(raised.value)


@given(data=st.data())
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
def test_mutated_sparse_shards_never_escape_as_other_errors(data: st.DataObject, small_sparse: dict[str, bytes], tmp_path: Path) -> None:
    """Byte flips in and around the sparse headers and maps: samples or CorruptShard, nothing
    else, and never a changed shard read silently when the manifest's hash is known."""
    base = small_sparse[data.draw(st.sampled_from(list(SPARSE_FORMATS)))]
    digest = xxhash.xxh3_128_hexdigest(base)
    blob = bytearray(base)
    for _ in range(data.draw(st.integers(1, 3))):
        pos = data.draw(st.integers(0, 4 * BLOCK))  # the headers, the pax records, the 1.0 map
        blob[pos] ^= data.draw(st.integers(1, 255))
    mutated = bytes(blob)
    try:
        read_every_way(mutated, tmp_path, expected_size=len(base), expected_xxh3_128=digest)
    except CorruptShard:
        return
    assert mutated == base, "a changed shard was read without an error"


# --- compressed shards ----------------------------------------------------------------------

COMPRESSORS = [
    # (tar option, the program it runs, what the message names, how it says to undo it)
    ("--gzip", "gzip", "gzip", "gunzip"),
    ("--bzip2", "bzip2", "bzip2", "bunzip2"),
    ("--xz", "xz", "xz", "unxz"),
    ("--zstd", "zstd", "zstd", "unzstd"),
    ("--use-compress-program=lz4", "lz4", "lz4", "lz4 -d"),
]


@pytest.mark.parametrize("option, program, kind, undo", COMPRESSORS, ids=[c[1] for c in COMPRESSORS])
@pytest.mark.parametrize("size", ["tiny", "large"])
def test_compressed_shards_are_refused_saying_what_they_are(option: str, program: str, kind: str, undo: str, size: str, tmp_path: Path) -> None:
    """``tar -z`` (and -j, -J, --zstd, lz4), named ``.tar`` or not, small enough to be shorter
    than one tar header or not: refused with the compression named and the way out."""
    if shutil.which(program) is None:
        pytest.skip(f"{program} is not installed")
    src = tmp_path / "src"
    src.mkdir()
    rng = random.Random(1)
    names = ["0001.cls"] if size == "tiny" else [f"{i:04d}.jpg" for i in range(30)]
    for name in names:
        (src / name).write_bytes(b"1" if size == "tiny" else rng.randbytes(20_000))
    shard = gnu_tar(src, names, option)
    if size == "tiny":
        assert len(shard) < BLOCK, len(shard)  # shorter than the header the reader would wait for
    with pytest.raises(CorruptShard, match=rf"{kind}-compressed") as raised:
        read_every_way(shard, tmp_path)
    message = str(raised.value)
    assert "uncompressed tar" in message and undo in message, message
    assert raised.value.position == 0


def test_gzip_data_named_tar_is_refused_from_a_file(tmp_path: Path) -> None:
    """The mapped-file path (a ``.tar`` that really is gzip, as a daemon cache file would be)."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "0001.jpg").write_bytes(bytes(5000))
    path = tmp_path / "train-000001.tar"
    path.write_bytes(gnu_tar(src, ["0001.jpg"], "-z"))
    for map_files in (True, False):
        with open(path, "rb", buffering=0) as handle, pytest.raises(CorruptShard, match="gzip-compressed.*gunzip"):
            list(iter_samples(handle, url=f"file://{path}", map_files=map_files))


@pytest.mark.parametrize("magic, kind", [(b"LZIP\x01", "lzip"), (b"\x1f\x9d\x90", "compress"), (b"\x1f\x8b\x08", "gzip")])
def test_other_compressions_by_their_magic(magic: bytes, kind: str, tmp_path: Path) -> None:
    """Compressors GNU tar runs (--lzip, -Z) but this machine may lack: by their magic alone,
    short or longer than a tar header."""
    for blob in (magic + bytes(40), magic + random.Random(2).randbytes(5000)):
        with pytest.raises(CorruptShard, match=f"{kind}-compressed.*uncompressed tar"):
            read_every_way(blob, tmp_path)


def test_names_that_look_like_compression_magic_are_still_tar(tmp_path: Path) -> None:
    """A plain tar whose first member's name starts with a compressor's magic is read: the
    magic is believed only where no valid tar header is."""
    names = ["BZh91AY&SY.jpg", "\x1f\x8b\x08.jpg", "(\xb5/\xfd.jpg"]
    for name in names:
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT, encoding="latin-1") as tar:
            info = tarfile.TarInfo(name)
            info.size = 4
            tar.addfile(info, io.BytesIO(b"data"))
        got = read_every_way(buf.getvalue(), tmp_path)
        assert [bytes(s["jpg"]) for s in got] == [b"data"], name
