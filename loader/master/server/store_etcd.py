"""The high-availability state store: the journal and its snapshots in etcd.

Layout under the prefix (``/shardcache`` by default)::

    <prefix>/leader                      leadership key (see election.py)
    <prefix>/log/<last seq, 16 hex>      one group-commit batch: {"records": [[seq, text], ...]}
                                         or {"blob": n} when stored in n chunks under blob/
    <prefix>/blob/<seq>/<i>              chunks of a batch too large for one etcd value
    <prefix>/snap                        {"seq": S, "chunks": n}: the snapshot in force
    <prefix>/snapdata/<S>/<i>            chunks of snapshot S (zlib-compressed JSON)

Every write is a transaction that first compares the leader key's create revision with the
writer's fencing token, so only the current leader changes anything. A snapshot's chunks are
written first under their own sequence number (invisible until referenced); one final
transaction points ``snap`` at them and deletes the log, blobs and older snapshot below it.
Values are kept under etcd's default request limit (1.5 MiB) by chunking.
"""

from __future__ import annotations

import asyncio
import json
import zlib
from collections.abc import Callable
from typing import Any

from loader.master.server.etcd import EtcdClient, EtcdError, cmp_create_revision, op_delete, op_put, prefix_end
from loader.master.server.journal import LogRecord, compress_text

__all__ = ["EtcdStore", "Fenced"]

_CHUNK = 512 * 1024


class Fenced(EtcdError):
    """This master is no longer the leader: its write was refused."""


def _seq_key(seq: int) -> str:
    return f"{seq:016x}"


class EtcdStore:
    def __init__(self, etcd: EtcdClient, prefix: str, fence: Callable[[], int], *, compact: bool = True) -> None:
        self._etcd = etcd
        self._p = prefix.rstrip("/")
        self._fence = fence
        self._compact = compact

    def __repr__(self) -> str:
        return f"EtcdStore(prefix={self._p!r})"

    def key(self, *parts: str) -> bytes:
        return "/".join((self._p, *parts)).encode()

    async def open(self) -> None:
        await self._etcd.range(self.key("snap"))  # reachability check

    async def close(self) -> None:
        pass  # the etcd client belongs to the service

    def _guard(self) -> list[dict[str, Any]]:
        token = self._fence()
        if not token:
            raise Fenced("this master is not the leader")
        return [cmp_create_revision(self.key("leader"), token)]

    async def _txn(self, ops: list[dict[str, Any]]) -> int:
        ok, _, revision = await self._etcd.txn(self._guard(), ops)
        if not ok:
            raise Fenced("another master took over leadership; this one stepped down")
        return revision

    async def _put_chunks(self, base: str, data: bytes) -> int:
        chunks = [data[i : i + _CHUNK] for i in range(0, len(data), _CHUNK)] or [b""]
        for i, chunk in enumerate(chunks):
            await self._txn([op_put(self.key(base, f"{i:06d}"), chunk)])
        return len(chunks)

    async def _get_chunks(self, base: str, count: int) -> bytes:
        start = self.key(base, "")
        kvs = await self._etcd.range_all(start, prefix_end(start), page=4)
        if len(kvs) < count:
            raise EtcdError(f"etcd state is incomplete: {base} has {len(kvs)} of {count} chunks")
        return b"".join(kv.value for kv in kvs[:count])

    async def load(self) -> tuple[dict[str, Any] | None, int, list[LogRecord]]:
        snap, snap_seq, records = await self.load_text()
        return (json.loads(snap) if snap is not None else None), snap_seq, records

    async def load_text(self) -> tuple[str | None, int, list[LogRecord]]:
        snap: str | None = None
        snap_seq = 0
        meta = await self._etcd.get(self.key("snap"))
        if meta is not None:
            info = json.loads(meta.value)
            snap_seq = int(info["seq"])
            data = await self._get_chunks(f"snapdata/{_seq_key(snap_seq)}", int(info["chunks"]))
            # The text, not its decoded dict (MasterState.from_text reads the specs in place);
            # inflated on a thread: the election's keep-alive runs on the event loop meanwhile.
            snap = await asyncio.to_thread(_inflate, data)
            del data
        start = self.key("log", _seq_key(snap_seq + 1))
        kvs = await self._etcd.range_all(start, prefix_end(self.key("log", "")))
        records: list[LogRecord] = []
        for kv in kvs:
            body = json.loads(kv.value)
            if "blob" in body:
                last = kv.key.rsplit(b"/", 1)[1].decode()
                body = json.loads(await self._get_chunks(f"blob/{last}", int(body["blob"])))
            records.extend((int(seq), str(text)) for seq, text in body["records"] if int(seq) > snap_seq)
        records.sort()
        return snap, snap_seq, records

    async def write(self, records: list[LogRecord], snapshot: tuple[int, str] | None) -> None:
        if snapshot is not None:
            await self._write_snapshot(*snapshot)
            return
        if not records:
            return
        last = _seq_key(records[-1][0])
        value = json.dumps({"records": records}, separators=(",", ":")).encode()
        if len(value) > _CHUNK:
            count = await self._put_chunks(f"blob/{last}", value)
            value = json.dumps({"blob": count}).encode()
        await self._txn([op_put(self.key("log", last), value)])

    async def _write_snapshot(self, seq: int, state: str) -> None:
        # The snapshot covers every record of this batch: they need no log entry of their own.
        data = await asyncio.to_thread(compress_text, state)
        sk = _seq_key(seq)
        count = await self._put_chunks(f"snapdata/{sk}", data)
        above = _seq_key(seq + 1)
        revision = await self._txn(
            [
                op_put(self.key("snap"), json.dumps({"seq": seq, "chunks": count}).encode()),
                op_delete(self.key("log", ""), self.key("log", above)),
                op_delete(self.key("blob", ""), self.key("blob", above)),
                op_delete(self.key("snapdata", ""), self.key("snapdata", sk)),
            ]
        )
        if self._compact:
            try:
                await self._etcd.compact(revision)
            except EtcdError:
                pass  # history compaction is housekeeping; the next snapshot tries again


def _inflate(data: bytes) -> str:
    text = zlib.decompress(data)
    return text.decode("utf-8")
