"""Where the master learns the cluster cache's ring: ``shardcache master --cluster URL``.

The leader asks a daemon of the cluster (the first of ``--cluster`` that answers) for its view,
``GET /_shardcache/peers``, every ``--cluster-poll`` seconds, and when the live members or their
nodes changed it logs a :class:`~loader.master.server.state.Placement` event, so jobs with a
``locality_window`` place shards by the very ring the daemons use (``wire.rendezvous`` over the
live members), and a restarted or newly elected master replays the same placements. A daemon
that does not answer costs one bounded request per poll; the ring the state holds stays until a
daemon says otherwise (an empty ring is taken only from a daemon that lists no live member).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Protocol

import aiohttp

from loader.master.errors import MasterError
from loader.master.server.auth import OPERATOR, Caller
from loader.master.server.events import Placement
from loader.master.server.state import MasterState, Result
from wire import jsontext
from wire.peerview import parse_peers

__all__ = ["PlacementPoller", "placement_members"]

log = logging.getLogger(__name__)

_MAX_ANSWER = 4 * 1024 * 1024


def placement_members(doc: Any) -> tuple[tuple[str, str], ...]:
    """The live members of a ``/_shardcache/peers`` answer as (member id, node or ""), sorted;
    ValueError when it is not that document."""
    view = parse_peers(doc)
    return tuple(sorted((m.id, m.node or "") for m in view.live))


class Submitter(Protocol):
    """What the poller needs of the master's service (service.MasterService)."""

    role: str
    state: MasterState | None

    async def submit(self, event: Placement, caller: Caller) -> Result: ...


class PlacementPoller:
    def __init__(self, service: Submitter, urls: tuple[str, ...], interval_s: float, timeout_s: float = 2.0) -> None:
        self.service = service
        self.urls = tuple(u.rstrip("/") for u in urls)
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.last_ok: float | None = None
        self.source: str | None = None
        self.error: str | None = None

    def status(self) -> dict[str, Any]:
        """For the job status: where the ring comes from and whether it is fresh."""
        return {
            "sources": list(self.urls), "source": self.source, "error": self.error,
            "last_ok_s_ago": None if self.last_ok is None else round(time.monotonic() - self.last_ok, 1),
        }

    async def run(self) -> None:
        timeout = aiohttp.ClientTimeout(total=self.timeout_s)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            while True:
                if self.service.role == "leader":
                    try:
                        await self.poll_once(session)
                    except Exception as exc:  # a bug here must not end the polls: the next one may work
                        self.error = f"poll failed: {type(exc).__name__}: {exc}"[:300]
                        log.exception("polling the cluster's ring failed")
                await asyncio.sleep(self.interval_s)

    async def poll_once(self, session: aiohttp.ClientSession) -> bool:
        errors = []
        for url in self.urls:
            try:
                members = await self._fetch(session, url)
            except (TimeoutError, aiohttp.ClientError, OSError, ValueError) as exc:
                errors.append(f"{url}: {type(exc).__name__}: {exc}"[:300])
                continue
            self.last_ok, self.source, self.error = time.monotonic(), url, None
            state = self.service.state
            if state is not None and dict(members) != state.ring.node_of:
                try:
                    await self.service.submit(Placement(members), OPERATOR)
                except MasterError as exc:  # deposed or the store failed meanwhile: next poll
                    self.error = f"placement not recorded: {exc}"
                    return False
                log.info("cluster ring from %s: %d live members", url, len(members))
            return True
        self.error = "; ".join(errors) + " (the ring the master holds is kept)"
        log.warning("no cluster daemon answered /_shardcache/peers: %s", self.error)
        return False

    async def _fetch(self, session: aiohttp.ClientSession, url: str) -> tuple[tuple[str, str], ...]:
        async with session.get(url + "/_shardcache/peers") as response:
            if response.status != 200:
                raise ValueError(f"answered HTTP {response.status}")
            body = await response.content.read(_MAX_ANSWER + 1)
            if len(body) > _MAX_ANSWER:
                raise ValueError("the answer is too large")
        return placement_members(jsontext.loads(body))
