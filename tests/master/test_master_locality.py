"""Cache-aware leases (loader/master/server/locality.py) in the pure state machine: window 0 is the
plain seeded shuffle, any window keeps every shard exactly once per epoch and moves the order by
less than the window, shards go to the node that owns or caches them, owners follow the ring as
``wire.rendezvous`` places them, and the spec and snapshots carry it all."""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

import pytest

from loader.master.errors import BadRequest
from loader.master.server.events import Complete, CreateJob, Lease, Placement
from loader.master.server.locality import Owners, Ring
from loader.master.server.spec import JobSpec, ShardSpec
from loader.master.server.state import MasterState
from wire.rendezvous import owner
from wire.shuffle import EpochOrder

NODES = ("n0", "n1", "n2", "n3")
RING = tuple((f"http://10.0.0.{i}:8600", node) for i, node in enumerate(NODES))


class Driver:
    """One job, trainers one per node leasing in turns and completing at once."""

    def __init__(self, n: int, window: int, *, ring: tuple[tuple[str, str], ...] | None = RING, epochs: int = 2,
                 seed: int = 7) -> None:
        self.state = MasterState()
        self.now = 100.0
        self.ids = 0
        self.log: list[tuple[Any, float]] = []
        if ring is not None:
            self.apply(Placement(ring))
        shards = tuple(ShardSpec(f"shard-{i:05d}.tar", 1000, 10) for i in range(n))
        self.spec = JobSpec("job", "s3://bucket/train/", shards, epochs, seed, True, 60.0, 3, window)
        self.apply(CreateJob(self.spec))

    def apply(self, event: Any) -> dict[str, Any]:
        result = self.state.apply(event, self.now)
        if result.mutated:
            self.log.append((result.record, result.now))
        return result.answer

    def lease(self, node: str) -> dict[str, Any] | None:
        self.ids += 1
        answer = self.apply(Lease("job", f"t-{node}", node, 1, None, (f"lease{self.ids:08d}",)))
        return answer["leases"][0] if answer["status"] == "ok" else None

    def run_epoch(self, nodes: tuple[str, ...] = NODES) -> list[tuple[str, int]]:
        """Trainers lease in turns until the epoch is handed out; (node, shard) in hand-out order."""
        epoch = self.state.jobs["job"].epoch
        taken: list[tuple[str, int]] = []
        held: list[tuple[str, str]] = []
        for _ in range(10 * self.spec.table.__len__() + 10):
            for node in nodes:
                got = self.lease(node)
                if got is None or got["epoch"] != epoch:
                    if got is not None:  # the next epoch opened: give it back to a later call
                        held.append((node, got["lease"]))
                    continue
                taken.append((node, got["shard"]))
                self.apply(Complete("job", got["lease"], f"t-{node}"))
            if len(taken) == len(self.spec.shards):
                break
        for node, lease in held:
            self.apply(Complete("job", lease, f"t-{node}"))
        return taken

    def locality(self) -> dict[str, Any]:
        return self.state.status("job", self.now)["locality"]


def test_window_0_is_the_plain_seeded_shuffle_whatever_the_ring() -> None:
    drive = Driver(200, 0, epochs=2)
    for epoch in range(2):
        taken = drive.run_epoch()
        assert [shard for _, shard in taken] == list(EpochOrder(200, 7, epoch, True))
    assert drive.state.status("job", drive.now)["locality"] is None


@pytest.mark.parametrize("window", [1, 2, 16, 64, 500])
def test_any_window_hands_out_every_shard_once_per_epoch_and_moves_the_order_less_than_the_window(window: int) -> None:
    n = 300
    drive = Driver(n, window, epochs=3)
    for epoch in range(3):
        taken = drive.run_epoch()
        assert sorted(shard for _, shard in taken) == list(range(n)), f"epoch {epoch}: not each shard exactly once"
        order = EpochOrder(n, 7, epoch, True)
        moved = [abs(k - order.index(shard)) for k, (_, shard) in enumerate(taken)]
        assert max(moved) < window
    report = drive.locality()
    assert [e["epoch"] for e in report["epochs"]] == [1, 2]  # the open ones and the last two done
    assert all(e["max_displacement"] < window and e["handed"] == n for e in report["epochs"])
    if window == 1:
        # Window 1 looks at the cursor only: the plain order, with its locality counted.
        assert [shard for _, shard in taken] == list(EpochOrder(n, 7, 2, True))
        assert all(e["spearman"] == 1.0 and e["mean_displacement"] == 0 for e in report["epochs"])


def test_shards_go_to_the_node_that_owns_them_then_to_the_node_that_read_them() -> None:
    n = 400
    drive = Driver(n, 32, epochs=2)
    taken = drive.run_epoch()
    members = [m for m, _ in RING]
    node_of = dict(RING)
    owners = {shard: owner(members, f"bucket/train/shard-{shard:05d}.tar") for _, shard in taken}
    owned = sum(1 for node, shard in taken if node_of.get(owners[shard] or "") == node)
    assert owned / n > 0.9, f"only {owned}/{n} leases went to the owner's node"
    first = drive.locality()
    assert first["leases"]["owner"] == owned and first["local_share"] > 0.9
    assert 0 < first["epochs"][0]["mean_displacement"] < 32 and first["epochs"][0]["spearman"] > 0.9

    # No ring (per-node caches): the second epoch goes where the first one read each shard.
    drive2 = Driver(n, 32, ring=None, epochs=2)
    first_read = dict((shard, node) for node, shard in drive2.run_epoch())
    assert drive2.locality()["leases"]["unplaced"] == n  # nothing known in epoch 1
    second = drive2.run_epoch()
    again = sum(1 for node, shard in second if first_read[shard] == node)
    assert again / n > 0.9
    assert drive2.locality()["leases"]["cached"] == again


def test_the_plain_order_gets_a_quarter_local_so_the_window_is_what_moves_it() -> None:
    n = 400
    plain = Driver(n, 1, epochs=1)
    plain.run_epoch()
    share = plain.locality()["local_share"]
    assert 0.15 < share < 0.35  # 4 nodes: ~1/4 by chance


def test_a_node_with_no_trainers_does_not_starve_its_shards() -> None:
    """Shards owned by n3, where no trainer runs, are still handed out, each within the window."""
    n = 200
    drive = Driver(n, 8, epochs=1)
    taken = drive.run_epoch(nodes=("n0", "n1", "n2"))
    assert sorted(s for _, s in taken) == list(range(n))
    assert drive.locality()["epochs"][0]["max_displacement"] < 8


def test_owners_follow_the_ring_incrementally_as_rendezvous_places_them() -> None:
    names = [f"bucket/train/s{i}" for i in range(300)]
    ring = Ring()
    owners = Owners(len(names), names.__getitem__)
    pool = [f"http://10.1.0.{i}:8600" for i in range(12)]
    steps = [pool[:4], pool[:6], pool[1:6], pool[1:6] + pool[8:10], pool[8:10], pool[:12], [pool[3]], pool[2:5]]
    for live in steps:
        ring.update((m, f"node-{m[-6:-5]}") for m in live)
        for i in range(0, len(names), 3):  # some shards memoised at each version, others later
            assert owners.member(i, ring) == owner(live, names[i])
    for i, name in enumerate(names):
        assert owners.member(i, ring) == owner(steps[-1], name)
    assert not ring.update((m, f"node-{m[-6:-5]}") for m in steps[-1])  # the same ring: no change


def test_a_ring_change_mid_epoch_and_a_restore_choose_as_a_master_that_never_stopped() -> None:
    drive = Driver(150, 16, epochs=2)
    for _ in range(40):
        drive.lease("n0")
        drive.lease("n2")
    drive.apply(Placement(RING[1:]))  # n0's daemon left the ring
    snapshot = json.loads(json.dumps(drive.state.to_json()))
    restored = MasterState.from_json(snapshot)
    text_restored = MasterState.from_text(drive.state.snapshot_text())
    for state in (restored, text_restored):
        assert state.to_json() == drive.state.to_json()
        assert state.ring.node_of == drive.state.ring.node_of
    before = len(drive.log)
    for node in ("n1", "n0", "n3", "n2") * 10:
        drive.lease(node)
    for event, at in drive.log[before:]:
        restored.apply(event, at)
        text_restored.apply(event, at)
    assert restored.to_json() == drive.state.to_json() == text_restored.to_json()


def test_the_window_is_a_spec_field_written_only_when_set() -> None:
    shards = [{"key": "a.tar"}, {"key": "b.tar"}]
    plain = JobSpec.from_json({"name": "j", "dataset": "s3://b/p/", "shards": shards})
    assert plain.locality_window == 0 and "locality_window" not in plain.json_text
    windowed = JobSpec.from_json({"name": "j", "dataset": "s3://b/p/", "shards": shards, "locality_window": 64})
    assert windowed.locality_window == 64 and windowed.summary()["locality_window"] == 64
    assert JobSpec.from_log_text(windowed.json_text) == windowed
    assert JobSpec.from_log(json.loads(windowed.json_text)) == windowed
    assert JobSpec.from_log_text(plain.json_text) == plain
    for bad in (-1, 65_537, "8", 2.5, True):
        with pytest.raises(BadRequest, match="locality_window"):
            JobSpec.from_json({"name": "j", "dataset": "s3://b/p/", "shards": shards, "locality_window": bad})


def test_a_placement_is_checked_before_it_changes_anything() -> None:
    state = MasterState()
    for bad in ((("", "n0"),), (("m", 3),), (("m",),), ((("m", "n", "x")),)):
        with pytest.raises(BadRequest):
            state.apply(Placement(bad), 1.0)  # type: ignore[arg-type]
    assert state.ring.version == 0
    assert state.apply(Placement(RING), 1.0).mutated
    assert not state.apply(Placement(tuple(reversed(RING))), 2.0).mutated  # the same members


def test_a_file_dataset_is_placed_by_its_readers_only() -> None:
    state = MasterState()
    state.apply(Placement(RING), 1.0)
    spec = JobSpec("j", "file:///data/b/p/", tuple(ShardSpec(f"s{i}") for i in range(20)), 2, 0, True, 60.0, 3, 8)
    state.apply(CreateJob(spec), 1.0)
    kinds: Counter[str] = Counter()
    for i in range(20):
        got = state.apply(Lease("j", "t", "n0", 1, None, (f"lease{i:08d}",)), 2.0).answer["leases"][0]
        state.apply(Complete("j", got["lease"], "t"), 2.0)
    kinds.update(state.status("j", 2.0)["locality"]["leases"])
    assert kinds["unplaced"] == 20 and kinds["owner"] == 0
