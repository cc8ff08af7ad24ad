"""Synchronous data-parallel training under real torchrun (gloo on loopback): 2 and 3 ranks read
one continuous job from a real master, with 0 and 2 DataLoader workers, an ``all_reduce`` every
step and the same fixed step count on every rank. The shard count (11) is not a multiple of the
world size, so at every epoch's end some rank holds the epoch's last shards while another has
none left: the case that must not deadlock. Every rank must finish all its steps within the
bound; the samples received are then checked for balance (continuous mode does not say which
epoch a sample belongs to, so the check counts how often each sample came)."""

from __future__ import annotations

import collections
import math
from pathlib import Path

import pytest

from tests.support.torchrun import TorchRun, job_status, make_dataset

pytest.importorskip("torch", reason="torch is not installed: scripts/test.sh installs it (CPU build, torch==2.13.0)")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(150)]

__all__: list[str] = []

# 176 samples: 44 batches an epoch, for 2 or 3 ranks. Shards of 4 batches: more than a DataLoader
# worker reads ahead (prefetch_factor 2), so a blocked rank's workers cannot finish them alone.
SHARDS, PER_SHARD, BATCH = 11, 16, 4
RUN_TIMEOUT_S = 90.0  # the gloo timeout (30 s) turns a deadlock into an exit well before this
SLEEP_S = 0.02  # emulated compute per step


@pytest.mark.parametrize(("nproc", "workers"), [(2, 0), (2, 2), (3, 0), (3, 2)])
def test_fixed_steps_with_all_reduce_finish_on_every_rank(tmp_path: Path, master: str, nproc: int, workers: int) -> None:
    url, written = make_dataset(tmp_path, SHARDS, PER_SHARD)
    dataset = written.total()
    # 3.5 epochs' worth of samples over the world: every run crosses three epoch ends.
    steps = math.ceil(3.5 * dataset / (BATCH * nproc))
    job = f"ddp-{nproc}-{workers}"
    args = [
        "--url", url, "--steps", str(steps), "--batch-size", str(BATCH), "--num-workers", str(workers),
        "--lease-ttl-s", "10", "--sleep", str(SLEEP_S), "--gloo-timeout-s", "30",
    ]
    with TorchRun(tmp_path, args, nproc=nproc, master=master, job=job) as run:
        rc = run.wait(RUN_TIMEOUT_S)
        report = run.report(rc, RUN_TIMEOUT_S)
    assert rc == 0, f"{nproc} ranks x {workers} workers, {steps} steps each:\n{report}"

    logs = run.logs()
    for rank in range(nproc):
        done = logs.done.get((rank, 0))
        assert done is not None and done["steps"] == steps, f"rank {rank} did not finish {steps} steps:\n{report}"
        assert [rec["step"] for rec in logs.batches[(rank, 0)]] == list(range(steps)), report
    assert not any(attempt for _, attempt in logs.batches), f"no restart was asked for:\n{report}"

    counts = collections.Counter(ident for _, _, ident in logs.received())
    total = sum(counts.values())
    assert total == steps * BATCH * nproc  # continuous mode: every batch is full
    assert set(counts) <= set(written.samples), "received samples that the dataset does not hold"
    # Each epoch hands out every sample once, so over the run no sample can come more than once
    # per (partly) started epoch, and none can be left out of an epoch that was read in full.
    most, least = total / dataset + 1, total // dataset - 1
    over = {ident: n for ident, n in counts.items() if n > most}
    under = [ident for ident in written.samples if counts.get(ident, 0) < least]
    assert not over, f"received more than {most:.2f} times: {dict(list(over.items())[:5])}"
    assert not under, f"received fewer than {least} times: {under[:5]} ({len(under)} samples)"


EPOCHS = 2


def test_epoch_loop_reads_every_sample_exactly_once_per_epoch(tmp_path: Path, master: str) -> None:
    """The non-continuous loop, ``for batch in dl`` each epoch and a barrier after it (train.py's
    ``--epochs``): 11 shards on 2 ranks. Every rank ends every epoch, and every sample comes
    exactly once per epoch: the epoch barrier that non-continuous mode keeps."""
    url, written = make_dataset(tmp_path, SHARDS, PER_SHARD)
    job = "epochs-2-2"
    args = [
        "--url", url, "--epochs", str(EPOCHS), "--batch-size", str(BATCH), "--num-workers", "2",
        "--lease-ttl-s", "10", "--sleep", str(SLEEP_S), "--gloo-timeout-s", "30",
    ]
    with TorchRun(tmp_path, args, nproc=2, master=master, job=job) as run:
        rc = run.wait(RUN_TIMEOUT_S)
        report = run.report(rc, RUN_TIMEOUT_S)
    assert rc == 0, f"2 ranks x 2 workers, {EPOCHS} epochs:\n{report}"

    logs = run.logs()
    assert {rank for rank, _ in logs.done} == {0, 1}, f"every rank ends every epoch:\n{report}"
    status = job_status(master, job)
    assert status is not None and status["finished"] and status["totals"]["completed"] == SHARDS * EPOCHS, status
    counts = collections.Counter(ident for _, _, ident in logs.received())
    wrong = {ident: counts.get(ident, 0) for ident in written.samples if counts.get(ident, 0) != EPOCHS}
    assert not wrong and set(counts) <= set(written.samples), f"not exactly {EPOCHS} times each: {dict(list(wrong.items())[:5])}"
