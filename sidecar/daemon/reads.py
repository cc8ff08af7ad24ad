"""The one way the daemon reads an object through its cache, whatever asked: the S3 GET and HEAD
(:mod:`sidecar.daemon.s3api`, a client's or a peer daemon's), file handles
(:mod:`sidecar.daemon.handles`), warm-ups (:mod:`sidecar.daemon.warmups`) and prefetches
(:mod:`sidecar.daemon.prefetch`).

A front end describes the read in a :class:`ReadContext` (who asks, for which tenant, with which
claim, whether a peer asked, whether it wants this daemon's copy only) and gets back what to
answer: a :class:`Hit` (a verified, open copy), a :class:`Filling` (the fill it started or
joined), :class:`Uncached` (stream it from the origin, caching nothing), or :class:`Decided` (the
front end's own conditions answered first), or an exception to translate (a
:class:`~sidecar.errors.ChecksumMismatch`, :class:`NotCached`, the origin's errors). The front ends
only translate: the rules below are written once.

- **Lookup, then the claim.** A caller may bring its xxh3-128 of the object (a claim, the
  loader's manifest). A cached copy that disagrees is judged by :mod:`sidecar.daemon.claims`: its
  file re-hashed (bounded), an unverified copy fetched again once per claim, else
  ``ChecksumMismatch``. A fill's bytes are compared with the claim at the seal, before the caller
  gets any: it gets these bytes or an error.
- **Verified opens.** A hit is opened through :meth:`cache.Store.open_verified` (re-hashed when
  its file's stamp moved, or when the reader found its own read of it wrong: ``recheck``, as
  rarely as a disagreeing claim may); a copy that fails is removed and fetched again.
- **Peers and names never cached.** A peer's read, and ``manifest.json`` (the mutable index of
  immutable shards), read the real origin only (``origin_only``, given to the fetcher and from
  there to the origin: :class:`~sidecar.daemon.peers.origin.ClusterOrigin` routes, no other does).
  A peer's hand-off asks for this daemon's copy only (``if_cached``).
- **Counting.** Every lookup is counted once (hit, miss, coalesced), every claim dispute by its
  outcome; where bytes come from and how they are sent is counted by :class:`Tally`.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Generic, TypeVar, overload

from cache import CacheError, CorruptEntry, Entry, EntryNotFound, IntegrityError, ReadOnlyViewError, Store
from sidecar.daemon.accounting import Tally, miss_source
from sidecar.daemon.claims import Claims
from sidecar.daemon.fills import Fetcher, Fill
from sidecar.daemon.metrics import Metrics
from sidecar.daemon.origins import ObjectInfo
from sidecar.daemon.priority import DEMAND
from sidecar.errors import ChecksumMismatch, SidecarError

__all__ = [
    "UNCACHED_NAMES", "Decided", "Filling", "Hit", "NotCached", "ReadContext", "ReadService", "Uncached", "mismatch",
]

log = logging.getLogger(__name__)

T = TypeVar("T")

UNCACHED_NAMES = frozenset({"manifest.json"})
"""Object names (the last part of a key) never cached: a dataset's manifest is the mutable index
of its immutable shards, always the origin's current copy."""


class NotCached(SidecarError):
    """The daemon does not keep this object (a name never cached, no room, the tenant's quota;
    for a peer's hand-off: no copy here): there is no copy to hand out, the client reads it over
    HTTP (a peer, from the origin)."""


@dataclass(frozen=True)
class ReadContext:
    """One read of ``bucket/key``, as its front end describes it."""

    bucket: str
    key: str
    caller: str = ""
    """Who asks, as far as the transport tells (an address, a process, a warm-up): whose
    disagreeing claims share a refetch budget (:meth:`sidecar.daemon.claims.Claims.may_refetch`)."""
    tenant: str = ""
    """Whose quota a fill this read starts counts against ("" without ``--auth``, and for peers)."""
    claim: str | None = None
    """The caller's xxh3-128 of the object (lower-case hex), if it brought one."""
    recheck: bool = False
    """The caller's own read of this daemon's copy did not match: re-hash it before answering."""
    peer: str | None = None
    """The member id of the daemon that asked for this read, ``None`` for a client's."""
    if_cached: bool = False
    """A peer's hand-off: this daemon's copy or nothing (the asking owner reads the origin itself)."""
    priority: int = DEMAND
    counted: bool = True
    """Whether the lookup counts in the cache's hit figures (``shardcache_cache_lookups``): a
    reader's does; a warm-up's, which only brings objects in, does not."""

    @property
    def cacheable(self) -> bool:
        return self.key.rsplit("/", 1)[-1] not in UNCACHED_NAMES

    @property
    def origin_only(self) -> bool:
        """Never routed to another daemon: a peer's read (two daemons whose views of the ring
        differ could otherwise forward it to each other in a loop), or a name never cached."""
        return self.peer is not None or not self.cacheable


@dataclass
class Hit:
    """A cached copy, verified and open: ``fd`` is the caller's to close."""

    entry: Entry
    fd: int
    state: str = "hit"
    came_from: str = "local"


@dataclass
class Filling:
    """The object's fill, started (``miss``) or joined (``coalesced``); a claim, if any, matched."""

    fill: Fill
    info: ObjectInfo
    state: str
    came_from: str


@dataclass
class Uncached:
    """Stream the object from the origin, caching nothing, for ``reason``; ``state`` is what the
    answer says of the cache (``miss``, or ``coalesced`` when it joined a fill that caches nothing)."""

    info: ObjectInfo
    state: str
    reason: str


@dataclass
class Decided(Generic[T]):
    """The front end's own conditions (HTTP's ``If-None-Match`` and friends) answered the read."""

    answer: T


Decide = Callable[[Entry | ObjectInfo, str], T | None]
"""A front end's conditions on the object found (cached entry or origin info, and the ``state``
it would be answered with), evaluated before any byte is sent: an answer to send instead, or
``None`` to read on. May raise (a failed ``If-Match``)."""


def mismatch(what: str, etag: str, vouched: str, digest: str, claim: str) -> ChecksumMismatch:
    return ChecksumMismatch(
        f"{what} (ETag {etag}, {vouched}) hashes to xxh3-128 {digest}, the caller expects {claim}: the "
        "manifest is stale or wrong (rebuild it with `shardcache index`)"
    )


class ReadService:
    """Reads through the node's cache (``store`` ``None``: a daemon without one, everything
    streams from the origin). Loop-only, as the fetcher and the claims it uses."""

    def __init__(self, store: Store | None, fetcher: Fetcher, claims: Claims, metrics: Metrics) -> None:
        self.store = store
        self.fetcher = fetcher
        self.claims = claims
        self.metrics = metrics

    def tally(self, ctx: ReadContext) -> Tally:
        """The byte counters of an answer to ``ctx``."""
        return Tally(self.metrics, ctx.peer is not None)

    # -- what an object is (HEAD) -------------------------------------------------------------

    async def head(self, ctx: ReadContext) -> tuple[Entry | ObjectInfo, str]:
        """What the object is, and the state to answer it with: the cached copy matching the
        claim (``hit``, not opened: a HEAD sends no byte), else the origin's answer (``miss``)."""
        store = self.store
        if store is not None and ctx.cacheable:
            entry = store.lookup(ctx.bucket, ctx.key, xxh3_128=ctx.claim)
            if entry is not None:
                return entry, "hit"
        return await self._origin_head(ctx), "miss"

    async def _origin_head(self, ctx: ReadContext) -> ObjectInfo:
        origin = self.fetcher.origin
        head = functools.partial(origin.head, origin_only=ctx.origin_only)
        info: ObjectInfo = await self.fetcher.call_origin("head", f"head {ctx.bucket}/{ctx.key}", head, ctx.bucket, ctx.key)
        return info

    # -- a read -------------------------------------------------------------------------------

    @overload
    async def read(
        self, ctx: ReadContext, *, decide: None = None, for_others: bool = False,
        before_fill: Callable[[], Awaitable[None]] | None = None,
    ) -> Hit | Filling | Uncached: ...

    @overload
    async def read(
        self, ctx: ReadContext, *, decide: Decide[T], for_others: bool = False,
        before_fill: Callable[[], Awaitable[None]] | None = None,
    ) -> Hit | Filling | Uncached | Decided[T]: ...

    async def read(
        self, ctx: ReadContext, *, decide: Decide[T] | None = None, for_others: bool = False,
        before_fill: Callable[[], Awaitable[None]] | None = None,
    ) -> Hit | Filling | Uncached | Decided[T]:
        """Read ``ctx``'s object: from the cache, else from a fill, else uncached (module docstring).

        ``decide``: the front end's conditions, asked once the object is known (see :data:`Decide`).
        ``for_others``: a hit's descriptor goes to another process (:meth:`cache.Store.open_verified`).
        ``before_fill``: awaited before a fill is started or joined (a warm-up's rate limit)."""
        store = self.store
        if store is None or not ctx.cacheable:
            reason = "no cache on this daemon" if store is None else "never cached (the mutable index of its shards)"
            return await self._uncached(ctx, decide, reason)
        entry = store.lookup(ctx.bucket, ctx.key)
        if entry is not None and ctx.claim and entry.xxh3_128 != ctx.claim:
            entry = await self._disputed(entry, ctx)
        if entry is not None:
            if decide is not None and (answer := decide(entry, "hit")) is not None:
                self._count(ctx, "hit")
                return Decided(answer)
            force = ctx.recheck and self.claims.may_recheck(entry)
            fd = await self.open(entry, force=force, for_others=for_others)
            if fd is not None:
                self._count(ctx, "hit")
                return Hit(entry, fd)

        if ctx.peer is not None and ctx.if_cached:
            raise NotCached(f"{ctx.bucket}/{ctx.key} is not cached on this member")
        if ctx.peer is not None and self.fetcher.origin.fetching_from_peer(ctx.bucket, ctx.key):
            # This daemon reads the object from a peer that (with another view of the ring) asks it
            # back: joining that fill would wait on itself. The origin's bytes, uncached, instead.
            return await self._uncached(ctx, decide, "read from a peer here now")
        if before_fill is not None:
            await before_fill()
        fill, created = self.fetcher.start(
            ctx.bucket, ctx.key, ctx.priority, tenant=ctx.tenant, origin_only=ctx.origin_only
        )
        state = "miss" if created else "coalesced"
        self._count(ctx, state)
        info = await fill.wait_info()
        # The fill goes on whatever the conditions say: the object is wanted, in this version.
        if decide is not None and (answer := decide(info, state)) is not None:
            return Decided(answer)
        if not fill.cacheable:
            return Uncached(info, state, "no room for it in the cache (or the tenant's quota)")
        if ctx.claim:
            # Compared before the first byte: the caller gets these bytes or an error.
            digest = await fill.wait_sealed()
            if digest is not None and digest != ctx.claim:
                self.metrics.claim_outcomes.labels(outcome="mismatch").inc()
                vouched = f"just fetched, verified against its {fill.check.algorithm}" if fill.check else "just fetched, unverified"
                raise mismatch(f"{ctx.bucket}/{ctx.key}: the origin's bytes", info.etag, vouched, digest, ctx.claim)
        return Filling(fill, info, state, miss_source(state, info.source))

    def _count(self, ctx: ReadContext, result: str) -> None:
        if ctx.counted:
            self.metrics.cache_lookups.labels(result=result).inc()

    async def _uncached(self, ctx: ReadContext, decide: Decide[T] | None, reason: str) -> Uncached | Decided[T]:
        self._count(ctx, "miss")
        info = await self._origin_head(ctx)
        if decide is not None and (answer := decide(info, "miss")) is not None:
            return Decided(answer)
        return Uncached(info, "miss", reason)

    async def settle(self, filling: Filling, *, for_others: bool = False) -> Hit:
        """The filled copy, published and open (a descriptor's front ends: handles); ``NotCached``
        when the fill ended without one. The origin's bytes failing their check raise as they are."""
        key = f"{filling.fill.bucket}/{filling.fill.key}"
        try:
            entry = await filling.fill.wait_done()
        except IntegrityError:
            raise  # the origin's bytes failed their checksum: 502 BadDigest
        except CacheError as exc:  # the disk filled up underneath, ...: HTTP streams it from the origin
            raise NotCached(f"{key} could not be cached ({exc}): read it over HTTP") from exc
        fd = await self.open(entry, for_others=for_others) if entry is not None else None
        if entry is None or fd is None:
            raise NotCached(f"{key} is not in the cache after its fill: read it over HTTP")
        return Hit(entry, fd, filling.state, filling.came_from)

    async def open(self, entry: Entry, *, force: bool = False, for_others: bool = False) -> int | None:
        """``entry``'s file, open, if it checks out (re-hashed when its stamp moved, or ``force``);
        ``None`` when it was corrupt (removed) or is gone: fetch it again. ``for_others``: through
        the read-only view (:meth:`cache.Store.open_verified`), never a writable descriptor."""
        store = self.store
        assert store is not None
        with store.pinned(entry):
            try:
                fd, _ = await asyncio.to_thread(store.open_verified, entry, force, for_others=for_others)
            except (CorruptEntry, EntryNotFound):
                return None
            except ReadOnlyViewError as exc:
                log.error("%s", exc)
                raise NotCached(
                    f"{entry.bucket}/{entry.key}: no descriptor can be handed out safely now; read it over HTTP"
                ) from exc
        return fd

    async def _disputed(self, entry: Entry, ctx: ReadContext) -> Entry | None:
        """A hit whose caller expects other bytes (:mod:`sidecar.daemon.claims`): ``None`` when the
        object is to be fetched again (the copy failed its own check, or an unverified copy's first
        dispute with this claim), else :class:`ChecksumMismatch`."""
        assert ctx.claim is not None
        outcomes = self.metrics.claim_outcomes
        if self.claims.may_recheck(entry):
            fd = await self.open(entry, force=True)
            if fd is None:
                outcomes.labels(outcome="refetched").inc()
                return None
            await asyncio.to_thread(os.close, fd)
        if self.claims.may_refetch(entry, ctx.claim, ctx.caller):
            outcomes.labels(outcome="refetched").inc()
            return None
        outcomes.labels(outcome="mismatch").inc()
        vouched = (
            f"verified against the origin's {entry.verified}" if entry.verified
            else "unverified: the origin sends no checksum for it, and it was fetched again for this checksum already"
        )
        raise mismatch(f"{entry.bucket}/{entry.key}: the cached copy", entry.etag, vouched, entry.xxh3_128, ctx.claim)

    # -- ahead of readers ---------------------------------------------------------------------

    def cached(self, bucket: str, key: str) -> bool:
        """Whether a copy of ``bucket/key`` is in the cache (a prefetch needs no more: claims are
        judged when callers read)."""
        return self.store is not None and self.store.lookup(bucket, key) is not None

    def prefetch(self, ctx: ReadContext) -> Fill | None:
        """Start (or join, promoting its priority) the fill of an object not cached; ``None``
        when it is cached, or is never cached."""
        if self.store is None or not ctx.cacheable or self.cached(ctx.bucket, ctx.key):
            return None
        fill, _ = self.fetcher.start(ctx.bucket, ctx.key, ctx.priority, tenant=ctx.tenant, origin_only=ctx.origin_only)
        return fill
