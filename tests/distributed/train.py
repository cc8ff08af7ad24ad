"""A training script for the torchrun tests (run by torchrun, not collected by pytest): a gloo
process group on loopback, a dynamic ``loader.torch.ShardDataset`` leased from a master, a
DataLoader, and an ``all_reduce`` every step, as synchronous data-parallel training does.

    torchrun --nproc-per-node=2 tests/distributed/train.py --url file:///... --master-url http://... \
        --job j --out-dir DIR --steps 40 --batch-size 4 --num-workers 2

Three loops:

- ``--steps N`` (continuous mode): exactly N steps on every rank, across epoch boundaries, an
  ``all_reduce`` each step (the README's DDP recipe);
- ``--epochs N --continuous``: one pass over a continuous job of N epochs. Ranks end with uneven
  batch counts, so every step all-reduces a "have a batch" flag with the data and a rank that ran
  out keeps joining the collective until every rank has (what DDP's ``Join`` does in the README's
  elastic recipe);
- ``--epochs N`` (non-continuous mode): ``for batch in dl`` once per epoch, a ``barrier`` after
  each. No collective per step: a trainer's epoch ends only when every shard of it is done, so a
  rank that ran out waits for the last shards of its peers, which a peer blocked in a per-step
  collective would never finish (the README says to use continuous mode for that).

Each rank and attempt (``TORCHELASTIC_RESTART_COUNT``) appends JSON lines to
``<out-dir>/rank<r>-attempt<a>.jsonl``: a ``start`` line, one line per batch the training loop
received (``{"t", "rank", "attempt", "step", "worker", "samples": [[shard key, sample key], ...]}``) and a
``done`` line with the step count. Writes are unbuffered appends, so a rank killed mid-run keeps
every line it wrote. The loader's own log (DEBUG: leases, renewals, completions) goes to
``<out-dir>/rank<r>-attempt<a>.log``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

__all__ = ["collate_keys", "main"]


def collate_keys(batch: list[dict[str, Any]]) -> dict[str, Any]:
    """Keep only which sample each item is (shard key from ``__url__``, ``__key__``) and which
    DataLoader worker made the batch (None: the main process)."""
    import torch.utils.data

    info = torch.utils.data.get_worker_info()
    return {
        "worker": None if info is None else info.id,
        "samples": [[str(s["__url__"]).rsplit("/", 1)[-1], str(s["__key__"])] for s in batch],
    }


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--url", required=True, help="dataset prefix (file:// in the tests)")
    p.add_argument("--master-url", required=True, help="lease master URL (not --master: torchrun would take it for its own --master-addr)")
    p.add_argument("--job", required=True)
    p.add_argument("--out-dir", required=True, type=Path, help="where the JSON-lines logs go")
    loop = p.add_mutually_exclusive_group(required=True)
    loop.add_argument("--steps", type=int, help="continuous mode: this many steps on every rank")
    loop.add_argument("--epochs", type=int, help="non-continuous mode: this many epoch loops (and the job's epochs)")
    p.add_argument("--job-epochs", type=int, default=None, help="continuous mode: the job's epochs (default unbounded)")
    p.add_argument("--continuous", action="store_true", help="with --epochs: one pass over a continuous job of that many epochs")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--num-workers", type=int, default=0)
    p.add_argument("--lease-ttl-s", type=float, default=10.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sleep", type=float, default=0.0, help="seconds of emulated compute per step")
    p.add_argument("--fail-at-step", type=int, default=None, help="raise at this step, on the first attempt only")
    p.add_argument("--fail-rank", type=int, default=1, help="the rank that raises with --fail-at-step")
    p.add_argument("--gloo-timeout-s", type=float, default=40.0,
                   help="collective timeout: a deadlocked step fails after this instead of hanging")
    p.add_argument("--dataloader", choices=("plain", "shardcache"), default="shardcache",
                   help="torch.utils.data.DataLoader, or loader.torch.DataLoader (plain while it does not exist)")
    p.add_argument("--ckpt-dir", type=Path, default=None,
                   help="checkpoint the DataLoader (with the step) here, and resume from the latest one at start")
    p.add_argument("--ckpt-every", type=int, default=0, help="checkpoint after every this many steps")
    p.add_argument("--ckpt-way", choices=("dcp", "rank0"), default="dcp",
                   help="dcp: every rank saves its own state with torch.distributed.checkpoint; rank0: rank 0 "
                   "alone torch.save()s its state (the way most scripts do), every rank loads it")
    p.add_argument("--kill-after-ckpt", type=int, default=None,
                   help="on attempt 0, SIGKILL this rank a few steps after the first checkpoint (a whole-job kill "
                   "when the test then kills the rest)")
    return p.parse_args(argv)


class _Checkpoints:
    """The DataLoader's state (and the step) saved and loaded the two ways scripts do it.

    ``dcp``: ``torch.distributed.checkpoint`` on every rank (the DataLoader is a ``Stateful``),
    into ``step-N/``, then rank 0 points ``latest`` at it. ``rank0``: rank 0 ``torch.save``s its
    state to ``step-N.pt`` and points ``latest`` at it; every rank loads that file."""

    def __init__(self, directory: Path, way: str, rank: int) -> None:
        self.dir, self.way, self.rank = directory, way, rank
        directory.mkdir(parents=True, exist_ok=True)

    def _point(self, name: str) -> None:
        tmp = self.dir / f"latest.{os.getpid()}"
        tmp.write_text(name)
        os.replace(tmp, self.dir / "latest")

    def save(self, step: int, dl: Any) -> None:
        import torch
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp

        if self.way == "dcp":
            dcp.save({"dl": dl, "meta": {"step": step}}, checkpoint_id=str(self.dir / f"step-{step}"))
            dist.barrier()
            if self.rank == 0:
                self._point(f"step-{step}")
        elif self.rank == 0:
            path = self.dir / f"step-{step}.pt"
            torch.save({"step": step, "dl": dl.state_dict()}, path)
            self._point(path.name)
        dist.barrier()

    def load(self, dl: Any) -> int:
        """The step resumed at (0: no checkpoint yet)."""
        import torch
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp

        latest = self.dir / "latest"
        step = 0
        if latest.exists():
            name = latest.read_text().strip()
            if self.way == "dcp":
                state: dict[str, Any] = {"dl": dl, "meta": {"step": 0}}
                dcp.load(state, checkpoint_id=str(self.dir / name))
                step = int(state["meta"]["step"])
            else:
                saved = torch.load(self.dir / name, weights_only=False)
                dl.load_state_dict(saved["dl"])
                step = int(saved["step"])
        # Every rank rewound before any iterates: a rank's rewind would otherwise revoke the
        # leases a faster peer already read from (those samples would be trained twice).
        dist.barrier()
        return step


class _Log:
    """One rank's JSON-lines log: unbuffered appends, each line whole."""

    def __init__(self, path: Path) -> None:
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def write(self, record: dict[str, Any]) -> None:
        os.write(self._fd, (json.dumps(record) + "\n").encode())

    def close(self) -> None:
        os.close(self._fd)


def _dataloader_class(choice: str) -> tuple[type, str]:
    import torch.utils.data

    import loader.torch

    if choice == "shardcache":
        cls = getattr(loader.torch, "DataLoader", None)
        if cls is not None:
            return cls, "shardcache"
        return torch.utils.data.DataLoader, "plain (loader.torch.DataLoader does not exist yet)"
    return torch.utils.data.DataLoader, "plain"


def main(argv: list[str]) -> int:
    args = _parse(argv)
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    args.out_dir.mkdir(parents=True, exist_ok=True)
    name = f"rank{rank}-attempt{attempt}"

    handler = logging.FileHandler(args.out_dir / f"{name}.log")
    handler.setFormatter(logging.Formatter("%(asctime)s %(process)d %(levelname)s %(name)s: %(message)s"))
    logging.getLogger().addHandler(handler)
    logging.getLogger().setLevel(logging.INFO)
    logging.getLogger("loader").setLevel(logging.DEBUG)

    import torch
    import torch.distributed as dist

    from loader.torch import ShardDataset

    log = _Log(args.out_dir / f"{name}.jsonl")
    dist.init_process_group("gloo", timeout=timedelta(seconds=args.gloo_timeout_s))
    continuous = args.steps is not None or args.continuous
    cls, which = _dataloader_class(args.dataloader)
    log.write({"start": True, "t": time.time(), "rank": rank, "world": world, "attempt": attempt,
               "pid": os.getpid(), "dataloader": which, "continuous": continuous})
    ds = ShardDataset(
        args.url, job=args.job, master=args.master_url, continuous=continuous,
        epochs=args.job_epochs if args.steps is not None else args.epochs, lease_ttl_s=args.lease_ttl_s, seed=args.seed,
    )
    dl = cls(ds, batch_size=args.batch_size, num_workers=args.num_workers, collate_fn=collate_keys)

    step = 0
    ckpt = _Checkpoints(args.ckpt_dir, args.ckpt_way, rank) if args.ckpt_dir is not None else None
    if ckpt is not None:
        step = ckpt.load(dl)
        log.write({"resumed": True, "t": time.time(), "rank": rank, "attempt": attempt, "step": step})
    first_ckpt: int | None = None

    def after_step() -> None:
        """Checkpoint every --ckpt-every steps (``step`` steps are done); die if asked."""
        nonlocal first_ckpt
        if ckpt is not None and args.ckpt_every and step % args.ckpt_every == 0:
            ckpt.save(step, dl)
            log.write({"ckpt": True, "t": time.time(), "rank": rank, "attempt": attempt, "step": step})
            if first_ckpt is None:
                first_ckpt = step
        if (args.kill_after_ckpt is not None and attempt == 0 and rank == args.kill_after_ckpt
                and first_ckpt is not None and step >= first_ckpt + 3):
            os.kill(os.getpid(), signal.SIGKILL)

    def train_step(batch: dict[str, Any] | None) -> None:
        """Log the batch as received, fail if asked, emulate compute."""
        if batch is not None:
            log.write({"t": time.time(), "rank": rank, "attempt": attempt, "step": step, **batch})
        if args.fail_at_step is not None and step == args.fail_at_step and rank == args.fail_rank and attempt == 0:
            raise RuntimeError(f"rank {rank} fails at step {step} on attempt 0 (--fail-at-step)")
        if args.sleep:
            time.sleep(args.sleep)

    if args.steps is not None:
        batches = iter(dl)
        while step < args.steps:
            batch = next(batches, None)
            if batch is None:
                raise RuntimeError(f"rank {rank}: the loader ended at step {step} of {args.steps} (job finished?)")
            train_step(batch)
            dist.all_reduce(torch.tensor([float(len(batch["samples"]))]))
            step += 1
            after_step()
    elif args.continuous:
        batches = iter(dl)
        while True:
            batch = next(batches, None)
            train_step(batch)
            have = torch.tensor([0.0 if batch is None else 1.0, float(len(batch["samples"]) if batch else 0)])
            dist.all_reduce(have)
            if have[0].item() == 0:  # every rank ran out: the job ended everywhere
                break
            step += 1
            after_step()
    else:
        # Non-continuous: ``step`` counts epochs here (ranks take different numbers of batches in
        # an epoch), a checkpoint goes after each epoch's barrier, --fail-at-step counts batches.
        epoch_step, batches_seen = step, 0
        fail_at, args.fail_at_step = args.fail_at_step, None
        for step in range(epoch_step, args.epochs):
            for batch in dl:
                train_step(batch)
                batches_seen += 1
                if fail_at is not None and batches_seen == fail_at and rank == args.fail_rank and attempt == 0:
                    raise RuntimeError(f"rank {rank} fails at its batch {batches_seen} on attempt 0 (--fail-at-step)")
            dist.barrier()
            step += 1
            after_step()
    log.write({"done": True, "t": time.time(), "rank": rank, "attempt": attempt, "steps": args.steps if continuous else step})
    log.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main(sys.argv[1:])
    # Past this point nothing is left to do but the interpreter's teardown, where gloo's C++
    # threads now and then abort the process ("terminate called without an active exception",
    # SIGABRT) after every record was written and the process group destroyed: torchrun then
    # reports a finished job as failed (seen once in CI, rank 1 of the elastic checkpoint test;
    # pytorch/pytorch#179291 describes the same teardown race). Exit without that teardown.
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)
