"""Emulated accelerators at >= 90% utilisation, following MLPerf Storage's method (not an MLPerf result).

MLPerf Storage's DLIO engine emulates an accelerator as a consumer that takes a batch of ``B``
samples and then sleeps for the compute time of a real one; accelerator utilisation (AU) is
compute time over wall time, the first step excluded. DLIO's H100 ResNet-50 setting is 400
samples per 0.224 s (~115 KB a sample, ~205 MB/s per accelerator). This machine (2 cores, a
loopback origin) scales it by one factor applied to every reader alike: ``--batch 40`` samples
per ``--compute-ms 22.4`` keeps the samples/s of one accelerator and makes steps 10x finer.

How N accelerators share one node's reader: each reader is used the way the suite uses it, one
iterator per node (``bench.peers.make_reader``, ``procs`` 1), read by one producer thread into a
queue of batches (two per accelerator, as a DataLoader prefetches); the N accelerators are
threads taking batches from that queue (a sleep releases the GIL, as a kernel wait does).

For each reader -- shardcache's ``ShardLoader`` on a cold daemon, on a warm daemon, and each peer
of the suite (``bench.suite.PEERS``) on fresh caches -- the largest N (1, 2, 4, ... then bisect)
whose every accelerator keeps AU >= 90% is reported with samples/s and MB/s. Each trial runs in
its own process (``--trial SPEC OUT``) for at most ``--trial-s`` seconds after its first step (a
reader's start-up is not in the window) or one epoch.

    python -m bench.accelerator_bench            # ~8 min on 2 cores
    python -m bench.accelerator_bench --quick    # CI smoke, < 60 s

Writes ``bench/results/accelerators.json`` and ``.png`` and prints a table.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.common import (
    RESULTS_DIR,
    fmt_size,
    log_line,
    machine_facts,
    parse_size,
    spawn,
    stop_process,
    write_results,
)
from bench.latency_proxy import LatencyProxy
from bench.peers_common import MB
from bench.servers import store_server

__all__ = ["AccelConfig", "READERS", "run_trial", "run", "main"]

AU_TARGET = 0.90
DLIO_H100_RESNET50 = {"batch": 400, "compute_s": 0.224, "sample_bytes": 115_000}
# Table name -> how the trial reads: the suite's reader name, and the daemon state for shardcache.
READERS: dict[str, dict[str, Any]] = {
    "shardcache_cold": {"reader": "loader", "daemon": "cold"},
    "shardcache_warm": {"reader": "loader", "daemon": "warm"},
    "boto3": {"reader": "boto3"},
    "boto3_transfer": {"reader": "boto3_transfer"},
    "s3fs": {"reader": "s3fs"},
    "webdataset": {"reader": "webdataset"},
    "streaming": {"reader": "streaming"},
    "s3torchconnector": {"reader": "s3torchconnector"},
}
LABELS = {
    "shardcache_cold": "shardcache ShardLoader, cold daemon",
    "shardcache_warm": "shardcache ShardLoader, warm daemon",
    "boto3": "boto3 get_object",
    "boto3_transfer": "boto3 download_fileobj",
    "s3fs": "s3fs",
    "webdataset": "webdataset (fresh cache_dir)",
    "streaming": "mosaicml-streaming (fresh local)",
    "s3torchconnector": "s3torchconnector",
}


@dataclass
class AccelConfig:
    batch: int = 40
    """Samples per step of one emulated accelerator (DLIO H100 ResNet-50: 400)."""
    compute_ms: float = 22.4
    """Sleep per step (DLIO: 224 ms); batch / compute keeps DLIO's samples/s per accelerator."""
    size: int = 1024**3
    """Dataset payload bytes (the suite's generator: 80-140 KB samples)."""
    shard_bytes: int = 32 * 1024**2
    delay_ms: float = 20.0
    """Per-request delay of the latency proxy in front of the store."""
    trial_s: float = 5.0
    """Bound on one trial (one epoch at most)."""
    min_steps: int = 4
    """Steps after the first that every accelerator must take for a trial to count."""
    max_n: int = 64
    readers: tuple[str, ...] = tuple(READERS)
    seed: int = 0
    quick: bool = False
    stock_moto: bool = False
    """moto as shipped (every ranged GET copies the whole object); False: a range costs the range,
    as on S3 and in the suite (``bench.servers.S3_LIKE_MOTO``)."""
    timeout_s: float = 120.0
    """Bound on one trial process."""
    note: str = ""
    """What else ran on the machine meanwhile (recorded with the figures)."""


# -- one trial (child process) -------------------------------------------------------------------


def _payload(sample: dict[str, Any]) -> int:
    return sum(len(v) for k, v in sample.items() if k != "__key__" and isinstance(v, (bytes, bytearray, memoryview)))


def run_trial(spec: dict[str, Any]) -> dict[str, Any]:
    """N emulated accelerators on one reader for at most ``trial_s`` seconds after the first step
    (start-up bounded by ``startup_s``) or one epoch."""
    from bench.peers import make_reader

    n, batch, compute_s, cap_s = spec["n"], spec["batch"], spec["compute_s"], spec["trial_s"]
    samples = make_reader(spec)(0)
    done = object()
    batches: queue.Queue[Any] = queue.Queue(maxsize=2 * n)
    stop = threading.Event()
    # The trial's window opens at the first step's end: start-up (a reader that downloads a whole
    # shard before its first sample, as mosaicml-streaming does) is excluded from the window as
    # the first step is from AU, or a 1 s quick trial measured no step of such a reader at all.
    started_up = threading.Event()
    failure: list[BaseException] = []

    def produce() -> None:
        try:
            current: list[int] = []
            for sample in samples:
                current.append(_payload(sample))
                if len(current) == batch:
                    while not stop.is_set():
                        with contextlib.suppress(queue.Full):
                            batches.put(current, timeout=0.1)
                            break
                    if stop.is_set():
                        return
                    current = []
        except BaseException as exc:  # noqa: BLE001 - reported by the trial
            failure.append(exc)
        finally:
            for _ in range(n):  # one end marker per accelerator; a partial last batch is dropped
                with contextlib.suppress(queue.Full):
                    batches.put(done, timeout=2)

    per_accel: list[dict[str, Any]] = [{} for _ in range(n)]

    def accelerate(index: int) -> None:
        steps = 0
        nbytes = 0
        first_end: float | None = None
        last_end = 0.0
        longest_wait = 0.0
        while not stop.is_set():
            asked = time.monotonic()
            item = batches.get(timeout=600)
            if item is done:
                break
            waited = time.monotonic() - asked
            time.sleep(compute_s)  # the accelerator's step
            last_end = time.monotonic()
            if first_end is None:
                first_end = last_end  # the first step (start-up) is excluded, as DLIO does
                started_up.set()
                continue
            steps += 1
            nbytes += sum(item)
            longest_wait = max(longest_wait, waited)
        wall = last_end - first_end if first_end is not None else 0.0
        per_accel[index] = {"steps": steps, "bytes": nbytes, "wall_s": round(wall, 4),
                            "au": round(steps * compute_s / wall, 4) if wall > 0 else 0.0,
                            "longest_wait_s": round(longest_wait, 4)}

    producer = threading.Thread(target=produce, name="reader", daemon=True)
    accels = [threading.Thread(target=accelerate, args=(i,), name=f"accel-{i}", daemon=True) for i in range(n)]
    started = time.monotonic()
    producer.start()
    for thread in accels:
        thread.start()
    # Start-up is bounded too (the parent's timeout is the last resort).
    started_up.wait(spec.get("startup_s", 30.0))
    deadline = time.monotonic() + cap_s
    while any(t.is_alive() for t in accels) and time.monotonic() < deadline:
        time.sleep(0.02)
    stop.set()
    for thread in accels:
        thread.join(compute_s + 5)
    producer.join(10)
    if failure:
        raise failure[0]
    walls = [a["wall_s"] for a in per_accel if a]
    total_steps = sum(a["steps"] for a in per_accel if a)
    total_bytes = sum(a["bytes"] for a in per_accel if a)
    wall = max(walls) if walls else 0.0
    return {
        "n": n,
        "accelerators": per_accel,
        "min_au": min((a["au"] for a in per_accel if a), default=0.0),
        "min_steps": min((a["steps"] for a in per_accel if a), default=0),
        "samples_per_s": round(total_steps * batch / wall, 1) if wall else 0.0,
        "mb_per_s": round(total_bytes / wall / MB, 1) if wall else 0.0,
        "elapsed_s": round(time.monotonic() - started, 2),
    }


# -- orchestration ------------------------------------------------------------------------------


class Bench:
    def __init__(self, cfg: AccelConfig, workdir: Path, runner: Any, endpoint: str) -> None:
        self.cfg = cfg
        self.workdir = workdir
        self.runner = runner  # bench.suite.Runner: its base_spec and dataset
        self.endpoint = endpoint
        self.count = 0

    def trial(self, name: str, n: int, extra: dict[str, Any]) -> dict[str, Any]:
        self.count += 1
        spec = self.runner.base_spec(READERS[name]["reader"]) | extra | {
            "n": n, "batch": self.cfg.batch, "compute_s": self.cfg.compute_ms / 1000, "trial_s": self.cfg.trial_s,
            "startup_s": self.cfg.timeout_s / 2}
        cache = self.workdir / f"cache-{name}-{self.count}"
        spec.setdefault("cache_dir", str(cache))
        spec_path = self.workdir / f"trial-{self.count:03d}-{name}-{n}.json"
        out_path = spec_path.with_suffix(".out.json")
        log = spec_path.with_suffix(".log")
        spec_path.write_text(json.dumps(spec))
        proc = spawn([sys.executable, "-m", "bench.accelerator_bench", "--trial", str(spec_path), str(out_path)], log)
        try:
            proc.wait(timeout=self.cfg.timeout_s)
        except subprocess.TimeoutExpired:
            stop_process(proc)
            return {"n": n, "error": f"trial timed out after {self.cfg.timeout_s:.0f}s", "log_tail": log.read_text()[-1500:]}
        finally:
            shutil.rmtree(cache, ignore_errors=True)
        if proc.returncode != 0 or not out_path.exists():
            return {"n": n, "error": f"trial exited {proc.returncode}", "log_tail": log.read_text()[-1500:]}
        result: dict[str, Any] = json.loads(out_path.read_text())
        result["passed"] = result["min_au"] >= AU_TARGET and result["min_steps"] >= self.cfg.min_steps
        return result

    def search(self, name: str, extra_for: Any) -> dict[str, Any]:
        """Largest N with every accelerator at AU >= 90%: doubling, then bisection."""
        trials: dict[int, dict[str, Any]] = {}

        def attempt(n: int) -> bool:
            with extra_for(n) as extra:
                res = self.trial(name, n, extra)
            trials[n] = res
            if "error" in res:
                log_line(f"  {name} N={n}: FAILED: {res['error']}")
                return False
            log_line(f"  {name} N={n}: min AU {res['min_au']:.1%} (min {res['min_steps']} steps), "
                 f"{res['samples_per_s']:.0f} samples/s, {res['mb_per_s']:.0f} MB/s -> {'pass' if res['passed'] else 'fail'}")
            return bool(res["passed"])

        good, bad = 0, None
        n = 1
        while n <= self.cfg.max_n:
            if not attempt(n):
                bad = n
                break
            good, n = n, n * 2
        if bad is not None:
            while bad - good > 1:
                mid = (good + bad) // 2
                if attempt(mid):
                    good = mid
                else:
                    bad = mid
        best = trials.get(good) if good else None
        return {
            "max_accelerators": good,
            "capped_at_max_n": bad is None,
            "samples_per_s": best["samples_per_s"] if best else None,
            "mb_per_s": best["mb_per_s"] if best else None,
            "min_au": best["min_au"] if best else None,
            "first_failing": trials[bad] if bad is not None else None,
            "trials": [trials[k] for k in sorted(trials)],
        }


def _table(rows: dict[str, Any]) -> str:
    head = f"{'reader':38} {'max N':>5} {'samples/s':>9} {'MB/s':>7} {'min AU':>7} {'AU at N+1':>9}"
    lines = [head, "-" * len(head)]
    for name, row in rows.items():
        if "error" in row:
            lines.append(f"{LABELS[name]:38} FAILED: {row['error']}")
            continue
        nxt = row["first_failing"]
        nxt_au = f"{nxt['min_au']:.1%}" if nxt and "min_au" in nxt else "-"
        lines.append(f"{LABELS[name]:38} {row['max_accelerators']:>5}{'+' if row['capped_at_max_n'] else ' '}"
                     f"{row['samples_per_s'] or 0:>9.0f} {row['mb_per_s'] or 0:>7.0f} "
                     f"{(row['min_au'] or 0):>7.1%} {nxt_au:>9}")
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = {k: v for k, v in result["rows"].items() if "error" not in v}
    names = list(rows)
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    ys = range(len(names))
    left.barh(ys, [rows[n]["max_accelerators"] for n in names], color="#4c72b0")
    left.set_yticks(list(ys), [LABELS[n] for n in names])
    left.invert_yaxis()
    left.set_xlabel("emulated accelerators at AU >= 90%")
    # Where not even one accelerator reached 90%, the N=1 trial's MB/s (hatched) shows how far off it was.
    shown = [rows[n]["mb_per_s"] if rows[n]["max_accelerators"] else rows[n]["trials"][0].get("mb_per_s", 0)
             for n in names]
    bars = right.barh(ys, [v or 0 for v in shown], color="#55a868")
    for name, bar in zip(names, bars, strict=True):
        if not rows[name]["max_accelerators"]:
            bar.set_hatch("//")
            bar.set_facecolor("#c8e6c9")
    right.set_yticks(list(ys), [""] * len(names))
    right.invert_yaxis()
    right.set_xlabel("MB/s delivered at that count (hatched: at N=1, AU < 90%)")
    cfg = result["config"]
    fig.suptitle(f"Emulated accelerators (MLPerf Storage method, not an MLPerf result): "
                 f"{cfg['batch']} samples per {cfg['compute_ms']:g} ms, {result['machine']['cpu_count']} CPUs")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(cfg: AccelConfig, out: Path) -> dict[str, Any]:
    from bench.daemon_bench import Daemon
    from bench.suite import Runner, SuiteConfig, build_dataset

    started = time.monotonic()
    facts = machine_facts()
    facts["loadavg_start"] = __import__("os").getloadavg()
    workdir = Path(tempfile.mkdtemp(prefix="shardcache-accel-"))
    rows: dict[str, Any] = {}
    try:
        with contextlib.ExitStack() as stack:
            store = stack.enter_context(store_server("moto", workdir, s3_like=not cfg.stock_moto))
            scfg = SuiteConfig(size=cfg.size, shard_bytes=cfg.shard_bytes, delay_ms=cfg.delay_ms, seed=cfg.seed)
            dataset = build_dataset(scfg, store, workdir)
            proxy = stack.enter_context(LatencyProxy(store.endpoint, cfg.delay_ms, None, workdir / "proxy.log"))
            runner = Runner(scfg, workdir, dataset, proxy.endpoint)
            bench = Bench(cfg, workdir, runner, proxy.endpoint)
            warm: list[Any] = []

            @contextlib.contextmanager
            def cold_daemon(n: int) -> Any:
                daemon = Daemon(workdir, f"cold-{n}", proxy.endpoint, 4 * dataset.bytes, [])
                try:
                    yield {"daemon": daemon.url}
                finally:
                    daemon.stop()

            @contextlib.contextmanager
            def warm_daemon(_n: int) -> Any:
                if not warm:  # one daemon, filled once by a full epoch, kept for every warm trial
                    daemon = Daemon(workdir, "warm", proxy.endpoint, 4 * dataset.bytes, [])
                    stack.callback(daemon.stop)
                    fill = runner.execute("warm-fill", runner.base_spec("loader") | {"daemon": daemon.url, "epochs": [{}]})
                    if "error" in fill:
                        raise RuntimeError(f"warming the daemon failed: {fill['error']}")
                    daemon.settle()
                    warm.append(daemon)
                yield {"daemon": warm[0].url}

            @contextlib.contextmanager
            def plain(_n: int) -> Any:
                yield {}

            for name in cfg.readers:
                log_line(f"{LABELS[name]}:")
                how = READERS[name].get("daemon")
                try:
                    rows[name] = bench.search(name, cold_daemon if how == "cold" else warm_daemon if how == "warm" else plain)
                except Exception as exc:  # one reader's failure must not lose the others
                    rows[name] = {"error": f"{type(exc).__name__}: {exc}"}
                    log_line(f"  {name}: FAILED: {rows[name]['error']}")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    facts["loadavg_end"] = __import__("os").getloadavg()
    print(_table(rows), flush=True)
    per_accel_sps = cfg.batch / (cfg.compute_ms / 1000)
    result = {
        "benchmark": "accelerators",
        "method": "MLPerf Storage (DLIO) emulation: each accelerator takes a batch then sleeps the compute time; "
                  "AU = compute / wall, first step excluded; largest N with every accelerator at AU >= 90%. "
                  "Follows MLPerf Storage's method; not an MLPerf result.",
        "scaling": {"dlio_h100_resnet50": DLIO_H100_RESNET50, "batch": cfg.batch, "compute_s": cfg.compute_ms / 1000,
                    "factor": round(DLIO_H100_RESNET50["batch"] / cfg.batch, 3),
                    "samples_per_s_per_accelerator": round(per_accel_sps, 1),
                    "note": "batch and compute time divided by the same factor for every reader: "
                            "samples/s per accelerator as DLIO's H100"},
        "sharing": "one reader iterator per node (as the suite uses each reader, one process), read by one "
                   "producer thread into a queue of 2 batches per accelerator; N accelerator threads take batches",
        "readers": {name: {**READERS[name], "label": LABELS[name]} for name in cfg.readers},
        "caches": "peers: fresh cache dirs per trial (cold); shardcache_cold: a fresh daemon per trial; "
                  "shardcache_warm: one daemon filled by a full epoch beforehand",
        "config": asdict(cfg) | {"readers": list(cfg.readers)},
        "dataset": {"shards": len(dataset.keys), "bytes": dataset.bytes, "samples": dataset.samples,
                    "mean_sample_bytes": round(dataset.bytes / max(1, dataset.samples)),
                    "origin": f"moto S3 server behind bench.latency_proxy ({cfg.delay_ms:g} ms per request)"
                              + ("; stock moto: every GET copies the whole object" if cfg.stock_moto
                                 else "; a ranged GET costing the range as on S3 (bench.servers.S3_LIKE_MOTO)")},
        "au_target": AU_TARGET,
        "note": cfg.note,
        "rows": rows,
        "machine": facts,
        "elapsed_s": round(time.monotonic() - started, 1),
    }
    write_results(out, result)
    try:
        plot(result, out.with_suffix(".png"))
    except Exception as exc:  # a missing matplotlib must not lose the measurements
        log_line(f"plot not drawn: {exc}")
    log_line(f"wrote {out} ({result['elapsed_s']:.0f}s; dataset {fmt_size(dataset.bytes)})")
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.accelerator_bench",
        description="Largest number of emulated accelerators (MLPerf Storage's DLIO method) each reader keeps at AU >= 90%",
        epilog="examples:\n  python -m bench.accelerator_bench\n  python -m bench.accelerator_bench --quick --out /tmp/a.json\n"
               "  python -m bench.accelerator_bench --readers shardcache_warm,boto3 --trial-s 8",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--quick", action="store_true", help="CI smoke: 48 MiB, 1 s trials, N up to 2")
    parser.add_argument("--batch", type=int, default=40, help="samples per step (default 40; DLIO 400)")
    parser.add_argument("--compute-ms", type=float, default=22.4, help="sleep per step (default 22.4; DLIO 224)")
    parser.add_argument("--size", default=None, help="dataset size (default 1GiB, quick 48MiB)")
    parser.add_argument("--shard-size", default=None, help="shard size (default 32MiB, quick 8MiB)")
    parser.add_argument("--delay-ms", type=float, default=20.0, help="per-request latency at the store")
    parser.add_argument("--trial-s", type=float, default=None, help="bound on one trial (default 5, quick 1)")
    parser.add_argument("--max-n", type=int, default=None, help="largest N tried (default 64, quick 2)")
    parser.add_argument("--readers", default=",".join(READERS), help=f"comma-separated of: {','.join(READERS)}")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "accelerators.json", help="result JSON (.png beside)")
    parser.add_argument("--stock-moto", action="store_true",
                        help="moto as shipped (every ranged GET copies the whole object); default: a range costs the range")
    parser.add_argument("--note", default="", help="what else ran on the machine meanwhile (kept in the JSON)")
    parser.add_argument("--trial", nargs=2, metavar=("SPEC", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.trial:
        result = run_trial(json.loads(Path(args.trial[0]).read_text()))
        Path(args.trial[1]).write_text(json.dumps(result))
        return 0
    readers = tuple(r.strip() for r in args.readers.split(",") if r.strip())
    unknown = [r for r in readers if r not in READERS]
    if unknown or not readers:
        parser.error(f"--readers takes some of {', '.join(READERS)} (got {', '.join(unknown) or 'none'})")
    if args.batch < 1 or args.compute_ms <= 0:
        parser.error("--batch and --compute-ms must be positive")
    cfg = AccelConfig(
        batch=args.batch, compute_ms=args.compute_ms,
        size=parse_size(args.size or ("48MiB" if args.quick else "1GiB")),
        shard_bytes=parse_size(args.shard_size or ("8MiB" if args.quick else "32MiB")),
        delay_ms=args.delay_ms, trial_s=args.trial_s or (1.0 if args.quick else 5.0),
        min_steps=2 if args.quick else 4, max_n=args.max_n or (2 if args.quick else 64),
        readers=readers, quick=args.quick, stock_moto=args.stock_moto, timeout_s=60.0 if args.quick else 120.0,
        note=args.note,
    )
    run(cfg, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
