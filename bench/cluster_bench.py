"""Per-node caches vs one cache per cluster (issue 17), on the multi-host test bed.

Four nodes (network namespaces on one bridge, ``bench.clusterbed``), the origin (moto) on a host
of its own behind a link cap, a dataset twice the size of one node's cache (192 MiB against
96 MiB). Every node reads the whole dataset in each of two epochs, all nodes at once, each in its
own shuffled order (a new one each epoch), through its own daemon; the reader checks every
object's xxh3-128. Two runs on the same bed and the same dataset:

- ``per_node``: daemons without peers, each an island (what shardcache did before issue 17);
- ``cluster``: the same daemons with ``--peer`` each other and a shared secret.

Per epoch it records the origin bytes over the dataset's size (the sum of the daemons'
``origin_read_bytes``), the bytes daemons read from peers and served to them, and the wall time.
Results go to ``bench/results/cluster.json`` with the machine facts.

    sudo python -m bench.cluster_bench            # 4 nodes, 96 MiB caches, 192 MiB dataset, 2 epochs
    sudo python -m bench.cluster_bench --quick    # 4 nodes, 24 MiB caches, 48 MiB dataset (smoke)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import xxhash

from bench.clusterbed import Cluster, ClusterUnavailable, Daemon, check_available, read_results
from bench.common import RESULTS_DIR, fmt_size, in_workdir, machine_facts, make_samples, pack_shards, parse_size, wait_until, write_results

__all__ = ["main", "run", "MODES"]

BUCKET = "cluster-bench"
PREFIX = "train/"
MODES = ("per_node", "cluster")


def _dataset(total: int, shard: int) -> dict[str, bytes]:
    return {f"{PREFIX}{name}": data for name, data, _ in pack_shards(make_samples(total, seed=5), shard)}


def _counters(daemons: list[Daemon]) -> dict[str, dict[str, int]]:
    out = {}
    for daemon in daemons:
        stats = daemon.stats()
        out[daemon.host.role] = {
            "origin_read_bytes": int(stats.get("origin_read_bytes") or 0),
            "peer_read_bytes": int(stats.get("peer_read_bytes") or 0),
            "peer_served_bytes": int((stats.get("served_bytes") or {}).get("peer") or 0),
        }
    return out


def _epoch(cluster: Cluster, objects: list[dict[str, Any]], workdir: Path, mode: str, epoch: int,
           timeout: float) -> tuple[float, int]:
    """Every node reads every object once, all at once; returns (seconds, bytes read)."""
    outs = {}
    started = time.monotonic()
    for i, host in enumerate(cluster.hosts):
        out = workdir / f"{mode}-e{epoch}-{host.role}.jsonl"
        cluster.start_reader(host, f"http://{host.address}:8600", BUCKET, objects, out, seed=100 * epoch + i)
        outs[host.role] = out

    def done() -> bool:
        return all((rows := read_results(out)) and rows[-1].get("done") for out in outs.values())

    wait_until(done, timeout=timeout, what=f"the {mode} readers of epoch {epoch + 1}", interval=0.1)
    elapsed = time.monotonic() - started
    total = 0
    for role, out in outs.items():
        rows = read_results(out)[:-1]
        bad = [r for r in rows if not r.get("ok")]
        if bad or len(rows) != len(objects):
            raise RuntimeError(f"{mode} epoch {epoch + 1} on {role}: {len(bad)} bad reads of {len(rows)} "
                               f"(first: {bad[:1]}); logs under {workdir}")
        total += sum(int(r["bytes"]) for r in rows)
    return elapsed, total


def run(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    dataset = _dataset(args.dataset_size, args.shard_size)
    objects: list[dict[str, Any]] = [{"key": key, "size": len(data), "xxh3_128": xxhash.xxh3_128_hexdigest(data)}
               for key, data in sorted(dataset.items())]
    dataset_bytes = sum(int(o["size"]) for o in objects)
    results: dict[str, Any] = {"benchmark": "cluster", "machine": machine_facts()}
    modes: dict[str, Any] = {}
    with Cluster(args.nodes, workdir / "bed", origin_mbps=args.origin_mbps, host_mbps=args.host_mbps,
                 origin_latency_ms=args.latency_ms) as cluster:
        cluster.start_origin()
        cluster.upload(BUCKET, dataset)
        results["setup"] = {
            **cluster.facts(),
            "dataset_bytes": dataset_bytes, "shards": len(objects), "shard_bytes_target": args.shard_size,
            "cache_size": args.cache_size, "cache_bytes": parse_size(args.cache_size),
            "dataset_over_cache": round(dataset_bytes / parse_size(args.cache_size), 3), "epochs": args.epochs,
            "reads": "every node reads every object each epoch, all nodes at once, each in its own shuffled order",
            "store": "moto server (own process, objects in RAM) on the origin host",
        }
        for mode in args.modes:
            daemons = cluster.start_daemons(args.cache_size, peers=mode == "cluster", name=mode)
            if mode == "cluster":
                cluster.wait_members(args.nodes)
            epochs: list[dict[str, Any]] = []
            before = _counters(daemons)
            for epoch in range(args.epochs):
                seconds, read = _epoch(cluster, objects, workdir, mode, epoch, args.epoch_timeout)
                for daemon in daemons:
                    daemon.settle()
                after = _counters(daemons)
                delta = {role: {k: after[role][k] - before[role][k] for k in after[role]} for role in after}
                before = after
                origin = sum(d["origin_read_bytes"] for d in delta.values())
                peer_in = sum(d["peer_read_bytes"] for d in delta.values())
                peer_out = sum(d["peer_served_bytes"] for d in delta.values())
                epochs.append({
                    "epoch": epoch + 1, "seconds": round(seconds, 2), "bytes_read_by_readers": read,
                    "origin_bytes": origin, "origin_over_dataset": round(origin / dataset_bytes, 3),
                    "peer_read_bytes": peer_in, "peer_served_bytes": peer_out,
                    "peer_over_dataset": round(peer_in / dataset_bytes, 3), "per_node": delta,
                })
                print(f"{mode:8s} epoch {epoch + 1}: origin {fmt_size(origin)} ({origin / dataset_bytes:.2f}x the "
                      f"dataset), peers {fmt_size(peer_in)} ({peer_in / dataset_bytes:.2f}x), {seconds:.1f} s", flush=True)
            cluster.stop_daemons()
            modes[mode] = {"peers": mode == "cluster", "epochs": epochs,
                           "origin_over_dataset_total": round(sum(e["origin_bytes"] for e in epochs) / dataset_bytes, 3)}
    results["modes"] = modes
    results["summary"] = {
        mode: {f"epoch{e['epoch']}_origin_over_dataset": e["origin_over_dataset"] for e in modes[mode]["epochs"]}
        | {f"epoch{e['epoch']}_peer_over_dataset": e["peer_over_dataset"] for e in modes[mode]["epochs"]}
        for mode in args.modes
    }
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.cluster_bench", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smoke size: 24 MiB caches, 48 MiB dataset, 1 MiB shards")
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--cache-size", default=None, help="each daemon's --cache-size (default 96MiB; quick 24MiB)")
    parser.add_argument("--dataset-size", type=parse_size, default=None, help="default 192MiB (quick 48MiB)")
    parser.add_argument("--shard-size", type=parse_size, default=None, help="default 2MiB (quick 1MiB)")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--origin-mbps", type=float, default=800.0, help="the origin host's link, Mbit/s (default 800)")
    parser.add_argument("--host-mbps", type=float, default=None, help="each node's link, Mbit/s (default: uncapped)")
    parser.add_argument("--latency-ms", type=float, default=0.0, help="per-request delay to the origin (default 0)")
    parser.add_argument("--epoch-timeout", type=float, default=300.0, help="seconds one epoch may take")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)} (default both)")
    parser.add_argument("--out", type=Path, default=None,
                        help="results JSON (default bench/results/cluster.json; with --quick none unless given)")
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--keep", action="store_true", help="keep the workdir (daemon and reader logs)")
    args = parser.parse_args(argv)
    args.cache_size = args.cache_size or ("24MiB" if args.quick else "96MiB")
    args.dataset_size = args.dataset_size or parse_size("48MiB" if args.quick else "192MiB")
    args.shard_size = args.shard_size or parse_size("1MiB" if args.quick else "2MiB")
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not args.modes or set(args.modes) - set(MODES):
        parser.error(f"--modes takes {', '.join(MODES)}")
    try:
        check_available()
    except ClusterUnavailable as exc:
        parser.error(str(exc))

    def go(workdir: Path) -> dict[str, Any]:
        results = run(args, workdir)
        out = args.out or (None if args.quick else RESULTS_DIR / "cluster.json")
        print(json.dumps(results["summary"], indent=2))
        if out is not None:
            write_results(out, results)
            print(f"results: {out}", file=sys.stderr)
        return results

    in_workdir(args.workdir, "cluster-bench-", args.keep, go)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
