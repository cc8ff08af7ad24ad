"""Data stall: how long a trainer waits for data, cold cache then warm.

A simulated trainer runs the loop users run::

    for images, labels in DataLoader(ShardDataset(url, job=..., master=..., endpoint=daemon),
                                     batch_size=B, num_workers=2, persistent_workers=True, ...):
        time.sleep(step_s)        # the GPU step (a sleep releases the GIL, as a kernel wait does)

and the stall is the time spent in ``next(batches)`` over the epoch's wall time. Epoch 1 starts
on an empty daemon cache (the loader's lease prefetch hints make the daemon fetch ahead); epoch 2
is the same job again, warm. The same runs in static mode (``rank``/``world_size``, a fresh
daemon) for comparison.

The origin is a moto S3 server in its own process behind :mod:`bench.latency_proxy` with a
per-request delay and a TOTAL throughput cap (all connections together) of ``--origin-factor``
(1.5) times the trainer's consumption in bytes/s. Targets (issue 3): warm stall < 2%, cold < 10%.

    python -m bench.stall_bench            # ~25 s epochs, a few minutes
    python -m bench.stall_bench --quick    # small dataset, under ~90 s

Writes a table to stdout and ``bench/results/stall.json``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.common import (
    RESULTS_DIR,
    fmt_size,
    log_line,
    machine_facts,
    make_samples,
    pack_shards,
    parse_size,
    spawn,
    stop_process,
    write_results,
)
from bench.latency_proxy import LatencyProxy
from bench.servers import MasterProcess, MotoServer, ServeProcess

__all__ = ["StallConfig", "main"]

BUCKET = "stall"
PREFIX = "train/"
WARM_TARGET = 0.02
COLD_TARGET = 0.10
# What the "decode" keeps of each sample: a fixed-size uint8 tensor (so batches collate into
# one shared-memory tensor, as decoded images do). Samples are 80-140 KB.
DECODED_BYTES = 80_000


@dataclass
class StallConfig:
    rate: float = 400.0
    """Samples per second the trainer consumes when never waiting."""
    batch: int = 256
    """Batch size; the GPU step is batch / rate seconds."""
    epoch_s: float = 25.0
    """Target epoch length at the trainer rate (sets the dataset size)."""
    shard_bytes: int = 32 * 1024 * 1024
    """Shard size."""
    origin_factor: float = 1.5
    """Origin total throughput cap as a multiple of the trainer's consumption in bytes/s."""
    delay_ms: float = 20.0
    """Per-request one-way latency added by the proxy."""
    workers: int = 2
    """DataLoader num_workers."""
    prefetch_factor: int = 4
    """DataLoader prefetch_factor (batches per worker)."""
    seed: int = 0
    """Dataset seed."""
    modes: tuple[str, ...] = ("floor", "dynamic", "static")
    """Which runs: ``floor`` (in-memory samples, the DataLoader's own cost), ``dynamic``, ``static``."""
    daemon_args: tuple[str, ...] = ()
    """Extra ``serve`` flags (experiments, e.g. ``--parts-per-object 1``)."""
    short_circuit: bool = True
    """Loader reads cached files directly (the node cache dir mounted in the pod)."""
    timeout_s: float = 600.0
    """Bound on one trainer run."""


# -- trainer (child process) ------------------------------------------------------------------


def _decode(sample: dict[str, Any]) -> Any:
    import torch

    jpg = sample["jpg"]
    image = torch.frombuffer(bytearray(jpg[:DECODED_BYTES]), dtype=torch.uint8)
    return image, int(sample["cls"])


def _daemon_stats(url: str) -> dict[str, Any]:
    import urllib.request

    with urllib.request.urlopen(url.rstrip("/") + "/_shardcache/stats", timeout=10) as resp:
        return dict(json.loads(resp.read()))


def _epoch_daemon_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    if not before or not after:
        return {}
    req0, req1 = before.get("requests", {}), after.get("requests", {})
    counts = {k: req1.get(k, 0) - req0.get(k, 0) for k in ("hits", "misses", "coalesced")}
    total = sum(counts.values())
    return {
        **{k: int(v) for k, v in counts.items()},
        "hit_rate": round(counts["hits"] / total, 4) if total else None,
        "origin_read_bytes": int(after.get("origin_read_bytes", 0) - before.get("origin_read_bytes", 0)),
    }


class FloorDataset:
    """The same decoded samples from memory, no I/O: what the DataLoader hand-off alone costs
    (the floor under any loader's stall at this batch size and step time)."""

    def __init__(self, samples: int, seed: int) -> None:
        self.samples = samples
        self.seed = seed

    def __iter__(self) -> Any:
        import random

        import torch.utils.data

        info = torch.utils.data.get_worker_info()
        worker, count = (info.id, info.num_workers) if info is not None else (0, 1)
        blob = random.Random(self.seed + worker).randbytes(DECODED_BYTES)
        for index in range(worker, self.samples, count):
            yield _decode({"jpg": blob, "cls": str(index % 1000).encode()})


def run_trainer(spec: dict[str, Any]) -> dict[str, Any]:
    """The simulated trainer: two epochs through one DataLoader with persistent workers."""
    import torch.utils.data

    from loader.torch import ShardDataset

    url = f"s3://{BUCKET}/{PREFIX}"
    if spec["mode"] == "floor":
        # Wrapped so that torch is imported only in the trainer process, not by the orchestrator.
        class Floor(torch.utils.data.IterableDataset):  # type: ignore[type-arg]
            def __init__(self) -> None:
                self.inner = FloorDataset(spec["samples"], spec["seed"])

            def __iter__(self) -> Any:
                return iter(self.inner)

        ds = Floor()
    elif spec["mode"] == "dynamic":
        ds = ShardDataset(url, job=spec["job"], master=spec["master"], endpoint=spec["daemon"], epochs=2,
                          seed=spec["seed"], transform=_decode)
    else:
        ds = ShardDataset(url, rank=0, world_size=1, seed=spec["seed"], endpoint=spec["daemon"], transform=_decode)
    batches = torch.utils.data.DataLoader(ds, batch_size=spec["batch"], num_workers=spec["workers"],
                                          persistent_workers=True, prefetch_factor=spec["prefetch_factor"])
    step_s = spec["batch"] / spec["rate"]
    epochs = []
    for epoch in range(2):
        before = _daemon_stats(spec["daemon"]) if spec["daemon"] else {}
        samples = 0
        steps = 0
        stall = 0.0
        first_batch_s = None
        waits: list[float] = []
        start = time.monotonic()
        it = iter(batches)
        while True:
            asked = time.monotonic()
            try:
                images, _labels = next(it)
            except StopIteration:
                stall += time.monotonic() - asked  # the wait for the epoch's end is waiting too
                break
            got = time.monotonic()
            waited = got - asked
            stall += waited
            waits.append(waited)
            if first_batch_s is None:
                first_batch_s = got - start
            samples += int(images.shape[0])
            steps += 1
            time.sleep(step_s)  # the GPU step
        wall = time.monotonic() - start
        after = _daemon_stats(spec["daemon"]) if spec["daemon"] else {}
        waits.sort()
        epochs.append({
            "epoch": epoch,
            "kind": "cold" if epoch == 0 else "warm",
            "wall_s": round(wall, 3),
            "samples": samples,
            "steps": steps,
            "stall_s": round(stall, 3),
            "stall_fraction": round(stall / wall, 4) if wall else None,
            "first_batch_s": round(first_batch_s, 3) if first_batch_s is not None else None,
            "stall_after_first_batch_s": round(stall - (first_batch_s or 0.0), 3),
            "longest_wait_s": round(waits[-1], 3) if waits else None,
            "waits_over_100ms": sum(1 for w in waits if w > 0.1),
            "samples_per_s": round(samples / wall, 1) if wall else None,
            "ideal_s": round(steps * step_s, 3),
            "daemon": _epoch_daemon_delta(before, after),
        })
    return {"epochs": epochs, "step_s": step_s}


# -- orchestration ----------------------------------------------------------------------------


@dataclass
class Dataset:
    shards: int
    samples: int
    bytes: int

    @property
    def bytes_per_sample(self) -> float:
        return self.bytes / self.samples


def build_dataset(cfg: StallConfig, moto: MotoServer, workdir: Path) -> Dataset:
    client = moto.client()
    client.create_bucket(Bucket=BUCKET)
    # ~112 KB of tar per sample (80-140 KB payload plus headers): enough samples for epoch_s.
    target = int(cfg.rate * cfg.epoch_s * 110_000)
    shards = samples = size = 0
    for name, data, count in pack_shards(make_samples(target, cfg.seed), cfg.shard_bytes):
        client.put_object(Bucket=BUCKET, Key=PREFIX + name, Body=data)
        shards += 1
        samples += count
        size += len(data)
    log = workdir / "index.log"
    proc = spawn([sys.executable, "-m", "sidecar.cli", "index", f"s3://{BUCKET}/{PREFIX}", "--s3-endpoint",
                  moto.endpoint, "--quiet", "--json"], log)
    if proc.wait(timeout=600) != 0:
        raise RuntimeError(f"shardcache index failed: {log.read_text()[-2000:]}")
    return Dataset(shards, samples, size)


def start_daemon(workdir: Path, name: str, origin: str, cache_size: int, extra: tuple[str, ...] = ()) -> ServeProcess:
    cache = workdir / f"cache-{name}"
    shutil.rmtree(cache, ignore_errors=True)
    return ServeProcess(workdir / f"daemon-{name}.log", ["--origin", "s3", "--s3-endpoint", origin, "--cache-dir", str(cache),
                                                         "--cache-size", str(cache_size), "--min-free", "0", *extra]).start()


def start_master(workdir: Path, name: str) -> MasterProcess:
    return MasterProcess(workdir / f"master-{name}.log", f"sqlite:///{workdir / (name + '.db')}", ready_path="/healthz").start()


def run_mode(cfg: StallConfig, mode: str, workdir: Path, dataset: Dataset, proxy: LatencyProxy) -> dict[str, Any]:
    daemon = start_daemon(workdir, mode, proxy.endpoint, 4 * dataset.bytes, cfg.daemon_args) if mode != "floor" else None
    master = start_master(workdir, f"master-{mode}") if mode == "dynamic" else None
    try:
        spec = {"mode": mode, "daemon": daemon.url if daemon else None, "master": master.url if master else None,
                "job": f"stall-{int(time.time())}", "seed": cfg.seed, "rate": cfg.rate, "batch": cfg.batch,
                "workers": cfg.workers, "prefetch_factor": cfg.prefetch_factor, "samples": dataset.samples}
        spec_path, out_path = workdir / f"spec-{mode}.json", workdir / f"out-{mode}.json"
        spec_path.write_text(json.dumps(spec))
        log = workdir / f"trainer-{mode}.log"
        env = {"SHARDCACHE_SHORT_CIRCUIT": "1" if cfg.short_circuit else "0"}
        proc = spawn([sys.executable, "-m", "bench.stall_bench", "--trainer", str(spec_path), str(out_path)], log, env)
        try:
            proc.wait(timeout=cfg.timeout_s)
        except subprocess.TimeoutExpired:
            stop_process(proc)
            return {"error": f"trainer timed out after {cfg.timeout_s:.0f}s", "log_tail": log.read_text()[-2000:]}
        if proc.returncode != 0 or not out_path.exists():
            return {"error": f"trainer exited {proc.returncode}", "log_tail": log.read_text()[-2000:]}
        result: dict[str, Any] = json.loads(out_path.read_text())
        for ep in result["epochs"]:
            ep["mb_per_s"] = round(ep["samples"] * dataset.bytes_per_sample / ep["wall_s"] / 1e6, 1)
            complete = ep["samples"] == dataset.samples
            ep["all_samples"] = complete
        return result
    finally:
        if master is not None:
            master.stop()
        if daemon is not None:
            daemon.stop()


def _table(results: dict[str, Any]) -> str:
    head = (f"{'mode':8} {'epoch':5} {'wall s':>7} {'samples':>7} {'stall s':>7} {'stall':>6} {'1st batch':>9} "
            f"{'samples/s':>9} {'MB/s':>6} {'hit rate':>8} {'target':>7}")
    lines = [head, "-" * len(head)]
    for mode, res in results.items():
        if "error" in res:
            lines.append(f"{mode:8} FAILED: {res['error']}")
            continue
        for ep in res["epochs"]:
            hit = ep["daemon"].get("hit_rate")
            lines.append(
                f"{mode:8} {ep['kind']:5} {ep['wall_s']:7.2f} {ep['samples']:7d} {ep['stall_s']:7.2f} "
                f"{ep['stall_fraction']:6.1%} {ep['first_batch_s'] or 0:9.2f} {ep['samples_per_s']:9.1f} "
                f"{ep['mb_per_s']:6.1f} {'-' if hit is None else f'{hit:.0%}':>8} "
                f"{'yes' if ep['target_met'] else 'NO':>7}")
    return "\n".join(lines)


def run(cfg: StallConfig, out: Path) -> dict[str, Any]:
    facts = machine_facts()
    workdir = Path(tempfile.mkdtemp(prefix="shardcache-stall-"))
    results: dict[str, Any] = {}
    try:
        with MotoServer(workdir) as moto:
            started = time.monotonic()
            dataset = build_dataset(cfg, moto, workdir)
            demand = cfg.rate * dataset.bytes_per_sample
            origin_bps = cfg.origin_factor * demand
            log_line(f"dataset: {dataset.shards} shards of {fmt_size(cfg.shard_bytes)}, {dataset.samples} samples, "
                 f"{fmt_size(dataset.bytes)} ({time.monotonic() - started:.0f}s); trainer {cfg.rate:.0f} samples/s = "
                 f"{demand / 1e6:.1f} MB/s, origin capped at {origin_bps / 1e6:.1f} MB/s total + {cfg.delay_ms:.0f} ms")
            with LatencyProxy(moto.endpoint, cfg.delay_ms, None, workdir / "proxy.log",
                              total_mbps=origin_bps / 1e6) as proxy:
                for mode in cfg.modes:
                    log_line(f"{mode}: cold epoch then warm epoch ...")
                    res = run_mode(cfg, mode, workdir, dataset, proxy)
                    results[mode] = res
                    if "error" in res:
                        log_line(f"{mode}: FAILED: {res['error']}\n{res['log_tail']}")
                        continue
                    for ep in res["epochs"]:
                        target = COLD_TARGET if ep["kind"] == "cold" else WARM_TARGET
                        ep["target"] = target
                        ep["target_met"] = bool(ep["stall_fraction"] is not None and ep["stall_fraction"] < target)
                        log_line(f"  {mode} {ep['kind']}: {ep['wall_s']:.1f}s, stall {ep['stall_s']:.2f}s "
                             f"({ep['stall_fraction']:.1%}), first batch {ep['first_batch_s']}s, "
                             f"hit rate {ep['daemon'].get('hit_rate')}")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print(_table(results), flush=True)
    data = {
        "benchmark": "stall",
        "config": {**asdict(cfg), "modes": list(cfg.modes), "daemon_args": list(cfg.daemon_args), "step_s": cfg.batch / cfg.rate},
        "dataset": {**asdict(dataset), "bytes_per_sample": round(dataset.bytes_per_sample)},
        "origin": {"kind": "moto server (own process, objects in RAM) behind bench.latency_proxy",
                   "total_cap_mb_per_s": round(origin_bps / 1e6, 2),
                   "trainer_demand_mb_per_s": round(demand / 1e6, 2), "delay_ms": cfg.delay_ms},
        "targets": {"cold_stall_fraction_below": COLD_TARGET, "warm_stall_fraction_below": WARM_TARGET},
        "results": results,
        "targets_met": {mode: {ep["kind"]: ep["target_met"] for ep in res["epochs"]}
                        for mode, res in results.items() if "error" not in res},
        "machine": facts,
    }
    write_results(out, data)
    log_line(f"wrote {out}")
    return data


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.stall_bench",
        description="Data stall of a simulated trainer (DataLoader + ShardDataset + daemon), cold then warm",
        epilog="examples:\n  python -m bench.stall_bench\n  python -m bench.stall_bench --quick\n"
               "  python -m bench.stall_bench --rate 300 --batch 32 --modes dynamic",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--quick", action="store_true", help="small dataset (8 s epochs, 16 MiB shards)")
    parser.add_argument("--rate", type=float, default=None, help="trainer samples/s (default 400)")
    parser.add_argument("--batch", type=int, default=256, help="batch size (default 256)")
    parser.add_argument("--epoch-s", type=float, default=None, help="target epoch seconds (default 25, quick 8)")
    parser.add_argument("--shard-size", default=None, help="shard size (default 32MiB, quick 16MiB)")
    parser.add_argument("--origin-factor", type=float, default=1.5, help="origin total cap / trainer demand")
    parser.add_argument("--delay-ms", type=float, default=20.0, help="per-request latency at the origin")
    parser.add_argument("--workers", type=int, default=2, help="DataLoader num_workers")
    parser.add_argument("--prefetch-factor", type=int, default=4, help="DataLoader prefetch_factor")
    parser.add_argument("--modes", default="floor,dynamic,static", help="comma-separated: floor,dynamic,static")
    parser.add_argument("--daemon-arg", action="append", default=[], metavar="ARG",
                        help="extra flag for the daemon, repeatable (e.g. --daemon-arg=--parts-per-object --daemon-arg=1)")
    parser.add_argument("--no-short-circuit", action="store_true", help="read through the daemon's HTTP body")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "stall.json", help="result JSON path")
    parser.add_argument("--trainer", nargs=2, metavar=("SPEC", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.trainer:
        spec = json.loads(Path(args.trainer[0]).read_text())
        result = run_trainer(spec)
        Path(args.trainer[1]).write_text(json.dumps(result))
        return 0
    modes = tuple(m.strip() for m in args.modes.split(",") if m.strip())
    if not modes or any(m not in ("floor", "dynamic", "static") for m in modes):
        parser.error("--modes takes floor, dynamic and/or static")
    cfg = StallConfig(
        rate=args.rate or 400.0, batch=args.batch,
        epoch_s=args.epoch_s or (8.0 if args.quick else 25.0),
        shard_bytes=parse_size(args.shard_size or ("16MiB" if args.quick else "32MiB")),
        origin_factor=args.origin_factor, delay_ms=args.delay_ms, workers=args.workers,
        prefetch_factor=args.prefetch_factor, modes=modes, short_circuit=not args.no_short_circuit,
        daemon_args=tuple(args.daemon_arg),
    )
    if cfg.rate <= 0 or cfg.batch < 1 or cfg.origin_factor <= 0 or cfg.workers < 1 or cfg.prefetch_factor < 1:
        parser.error("--rate, --batch, --origin-factor, --workers and --prefetch-factor must be positive")
    run(cfg, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
