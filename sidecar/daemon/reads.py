"""The one way the daemon reads an object through its cache, whatever asked: the S3 GET and HEAD
(:mod:`sidecar.daemon.s3api`, a client's or a peer daemon's), file handles
(:mod:`sidecar.daemon.handles`), warm-ups (:mod:`sidecar.daemon.warmups`) and prefetches
(:mod:`sidecar.daemon.prefetch`).

A front end describes the read in a :class:`ReadContext` (who asks, for which tenant, with which
claim, whether a peer asked, whether it wants this daemon's copy only) and gets back what to
answer: a :class:`Hit` (a verified, open copy), a :class:`Filling` (the fill it started or
joined), :class:`Uncached` (stream it from the origin, caching nothing), or :class:`Decided` (the
front end's own conditions answered first), :class:`Direct` (a small range of an object not
cached, from one ranged GET of the origin), or an exception to translate (a
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
- **Small ranges of objects not cached** (``direct_range_bytes``, ``--direct-range-bytes``): a
  ranged read of at most that many bytes, of an object neither cached nor filled as far as the
  range's start, is answered by one ranged GET of the origin (:class:`Direct`), not from the
  whole object's fill. Every byte of the answer is of the version its headers name: the bytes and
  the headers come from one origin answer (a resumed body asks ``If-Match`` its ETag), and where a
  fill of the object runs, its version is asked for (``If-Match``) or, if not known yet, compared
  before the first byte (another version: the read is the fill's, as before). Not for peers (their
  reads stay as they are), names never cached, or a caller's claim (a whole-object checksum cannot
  be checked on a range: that read waits for the fill's seal, as before). Behind the answer the
  whole object is filled at prefetch priority only into free room, never evicting anything
  (:meth:`cache.Store.has_room`; ``begin(evict=False)``), a few such fills at a time: a random
  reader of a dataset larger than the cache fills what fits and reads the rest by ranges.
- **Counting.** Every lookup is counted once (hit, miss, coalesced), every claim dispute by its
  outcome; where bytes come from and how they are sent is counted by :class:`Tally`, and for the
  job the reader named (``x-shardcache-job``) by :class:`~sidecar.daemon.jobstats.JobTally`.
- **The plan's fills.** A fill the lease master's plan asked for (:mod:`sidecar.daemon.prefetch`)
  evicts no entry the plan keeps (:meth:`cache.Store.spare_kept`) until a demand read joins it:
  a trainer waiting for the object may evict as any demand read does.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Generic, TypeVar, overload

from cache import CacheError, CorruptEntry, Entry, EntryNotFound, IntegrityError, ReadOnlyViewError, Store
from sidecar.daemon.accounting import Tally, miss_source
from sidecar.daemon.claims import Claims
from sidecar.daemon.fills import Fetcher, Fill, RangeRead
from sidecar.daemon.jobstats import JobStats, JobTally
from sidecar.daemon.metrics import Metrics
from sidecar.daemon.origins import ObjectInfo
from sidecar.daemon.priority import DEMAND, LEASE
from sidecar.daemon.unread import Unread
from sidecar.errors import ChecksumMismatch, InvalidRange, ObjectNotFound, SidecarError

__all__ = [
    "DIRECT_RANGE", "RECENT_READS", "UNCACHED_NAMES", "Decided", "Direct", "Filling", "Hit", "NotCached", "ReadContext", "ReadService",
    "Uncached", "mismatch",
]

log = logging.getLogger(__name__)

T = TypeVar("T")

UNCACHED_NAMES = frozenset({"manifest.json"})
"""Object names (the last part of a key) never cached: a dataset's manifest is the mutable index
of its immutable shards, always the origin's current copy."""


RECENT_READS = 16_384
"""How many objects' last read times :meth:`ReadService.read_since` keeps (~2 MB at most): a
prefetch waits seconds at most before it runs, and a node reads far fewer objects meanwhile."""

DIRECT_RANGE = "range_origin"
"""The state of a :class:`Direct` read: its answer's ``x-shardcache-cache`` and the
``shardcache_served_bytes`` source of its bytes."""


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
    job: str = ""
    """The job the reader named (``x-shardcache-job``, checked), whose figures its bytes count in
    too (:mod:`sidecar.daemon.jobstats`); "" for none."""

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
class Direct:
    """A range of an object not cached, from one ranged GET of the origin (``read``: open, to
    stream and close); the object may be filling behind it, for later reads."""

    read: RangeRead
    state: str = DIRECT_RANGE
    came_from: str = "origin"


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

    def __init__(
        self, store: Store | None, fetcher: Fetcher, claims: Claims, metrics: Metrics, *,
        direct_range_bytes: int = 0, fills_behind: int = 4, jobs: JobStats | None = None,
    ) -> None:
        self.store = store
        self.fetcher = fetcher
        self.claims = claims
        self.metrics = metrics
        self.direct_range_bytes = direct_range_bytes
        """Ranges up to this many bytes of objects not cached come straight from the origin (0: never)."""
        self.fills_behind = fills_behind
        """Fills started behind direct ranges that may run at once (more: the range only)."""
        self.jobs = jobs if jobs is not None else JobStats()
        """The per-job counters reads that name a job count in."""
        self.unread = Unread(metrics)
        """Prefetched objects not read yet, and those the cache let go unread (unread.py)."""
        self.prefetching: set[tuple[str, str]] = set()
        """Objects whose fill a prefetch started: the plan's, in :meth:`cache.Store.spare_kept`,
        or a hint's, in :meth:`cache.Store.awaited` (the prefetcher's)."""
        self._read_at: OrderedDict[tuple[str, str], float] = OrderedDict()
        """When readers last asked for each object (the latest :data:`RECENT_READS`; :meth:`read_since`)."""
        self._behind: dict[Fill, int] = {}  # fills started behind direct ranges, and their objects' sizes
        self._admitting = 0
        self._tasks: set[asyncio.Task[None]] = set()

    def tally(self, ctx: ReadContext) -> Tally:
        """The byte counters of an answer to ``ctx`` (and of its job, if it names one). Every
        reader's answer takes them (a GET, a short-circuit open, a handle, a peer's read): here the
        object is noted as read (:meth:`read_since`, :class:`~sidecar.daemon.unread.Unread`)."""
        name = (ctx.bucket, ctx.key)
        self._read_at[name] = time.monotonic()
        self._read_at.move_to_end(name)
        if len(self._read_at) > RECENT_READS:
            self._read_at.popitem(last=False)
        self.unread.read(ctx.bucket, ctx.key)
        if ctx.job:
            return JobTally(self.metrics, ctx.peer is not None, self.jobs, ctx.job, ctx.tenant)
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
        before_fill: Callable[[], Awaitable[None]] | None = None, direct: None = None,
    ) -> Hit | Filling | Uncached: ...

    @overload
    async def read(
        self, ctx: ReadContext, *, decide: Decide[T], for_others: bool = False,
        before_fill: Callable[[], Awaitable[None]] | None = None, direct: None = None,
    ) -> Hit | Filling | Uncached | Decided[T]: ...

    @overload
    async def read(
        self, ctx: ReadContext, *, decide: Decide[T], for_others: bool = False,
        before_fill: Callable[[], Awaitable[None]] | None = None, direct: tuple[int, int] | None,
    ) -> Hit | Filling | Uncached | Direct | Decided[T]: ...

    async def read(
        self, ctx: ReadContext, *, decide: Decide[T] | None = None, for_others: bool = False,
        before_fill: Callable[[], Awaitable[None]] | None = None, direct: tuple[int, int] | None = None,
    ) -> Hit | Filling | Uncached | Direct | Decided[T]:
        """Read ``ctx``'s object: from the cache, else from a fill, else uncached (module docstring).

        ``decide``: the front end's conditions, asked once the object is known (see :data:`Decide`).
        ``for_others``: a hit's descriptor goes to another process (:meth:`cache.Store.open_verified`).
        ``before_fill``: awaited before a fill is started or joined (a warm-up's rate limit).
        ``direct``: the ``[start, end)`` the caller asks for, when it asks for one range of known
        bounds: a small one of an object not cached may be a :class:`Direct` read."""
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
        if direct is not None and before_fill is None and self.may_go_direct(ctx, direct):
            ranged = await self._direct(ctx, direct, decide)
            if ranged is not None:
                return ranged
        if ctx.peer is not None and self.fetcher.origin.fetching_from_peer(ctx.bucket, ctx.key):
            # This daemon reads the object from a peer that (with another view of the ring) asks it
            # back: joining that fill would wait on itself. The origin's bytes, uncached, instead.
            return await self._uncached(ctx, decide, "read from a peer here now")
        if before_fill is not None:
            await before_fill()
        fill, created = self.fetcher.start(
            ctx.bucket, ctx.key, ctx.priority, tenant=ctx.tenant, origin_only=ctx.origin_only
        )
        if not created and ctx.priority == DEMAND and (ctx.bucket, ctx.key) in self.prefetching:
            # A trainer waits for it: a plan's fill may evict as a demand read's, and a hint's
            # entry is read as it lands (awaited by nobody once published).
            store.unspare(ctx.bucket, ctx.key)
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

    # -- a small range of an object not cached, straight from the origin ----------------------

    def may_go_direct(self, ctx: ReadContext, rng: tuple[int, int]) -> bool:
        """Whether ``rng`` of ``ctx``'s object may be read from the origin by range (or, landed in
        a fill, be sent before the fill's seal): small, no claim, no peer, an origin that can."""
        start, end = rng
        return (
            0 < end - start <= self.direct_range_bytes
            and ctx.peer is None
            and not ctx.claim
            and ctx.cacheable
            and self.fetcher.origin.direct_ranges
        )

    async def _direct(self, ctx: ReadContext, rng: tuple[int, int], decide: Decide[T] | None) -> Direct | Decided[T] | None:
        """``ctx``'s range from one ranged GET of the origin, or ``None``: read it as before (from
        the fill, which has the range's start already, is another version, or knows the size of an
        object the range starts past)."""
        start, end = rng
        fill = self.fetcher.inflight.get((ctx.bucket, ctx.key))
        if fill is not None and (fill.contiguous >= end or fill.error is not None):
            # Landed whole already: from the fill at once (s3api: without waiting for its seal,
            # as a range from the origin would not). Landed in part: from the origin, not after
            # the rest of the fill.
            return None
        # The fill's version, when it is known: the origin answers it or 412 (ObjectNotFound).
        etag = fill.info.etag if fill is not None and fill.info is not None else None
        opening = asyncio.ensure_future(self.fetcher.open_range(ctx.bucket, ctx.key, start, end, etag))
        try:
            if fill is not None and etag is None and fill.asked:
                # The fill's first answer is on its way, sent before this request: it is in by
                # the time this one is, and the two versions are compared before any byte is sent.
                with contextlib.suppress(Exception):
                    await fill.wait_info()
            read = await opening
        except InvalidRange:
            return None  # past the end: answered as before, 416 with the object's size
        except ObjectNotFound:
            if etag is None:
                raise
            return None  # no longer the fill's version: the fill's bytes, or its error
        except BaseException:
            _discard(opening)
            raise
        if read is None:
            return None
        info = read.info
        if fill is not None and fill.info is not None and fill.info.etag != info.etag:
            read.close()
            log.debug("%s/%s changed between its fill (%s) and a range (%s): read from the fill",
                      ctx.bucket, ctx.key, fill.info.etag, info.etag)
            return None
        self._count(ctx, "miss")
        try:
            if decide is not None and (answer := decide(info, DIRECT_RANGE)) is not None:
                read.close()
                return Decided(answer)
        except BaseException:
            read.close()
            raise
        log.debug("%s/%s bytes %d-%d straight from the origin (ETag %s)", ctx.bucket, ctx.key, read.start,
                  read.end - 1, info.etag)
        self._fill_behind(ctx, info.size)
        return Direct(read)

    def _fill_behind(self, ctx: ReadContext, size: int) -> None:
        """Fill the whole object behind a direct range, if it fits into free room (checked off the
        loop) and few such fills run: at prefetch priority, evicting nothing."""
        if self.store is None or (ctx.bucket, ctx.key) in self.fetcher.inflight:
            return
        self._behind = {fill: size for fill, size in self._behind.items() if not fill.finished}
        if len(self._behind) + self._admitting >= self.fills_behind:
            self.metrics.range_fills.labels(outcome="busy").inc()
            return
        self._admitting += 1
        task = asyncio.create_task(self._admit_behind(ctx, size), name=f"fill-behind:{ctx.bucket}/{ctx.key}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _admit_behind(self, ctx: ReadContext, size: int) -> None:
        store = self.store
        assert store is not None
        try:
            # Fills started behind ranges whose room the store has not reserved yet (their first
            # answer is not in) count too: two of them must not both take the same free room.
            pending = sum(other for fill, other in self._behind.items() if fill.info is None and not fill.finished)
            if not await asyncio.to_thread(store.has_room, size + pending, ctx.tenant):
                self.metrics.range_fills.labels(outcome="no_room").inc()
                log.debug("not filling %s/%s behind a range: no free room for %d bytes", ctx.bucket, ctx.key, size)
                return
            if (ctx.bucket, ctx.key) in self.fetcher.inflight or store.lookup(ctx.bucket, ctx.key) is not None:
                return  # filled or filling meanwhile
            fill, created = self.fetcher.start(ctx.bucket, ctx.key, LEASE, tenant=ctx.tenant, evict=False)
            if created:
                self._behind[fill] = size
                self.metrics.range_fills.labels(outcome="started").inc()
        except Exception:  # a background nicety: the read was answered
            log.exception("filling %s/%s behind a range failed to start", ctx.bucket, ctx.key)
        finally:
            self._admitting -= 1

    def _count(self, ctx: ReadContext, result: str) -> None:
        if ctx.counted:
            self.metrics.cache_lookups.labels(result=result).inc()

    def read_since(self, bucket: str, key: str, since: float) -> bool:
        """Whether a reader asked for ``bucket/key`` after ``since`` (``time.monotonic()``), as far
        as the last :data:`RECENT_READS` objects read tell."""
        at = self._read_at.get((bucket, key))
        return at is not None and at > since

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

    def prefetch(self, ctx: ReadContext, cause: str = "") -> Fill | None:
        """Start (or join, promoting its priority) the fill of an object not cached; ``None``
        when it is cached, or is never cached. ``cause`` (``hint``, ``plan``): a fill started
        here is a prefetch's guess, counted if the cache lets it go unread (:mod:`~sidecar.daemon.unread`)."""
        if self.store is None or not ctx.cacheable or self.cached(ctx.bucket, ctx.key):
            return None
        fill, new = self.fetcher.start(ctx.bucket, ctx.key, ctx.priority, tenant=ctx.tenant, origin_only=ctx.origin_only)
        if new and cause:
            self.unread.started(ctx.bucket, ctx.key, cause)
        return fill


def _discard(opening: asyncio.Future[RangeRead | None]) -> None:
    """A range being opened that nobody will read: stopped, or closed once it is open."""
    opening.cancel()

    def closed(done: asyncio.Future[RangeRead | None]) -> None:
        if not done.cancelled() and done.exception() is None and (read := done.result()) is not None:
            read.close()

    opening.add_done_callback(closed)
