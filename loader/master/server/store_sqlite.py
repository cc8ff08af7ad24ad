"""The embedded state store: one SQLite file holding a snapshot and the event log after it.

Every call runs on one dedicated thread (a SQLite connection belongs to one thread, and one
writer is all a journal needs), so the event loop never blocks on the disk. WAL with
``synchronous=FULL`` makes each commit durable before it returns: a ``kill -9`` (or a power
cut) after an answer never loses the change it answered for. A lock file held with ``flock``
keeps a second master off the same file; the kernel drops it when the process dies.
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
import sqlite3
import zlib
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from loader.master.errors import StateError
from loader.master.server.journal import LogRecord, compress_text

__all__ = ["SqliteStore"]

T = TypeVar("T")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (k TEXT PRIMARY KEY, v TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS log (last INTEGER PRIMARY KEY, first INTEGER NOT NULL, records TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS snapshot (id INTEGER PRIMARY KEY CHECK (id = 1), seq INTEGER NOT NULL, state BLOB NOT NULL);
"""
_FORMAT = "2"


class SqliteStore:
    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="master-sqlite")
        self._conn: sqlite3.Connection | None = None
        self._lock_fd: int | None = None

    def __repr__(self) -> str:
        return f"SqliteStore({str(self.path)!r})"

    async def _call(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def open(self) -> None:
        await self._call(self._open)

    async def load_text(self) -> tuple[str | None, int, Iterator[LogRecord]]:
        snap, snap_seq, rows = await self._call(self._load)
        return snap, snap_seq, _split_rows(rows, snap_seq)

    async def load(self) -> tuple[dict[str, Any] | None, int, list[LogRecord]]:
        snap, snap_seq, records = await self.load_text()
        return (json.loads(snap) if snap is not None else None), snap_seq, list(records)

    async def write(self, records: list[LogRecord], snapshot: tuple[int, str] | None) -> None:
        await self._call(self._write, records, snapshot)

    async def close(self) -> None:
        try:
            await self._call(self._close)
        finally:
            self._executor.shutdown(wait=False)

    # -- on the store thread --

    def _open(self) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(str(self.path) + ".lock", os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise StateError(
                f"cannot create the master state file {self.path}: {exc.strerror}; "
                "pass a writable location with --state sqlite:///path/to/master.db"
            ) from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            raise StateError(
                f"another master is using {self.path}: stop it, or give this one its own --state"
            ) from exc
        self._lock_fd = fd
        try:
            # No statement cache: a cached statement keeps its last bound parameters (SQLite's
            # copy of them) until it is bound again, so the ~73 MB text of a 1M-shard job's create
            # record stayed in memory until the next write. Preparing a statement per batch
            # costs microseconds.
            conn = sqlite3.connect(str(self.path), isolation_level=None, check_same_thread=False, cached_statements=0)
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=FULL")
            conn.executescript(_SCHEMA)
            row = conn.execute("SELECT v FROM meta WHERE k = 'format'").fetchone()
            if row is None:
                conn.execute("INSERT INTO meta (k, v) VALUES ('format', ?)", (_FORMAT,))
            elif row[0] != _FORMAT:
                raise StateError(f"{self.path} holds master state format {row[0]}, this master reads format {_FORMAT}")
        except sqlite3.Error as exc:
            self._close()
            raise StateError(f"cannot open the master state file {self.path}: {exc}") from exc
        self._conn = conn

    def _load(self) -> tuple[str | None, int, list[tuple[int, int, str]]]:
        """The snapshot's text and the log's rows (one per batch, still joined: a million small
        records cost their text, not a million string objects, until they are replayed)."""
        conn = self._require()
        try:
            row = conn.execute("SELECT seq, state FROM snapshot WHERE id = 1").fetchone()
            snap: str | None = None
            snap_seq = 0
            if row is not None:
                snap_seq = int(row[0])
                data = zlib.decompress(row[1])
                del row
                snap = data.decode("utf-8")
                del data  # the text alone from here on (a 1M-shard job's is ~73 MB)
            rows: list[tuple[int, int, str]] = []
            for last, first, text in conn.execute("SELECT last, first, records FROM log WHERE last > ? ORDER BY last", (snap_seq,)):
                text = str(text)
                count = text.count("\n") + 1
                if count != last - first + 1:
                    raise ValueError(f"log batch {first}..{last} holds {count} records")
                rows.append((int(last), int(first), text))
        except (sqlite3.Error, zlib.error, ValueError) as exc:
            raise StateError(f"cannot read the master state from {self.path}: {exc}") from exc
        return snap, snap_seq, rows

    def _write(self, records: list[LogRecord], snapshot: tuple[int, str] | None) -> None:
        conn = self._require()
        blob = compress_text(snapshot[1]) if snapshot else None
        # One row per batch, not per record: each SQLite step releases and re-takes the GIL, and
        # every re-take can wait behind the busy event loop thread. Records are JSON (no raw
        # newline) with consecutive sequence numbers, so a batch is their lines.
        first, last = records[0][0], records[-1][0]
        if last - first + 1 != len(records) or (snapshot is not None and snapshot[0] != last):
            raise StateError(f"journal batch {first}..{last} is not contiguous or not covered by its snapshot")
        try:
            if snapshot is None:
                # One statement in autocommit mode is its own durable transaction: a single
                # SQLite step (and GIL hand-over) per batch.
                conn.execute("INSERT INTO log (last, first, records) VALUES (?, ?, ?)", (last, first, "\n".join(r for _, r in records)))
                return
            conn.execute("BEGIN IMMEDIATE")
            try:
                conn.execute("INSERT OR REPLACE INTO snapshot (id, seq, state) VALUES (1, ?, ?)", (snapshot[0], blob))
                conn.execute("DELETE FROM log WHERE last <= ?", (snapshot[0],))
                conn.execute("COMMIT")
            except BaseException:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                raise
        except sqlite3.Error as exc:
            raise StateError(f"cannot write the master state to {self.path}: {exc}") from exc

    def _require(self) -> sqlite3.Connection:
        if self._conn is None:
            raise StateError("the SQLite state store is not open")
        return self._conn

    def _close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None


def _split_rows(rows: list[tuple[int, int, str]], after: int) -> Iterator[LogRecord]:
    """The records of the log ``rows`` with a sequence number above ``after``, in order, each row
    split as it is reached and let go once replayed."""
    rows.reverse()
    while rows:
        last, first, text = rows.pop()
        if first == last:  # one record (a large job's create often is): the row's text is it
            if first > after:
                yield first, text
            continue
        start = 0
        for seq in range(first, last + 1):
            end = text.find("\n", start)
            if end < 0:
                end = len(text)
            if seq > after:
                yield seq, text[start:end]
            start = end + 1
