"""The daemon's one read path (:mod:`sidecar.daemon.reads`), driven directly: a real store in a tmp
directory, the real fetcher, and a real ``file://`` origin whose files the tests write and change.

The front ends' answers are covered where they are served (test_s3_api, test_handles, the warm-up
tests); these check the rules the front ends no longer hold: lookup, claims, fills, what is never
cached, and that a peer's read says so to the origin.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import xxhash

from cache import Store, StoreSettings
from sidecar.daemon.claims import Claims, ClaimSettings
from sidecar.daemon.fills import Fetcher, FetchSettings
from sidecar.daemon.metrics import Metrics
from sidecar.daemon.origins import FileOrigin
from sidecar.daemon.reads import Decided, Filling, Hit, NotCached, ReadContext, ReadService, Uncached
from sidecar.errors import ChecksumMismatch


def digest(data: bytes) -> str:
    return xxhash.xxh3_128_hexdigest(data)


class RecordingOrigin(FileOrigin):
    """A real file origin that records the ``origin_only`` each request was made with."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.routes: list[tuple[str, str, bool]] = []

    async def head(self, bucket: str, key: str, *, origin_only: bool = False):  # type: ignore[no-untyped-def]
        self.routes.append(("head", key, origin_only))
        return await super().head(bucket, key, origin_only=origin_only)

    def open_first(self, bucket: str, key: str, *, origin_only: bool = False):  # type: ignore[no-untyped-def]
        self.routes.append(("open_first", key, origin_only))
        return super().open_first(bucket, key, origin_only=origin_only)


@pytest.fixture
def root(tmp_path: Path) -> Iterator[Path]:
    bucket = tmp_path / "origin" / "bkt"
    (bucket / "ds").mkdir(parents=True)
    yield tmp_path


@asynccontextmanager
async def service(root: Path, store: bool = True) -> AsyncIterator[tuple[ReadService, RecordingOrigin]]:
    origin = RecordingOrigin(root / "origin")
    await origin.start()
    cache = Store(StoreSettings(root=root / "cache", capacity_bytes=1 << 30, min_free_ratio=0.0)) if store else None
    if cache is not None:
        await asyncio.to_thread(cache.open)
    metrics = Metrics()
    fetcher = Fetcher(cache, origin, FetchSettings(), metrics)
    try:
        yield ReadService(cache, fetcher, Claims(ClaimSettings()), metrics), origin
    finally:
        await fetcher.close()
        await origin.close()
        if cache is not None:
            await asyncio.to_thread(cache.close)


def write(root: Path, key: str, data: bytes) -> None:
    (root / "origin" / "bkt" / key).write_bytes(data)


async def cached(reads: ReadService, key: str, timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not reads.cached("bkt", key):
        assert asyncio.get_running_loop().time() < deadline, f"{key} never cached"
        await asyncio.sleep(0.01)


def lookups(reads: ReadService, result: str) -> float:
    return reads.metrics.cache_lookups.labels(result=result)._value.get()


async def read_fd(fd: int, size: int) -> bytes:
    def read() -> bytes:
        try:
            return os.pread(fd, size, 0)
        finally:
            os.close(fd)

    return await asyncio.to_thread(read)


async def close(fd: int) -> None:
    await asyncio.to_thread(os.close, fd)


def flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


def test_miss_then_coalesced_then_hit(root: Path) -> None:
    data = os.urandom(300_000)
    write(root, "ds/0.tar", data)

    async def scenario() -> None:
        async with service(root) as (reads, _):
            ctx = ReadContext("bkt", "ds/0.tar", claim=digest(data))
            first, second = await asyncio.gather(reads.read(ctx), reads.read(ctx))
            assert isinstance(first, Filling) and isinstance(second, Filling)
            assert {first.state, second.state} == {"miss", "coalesced"} and first.fill is second.fill
            hit = await reads.settle(first)
            assert await read_fd(hit.fd, len(data)) == data
            again = await reads.read(ctx)
            assert isinstance(again, Hit) and again.state == "hit" and again.came_from == "local"
            assert await read_fd(again.fd, len(data)) == data
            assert (lookups(reads, "miss"), lookups(reads, "coalesced"), lookups(reads, "hit")) == (1, 1, 1)

    asyncio.run(scenario())


def test_a_claim_is_compared_before_any_byte(root: Path) -> None:
    data = os.urandom(4096)
    write(root, "ds/0.tar", data)
    wrong = "0" * 32

    async def scenario() -> None:
        async with service(root) as (reads, _):
            # A fill's bytes are compared at the seal: the caller gets an error, not the bytes.
            with pytest.raises(ChecksumMismatch, match="the origin's bytes .* the caller expects 0000"):
                await reads.read(ReadContext("bkt", "ds/0.tar", claim=wrong, caller="a"))
            await cached(reads, "ds/0.tar")  # published all the same: it is what the origin vouched for
            # The origin sends no checksum for it (a file origin): an unverified copy is fetched
            # again once for a disagreeing claim, whose bytes disagree again...
            with pytest.raises(ChecksumMismatch, match="the origin's bytes"):
                await reads.read(ReadContext("bkt", "ds/0.tar", claim=wrong, caller="a"))
            assert reads.metrics.claim_outcomes.labels(outcome="refetched")._value.get() == 1
            await cached(reads, "ds/0.tar")
            # ... and then no more: 409 on the cached copy, and counted.
            with pytest.raises(ChecksumMismatch, match="the cached copy .* fetched again for this checksum already"):
                await reads.read(ReadContext("bkt", "ds/0.tar", claim=wrong, caller="a"))
            assert reads.metrics.claim_outcomes.labels(outcome="mismatch")._value.get() == 3
            right = await reads.read(ReadContext("bkt", "ds/0.tar", claim=digest(data)))
            assert isinstance(right, Hit)
            await close(right.fd)

    asyncio.run(scenario())


def test_a_damaged_copy_is_fetched_again(root: Path) -> None:
    data = os.urandom(8192)
    write(root, "ds/0.tar", data)

    async def scenario() -> None:
        async with service(root) as (reads, _):
            first = await reads.read(ReadContext("bkt", "ds/0.tar"))
            assert isinstance(first, Filling)
            await close((await reads.settle(first)).fd)
            store = reads.store
            assert store is not None
            entry = store.lookup("bkt", "ds/0.tar")
            assert entry is not None
            await asyncio.to_thread(flip_byte, store.data_path(entry), 100)  # a flipped byte on the cache disk
            # The reader found its copy wrong (recheck): re-hashed, removed, filled again.
            again = await reads.read(ReadContext("bkt", "ds/0.tar", recheck=True, claim=digest(data)))
            assert isinstance(again, Filling) and again.state == "miss"
            assert await read_fd((await reads.settle(again)).fd, len(data)) == data

    asyncio.run(scenario())


def test_names_never_cached_and_peers_read_the_origin_only(root: Path) -> None:
    write(root, "ds/manifest.json", b"{}")
    write(root, "ds/0.tar", b"x" * 1000)

    async def scenario() -> None:
        async with service(root) as (reads, origin):
            manifest = await reads.read(ReadContext("bkt", "ds/manifest.json"))
            assert isinstance(manifest, Uncached) and "never cached" in manifest.reason
            assert reads.prefetch(ReadContext("bkt", "ds/manifest.json")) is None
            assert not reads.cached("bkt", "ds/manifest.json")
            peer = await reads.read(ReadContext("bkt", "ds/0.tar", peer="node-b"))
            assert isinstance(peer, Filling) and peer.fill.origin_only
            await close((await reads.settle(peer)).fd)
            client = ReadContext("bkt", "ds/1.tar")
            assert not client.origin_only
            assert ("head", "ds/manifest.json", True) in origin.routes
            assert ("open_first", "ds/0.tar", True) in origin.routes
            # A peer's hand-off wants this daemon's copy only.
            with pytest.raises(NotCached, match="not cached on this member"):
                await reads.read(ReadContext("bkt", "ds/2.tar", peer="node-b", if_cached=True))
            assert not any(key == "ds/2.tar" for _, key, _ in origin.routes)

    asyncio.run(scenario())


def test_conditions_decide_before_any_open_or_fill_wait(root: Path) -> None:
    data = os.urandom(2048)
    write(root, "ds/0.tar", data)

    async def scenario() -> None:
        async with service(root) as (reads, _):
            seen: list[str] = []

            def not_modified(obj: object, state: str) -> str:
                seen.append(state)
                return "304"

            decided = await reads.read(ReadContext("bkt", "ds/0.tar"), decide=not_modified)
            assert isinstance(decided, Decided) and decided.answer == "304" and seen == ["miss"]
            await cached(reads, "ds/0.tar")  # the fill went on: the object is wanted, in this version
            decided = await reads.read(ReadContext("bkt", "ds/0.tar"), decide=not_modified)
            assert isinstance(decided, Decided) and seen == ["miss", "hit"]

    asyncio.run(scenario())


def test_without_a_store_everything_streams(root: Path) -> None:
    write(root, "ds/0.tar", b"y" * 10)

    async def scenario() -> None:
        async with service(root, store=False) as (reads, _):
            result = await reads.read(ReadContext("bkt", "ds/0.tar"))
            assert isinstance(result, Uncached) and result.info.size == 10 and result.state == "miss"
            chunks = [c async for c, _ in reads.fetcher.passthrough("bkt", "ds/0.tar", 0, 10, result.info.etag)]
            assert b"".join(chunks) == b"y" * 10

    asyncio.run(scenario())
