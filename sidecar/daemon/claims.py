"""A caller's checksum is a claim, not an order: what a disagreeing ``x-shardcache-xxh3-128`` may
make the daemon do.

The loader sends its manifest's xxh3-128 with every read. When the cached copy hashes to
something else, either the copy went bad or the caller's manifest is stale (or the caller lies),
and only the first is a reason to touch what every other caller reads:

- the daemon first re-hashes its own file (at most once per entry per
  :attr:`ClaimSettings.recheck_interval_s`: a caller cannot make it hash a shard on every
  request); a file that fails its own check is dropped and fetched again;
- an entry the origin vouched for (:attr:`cache.Entry.verified`) and whose file checks out is
  right: the caller gets ``409 ChecksumMismatch`` naming both hashes, and nothing is refetched;
- an *unverified* entry is fetched again once per claim (the same caller asking again with the
  same hash gets the mismatch), and each caller gets :attr:`ClaimSettings.refetches_per_minute`
  such refetches at most. The new copy replaces the old one atomically, so readers of the old
  one are never cut off; if it still disagrees, the caller gets the mismatch.
"""

from __future__ import annotations

import socket
import struct
import time
from collections import OrderedDict
from dataclasses import dataclass

from aiohttp import web

from cache import Entry
from sidecar.daemon.ratelimit import TokenBucket

__all__ = ["ClaimSettings", "Claims", "caller_of"]

_REMEMBERED = 65536  # (entry, claim) pairs and callers kept: bounded memory whatever callers send


@dataclass(frozen=True)
class ClaimSettings:
    recheck_interval_s: float = 60.0
    """A disagreeing claim re-hashes the entry's file at most this often."""

    refetches_per_minute: float = 6.0
    """Refetches of unverified entries one caller's claims may cause per minute (a token bucket
    of that size, refilled at that rate)."""


class Claims:
    """The bookkeeping of disputed entries; see the module docstring. Loop-only (no locks)."""

    def __init__(self, settings: ClaimSettings) -> None:
        self.settings = settings
        self._rechecked: OrderedDict[str, float] = OrderedDict()
        self._refetched: OrderedDict[tuple[str, str], None] = OrderedDict()
        self._budgets: OrderedDict[str, TokenBucket] = OrderedDict()

    def may_recheck(self, entry: Entry) -> bool:
        now = time.monotonic()
        last = self._rechecked.get(entry.id)
        if last is not None and now - last < self.settings.recheck_interval_s:
            return False
        _remember(self._rechecked, entry.id, now)
        return True

    def may_refetch(self, entry: Entry, claim: str, caller: str) -> bool:
        """Whether this disagreeing claim may fetch the unverified ``entry`` again; counted if so."""
        if entry.verified:
            return False
        pair = (entry.id, claim)
        if pair in self._refetched:
            return False
        per_minute = self.settings.refetches_per_minute
        budget = self._budgets.get(caller) or TokenBucket(per_minute / 60.0, burst=per_minute)
        _remember(self._budgets, caller, budget)
        if not budget.try_take(1):
            return False
        _remember(self._refetched, pair, None)
        return True


def _remember(table: OrderedDict, key: object, value: object) -> None:
    table[key] = value
    table.move_to_end(key)
    while len(table) > _REMEMBERED:
        table.popitem(last=False)


_PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


def caller_of(request: web.Request) -> str:
    """Who sent ``request``, as far as the transport tells: the peer address over TCP, the
    process (pid and uid, ``SO_PEERCRED``) over a unix socket, where a pod's sidecar connects."""
    transport = request.transport
    sock = transport.get_extra_info("socket") if transport is not None else None
    if sock is not None and sock.family == socket.AF_UNIX:
        try:
            pid, uid, _ = _PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
        except OSError:
            return "unix"
        return f"unix pid {pid} uid {uid}"
    return request.remote or "unknown"
