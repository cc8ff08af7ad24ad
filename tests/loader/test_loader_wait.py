"""The loader times the training loop's wait for data (issue 19): against a slow origin (moto
behind a real proxy that delays every object GET) it reports about what the loop really waited,
against a fast one about nothing; the master (a real ``shardcache master``) shows the same totals,
counted once however many renews carried them."""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest

from loader import ShardLoader
from loader.stall import WaitMeter
from tests.support.proxies import FaultProxy
from tests.support.shards import Written, write_manifest, write_shards
from tests.support.waits import wait_until
from wire.stall import WAIT_BUCKETS_S, validate_wait

pytestmark = [pytest.mark.filterwarnings("ignore:This DataLoader will create"), pytest.mark.timeout(120)]

DELAY_S = 0.25  # per object GET of the slow origin
COMPUTE_S = 0.02  # the loop's "training step" per item


def status(master: str, job: str) -> dict[str, Any]:
    return json.load(urllib.request.urlopen(f"{master}/v1/jobs/{job}", timeout=10))


def trainer_wait(master: str, job: str, trainer: str) -> dict[str, Any] | None:
    for t in status(master, job)["trainers"]:
        if t["trainer"] == trainer:
            return t.get("wait")
    raise AssertionError(f"trainer {trainer} not in the job status")


def run_loop(items: Iterable[Any], compute_s: float) -> tuple[int, float, float]:
    """Iterate as a training loop does, timing each ``__next__`` ourselves: (steps, waited, wall)."""
    it: Iterator[Any] = iter(items)
    steps = 0
    waited = 0.0
    began = time.perf_counter()
    while True:
        asked = time.perf_counter()
        try:
            next(it)
        except StopIteration:
            waited += time.perf_counter() - asked
            break
        waited += time.perf_counter() - asked
        steps += 1
        time.sleep(compute_s)  # the training step's compute
    return steps, waited, time.perf_counter() - began


@pytest.fixture
def slow_s3(s3_server: Any, bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, Written]]:
    """4 shards x 6 samples under s3://bucket/train/, read through a proxy delaying each GET."""
    written = write_shards(tmp_path / "w", shards=4, per_shard=6, sizes=(10, 2000))
    write_manifest(written)
    client = s3_server.client()
    for path in sorted(written.root.iterdir()):
        client.put_object(Bucket=bucket, Key="train/" + path.name, Body=path.read_bytes())
    proxy = FaultProxy("127.0.0.1", s3_server.port).start()
    proxy.faults.delay_s = DELAY_S
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
    try:
        yield f"s3://{bucket}/train/", written
    finally:
        proxy.close()


def check_stats(stats: dict[str, Any], steps: int) -> None:
    assert stats["steps"] == steps
    assert sum(stats["buckets"]) == steps and len(stats["buckets"]) == len(WAIT_BUCKETS_S)
    assert 0 <= stats["seconds"] <= stats["elapsed_s"] + 0.01


def test_a_slow_origin_is_reported_as_about_what_the_loop_waited(
    slow_s3: tuple[str, Written], master: str
) -> None:
    url, written = slow_s3
    loader = ShardLoader(url, job="slow", master=master, epochs=1, trainer="t-slow", endpoint="")
    steps, waited, wall = run_loop(loader, COMPUTE_S)
    assert steps == written.total()
    stats = loader.wait_stats()
    check_stats(stats, steps)
    # Each of the 4 shards (and the manifest) cost at least one delayed GET the loop waited for.
    assert waited >= 4 * DELAY_S
    assert abs(stats["seconds"] - waited) <= 0.1 * waited + 0.05
    assert stats["fraction"] == pytest.approx(waited / wall, abs=0.1)
    assert stats["p99_s"] is not None and stats["p99_s"] >= DELAY_S  # the shard opens
    # The master has the same totals: every delta counted once (completes, final report).
    wait = trainer_wait(master, "slow", "t-slow")
    assert wait is not None
    assert wait["steps"] == steps
    assert wait["seconds"] == pytest.approx(stats["seconds"], abs=0.01)
    assert wait["fraction_60s"] == pytest.approx(waited / wall, abs=0.15)
    assert wait["epochs"]["0"]["steps"] == steps
    job_wait = status(master, "slow")["wait"]
    assert job_wait["trainers_waiting"] == 1 and job_wait["fraction_60s"] > 0.3


@pytest.mark.slow
def test_a_fast_origin_reports_almost_no_wait(dataset: tuple[str, Written], master: str) -> None:
    url, written = dataset
    static = ShardLoader(url, seed=2)
    steps, waited, wall = run_loop(static, COMPUTE_S)
    stats = static.wait_stats()
    check_stats(stats, written.total())
    assert stats["fraction"] < 0.15
    assert abs(stats["seconds"] - waited) <= 0.1 * waited + 0.02
    assert stats["p50_s"] is not None and stats["p50_s"] <= 0.01

    dynamic = ShardLoader(url, job="fast", master=master, epochs=1, trainer="t-fast")
    steps, waited, wall = run_loop(dynamic, COMPUTE_S)
    assert steps == written.total()
    wait = trainer_wait(master, "fast", "t-fast")
    assert wait is not None and wait["steps"] == steps
    # A lease request per shard is all the loop waits for (milliseconds against a local master).
    assert wait["fraction_60s"] is not None and wait["fraction_60s"] < 0.2
    assert wait["seconds"] == pytest.approx(dynamic.wait_stats()["seconds"], abs=0.01)


@pytest.mark.slow
def test_many_renews_count_each_wait_once(slow_s3: tuple[str, Written], master: str) -> None:
    url, written = slow_s3
    # A 1 s TTL renews every 0.33 s: about ten renews carry deltas, then the final report.
    loader = ShardLoader(url, job="renews", master=master, epochs=1, trainer="t-renew", endpoint="", lease_ttl_s=1)
    steps, waited, _ = run_loop(loader, 0.1)
    assert steps == written.total()
    stats = loader.wait_stats()
    wait = trainer_wait(master, "renews", "t-renew")
    assert wait is not None
    assert wait["steps"] == stats["steps"] == steps
    assert wait["seconds"] == pytest.approx(stats["seconds"], abs=0.01)
    assert abs(stats["seconds"] - waited) <= 0.1 * waited + 0.05


@pytest.mark.slow
def test_the_drop_in_dataloader_reports_batches_a_plain_one_nothing(
    slow_s3: tuple[str, Written], master: str
) -> None:
    import torch.utils.data

    from loader.torch import DataLoader, ShardDataset

    url, written = slow_s3
    ds = ShardDataset(url, job="dl", master=master, epochs=2, trainer="t-dl", endpoint="", transform=lambda s: s["__key__"])
    dl = DataLoader(ds, batch_size=4, num_workers=2, collate_fn=list)
    steps, waited, _ = run_loop(dl, COMPUTE_S)
    assert steps == written.total() // 4  # 6 batches: steps are batches
    stats = dl.wait_stats()
    check_stats(stats, steps)
    assert abs(stats["seconds"] - waited) <= 0.1 * waited + 0.05
    assert stats["seconds"] >= DELAY_S  # the first batch waits for a delayed GET at least
    wait = trainer_wait(master, "dl", "t-dl")
    assert wait is not None and wait["steps"] == steps
    assert wait["seconds"] == pytest.approx(stats["seconds"], abs=0.01)

    # A plain DataLoader cannot see the loop: the dataset's samples are no steps, nothing is sent.
    plain_ds = ShardDataset(url, job="dl", master=master, epochs=2, trainer="t-plain", endpoint="")
    got = sum(len(batch["__key__"]) for batch in torch.utils.data.DataLoader(plain_ds, batch_size=4, num_workers=0))
    assert got == written.total()
    assert plain_ds.loader.wait_stats()["steps"] == 0
    assert trainer_wait(master, "dl", "t-plain") is None


def test_a_failed_send_keeps_its_delta_for_the_next_report() -> None:
    meter = WaitMeter()
    assert meter.take() is None  # no step yet: nothing to say
    items = meter.timed(iter(range(3)))
    for _ in items:
        time.sleep(0.01)  # a step's compute
    first = meter.take()
    assert first is not None and first.steps == 3 and sum(first.buckets) == 3
    meter.restore(first)  # the send failed
    for _ in meter.timed(iter(range(2))):
        pass
    second = meter.take()
    assert second is not None and second.steps == 5 and sum(second.buckets) == 5
    assert second.elapsed_s >= first.elapsed_s and second.seconds >= first.seconds
    validate_wait(second.field())
    meter.commit(second)
    third = meter.take()
    assert third is None or third.steps == 0
    assert meter.stats()["steps"] == 5


def test_a_wait_in_progress_is_reported_before_it_ends() -> None:
    meter = WaitMeter()
    token = meter.start()
    time.sleep(0.3)  # the wait being measured (the subject): 0.3 s, then 0.1 s more
    during = meter.take()
    assert during is not None and during.steps == 0 and during.seconds >= 0.25
    assert during.seconds <= during.elapsed_s
    time.sleep(0.1)
    meter.stop(token)
    after = meter.take()
    assert after is not None and after.steps == 1 and 0.05 <= after.seconds < 0.25
    assert after.buckets[WAIT_BUCKETS_S.index(0.5)] == 1  # the whole 0.4 s wait's bucket


def _with_sender(meter: WaitMeter, loop: Any) -> list[Any]:
    """Run ``loop()`` while a sender takes reports as fast as it can (giving every seventh back, as
    a failed send does), each checked as the master checks it; all the reports, the last included."""
    import threading

    reports: list[Any] = []
    done = threading.Event()

    def send() -> None:
        while not done.is_set():
            taken = meter.take()
            if taken is not None:
                validate_wait(taken.field())  # buckets add up to steps, seconds within elapsed
                reports.append(taken)
                if len(reports) % 7 == 0:
                    meter.restore(reports.pop())

    sender = threading.Thread(target=send)
    sender.start()
    try:
        loop()
    finally:
        done.set()
        sender.join()
    last = meter.take()
    if last is not None:
        reports.append(last)
    return reports


def _slow(n: int) -> Iterator[int]:
    for i in range(n):
        time.sleep(0.002)  # a wait of 2 ms
        yield i


def test_reports_taken_while_the_loop_runs_add_up_to_its_totals() -> None:
    """The loop's side takes no lock per step: reports taken while loops run are still accepted by
    the master, their steps and buckets add up to every step exactly, and their seconds neither
    lose a wait nor count one twice."""
    import threading

    # Two loops at once: every step counted. (Not their seconds: a report's seconds are capped at
    # its elapsed time, and two loops can wait more than that.)
    meter = WaitMeter()

    def two_loops() -> None:
        second = threading.Thread(target=lambda: sum(1 for _ in meter.timed(_slow(40))))
        second.start()
        assert sum(1 for _ in meter.timed(iter(range(200_000)))) == 200_000
        second.join()

    reports = _with_sender(meter, two_loops)
    totals = meter.stats()
    assert totals["steps"] == sum(r.steps for r in reports) == 200_040
    assert [sum(c) for c in zip(*(r.buckets for r in reports), strict=True)] == totals["buckets"]

    # One loop: the reports' seconds are the meter's, to within a short wait (one read between a
    # wait's two writes is counted in the next report, capped at that report's elapsed time).
    meter = WaitMeter()

    def one_loop() -> None:
        assert sum(1 for _ in meter.timed(iter(range(200_000)))) == 200_000
        assert sum(1 for _ in meter.timed(_slow(40))) == 40

    reports = _with_sender(meter, one_loop)
    totals = meter.stats()
    assert totals["steps"] == sum(r.steps for r in reports) == 200_040
    assert totals["seconds"] >= 40 * 0.002
    assert abs(sum(r.seconds for r in reports) - totals["seconds"]) < 0.005


def test_a_loop_that_reads_ahead_on_a_thread_reports_its_own_steps_waits(
    slow_s3: tuple[str, Written], master: str
) -> None:
    """``loader.timed``: a thread reads the loader into a queue of batches ahead of the loop; what
    the loader reports (and the master shows, and its plans follow) is the loop's wait for
    batches, not the reading thread's wait for samples."""
    import queue
    import threading

    url, written = slow_s3
    loader = ShardLoader(url, job="ahead", master=master, epochs=1, trainer="t-ahead", endpoint="")
    batches: queue.Queue[list[Any] | None] = queue.Queue()
    read_waits: list[float] = []

    def read() -> None:
        batch: list[Any] = []
        it = iter(loader)
        while True:
            asked = time.perf_counter()
            sample = next(it, None)
            read_waits.append(time.perf_counter() - asked)
            if sample is None:
                break
            batch.append(sample)
            if len(batch) == 4:
                batches.put(batch)
                batch = []
        batches.put(batch or None)
        batches.put(None)

    steps_iter = loader.timed(iter(batches.get, None))  # before the thread starts iterating
    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    # The loop starts once the first batch is queued, and its step (0.4 s a batch) is slower than
    # the reading: the queue stays ahead and the loop hardly waits, while the thread waits for
    # every delayed GET (and on a loaded machine the loop's first wait was 0.8 s of the 1.0).
    wait_until(lambda: not batches.empty(), timeout=30, what="the reading thread's first batch")
    steps, waited, _ = run_loop(steps_iter, 0.4)
    reader.join(30)
    assert steps == written.total() // 4
    stats = loader.wait_stats()
    check_stats(stats, steps)
    assert abs(stats["seconds"] - waited) <= 0.1 * waited + 0.05
    assert sum(read_waits) >= 4 * DELAY_S > waited + 0.3  # the thread's waits are not the loop's
    wait = trainer_wait(master, "ahead", "t-ahead")
    assert wait is not None
    assert wait["steps"] == steps  # batches, not samples
    assert wait["seconds"] == pytest.approx(stats["seconds"], abs=0.01)


def test_timed_refuses_a_loader_its_dataloader_times_already() -> None:
    pytest.importorskip("torch")
    from loader.errors import ConfigError
    from loader.torch import ShardDataset

    ds = ShardDataset("s3://bucket/train/", rank=0, world_size=1, seed=0)
    with pytest.raises(ConfigError, match="DataLoader"):
        ds.loader.timed([1, 2])
