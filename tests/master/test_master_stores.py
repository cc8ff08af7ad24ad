"""The two state stores on their own: SQLite and a real etcd keep the journal and snapshots
(chunked when large), refuse a second owner, and etcd refuses writes from a deposed leader."""

from __future__ import annotations

import asyncio
import json
import os
import uuid
from pathlib import Path
from typing import Any

import pytest

from loader.master.errors import StateError
from loader.master.server.etcd import EtcdClient
from loader.master.server.store_etcd import EtcdStore, Fenced
from loader.master.server.store_sqlite import SqliteStore
from tests.support.masters import EtcdServer


def big_state(size: int) -> dict[str, Any]:
    # Incompressible text, so the compressed snapshot really spans several etcd values.
    return {"version": 1, "blob": os.urandom(size).hex()}


def test_sqlite_journal_snapshot_and_reload(tmp_path: Path) -> None:
    async def main() -> None:
        store = SqliteStore(tmp_path / "m.db")
        await store.open()
        await store.write([(1, "a"), (2, "b")], None)
        await store.write([(3, "c")], (3, json.dumps({"version": 1, "x": 1})))
        await store.write([(4, "d"), (5, "e")], None)
        assert await store.load() == ({"version": 1, "x": 1}, 3, [(4, "d"), (5, "e")])
        # A second master on the same file is refused with a clear message.
        other = SqliteStore(tmp_path / "m.db")
        with pytest.raises(StateError, match="another master"):
            await other.open()
        await other.close()
        await store.close()
        again = SqliteStore(tmp_path / "m.db")
        await again.open()
        assert (await again.load())[2] == [(4, "d"), (5, "e")]
        with pytest.raises(StateError):
            await again.write([(5, "dup")], None)  # a sequence number is never reused
        await again.close()

    asyncio.run(main())


def test_sqlite_unusable_location_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("not a directory")

    async def main() -> None:
        store = SqliteStore(tmp_path / "file" / "m.db")
        with pytest.raises(StateError, match="--state"):
            await store.open()
        await store.close()

    asyncio.run(main())


def test_etcd_store_chunks_and_fencing(etcd_server: EtcdServer) -> None:
    prefix = f"/st-{uuid.uuid4().hex[:8]}"

    async def main() -> None:
        async with EtcdClient([etcd_server.endpoint]) as etcd:
            leader = f"{prefix}/leader".encode()
            await etcd.put(leader, b"me")
            token = (await etcd.get(leader)).create_revision  # type: ignore[union-attr]
            store = EtcdStore(etcd, prefix, lambda: token)
            await store.open()
            assert await store.load() == (None, 0, [])
            await store.write([(1, "a"), (2, "b")], None)
            large = [(3, "x" * 700_000), (4, "y" * 700_000)]  # over one etcd value: stored as chunks
            await store.write(large, None)
            snap, seq, records = await store.load()
            assert (snap, seq, records) == (None, 0, [(1, "a"), (2, "b"), *large])

            state = big_state(1_500_000)  # ~3 MB of JSON: several chunks
            await store.write([(5, "c")], (5, json.dumps(state)))
            await store.write([(6, "d")], None)
            assert await store.load() == (state, 5, [(6, "d")])
            old_log = await etcd.range_all(f"{prefix}/log/".encode(), f"{prefix}/log0".encode())
            assert len(old_log) == 1, "the log below the snapshot is dropped"

            # Another master takes over (the key is re-created): the old one can change nothing.
            await etcd.delete(leader)
            await etcd.put(leader, b"someone-else")
            with pytest.raises(Fenced):
                await store.write([(7, "e")], None)
            with pytest.raises(Fenced):
                await store.write([(7, "e")], (7, json.dumps({"version": 1})))
            assert await store.load() == (state, 5, [(6, "d")])

    asyncio.run(main())


def test_etcd_unreachable_is_a_state_error() -> None:
    from tests.support.processes import free_port

    async def main() -> None:
        async with EtcdClient([f"http://127.0.0.1:{free_port()}"], timeout_s=1) as etcd:
            with pytest.raises(StateError, match="etcd unreachable"):
                await etcd.get(b"/x")

    asyncio.run(main())
