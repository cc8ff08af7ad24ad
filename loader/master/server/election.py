"""Leader election through one etcd key held by an etcd lease.

A candidate creates ``<prefix>/leader`` (compare: the key does not exist) attached to a lease
it keeps alive; whoever creates it leads. The key's create revision is the leader's fencing
token: every state write compares it, so a deposed leader that has not noticed yet can change
nothing. When the leader dies its lease runs out within ``ttl_s``, etcd deletes the key, and
the first standby to see it gone takes over. A leader that cannot refresh its lease for two
thirds of the TTL steps down on its own, before etcd could hand leadership to someone else.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from loader.master.server.etcd import EtcdClient, EtcdError, cmp_create_revision, op_put, op_range

__all__ = ["Election"]

log = logging.getLogger(__name__)


class Election:
    def __init__(
        self,
        etcd: EtcdClient,
        key: bytes,
        identity: dict[str, Any],
        *,
        ttl_s: int = 3,
        poll_s: float = 0.5,
        on_elected: Callable[[int], Awaitable[None]],
        on_deposed: Callable[[], Awaitable[None]],
    ) -> None:
        self._etcd = etcd
        self.key = key
        self.identity = dict(identity)
        self._value = json.dumps(self.identity, sort_keys=True).encode()
        self._ttl = int(ttl_s)
        self._poll = float(poll_s)
        self._on_elected = on_elected
        self._on_deposed = on_deposed
        self._resign = asyncio.Event()
        self.leader: dict[str, Any] | None = None
        """The current leader's identity as last seen (``{"id", "url"}``), None when unknown."""
        self.revision = 0
        """Our fencing token while we lead (create revision of the leader key), else 0."""
        self._lease = 0

    @property
    def is_leader(self) -> bool:
        return self.revision != 0

    def resign(self) -> None:
        """Give up leadership (e.g. after a failed write); the loop campaigns again afterwards."""
        self._resign.set()

    async def run(self) -> None:
        """Campaign, lead, step down, repeat; runs until cancelled (revoking the lease if leading)."""
        try:
            while True:
                try:
                    await self._campaign_once()
                except EtcdError as exc:
                    log.warning("election: %s", exc)
                    await asyncio.sleep(self._poll)
        finally:
            if self._lease:
                # Hand over at once instead of letting the standbys wait out the TTL.
                lease, self._lease = self._lease, 0
                try:
                    await asyncio.shield(self._etcd.lease_revoke(lease))
                except (EtcdError, asyncio.CancelledError):
                    pass

    async def _campaign_once(self) -> None:
        current = await self._etcd.get(self.key)
        if current is not None:
            self.leader = _decode(current.value)
            await asyncio.sleep(self._poll)
            return
        lease, _ = await self._etcd.lease_grant(self._ttl)
        self._lease = lease
        won, responses, revision = await self._etcd.txn(
            [cmp_create_revision(self.key, 0)], [op_put(self.key, self._value, lease)], [op_range(self.key)]
        )
        if not won:
            self._lease = 0
            await self._etcd.lease_revoke(lease)
            kvs = EtcdClient.range_response(responses[0]) if responses else []
            self.leader = _decode(kvs[0].value) if kvs else None
            await asyncio.sleep(self._poll)
            return
        self.revision = revision
        self.leader = dict(self.identity)
        self._resign.clear()
        log.info("elected leader (fencing revision %d)", revision)
        try:
            await self._on_elected(revision)
            await self._hold(lease)
        finally:
            self.revision = 0
            self.leader = None
            log.info("stepped down from leadership")
            await self._on_deposed()
            if self._lease == lease:
                self._lease = 0
                try:
                    await self._etcd.lease_revoke(lease)
                except EtcdError:
                    pass  # it expires on its own

    async def _hold(self, lease: int) -> None:
        last_ok = time.monotonic()
        interval = self._ttl / 3
        while True:
            try:
                await asyncio.wait_for(self._resign.wait(), timeout=interval)
                return  # resigned
            except TimeoutError:
                pass
            try:
                ttl = await asyncio.wait_for(self._etcd.lease_keepalive(lease), timeout=interval)
            except (TimeoutError, EtcdError) as exc:
                if time.monotonic() - last_ok > self._ttl * 2 / 3:
                    log.warning("cannot refresh the leadership lease (%s): stepping down", exc)
                    return
                continue
            if ttl <= 0:
                log.warning("the leadership lease expired: stepping down")
                return
            last_ok = time.monotonic()


def _decode(raw: bytes) -> dict[str, Any] | None:
    try:
        value = json.loads(raw)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None
