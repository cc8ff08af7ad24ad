"""Datasets larger than the cache (issue 32): LRU, ``hold`` and the master's plan, with real trainers
on the multi-host bed.

The bed is ``bench.clusterbed``'s (network namespaces on one bridge, the origin, moto, on a host of
its own behind a capped link) and the trainers are ``bench.locality_bench``'s: on every node
``--trainers-per-node`` processes, each a real :class:`loader.ShardLoader` in dynamic mode through
its node's daemon, all of one job on one ``shardcache master``, each step checked sample by sample
against the generator's digests, then an emulated compute step; a barrier between epochs. Every
epoch must deliver every sample exactly once across the trainers, whatever the policy.

The trainers together read at D bytes/s (batch x mean sample / step, times the trainers); the
origin's link is capped at ``--origin-share`` x D (default 0.6). The dataset is twice the cache:
with per-node caches twice one node's cache, with the cluster cache (daemons peering, one owner
per object) twice the cluster's. Every mode uses today's cache-aware leases (``locality_window``),
so they differ only in what the caches know:

- ``lru`` / ``hold``: the daemons' own policies (``--eviction``); the master guesses a shard is
  cached where its last reader ran;
- ``planned``: the daemons report what they hold to the master (``--master``) and take its plan:
  they prefetch the shards their trainers will be leased, in that order, and evict by Belady's rule
  over the master's known order (``--eviction planned``); the master's leases prefer shards
  reported held on the trainer's node.

The bound: an epoch must fetch from the origin at least the part of the dataset the caches
cannot hold, ``max(0, 1 - C / dataset)`` with C the caches' total (a job reads each shard once per
epoch across its nodes, so per-node caches count together once the master places reads where the
data is). Per epoch: stall fraction (the trainers' wait over their wall time), origin bytes over
the dataset beside the bound, hit rate, peer bytes, the order's mean displacement and rank
correlation from the master, and the master's per-node cache view when the daemons report.
Targets (issue 32): warm epochs stall below 5% with ``planned``; origin bytes per warm epoch
within 1.1x the bound; the displacement bounded by the window.

    sudo python -m bench.capacity_bench           # 4 nodes x 2 trainers, 6 modes, 4 epochs
    sudo python -m bench.capacity_bench --quick   # smoke

Writes ``bench/results/capacity.json`` and ``capacity.png``, and prints a README-ready table.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.clusterbed import DAEMON_PORT, Cluster, ClusterUnavailable, LinkMeter, check_available
from bench.common import RESULTS_DIR, fmt_size, in_workdir, log_line, machine_facts, parse_size, write_results
from bench.locality_bench import (
    BUCKET,
    JOB_SEED,
    PREFIX,
    Dataset,
    Master,
    Mode,
    Trainers,
    _check_epoch,
    _counters,
    _hit_rate,
    _locality,
    _stall,
    _uncommitted,
    build_dataset,
)
from wire.rendezvous import member_id
from wire.rendezvous import owner as rendezvous_owner

__all__ = ["POLICIES", "MODES", "TARGETS", "bound", "run", "markdown_table", "main"]

POLICIES = ("lru", "hold", "planned")
TARGETS = {"warm_stall_fraction": 0.05, "origin_over_bound": 1.1}


@dataclass(frozen=True)
class CapacityMode:
    name: str
    peers: bool
    policy: str

    @property
    def label(self) -> str:
        where = "cluster cache" if self.peers else "per-node caches"
        how = {"lru": "LRU", "hold": "hold", "planned": "master's plan"}[self.policy]
        return f"{where}, {how}"

    def locality_mode(self) -> Mode:
        """The trainers' view of the mode (``bench.locality_bench``): every mode leases by locality."""
        return Mode(self.name, peers=self.peers, aware=True, label=self.label)


MODES = {f"{'cluster' if peers else 'per_node'}_{policy}": CapacityMode(f"{'cluster' if peers else 'per_node'}_{policy}",
                                                                           peers, policy)
         for peers in (False, True) for policy in POLICIES}


def bound(cache_total: int, dataset: int) -> float:
    """The least origin bytes per epoch over the dataset: what the caches cannot hold."""
    return max(0.0, 1.0 - cache_total / dataset)


def _cache_bytes(mode: CapacityMode, dataset: int, nodes: int, over: float) -> int:
    """Each daemon's cache: the dataset is ``over`` x one node's cache, or the cluster's."""
    total = dataset / over
    return int(total / nodes) if mode.peers else int(total)


def _owned(cluster: Cluster, dataset: Dataset, daemon_urls: list[str]) -> dict[str, int]:
    """Per node, the shards the cluster cache's owner of each (rendezvous over the daemons, as they
    route) is: with ~100 shards over 4 nodes a node owns 17-41 of them, by the run's addresses
    (rendezvous hashing's own spread: over 2,000 random subnets the largest share averages 30.5,
    its 90th percentile 34), and one that owns more than its cache's share carries a larger share
    of the misses and of its peers' reads (what an epoch's per-node fills vary with from run to run)."""
    members = {member_id(url): host.role for url, host in zip(daemon_urls, cluster.hosts, strict=True)}
    counts = dict.fromkeys(members.values(), 0)
    ids = list(members)
    for shard in dataset.shards:
        owner = rendezvous_owner(ids, f"{BUCKET}/{PREFIX}{shard['key']}")
        if owner is not None:
            counts[members[owner]] += 1
    return counts


def run_mode(cluster: Cluster, mode: CapacityMode, dataset: Dataset, dataset_path: Path, workdir: Path,
             args: argparse.Namespace) -> dict[str, Any]:
    nodes = len(cluster.hosts)
    cache = _cache_bytes(mode, dataset.bytes, nodes, args.over)
    daemon_urls = [f"http://{host.address}:{DAEMON_PORT}" for host in cluster.hosts]
    # The master first: planned daemons report to it from their start.
    master = Master(cluster, workdir, mode.name, daemon_urls[:1] if mode.peers else [])
    trainers: Trainers | None = None
    assert cluster.origin_host is not None
    link = LinkMeter(workdir / f"link-{mode.name}.log").start(cluster.origin_host)
    try:
        extra = ["--eviction", mode.policy]
        if mode.policy == "planned":
            extra += ["--master", master.url]
        daemons = cluster.start_daemons(f"{cache}B", peers=mode.peers, extra=extra, name=mode.name)
        if mode.peers:
            cluster.wait_members(nodes)
            master.wait_ring(nodes)
        trainers = Trainers(cluster, workdir, mode.locality_mode(), master, dataset_path, args)
        trainers.wait(lambda r: any(x.get("ready") for x in r), timeout=120, what=f"the {mode.name} trainers to start")
        before = _counters(daemons)
        locality_before: dict[str, Any] | None = None
        epochs: list[dict[str, Any]] = []
        limit = bound(cache * nodes, dataset.bytes)
        for epoch in range(args.epochs):
            given = trainers.release(epoch)
            done = trainers.wait(lambda r, e=epoch: any(x.get("epoch") == e for x in r),
                                 timeout=args.epoch_timeout, what=f"the {mode.name} trainers' epoch {epoch + 1}")
            rows = {name: next(x for x in r if x.get("epoch") == epoch) for name, r in done.items()}
            for daemon in daemons:
                daemon.settle()
            after = _counters(daemons)
            delta = {role: {k: after[role][k] - before[role][k] for k in after[role]} for role in after}
            before = after
            status = master.job(trainers.job)
            locality = status.get("locality")
            check = _check_epoch(rows, dataset, mode.name, epoch)
            total = {k: sum(d[k] for d in delta.values()) for k in next(iter(delta.values()))}
            origin, peer = total["origin_read_bytes"], total["peer_read_bytes"]
            seconds = max(float(r["end"]) for r in rows.values()) - given
            stall = _stall(rows)
            over = origin / dataset.bytes
            ep: dict[str, Any] = {
                "epoch": epoch + 1, "seconds": round(seconds, 2), "origin_bytes": origin,
                "origin_over_dataset": round(over, 4), "bound": round(limit, 4),
                "origin_over_bound": round(over / limit, 3) if limit > 0 else None,
                # The origin's bytes over what its capped link could carry in the epoch's time (above
                # 1: fills went on after the trainers' epoch ended, prefetches of the next). A cold
                # epoch gets 0.87-0.89: TCP gets 0.96 of the cap through (bench.netbed), and the
                # epoch's first and last moments run no fill.
                "origin_over_link": round(origin / (cluster.origin_mbps * 1e6 / 8 * seconds), 3)
                if cluster.origin_mbps and seconds > 0 else None,
                # The same for each tenth of the epoch (the link's bytes sampled in the origin's
                # namespace): where the link idled while the trainers waited at the end.
                "link_by_tenth": link.busy_by_part(given, given + seconds, cluster.origin_mbps * 1e6 / 8)
                if cluster.origin_mbps else None,
                "peer_over_dataset": round(peer / dataset.bytes, 4), "hit_rate": _hit_rate(total),
                # Prefetched bytes the caches let go before anyone read them: origin bytes spent
                # twice (once for the prefetch, once for the read that came after it).
                "unread_hint_over_dataset": round(total["unread_hint_bytes"] / dataset.bytes, 4),
                "unread_plan_over_dataset": round(total["unread_plan_bytes"] / dataset.bytes, 4),
                "plan_filled_over_dataset": round(total["plan_filled_bytes"] / dataset.bytes, 4),
                "fills": total["fills"],
                "per_node": {role: {**d, "hit_rate": _hit_rate(d)} for role, d in delta.items()},
                # The interval each daemon reports to the master at (its last plan's), at the
                # epoch's end: shorter where the node's cache turns over fast (plan_interval).
                "report_interval_s": {d.host.role: (d.stats().get("master") or {}).get("interval_s") for d in daemons},
                "stall": stall, "check": check, "locality": _locality(locality_before, locality, epoch),
                "cache_view": status.get("cache"),
            }
            locality_before = locality
            epochs.append(ep)
            order = (ep["locality"] or {}).get("order") or {}
            log_line(f"{mode.name:18s} epoch {epoch + 1}: origin {fmt_size(origin)} ({over:.2f}x the dataset, bound "
                     f"{limit:.2f}; the link {ep['origin_over_link']} busy), peers {ep['peer_over_dataset']:.2f}x, {seconds:.1f} s, "
                     f"hit rate {ep['hit_rate']}, "
                     f"stall {stall['fraction']:.1%}, displacement {order.get('mean_displacement')}, fills {ep['fills']}, "
                     f"plan fills {ep['plan_filled_over_dataset']:.2f}x, evicted unread: hints "
                     f"{ep['unread_hint_over_dataset']:.2f}x, plan {ep['unread_plan_over_dataset']:.2f}x")
            if args.screenshot is not None and mode.policy == "planned" and epoch == max(0, args.epochs - 2):
                # Between the last two epochs (the next is not released yet, so no epoch's figures
                # pay for chromium): the plans are live and the last minute's waits are a warm
                # epoch's; at the job's end every plan is empty.
                _screenshot(master.url, args.screenshot)
        trainers.wait(lambda r: any(x.get("done") for x in r), timeout=60, what=f"the {mode.name} trainers to end")
        return {"label": mode.label, "peers": mode.peers, "policy": mode.policy, "cache_bytes_per_node": cache,
                "cache_bytes_total": cache * nodes, "bound": round(limit, 4), "epochs": epochs,
                "owned_shards": _owned(cluster, dataset, daemon_urls) if mode.peers else None}
    finally:
        if trainers is not None:
            trainers.stop()
        link.stop()
        master.stop()
        cluster.stop_daemons()


def _screenshot(url: str, path: Path) -> None:
    """The master's status page as it stands (the job's Cache panel, from the daemons' reports),
    by headless chromium; logged and skipped when there is none."""
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        log_line("no screenshot: chromium is not installed")
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    done = subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                           "--window-size=1200,1000", "--virtual-time-budget=4000", f"--screenshot={path}", url + "/"],
                          capture_output=True, text=True, timeout=120, check=False)
    log_line(f"screenshot of {url}/ -> {path}" if done.returncode == 0 and path.exists()
             else f"no screenshot (chromium exited {done.returncode}): {done.stderr[-300:]}")


def _targets(modes: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, mode in modes.items():
        warm = (mode.get("epochs") or [])[1:]
        if not warm:
            continue
        stall = max(e["stall"]["fraction"] for e in warm)
        out[f"{name}: warm stall < 5%"] = {"value": stall, "target": TARGETS["warm_stall_fraction"],
                                          "met": stall < TARGETS["warm_stall_fraction"], "policy": mode["policy"]}
        if mode["bound"] > 0:
            ratio = max(e["origin_over_dataset"] for e in warm) / mode["bound"]
            out[f"{name}: warm origin <= 1.1x the bound"] = {
                "value": round(ratio, 3), "target": TARGETS["origin_over_bound"],
                "met": ratio <= TARGETS["origin_over_bound"], "policy": mode["policy"]}
        else:
            value = max(e["origin_over_dataset"] for e in warm)
            out[f"{name}: warm origin / dataset (bound 0) <= 0.05"] = {
                "value": value, "target": 0.05, "met": value <= 0.05, "policy": mode["policy"]}
    return out


def run(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    started = time.monotonic()
    dataset = build_dataset(args.dataset_size, args.shard_size)
    dataset_path = workdir / "digests.json"
    dataset_path.write_text(json.dumps(dataset.digests))
    mean_sample = dataset.bytes / max(1, len(dataset.digests))
    trainers = args.nodes * args.trainers_per_node
    demand = trainers * args.batch * mean_sample / (args.compute_ms / 1000)
    origin_mbit = args.origin_share * demand * 8 / 1e6
    results: dict[str, Any] = {"benchmark": "capacity", "machine": machine_facts()}
    modes: dict[str, Any] = {}
    with Cluster(args.nodes, workdir / "bed", origin_mbps=origin_mbit) as cluster:
        cluster.start_origin()
        cluster.upload(BUCKET, dataset.objects)
        results["setup"] = {
            **cluster.facts(), "dataset_bytes": dataset.bytes, "shards": len(dataset.shards),
            "samples": len(dataset.digests), "dataset_over_cache": args.over, "epochs": args.epochs,
            "trainers": trainers, "trainers_per_node": args.trainers_per_node, "window": args.window,
            "batch": args.batch, "compute_ms": args.compute_ms, "job_seed": JOB_SEED,
            "demand_mb_per_s": round(demand / 1e6, 2), "origin_share": args.origin_share,
            "origin_mbit": round(origin_mbit, 1),
            "bound": "max(0, 1 - caches' total / dataset): what an epoch must fetch at least",
        }
        for name in args.modes:
            mode = MODES[name]
            log_line(f"{name}: {mode.label} ...")
            modes[name] = run_mode(cluster, mode, dataset, dataset_path, workdir, args)
    results["modes"] = modes
    results["targets"] = _targets(modes)
    results["machine"]["loadavg_end"] = os.getloadavg()
    results["machine"]["uncommitted"] = _uncommitted()
    results["elapsed_s"] = round(time.monotonic() - started, 1)
    results["command"] = "python -m bench.capacity_bench" + "".join(f" {a}" for a in (args.argv or []))
    return results


def _pct(value: Any) -> str:
    return "–" if value is None else f"{value * 100:.1f}%"


def markdown_table(results: dict[str, Any]) -> str:
    setup, machine = results["setup"], results["machine"]
    lines = [
        f"{setup['nodes']} nodes × {setup['trainers_per_node']} trainers reading {setup['demand_mb_per_s']:g} MB/s "
        f"together (D); origin capped at {setup['origin_share']:g} × D ({setup['origin_mbit']:g} Mbit/s); dataset "
        f"{fmt_size(setup['dataset_bytes'])} ({setup['shards']} shards) = {setup['dataset_over_cache']:g}× the cache "
        f"(one node's, or the cluster's); window {setup['window']}. {machine['cpu_count']} CPUs, git "
        f"{machine.get('git_revision')}, {machine['date']}.",
        "",
        "| caches, policy | epoch | stall | origin / dataset | bound | hit rate | peer / dataset | epoch s "
        "| mean displacement | Spearman |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for mode in results["modes"].values():
        for ep in mode["epochs"]:
            order = (ep.get("locality") or {}).get("order") or {}
            disp, rho = order.get("mean_displacement"), order.get("spearman")
            lines.append(
                f"| {mode['label']} | {ep['epoch']} | {_pct(ep['stall']['fraction'])} | {ep['origin_over_dataset']:.2f} "
                f"| {ep['bound']:.2f} | {_pct(ep['hit_rate'])} | {ep['peer_over_dataset']:.2f} | {ep['seconds']:.1f} "
                f"| {'–' if disp is None else f'{disp:.1f}'} | {'–' if rho is None else f'{rho:.3f}'} |")
    owned = next((m["owned_shards"] for m in results["modes"].values() if m.get("owned_shards")), None)
    if owned:
        lines += ["", "Cluster cache: shards each node owns (rendezvous over this run's addresses): "
                  + ", ".join(f"{node} {count}" for node, count in owned.items()) + "."]
    lines += ["", "| target | measured | target | met |", "|---|---:|---:|---|"]
    for name, check in results["targets"].items():
        value, target = check["value"], check["target"]
        pct = "stall" in name or "dataset" in name
        lines.append(f"| {name} | {_pct(value) if pct else f'{value:.2f}×'} | {_pct(target) if pct else f'{target:g}×'} "
                     f"| {'yes' if check['met'] else '**no**'} |")
    return "\n".join(lines)


def plot(results: dict[str, Any], path: Path) -> None:
    """Per mode and epoch: stall (left), origin bytes over the dataset with the bound (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = results["modes"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.2))
    width = 0.8 / max(1, len(modes))
    for i, mode in enumerate(modes.values()):
        xs = [e + i * width for e in range(len(mode["epochs"]))]
        left.bar(xs, [100 * ep["stall"]["fraction"] for ep in mode["epochs"]], width, label=mode["label"])
        bars = right.bar(xs, [ep["origin_over_dataset"] for ep in mode["epochs"]], width, label=mode["label"])
        right.hlines([mode["bound"]] * len(xs), [x - width / 2 for x in xs], [x + width / 2 for x in xs],
                     colors=[bars.patches[0].get_facecolor()], linestyles="--", linewidth=1.5)
    epochs = max((len(m["epochs"]) for m in modes.values()), default=0)
    for ax in (left, right):
        ax.set_xticks([e + 0.4 - width / 2 for e in range(epochs)], [f"epoch {e + 1}" for e in range(epochs)])
        ax.legend(fontsize=7)
    left.axhline(100 * TARGETS["warm_stall_fraction"], color="grey", lw=0.8, ls="--")
    left.set_ylabel("trainers' stall, % of wall time")
    right.set_ylabel("origin bytes / dataset (dashed: the bound)")
    setup = results["setup"]
    fig.suptitle(f"dataset {setup['dataset_over_cache']:g}× the cache, origin {setup['origin_share']:g} × the trainers' "
                 f"rate, {setup['nodes']} nodes × {setup['trainers_per_node']} trainers")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.capacity_bench", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smoke: 2 nodes, 32 MiB of 1 MiB shards, 2 epochs")
    parser.add_argument("--nodes", type=int, default=None, help="default 4 (quick 2)")
    parser.add_argument("--trainers-per-node", type=int, default=2)
    parser.add_argument("--dataset-size", type=parse_size, default=None, help="default 192MiB (quick 32MiB)")
    parser.add_argument("--shard-size", type=parse_size, default=None, help="default 2MiB (quick 1MiB)")
    parser.add_argument("--over", type=float, default=2.0, help="the dataset over the cache (default 2)")
    parser.add_argument("--epochs", type=int, default=None, help="default 4 (quick 2): two middle epochs, which keep for the next, and the last")
    parser.add_argument("--window", type=int, default=16, help="the job's locality_window (default 16)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--compute-ms", type=float, default=None, help="the emulated step (default 200; quick 80)")
    parser.add_argument("--queue-batches", type=int, default=4)
    parser.add_argument("--origin-share", type=float, default=0.6, help="the origin's link over D (default 0.6)")
    parser.add_argument("--epoch-timeout", type=float, default=300.0)
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    parser.add_argument("--out", type=Path, default=None, help="default bench/results/capacity.json (quick: none)")
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--keep", action="store_true")
    parser.add_argument("--screenshot", type=Path, default=None,
                        help="save the master's status page (headless chromium) between the last two epochs of "
                             "the last planned mode")
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    args.nodes = args.nodes or (2 if args.quick else 4)
    args.dataset_size = args.dataset_size or parse_size("32MiB" if args.quick else "192MiB")
    args.shard_size = args.shard_size or parse_size("1MiB" if args.quick else "2MiB")
    args.epochs = args.epochs if args.epochs is not None else (2 if args.quick else 4)
    args.compute_ms = args.compute_ms if args.compute_ms is not None else (80.0 if args.quick else 200.0)
    args.epoch_timeout = float(args.epoch_timeout)
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not args.modes or set(args.modes) - set(MODES):
        parser.error(f"--modes takes {', '.join(MODES)}")
    if args.over <= 1 or not 0 < args.origin_share <= 10 or args.epochs < 1:
        parser.error("--over must be > 1, --origin-share in (0, 10], --epochs >= 1")
    try:
        check_available()
    except ClusterUnavailable as exc:
        parser.error(str(exc))

    def go(workdir: Path) -> dict[str, Any]:
        results = run(args, workdir)
        out = args.out or (None if args.quick else RESULTS_DIR / "capacity.json")
        print(markdown_table(results), flush=True)
        if out is not None:
            write_results(out, results)
            try:
                plot(results, out.with_suffix(".png"))
            except Exception as exc:  # a missing matplotlib must not lose the measurements
                log_line(f"plot not drawn: {exc}")
            print(f"results: {out}", file=sys.stderr)
        return results

    in_workdir(args.workdir, "capacity-bench-", args.keep, go)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
