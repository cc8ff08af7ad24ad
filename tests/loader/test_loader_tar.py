"""The streaming tar reader against real writers (webdataset, tarfile in every format) and against
truncated, corrupted and hostile input."""

from __future__ import annotations

import io
import random
import tarfile
import tempfile
from typing import Any

import pytest
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loader import CorruptShard, iter_members, iter_samples, split_name
from loader.tar import MemberLog
from loader.tarindex import TarIndex, iter_indexed


def webdataset_tar(samples: list[dict[str, Any]]) -> bytes:
    import webdataset as wds

    buf = io.BytesIO()
    with wds.TarWriter(buf) as writer:
        for sample in samples:
            writer.write(sample)
    return buf.getvalue()


def tarfile_tar(members: list[tuple[str, bytes]], fmt: int = tarfile.PAX_FORMAT, extra: Any = None) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as tar:
        if extra:
            extra(tar)
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


class Trickle:
    """A raw reader returning short reads of random sizes (as sockets do)."""

    def __init__(self, data: bytes, seed: int = 0, max_read: int = 700) -> None:
        self._data = data
        self._pos = 0
        self._rng = random.Random(seed)
        self._max = max_read

    def read(self, n: int = -1) -> bytes:
        if n < 0:
            n = len(self._data)
        size = min(n, self._rng.randint(1, self._max))
        out = self._data[self._pos : self._pos + size]
        self._pos += len(out)
        return out

    @property
    def pulled(self) -> int:
        return self._pos


def _outcome(source: Any, **kwargs: Any) -> tuple[str, Any]:
    try:
        return "samples", list(iter_samples(source, url="mem://x.tar", **kwargs))
    except CorruptShard as exc:
        return "error", (str(exc), exc.position)


def _indexed_outcome(data: bytes, **kwargs: Any) -> tuple[str, Any]:
    """The outcome of reading ``data`` from a file by the member table of a first, unchecked
    parse of it (loader.tarindex); a parse where that parse could not make one."""
    with tempfile.NamedTemporaryFile(suffix=".tar") as handle:
        handle.write(data)
        handle.flush()
        members = MemberLog()
        try:
            with open(handle.name, "rb", buffering=0) as reader:
                for _ in iter_samples(reader, log=members):
                    pass
        except CorruptShard:
            pass
        table = TarIndex.from_log(members, len(data))
        with open(handle.name, "rb", buffering=0) as reader:
            if table is None:
                return _outcome(reader, **kwargs)
            checks = {k: v for k, v in kwargs.items() if k in ("start", "expected_size", "expected_xxh3_128")}
            try:
                return "samples", list(iter_indexed(reader, table, url="mem://x.tar", **checks))
            except CorruptShard as exc:
                return "error", (str(exc), exc.position)


def read_all(data: bytes, **kwargs: Any) -> list[dict[str, Any]]:
    """The samples of ``data``, read every way the reader has: streamed (as from a socket),
    sliced out of a buffer (as from a mapped file), and by the member table of an earlier read
    (a warm epoch). All must give the same samples, or the same error at the same position."""
    streamed = _outcome(io.BytesIO(data), **kwargs)
    mapped = _outcome(data, **kwargs)
    assert streamed == mapped
    assert _indexed_outcome(data, **kwargs) == streamed, "the member table's read disagrees with the parse"
    kind, value = streamed
    if kind == "error":
        raise CorruptShard(value[0], position=value[1])
    return value


TRICKY = [
    {"__key__": "a/b.c/000001", "jpg": b"x" * 10, "cls": 3, "json": {"a": 1}, "seg.png": b"yy", "txt": "héllo"},
    {"__key__": "é" * 60 + "/" + "k" * 120, "bin": b"z" * 5000},  # needs PAX long names
    {"__key__": "000002", "JPG": b"upper", "tar.bin": b"\x1f\x8b"},
    {"__key__": "000003", "empty": b""},
]


def test_matches_webdataset_on_tricky_names() -> None:
    """Same keys, fields and bytes as webdataset's own reader, on names that need PAX headers,
    directories with dots, multi-dot and upper-case extensions and empty members."""
    import webdataset as wds

    data = webdataset_tar(TRICKY)
    mine = read_all(data)
    ref = list(wds.tariterators.tar_file_expander([{"stream": io.BytesIO(data), "url": "mem://x.tar"}]))
    ref_samples = list(wds.tariterators.group_by_keys(ref))
    assert len(mine) == len(ref_samples) == len(TRICKY)
    for got, want in zip(mine, ref_samples, strict=True):
        assert got["__url__"] == "mem://x.tar"
        assert {k: v for k, v in got.items() if k != "__url__"} == {
            k: v for k, v in want.items() if not k.startswith("__") or k == "__key__"
        }
    assert mine[0]["__key__"] == "a/b.c/000001"
    assert mine[0]["seg.png"] == b"yy" and mine[0]["txt"] == "héllo".encode()
    assert mine[2]["jpg"] == b"upper" and mine[2]["tar.bin"] == b"\x1f\x8b"
    assert mine[3]["empty"] == b""


@pytest.mark.parametrize("fmt", [tarfile.GNU_FORMAT, tarfile.USTAR_FORMAT, tarfile.PAX_FORMAT])
def test_every_tar_format(fmt: int) -> None:
    long_dir = "d" * 90 + "/" + "e" * 60  # > 100 chars: ustar prefix, GNU 'L', or PAX path
    members = [(f"{long_dir}/0001.jpg", b"a" * 700), (f"{long_dir}/0001.cls", b"1"), ("0002.jpg", b"b" * 512)]
    samples = read_all(tarfile_tar(members, fmt))
    assert [(s["__key__"], sorted(k for k in s if not k.startswith("__"))) for s in samples] == [
        (f"{long_dir}/0001", ["cls", "jpg"]),
        ("0002", ["jpg"]),
    ]
    assert samples[0]["jpg"] == b"a" * 700 and samples[1]["jpg"] == b"b" * 512


def test_skips_what_webdataset_skips() -> None:
    def extra(tar: tarfile.TarFile) -> None:
        d = tarfile.TarInfo("somedir")
        d.type = tarfile.DIRTYPE
        tar.addfile(d)
        link = tarfile.TarInfo("0001.lnk")
        link.type = tarfile.SYMTYPE
        link.linkname = "0001.jpg"
        tar.addfile(link)

    members = [
        ("__meta__", b"m"), ("__index__/x.json", b"{}"), ("README", b"no extension"), ("0001.jpg", b"j"), (".hidden", b"h")
    ]
    samples = read_all(tarfile_tar(members, extra=extra))
    assert [(s["__key__"], set(s) - {"__key__", "__url__"}) for s in samples] == [("0001", {"jpg"})]


def test_resume_at_every_offset_yields_the_rest() -> None:
    samples = [{"__key__": f"{i:04d}", "jpg": bytes([i]) * (i * 37 % 1500), "cls": i} for i in range(12)]
    data = webdataset_tar(samples)
    full = read_all(data)
    assert len(full) == 12
    for start in range(14):
        assert read_all(data, start=start) == full[start:]


def test_skipped_samples_are_not_held_in_memory() -> None:
    """Resuming skips data (want() returns False): no bytes object is built for skipped members."""
    data = tarfile_tar([(f"{i:04d}.bin", bytes(100_000)) for i in range(10)])
    seen: list[tuple[str, bool]] = []
    for name, payload in iter_members(io.BytesIO(data), want=lambda n: n >= "0008"):
        seen.append((name, payload is not None))
    assert seen == [(f"{i:04d}.bin", i >= 8) for i in range(10)]


@given(seed=st.integers(0, 2**16), max_read=st.integers(1, 3000), chunk=st.sampled_from([4096, 5000, 65536]))
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_short_reads_do_not_change_the_result(seed: int, max_read: int, chunk: int) -> None:
    data = webdataset_tar(TRICKY * 3)
    expected = read_all(data)
    got = list(iter_samples(Trickle(data, seed, max_read), url="mem://x.tar", chunk=chunk))
    assert got == expected


def test_streams_without_reading_ahead() -> None:
    """Two samples into a 4 MB shard, only those members plus about one chunk have been pulled."""
    data = tarfile_tar([(f"{i:04d}.bin", bytes(200_000)) for i in range(20)])
    raw = Trickle(data, max_read=1 << 20)
    samples = iter_samples(raw, url="mem://x.tar", chunk=64 * 1024)
    next(samples)
    next(samples)  # the first sample is complete only when the second key is seen
    assert raw.pulled < 4 * 200_000, raw.pulled  # the shard is 20 x 200 kB


def test_truncation_anywhere_is_an_error() -> None:
    """Cut anywhere before the end-of-archive block: CorruptShard, never fewer samples silently.
    With the manifest's size, a cut in the trailing padding is caught as well."""
    data = webdataset_tar(TRICKY)
    with tarfile.open(fileobj=io.BytesIO(data)) as ref:
        ref.getmembers()
        end_block = ref.offset  # where the end-of-archive zero blocks begin
    cuts = sorted({0, 1, 511, 512, 513, end_block - 1, end_block, end_block + 511}
                  | set(range(0, end_block, 97)))
    for cut in cuts:
        with pytest.raises(CorruptShard, match="truncated"):
            read_all(data[:cut])
    for cut in (end_block + 512, end_block + 1024, len(data) - 1):
        with pytest.raises(CorruptShard, match="size mismatch"):
            read_all(data[:cut], expected_size=len(data))
    assert len(read_all(data, expected_size=len(data))) == len(TRICKY)


def test_checksums_and_sizes() -> None:
    data = webdataset_tar(TRICKY)
    digest = xxhash.xxh3_128_hexdigest(data)
    assert len(read_all(data, expected_size=len(data), expected_xxh3_128=digest)) == len(TRICKY)
    # a flipped data byte keeps the tar valid, only the hash can tell
    pos = data.index(b"z" * 5000) + 100
    flipped = data[:pos] + b"Z" + data[pos + 1 :]
    with pytest.raises(CorruptShard, match="checksum mismatch"):
        read_all(flipped, expected_size=len(data), expected_xxh3_128=digest)
    with pytest.raises(CorruptShard, match="size mismatch"):
        read_all(data + bytes(512), expected_size=len(data))
    # a flipped header byte is caught by the header checksum, hash or not
    with pytest.raises(CorruptShard, match="checksum mismatch"):
        read_all(data[:3] + bytes([data[3] ^ 0x20]) + data[4:])


@pytest.mark.parametrize(
    "blob, match",
    [
        (b"", "truncated"),
        (b"not a tar file at all" * 100, "checksum"),
        (bytes(range(256)) * 8, "checksum"),
        (b"\x1f\x8b\x08" + bytes(2000), "checksum"),  # gzip is not read (manifest lists *.tar)
    ],
)
def test_garbage(blob: bytes, match: str) -> None:
    with pytest.raises(CorruptShard, match=match):
        read_all(blob)


def _header(name: str, size: int, typeflag: bytes = b"0", raw_size: bytes | None = None) -> bytes:
    info = tarfile.TarInfo(name)
    info.size = size
    info.type = typeflag
    block = bytearray(info.tobuf(format=tarfile.USTAR_FORMAT))
    if raw_size is not None:
        block[124:136] = raw_size
        block[148:156] = b"        "
        block[148:156] = b"%06o\x00 " % sum(block)
    return bytes(block)


def test_hostile_headers() -> None:
    # a header claiming a 64 GiB member (base-256 size) is refused before any allocation
    huge = _header("0001.jpg", 0, raw_size=b"\x80" + (64 << 30).to_bytes(11, "big"))
    with pytest.raises(CorruptShard, match="max_member_bytes"):
        read_all(huge + bytes(1024))
    # a size field that is not octal
    with pytest.raises(CorruptShard, match="invalid size"):
        read_all(_header("0001.jpg", 0, raw_size=b"99999999999\x00") + bytes(1024))
    # a GNU long name claiming 1 GiB
    with pytest.raises(CorruptShard, match="too large"):
        read_all(_header("././@LongLink", 1 << 30, b"L") + bytes(1024))
    # malformed PAX records
    for record in (b"999 path=x\n", b"abc path=x\n", b"12 pathx\n\n\n", b"5 a=b\n"):
        pax = _header("././@PaxHeader", len(record), b"x") + record.ljust(512, b"\x00")
        with pytest.raises(CorruptShard, match="PAX"):
            read_all(pax + _header("0001.jpg", 0) + bytes(1024))
    # the same field twice in one sample
    with pytest.raises(CorruptShard, match="repeats field"):
        read_all(tarfile_tar([("0001.jpg", b"a"), ("0001.jpg", b"b")]))


@given(data=st.data())
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_mutations_never_escape_as_other_errors(data: st.DataObject) -> None:
    """Random byte flips, cuts and insertions: samples or CorruptShard, nothing else, and a flip
    is never silent when the manifest hash is known."""
    base = webdataset_tar(TRICKY[:2] + TRICKY[3:])
    digest = xxhash.xxh3_128_hexdigest(base)
    blob = bytearray(base)
    for _ in range(data.draw(st.integers(1, 4))):
        kind = data.draw(st.sampled_from(["flip", "cut", "insert"]))
        pos = data.draw(st.integers(0, max(0, len(blob) - 1)))
        if kind == "flip" and blob:
            blob[pos] ^= data.draw(st.integers(1, 255))
        elif kind == "cut":
            del blob[pos : pos + data.draw(st.integers(1, 2000))]
        else:
            blob[pos:pos] = data.draw(st.binary(min_size=1, max_size=600))
    mutated = bytes(blob)
    try:
        read_all(mutated, expected_size=len(base), expected_xxh3_128=digest)
    except CorruptShard:
        return
    assert mutated == base, "a changed shard was read without an error"


def test_split_name_matches_webdataset() -> None:
    from webdataset.tariterators import base_plus_ext

    for name in ["a.jpg", "dir/0001.seg.png", "d.v2/x/0001.JPG", "noext", ".hidden", "a/.b", "a/b.", "x.y/z"]:
        base, ext = base_plus_ext(name)
        assert split_name(name) == (None if base is None else (base, ext.lower()))


def test_local_files_are_mapped_from_their_position(tmp_path: Any) -> None:
    """A regular file is read through a mapping, from the file object's current position, with
    the same samples and errors as a stream; files with nothing left are reported as streams are."""
    data = webdataset_tar(TRICKY)
    digest = xxhash.xxh3_128_hexdigest(data)
    path = tmp_path / "shard.tar"
    path.write_bytes(b"junk" * 300 + data)
    with open(path, "rb", buffering=0) as handle:
        handle.seek(1200)
        got = list(iter_samples(handle, url="mem://x.tar", expected_size=len(data), expected_xxh3_128=digest))
    assert got == read_all(data)
    flipped = bytearray(data)
    flipped[data.index(b"z" * 5000) + 7] ^= 1
    path.write_bytes(bytes(flipped))
    with open(path, "rb", buffering=0) as handle, pytest.raises(CorruptShard, match="checksum mismatch"):
        list(iter_samples(handle, expected_size=len(data), expected_xxh3_128=digest))
    path.write_bytes(data[:5000])
    with open(path, "rb", buffering=0) as handle, pytest.raises(CorruptShard, match="truncated"):
        list(iter_samples(handle))
    path.write_bytes(b"")
    with open(path, "rb", buffering=0) as handle, pytest.raises(CorruptShard, match="truncated"):
        list(iter_samples(handle))


def test_large_mapped_file_is_read_whole(tmp_path: Any) -> None:
    """A shard bigger than the unmapping stride: every byte still read, hashed and verified."""
    rng = random.Random(5)
    members = [(f"{i:04d}.bin", rng.randbytes(rng.randint(300_000, 700_000))) for i in range(40)]
    data = tarfile_tar(members, fmt=tarfile.USTAR_FORMAT)
    path = tmp_path / "big.tar"
    path.write_bytes(data)
    with open(path, "rb", buffering=0) as handle:
        got = list(iter_samples(handle, expected_size=len(data), expected_xxh3_128=xxhash.xxh3_128_hexdigest(data)))
    assert [(s["__key__"], s["bin"]) for s in got] == [(name[:-4], payload) for name, payload in members]


def test_zero_copy_members_are_views_with_the_same_bytes(tmp_path: Any) -> None:
    """``zero_copy``: memoryviews (of the mapping for files and buffers, of each member's bytes for
    streams) with the same content as the copying reader; they stay valid after the reader has
    moved on, unmapped what it read and finished (the view keeps its mapping)."""
    rng = random.Random(9)
    members = [(f"{i:04d}.bin", rng.randbytes(rng.randint(300_000, 700_000))) for i in range(40)]
    data = tarfile_tar(members, fmt=tarfile.USTAR_FORMAT)
    digest = xxhash.xxh3_128_hexdigest(data)
    path = tmp_path / "big.tar"
    path.write_bytes(data)
    expected = [(name[:-4], payload) for name, payload in members]
    with open(path, "rb", buffering=0) as handle:
        mapped = list(iter_samples(handle, expected_size=len(data), expected_xxh3_128=digest, zero_copy=True))
    streamed = list(iter_samples(io.BytesIO(data), expected_xxh3_128=digest, zero_copy=True))
    in_memory = list(iter_samples(data, zero_copy=True))
    for got in (mapped, streamed, in_memory):
        assert all(isinstance(s["bin"], memoryview) for s in got)
        assert [(s["__key__"], bytes(s["bin"])) for s in got] == expected
    with pytest.raises(CorruptShard, match="checksum mismatch"):
        list(iter_samples(data[:-1] + b"\x01", expected_xxh3_128=digest, zero_copy=True))
