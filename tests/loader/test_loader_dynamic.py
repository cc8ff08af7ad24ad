"""Dynamic mode against a real ``shardcache master`` process: joining one job, epochs, exactly-once
delivery across trainers and DataLoader workers, continuous mode, giving back a shard part-read,
corrupt shards reported with ``fail``."""

from __future__ import annotations

import itertools
import json
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from loader import ConfigError, CorruptShard, LoaderSettings, ShardLoader
from loader.master.client import MasterClient
from loader.master.errors import JobConflict
from tests.support.processes import free_port
from tests.support.shards import Written, delivered, write_manifest, write_shards
from tests.support.waits import wait_until

pytestmark = [pytest.mark.filterwarnings("ignore:This DataLoader will create"), pytest.mark.timeout(90)]


def status(master: str, job: str) -> dict[str, Any]:
    return json.load(urllib.request.urlopen(f"{master}/v1/jobs/{job}", timeout=10))


def test_one_trainer_reads_every_epoch_then_the_job_finishes(dataset: tuple[str, Written], master: str) -> None:
    url, written = dataset
    loader = ShardLoader(url, job="j1", master=master, epochs=2, seed=4)
    assert loader.mode == "dynamic"
    first = list(loader)
    assert delivered(first) == written.samples
    assert not loader.finished and loader.epoch == 1
    second = list(loader)
    assert delivered(second) == written.samples
    assert [s["__key__"] for s in first] != [s["__key__"] for s in second]  # reshuffled per epoch
    assert loader.finished
    assert list(loader) == []  # nothing after the last epoch
    st = status(master, "j1")
    assert st["finished"] and st["totals"]["completed"] == 2 * len(written.keys)
    assert st["shards"]["failed"] == 0


def test_same_arguments_join_one_job_different_spec_conflicts(dataset: tuple[str, Written], master: str) -> None:
    url, written = dataset
    a = ShardLoader(url, job="shared", master=master, epochs=1, trainer="a")
    b = ShardLoader(url, job="shared", master=master, epochs=1, trainer="b")
    ita, itb = iter(a), iter(b)
    got = [next(ita), next(itb)]
    jobs = json.load(urllib.request.urlopen(f"{master}/v1/jobs"))["jobs"]
    assert [j["name"] for j in jobs] == ["shared"]
    assert {t["trainer"] for t in status(master, "shared")["trainers"]} == {"a", "b"}
    # Trainers are concurrent by nature: at the end of the epoch one waits for the other's lease.
    rest: list[list[dict[str, Any]]] = [[], []]
    threads = [threading.Thread(target=lambda i=i, it=it: rest[i].extend(it)) for i, it in enumerate((ita, itb))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert delivered(got + rest[0] + rest[1]) == written.samples
    with pytest.raises(JobConflict, match="exists on the master with a different spec"):
        list(ShardLoader(url, job="shared", master=master, epochs=1, seed=99))


def test_concurrent_trainers_deliver_each_sample_once(dataset: tuple[str, Written], master: str) -> None:
    url, written = dataset
    results: dict[str, list[dict[str, Any]]] = {}
    errors: list[BaseException] = []

    def trainer(name: str) -> None:
        try:
            loader = ShardLoader(url, job="conc", master=master, epochs=1, trainer=name, lease_ttl_s=10)
            results[name] = list(loader)
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=trainer, args=(f"t{i}",)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    assert delivered([s for r in results.values() for s in r]) == written.samples
    st = status(master, "conc")
    assert st["finished"] and st["totals"]["completed"] == len(written.keys) and st["totals"]["reissued"] == 0


def test_torch_workers_each_lease_their_own_shards(dataset: tuple[str, Written], master: str) -> None:
    torch_data = pytest.importorskip("torch.utils.data")
    from loader.torch import ShardDataset

    url, written = dataset
    ds = ShardDataset(url, job="torchjob", master=master, epochs=2, trainer="gpu0")
    loader = torch_data.DataLoader(ds, batch_size=None, num_workers=4)
    for _ in range(2):
        assert delivered(list(loader)) == written.samples
    st = status(master, "torchjob")
    assert st["finished"] and st["totals"]["completed"] == 2 * len(written.keys)
    # One trainer (the iterating process); its workers are lease streams under it.
    assert [t["trainer"] for t in st["trainers"]] == ["gpu0"]
    assert {s["stream"] for s in st["trainers"][0]["streams"]} <= {f"w{i}" for i in range(4)}


def test_continuous_mode_runs_across_epochs(dataset: tuple[str, Written], master: str) -> None:
    url, written = dataset
    loader = ShardLoader(url, job="cont", master=master, epochs=3, continuous=True)
    samples = list(loader)
    assert len(samples) == 3 * written.total()
    seen: dict[tuple[str, str], int] = {}
    for s in samples:
        ident = (s["__url__"].rsplit("/", 1)[-1], s["__key__"])
        seen[ident] = seen.get(ident, 0) + 1
    assert set(seen) == set(written.samples) and set(seen.values()) == {3}
    assert loader.finished
    # a fixed number of steps for DDP: islice a continuous loader
    steps = list(itertools.islice(ShardLoader(url, job="cont2", master=master, continuous=True), written.total() + 3))
    assert len(steps) == written.total() + 3


def test_stopping_early_hands_the_rest_to_another_trainer(dataset: tuple[str, Written], master: str) -> None:
    """A trainer that stops mid-shard releases its leases at the offset reached: another trainer
    gets the shard at once (not after the 60 s TTL), at that offset: no sample twice, none lost."""
    url, written = dataset
    spec = dict(job="handover", master=master, epochs=1, lease_ttl_s=60.0, settings=LoaderSettings(lease_ahead=1))
    a = ShardLoader(url, trainer="a", **spec)
    it = iter(a)
    head = [next(it) for _ in range(3)]
    it.close()  # GeneratorExit: the shard being read (offset 3) and the one leased ahead go back
    st = status(master, "handover")
    assert st["totals"]["released"] == 2 and st["shards"]["leased"] == 0, st
    rest = list(ShardLoader(url, trainer="b", **spec))
    assert delivered(head + rest) == written.samples
    st = status(master, "handover")
    assert st["finished"] and st["totals"]["reissued"] == 2 and st["totals"]["completed"] == len(written.keys)


def test_corrupt_shard_is_reported_and_skipped(tmp_path: Path, master: str) -> None:
    written = write_shards(tmp_path / "d", shards=4, per_shard=5)
    write_manifest(written)
    bad = written.keys[2]
    path = tmp_path / "d" / bad
    path.write_bytes(path.read_bytes()[:2500])
    url = f"file://{tmp_path}/d/"
    # A short TTL: the raising trainer leaves its queued lease behind until it expires.
    spec: dict[str, Any] = dict(job="corrupt", master=master, epochs=1, max_failures=2, lease_ttl_s=1.0)
    got: list[dict[str, Any]] = []
    # on_error="raise": the error reaches the caller, and the master knows (the shard is back to todo)
    with pytest.raises(CorruptShard, match="truncated"):
        for sample in ShardLoader(url, trainer="r", **spec):
            got.append(sample)
    st = status(master, "corrupt")
    assert st["totals"]["failures"] == 1 and st["shards"]["failed"] == 0 and not st["finished"]
    # on_error="skip": it fails again, reaches max_failures, is marked failed, and the epoch completes
    got += ShardLoader(url, trainer="s", on_error="skip", **spec)
    st = status(master, "corrupt")
    assert st["finished"], st
    failed = st["failed_shards"] or st.get("failed_previous_epoch")
    assert [f["key"] for f in failed] == [bad] and "truncated" in failed[0]["last_error"]
    assert st["totals"]["completed"] == len(written.keys) - 1
    good = [s for s in got if not s["__url__"].endswith(bad)]
    assert delivered(good) == {k: v for k, v in written.samples.items() if k[0] != bad}


@pytest.mark.slow
def test_leased_shards_are_prefetched_through_the_daemon(
    dataset: tuple[str, Written], master: str, start_daemon: Any
) -> None:
    url, written = dataset
    root = url[len("file://") :].split("/bkt/")[0]
    endpoint = start_daemon(f"file://{root}")
    loader = ShardLoader(url, job="pf", master=master, epochs=1, endpoint=endpoint,
                         settings=LoaderSettings(lease_ahead=2))
    it = iter(loader)
    next(it)  # holds three leases: one being read, two hinted to the daemon with priority lease

    def prefetched() -> int:
        return int(json.load(urllib.request.urlopen(endpoint + "/_shardcache/stats"))["prefetch"]["done"])

    wait_until(lambda: prefetched() >= 2, timeout=20, what="two lease prefetches done")
    st = status(master, "pf")
    assert st["shards"]["leased"] == 3
    rest = list(it)
    assert len(rest) == written.total() - 1


def test_master_client_is_shared_contract(master: str) -> None:
    """The loader relies on these client calls; keep them honest against the real master."""
    client = MasterClient(master)
    st = client.create_job({"name": "c", "dataset": "s3://b/p/", "shards": [{"key": "a.tar", "size": 1, "samples": 2}], "epochs": 1})
    assert st["name"] == "c"
    answer = client.lease("c", trainer="t", node="n", count=2)
    assert answer["status"] == "ok" and len(answer["leases"]) == 1
    lease = answer["leases"][0]["lease"]
    assert client.renew("c", lease, "t", 1) > 0
    client.complete("c", lease, "t")
    assert client.lease("c", trainer="t", node="n", count=1)["status"] == "finished"


def test_leaving_trainer_releases_or_reports_its_offset(master: str, tmp_path: Path) -> None:
    """How a trainer gives its leases back when it stops: released at the offset on a master that
    knows ``release``; on one from before it (the route answers 404, as this client subclass does
    in place of an old master) the offset is reported by a final renew and the lease expires; with
    no master reachable it gives up at once instead of also trying to renew."""
    from loader.master.errors import BadRequest
    from loader.master.stream import Held, Renewer

    class OldMaster(MasterClient):
        def release(self, job: str, lease: str, trainer: str, offset: int, clock: int | None = None) -> str:
            raise BadRequest("HTTP 404: Not Found")

    spec = {"name": "bye", "dataset": "s3://b/p/", "epochs": 1, "lease_ttl_s": 60,
            "shards": [{"key": f"{i}.tar", "size": 1, "samples": 10} for i in range(3)]}
    client = MasterClient(master)
    client.create_job(spec)

    def hold(trainer: str, position: int) -> Held:
        item = client.lease("bye", trainer=trainer, node="n", count=1)["leases"][0]
        return Held(item["lease"], item["shard"], item["key"], 0, 0, 60.0, position=position)

    released = hold("a", 4)
    renewer = Renewer(client, "bye", "a", 1 / 3)
    renewer.add(released)
    renewer.stop(give_back=True)
    assert released.done and status(master, "bye")["totals"]["released"] == 1
    reissued = client.lease("bye", trainer="b", node="n", count=1)["leases"][0]
    assert (reissued["shard"], reissued["offset"]) == (released.shard, 4)

    kept = hold("c", 7)
    renewer = Renewer(OldMaster(master), "bye", "c", 1 / 3)
    renewer.add(kept)
    renewer.stop(give_back=True)
    st = status(master, "bye")
    assert st["totals"]["released"] == 1 and st["shards"]["leased"] == 2  # still held, offset reported
    renew = urllib.request.Request(f"{master}/v1/jobs/bye/leases/{kept.lease}/renew", method="POST",
                                   data=json.dumps({"trainer": "c", "offset": 0}).encode())
    assert json.load(urllib.request.urlopen(renew, timeout=10))["offset"] == 7  # what the final renew reported

    gone = MasterClient(f"http://127.0.0.1:{free_port()}", retry_deadline_s=0.5)
    renewer = Renewer(gone, "bye", "c", 1 / 3)
    renewer.add(Held(kept.lease, kept.shard, kept.key, 0, 0, 60.0, position=8))
    renewer.add(Held("nosuchlease0000", 0, "x", 0, 0, 60.0))
    began = time.monotonic()
    renewer.stop(give_back=True)
    assert time.monotonic() - began < 5  # one unanswered call, not one per lease plus renewals


def test_the_locality_window_comes_from_the_loader_or_the_environment(dataset: tuple[str, Written], master: str) -> None:
    """Cache-aware leases (issue 18): ``locality_window`` joins the job spec, from the argument or
    ``SHARDCACHE_LOCALITY_WINDOW``; every sample still once; a bad value says what to use."""
    url, written = dataset
    settings = LoaderSettings.from_env({"SHARDCACHE_LOCALITY_WINDOW": "8", "SHARDCACHE_NODE": "node-a"})
    loader = ShardLoader(url, job="windowed", master=master, epochs=1, settings=settings)
    assert delivered(list(loader)) == written.samples
    st = status(master, "windowed")
    assert st["spec"]["locality_window"] == 8 and st["locality"]["window"] == 8
    assert st["locality"]["leases"]["unplaced"] == len(written.keys)  # no ring, no reads before: nothing known
    # The argument wins; the same job with another window is a conflict naming the field.
    with pytest.raises(JobConflict) as conflict:
        list(ShardLoader(url, job="windowed", master=master, epochs=1, settings=settings, locality_window=4))
    assert "locality_window" in conflict.value.details["differs"]
    assert status(master, "windowed")["spec"]["locality_window"] == 8
    plain = ShardLoader(url, job="plain", master=master, epochs=1)
    assert delivered(list(plain)) == written.samples and status(master, "plain")["locality"] is None
    with pytest.raises(ConfigError, match="SHARDCACHE_LOCALITY_WINDOW='lots'"):
        LoaderSettings.from_env({"SHARDCACHE_LOCALITY_WINDOW": "lots"})
    with pytest.raises(ConfigError, match="locality_window"):
        ShardLoader(url, job="bad", master=master, locality_window=-1)
