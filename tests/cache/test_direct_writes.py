"""Fills written with O_DIRECT (StoreSettings.direct_writes): the same bytes as buffered writes,
whatever lands aligned or not, in order or not, on file systems that take O_DIRECT and those that
refuse it, and readers of the temp file never see stale pages."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import xxhash

from cache import Store, StoreSettings, aligned_buffer

MiB = 1024 * 1024


def make(root: Path, direct: bool = True) -> Store:
    store = Store(StoreSettings(root=root, capacity_bytes=1 << 30, min_free_ratio=0, direct_writes=direct))
    store.open()
    return store


def payload(size: int) -> bytes:
    return os.urandom(size)


def aligned(data: bytes) -> memoryview:
    buffer = aligned_buffer(max(len(data), 4096))
    buffer[: len(data)] = data
    return buffer[: len(data)]


def takes_direct(path: Path) -> bool:
    probe = path / "probe"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o600)
    except OSError:
        return False
    os.close(fd)
    probe.unlink()
    return True


def test_aligned_pieces_go_direct_and_the_tail_buffered(tmp_path):
    if not takes_direct(tmp_path):
        pytest.skip(f"{tmp_path} refuses O_DIRECT")
    store = make(tmp_path / "c")
    data = payload(3 * MiB + 12345)  # three aligned pieces and a tail that is not
    writer = store.begin("b", "k", "etag", len(data), xxhash.xxh3_128_hexdigest(data))
    assert writer._direct is not None
    for offset in range(0, len(data), MiB):
        writer.write_at(offset, aligned(data[offset : offset + MiB]))
    assert not writer._direct_refused, "aligned pieces were refused"
    entry = writer.commit()
    assert store.data_path(entry).read_bytes() == data
    store.close()


def test_out_of_order_parts_hash_what_the_disk_holds(tmp_path):
    """A split fill's later parts land first and are hashed by reading them back: from the disk
    when they were written direct."""
    store = make(tmp_path / "c")
    data = payload(4 * MiB)
    writer = store.begin("b", "k", "etag", len(data), xxhash.xxh3_128_hexdigest(data))
    for offset in (2 * MiB, 3 * MiB, 0, MiB):
        writer.write_at(offset, aligned(data[offset : offset + MiB]))
    writer.hash_upto(len(data))
    entry = writer.commit()
    assert entry.xxh3_128 == xxhash.xxh3_128_hexdigest(data)
    assert store.data_path(entry).read_bytes() == data
    store.close()


def test_an_unaligned_buffer_falls_back_to_buffered_writes(tmp_path):
    store = make(tmp_path / "c")
    data = payload(2 * MiB)
    writer = store.begin("b", "k", "etag", len(data), xxhash.xxh3_128_hexdigest(data))
    # bytes objects keep their data 32 bytes past the object's start: never page-aligned.
    writer.write_at(0, data[:MiB])
    writer.write_at(MiB, bytearray(data[MiB:]))
    entry = writer.commit()
    assert store.data_path(entry).read_bytes() == data
    store.close()


def test_a_reader_of_the_temp_file_sees_direct_writes(tmp_path):
    """Readers of a fill in progress read its temp file through the page cache (sendfile, and
    read-ahead past what they asked for): pages cached while a range was a hole are dropped when
    a direct write covers them."""
    if not takes_direct(tmp_path):
        pytest.skip(f"{tmp_path} refuses O_DIRECT")
    store = make(tmp_path / "c")
    data = payload(2 * MiB)
    writer = store.begin("b", "k", "etag", len(data), xxhash.xxh3_128_hexdigest(data))
    reader = os.open(writer.path, os.O_RDONLY)
    try:
        os.ftruncate(writer.fd, len(data))  # a hole where the bytes will land
        assert os.pread(reader, MiB, MiB) == bytes(MiB)  # zeros, cached now
        writer.write_at(MiB, aligned(data[MiB:]))
        writer.write_at(0, aligned(data[:MiB]))
        assert os.pread(reader, 2 * MiB, 0) == data
    finally:
        os.close(reader)
    writer.commit()
    store.close()


def test_a_file_system_without_o_direct_writes_buffered(tmp_path, monkeypatch):
    """tmpfs before Linux 6.6 and some FUSE file systems refuse O_DIRECT at open (EINVAL)."""
    import errno

    real_open = os.open

    def refusing_open(path, flags, *args):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", refusing_open)
    store = make(tmp_path / "c")
    data = payload(MiB + 7)
    writer = store.begin("b", "k", "etag", len(data), xxhash.xxh3_128_hexdigest(data))
    assert writer._direct is None
    writer.write_at(0, aligned(data[:MiB]))
    writer.write_at(MiB, data[MiB:])
    entry = writer.commit()
    assert store.data_path(entry).read_bytes() == data
    store.close()


def test_off_writes_everything_buffered(tmp_path):
    store = make(tmp_path / "c", direct=False)
    data = payload(MiB)
    writer = store.begin("b", "k", "etag", len(data), xxhash.xxh3_128_hexdigest(data))
    assert writer._direct is None
    writer.write_at(0, aligned(data))
    assert store.data_path(writer.commit()).read_bytes() == data
    store.close()


def resident_pages(path: Path) -> tuple[int, int]:
    """(pages of the file in the page cache, pages in all), by mincore(2)."""
    import ctypes
    import mmap

    size = path.stat().st_size
    pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
    with open(path, "rb") as handle:
        mapped = mmap.mmap(handle.fileno(), size, access=mmap.ACCESS_COPY)
    try:
        address = ctypes.addressof(ctypes.c_char.from_buffer(mapped))
        vector = (ctypes.c_ubyte * pages)()
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.mincore(ctypes.c_void_p(address), ctypes.c_size_t(size), vector) != 0:
            raise OSError(ctypes.get_errno(), "mincore")
        del address
        return sum(v & 1 for v in vector), pages
    finally:
        mapped.close()


def test_direct_bytes_skip_the_page_cache_and_streamed_ones_do_not(tmp_path):
    """What the option is for (no copy into the page cache), and the writer's way around it:
    bytes written with ``direct=False`` go through the page cache."""
    if not takes_direct(tmp_path):
        pytest.skip(f"{tmp_path} refuses O_DIRECT")
    store = make(tmp_path / "c")
    data = payload(2 * MiB)
    writer = store.begin("b", "k", "etag", len(data), xxhash.xxh3_128_hexdigest(data))
    writer.write_at(0, aligned(data[:MiB]))
    writer.writev_at(MiB, [aligned(data[MiB:])], direct=False)
    path = Path(writer.path)
    os.fsync(writer.fd)
    in_cache, pages = resident_pages(path)
    half = pages // 2
    assert in_cache == half, f"{in_cache} of {pages} pages cached: expected only the streamed half"
    writer.commit()
    store.close()
