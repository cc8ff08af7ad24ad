"""Running ``tests/distributed/train.py`` under real torchrun, bounded in time, and reading what it did.

:class:`TorchRun` starts ``python -m torch.distributed.run`` (the module behind the ``torchrun``
command, run with this interpreter so its workers import this checkout) with c10d rendezvous on a
free loopback port and gloo on loopback. While it runs, the job's status on the master is sampled;
when no rank has logged a batch for a few seconds, the status and each rank's last step are kept
as a *stall*, so a deadlock's failure message says where every rank stopped and what the master
showed then. On a timeout (or when a test ends) every process the run started is killed by its id:
torchrun puts each rank in a session of its own, so its process group does not reach them, and
they are found by a token in their environment instead.
"""

from __future__ import annotations

import collections
import json
import os
import re
import signal
import subprocess
import time
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.support.processes import PYTHON, REPO, free_port, spawn
from tests.support.shards import Written, write_manifest, write_shards

__all__ = ["Ident", "Logs", "Stall", "TorchRun", "job_status", "lease_lines", "make_dataset", "sample_offsets"]

SCRIPT = REPO / "tests" / "distributed" / "train.py"  # what torchrun runs (collect_ignore there)
TOKEN_VAR = "DISTTEST_RUN_TOKEN"  # only read here, to find the run's processes

Ident = tuple[str, str]  # (shard key, sample key)


def make_dataset(tmp: Path, shards: int, per_shard: int) -> tuple[str, Written]:
    """A file:// dataset with a manifest (sample counts and hashes)."""
    written = write_shards(tmp / "root" / "bk" / "ds", shards=shards, per_shard=per_shard, sizes=(10, 800))
    write_manifest(written)
    return f"file://{tmp}/root/bk/ds/", written


def job_status(master: str, job: str) -> dict[str, Any] | None:
    try:
        with urllib.request.urlopen(f"{master}/v1/jobs/{job}", timeout=5) as resp:
            status: dict[str, Any] = json.load(resp)
            return status
    except Exception:
        return None


def _brief(status: dict[str, Any] | None) -> str:
    if status is None:
        return "no job status"
    trainers = status.get("trainers") or []
    holding = ", ".join(f"{t.get('trainer')}: {t.get('leases')}" for t in trainers if t.get("leases"))
    return (f"epoch {status.get('epoch')} finished={status.get('finished')} shards {status.get('shards')} "
            f"totals {status.get('totals')}; leases held by [{holding}] ({len(trainers)} trainers seen)")


_LEASED = re.compile(r"leased shard (\S+) epoch (\d+) offset (\d+)")
_COMPLETED = re.compile(r"completed shard (\S+) epoch (\d+)")


def lease_lines(log_dir: Path, attempt: int) -> tuple[dict[tuple[str, int], int], set[tuple[str, int]]]:
    """From the loader's DEBUG logs of one attempt's ranks: per (shard, epoch) the lowest offset
    it was leased at (its first grant in that attempt), and the (shard, epoch)s it completed."""
    leased: dict[tuple[str, int], int] = {}
    completed: set[tuple[str, int]] = set()
    for path in sorted(log_dir.glob(f"rank*-attempt{attempt}.log")):
        text = path.read_text(errors="replace")
        for m in _LEASED.finditer(text):
            ident = (m.group(1), int(m.group(2)))
            leased[ident] = min(leased.get(ident, int(m.group(3))), int(m.group(3)))
        completed.update((m.group(1), int(m.group(2))) for m in _COMPLETED.finditer(text))
    return leased, completed


def sample_offsets(written: Written, idents: list[Ident]) -> str:
    """``train-000003.tar offsets 24-31, 40`` for a list of samples: which ones, readably."""
    by_shard: dict[str, list[int]] = collections.defaultdict(list)
    for shard, key in idents:
        by_shard[shard].append(written.order[shard].index(key))
    parts = []
    for shard in sorted(by_shard):
        offsets = sorted(by_shard[shard])
        runs: list[str] = []
        start = prev = offsets[0]
        for o in [*offsets[1:], None]:
            if o is not None and o == prev + 1:
                prev = o
                continue
            runs.append(f"{start}-{prev}" if prev != start else str(start))
            if o is not None:
                start = prev = o
        parts.append(f"{shard} offsets {', '.join(runs)}")
    return "; ".join(parts)


@dataclass
class Logs:
    """The JSON-lines logs of every rank and attempt: ``batches[(rank, attempt)]`` in order."""

    batches: dict[tuple[int, int], list[dict[str, Any]]] = field(default_factory=dict)
    done: dict[tuple[int, int], dict[str, Any]] = field(default_factory=dict)
    start: dict[tuple[int, int], dict[str, Any]] = field(default_factory=dict)
    resumed: dict[tuple[int, int], int] = field(default_factory=dict)
    """(rank, attempt) -> the step its checkpoint resumed it at (0: none to resume from)."""
    ckpts: dict[tuple[int, int], list[int]] = field(default_factory=dict)
    """(rank, attempt) -> the steps it checkpointed after."""

    @classmethod
    def read(cls, directory: Path) -> Logs:
        logs = cls()
        for path in sorted(directory.glob("rank*-attempt*.jsonl")):
            for line in path.read_text().splitlines():
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue  # a line cut by a kill
                ident = (int(rec["rank"]), int(rec["attempt"]))
                if rec.get("done"):
                    logs.done[ident] = rec
                elif rec.get("start"):
                    logs.start[ident] = rec
                elif rec.get("resumed"):
                    logs.resumed[ident] = int(rec["step"])
                elif rec.get("ckpt"):
                    logs.ckpts.setdefault(ident, []).append(int(rec["step"]))
                else:
                    logs.batches.setdefault(ident, []).append(rec)
        return logs

    def received(self, attempt: int | None = None) -> list[tuple[float, int, Ident]]:
        """Every sample a training loop received: (time, rank, sample), optionally of one attempt."""
        out: list[tuple[float, int, Ident]] = []
        for (rank, att), recs in self.batches.items():
            if attempt is not None and att != attempt:
                continue
            for rec in recs:
                out.extend((float(rec["t"]), rank, (s[0], s[1])) for s in rec["samples"])
        return out

    def trained(self) -> list[tuple[int, int, Ident]]:
        """What the model trained on: every attempt's batches before the step the next attempt
        resumed at (the checkpoint it loaded), and everything the last attempt received, as
        (attempt, rank, sample)."""
        attempts = sorted({a for _, a in self.batches} | {a for _, a in self.resumed})
        out: list[tuple[int, int, Ident]] = []
        for i, att in enumerate(attempts):
            later = [step for (_, a), step in self.resumed.items() if a == attempts[i + 1]] if i + 1 < len(attempts) else []
            upto = min(later) if later else None
            for (rank, a), recs in self.batches.items():
                if a != att:
                    continue
                for rec in recs:
                    if upto is None or int(rec["step"]) < upto:
                        out.extend((a, rank, (s[0], s[1])) for s in rec["samples"])
        return out

    def summary(self) -> str:
        lines = []
        for ident in sorted(set(self.batches) | set(self.start) | set(self.done)):
            recs = self.batches.get(ident, [])
            last = recs[-1]["step"] if recs else None
            done = self.done.get(ident)
            lines.append(f"rank {ident[0]} attempt {ident[1]}: {len(recs)} batches, last step {last}, "
                         f"{'done, steps ' + str(done['steps']) if done else 'no done line'}")
        return "\n".join(lines) or "no rank logged anything"


@dataclass
class Stall:
    """No batch logged for ``quiet_s``: where each rank was, and what the master showed."""

    at_s: float  # since the run started
    steps: dict[str, Any]
    status: dict[str, Any] | None

    def __str__(self) -> str:
        return f"at +{self.at_s:.1f}s nothing logged for a while; last steps {self.steps}; master: {_brief(self.status)}"


class TorchRun:
    """One torchrun invocation of ``train.py``; use as a context manager (kills what is left)."""

    def __init__(
        self, tmp: Path, script_args: list[str], *, nproc: int, nnodes: str = "1", max_restarts: int = 0,
        master: str, job: str, script: Path | None = None,
    ) -> None:
        """``script``: another training script than train.py (a README recipe), run with
        ``script_args`` only and the master in ``SHARDCACHE_MASTER``."""
        self.tmp, self.master, self.job = tmp, master, job
        self.log_dir = tmp / "ranks"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.output = tmp / "torchrun.log"
        self.token = uuid.uuid4().hex
        port = free_port()
        args = [
            PYTHON, "-m", "torch.distributed.run", f"--nnodes={nnodes}", f"--nproc-per-node={nproc}",
            f"--max-restarts={max_restarts}", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
            # No waiting for a second node that never comes (--nnodes=1:2): the default last call is 30 s.
            "--rdzv-conf=last_call_timeout=1,join_timeout=60", "--local-addr=127.0.0.1", "--monitor-interval=0.1",
            *(
                [str(SCRIPT), "--out-dir", str(self.log_dir), "--master-url", master, "--job", job, *script_args]
                if script is None else [str(script), *script_args]
            ),
        ]
        env = {
            TOKEN_VAR: self.token,
            "GLOO_SOCKET_IFNAME": "lo",
            # Reported with torch 2.13: a restarted worker group's gloo connectFullMesh refused
            # ("Connection refused") on the TCPStore shared with the rendezvous. Not seen here
            # (with or without --local-addr), kept: the agent's own store serves every attempt.
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
            "OMP_NUM_THREADS": "1",  # 2 cores shared by every rank and worker
            "PYTHONUNBUFFERED": "1",
            "SHARDCACHE_MASTER": master,
        }
        self.started = time.monotonic()
        self.proc: subprocess.Popen[bytes] = spawn(args, self.output, env=env)
        self.stalls: list[Stall] = []
        self.last_status: dict[str, Any] | None = None
        self.timed_out = False
        self.elapsed_s = 0.0  # from the start to torchrun's exit (or its kill)

    def __enter__(self) -> TorchRun:
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill()

    def _progress(self) -> int:
        return sum(p.stat().st_size for p in self.log_dir.glob("*.jsonl"))

    def _last_steps(self) -> dict[str, Any]:
        logs = Logs.read(self.log_dir)
        return {f"r{r}a{a}": (recs[-1]["step"] if recs else None) for (r, a), recs in sorted(logs.batches.items())}

    def wait(self, timeout: float, quiet_s: float = 5.0) -> int | None:
        """Wait for torchrun to exit (its status), or kill the run after ``timeout`` (None)."""
        deadline = self.started + timeout
        seen, changed = -1, time.monotonic()
        in_stall = False
        while self.proc.poll() is None:
            now = time.monotonic()
            if now > deadline:
                self.timed_out = True
                self.kill()
                self.elapsed_s = time.monotonic() - self.started
                return None
            status = job_status(self.master, self.job)
            if status is not None:
                self.last_status = status
            progress = self._progress()
            if progress != seen:
                seen, changed, in_stall = progress, now, False
            elif progress and not in_stall and now - changed > quiet_s:
                in_stall = True
                self.stalls.append(Stall(now - self.started, self._last_steps(), status))
            time.sleep(0.5)
        self.elapsed_s = time.monotonic() - self.started
        return self.proc.returncode

    def _ours(self) -> list[int]:
        """Processes carrying this run's token: torchrun, its ranks and their DataLoader workers."""
        marker = f"{TOKEN_VAR}={self.token}".encode()
        pids = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) == os.getpid():
                continue
            try:
                environ = Path(f"/proc/{entry}/environ").read_bytes()
            except OSError:
                continue
            if marker in environ.split(b"\0"):
                pids.append(int(entry))
        return pids

    def rank_pid(self, rank: int) -> int | None:
        """The process of local rank ``rank`` (not one of its DataLoader workers, which inherit its
        environment): the one whose parent is not itself that rank."""
        def local_rank(pid: int) -> str | None:
            try:
                for item in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                    if item.startswith(b"LOCAL_RANK="):
                        return item.split(b"=", 1)[1].decode()
            except OSError:
                return None
            return None

        for pid in self._ours():
            if local_rank(pid) != str(rank):
                continue
            try:
                ppid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            if local_rank(ppid) != str(rank):
                return pid
        return None

    def kill(self) -> None:
        """SIGKILL torchrun (first: it would restart its workers) and every process of the run."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)
        deadline = time.monotonic() + 10
        while (pids := self._ours()) and time.monotonic() < deadline:
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.1)

    def logs(self) -> Logs:
        return Logs.read(self.log_dir)

    def report(self, rc: int | None, timeout: float) -> str:
        """Everything needed to tell a deadlock from a crash, for a failure message."""
        logs = self.logs()
        outcome = f"timed out after {timeout:.0f}s and was killed" if rc is None else f"exited with {rc}"
        parts = [
            f"torchrun {outcome} after {self.elapsed_s:.1f}s",
            "ranks:\n" + logs.summary(),
            "stalls:\n" + ("\n".join(str(s) for s in self.stalls) or "none"),
            "master's job status (last seen while running): " + _brief(self.last_status),
            "master's job status now: " + _brief(job_status(self.master, self.job)),
            "torchrun output (tail):\n" + _tail(self.output, 4000),
        ]
        for path in sorted(self.log_dir.glob("*.log")):
            parts.append(f"{path.name} (tail):\n" + _tail(path, 1500))
        return "\n\n".join(parts)


def _tail(path: Path, chars: int) -> str:
    if not path.exists():
        return "(missing)"
    text = path.read_text(errors="replace")
    return text[-chars:]
