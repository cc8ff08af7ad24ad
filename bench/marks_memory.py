"""Checkpoint marks' memory: what a day of checkpoints costs the lease master for a 1,000,000-shard job.

The lease state machine (``loader.master.server.state.MasterState``) is driven in this process,
with simulated time (nothing sleeps), the same day twice:

- ``clocks``: every renew, completion and release carries the trainer's clock, and every
  ``--checkpoint-s`` (60 s) every trainer reports its positions at the checkpoint's clock (a
  ``Mark``, the ``torch.distributed.checkpoint`` way: every rank; ``--rank0-marks``: rank 0 only):
  the master keeps the marks (at most ``MAX_MARKS``), the history of changes a rewind to one of
  them undoes (``loader/master/server/marks.py``) and the closed epochs a rewind may reopen;
- ``plain``: the same leases, renews and completions without clocks and without marks (what a
  client that keeps no clock costs).

Assumptions (the defaults; each is an option): the job of ``bench.master_memory.make_spec``
(1,000,000 shards of 900..1100 samples, keys like ``imagenet/train/shard-000123.tar``); 64
lock-step trainers, each holding 4 leases that its loop reads round robin (a DataLoader with 4
workers); 5,000 samples/s job-wide, so each held lease is read at 5000 / 64 / 4 = 19.5 samples/s
and a trainer completes a shard about every 13 s (5 completions/s job-wide, 432,000 a day: less than
half an epoch, so no epoch closes in the day); the clock counts the samples a trainer's loop
received (78 a second, the same on every rank); every held lease renewed every 10 s with the
position reached and the clock (the renewer's period for a 30 s TTL), a completion when a shard's
last sample is received, then a new lease. Coarsened: time moves in steps of the renew period
(10 s): the renews, completions and leases of a step are applied at the step's end, the
completions stamped with the clock at which their last sample was received.

Measured with ``tracemalloc`` (live Python bytes, the allocator's slack not counted): the state's
bytes at the day's end (and each hour) in both runs, their difference (the marks' cost), the
marks' own object graph walked directly (marks, history, kept closed epochs) and per change kept;
the snapshot text's size in both runs. Then, without tracemalloc: how long the master takes to
trim the history once (what each new mark does), to write the snapshot, and to rewind to the
last mark and to the oldest kept one.

Run: ``python -m bench.marks_memory`` (about 2 minutes on 2 cores) or ``--quick`` (100,000 shards,
2 simulated hours). Prints a table and writes ``bench/results/marks_memory.json``
(``marks_memory-quick.json`` for ``--quick``). Not part of ``python -m bench``.
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import tempfile
import time
import tracemalloc
import types
from pathlib import Path
from typing import Any

from bench.common import REPO, RESULTS_DIR, machine_facts, write_results
from bench.master_memory import make_spec
from loader.master.server.events import Complete, CreateJob, Lease, Mark, Renew, Rewind
from loader.master.server.marks import MAX_HISTORY, MAX_MARKS, RETAIN_S, JobMarks
from loader.master.server.spec import JobSpec
from loader.master.server.state import EpochState, MasterState

__all__ = ["main"]

_T0 = 1_000_000.0
_MB = 1e6


class _Slot:
    """One lease a trainer holds and reads (one DataLoader worker's)."""

    __slots__ = ("lease", "samples", "offset")

    def __init__(self, lease: str, samples: int, offset: float) -> None:
        self.lease, self.samples, self.offset = lease, samples, offset


def deep_size(root: Any) -> int:
    """Bytes of the objects reachable from ``root`` (each counted once; classes, modules and
    functions not counted)."""
    return deep_size_without(root)


def deep_size_without(root: Any, *skip: Any) -> int:
    """:func:`deep_size` of ``root``, not walking into ``skip`` (the spec: the same in both runs)."""
    seen = {id(obj) for obj in skip}
    stack = [root]
    total = 0
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, (type, types.ModuleType, types.FunctionType)):
            continue
        seen.add(id(obj))
        total += sys.getsizeof(obj)
        stack.extend(gc.get_referents(obj))
    return total


def marks_bytes(marks: JobMarks) -> dict[str, int]:
    """The marks' own objects, walked: the history (list and changes), the marks, the closed epochs."""
    return {
        "history_bytes": deep_size(marks.history),
        "marks_bytes": deep_size(marks.marks),
        "closed_epochs_bytes": deep_size(marks.closed),
    }


class Day:
    """The simulated day of one run."""

    def __init__(self, spec: JobSpec, args: argparse.Namespace, clocks: bool) -> None:
        self.spec, self.args, self.clocks = spec, args, clocks
        self.name = spec.name
        self.state = MasterState()
        self.ids = 0
        self.loop_rate = args.samples_per_s / args.trainers  # samples a trainer's loop receives a second
        self.read_rate = self.loop_rate / args.leases  # each held lease, read round robin
        self.trainers = [f"rank{i:03d}" for i in range(args.trainers)]
        self.slots: list[list[_Slot]] = []
        self.counts = {"lease": 0, "renew": 0, "complete": 0, "mark": 0}
        self.hourly: list[dict[str, Any]] = []

    def clock_at(self, t: float) -> int | None:
        return int((t - _T0) * self.loop_rate) if self.clocks else None

    def new_ids(self, count: int) -> tuple[str, ...]:
        start = self.ids
        self.ids += count
        return tuple(f"L{i:012d}" for i in range(start, start + count))

    def lease(self, trainer: str, count: int, now: float) -> list[_Slot]:
        answer = self.state.apply(Lease(self.name, trainer, "node", count, None, self.new_ids(count)), now).answer
        self.counts["lease"] += 1
        if answer["status"] != "ok" or len(answer["leases"]) != count:
            raise RuntimeError(f"lease refused: {answer}")
        return [_Slot(g["lease"], g["samples"], float(g["offset"])) for g in answer["leases"]]

    def run(self, trace: bool) -> dict[str, Any]:
        args, apply, name = self.args, self.state.apply, self.name
        step = args.renew_s
        steps = int(args.hours * 3600 / step)
        mark_every = max(1, round(args.checkpoint_s / step))
        started = time.perf_counter()
        if trace:
            gc.collect()
            tracemalloc.start()
        base = tracemalloc.get_traced_memory()[0] if trace else 0
        apply(CreateJob(self.spec), _T0)
        created = tracemalloc.get_traced_memory()[0] - base if trace else 0
        self.slots = [self.lease(t, args.leases, _T0) for t in self.trainers]
        for k in range(1, steps + 1):
            now = _T0 + k * step
            clock = self.clock_at(now)
            for trainer, slots in zip(self.trainers, self.slots, strict=True):
                for i, slot in enumerate(slots):
                    offset = slot.offset + self.read_rate * step
                    while offset >= slot.samples:  # its last sample received within the step
                        over = offset - slot.samples
                        apply(Complete(name, slot.lease, trainer, self.clock_at(now - over / self.read_rate)), now)
                        self.counts["complete"] += 1
                        slot = slots[i] = self.lease(trainer, 1, now)[0]
                        offset = slot.offset + over
                    slot.offset = offset
                    apply(Renew(name, slot.lease, trainer, int(offset), clock), now)
                    self.counts["renew"] += 1
            if self.clocks and k % mark_every == 0:
                assert clock is not None
                reporters = self.trainers[:1] if args.rank0_marks else self.trainers
                for trainer, slots in zip(reporters, self.slots, strict=False):
                    answer = apply(Mark(name, trainer, clock, tuple((s.lease, int(s.offset)) for s in slots)), now).answer
                    self.counts["mark"] += 1
                    if answer["lost"]:
                        raise RuntimeError(f"a mark lost leases: {answer}")
            if k % int(3600 / step) == 0 or k == steps:
                sampling = time.perf_counter()
                self.hourly.append(self.sample(now, base, trace))
                started += time.perf_counter() - sampling  # the walk is ours, not the master's
        result = {
            "steps": steps,
            "events": dict(self.counts),
            "run_s": round(time.perf_counter() - started, 1),
            "state_bytes_after_create": created,
            "end": self.hourly[-1],
            "hourly": self.hourly,
        }
        if trace:
            result["peak_bytes"] = tracemalloc.get_traced_memory()[1] - base
            tracemalloc.stop()
        return result

    def sample(self, now: float, base: int, trace: bool) -> dict[str, Any]:
        job = self.state.jobs[self.name]
        marks = job.marks
        return {
            "hour": round((now - _T0) / 3600, 2),
            "state_bytes": tracemalloc.get_traced_memory()[0] - base if trace else None,
            "history": len(marks.history),
            "marks": len(marks.marks),
            "closed_epochs_kept": len(marks.closed),
            "epoch": job.epoch,
            "completed": job.totals["completed"],
            "marks_graph_bytes": None if trace else sum(marks_bytes(marks).values()),
        }


def timings(day: Day) -> dict[str, Any]:
    """Without tracemalloc: a history trim, a snapshot, a rewind to the last mark and to the oldest."""
    job = day.state.jobs[day.name]
    marks = job.marks
    now = day.state.last_now
    out: dict[str, Any] = {}
    started = time.perf_counter()
    marks.trim(now)
    out["trim_s"] = round(time.perf_counter() - started, 4)
    started = time.perf_counter()
    text = day.state.snapshot_text()
    out["snapshot_s"] = round(time.perf_counter() - started, 3)
    started = time.perf_counter()
    restored = MasterState.from_text(text)
    out["snapshot_load_s"] = round(time.perf_counter() - started, 3)
    del restored, text
    if marks.marks:
        ids = list(marks.marks)
        for which, mid in (("last", ids[-1]), ("oldest", ids[0])):
            clock = marks.marks[mid].clock
            started = time.perf_counter()
            answer = day.state.apply(Rewind(day.name, "resumed", mid, clock, job.created_at), now + 1).answer
            out[f"rewind_{which}_s"] = round(time.perf_counter() - started, 3)
            out[f"rewind_{which}"] = answer
    return out


def _proc_status_kib() -> dict[str, int]:
    out: dict[str, int] = {}
    try:
        with open("/proc/self/status", encoding="ascii", errors="replace") as handle:
            for line in handle:
                name, _, rest = line.partition(":")
                if name in ("VmRSS", "VmHWM"):
                    out[name] = int(rest.split()[0])
    except OSError:
        pass
    return out


def build_spec(args: argparse.Namespace) -> JobSpec:
    raw = make_spec("marks-memory", args.shards)
    raw["epochs"] = None  # a day is less than an epoch anyway: never finished
    spec = JobSpec.from_json(raw, max_shards=max(args.shards, 1))
    del raw
    gc.collect()
    return spec


def worker(args: argparse.Namespace) -> dict[str, Any]:
    """One run (``--worker plain`` or ``clocks``) in its own process: the day untraced (RSS at its
    end, the job's objects walked), then ``--traced-hours`` again from the start under tracemalloc."""
    clocks = args.worker == "clocks"
    spec = build_spec(args)
    day = Day(spec, args, clocks)
    run = day.run(trace=False)
    job = day.state.jobs[day.name]
    status = _proc_status_kib()
    end = {
        "rss_kib": status.get("VmRSS"),
        "hwm_kib": status.get("VmHWM"),
        "job_bytes": deep_size_without(job, job.spec),
        "marks_graph": marks_bytes(job.marks),
        "snapshot_chars": len(day.state.snapshot_text()),
    }
    out: dict[str, Any] = {"label": args.worker, "run": run, "end": end}
    if clocks:
        out["timings"] = timings(day)
        # No epoch of this job closes in a day; what one kept closed epoch would cost (its done bits):
        closed = EpochState(0, len(spec.shards), spec.seed, spec.shuffle)
        for shard in range(len(spec.shards)):
            closed.mark_done(shard)
        end["closed_epoch_bytes_each"] = deep_size(closed)
    del day, job
    gc.collect()
    traced_args = argparse.Namespace(**{**vars(args), "hours": args.traced_hours})
    traced = Day(spec, traced_args, clocks)
    out["traced"] = traced.run(trace=True)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.marks_memory", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shards", type=int, default=1_000_000, help="shards in the job")
    parser.add_argument("--hours", type=float, default=24.0, help="simulated hours")
    parser.add_argument("--traced-hours", type=float, default=1.0,
                        help="simulated hours of the run again under tracemalloc (the marks' history is at its "
                        "steady size once the oldest kept mark is MAX_MARKS checkpoints old: ~33 minutes)")
    parser.add_argument("--trainers", type=int, default=64, help="lock-step trainers (ranks)")
    parser.add_argument("--leases", type=int, default=4, help="leases each trainer holds and reads round robin")
    parser.add_argument("--samples-per-s", type=float, default=5000.0, help="samples the job's loops receive a second")
    parser.add_argument("--renew-s", type=float, default=10.0, help="renew period (and the simulation's step)")
    parser.add_argument("--checkpoint-s", type=float, default=60.0, help="seconds between checkpoints")
    parser.add_argument("--rank0-marks", action="store_true", help="only rank 0 reports at a checkpoint")
    parser.add_argument("--quick", action="store_true", help="100,000 shards, 2 simulated hours, 0.75 traced")
    parser.add_argument("--out", type=Path, default=None, help="default bench/results/marks_memory[-quick].json")
    parser.add_argument("--worker", choices=("plain", "clocks"), default=None, help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.shards, args.hours, args.traced_hours = 100_000, 2.0, 0.75
    if args.worker:
        result = worker(args)
        assert args.worker_out is not None
        args.worker_out.write_text(json.dumps(result))
        return 0
    out = args.out or RESULTS_DIR / ("marks_memory-quick.json" if args.quick else "marks_memory.json")
    print(f"marks memory: {args.shards:,} shards, {args.hours:g} h simulated ({args.traced_hours:g} h again under "
          f"tracemalloc), {args.trainers} trainers x {args.leases} leases, {args.samples_per_s:g} samples/s, renew every "
          f"{args.renew_s:g} s, checkpoint every {args.checkpoint_s:g} s ({'rank 0' if args.rank0_marks else 'every rank'} "
          "reports); the run with clocks and the plain one in two processes at once", flush=True)
    started = time.perf_counter()
    forwarded = [a for a in (argv if argv is not None else sys.argv[1:]) if a != "--quick"]
    fixed = ["--shards", str(args.shards), "--hours", str(args.hours), "--traced-hours", str(args.traced_hours)]
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="marks-memory-") as tmp:
        procs = {}
        for label in ("plain", "clocks"):
            path = Path(tmp) / f"{label}.json"
            cmd = [sys.executable, "-m", "bench.marks_memory", *forwarded, *fixed, "--worker", label, "--worker-out", str(path)]
            procs[label] = (subprocess.Popen(cmd, cwd=REPO), path)
        for label, (proc, path) in procs.items():
            if proc.wait() != 0:
                raise SystemExit(f"the {label} run failed ({proc.returncode})")
            results[label] = json.loads(path.read_text())
    plain, clocked = results["plain"], results["clocks"]
    pe, ce = plain["end"], clocked["end"]
    graph = ce["marks_graph"]
    history = clocked["run"]["end"]["history"]
    graph_total = sum(graph.values())
    cost = {
        "job_bytes_plain": pe["job_bytes"],
        "job_bytes_clocks": ce["job_bytes"],
        "job_extra_bytes": ce["job_bytes"] - pe["job_bytes"],
        "marks_graph": graph,
        "marks_graph_bytes": graph_total,
        "closed_epoch_bytes_each": ce.get("closed_epoch_bytes_each"),
        "history_changes": history,
        "history_bytes_per_change": round(graph["history_bytes"] / history, 1) if history else None,
        "max_history_bytes_estimate": round(graph["history_bytes"] / history * MAX_HISTORY) if history else None,
        "rss_extra_kib": (ce["rss_kib"] or 0) - (pe["rss_kib"] or 0),
        "hwm_extra_kib": (ce["hwm_kib"] or 0) - (pe["hwm_kib"] or 0),
        "traced_state_bytes_plain": plain["traced"]["end"]["state_bytes"],
        "traced_state_bytes_clocks": clocked["traced"]["end"]["state_bytes"],
        "traced_extra_bytes": clocked["traced"]["end"]["state_bytes"] - plain["traced"]["end"]["state_bytes"],
        "traced_peak_extra_bytes": clocked["traced"]["peak_bytes"] - plain["traced"]["peak_bytes"],
        "snapshot_chars_plain": pe["snapshot_chars"],
        "snapshot_chars_clocks": ce["snapshot_chars"],
        "snapshot_extra_chars": ce["snapshot_chars"] - pe["snapshot_chars"],
        "snapshot_extra_chars_per_change": round((ce["snapshot_chars"] - pe["snapshot_chars"]) / history, 1) if history else None,
    }
    th = args.traced_hours
    rows = [
        (f"the job's objects at {args.hours:g} h (walked)", pe["job_bytes"], ce["job_bytes"]),
        ("  marks + history + closed epochs (walked)", 0, graph_total),
        ("    history", 0, graph["history_bytes"]),
        ("    marks", 0, graph["marks_bytes"]),
        ("    closed epochs kept", 0, graph["closed_epochs_bytes"]),
        (f"live state at {th:g} h (tracemalloc)", cost["traced_state_bytes_plain"], cost["traced_state_bytes_clocks"]),
        (f"peak at {th:g} h (tracemalloc)", plain["traced"]["peak_bytes"], clocked["traced"]["peak_bytes"]),
        (f"process RSS at {args.hours:g} h", (pe["rss_kib"] or 0) * 1024, (ce["rss_kib"] or 0) * 1024),
        ("snapshot text", pe["snapshot_chars"], ce["snapshot_chars"]),
    ]
    print()
    print(f"{'':46s} {'plain':>10s} {'clocks':>10s} {'difference':>11s}")
    for what, a, b in rows:
        print(f"{what:46s} {a / _MB:8.1f}MB {b / _MB:8.1f}MB {(b - a) / _MB:+9.1f}MB")
    end = clocked["run"]["end"]
    print(f"{'changes kept / marks kept / closed epochs kept':46s} {history:>10,} {end['marks']:>10} {end['closed_epochs_kept']:>11}")
    print(f"{'bytes a change kept (history, walked)':46s} {cost['history_bytes_per_change']!s:>10} "
          f"{'snapshot':>10} {cost['snapshot_extra_chars_per_change']!s:>9} chars")
    print()
    print("hour  history  marks  marks+history MB")
    for c in clocked["run"]["hourly"]:
        print(f"{c['hour']:4g} {c['history']:8,} {c['marks']:6d} {c['marks_graph_bytes'] / _MB:17.1f}")
    tm = clocked.get("timings", {})
    print()
    print(f"events: {clocked['run']['events']}; simulated in {clocked['run']['run_s']} s (clocks) and "
          f"{plain['run']['run_s']} s (plain), {time.perf_counter() - started:.0f} s in all")
    print(f"without tracemalloc: a history trim (each new mark does one) {tm.get('trim_s')} s, snapshot {tm.get('snapshot_s')} s "
          f"(load {tm.get('snapshot_load_s')} s), rewind to the last mark {tm.get('rewind_last_s')} s (undone "
          f"{tm.get('rewind_last', {}).get('undone')}), to the oldest kept {tm.get('rewind_oldest_s')} s (undone "
          f"{tm.get('rewind_oldest', {}).get('undone')})")
    if ce.get("closed_epoch_bytes_each"):
        print(f"a closed epoch kept for a rewind (none closes in this day) would cost {ce['closed_epoch_bytes_each'] / _MB:.2f} MB "
              f"(its done bits); one is kept while a change of it is in the history")
    if cost["max_history_bytes_estimate"]:
        print(f"at MAX_HISTORY ({MAX_HISTORY:,} changes) the history would hold about "
              f"{cost['max_history_bytes_estimate'] / _MB:.0f} MB")
    path = write_results(out, {
        "benchmark": "marks-memory",
        "what": "the lease master's memory and snapshot size for one job over a simulated day with a checkpoint mark "
                "every --checkpoint-s, against the same day without clocks and marks (MasterState driven in process)",
        "params": {"shards": args.shards, "hours": args.hours, "traced_hours": args.traced_hours,
                   "trainers": args.trainers, "leases": args.leases, "samples_per_s": args.samples_per_s,
                   "renew_s": args.renew_s, "checkpoint_s": args.checkpoint_s, "rank0_marks": args.rank0_marks,
                   "max_marks": MAX_MARKS, "retain_s": RETAIN_S, "max_history": MAX_HISTORY},
        "machine": machine_facts(),
        "cost": cost,
        "timings": tm,
        "runs": {"plain": plain, "clocks": clocked},
    })
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
