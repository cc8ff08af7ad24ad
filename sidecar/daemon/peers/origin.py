"""The origin a clustered daemon reads through: the owner of each object first, then the origin.

:class:`ClusterOrigin` wraps the real origin. A ``head``, ``open`` or ``open_first`` of an object
whose owner (the first of :func:`wire.rendezvous.ranked` over the live members) is another daemon
goes to that daemon's S3 API (:class:`PeerOrigin`), then down the ranking to this daemon's own
place in it, then to the real origin: a peer that is dead, slow (``peer_read_timeout_s``) or
erroring costs one failed request, never an error the reader would not have had without peers.
Listings, HeadBucket and GetBucketLocation always go to the real origin (they are not cached).

A hand-off: an object this daemon owns but does not hold is first asked of the member ranked
next for it, from its cache only (:data:`~sidecar.daemon.peers.signing.IF_CACHED_HEADER`), then read
from the origin. When a member joins it takes over objects the one ranked after it holds, so they
move over the peer links instead of leaving the object store again; when none holds it (a cold
read, or its holder left), the cost is one refused request.

A read for a peer (``origin_only``: the caller says so, :class:`sidecar.daemon.reads.ReadContext`)
reads the real origin only, so two daemons whose views of the ring differ can never forward a
read to each other in a loop. A body says where it came from
(:attr:`~sidecar.daemon.origins.base.Body.source`): its bytes count as the peer's or the origin's by it.

Every peer request is signed for the member asked, and every answer must be signed by it
(:mod:`.signing`): an answer that is not is the peer being unavailable (the next candidate, or
the origin), and nothing of it is read. A fill from a peer is checked against what the *origin*
says, never what the peer says: the real origin is asked (a HEAD with its checksums, while the
peer answers: one origin request per fill from a peer, no bytes) and the peer's answer must be
that version (ETag, size, and every checksum both state); the fill then takes the origin's
checksums, ETag and headers, and the bytes are verified against them as they land
(:mod:`sidecar.daemon.fills`); the peer's xxh3-128 of a hit is checked too. A fill that fails its
check makes that object come from the origin for a while (:meth:`ClusterOrigin.refused`). Where
the origin vouches for no checksum (a multipart upload's ETag without a full-object checksum,
SSE-KMS/SSE-C, ``--no-verify-etag``) the copy is unverified, as one from the origin would be: it
is the origin's version (ETag and size), but its bytes are as good as the member that sent them.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import threading
import time
from collections.abc import Mapping
from typing import Any, TypeVar
from urllib.parse import quote

from sidecar.daemon.origins.base import Body, ObjectInfo, Origin
from sidecar.daemon.origins.httppool import HTTPPool, Response
from sidecar.daemon.origins.s3 import S3Origin, S3Settings
from sidecar.daemon.peers.config import ClusterSettings
from sidecar.daemon.peers.membership import Membership
from sidecar.daemon.peers.signing import (
    ANSWER_HEADER,
    IF_CACHED_HEADER,
    PEER_HEADER,
    PeerAsk,
    PeerRefused,
    check_answer,
    new_nonce,
    sign,
)
from sidecar.errors import AccessDenied, OriginBadResponse, OriginThrottled, OriginUnavailable
from wire.errors import InvalidName
from wire.names import validate_xxh3_128
from wire.rendezvous import ranked

__all__ = ["ClusterOrigin", "PeerOrigin"]

log = logging.getLogger(__name__)

T = TypeVar("T")

# What makes a read go on to the next candidate: the peer down, slow, overloaded, or refusing
# this daemon (another secret, a clock off by more than the skew). A missing object or a bad
# range is the origin's answer, relayed: the same from every candidate.
_FALL_THROUGH = (OriginUnavailable, OriginBadResponse, OriginThrottled, AccessDenied)

DISTRUST_S = 600.0
"""Seconds an object whose peer bytes failed their check is read from the origin only."""

VOUCH_THREADS = 16
"""Threads that ask the origin what an object is while a peer answers (one per fill from a peer
in flight; more wait their turn). Threads of their own: the origin's may all be waiting on peers."""

_FILE_HEAD_S = 30.0
"""How long a fill from a peer waits for a non-S3 origin's HEAD (run on the loop) before the origin's bytes instead."""


class PeerOrigin(S3Origin):
    """Another daemon's S3 API as an origin: S3Origin's requests and answers (errors, sizes,
    checksums), addressed to the peer with the peer header instead of presigned."""

    def __init__(self, member: str, url: str, asker: str, secret: bytes | None, pool: HTTPPool, owner: Origin,
                 *, if_cached: bool = False) -> None:
        super().__init__(S3Settings())
        self.member = member
        self.if_cached = if_cached
        """A hand-off: the peer answers from its cache only, and the copy is this daemon's own."""
        self.url = url.rstrip("/")
        self._asker = asker
        self._secret = secret
        self._pool = pool
        self._owner = owner  # whose worker threads run this peer's requests
        self._local = threading.local()
        self.namespace = f"peer:{member}"
        self.description = f"peer {member}"

    @property
    def executor(self) -> Any:
        return self._owner.executor

    def _request(self, method: str, op: str, params: dict[str, Any], headers: dict[str, str] | None = None) -> Response:
        """S3Origin's request, to the peer: signed for it, with a fresh nonce, and its answer
        refused (:class:`OriginUnavailable`: the next candidate) unless the member signed it."""
        path = "/" + quote(params["Bucket"], safe="") + "/" + quote(params.get("Key", ""), safe="/~")
        sent = dict(headers or {})
        if self.if_cached:
            sent[IF_CACHED_HEADER] = "1"
        ask = PeerAsk(self._asker, self.member, new_nonce())
        sent[PEER_HEADER] = sign(self._secret, ask, method, path, sent)
        assert self._pool is not None
        resp = self._pool.request(method, self.url + path, sent)
        try:
            check_answer(self._secret, resp.headers.get(ANSWER_HEADER), ask, resp.status, resp.headers)
        except PeerRefused as exc:
            resp.close()
            raise OriginUnavailable(f"{params['Bucket']}/{params.get('Key', '')}: {exc}") from None
        resp = self._answered(resp, method, params)  # the member's S3 error, relayed
        self._local.headers = resp.headers  # open_first reads the xxh3-128 of a hit from it
        return resp

    def open(
        self, bucket: str, key: str, start: int, end: int | None, etag: str | None = None, *, origin_only: bool = False
    ) -> Body:
        body = super().open(bucket, key, start, end, etag)
        body.source = "peer"
        return body

    def open_first(self, bucket: str, key: str, *, origin_only: bool = False) -> tuple[ObjectInfo, Body]:
        info, body = super().open_first(bucket, key)
        body.source = "peer"
        digest = self._local.headers.get("x-shardcache-xxh3-128")
        try:
            xxh3 = validate_xxh3_128(digest, "x-shardcache-xxh3-128") if digest else None
        except InvalidName:
            xxh3 = None
        return dataclasses.replace(info, source="peer", borrowed=not self.if_cached, xxh3_128=xxh3), body


class ClusterOrigin(Origin):
    """The real origin behind the cluster's owners (see the module docstring)."""

    def __init__(self, real: Origin, membership: Membership, settings: ClusterSettings) -> None:
        self.real = real
        self.membership = membership
        self.settings = settings
        self.threads = real.threads
        self.namespace = real.namespace  # one cache entry id for an object on every member
        self.description = real.description
        self._pool: HTTPPool | None = None
        self._peers: dict[tuple[str, bool], PeerOrigin] = {}
        self._lock = threading.Lock()
        self._distrust: dict[str, float] = {}  # object name -> monotonic time its peer bytes may be tried again
        self._last_peer: dict[str, str] = {}  # object name -> member it was last read from (bounded)
        self.borrowing: dict[str, int] = {}  # object name -> reads of it from a peer in progress
        self.refusals = 0
        self.vouches = 0
        """Origin HEADs asked to check a peer's answer (one per fill from a peer)."""
        self.vouch_wait_s = 0.0
        """Seconds fills from peers waited for those HEADs after the peer had answered: what they cost."""
        self.disowned = 0
        """Peer answers refused because the origin says the object is another version."""
        self._vouchers: concurrent.futures.ThreadPoolExecutor | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def start(self) -> None:
        """Attach to the real origin, started already: its threads are this origin's threads."""
        self._executor = self.real.executor
        self._loop = asyncio.get_running_loop()
        self._vouchers = concurrent.futures.ThreadPoolExecutor(VOUCH_THREADS, thread_name_prefix="peer-vouch")
        self._pool = HTTPPool(
            max_idle_per_host=16,
            connect_timeout_s=self.settings.peer_connect_timeout_s,
            read_timeout_s=self.settings.peer_read_timeout_s,
        )
        self.description = f"{self.real.description}, cluster of {len(self.membership.members)} known"

    async def close(self) -> None:
        if self._pool is not None:
            await self.call(self._pool.close)
            self._pool = None
        if self._vouchers is not None:
            self._vouchers.shutdown(wait=False, cancel_futures=True)
            self._vouchers = None
        await self.real.close()

    # -- routing --------------------------------------------------------------------------------

    def _route(self, bucket: str, key: str, origin_only: bool, handoff: bool = True) -> tuple[list[PeerOrigin], bool]:
        """The peers to try for ``bucket/key``, best first, and whether another member owns it;
        for the owner, the hand-off (unless not ``handoff``: a HEAD asks the origin what it is).
        ``origin_only`` (a read for a peer): no other member's copy but the hand-off's."""
        name = f"{bucket}/{key}"
        live = self.membership.live
        order = ranked(live, name) if len(live) > 1 else [self.membership.self_id]
        borrowed = order[0] != self.membership.self_id
        if not borrowed:
            # The owner: the member ranked next may hold it (it owned it before this one joined).
            # Asked from its cache only, so even a fill for a peer (origin_only) may: it cannot loop.
            peer = self._peer(order[1], if_cached=True) if handoff and len(order) > 1 and not self._distrusted(name) else None
            return ([peer] if peer is not None else []), borrowed
        if origin_only or self._distrusted(name):
            return [], borrowed
        peers: list[PeerOrigin] = []
        for ident in order:
            if ident == self.membership.self_id:
                break  # this daemon is the next candidate: it reads the origin itself
            peer = self._peer(ident)
            if peer is not None:
                peers.append(peer)
        return peers, borrowed

    def _distrusted(self, name: str) -> bool:
        until = self._distrust.get(name)
        if until is None:
            return False
        if time.monotonic() < until:
            return True
        self._distrust.pop(name, None)
        return False

    def _peer(self, ident: str, *, if_cached: bool = False) -> PeerOrigin | None:
        with self._lock:
            peer = self._peers.get((ident, if_cached))
            if peer is None:
                url = self.membership.url_of(ident)
                if url is None or self._pool is None:
                    return None
                peer = PeerOrigin(ident, url, self.membership.self_id, self.settings.secret, self._pool, self,
                                  if_cached=if_cached)
                self._peers[(ident, if_cached)] = peer
            return peer

    def _tried(self, peer: PeerOrigin, what: str, exc: Exception) -> None:
        log.info("%s from peer %s failed (%s): trying the next candidate", what, peer.member, exc)

    def _note(self, name: str, member: str) -> None:
        with self._lock:
            if len(self._last_peer) > 100_000:
                self._last_peer.clear()
            self._last_peer[name] = member

    def refused(self, bucket: str, key: str) -> None:
        name = f"{bucket}/{key}"
        with self._lock:
            member = self._last_peer.pop(name, None)
            if member is None:
                return
            self.refusals += 1
            self._distrust[name] = time.monotonic() + DISTRUST_S
        log.warning("%s: the bytes peer %s sent failed their check; reading it from the origin for %g s",
                    name, member, DISTRUST_S)

    def fetching_from_peer(self, bucket: str, key: str) -> bool:
        """Whether a read of ``bucket/key`` from a peer is in progress here (a peer asking for it
        now would wait on itself if the two views of the ring differ)."""
        return self.borrowing.get(f"{bucket}/{key}", 0) > 0

    def _borrow(self, name: str, delta: int) -> None:
        with self._lock:
            left = self.borrowing.get(name, 0) + delta
            if left > 0:
                self.borrowing[name] = left
            else:
                self.borrowing.pop(name, None)

    # -- the Origin interface -------------------------------------------------------------------

    async def head(self, bucket: str, key: str, *, origin_only: bool = False) -> ObjectInfo:
        peers, borrowed = self._route(bucket, key, origin_only, handoff=False)
        for peer in peers:
            try:
                return dataclasses.replace(await peer.head(bucket, key), source="peer", borrowed=True)
            except _FALL_THROUGH as exc:
                self._tried(peer, f"head {bucket}/{key}", exc)
        return dataclasses.replace(await self.real.head(bucket, key), borrowed=borrowed)

    def open(
        self, bucket: str, key: str, start: int, end: int | None, etag: str | None = None, *, origin_only: bool = False
    ) -> Body:
        peers, _ = self._route(bucket, key, origin_only)
        for peer in peers:
            try:
                body = peer.open(bucket, key, start, end, etag)
            except _FALL_THROUGH as exc:
                self._tried(peer, f"{bucket}/{key} from {start}", exc)
                continue
            self._note(f"{bucket}/{key}", peer.member)
            return body
        return self.real.open(bucket, key, start, end, etag)

    def open_first(self, bucket: str, key: str, *, origin_only: bool = False) -> tuple[ObjectInfo, Body]:
        peers, borrowed = self._route(bucket, key, origin_only)
        name = f"{bucket}/{key}"
        said: concurrent.futures.Future[ObjectInfo] | None = None  # what the origin says, once asked
        for peer in peers:
            # Asked while the peer answers, but for a hand-off, which is often refused (a cold
            # object): then only once the peer has a copy, so a cold read costs no extra request.
            if said is None and not peer.if_cached:
                said = self._ask_origin(bucket, key)
            self._borrow(name, 1)
            try:
                info, body = peer.open_first(bucket, key)
                try:
                    if said is None:
                        said = self._ask_origin(bucket, key)
                    result = self._vouched(peer, info, self._origin_says(said)), body
                except BaseException:
                    body.close()
                    raise
            except _FALL_THROUGH as exc:
                self._tried(peer, name, exc)
                continue
            finally:
                self._borrow(name, -1)
            self._note(name, peer.member)
            return result
        info, body = self.real.open_first(bucket, key)
        return dataclasses.replace(info, borrowed=borrowed), body

    # -- what the origin says about a peer's answer -----------------------------------------------

    def _ask_origin(self, bucket: str, key: str) -> concurrent.futures.Future[ObjectInfo]:
        """The real origin's HEAD of ``bucket/key`` (with its checksums), on threads of its own."""
        assert self._vouchers is not None, "ClusterOrigin.start() was not awaited"
        with self._lock:
            self.vouches += 1
        return self._vouchers.submit(self._origin_head, bucket, key)

    def _origin_head(self, bucket: str, key: str) -> ObjectInfo:
        if isinstance(self.real, S3Origin):
            return self.real._head(bucket, key)  # blocking, on this thread: no loop round trip
        # Another origin (a file one) has only its coroutine: on the loop, bounded, in case the
        # loop's worker threads are all taken.
        assert self._loop is not None
        try:
            return asyncio.run_coroutine_threadsafe(self.real.head(bucket, key), self._loop).result(_FILE_HEAD_S)
        except concurrent.futures.TimeoutError:
            raise OriginUnavailable(f"{bucket}/{key}: the origin did not answer a HEAD in {_FILE_HEAD_S:g} s") from None

    def _origin_says(self, said: concurrent.futures.Future[ObjectInfo]) -> ObjectInfo:
        began = time.monotonic()
        try:
            return said.result()
        finally:
            waited = time.monotonic() - began
            with self._lock:
                self.vouch_wait_s += waited

    def _vouched(self, peer: PeerOrigin, claimed: ObjectInfo, origin: ObjectInfo) -> ObjectInfo:
        """What a fill from ``peer`` is checked against: the ``origin``'s info, once the peer's
        answer (``claimed``) is of that version; else :class:`OriginBadResponse` (the next candidate)."""
        name = f"{claimed.etag} ({claimed.size} B)"
        problem = None
        if claimed.etag != origin.etag or claimed.size != origin.size:
            problem = f"is version {name}; the origin has {origin.etag} ({origin.size} B)"
        else:
            theirs = dict(origin.checksums)
            for header, value in claimed.checksums:
                if header in theirs and theirs[header] != value:
                    problem = f"claims {header} {value[:100]}; the origin says {theirs[header]}"
                    break
        if problem is not None:
            with self._lock:
                self.disowned += 1
            raise OriginBadResponse(f"peer {peer.member}'s answer {problem}: reading it elsewhere")
        # The origin's checksums, ETag and headers; the peer's xxh3-128 of a hit is checked as well.
        return dataclasses.replace(origin, source="peer", borrowed=claimed.borrowed, xxh3_128=claimed.xxh3_128)

    async def list_objects_v2(self, bucket: str, params: Mapping[str, str]) -> bytes:
        return await self.real.list_objects_v2(bucket, params)

    async def list_objects(self, bucket: str, params: Mapping[str, str]) -> bytes:
        return await self.real.list_objects(bucket, params)

    async def head_bucket(self, bucket: str) -> str | None:
        return await self.real.head_bucket(bucket)

    async def bucket_location(self, bucket: str) -> bytes:
        return await self.real.bucket_location(bucket)
