"""The data resumes where the model's checkpoint is, under real torchrun (gloo on loopback).

The training script (``train.py``) checkpoints ``loader.torch.DataLoader``'s state with the step
every few steps, the two ways scripts do: every rank with ``torch.distributed.checkpoint`` (the
DataLoader is a ``Stateful``), or rank 0 alone with ``torch.save``; at start it loads the latest
checkpoint on every rank. A failure then makes the next attempt resume from that checkpoint:

- an elastic restart (``--nnodes=1:2 --max-restarts=1``): rank 1 raises a few steps after a
  checkpoint, torchrun restarts the group, which loads the checkpoint;
- a whole job killed (``kill -9`` of torchrun and every rank) after a checkpoint and submitted
  again on fewer ranks.

What the model trained on is, per attempt, the batches before the step the next attempt resumed
at, plus everything the last attempt received (``Logs.trained``). With every rank saving, every
sample of every epoch is in it exactly once; with rank 0 saving, at least once, the duplicates
being what the other ranks received since their last renew before the checkpoint."""

from __future__ import annotations

import collections
import time
from pathlib import Path
from typing import Any

import pytest

from tests.support.shards import Written
from tests.support.torchrun import Ident, Logs, TorchRun, job_status, make_dataset, sample_offsets

pytest.importorskip("torch", reason="torch is not installed: scripts/test.sh installs it (CPU build, torch==2.13.0)")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

__all__: list[str] = []

SHARDS, PER_SHARD, BATCH = 10, 24, 4  # 240 samples: 30 steps an epoch on 2 ranks
EPOCHS = 2
LEASE_TTL_S = 3.0
RENEW_INTERVAL_S = LEASE_TTL_S / 3
SLEEP_S = 0.05
CKPT_EVERY = 8
RUN_TIMEOUT_S = 120.0


def _args(url: str, ckpt: Path, way: str, workers: int, *extra: str) -> list[str]:
    return [
        "--url", url, "--epochs", str(EPOCHS), "--continuous", "--batch-size", str(BATCH),
        "--num-workers", str(workers), "--lease-ttl-s", str(LEASE_TTL_S), "--sleep", str(SLEEP_S),
        "--gloo-timeout-s", "30", "--ckpt-dir", str(ckpt), "--ckpt-every", str(CKPT_EVERY), "--ckpt-way", way, *extra,
    ]


def _rank0_duplicate_bound(logs: Logs, attempt: int, resumed_at: int) -> int:
    """With rank 0 saving alone, the other ranks' samples since their last renew before the
    checkpoint are trained again: at most what each received in the renew interval (+ slack)
    before the checkpoint step."""
    ckpt_t = None
    for (rank, att), recs in logs.batches.items():
        if att == attempt and rank == 0:
            ckpt_t = next((float(r["t"]) for r in recs if int(r["step"]) == resumed_at - 1), None)
    assert ckpt_t is not None, "rank 0's last batch before the checkpoint is in its log"
    bound = 0
    for (rank, att), recs in logs.batches.items():
        if att != attempt or rank == 0:
            continue
        bound += sum(len(r["samples"]) for r in recs
                     if int(r["step"]) < resumed_at and float(r["t"]) >= ckpt_t - RENEW_INTERVAL_S - 2.0)
    return bound


def _check_trained(logs: Logs, written: Written, way: str, report: str) -> None:
    trained = logs.trained()
    counts = collections.Counter(ident for _, _, ident in trained)
    assert set(counts) <= set(written.samples), "trained samples the dataset does not hold"
    missing: list[Ident] = [k for k in written.samples if counts[k] < EPOCHS]
    assert not missing, (
        f"{len(missing)} samples were trained fewer than {EPOCHS} times (once per epoch): "
        f"{sample_offsets(written, missing)}\n{report}"
    )
    extra = sum(n - EPOCHS for n in counts.values())
    if way == "dcp":
        twice = [k for k, n in counts.items() if n > EPOCHS]
        assert not twice, f"every rank saved: no sample may be trained twice in an epoch: {sample_offsets(written, twice)}\n{report}"
    else:
        resumed_at: dict[int, int] = {}
        for (_, att), step in logs.resumed.items():
            if step > 0:
                resumed_at[att] = min(step, resumed_at.get(att, step))
        bound = sum(_rank0_duplicate_bound(logs, att - 1, step) for att, step in resumed_at.items())
        assert extra <= bound, f"{extra} duplicates, more than the {bound} rank 1 received in its last renew interval\n{report}"


@pytest.mark.parametrize(("way", "workers"), [("dcp", 2), ("rank0", 0)])
def test_elastic_restart_resumes_at_the_checkpoint(tmp_path: Path, master: str, way: str, workers: int) -> None:
    url, written = make_dataset(tmp_path, SHARDS, PER_SHARD)
    job = f"ckpt-elastic-{way}"
    fail_at = 2 * CKPT_EVERY + 5  # a few steps after the second checkpoint
    args = _args(url, tmp_path / "ckpt", way, workers, "--fail-at-step", str(fail_at), "--fail-rank", "1")
    with TorchRun(tmp_path, args, nproc=2, nnodes="1:2", max_restarts=1, master=master, job=job) as run:
        rc = run.wait(RUN_TIMEOUT_S)
        report = run.report(rc, RUN_TIMEOUT_S)
    assert rc == 0, report
    logs = run.logs()
    assert logs.resumed.get((0, 1)) == logs.resumed.get((1, 1)) == 2 * CKPT_EVERY, (
        f"attempt 1 must resume at the last checkpoint: {logs.resumed}\n{report}"
    )
    after = [r for r in logs.batches.get((1, 0), []) if int(r["step"]) >= 2 * CKPT_EVERY]
    assert after, "attempt 0 trained past its checkpoint before it failed (what the rewind must give back)"
    _check_trained(logs, written, way, report)
    status: dict[str, Any] | None = job_status(master, job)
    assert status is not None and status["finished"] and status["totals"]["rewinds"] >= 1, status


def _run_until_killed(run: TorchRun, after_ckpt_steps: int, timeout: float) -> None:
    """Wait until a checkpoint was made and every rank trained a few steps past it, then
    ``kill -9`` torchrun and every rank (a node lost, a job evicted)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        logs = run.logs()
        ckpts = [s for steps in logs.ckpts.values() for s in steps]
        if ckpts:
            last = max(ckpts)
            steps = [max((int(r["step"]) for r in recs), default=-1) for recs in logs.batches.values()]
            if steps and min(steps) >= last + after_ckpt_steps:
                run.kill()
                return
        if run.proc.poll() is not None:
            raise AssertionError(f"the run ended before it could be killed:\n{run.report(run.proc.returncode, timeout)}")
        time.sleep(0.1)
    raise AssertionError(f"no checkpoint within {timeout}s:\n{run.report(None, timeout)}")


def _merged(first: Logs, second: Logs) -> Logs:
    """Two torchrun runs' logs as one job's attempts 0 and 1."""
    out = Logs()
    for att, logs in ((0, first), (1, second)):
        for (rank, _), recs in logs.batches.items():
            out.batches[(rank, att)] = recs
        for (rank, _), step in logs.resumed.items():
            out.resumed[(rank, att)] = step
        for (rank, _), done in logs.done.items():
            out.done[(rank, att)] = done
    return out


@pytest.mark.parametrize("way", ["dcp", "rank0"])
def test_a_killed_job_resubmitted_on_fewer_ranks_resumes_at_the_checkpoint(tmp_path: Path, master: str, way: str) -> None:
    url, written = make_dataset(tmp_path, SHARDS, PER_SHARD)
    job = f"ckpt-resubmit-{way}"
    ckpt = tmp_path / "ckpt"
    first_dir, second_dir = tmp_path / "run1", tmp_path / "run2"
    first_dir.mkdir(), second_dir.mkdir()
    with TorchRun(first_dir, _args(url, ckpt, way, 0), nproc=3, master=master, job=job) as first:
        _run_until_killed(first, 4, RUN_TIMEOUT_S)
    with TorchRun(second_dir, _args(url, ckpt, way, 2), nproc=2, master=master, job=job) as second:
        rc = second.wait(RUN_TIMEOUT_S)
        report = second.report(rc, RUN_TIMEOUT_S) + "\n\nfirst run:\n" + first.report(None, RUN_TIMEOUT_S)
    assert rc == 0, report
    logs = _merged(first.logs(), second.logs())
    resumed = {logs.resumed.get((r, 1)) for r in range(2)}
    assert len(resumed) == 1 and next(iter(resumed)) in [s for steps in first.logs().ckpts.values() for s in steps], (
        f"the resubmitted job resumes at the first run's last checkpoint: {logs.resumed}\n{report}"
    )
    _check_trained(logs, written, way, report)
    status = job_status(master, job)
    assert status is not None and status["finished"], status


def test_explicit_epochs_resume_at_the_epoch_checkpoint(tmp_path: Path, master: str) -> None:
    """Non-continuous mode (``for batch in dl`` per epoch, a barrier after each, a checkpoint
    after each barrier, every rank saving): ranks take different numbers of batches in an epoch,
    yet each rank's clock is the same at the epoch's end, so the checkpoint is one mark and the
    resumed attempt reads the failed epoch again, exactly."""
    url, written = make_dataset(tmp_path, SHARDS, PER_SHARD)
    job = "ckpt-epochs"
    args = [
        "--url", url, "--epochs", "3", "--batch-size", str(BATCH), "--num-workers", "0",
        "--lease-ttl-s", str(LEASE_TTL_S), "--sleep", str(SLEEP_S), "--gloo-timeout-s", "30",
        "--ckpt-dir", str(tmp_path / "ckpt"), "--ckpt-every", "1", "--ckpt-way", "dcp",
        "--fail-at-step", "40", "--fail-rank", "1",  # its 40th batch: in epoch 1 (about 30 an epoch)
    ]
    with TorchRun(tmp_path, args, nproc=2, nnodes="1:2", max_restarts=1, master=master, job=job) as run:
        rc = run.wait(RUN_TIMEOUT_S)
        report = run.report(rc, RUN_TIMEOUT_S)
    assert rc == 0, report
    logs = run.logs()
    assert logs.resumed.get((0, 1)) == logs.resumed.get((1, 1)) == 1, f"resumed after epoch 0: {logs.resumed}\n{report}"
    counts = collections.Counter(ident for _, _, ident in logs.trained())
    wrong = {k: counts[k] for k in written.samples if counts[k] != 3}
    assert not wrong, f"every sample trained once in each of 3 epochs; off: {sample_offsets(written, list(wrong))}\n{report}"
    status = job_status(master, job)
    assert status is not None and status["finished"], status
