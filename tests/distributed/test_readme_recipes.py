"""The README's DDP and elastic recipes, run as written under real torchrun (2 ranks, gloo): the
code blocks are taken from README.md, with only the dataset URL, the checkpoint path and the sizes
made small enough for this machine. The DDP recipe must run its fixed step count on every rank
across epoch ends, checkpointing with torch.distributed.checkpoint, and a second submission must
resume from its last checkpoint; the elastic one must survive a rank killed with SIGKILL mid-job
(torchrun restarts the group, the same script loads rank 0's checkpoint and rejoins the job) and
finish the job. (What the model trained on is checked sample by sample in
test_torchrun_checkpoint.py.)"""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest

from tests.support.torchrun import TorchRun, job_status, make_dataset

pytest.importorskip("torch", reason="torch is not installed: scripts/test.sh installs it (CPU build, torch==2.13.0)")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(150)]

__all__: list[str] = []

README = Path(__file__).resolve().parents[2] / "README.md"
SHARDS, PER_SHARD = 11, 16  # 11 shards on 2 ranks: never an even split
LEASE_TTL_S = 3  # the killed rank's leases come back after this (30 s by default)


def recipe(name: str, url: str, changes: dict[str, str]) -> str:
    """The python block after ``<!-- recipe: name -->`` in the README, with ``changes`` applied
    (each must occur exactly once: a recipe edited out of shape fails here, not silently)."""
    match = re.search(rf"<!-- recipe: {name} -->\n```python\n(.*?)\n```", README.read_text(), re.DOTALL)
    assert match, f"README.md has no '<!-- recipe: {name} -->' python block"
    code = match.group(1)
    for old, new in {'"s3://imagenet/train/"': repr(url), **changes}.items():
        assert code.count(old) == 1, f"recipe {name}: expected {old!r} once"
        code = code.replace(old, new)
    return code


def test_the_ddp_recipe_runs_its_steps_on_every_rank_and_resumes_at_its_checkpoint(tmp_path: Path, master: str) -> None:
    """Run once with checkpoints (every rank, torch.distributed.checkpoint), then submit the
    same script again with more steps: it loads the last checkpoint and goes on from there."""
    url, written = make_dataset(tmp_path, SHARDS, PER_SHARD)
    steps = 3 * written.total() // (2 * 4)  # three epochs' worth over 2 ranks, batch 4
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()

    def script(total: int) -> Path:
        path = tmp_path / f"train_ddp_{total}.py"
        path.write_text(recipe("ddp", url, {
            "STEPS = 100_000": f"STEPS = {total}", "EVERY = 1_000": "EVERY = 20", '"/checkpoints/resnet50-ddp"': repr(str(ckpt)),
            "batch_size=256": "batch_size=4", "num_workers=4": "num_workers=2",
        }))
        return path

    with TorchRun(tmp_path / "first", [], nproc=2, master=master, job="resnet50-ddp", script=script(steps)) as run:
        rc = run.wait(90)
        report = run.report(rc, 90)
    assert rc == 0, report
    status = job_status(master, "resnet50-ddp")
    assert status is not None and status["totals"]["completed"] >= 2 * SHARDS, status  # crossed two epoch ends
    assert status["totals"]["failures"] == 0, status
    saved = (ckpt / "latest").read_text()
    assert saved.endswith(f"step-{steps // 20 * 20}"), saved
    with TorchRun(tmp_path / "second", [], nproc=2, master=master, job="resnet50-ddp", script=script(steps + 30)) as run:
        rc = run.wait(90)
        report = run.report(rc, 90)
    assert rc == 0, report
    status = job_status(master, "resnet50-ddp")
    assert status is not None and status["totals"]["rewinds"] >= 1, f"the second run resumed from the checkpoint: {status}"
    assert (ckpt / "latest").read_text().endswith(f"step-{(steps + 30) // 20 * 20}")


def test_the_elastic_recipe_survives_a_killed_rank(tmp_path: Path, master: str) -> None:
    """Killed after about one epoch of four, so more than a lease TTL of work is left: the
    restarted ranks are still iterating when the dead rank's leases expire, and take them over.
    (A rank that dies within the job's last TTL leaves its shards to the next run: README.)
    With DataLoader workers, as the recipe is written; a rank killed without workers is
    test_torchrun_elastic.py's ``[0]`` and test_torchrun_checkpoint.py's ``rank0-0``, sample by sample."""
    workers = 2
    url, _ = make_dataset(tmp_path, SHARDS, PER_SHARD * 2)
    epochs = 4
    script = tmp_path / "train_elastic.py"
    code = recipe("elastic", url, {
        "epochs=90": f"epochs={epochs}, lease_ttl_s={LEASE_TTL_S}", "batch_size=256": "batch_size=4",
        "num_workers=4": f"num_workers={workers}", "EVERY = 1_000": "EVERY = 10",
        '"/checkpoints/resnet50.pt"': repr(str(tmp_path / "resnet50.pt")),
        # persistent_workers needs workers
        "persistent_workers=True": f"persistent_workers={workers > 0}",
    })
    # Emulated compute, so that the run lasts long enough to kill a rank in the middle of it.
    script.write_text(code.replace("        opt.step()\n", "        opt.step()\n        __import__('time').sleep(0.05)\n"))
    with TorchRun(tmp_path, [], nproc=2, nnodes="1:2", max_restarts=1, master=master, job="resnet50", script=script) as run:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            status = job_status(master, "resnet50")
            if status is not None and status["totals"]["completed"] >= SHARDS:
                break
            time.sleep(0.2)
        pid = run.rank_pid(1)
        assert pid is not None, "rank 1 not found"
        os.kill(pid, signal.SIGKILL)  # a real fault: the rank dies with whatever its DataLoader held
        rc = run.wait(120)
        report = run.report(rc, 120)
    assert rc == 0, report
    status = job_status(master, "resnet50")
    assert status is not None and status["finished"], status
    assert status["totals"]["failures"] == 0, status
    # The restarted group loaded rank 0's checkpoint: the job went back to it (what the killed
    # attempt delivered after it was handed out again, so shards past it were completed again).
    assert (tmp_path / "resnet50.pt").exists() and status["totals"]["rewinds"] >= 1, status
    assert status["totals"]["completed"] >= SHARDS * epochs, status
