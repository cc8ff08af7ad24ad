"""A shard's whole-file hash taken on a thread of its own while its samples are handed out.

A zero-copy read of a mapped shard does not touch the bytes it hands out: the members are views
of the mapping. Its own work per sample is a few microseconds of Python, so the hash of every
byte (:attr:`~loader.settings.LoaderSettings.rehash_warm`) was most of a warm epoch: xxh3 at
8-12 GB/s on one core against a loop that runs at 13-17 GB/s without it. xxhash releases the GIL
while it hashes a buffer, so on a thread of its own the hash runs on another core while the loop
hands out views, and the shard's check costs the longer of the two instead of their sum.

The check itself is unchanged: every byte of the file, headers included, is hashed, and the
reader compares the digest after the shard's last sample, before it reads on, as it does when it
hashes inline; a mismatch is still :class:`~loader.errors.CorruptShard` at the same place. A copying
read keeps hashing inline: there the hash is what brings each sample into the CPU cache for the
copy, and splitting them measured slower (see :func:`loader.tarindex.iter_indexed`).

One thread per shard read, started by the reading process (a forked DataLoader worker starts its
own: no pool to inherit across ``fork``); it stops at the next chunk when the read is abandoned.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

__all__ = ["HashBehind", "HASH_CHUNK_BYTES", "HASH_LEAD_BYTES"]

HASH_CHUNK_BYTES = 4 << 20
"""Bytes hashed per call: small enough that :attr:`HashBehind.done` moves often (mapped pages
are released only behind it) and a cancel is quick, large enough that the GIL is taken rarely."""

HASH_LEAD_BYTES = 32 << 20
"""How far the hash may run ahead of what the reader has handed out. The pages it reads count in
the process's RSS until they are released behind both the hash and the reader (by the hash's
thread, ``loader.tar.release_pages``), so ahead of a slow trainer an unbounded hash would map a
whole shard (up to GiBs) at once."""


class HashBehind:
    """``hasher.update(view[0:size])`` in chunks of :data:`HASH_CHUNK_BYTES` on a daemon thread.

    :attr:`done` is how many bytes have gone in (it only grows); :meth:`read_to` tells it how far
    the reader has handed out (it hashes at most :data:`HASH_LEAD_BYTES` past that);
    :meth:`digest` waits for the rest and gives the hex digest; :meth:`cancel` stops at the next
    chunk and waits for the thread, so the caller may close the mapping afterwards."""

    def __init__(self, hasher: Any, view: memoryview, size: int, read_from: int = 0,
                 release: Callable[[int, int], int] | None = None, name: str = "shardcache-hash") -> None:
        self._hasher = hasher
        self._view = view
        self._size = size
        # release(released, offset) -> released: gives back the mapping's pages before offset
        # (loader.tar.release_pages). Called on this thread only, behind both the hash and the
        # reader, so a 1 GiB shard never maps more than the lead at once.
        self._release = release
        self._released = 0
        self._read = read_from
        self._stop = False
        self._error: BaseException | None = None
        self._moved = threading.Condition(threading.Lock())
        self._limit = read_from + HASH_LEAD_BYTES
        self.done = 0
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def read_to(self, offset: int) -> None:
        """The reader has handed out the bytes before ``offset``: the hash may run on past it."""
        self._read = offset
        limit = offset + HASH_LEAD_BYTES
        if limit > self._limit:
            with self._moved:
                self._limit = limit
                self._moved.notify()

    def _run(self) -> None:
        update, view, size = self._hasher.update, self._view, self._size
        at = 0
        try:
            while at < size:
                if at >= self._limit:
                    with self._moved:
                        while at >= self._limit and not self._stop:
                            self._moved.wait()
                if self._stop:
                    return
                end = min(at + HASH_CHUNK_BYTES, size)
                update(view[at:end])
                at = end
                self.done = at
                upto = min(at, self._read)
                if self._release is not None and upto - self._released >= HASH_CHUNK_BYTES:
                    self._released = self._release(self._released, upto)
        except BaseException as exc:  # noqa: BLE001 - handed to the reader by digest()
            self._error = exc

    def digest(self) -> str:
        """The hex digest of all ``size`` bytes, once the thread has hashed them."""
        self.read_to(self._size)
        self._thread.join()
        if self._error is not None:
            raise self._error
        if self.done != self._size:
            raise RuntimeError("the hash was cancelled before it ended")
        return str(self._hasher.hexdigest())

    def cancel(self) -> None:
        """Stop at the next chunk and wait for the thread (it no longer reads the mapping)."""
        with self._moved:
            self._stop = True
            self._moved.notify()
        self._thread.join()
