"""Who is in the ring: this daemon, the ``--peer`` URLs and the records of ``--peers-dns``, each
health-checked with ``GET /readyz``.

A health check is a signed peer request (:mod:`.signing`) addressed to the member checked, with
a fresh nonce, and only an answer signed by that member for that request counts (with a
``--peer-secret-file``): whatever answers 200 at a member's address without the secret (a reused
pod IP behind a stale DNS record) is not a member, and never gets a read. Why a member is not
live is in ``GET /_shardcache/peers`` (``problem``) and logged when it changes.

Self is always a member and always live. Every other member is checked every
``health_interval_s`` (timeout ``health_timeout_s``); it is live from its first success and dead
after ``dead_after`` failures in a row, so a daemon started at the same moment as its peers finds
them within one interval, and a killed one leaves the ring within about
``dead_after * (interval + timeout)`` seconds. A member is dead until it first answers: a daemon
never sends reads to a peer it has not heard from. The DNS name is re-resolved every
``dns_interval_s`` (``getaddrinfo`` runs on a thread: it blocks); members that leave the records
leave the ring at once, a failed resolution keeps the last answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import ipaddress
import logging
import socket
from dataclasses import dataclass
from typing import Any

import aiohttp

from sidecar.daemon.metrics import Metrics
from sidecar.daemon.peers.config import ClusterSettings
from sidecar.daemon.peers.signing import ANSWER_HEADER, PEER_HEADER, PeerAsk, PeerRefused, check_answer, new_nonce, sign
from wire.rendezvous import member_id

__all__ = ["Member", "Membership"]

log = logging.getLogger(__name__)


@dataclass
class Member:
    id: str
    url: str
    live: bool = False
    failures: int = 0
    node: str | None = None
    self: bool = False
    from_dns: bool = False
    problem: str | None = None
    """Why its last health check failed (``None``: it passed)."""

    def describe(self) -> dict[str, Any]:
        return {"id": self.id, "url": self.url, "live": self.live, "node": self.node, "self": self.self,
                "problem": self.problem}


class Membership:
    def __init__(self, settings: ClusterSettings, node: str | None, metrics: Metrics | None = None) -> None:
        self.settings = settings
        self.self_id = settings.self_id
        self.node = node
        self._metrics = metrics
        self.members: dict[str, Member] = {
            self.self_id: Member(self.self_id, settings.advertise_url.rstrip("/"), live=True, node=node, self=True)
        }
        for url in settings.peers:
            ident = member_id(url)
            if ident not in self.members:
                self.members[ident] = Member(ident, ident)
        # Read by the origin's worker threads: replaced whole, never changed in place.
        self.live: tuple[str, ...] = (self.self_id,)
        self._tasks: list[asyncio.Task[None]] = []
        self._session: aiohttp.ClientSession | None = None
        self._checking: dict[str, asyncio.Task[None]] = {}
        if metrics is not None:
            metrics.peer_links_open.set(1 if settings.links == "open" else 0)
        self._update()

    async def start(self) -> None:
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=self.settings.health_timeout_s),
            connector=aiohttp.TCPConnector(limit=0, use_dns_cache=False),
        )
        if self.settings.peers_dns:
            self._tasks.append(asyncio.create_task(self._resolve_loop(), name="peers-dns"))
        self._tasks.append(asyncio.create_task(self._check_loop(), name="peers-health"))

    async def stop(self) -> None:
        for task in [*self._tasks, *self._checking.values()]:
            task.cancel()
        for task in [*self._tasks, *self._checking.values()]:
            with contextlib.suppress(BaseException):
                await task
        self._tasks.clear()
        self._checking.clear()
        if self._session is not None:
            await self._session.close()
            self._session = None

    def describe(self) -> list[dict[str, Any]]:
        return [member.describe() for member in sorted(self.members.values(), key=lambda m: m.id)]

    def url_of(self, ident: str) -> str | None:
        member = self.members.get(ident)
        return member.url if member is not None else None

    def _update(self) -> None:
        self.live = tuple(sorted(ident for ident, member in self.members.items() if member.live))
        if self._metrics is not None:
            self._metrics.cluster_members.labels(state="live").set(len(self.live))
            self._metrics.cluster_members.labels(state="dead").set(len(self.members) - len(self.live))

    # -- health -------------------------------------------------------------------------------

    async def _check_loop(self) -> None:
        while True:
            for member in list(self.members.values()):
                # One check per member at a time: a slow one does not hold the others back.
                if not member.self and member.id not in self._checking:
                    task = asyncio.create_task(self._check(member), name=f"peer-check:{member.id}")
                    self._checking[member.id] = task
                    task.add_done_callback(functools.partial(self._checked, member.id))
            await asyncio.sleep(self.settings.health_interval_s)

    def _checked(self, ident: str, _task: asyncio.Task[None]) -> None:
        self._checking.pop(ident, None)

    async def _check(self, member: Member) -> None:
        assert self._session is not None
        node: str | None = None
        problem: str | None = None
        impostor = False
        secret = self.settings.secret
        ask = PeerAsk(self.self_id, member.id, new_nonce())
        try:
            headers = {PEER_HEADER: sign(secret, ask, "GET", "/readyz")}
            async with self._session.get(member.url + "/readyz", headers=headers) as resp:
                check_answer(secret, resp.headers.get(ANSWER_HEADER), ask, resp.status, resp.headers)
                if resp.status != 200:
                    problem = f"/readyz answered {resp.status}"
                else:
                    with contextlib.suppress(ValueError, aiohttp.ContentTypeError):
                        body = await resp.json()
                        node = body.get("node") if isinstance(body, dict) and isinstance(body.get("node"), str) else None
        except PeerRefused as exc:
            problem, impostor = f"not a member: {exc}", True
        except (TimeoutError, aiohttp.ClientError, OSError, ValueError) as exc:
            problem = f"unreachable: {exc or type(exc).__name__}"
        if self.members.get(member.id) is not member:
            return  # left the ring (DNS) meanwhile
        if impostor and problem != member.problem:
            log.warning("peer %s: %s", member.id, problem)
        member.problem = problem
        if problem is None:
            member.failures = 0
            member.node = node
            if not member.live:
                log.info("peer %s (%s) is live", member.id, node or "no node name")
                member.live = True
                self._update()
            return
        member.failures += 1
        # Dead after a few failures in a row (a member may miss one check), at once when what
        # answers is no member: its answers would be refused anyway.
        if member.live and (impostor or member.failures >= self.settings.dead_after):
            log.warning("peer %s is dead after %d failed health checks (%s): its objects go to the next candidate",
                        member.id, member.failures, problem)
            member.live = False
            self._update()

    # -- DNS ------------------------------------------------------------------------------------

    async def _resolve_loop(self) -> None:
        name = self.settings.peers_dns
        assert name
        while True:
            try:
                infos = await asyncio.to_thread(socket.getaddrinfo, name, self.settings.port, 0, socket.SOCK_STREAM)
            except OSError as exc:
                log.warning("cannot resolve --peers-dns %s (%s): keeping the members it gave before", name, exc)
            else:
                self._apply_dns({str(info[4][0]) for info in infos})
            await asyncio.sleep(self.settings.dns_interval_s)

    def _apply_dns(self, addresses: set[str]) -> None:
        scheme = self.self_id.split("://", 1)[0]
        wanted: dict[str, str] = {}
        for address in addresses:
            host = f"[{address}]" if ipaddress.ip_address(address.split("%", 1)[0]).version == 6 else address
            url = f"{scheme}://{host}:{self.settings.port}"
            wanted[member_id(url)] = url
        changed = False
        for ident, member in list(self.members.items()):
            if member.from_dns and ident not in wanted:
                log.info("peer %s left the records of %s", ident, self.settings.peers_dns)
                del self.members[ident]
                changed = True
        for ident, url in wanted.items():
            if ident not in self.members:
                self.members[ident] = Member(ident, url, from_dns=True)
                changed = True
        if changed:
            self._update()
