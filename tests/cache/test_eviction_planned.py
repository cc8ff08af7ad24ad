"""``--eviction planned`` (issue 32): victims by the lease master's plan, Belady's rule over the
order its trainers will read in (:class:`cache.eviction.PlannedPolicy`), on a real store in a
temporary directory, and the policy against a naive model of its rule.

The rule: borrowed entries first (those the plan does not rank, least recently used first, then
those it ranks, farthest first), then owned entries the plan does not rank (least recently used
first; an entry whose name leaves the plan goes to the oldest end), then owned ranked entries,
farthest needed first. Pinned entries never go. A fill the plan asked for (``Store.spare_kept``)
never evicts a ranked entry. Without a plan, ``lru``'s victims exactly.

An entry a reader's hint filled (``Store.awaited``) goes after the ranked ones of its kind until it
is read, the plan ranks it, the second plan after it came does not, or ``AWAITED_S`` passed; then
it is unranked, as if just filled.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

from cache import Entry, Store, StoreSettings
from cache.eviction import BorrowedFirst, LRUPolicy, PlannedPolicy
from wire.nodeplan import name_hash

SIZE = 100


def make(root: Path, capacity: int = 4 * SIZE, eviction: str = "planned", max_items: int = 1000) -> Store:
    store = Store(StoreSettings(root=root, capacity_bytes=capacity, min_free_ratio=0.0, eviction=eviction, max_items=max_items))
    store.open()
    return store


class Evictions:
    """What left the store, in order (a watcher)."""

    def __init__(self, store: Store) -> None:
        self.keys: list[str] = []
        store.watch(self)

    def __call__(self, added: object, removed: list[Entry] | tuple[Entry, ...]) -> None:
        self.keys.extend(entry.key for entry in removed)

    def take(self) -> list[str]:
        taken, self.keys = self.keys, []
        return taken


def put(store: Store, key: str, size: int = SIZE, borrowed: bool = False, hinted: bool = False) -> Entry | None:
    if hinted:
        with store.awaited("b", key):
            return put(store, key, size, borrowed)
    writer = store.begin("b", key, f'"{key}"', size, borrowed=borrowed)
    if writer is None:
        return None
    writer.write_at(0, os.urandom(size))
    return writer.commit()


def cached(root: Path, keys: str) -> tuple[Store, Evictions]:
    """A planned store holding one entry per letter of ``keys``, and what leaves it from now on."""
    store = make(root)
    gone = Evictions(store)
    for key in keys:
        put(store, key)
    return store, gone


def plan(store: Store, *keys: str) -> dict[str, int]:
    return store.set_plan([name_hash("b", key) for key in keys], name_hash)


def keys_of(store: Store) -> set[str]:
    return {entry.key for entry in store.entries()}


def test_ranked_entries_go_farthest_needed_first(tmp_path):
    store, gone = cached(tmp_path, "abcd")
    plan(store, "d", "a", "c", "b")  # b is needed last
    put(store, "e")  # a demand read's fill: evicts a ranked entry, the farthest
    assert gone.take() == ["b"]
    put(store, "f")  # e is not ranked: first to go among the rest
    assert gone.take() == ["e"]
    put(store, "g")
    assert gone.take() == ["f"]
    plan(store, "g", "d", "a", "c")
    put(store, "h")
    assert gone.take() == ["c"]
    put(store, "i")  # h unranked, LRU first
    assert gone.take() == ["h"]


def test_unranked_entries_go_first_in_lru_order(tmp_path):
    store, gone = cached(tmp_path, "abcd")
    plan(store, "b", "a")
    store.touch_in_memory(store.lookup("b", "c"))  # c used after d: d is the least recently used
    put(store, "e")
    assert gone.take() == ["d"]
    put(store, "f")
    assert gone.take() == ["c"]
    # ranked a and b stay whatever their recency: a read of them changes nothing
    store.touch_in_memory(store.lookup("b", "e"))
    put(store, "g")
    assert gone.take() == ["f"]
    assert keys_of(store) == {"a", "b", "e", "g"}


def test_an_entry_leaving_the_plan_goes_first(tmp_path):
    store, gone = cached(tmp_path, "abcd")
    plan(store, "a", "b", "c")
    store.touch_in_memory(store.lookup("b", "d"))
    plan(store, "a", "c")  # b no longer needed: before d, read long ago as it was
    put(store, "e")
    assert gone.take() == ["b"]
    put(store, "f")
    assert gone.take() == ["d"]


def test_borrowed_entries_go_first_ranked_or_not(tmp_path):
    store = make(tmp_path)
    gone = Evictions(store)
    put(store, "own1")
    put(store, "lent1", borrowed=True)
    put(store, "lent2", borrowed=True)
    put(store, "own2")
    plan(store, "lent1", "own1", "lent2")  # own2 unranked, both borrowed ranked
    put(store, "x")
    assert gone.take() == ["lent2"]  # borrowed before any owned one, ranked: the farthest
    put(store, "y")
    assert gone.take() == ["lent1"]
    put(store, "z")
    assert gone.take() == ["own2"]  # then owned unranked
    put(store, "w")
    assert gone.take() == ["x"]


def test_pinned_entries_never_go(tmp_path):
    store, gone = cached(tmp_path, "abcd")
    plan(store, "a", "b", "c", "d")
    with store.pinned(store.lookup("b", "d")), store.pinned(store.lookup("b", "c")):
        put(store, "e")
        assert gone.take() == ["b"]  # farthest unpinned
    put(store, "f")  # e unranked goes first
    assert gone.take() == ["e"]
    put(store, "g")
    assert gone.take() == ["f"]
    plan(store, "a", "c", "d", "g")
    with store.pinned(store.lookup("b", "a")), store.pinned(store.lookup("b", "c")), \
            store.pinned(store.lookup("b", "d")), store.pinned(store.lookup("b", "g")):
        assert put(store, "h") is None  # everything in use: not admitted, nothing evicted
        assert gone.take() == []
    put(store, "h")
    assert gone.take() == ["g"]  # unpinned again: farthest first, as if never passed over


def test_a_refetched_ranked_entry_is_found_where_its_rank_says(tmp_path):
    store, gone = cached(tmp_path, "abcd")
    plan(store, "a", "b", "c", "d", "e")
    put(store, "x")  # evicts d: the walk down the plan's order passes e (not cached) and d
    put(store, "y")  # x is unranked
    put(store, "e")  # y is unranked; e, the farthest, comes in behind the walk
    assert gone.take() == ["d", "x", "y"]
    put(store, "z")
    assert gone.take() == ["e"]  # not c, where the walk stood
    put(store, "w")
    assert gone.take() == ["z"]
    assert keys_of(store) == {"a", "b", "c", "w"}


def test_a_plan_prefetch_never_evicts_an_entry_the_plan_keeps(tmp_path):
    store, gone = cached(tmp_path, "abcd")
    plan(store, "a", "b", "c")  # d unranked
    assert store.plan_room(SIZE) and not store.plan_room(2 * SIZE)
    with store.spare_kept("b", "p1"):
        assert put(store, "p1") is not None  # evicts d, the only entry the plan does not keep
    assert gone.take() == ["d"]
    plan(store, "a", "b", "c", "p1")
    assert not store.plan_room(SIZE)
    with store.spare_kept("b", "p2"):
        assert put(store, "p2") is None  # nothing the plan does not keep: not admitted
        store.unspare("b", "p2")  # a demand read joined the fill: it may evict as a demand read does
        assert put(store, "p2") is not None
    assert gone.take() == ["p1"]
    assert store.stats()["rejected_full"] == 1


def test_a_plan_prefetch_larger_than_the_room_it_may_make_evicts_nothing(tmp_path):
    store, gone = cached(tmp_path, "abcd")
    plan(store, "a", "b")  # c and d unranked: 2 x SIZE spare
    with store.spare_kept("b", "big"):
        assert put(store, "big", 3 * SIZE) is None
    assert gone.take() == []  # refused up front: c and d were not evicted in vain
    with store.spare_kept("b", "two"):
        assert put(store, "two", 2 * SIZE) is not None
    assert sorted(gone.take()) == ["c", "d"]


def test_plan_room_under_lru_and_hold(tmp_path):
    lru = make(tmp_path / "lru", eviction="lru")
    hold = make(tmp_path / "hold", eviction="hold")
    for store in (lru, hold):
        for key in "abc":
            put(store, key)
        plan(store, "a", "b", "c")  # ignored: neither evicts by plan
    assert lru.plan_room(4 * SIZE)  # lru: a plan prefetch evicts by LRU
    assert hold.plan_room(SIZE) and not hold.plan_room(2 * SIZE)  # hold: free room only
    with lru.spare_kept("b", "x"):
        put(lru, "x", 2 * SIZE)
    assert keys_of(lru) == {"b", "c", "x"}  # a, the least recently used, made the room


@pytest.mark.parametrize("seed", range(6))
def test_without_a_plan_the_victims_are_lrus(tmp_path, seed):
    """The same reads and fills on an ``lru`` and a ``planned`` store: the same victims, in order."""
    rng = random.Random(seed)
    stores = [make(tmp_path / name, capacity=6 * SIZE, eviction=name) for name in ("lru", "planned")]
    logs = [Evictions(store) for store in stores]
    for _ in range(60):
        key = f"k{rng.randrange(14)}"
        op = rng.random()
        size = rng.choice((SIZE // 2, SIZE, 2 * SIZE))
        borrowed = rng.random() < 0.3
        for store in stores:
            entry = store.lookup("b", key)
            if entry is not None and op < 0.5:
                store.touch_in_memory(entry)
            elif entry is None:
                put(store, key, size, borrowed)
    assert logs[0].keys == logs[1].keys and logs[0].keys
    assert keys_of(stores[0]) == keys_of(stores[1])


def test_the_watcher_sees_every_entry_once(tmp_path):
    store = make(tmp_path)
    put(store, "a")
    put(store, "b")
    seen: list[tuple[str, str]] = []
    unwatch = store.watch(lambda added, removed: seen.extend(
        [("+", e.key) for e in added] + [("-", e.key) for e in removed]))
    assert sorted(seen) == [("+", "a"), ("+", "b")]  # what is indexed now, first
    seen.clear()
    put(store, "c")
    store.remove(store.lookup("b", "a"))
    assert seen == [("+", "c"), ("-", "a")]
    unwatch()
    put(store, "d")
    assert seen == [("+", "c"), ("-", "a")]


def test_a_hinted_entry_is_kept_until_it_is_read(tmp_path):
    """A reader's hint filled it and nobody read it yet: the plan cannot rank it before the master
    hears of it, and as an unranked entry it was the first a plan's fill evicted."""
    store, gone = cached(tmp_path, "abc")
    plan(store, "a", "b")  # c unranked
    put(store, "h", hinted=True)
    assert store.plan_figures()["awaited_items"] == 1
    assert store.plan_room(SIZE) and not store.plan_room(2 * SIZE)  # c is the plan's to take, h is not
    with store.spare_kept("b", "p1"):
        assert put(store, "p1") is not None
    assert gone.take() == ["c"]
    plan(store, "a", "b", "p1")  # answers a report that may predate h: h still awaited
    assert store.plan_figures()["awaited_items"] == 1
    with store.spare_kept("b", "p2"):
        assert put(store, "p2") is None  # nothing but what the plan keeps and h
    assert gone.take() == []
    put(store, "d")  # a demand fill: the farthest ranked, never h
    assert gone.take() == ["p1"]
    with store.pinned(store.lookup("b", "d")):  # d, unranked, in use: the rest go in order
        put(store, "e")
        with store.pinned(store.lookup("b", "e")):
            put(store, "f")
            with store.pinned(store.lookup("b", "f")):
                put(store, "g")
    assert gone.take() == ["b", "a", "h"]  # ranked farthest first, then the awaited one


def test_a_hinted_entry_read_waits_for_nobody(tmp_path):
    store, gone = cached(tmp_path, "abc")
    plan(store, "a", "b", "c")
    put(store, "h", hinted=True)
    store.touch_in_memory(store.lookup("b", "h"))  # read: an unranked entry like any other
    assert store.plan_figures()["awaited_items"] == 0
    put(store, "d")
    assert gone.take() == ["h"]


def test_the_plan_decides_for_a_hinted_entry_the_second_plan_after_it(tmp_path):
    store, gone = cached(tmp_path, "ab")
    plan(store, "a", "b")
    put(store, "h1", hinted=True)
    put(store, "h2", hinted=True)
    plan(store, "a", "b")  # answers a report that may predate h1 and h2: they stay awaited
    assert store.plan_figures()["awaited_items"] == 2
    plan(store, "a", "h2", "b")  # the master knew of them: h2 ranked, h1 not needed
    assert store.plan_figures() == {"plan_names": 3, "ranked_items": 3, "unranked_items": 1, "awaited_items": 0}
    put(store, "c")
    assert gone.take() == ["h1"]  # not needed by the plan: an unranked entry, the only one
    put(store, "d")
    assert gone.take() == ["c"]
    put(store, "e")
    assert gone.take() == ["d"]


def test_a_hinted_entry_is_awaited_no_longer_than_awaited_s(tmp_path):
    """A master gone silent decides nothing: the entry stops being awaited after AWAITED_S."""
    now = [0.0]
    store = make(tmp_path)
    store._policy = PlannedPolicy(clock=lambda: now[0])  # the same policy, on a clock the test moves
    gone = Evictions(store)
    for key in "abc":
        put(store, key)
    plan(store, "a", "b", "c")
    put(store, "h", hinted=True)
    now[0] = PlannedPolicy.AWAITED_S - 1
    put(store, "d")
    assert gone.take() == ["c"]  # ranked, farthest: h still awaited
    now[0] = PlannedPolicy.AWAITED_S + 1
    put(store, "e")  # unread for AWAITED_S: unranked now, as if just filled (d is older)
    assert gone.take() == ["d"] and store.plan_figures()["awaited_items"] == 0
    put(store, "f")
    assert gone.take() == ["h"]  # before any ranked entry


def test_without_a_plan_a_hint_changes_nothing(tmp_path):
    store = make(tmp_path)
    gone = Evictions(store)
    put(store, "h", hinted=True)
    for key in "abcd":
        put(store, key)
    assert gone.take() == ["h"]  # lru's order: a daemon without a master keeps today's policy
    assert store.plan_figures()["awaited_items"] == 0


def test_a_reader_joining_a_hinted_fill_reads_it_as_it_lands(tmp_path):
    store = make(tmp_path)
    plan(store, "x")
    with store.awaited("b", "h"):
        writer = store.begin("b", "h", '"h"', SIZE)
        assert writer is not None
        store.unspare("b", "h")  # a demand read joined the fill
        writer.write_at(0, os.urandom(SIZE))
        writer.commit()
    assert store.plan_figures()["awaited_items"] == 0


def test_under_lru_and_hold_a_hint_changes_nothing(tmp_path):
    for eviction in ("lru", "hold"):
        store = make(tmp_path / eviction, eviction=eviction)
        plan(store, "h")
        put(store, "h", hinted=True)
        assert store.plan_figures() == {}


def test_the_policy_reports_its_figures(tmp_path):
    store = make(tmp_path)
    for key in "abc":
        put(store, key)
    figures = plan(store, "a", "b", "x", "a")  # x not cached; a twice: its first place counts
    assert figures == {"plan_names": 3, "ranked_items": 2, "unranked_items": 1, "awaited_items": 0}
    assert store.stats()["policy"] == figures


# -- the policy against a naive model of its rule --------------------------------------------------


class Model:
    """Every entry with its recency (a clock; entries that left the plan below every other) and
    pins, and the awaited ones (hinted: since which plan, since when); the victim by sorting all of
    them by the rule."""

    def __init__(self) -> None:
        self.entries: dict[str, Entry] = {}
        self.recency: dict[str, float] = {}
        self.ranks: dict[int, int] = {}
        self.clock = 0
        self.low = 0.0
        self.plans = 0
        self.now = 0.0
        self.awaited: dict[str, tuple[int, int, float]] = {}  # id -> (order, plans then, time then)

    def add(self, entry: Entry, hinted: bool = False) -> None:
        self.clock += 1
        self.entries[entry.id] = entry
        self.recency[entry.id] = self.clock
        if hinted and self.plans and name_hash(entry.bucket, entry.key) not in self.ranks:
            self.awaited[entry.id] = (self.clock, self.plans, self.now)

    def touch(self, entry: Entry) -> None:
        if self.awaited.pop(entry.id, None) is not None or name_hash(entry.bucket, entry.key) not in self.ranks:
            self.clock += 1
            self.recency[entry.id] = self.clock

    def remove(self, entry: Entry) -> None:
        del self.entries[entry.id]
        del self.recency[entry.id]
        self.awaited.pop(entry.id, None)

    def _to_oldest(self, ident: str) -> None:
        self.low -= 1
        self.recency[ident] = self.low

    def _to_newest(self, ident: str) -> None:
        self.clock += 1
        self.recency[ident] = self.clock

    def plan(self, keep: list[int]) -> None:
        old = self.ranks
        self.ranks = {}
        for rank, name in enumerate(keep):
            self.ranks.setdefault(name, rank)
        self.plans += 1
        for ident, (_, since, _) in sorted(self.awaited.items(), key=lambda item: item[1][0]):
            entry = self.entries[ident]
            if name_hash(entry.bucket, entry.key) in self.ranks:
                del self.awaited[ident]
            elif since <= self.plans - 2:  # the plan had its chance: not needed, as if just filled
                del self.awaited[ident]
                self._to_newest(ident)
        # leaving entries: to the oldest end, the farthest (by the old plan) oldest of them
        leaving = [e for e in self.entries.values()
                   if name_hash(e.bucket, e.key) in old and name_hash(e.bucket, e.key) not in self.ranks]
        for entry in sorted(leaving, key=lambda e: old[name_hash(e.bucket, e.key)]):
            self._to_oldest(entry.id)

    def victim(self, spare_ranked: bool) -> Entry | None:
        for ident, (_, _, since) in sorted(self.awaited.items(), key=lambda item: item[1][0]):
            if since <= self.now - PlannedPolicy.AWAITED_S:
                del self.awaited[ident]
                self._to_newest(ident)

        def key(entry: Entry) -> tuple[int, float]:
            rank = self.ranks.get(name_hash(entry.bucket, entry.key))
            base = 0 if entry.borrowed else 3
            if entry.id in self.awaited:
                return base + 2, self.awaited[entry.id][0]
            return base + (rank is not None), (-rank if rank is not None else self.recency[entry.id])

        candidates = [e for e in self.entries.values() if e.pins == 0
                      and not (spare_ranked and (name_hash(e.bucket, e.key) in self.ranks or e.id in self.awaited))]
        return min(candidates, key=key, default=None)


@pytest.mark.parametrize("seed", range(40))
def test_the_policy_agrees_with_the_model(seed):
    rng = random.Random(seed)
    model = Model()
    policy = PlannedPolicy(clock=lambda: model.now)
    names = [f"k{i}" for i in range(30)]
    live: dict[str, Entry] = {}
    for step in range(400):
        op = rng.random()
        key = rng.choice(names)
        if op < 0.35 and key not in live:
            entry = Entry(id=f"{key}@{step}", bucket="b", key=key, etag="e", size=rng.randint(1, 9), xxh3_128="",
                          created=step, borrowed=rng.random() < 0.25)
            hinted = rng.random() < 0.3
            live[key] = entry
            policy.on_add(entry)
            if hinted:
                policy.on_awaited(entry)
            model.add(entry, hinted)
        elif op < 0.5 and key in live:
            policy.on_touch(live[key])
            model.touch(live[key])
        elif op < 0.6 and key in live:
            entry = live.pop(key)
            policy.on_remove(entry)
            model.remove(entry)
        elif op < 0.7 and key in live:
            live[key].pins = 1 - live[key].pins
        elif op < 0.72:
            model.now += rng.choice((1.0, PlannedPolicy.AWAITED_S / 2))
        elif op < 0.77:
            keep = [name_hash("b", k) for k in rng.sample(names, rng.randint(0, len(names)))]
            keep += keep[: rng.randint(0, 3)]  # a name twice: its first place counts
            ranks: dict[int, int] = {}
            for rank, name in enumerate(keep):
                ranks.setdefault(name, rank)
            order = list(ranks)
            ranks = {name: rank for rank, name in enumerate(order)}
            old = model.ranks
            policy.plan(order, ranks, [n for n in ranks if n not in old], [n for n in old if n not in ranks], name_hash)
            model.plan(keep)
        else:
            spare = rng.random() < 0.3
            expected = model.victim(spare)
            got = policy.victim(spare)
            assert got is expected, (step, got, expected)
            if got is not None and rng.random() < 0.8:  # the store evicts it
                live.pop(got.key)
                policy.on_remove(got)
                model.remove(got)
        unranked = sum(e.size for e in model.entries.values()
                       if name_hash(e.bucket, e.key) not in model.ranks and e.id not in model.awaited)
        assert policy.spare()[0] == unranked
        assert policy.describe()["awaited_items"] == len(model.awaited)


@pytest.mark.parametrize("seed", range(10))
def test_without_a_plan_the_policy_is_lru(seed):
    rng = random.Random(seed)
    planned, lru = PlannedPolicy(), BorrowedFirst(LRUPolicy())
    live: dict[str, Entry] = {}
    for step in range(300):
        key = f"k{rng.randrange(20)}"
        op = rng.random()
        if op < 0.4 and key not in live:
            live[key] = Entry(id=key, bucket="b", key=key, etag="e", size=1, xxh3_128="", created=step,
                              borrowed=rng.random() < 0.3)
            planned.on_add(live[key])
            lru.on_add(live[key])
        elif op < 0.6 and key in live:
            planned.on_touch(live[key])
            lru.on_touch(live[key])
        elif op < 0.7 and key in live:
            live[key].pins = 1 - live[key].pins
        else:
            victim = planned.victim()
            assert victim is lru.victim()
            if victim is not None:
                del live[victim.key]
                planned.on_remove(victim)
                lru.on_remove(victim)


def test_a_borrowed_copy_never_evicts_an_entry_the_plan_keeps(tmp_path):
    """A peer read's copy of another daemon's object takes only room the plan does not keep: it
    would have cost a kept entry's next read a fetch from the origin, for a copy whose owner keeps
    the object anyway. With no such room the read is served uncached."""
    store, gone = cached(tmp_path, "abcd")
    plan(store, "a", "b", "c")  # d unranked
    assert put(store, "lent1", borrowed=True) is not None
    assert gone.take() == ["d"]
    plan(store, "a", "b", "c", "lent1")
    assert put(store, "lent2", borrowed=True) is None  # all ranked: not admitted, nothing evicted
    assert gone.take() == []
    assert put(store, "own") is not None  # a demand fill of an owned object evicts by the plan
    assert gone.take() == ["lent1"]  # borrowed first, the farthest ranked
