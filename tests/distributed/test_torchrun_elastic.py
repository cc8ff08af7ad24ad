"""An elastic restart under real torchrun: ``--nnodes=1:2 --max-restarts=1``, two ranks reading a
one-epoch continuous job from a real master (the README's elastic recipe: one pass, an
``all_reduce`` every step, a rank that ran out joining its peers' collectives until they end),
and rank 1 raising mid-epoch on the first attempt. torchrun stops the worker group and
starts a new one, whose ranks join the same job and read what is left of the epoch.

Afterwards the master must show the epoch done with every shard completed exactly once, and the
training loops of both attempts together must have received every sample of the dataset: a
sample that a DataLoader worker had read ahead (still queued in the DataLoader when its rank
died) must not count as read. The only duplicates allowed are the ones the lease protocol
allows: samples the dead ranks received after their last renew."""

from __future__ import annotations

import collections
from pathlib import Path
from typing import Any

import pytest

from tests.support.shards import Written
from tests.support.torchrun import Ident, Logs, TorchRun, job_status, lease_lines, make_dataset, sample_offsets

pytest.importorskip("torch", reason="torch is not installed: scripts/test.sh installs it (CPU build, torch==2.13.0)")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(150)]

__all__: list[str] = []

SHARDS, PER_SHARD, BATCH = 12, 48, 4  # 576 samples: 72 steps an epoch on 2 ranks, 12 per shard
LEASE_TTL_S = 3.0
RENEW_INTERVAL_S = LEASE_TTL_S / 3  # LoaderSettings.renew_fraction
RENEW_SLACK_S = 2.0  # a renew's round trip, a worker learning what its rank consumed, scheduling
# The first attempt runs for several renew intervals (41 steps of >= 0.1 s), so that what its
# renews reported is what the second attempt resumes from; it also completes some shards. (At
# step 12 with 0.05 s steps it would end before its first renew: only completions would count.)
FAIL_RANK, FAIL_AT_STEP = 1, 40
SLEEP_S = 0.1
RUN_TIMEOUT_S = 90.0


def _loader_lines(run: TorchRun, shards: set[str]) -> str:
    """Attempt 0's last lease lines (renewed, released, lost, completed) for these shards."""
    out: list[str] = []
    for path in sorted(run.log_dir.glob("rank*-attempt0.log")):
        last: dict[tuple[str, str], str] = {}
        for line in path.read_text(errors="replace").splitlines():
            for shard in shards:
                if shard in line:
                    kind = next((k for k in ("renewed", "released", "lost", "completed", "leased") if k in line), "")
                    last[(shard, kind)] = line
        out.extend(f"{path.name}: {line}" for _, line in sorted(last.items()))
    return "\n".join(out) or "(no lease lines for them)"


def _lost_at_restart(run: TorchRun, logs: Logs, written: Written) -> tuple[list[Ident], dict[str, int]]:
    """Samples attempt 0's training loops never received that the job nevertheless counts as read:
    those of a shard attempt 0 completed, and those below the offset attempt 1 resumed a shard at
    (the loader's lease log says both). Checked before anything else, so that it shows even when
    the second attempt does not get to the epoch's end. Also: where attempt 1 resumed each shard."""
    got = {ident for _, _, ident in logs.received(0)}
    resumed, _ = lease_lines(run.log_dir, 1)
    _, completed = lease_lines(run.log_dir, 0)
    lost: list[Ident] = []
    for shard, keys in written.order.items():
        upto = len(keys) if (shard, 0) in completed else resumed.get((shard, 0), 0)
        lost.extend((shard, key) for key in keys[:upto] if (shard, key) not in got)
    return lost, {shard: offset for (shard, _), offset in resumed.items() if offset}


def _duplicate_bound(logs: Logs) -> tuple[int, set[str]]:
    """How many samples a correct loader may hand out twice across the restart, and from which shards.

    A rank tells the master how far into each leased shard its training loop got with every
    renew, once per ``RENEW_INTERVAL_S``; the shard is re-issued to the next attempt from the
    last offset the master recorded. So the samples received again are at most the ones a dead
    rank received after its last renew before it died: within ``RENEW_INTERVAL_S`` (+ slack)
    of the last batch it received (it received nothing after that, so its death was no earlier).
    They all belong to shards that rank was reading then."""
    bound, shards = 0, set[str]()
    for (_, attempt), recs in logs.batches.items():
        if attempt != 0 or not recs:
            continue
        end = float(recs[-1]["t"])
        for rec in recs:
            if float(rec["t"]) >= end - RENEW_INTERVAL_S - RENEW_SLACK_S:
                bound += len(rec["samples"])
                shards.update(s[0] for s in rec["samples"])
    return bound, shards


@pytest.mark.parametrize("workers", [2, 0])
def test_restart_after_a_rank_fails_mid_epoch_loses_no_sample(tmp_path: Path, master: str, workers: int) -> None:
    url, written = make_dataset(tmp_path, SHARDS, PER_SHARD)
    job = f"elastic-{workers}"
    args = [
        "--url", url, "--epochs", "1", "--continuous", "--batch-size", str(BATCH), "--num-workers", str(workers),
        "--lease-ttl-s", str(LEASE_TTL_S), "--sleep", str(SLEEP_S), "--gloo-timeout-s", "30",
        "--fail-at-step", str(FAIL_AT_STEP), "--fail-rank", str(FAIL_RANK),
    ]
    with TorchRun(tmp_path, args, nproc=2, nnodes="1:2", max_restarts=1, master=master, job=job) as run:
        rc = run.wait(RUN_TIMEOUT_S)
        report = run.report(rc, RUN_TIMEOUT_S)
    logs = run.logs()
    lost, resumed = _lost_at_restart(run, logs, written)
    assert not lost, (
        f"{len(lost)} samples that attempt 0's training loops never received were counted as read (read ahead "
        f"of the loop, still queued in its DataLoader): {sample_offsets(written, lost)}; attempt 1 resumed "
        f"{resumed or 'no shard'} past 0\n"
        f"attempt 0's last lease lines for those shards:\n{_loader_lines(run, {s for s, _ in lost})}\n\n{report}"
    )
    assert rc == 0, f"2 ranks x {workers} workers, rank {FAIL_RANK} failing at step {FAIL_AT_STEP}:\n{report}"

    failed = logs.batches.get((FAIL_RANK, 0), [])
    assert failed and failed[-1]["step"] == FAIL_AT_STEP, f"rank {FAIL_RANK} did not fail where asked:\n{report}"
    assert set(logs.done) == {(0, 1), (1, 1)}, f"the second attempt's two ranks must finish, and only they:\n{report}"
    assert logs.done[(0, 1)]["steps"] == logs.done[(1, 1)]["steps"], report

    status: dict[str, Any] | None = job_status(master, job)
    assert status is not None and status["finished"], f"job not finished: {status}"
    assert status["totals"]["completed"] == SHARDS, f"every shard completed exactly once: {status}"
    assert status["shards"]["failed"] == 0 and status["totals"]["failures"] == 0, status

    by_attempt: dict[int, collections.Counter[Ident]] = {}
    for attempt in (0, 1):
        by_attempt[attempt] = collections.Counter(ident for _, _, ident in logs.received(attempt))
        twice = [ident for ident, n in by_attempt[attempt].items() if n > 1]
        assert not twice, f"attempt {attempt} received {len(twice)} samples twice: {sample_offsets(written, twice)}"
    received = set(by_attempt[0]) | set(by_attempt[1])
    assert received <= set(written.samples), "received samples that the dataset does not hold"

    missing = sorted(set(written.samples) - received)
    assert not missing, (
        f"{len(missing)} of {written.total()} samples never reached a training loop "
        f"(attempt 0 received {sum(by_attempt[0].values())}, attempt 1 {sum(by_attempt[1].values())}): "
        f"{sample_offsets(written, missing)}\n"
        f"attempt 0's last lease lines for those shards:\n{_loader_lines(run, {s for s, _ in missing})}"
    )

    duplicates = sorted(set(by_attempt[0]) & set(by_attempt[1]))
    bound, open_shards = _duplicate_bound(logs)
    # A shard attempt 0 received part of was being read when it ended, whenever that part came.
    for shard in {s for s, _ in by_attempt[0]}:
        if any((shard, key) not in by_attempt[0] for key in written.order[shard]):
            open_shards.add(shard)
    stray = [ident for ident in duplicates if ident[0] not in open_shards]
    assert not stray, f"received again from shards attempt 0 was not reading at its end: {sample_offsets(written, stray)}"
    assert len(duplicates) <= bound, (
        f"{len(duplicates)} samples received by both attempts, more than the {bound} attempt 0 received in its last "
        f"{RENEW_INTERVAL_S + RENEW_SLACK_S:g} s: {sample_offsets(written, duplicates)}"
    )
