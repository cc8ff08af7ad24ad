"""What short-circuit by handle costs a warm epoch: the same shards, read by the loader from
descriptors passed over the daemon's handle socket (``serve --handles``, what Kubernetes pods
get), from the cached file's path (``x-shardcache-path``, the cache directory shared: what a
single-tenant node allows), and over HTTP, in the same run, from the same daemon.

    python -m bench.handles_bench            # 1 GiB in 64 MiB shards, 7 rounds (~2 min)
    python -m bench.handles_bench --quick    # CI-sized: 96 MiB in 16 MiB shards, 3 rounds (< 60 s)

The set-up: one ``shardcache serve --mode node`` process with a ``file://`` origin (the dataset
written by bench/common.py: JPEG-sized random samples in WebDataset tars, plus a manifest with
each shard's size, xxh3-128 and sample count), listening on TCP loopback (the loader's HTTP
endpoint, as a pod's ``http://127.0.0.1:8600``) and on ``--handles unix://...``. Before anything is
measured, every shard is read once over HTTP (the fills) and once by each variant (warm: cache
files in the page cache, connections open). Then, per round, each variant in turn (the order
rotated each round, so none always goes first and drift hits all three) reads every shard:

- ``read``: ``DaemonSource.open`` then ``read(1 MiB)`` to the end, every byte, no parsing: what
  the transport delivers;
- ``epoch``: a ``ShardLoader`` epoch (static, not shuffled, manifest checks on: size, xxh3-128,
  sample count), every sample's fields: what a trainer's data loop gets. Local files (handle and
  path) are read through a memory mapping there, HTTP bodies by ``read`` calls.

One reader thread, as one DataLoader worker. Each round is checked to be what it claims, from the
daemon's ``served_bytes``: a handle or path round takes no shard byte over HTTP (``short_circuit``
counts the answered objects' bytes), an HTTP round takes them all as ``hit``; a handle round's
descriptors are counted by the loader (``HandleClient.received``), a path round's readers are files
opened by path. Figures: MB/s (10^6 bytes per second) of shard bytes, samples/s for epochs, the
median time of one ``open`` (reads: what the control exchange costs each shard, whatever its
size), CPU seconds per GB of this process and of the daemon; the median over rounds; ratios
handle/path and handle/http of those medians, and the median of same-round ratios (``paired``).

Writes ``bench/results/handles.json`` (``handles-quick.json`` with ``--quick``) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

import xxhash

from bench.common import (
    RESULTS_DIR,
    cpu_seconds,
    fmt_size,
    in_workdir,
    machine_facts,
    make_samples,
    pack_shards,
    parse_size,
    write_results,
)
from bench.servers import ServeProcess, ServerExited
from loader import LoaderSettings, ShardLoader
from loader.dataset import parse_dataset_url
from loader.sources import DaemonSource

__all__ = ["VARIANTS", "MODES", "BenchError", "Dataset", "Daemon", "Round", "write_dataset", "measure", "summarize", "run", "main"]

BUCKET = "handlebench"
PREFIX = "train"
VARIANTS = ("handle", "path", "http")
MODES = ("read", "epoch")
READ_CHUNK = 1 << 20


class BenchError(RuntimeError):
    """A measurement that cannot be trusted (a round that did not read the way it is labelled)."""


def say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


# -- the dataset --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Dataset:
    url: str  # file:///<origin root>/<bucket>/<prefix>/
    origin: str  # file:///<origin root>
    keys: tuple[str, ...]
    sizes: tuple[int, ...]
    samples: int

    @property
    def bytes(self) -> int:
        return sum(self.sizes)


def write_dataset(root: Path, total_bytes: int, shard_bytes: int, seed: int) -> Dataset:
    """The shards under ``root/<bucket>/<prefix>/`` and their manifest (what ``shardcache index``
    writes: every shard's size, xxh3-128 and sample count), so the loader checks all it reads."""
    directory = root / BUCKET / PREFIX
    directory.mkdir(parents=True, exist_ok=True)
    entries: list[dict[str, Any]] = []
    for name, data, count in pack_shards(make_samples(total_bytes, seed), shard_bytes):
        (directory / name).write_bytes(data)
        entries.append({"key": name, "size": len(data), "xxh3_128": xxhash.xxh3_128_hexdigest(data), "samples": count})
    manifest = {"version": 1, "format": "webdataset", "shards": entries}
    (directory / "manifest.json").write_text(json.dumps(manifest))
    return Dataset(f"file://{directory}/", f"file://{root}", tuple(e["key"] for e in entries),
                   tuple(e["size"] for e in entries), sum(e["samples"] for e in entries))


# -- the daemon ---------------------------------------------------------------------------------


class Daemon(ServeProcess):
    """``python -m sidecar.cli serve --mode node`` on the dataset's origin: TCP loopback for HTTP,
    ``--handles`` on a unix socket in ``workdir``. Launched when made; :meth:`wait_ready` waits for
    it and its handle socket."""

    def __init__(self, workdir: Path, origin: str, cache_size: int) -> None:
        self.handles = workdir / "handles.sock"
        self.cache_dir = workdir / "cache"
        super().__init__(workdir / "daemon.log", [
            "--handles", f"unix://{self.handles}", "--origin", origin, "--cache-dir", str(self.cache_dir),
            "--cache-size", str(cache_size), "--min-free", "0",
        ], mode="node")
        self.launch()

    def ready(self) -> bool:
        return super().ready() and self.handles.exists()

    def wait_ready(self) -> Self:
        try:
            return super().wait_ready()
        except ServerExited as exc:
            raise BenchError(str(exc)) from None

    @property
    def command_line(self) -> str:
        return " ".join(str(a) for a in self.command()[1:])

    def served(self) -> dict[str, int]:
        return {k: int(v) for k, v in self.stats()["served_bytes"].items()}

    def settle(self, timeout: float = 120.0) -> None:
        """A reader can finish before its fill is published (fsync, rename): wait for that."""
        super().settle(timeout)


def settings_for(variant: str, daemon: Daemon) -> LoaderSettings:
    if variant == "handle":
        return LoaderSettings(endpoint=daemon.url, handles=f"unix://{daemon.handles}")
    if variant == "path":
        return LoaderSettings(endpoint=daemon.url)
    if variant == "http":
        return LoaderSettings(endpoint=daemon.url, short_circuit=False)
    raise ValueError(f"unknown variant {variant!r}")


# -- reads ------------------------------------------------------------------------------------


@dataclass
class Readers:
    """One variant's loader and source, made once and kept (kept-alive connections)."""

    variant: str
    loader: ShardLoader
    source: DaemonSource

    @classmethod
    def make(cls, variant: str, daemon: Daemon, dataset: Dataset) -> Readers:
        settings = settings_for(variant, daemon)
        loader = ShardLoader(dataset.url, shuffle=False, settings=settings)
        source = DaemonSource(parse_dataset_url(dataset.url), daemon.url, settings)
        return cls(variant, loader, source)

    def received(self) -> int:
        """Descriptors the variant's handle clients received so far (0 without a handle socket)."""
        total = 0
        for source in (self.source, self.loader._source()):
            handles = getattr(source, "_handles", None)
            total += handles.received if handles is not None else 0
        return total

    def close(self) -> None:
        self.loader.close()
        self.source.close()


@dataclass
class Round:
    variant: str
    mode: str
    seconds: float
    bytes: int
    samples: int
    cpu_s: dict[str, float] = field(default_factory=dict)
    open_s: list[float] = field(default_factory=list)  # read mode: each DaemonSource.open

    @property
    def mb_s(self) -> float:
        return self.bytes / self.seconds / 1e6

    @property
    def samples_s(self) -> float:
        return self.samples / self.seconds


def _self_cpu() -> float:
    times = os.times()
    return times.user + times.system


@dataclass
class _Pass:
    bytes: int = 0
    samples: int = 0
    kinds: list[str] = field(default_factory=list)  # read mode: the type of each reader opened
    open_s: list[float] = field(default_factory=list)

    def add(self, other: _Pass) -> None:
        self.bytes += other.bytes
        self.samples += other.samples
        self.kinds += other.kinds
        self.open_s += other.open_s


def _read_all(readers: Readers) -> _Pass:
    """Every shard through the source, fully. ``open_s``: what each open took (HTTP: until the
    answer's headers; handle: the request, the descriptor and its fstat; path: the HTTP answer
    and the open)."""
    done = _Pass()
    for shard in readers.loader.shards:
        began = time.perf_counter()
        reader = readers.source.open(shard)
        done.open_s.append(time.perf_counter() - began)
        done.kinds.append(type(reader).__name__)
        try:
            while chunk := reader.read(READ_CHUNK):
                done.bytes += len(chunk)
        finally:
            reader.close()
    return done


def _epoch(readers: Readers) -> _Pass:
    """One loader epoch (its shards' bytes, its samples); every field's length is touched."""
    samples = 0
    payload = 0
    for sample in readers.loader:
        samples += 1
        for name, value in sample.items():
            if not name.startswith("__"):
                payload += len(value)
    if not payload:
        raise BenchError(f"{readers.variant} epoch: no payload")
    return _Pass(sum(s.size or 0 for s in readers.loader.shards), samples)


def measure(readers: Readers, mode: str, daemon: Daemon, dataset: Dataset, passes: int = 1) -> Round:
    """``passes`` passes of ``mode`` over every shard by ``readers``, checked against the daemon's
    counts. CPU times tick in hundredths of a second: a round lasts long enough to count them."""
    served_before, received_before = daemon.served(), readers.received()
    cpu_before = cpu_seconds(daemon.proc.pid)
    client_before = _self_cpu()
    done = _Pass()
    began = time.perf_counter()
    for _ in range(passes):
        done.add((_read_all if mode == "read" else _epoch)(readers))
    seconds = time.perf_counter() - began
    cpu = {"client": round(_self_cpu() - client_before, 4), "daemon": round(cpu_seconds(daemon.proc.pid) - cpu_before, 4)}
    served, received = daemon.served(), readers.received() - received_before
    delta = {k: served[k] - served_before.get(k, 0) for k in served}
    check(readers.variant, mode, dataset, passes, done.bytes, done.samples, done.kinds, delta, received)
    return Round(readers.variant, mode, seconds, done.bytes, done.samples, cpu, done.open_s)


def check(variant: str, mode: str, dataset: Dataset, passes: int, got: int, samples: int, kinds: list[str],
          delta: dict[str, int], received: int) -> None:
    """That the round read every byte, and the way its variant names."""
    what = f"{variant} {mode} round"
    total = dataset.bytes * passes
    if got != total:
        raise BenchError(f"{what}: {got} bytes in {passes} pass(es) of a {dataset.bytes}-byte dataset")
    if mode == "epoch" and samples != dataset.samples * passes:
        raise BenchError(f"{what}: {samples} samples in {passes} pass(es) of a {dataset.samples}-sample dataset")
    over_http = delta.get("hit", 0) + delta.get("miss", 0) + delta.get("coalesced", 0)
    shards = len(dataset.keys) * passes
    if variant == "http":
        ok = delta.get("hit", 0) == total and not delta.get("short_circuit") and not received
        ok = ok and all(kind != "FileIO" for kind in kinds)
    else:
        ok = over_http == 0 and delta.get("short_circuit", 0) == total and all(kind == "FileIO" for kind in kinds)
        ok = ok and received == (shards if variant == "handle" else 0)
    if not ok:
        raise BenchError(f"{what} did not read as labelled: served bytes {delta}, {received} descriptors, "
                         f"readers {sorted(set(kinds))} (see the daemon's log)")


# -- the run ----------------------------------------------------------------------------------


def run_rounds(readers: dict[str, Readers], mode: str, rounds: int, passes: int, daemon: Daemon,
               dataset: Dataset) -> dict[str, list[Round]]:
    """``rounds`` rounds of every variant, the order rotated each round: each variant takes each
    place in turn, so what drifts during a round's sequence does not favour one of them."""
    results: dict[str, list[Round]] = {variant: [] for variant in VARIANTS}
    for index in range(rounds):
        order = VARIANTS[index % len(VARIANTS):] + VARIANTS[:index % len(VARIANTS)]
        for variant in order:
            results[variant].append(measure(readers[variant], mode, daemon, dataset, passes))
        say(f"  [{mode}] round {index + 1}/{rounds}: " + ", ".join(f"{v} {results[v][-1].mb_s:.0f} MB/s" for v in VARIANTS))
    return results


def _median(values: list[float]) -> float:
    return statistics.median(values)


def _row(runs: list[Round], mode: str) -> dict[str, Any]:
    row: dict[str, Any] = {
        "bytes_per_round": runs[0].bytes,
        "mb_s": round(_median([r.mb_s for r in runs]), 1),
        "rounds_mb_s": [round(r.mb_s, 1) for r in runs],
        "rounds_s": [round(r.seconds, 4) for r in runs],
        "cpu_s_per_gb": {name: round(_median([r.cpu_s[name] / (r.bytes / 1e9) for r in runs]), 4) for name in ("client", "daemon")},
    }
    if mode == "epoch":
        row["samples_per_round"] = runs[0].samples
        row["samples_s"] = round(_median([r.samples_s for r in runs]), 1)
    else:
        row["open_ms_p50"] = round(_median([_median(r.open_s) * 1000 for r in runs]), 3)
    return row


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 4) if b else None


def summarize(mode: str, passes: int, rounds: dict[str, list[Round]]) -> dict[str, Any]:
    """Per variant: its figures; ``ratios``: handle against path and against http (the medians'
    ratio, and ``paired``: the median of same-round ratios)."""
    variants = {variant: _row(runs, mode) for variant, runs in rounds.items()}
    ratios: dict[str, Any] = {}
    for other in ("path", "http"):
        pairs = [h.mb_s / o.mb_s for h, o in zip(rounds["handle"], rounds[other], strict=True) if o.mb_s]
        ratios[f"handle/{other}"] = {
            "mb_s": _ratio(variants["handle"]["mb_s"], variants[other]["mb_s"]),
            "paired": round(_median(pairs), 4) if pairs else None,
            "paired_rounds": [round(x, 4) for x in pairs],
            "cpu_s_per_gb": {name: _ratio(variants["handle"]["cpu_s_per_gb"][name], variants[other]["cpu_s_per_gb"][name])
                             for name in ("client", "daemon")},
        }
    return {"rounds": len(rounds["handle"]), "passes_per_round": passes, "variants": variants, "ratios": ratios}


def print_table(results: dict[str, Any]) -> None:
    rows: list[tuple[str, ...]] = [("mode", "figure", *VARIANTS, "handle/path", "handle/http")]
    for mode in MODES:
        summary = results[mode]
        v, r = summary["variants"], summary["ratios"]
        figures = [("MB/s", "mb_s"), ("samples/s", "samples_s") if mode == "epoch" else ("open p50 ms", "open_ms_p50")]
        for title, key in figures:
            cells = [f"{v[x][key]:.3f}" if key == "open_ms_p50" else f"{v[x][key]:.1f}" for x in VARIANTS]
            ratio = [f"{r[f'handle/{o}']['mb_s']:.3f}" if key == "mb_s" else "" for o in ("path", "http")]
            rows.append((mode, title, *cells, *ratio))
        rows.append((mode, "paired round ratio", "", "", "", *(f"{r[f'handle/{o}']['paired']:.3f}" for o in ("path", "http"))))
        for name in ("client", "daemon"):
            rows.append((mode, f"CPU s/GB {name}", *(f"{v[x]['cpu_s_per_gb'][name]:.3f}" for x in VARIANTS),
                         *(_fmt(r[f"handle/{o}"]["cpu_s_per_gb"][name]) for o in ("path", "http"))))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for index, row in enumerate(rows):
        print("  ".join(cell.ljust(w) if i < 2 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths, strict=True))))
        if index == 0:
            print("  ".join("-" * w for w in widths))


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.handles_bench",
        description="A warm epoch read by the loader from descriptors over the daemon's handle socket, from cache "
                    "paths, and over HTTP: same daemon, same data, interleaved rounds; MB/s, samples/s, CPU per GB, "
                    "ratios handle/path and handle/http. Writes bench/results/handles.json.",
        epilog="examples:\n  python -m bench.handles_bench --quick\n  python -m bench.handles_bench --size 4GiB --rounds 9",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--quick", action="store_true", help="CI-sized run (< 60 s)")
    parser.add_argument("--size", default=None, help="dataset payload (default 1GiB; 96MiB with --quick)")
    parser.add_argument("--shard-size", default=None, help="tar shard size (default 64MiB; 16MiB with --quick)")
    parser.add_argument("--rounds", type=int, default=None,
                        help="measured rounds per variant and mode (default 7; 3 with --quick); a multiple of 3 puts "
                             "each variant in each place of the order equally often")
    parser.add_argument("--round-seconds", type=float, default=None,
                        help="about how long the fastest variant's round lasts (default 1.0; 0.3 with --quick): "
                             "passes of the dataset per round are set to match")
    parser.add_argument("--seed", type=int, default=0, help="dataset seed")
    parser.add_argument("--workdir", type=Path, default=None, help="where the dataset, cache, socket and log go (default: a temp dir)")
    parser.add_argument("--keep", action="store_true", help="keep the work dir (the daemon's log)")
    parser.add_argument("--results-dir", type=Path, default=RESULTS_DIR, help="where the result file is written")
    args = parser.parse_args(argv)
    try:
        args.size = parse_size(args.size or ("96MiB" if args.quick else "1GiB"))
        args.shard_size = parse_size(args.shard_size or ("16MiB" if args.quick else "64MiB"))
    except ValueError as exc:
        parser.error(str(exc))
    args.rounds = args.rounds or (3 if args.quick else 7)
    args.round_seconds = args.round_seconds if args.round_seconds is not None else (0.3 if args.quick else 1.0)
    if min(args.size, args.shard_size, args.rounds, args.round_seconds) <= 0:
        parser.error("--size, --shard-size, --rounds and --round-seconds must be positive")
    return args


def run(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """Everything measured, in the shape of the result file (less the machine and the config)."""
    dataset = write_dataset(workdir / "origin", args.size, args.shard_size, args.seed)
    say(f"dataset: {len(dataset.keys)} shards, {fmt_size(dataset.bytes)}, {dataset.samples} samples")
    daemon = Daemon(workdir, dataset.origin, max(1 << 30, 2 * dataset.bytes))
    readers: dict[str, Readers] = {}
    try:
        daemon.wait_ready()
        readers = {variant: Readers.make(variant, daemon, dataset) for variant in VARIANTS}
        say("filling the cache over HTTP, then one unmeasured pass of each variant and mode")
        began = time.perf_counter()
        _read_all(readers["http"])
        cold_s = time.perf_counter() - began
        daemon.settle()
        passes: dict[str, int] = {}
        for mode in MODES:
            fastest = min(measure(readers[variant], mode, daemon, dataset).seconds for variant in VARIANTS)
            # The fastest variant's round lasts about --round-seconds (the others longer).
            passes[mode] = max(1, min(1000, math.ceil(args.round_seconds / max(fastest, 1e-6))))
        summaries = {}
        for mode in MODES:
            say(f"[{mode}] {args.rounds} rounds of {passes[mode]} pass(es) per variant")
            summaries[mode] = summarize(mode, passes[mode], run_rounds(readers, mode, args.rounds, passes[mode], daemon, dataset))
        stats = daemon.stats()
    finally:
        for reader in readers.values():
            reader.close()
        daemon.stop()
    return {**summaries, "dataset": {"shards": len(dataset.keys), "bytes": dataset.bytes, "samples": dataset.samples,
                                     "shard_bytes_max": max(dataset.sizes)},
            "cold_fill_s": round(cold_s, 3), "daemon_served_bytes": stats["served_bytes"], "daemon_command": daemon.command_line}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    began = time.monotonic()
    facts = machine_facts()
    measured = in_workdir(args.workdir, "shardcache-handles-bench-", args.keep, lambda workdir: run(args, workdir))
    facts["loadavg_end"] = os.getloadavg()
    results: dict[str, Any] = {
        "benchmark": "handles",
        "machine": facts,
        "config": {
            "quick": args.quick, "size": args.size, "shard_size": args.shard_size, "rounds": args.rounds,
            "round_seconds": args.round_seconds, "seed": args.seed,
            "daemon": measured.pop("daemon_command"),
            "variants": {
                "handle": "LoaderSettings(endpoint=<tcp>, handles=unix://<--handles socket>): descriptors over SCM_RIGHTS",
                "path": "LoaderSettings(endpoint=<tcp>): x-shardcache-path answers, the cache dir readable here",
                "http": "LoaderSettings(endpoint=<tcp>, short_circuit=False): bodies over TCP loopback",
            },
            "modes": {
                "read": f"DaemonSource.open + read({READ_CHUNK}) to the end, every shard",
                "epoch": "ShardLoader epoch (static, unshuffled, verify on), every sample",
            },
            "reader_threads": 1,
            "order": "rounds interleaved, the variants' order rotated each round",
            "statistic": "median over rounds; ratios of the medians; paired: median of same-round ratios",
            "mb": "10^6 bytes",
        },
        **measured,
        "elapsed_s": round(time.monotonic() - began, 1),
    }
    path = write_results(args.results_dir / ("handles-quick.json" if args.quick else "handles.json"), results)
    print(f"warm reads by handle, by path and over HTTP: {measured['dataset']['shards']} shards, "
          f"{fmt_size(measured['dataset']['bytes'])}, one reader thread, median of {args.rounds} interleaved rounds, "
          "MB = 10^6 B\n")
    print_table(results)
    print(f"\n{results['elapsed_s']:.0f}s; results: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
