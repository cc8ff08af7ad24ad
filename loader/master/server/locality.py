"""Cache-aware leases: which node holds each shard, and the window a lease chooses in.

A job with ``locality_window`` W > 0 hands a trainer on node X, from the next W positions of the
epoch's seeded order, the first shard that is local to X; when none is, the next shard of the plain
order. A shard is local to X when

- its **owner** is on X: the member of the cluster cache that :func:`wire.rendezvous.owner` picks
  over the live members for ``bucket/key``, the rule the daemons themselves use, over the ring the
  master last learned (``Placement`` events, polled from a daemon's ``/_shardcache/peers``); or
- it is **cached** on X: X is its **holder**, the node whose daemon last reported it cached
  (``Holdings`` events, from the reports of daemons started with ``--master``: holdings.py), or,
  for daemons that do not report, whose trainer was the last to complete it in this job (so X's
  daemon filled or borrowed it: the guess). This holds without a cluster cache too (per-node
  caches).

The window keeps the order random and bounded: a shard is handed out fewer than W leases away
from its place in the plain order, since a position the window does not find local to anyone
stays at the window's left edge until nothing else in the window is left. W = 1 is the plain
order, with the locality counted.

Everything here is a pure function of the state (the ring, the seeded orders, the completions and
the reported holdings),
so a replayed or restored master chooses exactly as the live one did: the per-node heaps are an
index that is rebuilt whenever the locality of a position in a window may have changed, and a lease
always takes the smallest local position of the window, whatever the index held.

What it costs the master: per lease O(log W) amortised (the heaps, each position entering one or
two of them once), plus the owner of each shard entering a window: O(members) hashes the first
time, memoised per shard and updated by the members that joined since (O(1) per ring change
per shard) or recomputed when its owner left. A lease brings at most :data:`STEP` new positions
into the window, so no lease pays for placing a whole window (a new epoch's window opens over its
first W/STEP leases); a master that loaded the state places its open windows before it serves
(:meth:`MasterState.warm`). Measured at 1,000 members, 10,000 shards, W = 4096: 169 µs a lease on
average in the first epoch (p99 2.2 ms), 37 µs once the owners are known (p99 0.16 ms).
22 bytes per shard (owner, its score, the ring version, the holder), only in jobs with a
window; 12 more once a daemon reports holdings (the index of the shards by the hash of their name,
ShardIndex below, built on the first report).
"""

from __future__ import annotations

import base64
import bisect
import heapq
import math
from array import array
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from wire.dataset import parse_dataset_url
from wire.errors import InvalidName
from wire.nodeplan import name_hash
from wire.rendezvous import best, prefixed, score

if TYPE_CHECKING:
    from loader.master.server.spec import JobSpec

__all__ = [
    "KINDS",
    "STEP",
    "MAX_MEMBERS",
    "MAX_NODES",
    "Ring",
    "Owners",
    "Readers",
    "Holders",
    "Window",
    "JobLocality",
    "ShardIndex",
    "job_index",
    "s3_location",
]

KINDS = ("owner", "cached", "other", "unplaced")
"""How a granted lease stood to the trainer's node: its shard's owner was on the node, its holder
was (reported cached there, or last completed there), neither, or nothing was known (no ring and
no holder, or no node)."""
MAX_MEMBERS = 10_000
"""Most members a Placement may list."""
MAX_NODES = 65_535
"""Most distinct node names a job records as holders (2 bytes a shard); later ones are not."""
_JOINS_SLACK = 1024
STEP = 16
"""Positions a lease may bring into its epoch's window (beyond the ones it takes): a new epoch's
window opens over its first W/16 leases, so placing its shards (O(members) each the first time)
costs at most 16 owner computations a lease instead of W at once."""


class Ring:
    """The cluster's live members as the master last learned them: member id -> node name ("" for
    a member that names no node: it owns shards but is local to no trainer)."""

    __slots__ = ("version", "node_of", "joined", "joins", "prefixes")

    def __init__(self) -> None:
        self.version = 0
        self.node_of: dict[str, str] = {}
        self.joined: dict[str, int] = {}
        """member -> the ring version at which it (last) joined."""
        self.joins: list[tuple[int, str]] = []
        """(version, member) in joining order: the members added since a memoised owner."""
        self.prefixes: list[tuple[bytes, str]] = []
        """The live members as :func:`wire.rendezvous.best` takes them."""

    def update(self, members: Iterable[tuple[str, str]]) -> bool:
        """Take ``members`` as the ring; False when that is the ring already."""
        new = dict(members)
        if new == self.node_of:
            return False
        self.version += 1
        for member in new:
            if member not in self.node_of:
                self.joined[member] = self.version
                self.joins.append((self.version, member))
        for member in [m for m in self.joined if m not in new]:
            del self.joined[member]
        self.node_of = new
        self.prefixes = prefixed(sorted(new))
        if len(self.joins) > 4 * len(new) + _JOINS_SLACK:
            self.joins = sorted((v, m) for m, v in self.joined.items())
        return True

    @property
    def nodes(self) -> int:
        """Distinct node names among the members."""
        return len({node for node in self.node_of.values() if node})

    def joined_since(self, version: int) -> Iterable[str]:
        """Live members that joined after ``version``."""
        i = len(self.joins)
        while i > 0 and self.joins[i - 1][0] > version:
            i -= 1
        for v, member in self.joins[i:]:
            if self.joined.get(member) == v:
                yield member

    def to_json(self) -> dict[str, Any]:
        return {"version": self.version, "members": [[m, n] for m, n in sorted(self.node_of.items())]}

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> Ring:
        ring = cls()
        ring.version = int(raw["version"])
        ring.node_of = {str(m): str(n) for m, n in raw["members"]}
        # Owners are memoised from scratch after a restore, so every member counts as joined now.
        ring.joined = dict.fromkeys(ring.node_of, ring.version)
        ring.joins = [(ring.version, m) for m in sorted(ring.node_of)]
        ring.prefixes = prefixed(sorted(ring.node_of))
        return ring


class Owners:
    """The owner of each shard under the ring, memoised in arrays (derived state, never stored)."""

    __slots__ = ("names", "members", "member_ix", "owner", "score", "version")

    def __init__(self, n: int, names: Callable[[int], str]) -> None:
        self.names = names
        self.members: list[str] = []
        self.member_ix: dict[str, int] = {}
        self.owner = array("i", [-1]) * n
        self.score = array("Q", [0]) * n
        self.version = array("Q", [0]) * n

    def _ix(self, member: str) -> int:
        ix = self.member_ix.get(member)
        if ix is None:
            ix = self.member_ix[member] = len(self.members)
            self.members.append(member)
        return ix

    def member(self, shard: int, ring: Ring) -> str | None:
        if not ring.node_of:
            return None
        ix = self.owner[shard]
        if ix >= 0:
            held = self.members[ix]
            seen = self.version[shard]
            if seen == ring.version:
                return held
            if held in ring.node_of:
                # Only members that joined since can beat an owner that is still there.
                top, name = (self.score[shard], held), self.names(shard)
                for member in ring.joined_since(seen):
                    cand = (score(member, name), member)
                    if cand > top:
                        top = cand
                self._keep(shard, top, ring.version)
                return top[1]
        top = best(ring.prefixes, self.names(shard))
        self._keep(shard, top, ring.version)
        return top[1]

    def _keep(self, shard: int, top: tuple[int, str], version: int) -> None:
        self.owner[shard] = self._ix(top[1])
        self.score[shard] = top[0]
        self.version[shard] = version


class Readers:
    """The **holder** of each shard: the node whose daemon last reported it cached (a ``Holdings``
    event), or whose trainer last completed it (state: snapshotted, as ``"readers"`` since before
    daemons reported, so every snapshot loads). Called readers for that history; :data:`Holders`
    is the same class."""

    __slots__ = ("nodes", "node_ix", "reader", "known")

    def __init__(self, n: int) -> None:
        self.nodes: list[str] = []
        self.node_ix: dict[str, int] = {}
        self.reader = array("H", [0]) * n
        """Index + 1 into ``nodes``; 0: no reader known."""
        self.known = 0
        """Shards with a reader."""

    def get(self, shard: int) -> str | None:
        ix = self.reader[shard]
        return self.nodes[ix - 1] if ix else None

    def set(self, shard: int, node: str) -> bool:
        """Record ``node`` as the last reader of ``shard``; True when that changed it."""
        ix = self.node_ix.get(node)
        if ix is None:
            if len(self.nodes) >= MAX_NODES:
                return False
            self.nodes.append(node)
            ix = self.node_ix[node] = len(self.nodes)
        before = self.reader[shard]
        if before == ix:
            return False
        self.known += before == 0
        self.reader[shard] = ix
        return True

    def clear(self, shard: int) -> bool:
        """Forget the holder of ``shard``; True when it had one."""
        if not self.reader[shard]:
            return False
        self.reader[shard] = 0
        self.known -= 1
        return True

    def shards_of(self, node: str) -> list[int]:
        """The shards ``node`` holds, ascending: O(shards), at C speed (a byte search of the table)."""
        ix = self.node_ix.get(node)
        if ix is None:
            return []
        data, pattern = self.reader.tobytes(), array("H", [ix]).tobytes()
        out: list[int] = []
        at = data.find(pattern)
        while at >= 0:
            if at & 1:  # straddles two entries
                at = data.find(pattern, at + 1)
                continue
            out.append(at >> 1)
            at = data.find(pattern, at + 2)
        return out

    def to_json(self) -> dict[str, Any]:
        return {"nodes": list(self.nodes), "reader": base64.b64encode(self.reader.tobytes()).decode()}

    @classmethod
    def from_json(cls, raw: dict[str, Any], n: int) -> Readers:
        out = cls(n)
        out.nodes = [str(x) for x in raw["nodes"]]
        out.node_ix = {node: i + 1 for i, node in enumerate(out.nodes)}
        reader = array("H")
        reader.frombytes(base64.b64decode(raw["reader"]))
        if len(reader) != n:
            raise ValueError("a job's reader table does not match its shard count")
        out.reader = reader
        out.known = len(reader) - reader.count(0)
        return out


Holders = Readers


class Window:
    """One epoch's window: the positions taken ahead of the cursor, an index of the window's
    positions by the nodes they are local to, and how far the handed-out order moved."""

    __slots__ = ("ahead", "frontier", "indexed", "heaps", "entries", "handed", "sum_d", "max_d", "sk", "sp", "skk",
                 "spp", "skp")

    def __init__(self, cursor: int) -> None:
        self.ahead: set[int] = set()
        """Positions at or past the cursor already handed out (state)."""
        self.frontier = cursor
        """The window is ``[cursor, frontier)``: it grows by up to :data:`STEP` a lease, to W (state)."""
        self.indexed = True
        """Whether ``heaps`` index every position of the window (derived: False after a restore,
        a ring change or a compaction; rebuilt on the next lease)."""
        self.heaps: dict[str, list[int]] = {}
        self.entries = 0
        # State: the k-th fresh hand-out of the epoch took plain position p; sums for the mean
        # displacement |k - p| and for the (Spearman) correlation of k and p.
        self.handed = 0
        self.sum_d = 0
        self.max_d = 0
        self.sk = self.sp = self.skk = self.spp = self.skp = 0

    def reset(self) -> None:
        """Drop the index (a ring change, or too many stale entries): rebuilt on the next lease,
        over the same window."""
        self.heaps = {}
        self.entries = 0
        self.indexed = False

    def push(self, node: str, position: int) -> None:
        heapq.heappush(self.heaps.setdefault(node, []), position)
        self.entries += 1

    def note(self, position: int) -> None:
        k = self.handed
        d = abs(k - position)
        self.handed = k + 1
        self.sum_d += d
        self.max_d = max(self.max_d, d)
        self.sk += k
        self.sp += position
        self.skk += k * k
        self.spp += position * position
        self.skp += k * position

    def report(self, epoch: int) -> dict[str, Any]:
        m = self.handed
        rho: float | None = None
        if m > 1:
            cov = m * self.skp - self.sk * self.sp
            var = (m * self.skk - self.sk**2) * (m * self.spp - self.sp**2)
            rho = round(cov / math.sqrt(var), 6) if var > 0 else 1.0
        return {
            "epoch": epoch, "handed": m, "mean_displacement": round(self.sum_d / m, 3) if m else None,
            "max_displacement": self.max_d, "spearman": rho,
        }

    def to_json(self) -> dict[str, Any]:
        return {"ahead": sorted(self.ahead), "frontier": self.frontier,
                "stats": [self.handed, self.sum_d, self.max_d, self.sk, self.sp, self.skk, self.spp, self.skp]}

    @classmethod
    def from_json(cls, raw: dict[str, Any], cursor: int) -> Window:
        win = cls(cursor)
        win.ahead = set(raw["ahead"])
        win.frontier = int(raw.get("frontier", cursor))
        win.indexed = False
        win.handed, win.sum_d, win.max_d, win.sk, win.sp, win.skk, win.spp, win.skp = raw["stats"]
        return win


class JobLocality:
    """A windowed job's placement knowledge and its counts of local leases."""

    __slots__ = ("window", "owners", "readers", "counts", "names", "index")

    def __init__(self, window: int, n: int, names: Callable[[int], str] | None) -> None:
        self.window = window
        self.names = names
        """The object name (``bucket/key``) of a shard, as the daemons hash it; None: a dataset
        the ring cannot place (a ``file://`` one), local only by its readers."""
        self.owners = Owners(n, names) if names is not None else None
        self.readers = Readers(n)
        """The holder of each shard (state)."""
        self.counts = dict.fromkeys(KINDS, 0)
        self.index: ShardIndex | None = None
        """The shards by the hash daemons report them under (derived: built on the first report,
        job_index below)."""

    def owner_node(self, shard: int, ring: Ring) -> str | None:
        if self.owners is None:
            return None
        member = self.owners.member(shard, ring)
        return (ring.node_of.get(member) or None) if member is not None else None

    def nodes_of(self, shard: int, ring: Ring) -> tuple[str | None, str | None]:
        return self.owner_node(shard, ring), self.readers.get(shard)

    def kind(self, shard: int, node: str, ring: Ring) -> str:
        """How ``shard`` stands to a trainer on ``node`` (one of :data:`KINDS`)."""
        owner, reader = self.nodes_of(shard, ring)
        if node and owner == node:
            return "owner"
        if node and reader == node:
            return "cached"
        return "other" if node and (owner is not None or reader is not None) else "unplaced"

    def is_local(self, shard: int, node: str, ring: Ring) -> bool:
        owner, reader = self.nodes_of(shard, ring)
        return owner == node or reader == node

    def report(self, epochs: list[dict[str, Any]]) -> dict[str, Any]:
        placed = self.counts["owner"] + self.counts["cached"] + self.counts["other"]
        local = self.counts["owner"] + self.counts["cached"]
        return {
            "window": self.window, "leases": dict(self.counts),
            "local_share": round(local / placed, 4) if placed else None,
            "readers_known": self.readers.known, "epochs": epochs,
        }

    def to_json(self) -> dict[str, Any]:
        return {"readers": self.readers.to_json(), "counts": dict(self.counts)}

    def restore(self, raw: dict[str, Any], n: int) -> None:
        self.readers = Readers.from_json(raw["readers"], n)
        self.counts.update(raw["counts"])


# -- the shards of a job by the hash of their name ------------------------------------------------


def s3_location(dataset: str) -> tuple[str, str] | None:
    """``(bucket, prefix)`` of an ``s3://`` dataset, the names daemons hash its shards by; None
    for a dataset they do not name (``file://``, or not a dataset URL)."""
    try:
        url = parse_dataset_url(dataset)
    except InvalidName:
        return None
    return (url.bucket, url.prefix) if url.scheme == "s3" else None


class ShardIndex:
    """A job's shards by the 64-bit name daemons report them under (``name_hash(bucket, prefix +
    key)``): the hashes sorted, with the shard of each in a parallel array, found by binary
    search. 12 bytes a shard; derived from the spec (built once, never stored). Built in 1.7 s
    for 1,000,000 shards (a lookup ~1.3 µs): the service builds it on a thread."""

    __slots__ = ("hashes", "shards", "bucket", "prefix", "table", "mean_size")

    def __init__(self, spec: JobSpec, bucket: str, prefix: str) -> None:
        table = spec.table
        n = len(table)
        self.bucket, self.prefix, self.table = bucket, prefix, table
        raw = array("Q", bytes(8 * n))
        known = total = 0
        for i in range(n):
            raw[i] = name_hash(bucket, prefix + table.key(i))
            size = table.size(i)
            if size is not None:
                known += 1
                total += size
        order = sorted(range(n), key=raw.__getitem__)
        self.hashes = array("Q", [raw[i] for i in order])
        self.shards = array("I", order)
        self.mean_size = total // known if known else 0
        """The mean of the spec's known shard sizes (0: none known)."""

    @classmethod
    def build(cls, spec: JobSpec) -> ShardIndex | None:
        """The index of ``spec``'s shards; None for a dataset daemons do not name (not ``s3://``)."""
        where = s3_location(spec.dataset)
        return cls(spec, *where) if where is not None else None

    def find(self, h: int) -> int:
        """The shard named by hash ``h``; -1 when none is."""
        hashes = self.hashes
        i = bisect.bisect_left(hashes, h)
        return self.shards[i] if i < len(hashes) and hashes[i] == h else -1

    def key(self, shard: int) -> str:
        """The object key of ``shard`` in its bucket (the dataset's prefix and the shard's key)."""
        return self.prefix + self.table.key(shard)

    def hash_of(self, shard: int) -> int:
        return name_hash(self.bucket, self.key(shard))


def job_index(loc: JobLocality, spec: JobSpec) -> ShardIndex | None:
    """The job's :class:`ShardIndex`, built on first use (derived state: on a thread or in a replay,
    whichever comes first; built twice at worst, alike)."""
    if loc.names is None:
        return None
    index = loc.index
    if index is None:
        index = loc.index = ShardIndex.build(spec)
    return index
