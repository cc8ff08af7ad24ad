"""Streaming WebDataset reader: tar bytes in, sample dicts out, one member in memory at a time.

Two ways in, one parser: a stream (``read(n)``: sockets, HTTP bodies) is pulled a chunk at a time;
a regular local file (the ``file://`` source, the daemon's short-circuit cache files) or a
``bytes``/``mmap`` buffer is mapped and each member is sliced straight out of the page cache —
one copy per byte instead of two (``read`` into a chunk, then the member out of the chunk), and
no read call per chunk. Both paths give the same samples and the same errors.

Why not :mod:`tarfile`: in stream mode it reports a corrupt or truncated header after the first
member as a normal end of archive, so a cut-off shard would silently yield fewer samples. This
reader is strict instead: header checksums are verified, data must be complete, the archive must
end with its zero block, and (when the manifest gives them) the total size and xxh3_128 must
match. It understands what real writers produce: POSIX ustar with prefix, GNU long names
(``L``), PAX extended headers (``x``: ``path``, ``size``), base-256 sizes, and GNU tar's sparse
files (``tar --sparse``: old GNU ``S`` members with their extension headers, PAX sparse formats
0.0, 0.1 and 1.0), which are read as the files they stand for, holes as zeros. A compressed
stream (gzip, bzip2, xz, zstd, lz4, ...) is refused with an error that names the compression:
shards are read by byte range and cached as they are, so they must be plain tar.

Grouping follows the ``webdataset`` package exactly: a member ``dir/000123.seg.png`` belongs to
the sample with key ``dir/000123`` under field ``seg.png`` (field lowercased); consecutive
members with the same key form one sample; members without an extension, non-regular members
and ``__meta__`` entries are skipped; a field repeated within a sample is an error.
"""

from __future__ import annotations

import contextlib
import io
import mmap
import os
import re
import stat
import zlib
from collections.abc import Callable, Iterator
from typing import Any, Protocol

from loader.errors import CorruptShard

__all__ = ["RawReader", "TarSource", "MemberLog", "iter_members", "iter_samples", "map_source", "split_name",
           "UNMAP_EVERY_BYTES", "release_pages"]

BLOCK = 512
_ZERO_BLOCK = bytes(BLOCK)
UNMAP_EVERY_BYTES = 8 << 20  # a mapping's pages read and released together (see _Mapped)


def release_pages(buf: Any, released: int, offset: int) -> int:
    """Release the pages of the mapping ``buf`` from ``released`` up to ``offset`` (rounded down
    to a page) from this process's RSS (the page cache keeps them; a view still held faults them
    back in); the new ``released``."""
    end = offset - offset % mmap.PAGESIZE
    with contextlib.suppress(OSError, ValueError):
        buf.madvise(mmap.MADV_DONTNEED, released, end - released)
    return end
_MAX_META_BYTES = 1 << 20  # a PAX or GNU long-name record larger than this is not a name
_KEY_RE = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$", re.DOTALL)
_META_RE = re.compile(r"__[^/]*__($|/)")
_REGULAR = (b"0", b"\x00", b"7")
_SPARSE_PREFIX = b"GNU.sparse."  # PAX records of GNU tar's sparse formats
# Format 0.0 repeats these two keywords, one pair per map entry: their order is the map.
_SPARSE_00_KEYS = (b"GNU.sparse.offset", b"GNU.sparse.numbytes")
_GNU_ENTRY = 24  # an old GNU map entry: offset[12], numbytes[12]
# (magic, compression, how to undo it): what a compressed shard starts with, for the error that
# refuses it. tar -z/-j/-J/--zstd/--lzip/-Z and lz4 frames.
_COMPRESSIONS = (
    (b"\x1f\x8b", "gzip", "`gunzip -k shard.tar.gz`, or `gzip -dc shard.tar > plain.tar` for gzip data named .tar"),
    (b"BZh", "bzip2", "`bunzip2 -k shard.tar.bz2`, or `bzip2 -dc shard.tar > plain.tar`"),
    (b"\xfd7zXZ\x00", "xz", "`unxz -k shard.tar.xz`, or `xz -dc shard.tar > plain.tar`"),
    (b"\x28\xb5\x2f\xfd", "zstd", "`unzstd shard.tar.zst`, or `zstd -dc shard.tar > plain.tar`"),
    (b"\x04\x22\x4d\x18", "lz4", "`lz4 -d shard.tar.lz4 plain.tar`"),
    (b"LZIP", "lzip", "`lzip -dk shard.tar.lz`"),
    (b"\x1f\x9d", "compress", "`uncompress shard.tar.Z`, or `gzip -dc shard.tar.Z > plain.tar`"),
)
# maps bytes > 127 to 1 and the rest to 0: counts the bytes that are negative as signed chars
_HIGH_BYTES = bytes(1 if b > 127 else 0 for b in range(256))


class RawReader(Protocol):
    """What a byte source must offer: ``read(n)`` returning up to n bytes, b"" at the end."""

    def read(self, n: int = -1, /) -> bytes: ...


TarSource = RawReader | bytes | mmap.mmap
"""What the readers take: a stream, or the whole shard as ``bytes`` or an ``mmap``."""


class MemberLog:
    """Where a parse found the members it yielded, for :mod:`loader.tarindex`: ``names`` holds
    ``(key, field)`` and ``places`` ``(offset, size)`` of each, in order. :attr:`complete` only
    after a parse of a mapped shard from its start to its end, every check passed, with no
    member that is not a slice of the shard (a sparse file's)."""

    def __init__(self) -> None:
        self.names: list[tuple[str, str]] = []
        self.places: list[tuple[int, int]] = []
        self.mapped = False
        self.sliced = True
        self.finished = False

    @property
    def complete(self) -> bool:
        return self.mapped and self.sliced and self.finished and len(self.names) == len(self.places)

    @property
    def members(self) -> Iterator[tuple[str, str, int, int]]:
        for (key, field), (offset, size) in zip(self.names, self.places, strict=True):
            yield key, field, offset, size


class _Hasher(Protocol):
    def update(self, data: bytes | memoryview, /) -> None: ...

    def hexdigest(self) -> str: ...


def split_name(name: str) -> tuple[str, str] | None:
    """``"dir/000123.seg.PNG"`` → ``("dir/000123", "seg.png")``; None when it has no extension."""
    slash = name.rfind("/") + 1
    dot = name.find(".", slash)
    if dot > slash:
        # The common case, split with string methods (once per member, so it counts): the key
        # runs to the first dot of the base name, as the regex's greedy reading has it.
        return name[:dot], name[dot + 1 :].lower()
    match = _KEY_RE.match(name)  # no dot, or a base name starting with one: the regex decides
    if not match:
        return None
    return match.group(1), match.group(2).lower()


class _Stream:
    """Buffered, position-tracking reader over a raw source; hashes every byte it pulls."""

    def __init__(self, raw: RawReader, url: str, chunk: int, hasher: _Hasher | None) -> None:
        self._raw = raw
        self._url = url
        self._chunk = chunk
        self._hasher = hasher
        self._buf = b""
        self._off = 0  # consumed bytes of self._buf
        self.position = 0  # bytes consumed from the start of the object
        self.pulled = 0  # bytes read from the raw source

    def _pull(self, n: int) -> bytes:
        data = self._raw.read(n)
        if data:
            self.pulled += len(data)
            if self._hasher is not None:
                self._hasher.update(data)
        return data

    def read_exact(self, n: int, what: str, name: str | None = None) -> bytes:
        """``n`` bytes; a shard ending sooner is reported as truncated inside ``what`` (followed by
        the member ``name``: formatted only then, since this runs for every member)."""
        avail = len(self._buf) - self._off
        if avail >= n:
            out = self._buf[self._off : self._off + n]
            self._off += n
            self.position += n
            return out
        parts = [self._buf[self._off :]] if avail else []
        need = n - avail
        self._buf, self._off = b"", 0
        while need > 0:
            # Small needs refill the buffer a chunk at a time; a large member is read in one go.
            data = self._pull(self._chunk if need < self._chunk else need)
            if not data:
                raise CorruptShard(
                    f"truncated: the shard ends inside {_what(what, name)} ({n - need} of {n} bytes present)",
                    url=self._url,
                    position=self.position + (n - need),
                )
            if len(data) > need:
                parts.append(data[:need])
                self._buf, self._off = data, need
                need = 0
            else:
                parts.append(data)
                need -= len(data)
        self.position += n
        return b"".join(parts)

    def read_member(self, size: int, padded: int, name: str) -> bytes:
        """A member's ``size`` data bytes; its padding up to ``padded`` is consumed too."""
        data = self.read_exact(size, "member", name)
        if padded > size:
            self.skip(padded - size, "the padding of member", name)
        return data

    def skip(self, n: int, what: str, name: str | None = None) -> None:
        avail = len(self._buf) - self._off
        if avail >= n:
            self._off += n
            self.position += n
            return
        need = n - avail
        self._buf, self._off = b"", 0
        while need > 0:
            data = self._pull(self._chunk)
            if not data:
                raise CorruptShard(
                    f"truncated: the shard ends inside {_what(what, name)}",
                    url=self._url,
                    position=self.position + (n - need),
                )
            if len(data) > need:
                self._buf, self._off = data, need
                need = 0
            else:
                need -= len(data)
        self.position += n

    def peek(self, n: int) -> bytes:
        """Up to ``n`` bytes from the current position, not consumed (fewer only at the end)."""
        while len(self._buf) - self._off < n:
            data = self._pull(self._chunk)
            if not data:
                break
            self._buf, self._off = self._buf[self._off :] + data, 0
        return self._buf[self._off : self._off + n]

    def own(self, data: bytes) -> bytes:
        """A member built here (a sparse file): as is, iter_members makes views of what streams give."""
        return data

    def read_header(self) -> bytes | None:
        """The next 512-byte block; None when the object ends exactly here (no bytes at all)."""
        if self._off == len(self._buf):
            data = self._pull(self._chunk)
            if not data:
                return None
            self._buf, self._off = data, 0
        return self.read_exact(BLOCK, "a tar header")

    def drain(self, limit: int) -> int:
        """Read to the end of the object (at most ``limit`` more bytes); returns the bytes read."""
        total = len(self._buf) - self._off
        self._buf, self._off = b"", 0
        while total <= limit:
            data = self._pull(self._chunk)
            if not data:
                break
            total += len(data)
        self.position += total
        return total


class _Mapped:
    """:class:`_Stream`'s interface over a whole shard in memory (a mapped file or bytes): each
    member is one slice of the buffer, hashed from the buffer without a copy."""

    def __init__(
        self, buf: bytes | mmap.mmap, start: int, url: str, hasher: _Hasher | None, zero_copy: bool = False,
        log: MemberLog | None = None,
    ) -> None:
        self._buf = buf
        self._log = log
        if log is not None:
            log.mapped = True
        self._base = start
        self._end = len(buf)
        self._url = url
        self._hasher = hasher
        # What the hasher reads without a copy and, with zero_copy, what members are sliced from.
        # Zero-copy members keep it (and the mapping) alive after close(), until they are dropped.
        self._zero_copy = zero_copy
        self._view = memoryview(buf) if hasher is not None or zero_copy else None
        self._members: memoryview | bytes | mmap.mmap = self._view if zero_copy else buf  # type: ignore[assignment]
        self._hashed = start  # buffer offset up to which bytes went into the hasher
        # A mapped file's pages count in the reader's RSS once touched: unmap what was read every
        # UNMAP_EVERY_BYTES bytes (the page cache keeps them), so a 1 GiB shard costs no 1 GiB of RSS.
        self._unmap = isinstance(buf, mmap.mmap) and hasattr(buf, "madvise")
        self._unmapped = start - start % mmap.PAGESIZE
        self.position = 0
        self.pulled = 0

    def _hash_to(self, offset: int) -> None:
        # Everything up to the end of the member about to be copied, in one call: the copy then
        # reads bytes the hash has just brought into the CPU cache.
        if offset > self._hashed:
            self._hasher.update(self._view[self._hashed : offset])  # type: ignore[union-attr,index]
            self._hashed = offset

    def read_exact(self, n: int, what: str, name: str | None = None) -> bytes:
        at = self._base + self.position
        if at + n > self._end:
            present = self._end - at
            raise CorruptShard(
                f"truncated: the shard ends inside {_what(what, name)} ({present} of {n} bytes present)",
                url=self._url,
                position=self.position + present,
            )
        self.position += n
        return self._buf[at : at + n]

    def read_member(self, size: int, padded: int, name: str) -> bytes | memoryview:
        at = self._base + self.position
        if at + padded > self._end:
            self.read_exact(size, "member", name)  # raises if the data itself is cut
            self.skip(padded - size, "the padding of member", name)  # raises
        if self._hasher is not None:
            self._hash_to(at + padded)  # before the copy: the copy then reads cached bytes
        self.position += padded
        if self._log is not None:
            self._log.places.append((at, size))
        if self._unmap and at - self._unmapped >= UNMAP_EVERY_BYTES:
            self._release(at)  # held zero-copy members stay valid: their pages fault back in
        return self._members[at : at + size]

    def _release(self, offset: int) -> None:
        self._unmapped = release_pages(self._buf, self._unmapped, offset)

    def skip(self, n: int, what: str, name: str | None = None) -> None:
        at = self._base + self.position
        if at + n > self._end:
            raise CorruptShard(
                f"truncated: the shard ends inside {_what(what, name)}",
                url=self._url,
                position=self.position + self._end - at,
            )
        self.position += n

    def peek(self, n: int) -> bytes:
        at = self._base + self.position
        return self._buf[at : at + n]

    def own(self, data: bytes) -> bytes | memoryview:
        """A member built here (a sparse file): a view of it with zero_copy, as other members are."""
        if self._log is not None:
            self._log.sliced = False
        return memoryview(data) if self._zero_copy else data

    def read_header(self) -> bytes | None:
        at = self._base + self.position
        end = at + BLOCK
        if end > self._end:
            if at == self._end:
                return None
            return self.read_exact(BLOCK, "a tar header")  # raises: truncated
        self.position += BLOCK  # hashed with the member it heads (read_member) or by drain()
        return self._buf[at:end]

    def drain(self, limit: int) -> int:
        """Consume the rest of the buffer; hashed only when it is not longer than ``limit`` (a
        longer one fails the size check anyway, as a stream stops reading it there)."""
        at = self._base + self.position
        rest = self._end - at
        if rest <= limit and self._hasher is not None:
            self._hash_to(self._end)
        self.position += rest
        self.pulled = self._end - self._base
        return rest

    def close(self) -> None:
        if self._view is not None and not self._zero_copy:
            self._view.release()


def _what(what: str, name: str | None) -> str:
    return what if name is None else f"{what} {name!r}"


def map_source(raw: TarSource, map_files: bool) -> tuple[bytes | mmap.mmap, int, bool] | None:
    """``(buffer, start offset, whether we mapped it)`` for a buffer or (``map_files``) a regular
    local file read from its current position; None for anything else (it is streamed)."""
    if isinstance(raw, (bytes, mmap.mmap)):
        return raw, 0, False
    if not map_files:
        return None
    fileno = getattr(raw, "fileno", None)
    tell = getattr(raw, "tell", None)
    if fileno is None or tell is None:
        return None
    try:
        fd = fileno()
        info = os.fstat(fd)
        start = tell()
        if not stat.S_ISREG(info.st_mode) or info.st_size <= start:
            return None  # a pipe, or nothing left to map (the stream path reports the truncation)
        # Read-only and shared: pages come straight from the page cache. Shards are immutable (the
        # daemon publishes by rename and evicts by unlink, both safe under a mapping).
        mapped = mmap.mmap(fd, 0, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    except (OSError, ValueError, io.UnsupportedOperation):
        return None
    with contextlib.suppress(AttributeError, OSError):
        mapped.madvise(mmap.MADV_SEQUENTIAL)  # cold pages: read ahead aggressively
    return mapped, start, True


def _nul_str(field: bytes) -> str:
    return field.split(b"\x00", 1)[0].decode("utf-8", "surrogateescape")


def _number(field: bytes, what: str, url: str, pos: int) -> int:
    if field and field[0] & 0x80:  # GNU base-256 for values that do not fit in octal
        if field[0] == 0xFF:
            raise CorruptShard(f"negative {what} in tar header", url=url, position=pos)
        value = field[0] & 0x7F
        for byte in field[1:]:
            value = (value << 8) | byte
        return value
    text = field.replace(b"\x00", b" ").strip()
    if not text:
        return 0
    try:
        return int(text, 8)
    except ValueError:
        raise CorruptShard(f"invalid {what} {text[:20]!r} in tar header", url=url, position=pos) from None


def _parse_pax(data: bytes, url: str, pos: int) -> tuple[dict[str, str], list[tuple[bytes, str]] | None]:
    """PAX records: ``"%d %s=%s\\n" % (length, keyword, value)``; and, when there are ``GNU.sparse.*``
    records (a sparse member), the repeated offset/numbytes records of format 0.0 in their order
    (a dict keeps only the last of each), else None."""
    records: dict[str, str] = {}
    sparse: list[tuple[bytes, str]] | None = None
    i = 0
    while i < len(data):
        if data[i] == 0:  # some writers pad the record block with NULs
            break
        space = data.find(b" ", i)
        if space < 0:
            raise CorruptShard("malformed PAX header (record without length)", url=url, position=pos)
        try:
            length = int(data[i:space])
        except ValueError:
            raise CorruptShard("malformed PAX header (bad record length)", url=url, position=pos) from None
        if length <= space - i + 1 or i + length > len(data) or data[i + length - 1 : i + length] != b"\n":
            raise CorruptShard("malformed PAX header (record length out of range)", url=url, position=pos)
        record = data[space + 1 : i + length - 1]
        keyword, eq, value = record.partition(b"=")
        if not eq:
            raise CorruptShard("malformed PAX header (record without '=')", url=url, position=pos)
        if keyword.startswith(_SPARSE_PREFIX):
            if sparse is None:
                sparse = []
            if keyword in _SPARSE_00_KEYS:
                sparse.append((keyword, value.decode("ascii", "replace")))
        records[keyword.decode("utf-8", "replace")] = value.decode("utf-8", "surrogateescape")
        i += length
    return records, sparse


def iter_members(
    raw: TarSource,
    *,
    url: str = "",
    chunk: int = 1 << 20,
    max_member_bytes: int = 1 << 31,
    expected_size: int | None = None,
    expected_xxh3_128: str | None = None,
    want: Callable[[str], bool] | None = None,
    map_files: bool = True,
    zero_copy: bool = False,
    log: MemberLog | None = None,
) -> Iterator[tuple[str, bytes | memoryview | None]]:
    """Yield ``(name, data)`` for every regular member, in archive order.

    ``want(name) -> bool`` (optional) decides whether a member's data is needed; when it says no
    the data is skipped and ``None`` is yielded in its place (so resuming at a sample offset does
    not hold skipped samples in memory). After the end-of-archive block, when ``expected_size`` or
    ``expected_xxh3_128`` is given, the rest of the object is read and checked.

    ``raw`` is a stream (``read(n)``), or ``bytes``/``mmap``; a regular file object (``fileno``)
    is mapped and read from its current position (its own position does not move), unless
    ``map_files`` is false (see ``LoaderSettings.map_files``).

    ``zero_copy``: member data comes as a ``memoryview`` — of the mapping for a mapped file or a
    buffer (no copy at all), of the member's own ``bytes`` for a stream.

    ``log``: where each member read from a mapping lies (:class:`MemberLog`).
    """
    hasher: _Hasher | None = None
    if expected_xxh3_128 is not None:
        import xxhash

        hasher = xxhash.xxh3_128()
    mapping = map_source(raw, map_files)
    if mapping is None:
        assert not isinstance(raw, (bytes, mmap.mmap))  # map_source maps every buffer
        members = _members(_Stream(raw, url, chunk, hasher), url, max_member_bytes, expected_size, hasher,
                           expected_xxh3_128, want)
        if not zero_copy:
            yield from members
            return
        for name, data in members:
            yield name, (None if data is None else memoryview(data))
        return
    buf, start, owned = mapping
    mapped = _Mapped(buf, start, url, hasher, zero_copy, log)
    try:
        yield from _members(mapped, url, max_member_bytes, expected_size, hasher, expected_xxh3_128, want)
    finally:
        mapped.close()
        if owned:
            with contextlib.suppress(BufferError):  # a caller still holds a view: the GC unmaps it
                buf.close()  # type: ignore[union-attr]


def _members(
    stream: _Stream | _Mapped,
    url: str,
    max_member_bytes: int,
    expected_size: int | None,
    hasher: _Hasher | None,
    expected_xxh3_128: str | None,
    want: Callable[[str], bool] | None,
) -> Iterator[tuple[str, bytes | memoryview | None]]:
    long_name: str | None = None
    pax: dict[str, str] = {}
    sparse: list[tuple[bytes, str]] | None = None  # GNU sparse records of the PAX header, if any
    _refuse_compressed(stream.peek(BLOCK), url)
    while True:
        start = stream.position
        header = stream.read_header()
        if header is None:
            break
        if header == _ZERO_BLOCK:
            break  # end of archive (a second zero block and record padding may follow)
        _check_checksum(header, url, start)
        typeflag = header[156:157]
        size = _number(header[124:136], "size", url, start)
        if "size" in pax:
            try:
                size = int(pax["size"])
            except ValueError:
                raise CorruptShard("invalid size in PAX header", url=url, position=start) from None
        if size < 0:
            raise CorruptShard("negative member size", url=url, position=start)
        padded = (size + BLOCK - 1) // BLOCK * BLOCK
        if typeflag in (b"L", b"x", b"g", b"K"):
            if size > _MAX_META_BYTES:
                raise CorruptShard(f"tar extension header of {size} bytes is too large", url=url, position=start)
            data = stream.read_exact(padded, "a tar extension header")[:size]
            if typeflag == b"L":
                long_name = data.split(b"\x00", 1)[0].decode("utf-8", "surrogateescape")
            elif typeflag == b"x":
                pax, sparse = _parse_pax(data, url, start)
            continue  # 'g' (global) and 'K' (long link target) carry nothing a sample needs
        name = _member_name(header, long_name, pax)
        if typeflag == b"S" or (sparse is not None and typeflag in _REGULAR):
            # The slow path, for sparse members only (old GNU 'S', or a PAX header with GNU.sparse
            # records): a map to read, holes to fill. Other members pay one comparison.
            member = _sparse_member(stream, header, pax, sparse, name, size, url, start, max_member_bytes, want)
            long_name, pax, sparse = None, {}, None
            yield member
            continue
        if pax or long_name is not None:
            long_name, pax, sparse = None, {}, None
        if typeflag not in _REGULAR:
            # Directories, links, devices, unknown types: no sample data (skipped with what they carry).
            stream.skip(padded, "member", name)
            continue
        if size > max_member_bytes:
            raise CorruptShard(
                f"member {name!r} claims {size} bytes, more than max_member_bytes={max_member_bytes}",
                url=url,
                position=start,
            )
        if want is not None and not want(name):
            stream.skip(padded, "member", name)
            yield name, None
            continue
        yield name, stream.read_member(size, padded, name)
    if header is None:
        raise CorruptShard(
            "truncated: the shard ends without the tar end-of-archive block", url=url, position=stream.position
        )
    if expected_size is None and hasher is None:
        return
    limit = (expected_size - stream.position + 1) if expected_size is not None else (1 << 40)
    stream.drain(max(limit, 0))
    if expected_size is not None and stream.pulled != expected_size:
        raise CorruptShard(
            f"size mismatch: read {stream.pulled} bytes, the manifest says {expected_size}", url=url
        )
    if hasher is not None and expected_xxh3_128 is not None:
        digest = hasher.hexdigest()
        if digest != expected_xxh3_128.lower():
            raise CorruptShard(
                f"checksum mismatch: xxh3_128 is {digest}, the manifest says {expected_xxh3_128}", url=url
            )


def _check_checksum(header: bytes, url: str, pos: int) -> None:
    stored_field = header[148:156]
    try:
        stored = int(stored_field.replace(b"\x00", b" ").strip() or b"-1", 8)
    except ValueError:
        stored = -1
    # The byte sum by Adler-32, whose low half is 1 + the byte sum mod 65521 — exact for 256-byte
    # halves (at most 65,280): 0.3 us per header where sum() over 512 ints took 2.5 us.
    unsigned = (
        (zlib.adler32(header[:256]) & 0xFFFF) + (zlib.adler32(header[256:]) & 0xFFFF) - 2
        - sum(stored_field) + 8 * 32
    )
    if stored == unsigned:
        return
    # Some old writers summed signed chars. Only computed when the common form fails: done for
    # every member, a per-byte generator was 70% of the warm read time.
    high = header[:148].translate(_HIGH_BYTES).count(1) + header[156:].translate(_HIGH_BYTES).count(1)
    signed = unsigned - 256 * high
    if stored != signed:
        raise CorruptShard("invalid tar header (checksum mismatch): not a tar file or corrupted", url=url, position=pos)


def _refuse_compressed(head: bytes, url: str) -> None:
    """Raise when the shard starts with a compressor's magic rather than a tar header.

    Checked once per shard on its first bytes (a compressed stream can be shorter than one tar
    header). A valid tar header wins: a member may well be named ``BZh91AY&SY.jpg``."""
    for magic, kind, undo in _COMPRESSIONS:
        if not head.startswith(magic) or (kind == "bzip2" and head[3:4] not in b"123456789"):
            continue
        if len(head) == BLOCK:
            try:
                _check_checksum(head, url, 0)
                return
            except CorruptShard:
                pass
            what = "invalid tar header (checksum mismatch)"
        else:
            what = f"not a tar file ({len(head)} bytes, less than one tar header)"
        raise CorruptShard(
            f"{what}: the shard is {kind}-compressed (it starts with the {kind} magic {magic.hex(' ')}). "
            "WebDataset shards must be uncompressed tar: they are read by byte range and cached as they "
            f"are. Decompress every shard ({undo}) and list the .tar files, or re-pack the samples "
            "with `tar cf` and no compression option",
            url=url,
            position=0,
        )


def _decimal(text: str | bytes) -> int | None:
    """A non-negative decimal of at most 20 ASCII digits (what GNU tar writes), else None."""
    if not text or len(text) > 20 or not text.isdigit() or not text.isascii():
        return None
    return int(text)


class _SparseError:
    """Builds the errors of one sparse member: each names the member and its format."""

    def __init__(self, name: str, fmt: str, url: str, pos: int) -> None:
        self.name, self.fmt, self.url, self.pos = name, fmt, url, pos

    def __call__(self, problem: str) -> CorruptShard:
        return CorruptShard(
            f"sparse member {self.name!r} (GNU tar --sparse, {self.fmt} format): {problem}", url=self.url, position=self.pos
        )


def _sparse_member(
    stream: _Stream | _Mapped,
    header: bytes,
    pax: dict[str, str],
    pax_sparse: list[tuple[bytes, str]] | None,
    name: str,
    size: int,
    url: str,
    pos: int,
    max_member_bytes: int,
    want: Callable[[str], bool] | None,
) -> tuple[str, bytes | memoryview | None]:
    """A GNU sparse member, read as the file it stands for: ``(real name, data)`` (data None when
    ``want`` declines it). ``size`` is what the archive stores: map (format 1.0) and data chunks.

    Every map is checked before any data is read or allocated: the real size against
    ``max_member_bytes``, entries in order, disjoint, inside the real size, and adding up to the
    stored bytes. Anything else (an unknown version, a malformed map) is CorruptShard naming the
    member and the format: a sparse member is never yielded as its stored chunks, nor dropped."""
    map_bytes = 0  # format 1.0: the map's blocks at the start of the member's data
    if header[156:157] == b"S":
        fail = _SparseError(name, "gnu", url, pos)
        if header[257:265] != b"ustar  \x00":
            # Other writers' 'S' members (star's) lay the map out differently: refuse, never guess.
            raise fail("a sparse ('S') member without the GNU header magic: re-create the shard with GNU tar")
        realsize = _number(header[483:495], f"real size of sparse member {name!r}", url, pos)
        _check_real_size(realsize, max_member_bytes, fail)
        entries = _gnu_sparse_map(stream, header, fail)
    else:
        name = pax.get("GNU.sparse.name", name)  # 0.1 and 1.0 put GNUSparseFile.<pid>/... in the header
        major, minor = pax.get("GNU.sparse.major"), pax.get("GNU.sparse.minor")
        if major is not None or minor is not None:
            fail = _SparseError(name, f"pax {major}.{minor}", url, pos)
            if (major, minor) != ("1", "0"):
                raise fail(
                    f"GNU sparse format {major}.{minor} is not supported (0.0, 0.1 and 1.0 are): re-create "
                    "the shard without --sparse, or with --sparse-version=1.0"
                )
            realsize = _pax_real_size(pax, "GNU.sparse.realsize", fail)
            _check_real_size(realsize, max_member_bytes, fail)
            entries, map_bytes = _pax10_sparse_map(stream, size, fail)
        else:
            version = "0.0" if pax_sparse else "0.1" if "GNU.sparse.map" in pax else "(unknown version)"
            fail = _SparseError(name, f"pax {version}", url, pos)
            realsize = _pax_real_size(pax, "GNU.sparse.size", fail)
            _check_real_size(realsize, max_member_bytes, fail)
            entries = _pax0x_sparse_map(pax, pax_sparse, version, fail)
    stored = size - map_bytes
    _check_sparse_map(entries, realsize, stored, fail)
    padded = (size + BLOCK - 1) // BLOCK * BLOCK - map_bytes
    if want is not None and not want(name):
        stream.skip(padded, "member", name)
        return name, None
    data = stream.read_member(stored, padded, name)
    return name, stream.own(_expand_sparse(data, entries, realsize))


def _check_real_size(realsize: int, max_member_bytes: int, fail: _SparseError) -> None:
    # The limit is on what the member becomes in memory, not on the few bytes it stores.
    if realsize > max_member_bytes:
        raise fail(f"stands for {realsize} bytes, more than max_member_bytes={max_member_bytes}")


def _pax_real_size(pax: dict[str, str], key: str, fail: _SparseError) -> int:
    # 0.x write GNU.sparse.size, 1.0 GNU.sparse.realsize; take either, as GNU tar does
    text = pax.get(key, pax.get("GNU.sparse.realsize" if key == "GNU.sparse.size" else "GNU.sparse.size"))
    if text is None:
        raise fail(f"no real size ({key} record) in its PAX header")
    value = _decimal(text)
    if value is None:
        raise fail(f"invalid real size {text[:30]!r} ({key})")
    return value


def _gnu_sparse_map(stream: _Stream | _Mapped, header: bytes, fail: _SparseError) -> list[tuple[int, int]]:
    """The old GNU map: 4 entries in the header, 21 in each extension header that follows it
    while the previous one's isextended byte is set. An entry whose numbytes field starts with
    NUL ends the map (as GNU tar reads it); nothing may follow that."""
    entries: list[tuple[int, int]] = []
    what = f"sparse map entry of member {fail.name!r}"
    block, count, extended = header[386:482], 4, header[482]
    ended = False
    extensions = 0
    while True:
        for i in range(count):
            entry = block[i * _GNU_ENTRY : (i + 1) * _GNU_ENTRY]
            if entry[12] == 0:
                ended = True
            elif ended:
                raise fail("a map entry after the end of the map")
            else:
                entries.append((_number(entry[:12], what, fail.url, fail.pos), _number(entry[12:], what, fail.url, fail.pos)))
        if not extended:
            return entries
        if ended:
            raise fail("an extension header announced after the end of the map")
        extensions += 1
        if extensions * BLOCK > _MAX_META_BYTES:
            raise fail(f"a sparse map of more than {_MAX_META_BYTES} bytes of extension headers")
        ext = stream.read_exact(BLOCK, "the sparse extension header of member", fail.name)
        block, count, extended = ext[:504], 21, ext[504]


def _pax0x_sparse_map(
    pax: dict[str, str], pax_sparse: list[tuple[bytes, str]] | None, version: str, fail: _SparseError
) -> list[tuple[int, int]]:
    """Format 0.0: GNU.sparse.offset / GNU.sparse.numbytes records, alternating; 0.1: one
    GNU.sparse.map record, ``offset,numbytes,...``. GNU.sparse.numblocks, when given, counts them."""
    if version == "0.0":
        assert pax_sparse
        if "GNU.sparse.map" in pax:
            raise fail("both GNU.sparse.offset records (0.0) and a GNU.sparse.map (0.1)")
        values: list[str] = []
        for i, (keyword, value) in enumerate(pax_sparse):
            if keyword != _SPARSE_00_KEYS[i % 2]:
                raise fail(f"{keyword.decode()} record out of turn: GNU.sparse.offset and GNU.sparse.numbytes must alternate")
            values.append(value)
        if len(values) % 2:
            raise fail("a GNU.sparse.offset record without its GNU.sparse.numbytes")
    elif version == "0.1":
        text = pax["GNU.sparse.map"]
        values = text.split(",") if text else []
        if len(values) % 2:
            raise fail(f"GNU.sparse.map has an odd number of values ({len(values)}): not offset,numbytes pairs")
    else:
        raise fail("GNU.sparse records without a sparse map (neither GNU.sparse.major/minor, GNU.sparse.map nor GNU.sparse.offset)")
    entries = _sparse_pairs(values, fail)
    numblocks = pax.get("GNU.sparse.numblocks")
    if numblocks is not None and _decimal(numblocks) != len(entries):
        raise fail(f"GNU.sparse.numblocks={numblocks[:30]!r} but the map has {len(entries)} entries")
    return entries


def _sparse_pairs(values: list[str] | list[bytes], fail: _SparseError) -> list[tuple[int, int]]:
    """``offset, numbytes, offset, numbytes, ...`` as decimal text → ``[(offset, numbytes), ...]``."""
    numbers: list[int] = []
    for value in values:
        number = _decimal(value)
        if number is None:
            raise fail(f"invalid number {value[:30]!r} in the sparse map")
        numbers.append(number)
    return list(zip(numbers[::2], numbers[1::2], strict=True))


def _pax10_sparse_map(stream: _Stream | _Mapped, size: int, fail: _SparseError) -> tuple[list[tuple[int, int]], int]:
    """Format 1.0: the map opens the member's data, decimal numbers one a line (the entry count,
    then offset and numbytes of each), padded to a block. Returns the entries and the map's
    length in bytes. Read a block at a time, counting newlines, so a hostile count costs no more
    than the blocks the member really has."""
    parts: list[bytes] = []
    newlines = 0
    need: int | None = None  # lines the map has: 1 + 2 x entries, once the count is read
    while need is None or newlines < need:
        if (len(parts) + 1) * BLOCK > size:
            raise fail(f"the sparse map runs past the member's {size} stored bytes")
        if (len(parts) + 1) * BLOCK > _MAX_META_BYTES:
            raise fail(f"a sparse map of more than {_MAX_META_BYTES} bytes")
        block = stream.read_exact(BLOCK, "the sparse map of member", fail.name)
        parts.append(block)
        newlines += block.count(b"\n")
        if need is None and newlines:
            first = b"".join(parts).split(b"\n", 1)[0]
            count = _decimal(first)
            if count is None:
                raise fail(f"invalid entry count {first[:30]!r} in the sparse map")
            if count > _MAX_META_BYTES // 4:  # each entry takes 4 bytes at least: "0\n0\n"
                raise fail(f"a sparse map of {count} entries, larger than {_MAX_META_BYTES} bytes")
            need = 1 + 2 * count
    lines = b"".join(parts).split(b"\n", need)[1:need]
    return _sparse_pairs(lines, fail), len(parts) * BLOCK


def _check_sparse_map(entries: list[tuple[int, int]], realsize: int, stored: int, fail: _SparseError) -> None:
    end = 0
    total = 0
    for offset, numbytes in entries:
        if offset < end:
            raise fail(
                f"map entry at offset {offset} overlaps or comes before the previous one (ending at {end}): "
                "entries must be in order and disjoint"
            )
        end = offset + numbytes
        if end > realsize:
            raise fail(f"map entry {offset}+{numbytes} ends past the real size {realsize}")
        total += numbytes
    if total != stored:
        raise fail(f"the map covers {total} bytes but {stored} are stored")


def _expand_sparse(data: bytes | memoryview, entries: list[tuple[int, int]], realsize: int) -> bytes:
    """The file: the stored chunks at their offsets, zeros between them, in one allocation."""
    view = memoryview(data)
    largest = 0
    end = 0
    for offset, numbytes in entries:
        largest = max(largest, offset - end)
        end = offset + numbytes
    zeros = memoryview(bytes(max(largest, realsize - end)))  # calloc'd: untouched pages cost nothing
    parts: list[memoryview] = []
    at = 0
    end = 0
    for offset, numbytes in entries:
        if offset > end:
            parts.append(zeros[: offset - end])
        if numbytes:
            parts.append(view[at : at + numbytes])
        at += numbytes
        end = offset + numbytes
    if realsize > end:
        parts.append(zeros[: realsize - end])
    return b"".join(parts)


def _member_name(header: bytes, long_name: str | None, pax: dict[str, str]) -> str:
    if "path" in pax:
        return pax["path"]
    if long_name is not None:
        return long_name
    name = _nul_str(header[0:100])
    # POSIX ustar: a prefix field extends the name (its first byte tells, without decoding it)
    if header[345] and header[257:263] == b"ustar\x00":
        name = _nul_str(header[345:500]) + "/" + name
    return name


def iter_samples(
    raw: TarSource,
    *,
    url: str = "",
    start: int = 0,
    chunk: int = 1 << 20,
    max_member_bytes: int = 1 << 31,
    expected_size: int | None = None,
    expected_xxh3_128: str | None = None,
    map_files: bool = True,
    zero_copy: bool = False,
    log: MemberLog | None = None,
) -> Iterator[dict[str, Any]]:
    """Yield WebDataset samples ``{"__key__": key, "__url__": url, field: bytes, ...}``
    (``memoryview`` fields with ``zero_copy``; see :func:`iter_members`).

    ``start`` skips that many samples first without keeping their data (resuming a lease at the
    offset the master recorded). Errors are :class:`~loader.errors.CorruptShard`.

    ``log`` (a fresh :class:`MemberLog`): filled with where each sample's members lie, complete
    once the whole shard was read and checked (:mod:`loader.tarindex` keeps it).
    """
    if start < 0:
        raise ValueError("start must be >= 0")
    if log is not None and start:
        log.sliced = False  # the skipped samples' members are not logged
    index = -1  # index of the sample the current member belongs to
    current_key: str | None = None
    field = ""  # the field of the member want() accepted last, i.e. of the member yielded next
    sample: dict[str, Any] | None = None

    def want(name: str) -> bool:
        nonlocal index, current_key, field
        # Called once per regular member before its data is read: track sample boundaries here
        # so skipped samples never have their data read into memory.
        if name.startswith("__") and _META_RE.match(name):
            return False
        parts = split_name(name)
        if parts is None:
            return False
        if parts[0] != current_key:
            current_key = parts[0]
            index += 1
        field = parts[1]
        return index >= start

    for name, data in iter_members(
        raw,
        url=url,
        chunk=chunk,
        max_member_bytes=max_member_bytes,
        expected_size=expected_size,
        expected_xxh3_128=expected_xxh3_128,
        want=want,
        map_files=map_files,
        zero_copy=zero_copy,
        log=log,
    ):
        if data is None:
            continue
        key: str = current_key  # type: ignore[assignment]  # want() has just split this member's name
        if sample is None or sample["__key__"] != key:
            if sample is not None:
                yield sample
            sample = {"__key__": key, "__url__": url}
        if field in sample:
            raise CorruptShard(f"member {name!r} repeats field {field!r} of sample {key!r}", url=url)
        sample[field] = data
        if log is not None:
            log.names.append((key, field))
    if log is not None:
        log.finished = True  # the end of the archive, the size and the checksum checked
    if sample is not None:
        yield sample
