"""Cache-aware leases on the multi-host test bed (issue 18): per-node caches vs the cluster cache vs
the cluster cache with cache-aware leases, with real trainers.

The bed is ``bench.clusterbed``'s: four nodes (network namespaces on one bridge), the origin (moto)
on a host of its own behind a link cap (800 Mbit/s), one ``shardcache serve`` per node. The
dataset is twice one node's cache and half the cluster's (192 MiB of 2 MiB shards against 96 MiB
caches) and has a manifest, so the loader checks every shard's xxh3-128. On every node run two
trainer processes (``--trainers-per-node``), each a real :class:`loader.ShardLoader` in dynamic
mode reading through its node's daemon (``SHARDCACHE_NODE`` = the node's name), all of one job on
one lease master (``shardcache master``, sqlite state, in the root namespace on the bed's control
address: reachable from every host and not behind the origin's cap). Each trainer is the loop
users run with an emulated compute step so there is something to overlap: a thread reads the
loader into a queue of batches (a DataLoader's prefetch), the loop takes a batch, checks every
sample's bytes against the generator's digest (xxh3-64 of ``jpg|cls``), then sleeps
``--compute-ms`` (the accelerator's step). Its wait for the next batch is timed by
:class:`loader.stall.WaitMeter`. Between epochs every trainer waits at a barrier, so the daemons'
counters are read with nothing in flight and each epoch's figures are its own.

Modes (each on fresh daemons and a fresh master, the same job seed, so the same plain order):

- ``per_node``: daemons without peers (islands), ``locality_window`` 0;
- ``cluster``: daemons with peers and a secret, ``locality_window`` 0 (the plain seeded shuffle);
- ``cluster_aware``: daemons with peers, the master started with ``--cluster <a daemon>`` (it
  learns the ring), the job's ``locality_window`` set (``--window``, 16);
- ``per_node_aware``: islands, the window set: the "cached on" preference alone (the master
  knows no ring, only which node's trainer completed what).

One job for all trainers means every shard is read once per epoch in all, whatever the caches:
epoch 1 reads the dataset from the origin once even with per-node caches (the "about 4x" of
per-node caches is for every node reading the whole dataset, ``bench.cluster_bench``); per-node
caches lose from epoch 2 on, when a shard's next reader is on another node three times in four.

Per epoch: origin bytes / dataset (the daemons' ``origin_read_bytes`` deltas), peer bytes /
dataset (``peer_read_bytes``), the epoch's wall time, hit rates (``/stats`` ``requests``: a peer's
request counts on the daemon it asks too, and a read after its lease-ahead prefetch has filled the
shard is a hit), the trainers' stall (the job's share of their wall time spent waiting for a
batch, the epoch's end included, and the same without each trainer's first batch: the epoch's
start-up, all trainers at once), and the master's ``locality`` block (local share of the leases, displacement from the plain order,
Spearman's rank correlation). Every sample is checked, and every epoch must deliver every sample of
the dataset exactly once across all trainers. Targets (issue 18): epoch-1 origin <= 1.05x the
dataset, epoch-2 origin <= 5%, cache-aware peer bytes per epoch <= half the cluster cache's, warm
stall < 2%.

    sudo python -m bench.locality_bench            # 4 nodes x 2 trainers, 192 MiB, 3 epochs, 4 modes (~2 min)
    sudo python -m bench.locality_bench --quick    # smoke: 48 MiB of 1 MiB shards (~40 s)

Writes ``bench/results/locality.json`` (and ``locality.png``) with the machine facts and prints a
README-ready markdown table. Root and ``ip netns`` are needed (``bench.clusterbed.check_available``).
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import os
import queue
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xxhash

from bench.clusterbed import DAEMON_PORT, Cluster, ClusterUnavailable, Daemon, check_available, http_json, read_results
from bench.common import (
    REPO,
    RESULTS_DIR,
    fmt_size,
    free_port,
    in_workdir,
    log_line,
    machine_facts,
    make_samples,
    pack_shards,
    parse_size,
    spawn,
    stop_process,
    wait_until,
    write_results,
)

__all__ = ["MODES", "Mode", "TARGETS", "run", "run_trainer", "markdown_table", "main"]

BUCKET = "locality-bench"
PREFIX = "train/"
JOB_SEED = 7  # one seed for every mode: the same plain order, so the modes differ only in the lease choice


@dataclass(frozen=True)
class Mode:
    """How one run sets up the daemons, the master and the job."""

    name: str
    peers: bool
    """Daemons ``--peer`` each other (one cache per cluster)."""
    aware: bool
    """The job's ``locality_window`` is set (cache-aware leases)."""
    label: str

    @property
    def ring(self) -> bool:
        """The master polls a daemon's ``/_shardcache/peers`` (``shardcache master --cluster``):
        cache-aware leases over a cluster cache."""
        return self.peers and self.aware


MODES: dict[str, Mode] = {
    "per_node": Mode("per_node", peers=False, aware=False, label="per-node caches"),
    "cluster": Mode("cluster", peers=True, aware=False, label="cluster cache"),
    "cluster_aware": Mode("cluster_aware", peers=True, aware=True, label="cluster cache + cache-aware leases"),
    "per_node_aware": Mode("per_node_aware", peers=False, aware=True, label="per-node caches + cache-aware leases"),
}
DEFAULT_MODES = tuple(MODES)

TARGETS = {
    "epoch1_origin_over_dataset": 1.05,
    "epoch2_origin_over_dataset": 0.05,
    "aware_peer_over_cluster_peer": 0.5,
    "warm_stall_fraction": 0.02,
}


def _sample_digest(jpg: bytes, cls: bytes) -> str:
    return xxhash.xxh3_64_hexdigest(bytes(jpg) + b"|" + bytes(cls))


# -- the trainer (a child process inside a node) -------------------------------------------------


_END = object()


def _produce(loader: Any, batch: int, batches: queue.Queue[Any], stop: threading.Event, failure: list[BaseException]) -> None:
    """One epoch of ``loader`` into ``batches`` (the reading a DataLoader's workers do)."""

    def put(item: Any) -> bool:
        while not stop.is_set():
            with contextlib.suppress(queue.Full):
                batches.put(item, timeout=0.1)
                return True
        return False

    try:
        current: list[dict[str, Any]] = []
        for sample in loader:
            current.append(sample)
            if len(current) == batch:
                if not put(current):
                    return
                current = []
        if current:
            put(current)
    except BaseException as exc:  # noqa: BLE001 - the loop re-raises it
        failure.append(exc)
    finally:
        put(_END)


def _epoch(loader: Any, spec: dict[str, Any], digests: dict[str, str]) -> dict[str, Any]:
    """One epoch of the training loop: batches from the reader thread, each checked, then the step.
    ``meter`` is the bench's own figure of the epoch; ``loader.timed`` gives the same waits to the
    loader's meter, which reports them to the master."""
    from loader.stall import WaitMeter

    batches: queue.Queue[Any] = queue.Queue(maxsize=int(spec["queue_batches"]))
    stop = threading.Event()
    failure: list[BaseException] = []
    compute_s = float(spec["compute_ms"]) / 1000
    reader = threading.Thread(target=_produce, args=(loader, int(spec["batch"]), batches, stop, failure),
                              name="reader", daemon=True)

    def taken() -> Iterator[list[dict[str, Any]]]:
        while True:
            item = batches.get(timeout=float(spec["epoch_timeout"]))
            if item is _END:
                return
            yield item

    meter = WaitMeter(clock=time.monotonic)
    # The loader's waits (what the master's plans and the status page see) are the loop's, as a
    # DataLoader's would be, not the reading thread's: set before that thread starts iterating.
    timed_batches = loader.timed(taken())
    keys: list[str] = []
    bad: list[str] = []
    nbytes = steps = 0
    waits: list[tuple[float, float]] = []  # (when the loop asked, since the epoch's start; how long it waited)
    first_batch_s: float | None = None
    started = time.monotonic()
    last_step_end = started
    reader.start()
    try:
        asked = time.monotonic()
        for items in meter.timed(timed_batches):
            got = time.monotonic()
            waits.append((asked - started, got - asked))
            if first_batch_s is None:
                first_batch_s = got - started
            for sample in items:
                key = str(sample.get("__key__"))
                keys.append(key)
                jpg, cls = sample.get("jpg"), sample.get("cls")
                if jpg is None or cls is None or digests.get(key) != _sample_digest(jpg, cls):
                    bad.append(key)
                nbytes += len(jpg or b"") + len(cls or b"")
            time.sleep(compute_s)  # the accelerator's step
            steps += 1
            last_step_end = asked = time.monotonic()
    finally:
        stop.set()
        reader.join(30)
    ended = time.monotonic()
    if failure:
        raise failure[0]
    stats = meter.stats()
    wall = ended - started
    end_wait = ended - last_step_end  # after the last step: the epoch's end (others' last shards)
    stall = float(stats["seconds"])
    return {
        "end": ended, "wall_s": round(wall, 4), "steps": steps, "samples": len(keys),
        "payload_bytes": nbytes, "stall_s": round(stall, 4), "end_wait_s": round(end_wait, 4),
        "first_batch_s": round(first_batch_s, 4) if first_batch_s is not None else None,
        "longest_wait_s": round(max((w for _, w in waits), default=0.0), 4), "p99_wait_s": stats["p99_s"],
        "wait_by_tenth_s": _by_tenth(waits, wall),
        "bad": len(bad), "bad_keys": bad[:10], "keys": keys,
    }


def run_trainer(spec: dict[str, Any]) -> int:
    """The trainer: join the job, say ready, then each epoch at the orchestrator's go (a file)."""
    from loader import ShardLoader

    out = Path(spec["out"])

    def emit(row: dict[str, Any]) -> None:
        with open(out, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(row) + "\n")

    try:
        digests: dict[str, str] = json.loads(Path(spec["digests"]).read_text())
        extra: dict[str, Any] = {}
        if spec["locality_window"]:
            extra["locality_window"] = int(spec["locality_window"])
        loader = ShardLoader(spec["url"], job=spec["job"], master=spec["master"], endpoint=spec["endpoint"],
                             epochs=int(spec["epochs"]), seed=int(spec["seed"]), trainer=spec["trainer"], **extra)
        loader.shards  # noqa: B018 - the manifest is read before the clock starts
        emit({"ready": True, "node": loader.settings.node, "pid": os.getpid()})
        for epoch in range(int(spec["epochs"])):
            go = Path(spec["go"]) / f"go-{epoch}"
            wait_until(go.exists, timeout=float(spec["epoch_timeout"]) * (epoch + 1) + 120,
                       what=f"the orchestrator's go for epoch {epoch + 1}", interval=0.005)
            emit({"epoch": epoch, "trainer": spec["trainer"], **_epoch(loader, spec, digests)})
        loader.close()
        emit({"done": True})
        return 0
    except BaseException as exc:
        emit({"error": f"{type(exc).__name__}: {exc}"})
        raise


# -- the orchestrator ------------------------------------------------------------------------------


@dataclass
class Dataset:
    objects: dict[str, bytes]
    """What goes to the origin: the shards and ``manifest.json``."""
    shards: list[dict[str, Any]]
    digests: dict[str, str]
    """Sample key -> xxh3-64 of ``jpg|cls``, from the generator."""

    @property
    def bytes(self) -> int:
        return sum(int(s["size"]) for s in self.shards)


def build_dataset(total: int, shard_bytes: int, seed: int = 18) -> Dataset:
    digests: dict[str, str] = {}

    def recorded() -> Iterator[Any]:
        for sample in make_samples(total, seed=seed):
            digests[sample.key] = _sample_digest(sample.jpg, sample.cls)
            yield sample

    objects: dict[str, bytes] = {}
    shards = []
    for name, data, count in pack_shards(recorded(), shard_bytes):
        objects[PREFIX + name] = data
        shards.append({"key": name, "size": len(data), "xxh3_128": xxhash.xxh3_128_hexdigest(data), "samples": count})
    objects[PREFIX + "manifest.json"] = json.dumps({"version": 1, "format": "webdataset", "shards": shards}).encode()
    return Dataset(objects, shards, digests)


def _master_has_ring() -> bool:
    """Whether this checkout's master takes ``--cluster`` (issue 18's placement)."""
    done = subprocess.run([sys.executable, "-m", "sidecar.cli", "master", "--help"], capture_output=True, text=True,
                          timeout=60, check=False)
    return "--cluster" in done.stdout


def _loader_has_window() -> bool:
    from loader import ShardLoader

    return "locality_window" in inspect.signature(ShardLoader).parameters


def unsupported(mode: Mode) -> str | None:
    """Why this checkout cannot run ``mode`` (None: it can)."""
    if mode.aware and not _loader_has_window():
        return "ShardLoader takes no locality_window yet (issue 18's lease preference has not landed)"
    if mode.ring and not _master_has_ring():
        return "shardcache master takes no --cluster yet (issue 18's placement has not landed)"
    return None


class Master:
    """``shardcache master`` in the root namespace on the bed's control address (sqlite state)."""

    def __init__(self, cluster: Cluster, workdir: Path, name: str, ring: list[str]) -> None:
        port = free_port()
        self.url = f"http://{cluster.control_address}:{port}"
        self.log = workdir / f"master-{name}.log"
        args = [sys.executable, "-m", "sidecar.cli", "master", "--listen", f"tcp://{cluster.control_address}:{port}",
                "--state", f"sqlite:///{workdir / f'master-{name}.db'}"]
        for url in ring:
            args += ["--cluster", url]
        if ring:
            args += ["--cluster-poll", "1"]  # the ring within a second of the daemons' start
        self.proc = spawn(args, self.log)
        try:
            wait_until(lambda: self.proc.poll() is not None or bool(http_json(self.url + "/readyz").get("ready")),
                       timeout=60, what=f"the lease master (log: {self.log})")
            if self.proc.poll() is not None:
                raise RuntimeError(f"the lease master exited with {self.proc.returncode}:\n"
                                   f"{self.log.read_text(errors='replace')[-3000:]}")
        except BaseException:
            self.stop()
            raise

    def job(self, name: str) -> dict[str, Any]:
        data: dict[str, Any] = http_json(f"{self.url}/v1/jobs/{name}")
        return data

    def wait_ring(self, members: int, timeout: float = 30.0) -> dict[str, Any]:
        """Wait until the master holds the cluster's ring of ``members`` live members (its
        ``GET /v1/cluster``), so that the first epoch's leases are placed by it."""
        ring: dict[str, Any] = {}

        def placed() -> bool:
            ring.clear()
            ring.update(http_json(f"{self.url}/v1/cluster"))
            return len(ring.get("members") or []) == members

        wait_until(placed, timeout=timeout, interval=0.2,
                   what=f"the master to learn the ring of {members} members from --cluster (log: {self.log})")
        return ring

    def stop(self) -> None:
        stop_process(self.proc, timeout=10)


def _counters(daemons: list[Daemon]) -> dict[str, dict[str, int]]:
    out = {}
    for daemon in daemons:
        stats = daemon.stats()
        requests = stats.get("requests") or {}
        prefetch = stats.get("prefetch") or {}
        unread = (prefetch.get("evicted_unread") or {}).get("evicted_bytes") or {}
        plan = prefetch.get("plan") or {}
        cache = stats.get("cache") or {}
        out[daemon.host.role] = {
            "origin_read_bytes": int(stats.get("origin_read_bytes") or 0),
            "peer_read_bytes": int(stats.get("peer_read_bytes") or 0),
            "peer_served_bytes": int((stats.get("served_bytes") or {}).get("peer") or 0),
            "hits": int(requests.get("hits") or 0),
            "misses": int(requests.get("misses") or 0),
            "coalesced": int(requests.get("coalesced") or 0),
            # Fills finished (verified or not), what the plan's prefetches filled, and the bytes
            # of prefetches (a reader's hint, the plan) the cache let go before anyone read them.
            "fills": int(sum(((stats.get("verification") or {}).get("fills") or {}).values())),
            "plan_filled_bytes": int(plan.get("filled_bytes") or 0),
            "unread_hint_bytes": int(unread.get("hint") or 0),
            "unread_plan_bytes": int(unread.get("plan") or 0),
            # What became of the plan's prefetches (sidecar/daemon/prefetch.py), and the cache's
            # evictions and refusals (a fill with no room it may take: served uncached).
            **{f"plan_{k}": int(plan.get(k) or 0) for k in ("queued", "withdrawn", "filled", "no_room", "joined")},
            "evictions": int(cache.get("evictions") or 0),
            "rejected_full": int(cache.get("rejected_full") or 0),
        }
    return out


def _hit_rate(c: dict[str, int]) -> float | None:
    total = c["hits"] + c["misses"] + c["coalesced"]
    return round(c["hits"] / total, 4) if total else None


def _leases_delta(before: dict[str, Any] | None, after: dict[str, Any] | None) -> dict[str, int] | None:
    if after is None:
        return None
    now = after.get("leases") or {}
    then = (before or {}).get("leases") or {}
    return {k: int(now.get(k) or 0) - int(then.get(k) or 0) for k in now}


def _locality(before: dict[str, Any] | None, after: dict[str, Any] | None, epoch: int) -> dict[str, Any] | None:
    """The master's ``locality`` block for one epoch: its lease counts' delta, the share of them
    that were local, and the epoch's displacement and rank correlation."""
    if after is None:
        return None
    leases = _leases_delta(before, after) or {}
    total = sum(leases.values())
    local = leases.get("owner", 0) + leases.get("cached", 0)
    entry = next((e for e in after.get("epochs") or [] if e.get("epoch") == epoch), None)
    return {"window": after.get("window"), "leases": leases, "local_share": round(local / total, 4) if total else None,
            "local_share_job": after.get("local_share"), "order": entry}


class Trainers:
    """The trainer processes of one mode, ``per_node`` on every node."""

    def __init__(self, cluster: Cluster, workdir: Path, mode: Mode, master: Master, dataset_path: Path,
                 args: argparse.Namespace) -> None:
        self.go = workdir / f"go-{mode.name}"
        self.go.mkdir(parents=True, exist_ok=True)
        self.outs: dict[str, Path] = {}
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.job = f"locality-{mode.name}"
        for host in cluster.hosts:
            for j in range(args.trainers_per_node):
                name = f"{host.role}-t{j}"
                out = workdir / f"{mode.name}-{name}.jsonl"
                spec = {"url": f"s3://{BUCKET}/{PREFIX}", "job": self.job, "master": master.url,
                        "endpoint": f"http://{host.address}:{DAEMON_PORT}", "epochs": args.epochs, "seed": JOB_SEED,
                        "trainer": name, "locality_window": args.window if mode.aware else 0, "batch": args.batch,
                        "compute_ms": args.compute_ms, "queue_batches": args.queue_batches,
                        "epoch_timeout": args.epoch_timeout, "digests": str(dataset_path), "go": str(self.go),
                        "out": str(out)}
                spec_path = out.with_suffix(".spec.json")
                spec_path.write_text(json.dumps(spec))
                self.procs[name] = host.spawn([sys.executable, "-m", "bench.locality_bench", "--trainer", str(spec_path)],
                                              out.with_suffix(".log"), env={"SHARDCACHE_NODE": host.role})
                self.outs[name] = out

    def _rows(self, name: str) -> list[dict[str, Any]]:
        rows = read_results(self.outs[name])
        failed = [r for r in rows if "error" in r]
        proc = self.procs[name]
        if failed or (proc.poll() not in (None, 0)):
            log = self.outs[name].with_suffix(".log")
            tail = log.read_text(errors="replace")[-3000:] if log.exists() else ""
            raise RuntimeError(f"trainer {name} failed ({failed[:1] or f'exit {proc.returncode}'}):\n{tail}")
        return rows

    def wait(self, predicate: Any, timeout: float, what: str) -> dict[str, list[dict[str, Any]]]:
        """Wait (bounded) until every trainer's rows satisfy ``predicate``; a failed trainer raises."""
        rows: dict[str, list[dict[str, Any]]] = {}

        def ready() -> bool:
            rows.update({name: self._rows(name) for name in self.outs})
            return all(predicate(r) for r in rows.values())

        deadline = time.monotonic() + timeout
        while not ready():
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
            time.sleep(0.05)
        return rows

    def release(self, epoch: int) -> float:
        """The go for ``epoch``; returns when it was given (``time.monotonic``, shared by the trainers)."""
        at = time.monotonic()
        (self.go / f"go-{epoch}").touch()
        return at

    def stop(self) -> None:
        for proc in self.procs.values():
            stop_process(proc, timeout=10)


def _check_epoch(rows: dict[str, dict[str, Any]], dataset: Dataset, mode: str, epoch: int) -> dict[str, Any]:
    """Every sample's bytes right, and every sample delivered exactly once across the trainers."""
    seen = Counter(key for row in rows.values() for key in row["keys"])
    expected = set(dataset.digests)
    missing = sorted(expected - set(seen))
    duplicated = sorted(k for k, n in seen.items() if n > 1)
    unknown = sorted(set(seen) - expected)
    bad = sum(int(row["bad"]) for row in rows.values())
    check = {"samples": sum(seen.values()), "expected": len(expected), "bad_bytes": bad, "missing": len(missing),
             "duplicated": len(duplicated), "unknown": len(unknown)}
    if bad or missing or duplicated or unknown:
        first_bad: list[str] = next((row["bad_keys"][:3] for row in rows.values() if row["bad"]), [])
        raise RuntimeError(f"{mode} epoch {epoch + 1}: {check} (bad: {first_bad}, missing: {missing[:5]}, "
                           f"duplicated: {duplicated[:5]}, unknown: {unknown[:5]})")
    return check


def _by_tenth(waits: list[tuple[float, float]], wall: float) -> list[float]:
    """Seconds waited in each tenth of the epoch's wall time (a wait counts where it began)."""
    tenths = [0.0] * 10
    for at, waited in waits:
        tenths[min(9, int(10 * at / wall)) if wall > 0 else 0] += waited
    return [round(t, 3) for t in tenths]


def _stall(rows: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The job's stall: all its trainers' waits over all their wall time (the master's job-level
    share), and the same without each trainer's first batch (the epoch's start-up: a lease, an
    open, a first read, eight trainers at once on this machine's CPUs)."""
    wall = sum(float(r["wall_s"]) for r in rows.values())
    stall = sum(float(r["stall_s"]) for r in rows.values())
    first = sum(float(r["first_batch_s"] or 0) for r in rows.values())
    tenths = [r["wait_by_tenth_s"] for r in rows.values() if r.get("wait_by_tenth_s")]
    waited = sum(map(sum, tenths))
    return {
        "fraction": round(stall / wall, 4) if wall else None,
        "fraction_after_first_batch": round(max(0.0, stall - first) / wall, 4) if wall else None,
        "max_trainer_fraction": max((round(float(r["stall_s"]) / float(r["wall_s"]), 4)
                                     for r in rows.values() if float(r["wall_s"]) > 0), default=None),
        "mean_end_wait_s": round(sum(float(r["end_wait_s"]) for r in rows.values()) / len(rows), 3) if rows else None,
        "longest_wait_s": max((float(r["longest_wait_s"]) for r in rows.values()), default=None),
        "first_batch_s_max": max((float(r["first_batch_s"] or 0) for r in rows.values()), default=None),
        # Where in the epoch the trainers waited: each tenth's share of all their waits (a warm
        # epoch under Belady's rule opens with hits and ends with misses).
        "by_tenth": [round(sum(t) / waited, 3) for t in zip(*tenths, strict=True)] if waited > 0 else None,
    }


def run_mode(cluster: Cluster, mode: Mode, dataset: Dataset, dataset_path: Path, workdir: Path,
             args: argparse.Namespace) -> dict[str, Any]:
    daemons = cluster.start_daemons(args.cache_size, peers=mode.peers, name=mode.name)
    master: Master | None = None
    trainers: Trainers | None = None
    try:
        if mode.peers:
            cluster.wait_members(len(cluster.hosts))
        master = Master(cluster, workdir, mode.name, [daemons[0].url] if mode.ring else [])
        ring = master.wait_ring(len(cluster.hosts)) if mode.ring else None
        trainers = Trainers(cluster, workdir, mode, master, dataset_path, args)
        trainers.wait(lambda r: any(x.get("ready") for x in r), timeout=120, what=f"the {mode.name} trainers to start")
        before = _counters(daemons)
        locality_before: dict[str, Any] | None = None
        epochs: list[dict[str, Any]] = []
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
            ep: dict[str, Any] = {
                "epoch": epoch + 1, "seconds": round(seconds, 2),
                "origin_bytes": origin, "origin_over_dataset": round(origin / dataset.bytes, 4),
                "peer_read_bytes": peer, "peer_served_bytes": total["peer_served_bytes"],
                "peer_over_dataset": round(peer / dataset.bytes, 4),
                "hit_rate": _hit_rate(total), "requests": {k: total[k] for k in ("hits", "misses", "coalesced")},
                "per_node": {role: {**d, "hit_rate": _hit_rate(d)} for role, d in delta.items()},
                "stall": stall, "check": check,
                "locality": _locality(locality_before, locality, epoch),
                "trainers": {name: {k: v for k, v in r.items() if k not in ("keys", "bad_keys", "end")}
                             for name, r in rows.items()},
            }
            locality_before = locality
            epochs.append(ep)
            loc = ep["locality"] or {}
            log_line(f"{mode.name:14s} epoch {epoch + 1}: origin {fmt_size(origin)} ({ep['origin_over_dataset']:.2f}x the "
                 f"dataset), peers {fmt_size(peer)} ({ep['peer_over_dataset']:.2f}x), {seconds:.1f} s, hit rate "
                 f"{ep['hit_rate']}, stall {stall['fraction']:.1%} ({stall['fraction_after_first_batch']:.1%} "
                 f"after the first batch), local leases {loc.get('local_share')}")
        trainers.wait(lambda r: any(x.get("done") for x in r), timeout=60, what=f"the {mode.name} trainers to end")
        final = master.job(trainers.job)
        return {"label": mode.label, "peers": mode.peers, "locality_window": args.window if mode.aware else 0,
                "master_ring": {"cluster": [daemons[0].url], "poll_s": 1, "learned": ring} if mode.ring else None,
                "epochs": epochs,
                "master": {"finished": final.get("finished"), "totals": final.get("totals"),
                           "locality": final.get("locality")}}
    finally:
        if trainers is not None:
            trainers.stop()
        if master is not None:
            master.stop()
        cluster.stop_daemons()


def _targets(modes: dict[str, Any]) -> dict[str, Any]:
    """Each of issue 18's targets, measured where the run has what it needs (None: not run)."""
    out: dict[str, Any] = {}
    for name in ("cluster", "cluster_aware"):
        eps = (modes.get(name) or {}).get("epochs") or []
        if eps:
            value = eps[0]["origin_over_dataset"]
            out[f"{name}: epoch-1 origin / dataset <= 1.05"] = {
                "value": value, "target": TARGETS["epoch1_origin_over_dataset"],
                "met": value <= TARGETS["epoch1_origin_over_dataset"]}
        if len(eps) > 1:
            value = max(e["origin_over_dataset"] for e in eps[1:])
            out[f"{name}: epoch-2+ origin / dataset <= 5%"] = {
                "value": value, "target": TARGETS["epoch2_origin_over_dataset"],
                "met": value <= TARGETS["epoch2_origin_over_dataset"]}
    plain, aware = (modes.get("cluster") or {}).get("epochs"), (modes.get("cluster_aware") or {}).get("epochs")
    if plain and aware:
        ratios = [a["peer_read_bytes"] / p["peer_read_bytes"] if p["peer_read_bytes"] else None
                  for p, a in zip(plain, aware, strict=False)]
        worst = max((r for r in ratios if r is not None), default=None)
        out["cluster_aware peer bytes / cluster's, every epoch <= 0.5"] = {
            "value": round(worst, 4) if worst is not None else None, "per_epoch": [None if r is None else round(r, 4)
                                                                             for r in ratios],
            "target": TARGETS["aware_peer_over_cluster_peer"],
            "met": worst is not None and worst <= TARGETS["aware_peer_over_cluster_peer"]}
    for name, mode in modes.items():
        eps = mode.get("epochs") or []
        if len(eps) > 1:
            value = max(e["stall"]["fraction"] for e in eps[1:])
            out[f"{name}: warm stall < 2%"] = {
                "value": value, "after_first_batch": max(e["stall"]["fraction_after_first_batch"] for e in eps[1:]),
                "target": TARGETS["warm_stall_fraction"], "met": value < TARGETS["warm_stall_fraction"]}
    return out


def run(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    started = time.monotonic()
    dataset = build_dataset(args.dataset_size, args.shard_size)
    dataset_path = workdir / "digests.json"
    dataset_path.write_text(json.dumps(dataset.digests))
    results: dict[str, Any] = {"benchmark": "locality", "machine": machine_facts()}
    modes: dict[str, Any] = {}
    with Cluster(args.nodes, workdir / "bed", origin_mbps=args.origin_mbps, host_mbps=args.host_mbps) as cluster:
        cluster.start_origin()
        cluster.upload(BUCKET, dataset.objects)
        cache_bytes = parse_size(args.cache_size)
        step_bytes = args.batch * dataset.bytes / max(1, len(dataset.digests))
        results["setup"] = {
            **cluster.facts(),
            "dataset_bytes": dataset.bytes, "shards": len(dataset.shards), "samples": len(dataset.digests),
            "shard_bytes_target": args.shard_size, "cache_size": args.cache_size, "cache_bytes": cache_bytes,
            "dataset_over_cache": round(dataset.bytes / cache_bytes, 3),
            "dataset_over_cluster_cache": round(dataset.bytes / (cache_bytes * args.nodes), 3),
            "epochs": args.epochs, "trainers_per_node": args.trainers_per_node,
            "trainers": args.trainers_per_node * args.nodes, "job_seed": JOB_SEED, "window": args.window,
            "batch": args.batch, "compute_ms": args.compute_ms, "queue_batches": args.queue_batches,
            "trainer_demand_mb_per_s": round(step_bytes / (args.compute_ms / 1000) / 1e6, 2),
            "master": "shardcache master, sqlite state, in the root namespace on the bed's control address",
            "trainers_how": "a ShardLoader (dynamic mode, through the node's daemon, short-circuit reads) read by a "
                            "thread into a queue of batches; the loop checks each sample's xxh3-64, then sleeps "
                            "the compute step; its waits timed by loader.stall.WaitMeter; a barrier between epochs",
            "stall": "the job's share of the trainers' wall time spent waiting for a batch, the epoch's end "
                     "included; 'after first batch' leaves out each trainer's wait for its first batch",
            "local_leases": "per epoch: (owner + cached) / all leases the epoch handed out (the master's "
                            "locality counts); the master's own local_share leaves out the unplaced ones",
            "hit_rate": "daemon /stats requests: hits / (hits + misses + coalesced), peers' requests included; a "
                        "read after its lease-ahead prefetch filled the shard is a hit",
            "store": "moto server (own process, objects in RAM) on the origin host",
        }
        for name in args.modes:
            mode = MODES[name]
            reason = unsupported(mode)
            if reason is not None:
                log_line(f"{name}: skipped: {reason}")
                modes[name] = {"label": mode.label, "skipped": reason}
                continue
            log_line(f"{name}: {mode.label} ...")
            modes[name] = run_mode(cluster, mode, dataset, dataset_path, workdir, args)
    results["modes"] = modes
    results["targets"] = _targets({k: v for k, v in modes.items() if "skipped" not in v})
    results["summary"] = {
        name: {f"epoch{e['epoch']}": {"origin_over_dataset": e["origin_over_dataset"],
                                      "peer_over_dataset": e["peer_over_dataset"], "seconds": e["seconds"],
                                      "hit_rate": e["hit_rate"], "stall": e["stall"]["fraction"],
                                      "local_share": (e["locality"] or {}).get("local_share")}
               for e in mode["epochs"]}
        for name, mode in modes.items() if "skipped" not in mode
    }
    results["machine"]["loadavg_end"] = os.getloadavg()
    results["machine"]["uncommitted"] = _uncommitted()
    results["elapsed_s"] = round(time.monotonic() - started, 1)
    results["command"] = "python -m bench.locality_bench" + "".join(f" {a}" for a in (args.argv or []))
    return results


def _uncommitted() -> list[str] | None:
    """Files changed in the checkout beyond ``git_revision`` (what the figures also depend on)."""
    try:
        done = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO, capture_output=True,
                              text=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return [line[3:] for line in done.stdout.splitlines()] if done.returncode == 0 else None


# -- output ----------------------------------------------------------------------------------------


def _pct(value: Any) -> str:
    return "–" if value is None else f"{value * 100:.1f}%"


def _x(value: Any) -> str:
    return "–" if value is None else f"{value:.2f}×"


def markdown_table(results: dict[str, Any]) -> str:
    """The README's table: one row per mode and epoch, then the targets."""
    setup, machine = results["setup"], results["machine"]
    lines = [
        f"{setup['nodes']} nodes × {setup['trainers_per_node']} trainers, dataset {fmt_size(setup['dataset_bytes'])} "
        f"({setup['shards']} shards) = {setup['dataset_over_cache']:g}× one node's cache "
        f"({setup['cache_size']}), origin capped at {setup['origin']['link_mbit']:g} Mbit/s; trainer step "
        f"{setup['batch']} samples / {setup['compute_ms']:g} ms ({setup['trainer_demand_mb_per_s']:g} MB/s each); "
        f"window {setup['window']}. {machine['cpu_count']} CPUs, git {machine.get('git_revision')}, "
        f"{machine['date']}.",
        "",
        "| caches | epoch | origin / dataset | peer / dataset | epoch s | hit rate | stall (after 1st batch) "
        "| local leases | mean displacement | Spearman |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for mode in results["modes"].values():
        if "skipped" in mode:
            lines.append(f"| {mode['label']} | – | skipped: {mode['skipped']} | | | | | | | |")
            continue
        for ep in mode["epochs"]:
            loc = ep.get("locality") or {}
            order = loc.get("order") or {}
            disp = order.get("mean_displacement")
            rho = order.get("spearman")
            lines.append(
                f"| {mode['label']} | {ep['epoch']} | {_x(ep['origin_over_dataset'])} | {_x(ep['peer_over_dataset'])} "
                f"| {ep['seconds']:.1f} | {_pct(ep['hit_rate'])} | {_pct(ep['stall']['fraction'])} "
                f"({_pct(ep['stall']['fraction_after_first_batch'])}) | {_pct(loc.get('local_share'))} "
                f"| {'–' if disp is None else f'{disp:.1f}'} | {'–' if rho is None else f'{rho:.3f}'} |")
    lines += ["", "| target | measured | target | met |", "|---|---:|---:|---|"]
    for name, check in results["targets"].items():
        value, target = check["value"], check["target"]
        shown = _pct(value) if "stall" in name or "5%" in name else _x(value) if value is not None else "–"
        want = _pct(target) if "stall" in name or "5%" in name else f"{target:g}×"
        lines.append(f"| {name} | {shown} | {want} | {'yes' if check['met'] else '**no**'} |")
    return "\n".join(lines)


def plot(results: dict[str, Any], path: Path) -> None:
    """Origin and peer bytes per epoch and mode (bars), the stall beside them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = {k: v for k, v in results["modes"].items() if "skipped" not in v}
    epochs = max((len(m["epochs"]) for m in modes.values()), default=0)
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.2))
    width = 0.8 / max(1, len(modes))
    for i, (_name, mode) in enumerate(modes.items()):
        xs = [e + i * width for e in range(len(mode["epochs"]))]
        origin = [ep["origin_over_dataset"] for ep in mode["epochs"]]
        peer = [ep["peer_over_dataset"] for ep in mode["epochs"]]
        bars = left.bar(xs, origin, width, label=f"{mode['label']}: origin")
        left.bar(xs, peer, width, bottom=origin, color=bars.patches[0].get_facecolor(), alpha=0.4,
                 hatch="//", label=f"{mode['label']}: peers")
        right.bar(xs, [100 * ep["stall"]["fraction"] for ep in mode["epochs"]], width, label=mode["label"])
    for ax in (left, right):
        ax.set_xticks([e + 0.4 - width / 2 for e in range(epochs)], [f"epoch {e + 1}" for e in range(epochs)])
    left.axhline(1.05, color="grey", lw=0.8, ls="--")
    left.set_ylabel("bytes / dataset (solid: origin, hatched: peers)")
    left.legend(fontsize=7)
    right.axhline(2, color="grey", lw=0.8, ls="--")
    right.set_ylabel("trainers' stall, % of wall time")
    right.legend(fontsize=7)
    setup = results["setup"]
    fig.suptitle(f"{setup['nodes']} nodes × {setup['trainers_per_node']} trainers, dataset "
                 f"{setup['dataset_over_cache']:g}× a node's cache, origin {setup['origin']['link_mbit']:g} Mbit/s")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.locality_bench", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="smoke size: 24 MiB caches, 48 MiB dataset, 1 MiB shards, 60 ms steps, 2 epochs")
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--trainers-per-node", type=int, default=2)
    parser.add_argument("--cache-size", default=None, help="each daemon's --cache-size (default 96MiB; quick 24MiB)")
    parser.add_argument("--dataset-size", type=parse_size, default=None, help="default 192MiB (quick 48MiB)")
    parser.add_argument("--shard-size", type=parse_size, default=None, help="default 2MiB (quick 1MiB)")
    parser.add_argument("--epochs", type=int, default=None, help="default 3 (quick 2)")
    parser.add_argument("--window", type=int, default=16, help="the cache-aware modes' locality_window (default 16)")
    parser.add_argument("--batch", type=int, default=8, help="samples per trainer step (default 8)")
    parser.add_argument("--compute-ms", type=float, default=None, help="the emulated step (default 200; quick 60)")
    parser.add_argument("--queue-batches", type=int, default=4, help="batches a trainer reads ahead (default 4)")
    parser.add_argument("--origin-mbps", type=float, default=800.0, help="the origin host's link, Mbit/s (default 800)")
    parser.add_argument("--host-mbps", type=float, default=None, help="each node's link, Mbit/s (default: uncapped)")
    parser.add_argument("--epoch-timeout", type=float, default=300.0, help="seconds one epoch may take")
    parser.add_argument("--modes", default=",".join(DEFAULT_MODES),
                        help=f"comma-separated, of {', '.join(MODES)} (default {','.join(DEFAULT_MODES)}; a cache-aware "
                             "mode this checkout cannot run yet is skipped, with the reason in the results)")
    parser.add_argument("--out", type=Path, default=None,
                        help="results JSON, .png beside it (default bench/results/locality.json; with --quick none "
                             "unless given)")
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--keep", action="store_true", help="keep the workdir (daemon, master and trainer logs)")
    parser.add_argument("--trainer", metavar="SPEC", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.trainer:
        return run_trainer(json.loads(Path(args.trainer).read_text()))
    args.argv = list(sys.argv[1:] if argv is None else argv)
    args.cache_size = args.cache_size or ("24MiB" if args.quick else "96MiB")
    args.dataset_size = args.dataset_size or parse_size("48MiB" if args.quick else "192MiB")
    args.shard_size = args.shard_size or parse_size("1MiB" if args.quick else "2MiB")
    args.epochs = args.epochs if args.epochs is not None else (2 if args.quick else 3)
    args.compute_ms = args.compute_ms if args.compute_ms is not None else (60.0 if args.quick else 200.0)
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not args.modes or set(args.modes) - set(MODES):
        parser.error(f"--modes takes {', '.join(MODES)}")
    if args.epochs < 1 or args.trainers_per_node < 1 or args.batch < 1 or args.queue_batches < 1:
        parser.error("--epochs, --trainers-per-node, --batch and --queue-batches must be >= 1")
    if args.compute_ms <= 0 or not 0 <= args.window <= 65536:
        parser.error("--compute-ms must be > 0 and --window 0..65536")
    try:
        check_available()
    except ClusterUnavailable as exc:
        parser.error(str(exc))

    def go(workdir: Path) -> dict[str, Any]:
        results = run(args, workdir)
        out = args.out or (None if args.quick else RESULTS_DIR / "locality.json")
        print(markdown_table(results), flush=True)
        if out is not None:
            write_results(out, results)
            try:
                plot(results, out.with_suffix(".png"))
            except Exception as exc:  # a missing matplotlib must not lose the measurements
                log_line(f"plot not drawn: {exc}")
            print(f"results: {out}", file=sys.stderr)
        return results

    in_workdir(args.workdir, "locality-bench-", args.keep, go)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
