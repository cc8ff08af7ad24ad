"""Checkpoints in dynamic mode against a real ``shardcache master``: a loader's ``state_dict()``
names a mark on the master, and loading it (in a new process's loader, on any number of
trainers, once or many times) makes the master hand out exactly what the loops had not received
at that checkpoint. Also: states of another job, dataset or seed are refused saying what
differs, a mark that is gone is refused clearly, and static mode's DataLoader state with workers.

Each "attempt" is a set of fresh loaders (new trainer ids, as a restarted process has); what an
attempt received after its last checkpoint is what a crash would lose from the model."""

from __future__ import annotations

import collections
import itertools
import pickle
from pathlib import Path
from typing import Any

import pytest

from loader import ConfigError, ShardLoader
from loader.master.client import MasterClient
from loader.master.errors import CheckpointGone
from tests.support.masters import MasterProcess
from tests.support.shards import Written, write_manifest, write_shards

pytestmark = [pytest.mark.filterwarnings("ignore:This DataLoader will create"), pytest.mark.timeout(120)]

Ident = tuple[str, str]


@pytest.fixture
def data(tmp_path: Path) -> tuple[str, Written]:
    written = write_shards(tmp_path / "root" / "bk" / "ck", shards=6, per_shard=10, sizes=(10, 200))
    write_manifest(written)
    return f"file://{tmp_path}/root/bk/ck/", written


def ident(sample: dict[str, Any]) -> Ident:
    return str(sample["__url__"]).rsplit("/", 1)[-1], str(sample["__key__"])


def take(it: Any, n: int) -> list[Ident]:
    return [ident(s) for s in itertools.islice(it, n)]


def loader(url: str, master: str, name: str, **kw: Any) -> ShardLoader:
    args: dict[str, Any] = {"job": name, "master": master, "lease_ttl_s": 30.0, "seed": 3}
    args.update(kw)
    return ShardLoader(url, **args)


def test_resume_from_a_checkpoint_trains_every_sample_once(data: tuple[str, Written], master: str) -> None:
    """Two trainers in step read, checkpoint (both, at the same step), read on, and die; the
    resumed attempt (one trainer: fewer ranks) loads one of the two states and reads the rest."""
    url, written = data
    a, b = loader(url, master, "ck1", epochs=1, continuous=True), loader(url, master, "ck1", epochs=1, continuous=True)
    ia, ib = iter(a), iter(b)
    trained: list[Ident] = []
    for _ in range(7):  # lock step: one sample each per step
        trained += take(ia, 1) + take(ib, 1)
    state_a, state_b = a.state_dict(), b.state_dict()
    assert state_a["mark"] == state_b["mark"] and state_a["clock"] == state_b["clock"] == 7
    pickle.loads(pickle.dumps(state_a))  # small and picklable
    lost = []
    for _ in range(9):  # after the checkpoint: received, never trained (the attempt dies)
        lost += take(ia, 1) + take(ib, 1)
    ia.close(), ib.close()  # what they release (at the samples received) is undone by the rewind too

    resumed = loader(url, master, "ck1", epochs=1, continuous=True)
    resumed.load_state_dict(state_b)  # any rank's state: the same result
    rest = [ident(s) for s in resumed]
    counts = collections.Counter(trained + rest)
    assert set(counts) == set(written.samples), f"missing {len(set(written.samples) - set(counts))} samples"
    twice = [k for k, n in counts.items() if n > 1]
    assert not twice, f"trained twice: {twice}"
    assert set(lost) <= set(rest), "what was received after the checkpoint is read again"
    st = MasterClient(master).status("ck1")
    assert st["finished"] and st["totals"]["rewinds"] == 1


@pytest.mark.slow
def test_loading_on_every_rank_or_twice_is_one_rewind(data: tuple[str, Written], master: str) -> None:
    url, written = data
    a = loader(url, master, "ck2", epochs=1, continuous=True, lease_ttl_s=3.0)
    ia = iter(a)
    trained = take(ia, 13)
    state = a.state_dict()
    take(ia, 20)
    ia.close()
    # One thread reads both: at the end one waits for the other's last lease (a short TTL bounds it).
    r1, r2 = (loader(url, master, "ck2", epochs=1, continuous=True, lease_ttl_s=3.0) for _ in range(2))
    r1.load_state_dict(state)
    r1.load_state_dict(state)
    r2.load_state_dict(state)
    i1, i2 = iter(r1), iter(r2)
    rest: list[Ident] = []
    for _ in range(100):
        got = take(i1, 1) + take(i2, 1)
        if not got:
            break
        rest += got
    rest += [ident(s) for s in i1] + [ident(s) for s in i2]
    counts = collections.Counter(trained + rest)
    assert set(counts) == set(written.samples) and max(counts.values()) == 1


def test_an_older_checkpoint_rewinds_further(data: tuple[str, Written], master: str) -> None:
    url, written = data
    a = loader(url, master, "ck3", epochs=2, continuous=True)
    ia = iter(a)
    first = take(ia, 11)
    old = a.state_dict()
    take(ia, 30)
    a.state_dict()  # a newer checkpoint, not the one resumed from
    take(ia, 5)
    ia.close()
    r = loader(url, master, "ck3", epochs=2, continuous=True)
    r.load_state_dict(old)
    rest = [ident(s) for s in r]
    counts = collections.Counter(first + rest)
    assert set(counts) == set(written.samples) and set(counts.values()) == {2}, "two epochs, each sample once a epoch"


def test_explicit_epochs_resume_mid_epoch_and_at_an_epoch_end(data: tuple[str, Written], master: str) -> None:
    url, written = data
    a = loader(url, master, "ck4", epochs=3)
    epoch0 = [ident(s) for s in a]
    ia = iter(a)
    epoch1 = take(ia, 25)
    state = a.state_dict()
    take(ia, 10)
    ia.close()
    r = loader(url, master, "ck4", epochs=3)
    r.load_state_dict(state)
    epoch1 += [ident(s) for s in r]
    assert collections.Counter(epoch1) == collections.Counter(list(written.samples))
    end = r.state_dict()  # between two epochs
    ir = iter(r)
    assert take(ir, 17)
    ir.close()
    r2 = loader(url, master, "ck4", epochs=3)
    r2.load_state_dict(end)
    epoch2 = [ident(s) for s in r2]
    assert collections.Counter(epoch0) == collections.Counter(epoch2) == collections.Counter(list(written.samples))
    assert list(r2) == [] and r2.finished


def test_a_state_of_another_job_dataset_or_seed_is_refused(data: tuple[str, Written], master: str, tmp_path: Path) -> None:
    url, _ = data
    a = loader(url, master, "ck5", epochs=1)
    ia = iter(a)
    take(ia, 3)
    state = a.state_dict()
    ia.close()
    with pytest.raises(ConfigError, match=r"seed 3 \(this loader: 4\)"):
        loader(url, master, "ck5", epochs=1, seed=4).load_state_dict(state)
    with pytest.raises(ConfigError, match=r"job 'ck5' \(this loader: 'other'\)"):
        loader(url, master, "other", epochs=1).load_state_dict(state)
    other = write_shards(tmp_path / "root" / "bk" / "ck2", shards=2, per_shard=3, sizes=(10, 20))
    write_manifest(other)
    with pytest.raises(ConfigError, match="dataset"):
        loader(f"file://{tmp_path}/root/bk/ck2/", master, "ck5", epochs=1).load_state_dict(state)
    with pytest.raises(ConfigError, match="not a dynamic-mode loader state"):
        loader(url, master, "ck5", epochs=1).load_state_dict({"epoch": 1})
    tampered = dict(state, clock=state["clock"] + 1)
    with pytest.raises(Exception, match="state says"):
        loader(url, master, "ck5", epochs=1).load_state_dict(tampered)


def test_a_mark_that_is_gone_is_refused_clearly(data: tuple[str, Written], master: str) -> None:
    url, _ = data
    a = loader(url, master, "ck6", epochs=1)
    ia = iter(a)
    take(ia, 2)
    early = a.state_dict()
    take(ia, 5)
    late = a.state_dict()
    ia.close()
    loader(url, master, "ck6", epochs=1).load_state_dict(early)
    with pytest.raises(CheckpointGone, match="a rewind to an earlier checkpoint undid it"):
        loader(url, master, "ck6", epochs=1).load_state_dict(late)
    MasterClient(master).delete_job("ck6", force=True)
    b = loader(url, master, "ck6", epochs=1)
    ib = iter(b)
    take(ib, 4)
    b.state_dict()
    ib.close()
    with pytest.raises(CheckpointGone, match="earlier job named 'ck6'"):
        loader(url, master, "ck6", epochs=1).load_state_dict(early)


@pytest.mark.slow
def test_master_killed_between_checkpoint_and_resume_loses_nothing(data: tuple[str, Written], tmp_path: Path) -> None:
    """``kill -9`` of the master after the checkpoint and after the attempt read on past it: the
    restarted master (same SQLite state) knows the mark and every delivery after it, and the
    resumed attempt reads exactly what was not trained."""
    url, written = data
    proc = MasterProcess(tmp_path, f"sqlite://{tmp_path / 'm.db'}", name="m", advertise=False).start("healthz")
    master = proc.url
    try:
        a, b = (loader(url, master, "ck7", epochs=1, continuous=True) for _ in range(2))
        ia, ib = iter(a), iter(b)
        trained: list[Ident] = []
        for _ in range(12):
            trained += take(ia, 1) + take(ib, 1)
        state = a.state_dict()
        b.state_dict()
        for _ in range(10):  # received after the checkpoint, reported by renews and completions
            take(ia, 1), take(ib, 1)
        ia.close(), ib.close()  # the attempt ends (what it gives back is past the mark too)
        proc.kill9()  # the restarted master has only its journal
        proc.start("healthz")  # the same port and state
        resumed = loader(url, master, "ck7", epochs=1, continuous=True)
        resumed.load_state_dict(state)
        rest = [ident(s) for s in resumed]
        counts = collections.Counter(trained + rest)
        assert set(counts) == set(written.samples) and max(counts.values()) == 1
    finally:
        proc.stop()


def test_a_trainer_reading_when_the_job_is_rewound_is_told_and_goes_on(data: tuple[str, Written], master: str) -> None:
    """A rewind while a trainer reads (one rank loads its state after a peer started): the
    reader's leases are revoked; at its next renew or completion it learns it, drops those shards
    and leases again from the rewound job. What it received from the mark until then (the rest
    of the shards it held: the one it read and the one leased ahead) is trained twice, never
    skipped."""
    url, written = data
    a = loader(url, master, "ck8", epochs=1, continuous=True, lease_ttl_s=3.0)
    ia = iter(a)
    trained = take(ia, 14)
    state = a.state_dict()
    again = take(ia, 3)  # received after the checkpoint, then the rewind comes
    other = loader(url, master, "ck8", epochs=1, continuous=True, lease_ttl_s=3.0)
    other.load_state_dict(state)
    rest = [ident(s) for s in ia]  # goes on: its leases were revoked, it leases again
    counts = collections.Counter(trained + again + rest)
    assert set(counts) == set(written.samples)
    twice = {k for k, n in counts.items() if n > 1}
    assert max(counts.values()) == 2 and twice <= set(again + rest), "only what it received after the mark, twice"
    held_then = {k for k in again} | {k for k in rest[:20] if k in twice}
    assert twice <= held_then and len({shard for shard, _ in twice}) <= 2, (
        f"duplicates only from the two shards it held when the job was rewound: {sorted(twice)}"
    )
    st = MasterClient(master).status("ck8")
    assert st["finished"]
