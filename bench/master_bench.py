"""Master throughput: lease + complete round trips per second and their latency, 64 trainers.

Each trainer is an aiohttp client task that leases one shard and completes it, again and again
(one "round trip" = the two requests, each answered only once its change is durable). The
trainers run in ``--procs`` client processes next to one ``shardcache master`` process. Configs:

- ``sqlite``: the default store with group commit (``--max-batch 512``);
- ``sqlite-no-group-commit``: the same with ``--max-batch 1``, one fsync per change: the baseline
  the group commit is reported against;
- ``etcd``: the high-availability store on a local etcd (skipped when /usr/bin/etcd is missing).

Each config runs with two trainer clients: ``aiohttp`` (what a Python trainer would use) and
``raw`` (a minimal keep-alive HTTP/1.1 client on asyncio streams). On a 2-core machine the load
generator competes with the master for the CPUs; the raw client's much smaller cost per request
shows more of the master's own capacity. ``master us/rt`` is the master process's CPU time per
round trip, the figure least disturbed by other work on the machine.

Run: ``python -m bench.master_bench`` (``--quick`` for a short smoke run, about a minute). Prints a table and writes
``bench/results/master.json``. Target on the 2-core reference machine: >= 2,000 round trips/s on
SQLite with p99 < 50 ms.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from bench.common import RESULTS_DIR, machine_facts, write_results
from bench.servers import ETCD, EtcdServer, MasterProcess

__all__ = ["main"]


class _RawConnection:
    """A minimal keep-alive HTTP/1.1 client on asyncio streams: the load generator's own CPU cost
    per request is a fraction of aiohttp's, so on a 2-core machine more of the CPU is left to the
    master under test (which still speaks to it through aiohttp's server, unchanged)."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def post(self, path: str, body: bytes) -> tuple[int, bytes]:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        assert self.reader is not None
        self.writer.write(
            b"POST %s HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
            % (path.encode(), self.host.encode(), len(body), body)
        )
        head = await self.reader.readuntil(b"\r\n\r\n")
        status = int(head[9:12])
        length = 0
        for line in head.split(b"\r\n")[1:]:
            if line[:15].lower() == b"content-length:":
                length = int(line[15:])
        return status, await self.reader.readexactly(length)

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


async def _trainers(
    url: str, job: str, tasks: int, warmup_s: float, measure_s: float, offset: int, client: str = "aiohttp"
) -> dict[str, Any]:
    import urllib.parse

    import aiohttp

    latencies: list[float] = []
    waits = 0
    errors = 0
    total = 0
    start = time.perf_counter()
    measure_from = start + warmup_s
    measure_to = measure_from + measure_s
    parts = urllib.parse.urlsplit(url)
    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) if client == "aiohttp" else None

    async def trainer(idx: int) -> None:
        nonlocal waits, errors, total
        name = f"bench-{offset + idx}"
        lease_path = f"/v1/jobs/{job}/leases"
        body = json.dumps({"trainer": name, "node": f"node-{idx % 8}", "count": 1}).encode()
        done_body = json.dumps({"trainer": name}).encode()
        raw = _RawConnection(parts.hostname or "127.0.0.1", parts.port or 80) if session is None else None

        async def post(path: str, data: bytes) -> tuple[int, bytes]:
            if raw is not None:
                return await raw.post(path, data)
            assert session is not None
            async with session.post(url + path, data=data, headers={"Content-Type": "application/json"}) as resp:
                return resp.status, await resp.read()

        try:
            while True:
                t0 = time.perf_counter()
                if t0 >= measure_to:
                    return
                status, payload = await post(lease_path, body)
                if status != 200:
                    errors += 1
                    await asyncio.sleep(0.01)
                    continue
                answer = json.loads(payload)
                if answer["status"] != "ok":
                    waits += 1
                    await asyncio.sleep(min(answer.get("retry_after_s") or 0.01, 0.05))
                    continue
                lease = answer["leases"][0]["lease"]
                status, _ = await post(f"{lease_path}/{lease}/complete", done_body)
                t1 = time.perf_counter()
                total += 1
                if status != 200:
                    errors += 1
                elif measure_from <= t0 and t1 <= measure_to:
                    latencies.append(t1 - t0)
        finally:
            if raw is not None:
                await raw.close()

    try:
        await asyncio.gather(*(trainer(i) for i in range(tasks)))
    finally:
        if session is not None:
            await session.close()
    return {"latencies": latencies, "waits": waits, "errors": errors, "total": total}


def _client_proc(url: str, job: str, tasks: int, warmup_s: float, measure_s: float, offset: int, client: str, out: Any) -> None:
    import gc

    gc.set_threshold(20_000, 20, 20)  # the load generator's own GC pauses are not the master's latency
    out.put(asyncio.run(_trainers(url, job, tasks, warmup_s, measure_s, offset, client)))


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far (Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run_config(name: str, state: str, extra: list[str], client: str, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    import urllib.request

    master = MasterProcess(workdir / f"master-{name}.log", state, extra, cli_args=["--log-level", "WARNING"], advertise=True)
    url = master.url
    with master:
        job = "bench-" + uuid.uuid4().hex[:6]
        spec = {"name": job, "dataset": "s3://bench/train/", "seed": 1, "lease_ttl_s": 60,
                "shards": [{"key": f"train-{i:06d}.tar", "size": 1 << 20, "samples": 100} for i in range(args.shards)]}
        req = urllib.request.Request(url + "/v1/jobs", data=json.dumps(spec).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as resp:
            assert resp.status == 201
        queue: Any = mp.get_context("spawn").Queue()
        cpu_before = _cpu_s(master.pid)
        per_proc = [args.trainers // args.procs + (1 if i < args.trainers % args.procs else 0) for i in range(args.procs)]
        procs = []
        offset = 0
        for tasks in per_proc:
            proc = mp.get_context("spawn").Process(
                target=_client_proc, args=(url, job, tasks, args.warmup, args.seconds, offset, client, queue)
            )
            proc.start()
            procs.append(proc)
            offset += tasks
        results = [queue.get(timeout=args.warmup + args.seconds + 120) for _ in procs]
        master_cpu = _cpu_s(master.pid) - cpu_before
        for proc in procs:
            proc.join(30)
        latencies = [x for r in results for x in r["latencies"]]
        with urllib.request.urlopen(f"{url}/v1/jobs/{job}", timeout=10) as resp:
            status = json.load(resp)
    return {
        "config": name,
        "client": client,
        "state": state.split("://")[0],
        "extra_flags": extra,
        "round_trips": len(latencies),
        "round_trips_per_s": round(len(latencies) / args.seconds, 1),
        "p50_ms": round(_percentile(latencies, 0.50) * 1000, 2),
        "p99_ms": round(_percentile(latencies, 0.99) * 1000, 2),
        "max_ms": round(max(latencies, default=float("nan")) * 1000, 2),
        "waits": sum(r["waits"] for r in results),
        "errors": sum(r["errors"] for r in results),
        "completed_total": status["totals"]["completed"],
        "master_cpu_us_per_round_trip": round(1e6 * master_cpu / max(1, sum(r["total"] for r in results)), 1),
        "loadavg_after": os.getloadavg(),
        "epochs_total": status["totals"]["epochs"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.master_bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trainers", type=int, default=64, help="concurrent trainers (client tasks)")
    parser.add_argument("--procs", type=int, default=1,
                        help="client processes the trainers are spread over (1 leaves the other core to the master)")
    parser.add_argument("--clients", default="aiohttp,raw",
                        help="trainers' HTTP clients to run each config with: aiohttp, and/or raw (a minimal "
                        "keep-alive client that leaves more of the 2 CPUs to the master under test)")
    parser.add_argument("--seconds", type=float, default=10.0, help="measured seconds per config")
    parser.add_argument("--warmup", type=float, default=2.0, help="unmeasured seconds before")
    parser.add_argument("--shards", type=int, default=10_000, help="shards in the job (epochs roll over)")
    parser.add_argument("--configs", default="sqlite,sqlite-no-group-commit,etcd", help="comma-separated configs")
    parser.add_argument("--quick", action="store_true", help="short smoke run (3 s per config)")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "master.json")
    args = parser.parse_args(argv)
    if args.quick:
        args.seconds, args.warmup = 3.0, 1.0
    workdir = Path(tempfile.mkdtemp(prefix="master-bench-"))
    rows: list[dict[str, Any]] = []
    skipped: dict[str, str] = {}
    clients = [c.strip() for c in args.clients.split(",") if c.strip()]
    if not clients or set(clients) - {"aiohttp", "raw"}:
        parser.error("--clients takes aiohttp and/or raw")
    try:
        for config in [c.strip() for c in args.configs.split(",") if c.strip()]:
            for client in clients:
                state = f"sqlite://{workdir}/{config}-{client}/master.db"
                if config == "sqlite":
                    rows.append(run_config(config, state, ["--max-batch", "512"], client, args, workdir))
                elif config == "sqlite-no-group-commit":
                    rows.append(run_config(config, state, ["--max-batch", "1"], client, args, workdir))
                elif config == "etcd":
                    if not os.path.exists(ETCD):
                        skipped[config] = f"{ETCD} missing (apt-get install etcd-server)"
                        continue
                    with EtcdServer(workdir / client, binary=ETCD, data_dir="etcd") as etcd:
                        rows.append(run_config(config, f"etcd://127.0.0.1:{etcd.port}/bench", ["--max-batch", "512"],
                                               client, args, workdir))
                else:
                    parser.error(f"unknown config {config!r}")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    for row in rows:
        baseline = next((r for r in rows if r["config"] == "sqlite-no-group-commit" and r["client"] == row["client"]), None)
        row["vs_no_group_commit"] = (
            round(row["round_trips_per_s"] / baseline["round_trips_per_s"], 2)
            if baseline and baseline["round_trips_per_s"] else None
        )
    header = (f"{'config':<24} {'client':<8} {'round trips/s':>14} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8} "
              f"{'x baseline':>10} {'master us/rt':>12} {'errors':>6}")
    print(f"master: lease+complete round trips, {args.trainers} trainers in {args.procs} process(es), {args.seconds:g} s each")
    print(header)
    print("-" * len(header))
    for row in rows:
        ratio = f"{row['vs_no_group_commit']:.2f}" if row["vs_no_group_commit"] is not None else "-"
        print(f"{row['config']:<24} {row['client']:<8} {row['round_trips_per_s']:>14,.0f} {row['p50_ms']:>8.2f} "
              f"{row['p99_ms']:>8.2f} {row['max_ms']:>8.1f} {ratio:>10} {row['master_cpu_us_per_round_trip']:>12.0f} "
              f"{row['errors']:>6}")
    for config, why in skipped.items():
        print(f"{config:<24} skipped: {why}")
    target: dict[str, Any] = {"round_trips_per_s": 2000, "p99_ms": 50}
    for row in rows:
        if row["config"] == "sqlite":
            met = row["round_trips_per_s"] >= 2000 and row["p99_ms"] < 50
            target[f"met_{row['client']}"] = met
            print(f"target (sqlite >= 2,000/s, p99 < 50 ms) with the {row['client']} client: {'met' if met else 'NOT met'}")
    path = write_results(args.out, {
        "benchmark": "master",
        "what": "lease+complete round trips (2 durable requests each) with concurrent trainers",
        "params": {"trainers": args.trainers, "procs": args.procs, "seconds": args.seconds, "warmup": args.warmup,
                   "shards": args.shards, "clients": clients},
        "machine": machine_facts(),
        "results": rows,
        "skipped": skipped,
        "target": target,
    })
    load = os.getloadavg()[0]
    if load > (os.cpu_count() or 1):
        print(f"note: load average {load:.1f} on {os.cpu_count()} CPUs: other work competed for the CPUs during this run")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
