"""Master memory: what one 1,000,000-shard job costs the master, created, trained and deleted.

Starts a real ``shardcache master`` (SQLite state in a temp dir) and samples its memory from
``/proc/<pid>/status`` (``VmRSS``, and ``VmHWM``: the kernel's own peak) at each phase's end:

1. ``idle``: the master ready, no job;
2. ``created``: a job of ``--shards`` realistic shards (keys like
   ``imagenet/train/shard-000123.tar``, sizes ~1e8, ~1000 samples; ~70 MB of JSON, two epochs)
   created the way a trainer does, through ``MasterClient.create_job`` (gzip, ~12 MB on the
   wire), then joined the same way (by digest: no shard list sent);
   ``settled``: a one-shard job created after it (what the master holds once other writes
   followed the create's);
3. ``joined``: ``--joins`` concurrent creates of the same spec sent as plain JSON (what an old
   client sends): each is compared with the job as it streams by, nothing kept;
4. ``epoch`` (the headline): epoch 0 trained the way trainers train: ``--conns`` trainers, each
   holding at most ``--lease-batch`` leases: lease that many, complete them (over
   ``--complete-conns`` connections in all), lease again, until the epoch is done;
5. ``leased`` (the worst case): every shard of epoch 1 leased at once, 1024 a request, before
   any is completed (a trainer that leases without reading, or ``--conns`` trainers that each
   lease a million shards' worth);
6. ``completed``: every one of those leases completed (one request each): the job is finished;
7. ``restarted`` (``--restart``): the master stopped and started again on the same state: what
   loading the snapshot and replaying the log cost;
8. ``deleted``: ``DELETE /v1/jobs/{job}``: what is left once the job is gone.

The job's cost is RSS at a phase minus RSS when idle. RSS also counts memory the allocator keeps
after it was freed, so the live bytes are measured in this process too, under ``tracemalloc``:
the same body parsed by ``SpecStream`` (the spec's columns and compressed text, and the parse's
peak), and the state machine driven directly with the same job (created, an epoch with bounded
leases, an epoch leased at once and completed: the lease state's live bytes).

Run: ``python -m bench.master_memory`` (1M shards: the creates take seconds, the two million
completions minutes) or ``--quick`` (100k shards, no restart unless ``--restart``: about a
minute). Prints a table and writes ``bench/results/master-memory.json``, whose ``headline``
(the ``epoch`` phase) and ``worst_case`` (the ``leased`` phase) say which figure is which.
Target: a 1M-shard job created, leased and completed costs the master under 300 MB.
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import json
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import tracemalloc
import urllib.request
from pathlib import Path
from typing import Any

from bench.common import REPO, RESULTS_DIR, RssSampler, free_port, http_ok, machine_facts, spawn, stop_process, wait_until, write_results
from bench.master_bench import _RawConnection

__all__ = ["main"]

_MIB = 1024 * 1024
_TARGET_BYTES = 300 * 1000 * 1000  # "under 300 MB"


def make_spec(name: str, shards: int, seed: int = 1) -> dict[str, Any]:
    """A job spec as a trainer builds it: every field set, realistic keys, sizes and counts."""
    rng = random.Random(seed)
    return {
        "name": name, "dataset": "s3://datasets/imagenet/", "epochs": 2, "seed": 7, "shuffle": True,
        "lease_ttl_s": 3600, "max_failures": 3,
        "shards": [
            {"key": f"imagenet/train/shard-{i:06d}.tar", "size": rng.randint(80_000_000, 120_000_000),
             "samples": rng.randint(900, 1100)}
            for i in range(shards)
        ],
    }


def _status_kib(pid: int) -> dict[str, int]:
    out = {}
    with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as handle:
        for line in handle:
            name, _, rest = line.partition(":")
            if name in ("VmRSS", "VmHWM"):
                out[name] = int(rest.split()[0])
    return out


class _Scraper:
    """GETs the master's ``/metrics`` every ``interval_s`` on a thread, as Prometheus does where the
    chart's ServiceMonitor is on (every 30 s by default): a scrape reads every job's status."""

    def __init__(self, url: str, interval_s: float) -> None:
        self.url, self.interval_s = url, interval_s
        self.scrapes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="scraper", daemon=True)

    def start(self) -> None:
        if self.interval_s > 0:
            self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                with urllib.request.urlopen(self.url + "/metrics", timeout=60) as resp:
                    resp.read()
                self.scrapes += 1
            except OSError:
                pass  # restarting: the next scrape finds it again

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(70)


class _Master:
    def __init__(self, workdir: Path, extra_env: dict[str, str], *, trim: bool = True, tune: bool = True) -> None:
        self.workdir = workdir
        self.env = extra_env
        # What the allocator tuning of loader.master.server.app gives, measured by switching it
        # off in the master process (its functions replaced before it starts).
        off = [name for name, on in (("trim_allocator", trim), ("tune_allocator", tune)) if not on]
        self.launcher = ["-m", "sidecar.cli"] if not off else [
            "-c", "import sys; import loader.master.server.app as app; "
            + "; ".join(f"app.{name} = lambda: False" for name in off)
            + "; from sidecar.cli.dispatch import main; sys.exit(main(sys.argv[1:]))",
        ]
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.proc = spawn(
            [sys.executable, *self.launcher, "--log-level", "WARNING", "master", "--listen",
             f"tcp://127.0.0.1:{self.port}", "--state", f"sqlite://{self.workdir}/master.db", "--advertise-url", self.url],
            self.workdir / "master.log", self.env,
        )
        wait_until(lambda: self._alive() and http_ok(self.url + "/readyz"), timeout=600, what="the master", interval=0.2)

    def _alive(self) -> bool:
        if self.proc is not None and self.proc.poll() is not None:
            raise RuntimeError(f"the master exited: {(self.workdir / 'master.log').read_text()[-2000:]}")
        return True

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc, timeout=120)
            self.proc = None


def _host_port(url: str) -> tuple[str, int]:
    host, port = url.rsplit("//", 1)[1].split(":")
    return host, int(port)


async def _complete(conn: _RawConnection, job: str, trainer: str, leases: list[str]) -> None:
    body = json.dumps({"trainer": trainer}).encode()
    for lease in leases:
        status, payload = await conn.post(f"/v1/jobs/{job}/leases/{lease}/complete", body)
        if status != 200:
            raise RuntimeError(f"complete answered {status}: {payload[:300]!r}")


async def _train_epoch(url: str, job: str, epoch: int, trainers: int, batch: int, conns_each: int) -> dict[str, int]:
    """Epoch ``epoch`` trained as trainers train: each of ``trainers`` holds at most ``batch``
    leases (leases them, completes them over ``conns_each`` connections, leases again) until the
    master answers ``epoch_done``. Returns the leases and lease requests made."""
    host, port = _host_port(url)
    totals = {"leases": 0, "requests": 0, "most_held": 0}

    async def trainer(idx: int) -> None:
        name = f"trainer-{idx}"
        lease_conn = _RawConnection(host, port)
        conns = [_RawConnection(host, port) for _ in range(conns_each)]
        body = json.dumps({"trainer": name, "node": f"node-{idx % 4}", "count": batch, "epoch": epoch, "wait_s": 1}).encode()
        try:
            while True:
                status, payload = await lease_conn.post(f"/v1/jobs/{job}/leases", body)
                if status != 200:
                    raise RuntimeError(f"lease answered {status}: {payload[:300]!r}")
                answer = json.loads(payload)
                totals["requests"] += 1
                if answer["status"] == "epoch_done":
                    return
                leases = [lease["lease"] for lease in answer["leases"]]
                if answer["status"] != "ok" or not leases:
                    continue  # "wait" (long-polled): others hold the epoch's last leases
                totals["leases"] += len(leases)
                totals["most_held"] = max(totals["most_held"], len(leases))
                await asyncio.gather(*(_complete(c, job, name, leases[k::conns_each]) for k, c in enumerate(conns)))
        finally:
            for conn in (lease_conn, *conns):
                await conn.close()

    await asyncio.gather(*(trainer(i) for i in range(trainers)))
    return totals


async def _lease_all(url: str, job: str, conns: int) -> list[tuple[str, list[str]]]:
    """Lease every shard, 1024 a request, over ``conns`` connections: [(trainer, lease ids)]."""
    host, port = _host_port(url)

    async def worker(idx: int) -> tuple[str, list[str]]:
        trainer = f"bench-{idx}"
        conn = _RawConnection(host, port)
        body = json.dumps({"trainer": trainer, "node": f"node-{idx % 4}", "count": 1024}).encode()
        leases: list[str] = []
        try:
            while True:
                status, payload = await conn.post(f"/v1/jobs/{job}/leases", body)
                if status != 200:
                    raise RuntimeError(f"lease answered {status}: {payload[:300]!r}")
                answer = json.loads(payload)
                if answer["status"] != "ok":
                    return trainer, leases  # nothing left to hand out: the others hold the rest
                leases.extend(lease["lease"] for lease in answer["leases"])
        finally:
            await conn.close()

    return list(await asyncio.gather(*(worker(i) for i in range(conns))))


async def _complete_all(url: str, job: str, held: list[tuple[str, list[str]]], conns_each: int) -> int:
    host, port = _host_port(url)

    async def worker(trainer: str, leases: list[str]) -> None:
        conn = _RawConnection(host, port)
        try:
            await _complete(conn, job, trainer, leases)
        finally:
            await conn.close()

    # Each trainer's leases split over ``conns_each`` connections (completion needs the holder's name).
    tasks = [worker(trainer, leases[k::conns_each]) for trainer, leases in held for k in range(conns_each)]
    await asyncio.gather(*tasks)
    return sum(len(leases) for _, leases in held)


def _post_plain(url: str, body: bytes) -> tuple[int, float]:
    started = time.perf_counter()
    req = urllib.request.Request(url + "/v1/jobs", data=body, method="POST", headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as resp:
        resp.read()
        return resp.status, time.perf_counter() - started


def measure_spec_in_process(body: bytes) -> dict[str, Any]:
    """The spec's own share: the body parsed here by the master's parser, under tracemalloc."""
    sys.path.insert(0, str(REPO))
    from loader.master.server.spec_stream import SpecStream

    chunk = 1 << 20
    pieces = [body[i : i + chunk] for i in range(0, len(body), chunk)]

    def parse() -> tuple[Any, float, float]:
        started = time.perf_counter()
        parser = SpecStream()
        for piece in pieces:
            parser.feed(piece)
            parser.resume()
        parsed = time.perf_counter()
        spec = parser.finish()
        parser.close()
        return spec, parsed - started, time.perf_counter() - parsed

    _, parse_s, build_s = parse()  # timed without tracemalloc, which slows every allocation
    tracemalloc.start()
    spec, _, _ = parse()
    current, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    text_started = time.perf_counter()
    text_len = len(spec.json_text)
    text_s = time.perf_counter() - text_started
    return {
        "shards": len(spec.shards),
        "columns_bytes": spec.table.nbytes,
        "compressed_text_bytes": len(spec._cache.get("z", b"")) or len(spec._cache.get("text", "")),
        "json_text_chars": text_len,
        "held_bytes": current,
        "parse_peak_bytes": peak,
        "parse_s": round(parse_s, 3),
        "build_and_encode_s": round(build_s, 3),
        "json_text_s": round(text_s, 3),
    }


def measure_state_in_process(body: bytes, batch: int) -> dict[str, Any]:
    """The lease state's share, live bytes only: the state machine driven here directly (no HTTP,
    no journal), the same job created, epoch 0 leased ``batch`` at a time and completed before
    the next lease, epoch 1 leased whole (1024 at a time) then completed, under tracemalloc."""
    import base64
    import secrets

    from loader.master.server.events import Complete, CreateJob, Lease
    from loader.master.server.spec_stream import SpecStream
    from loader.master.server.state import MasterState

    def ids(count: int) -> tuple[str, ...]:
        raw = base64.urlsafe_b64encode(secrets.token_bytes(12 * count)).decode()
        return tuple(raw[16 * i : 16 * i + 16] for i in range(count))

    parser = SpecStream()
    parser.feed(body)
    parser.resume()
    spec = parser.finish()
    parser.close()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    state = MasterState()
    state.apply(CreateJob(spec), 1.0)
    after_create = tracemalloc.get_traced_memory()[0] - base
    while True:  # epoch 0: at most `batch` leases held at a time
        answer = state.apply(Lease(spec.name, "t", "n", batch, 0, ids(batch)), 2.0).answer
        if answer["status"] != "ok":
            break
        for lease in answer["leases"]:
            state.apply(Complete(spec.name, lease["lease"], "t"), 2.0)
        del answer
    after_epoch = tracemalloc.get_traced_memory()[0] - base
    leases: list[str] = []
    while True:  # epoch 1: every shard leased before any is completed
        answer = state.apply(Lease(spec.name, "t", "n", 1024, None, ids(1024)), 3.0).answer
        if answer["status"] != "ok":
            break
        leases.extend(lease["lease"] for lease in answer["leases"])
    del answer
    leases_bytes = sum(sys.getsizeof(lease) for lease in leases) + sys.getsizeof(leases)  # ours, not the state's
    after_lease = tracemalloc.get_traced_memory()[0] - base - leases_bytes
    for lease in leases:
        state.apply(Complete(spec.name, lease, "t"), 4.0)
    del leases
    after_complete = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    return {"state_bytes_after_create": after_create, "state_bytes_after_bounded_epoch": after_epoch,
            "state_bytes_after_leasing_all": after_lease, "state_bytes_after_completing": after_complete,
            "finished": state.jobs[spec.name].finished}


def run(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    from loader.master.client import MasterClient

    env = {"MALLOC_MMAP_THRESHOLD_": str(args.malloc_mmap_threshold)} if args.malloc_mmap_threshold else {}
    master = _Master(workdir, env, trim=args.trim, tune=args.tune)
    phases: list[dict[str, Any]] = []

    def phase(name: str, started: float, sampler: RssSampler, **extra: Any) -> None:
        mem = _status_kib(master.pid)
        phases.append({"phase": name, "seconds": round(time.perf_counter() - started, 2), "rss_mib": round(mem["VmRSS"] / 1024, 1),
                       "hwm_mib": round(mem["VmHWM"] / 1024, 1), "max_sampled_rss_mib": round(sampler.max_rss_kib / 1024, 1), **extra})
        print(f"  {name:<10} {phases[-1]['seconds']:>8.1f} s  rss {phases[-1]['rss_mib']:>7.1f} MiB  "
              f"hwm {phases[-1]['hwm_mib']:>7.1f} MiB  {extra or ''}", flush=True)

    def settle() -> None:
        time.sleep(0.5)  # a trim after a large job's epoch closed runs on a thread: let it finish

    job = "imagenet-1m" if args.shards >= 1_000_000 else f"imagenet-{args.shards}"
    spec = make_spec(job, args.shards)
    plain = json.dumps(spec).encode()
    gz_len = len(gzip.compress(plain, compresslevel=1, mtime=0))
    print(f"spec: {args.shards:,} shards, {len(plain) / _MIB:.1f} MiB as JSON, {gz_len / _MIB:.1f} MiB gzipped", flush=True)
    conns_each = max(1, args.complete_conns // args.conns)
    master.start()
    scraper = _Scraper(master.url, args.scrape_s)
    try:
        scraper.start()
        started = time.perf_counter()
        with RssSampler(master.pid) as sampler:
            time.sleep(1.0)
        phase("idle", started, sampler)

        started = time.perf_counter()
        with RssSampler(master.pid) as sampler:
            client = MasterClient(master.url, timeout_s=600, retry_deadline_s=600)
            status = client.create_job(spec)
            assert status["shards"]["total"] == args.shards, status
            join_status = client.create_job(spec)  # a trainer joining: by digest, no shard list sent
            assert join_status["name"] == job
            client.close()
            settle()
        phase("created", started, sampler)

        started = time.perf_counter()
        with RssSampler(master.pid) as sampler:
            tiny = {"name": "settle", "dataset": "s3://b/", "shards": ["x"], "lease_ttl_s": 60, "max_failures": 1}
            assert MasterClient(master.url).create_job(tiny)["name"] == "settle"
        phase("settled", started, sampler)

        started = time.perf_counter()
        with RssSampler(master.pid) as sampler:
            results = []
            if args.joins:
                import concurrent.futures

                with concurrent.futures.ThreadPoolExecutor(args.joins) as pool:
                    results = list(pool.map(lambda _: _post_plain(master.url, plain), range(args.joins)))
                assert all(code == 200 for code, _ in results), results
        phase("joined", started, sampler, joins=args.joins, join_s=[round(s, 2) for _, s in results])

        started = time.perf_counter()
        with RssSampler(master.pid) as sampler:
            trained = asyncio.run(_train_epoch(master.url, job, 0, args.conns, args.lease_batch, conns_each))
            settle()
        assert trained["leases"] == args.shards, f"epoch 0: leased {trained['leases']} of {args.shards}"
        phase("epoch", started, sampler, trainers=args.conns, lease_batch=args.lease_batch, **trained,
              completes_per_s=round(trained["leases"] / (time.perf_counter() - started)))

        started = time.perf_counter()
        with RssSampler(master.pid) as sampler:
            held = asyncio.run(_lease_all(master.url, job, args.conns))
        leased = sum(len(leases) for _, leases in held)
        assert leased == args.shards, f"leased {leased} of {args.shards}"
        phase("leased", started, sampler, leases=leased, leases_per_s=round(leased / (time.perf_counter() - started)))

        started = time.perf_counter()
        with RssSampler(master.pid) as sampler:
            done = asyncio.run(_complete_all(master.url, job, held, conns_each))
            del held
            settle()
        with urllib.request.urlopen(f"{master.url}/v1/jobs/{job}", timeout=60) as resp:
            final = json.load(resp)
        assert final["finished"] and final["shards"]["done"] == args.shards, final["shards"]
        phase("completed", started, sampler, completes=done, completes_per_s=round(done / (time.perf_counter() - started)))

        if args.restart:
            master.stop()
            started = time.perf_counter()
            master.start()
            with RssSampler(master.pid) as sampler:
                time.sleep(1.0)
            phase("restarted", started, sampler)

        started = time.perf_counter()
        with RssSampler(master.pid) as sampler:
            with MasterClient(master.url, timeout_s=120) as client:
                assert client.delete_job(job) == {"deleted": True}
            settle()
        phase("deleted", started, sampler)
    finally:
        scraper.stop()
        master.stop()

    by = {p["phase"]: p for p in phases}
    base = by["idle"]["rss_mib"]
    in_process = measure_spec_in_process(plain) if args.in_process else None
    state_in_process = measure_state_in_process(plain, args.lease_batch) if args.in_process else None

    def above(name: str) -> float:
        return round(by[name]["rss_mib"] - base, 1)

    cost = {
        "create_mib": above("created"),
        "create_settled_mib": above("settled"),
        "after_joins_mib": above("joined"),
        "epoch_bounded_mib": above("epoch"),
        "after_leasing_all_mib": above("leased"),
        "all_completed_mib": above("completed"),
        "peak_mib": round(max(p["hwm_mib"] for p in phases if p["phase"] not in ("restarted", "deleted")) - base, 1),
        "restart_mib": above("restarted") if "restarted" in by else None,
        "restart_peak_mib": round(by["restarted"]["hwm_mib"] - base, 1) if "restarted" in by else None,
        "deleted_mib": above("deleted"),
    }
    headline = {
        "figure": "epoch_bounded_mib",
        "what": f"master RSS above idle after the job was created, joined and one whole epoch trained by {args.conns} "
                f"trainers each holding at most {args.lease_batch} leases (lease them, complete them, lease again)",
        "mib": cost["epoch_bounded_mib"],
        "under_300_mb": cost["epoch_bounded_mib"] * _MIB < _TARGET_BYTES,
    }
    worst_case = {
        "figure": "after_leasing_all_mib",
        "what": "master RSS above idle with every shard of an epoch leased at once (1024 a request) before any "
                "was completed; all_completed_mib: once they all were",
        "mib": cost["after_leasing_all_mib"],
        "all_completed_mib": cost["all_completed_mib"],
        "under_300_mb": cost["after_leasing_all_mib"] * _MIB < _TARGET_BYTES,
    }
    return {"headline": headline, "worst_case": worst_case, "scrapes": scraper.scrapes, "phases": phases, "cost": cost,
            "spec_in_process": in_process, "state_in_process": state_in_process,
            "body_bytes": len(plain), "gzip_body_bytes": gz_len}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.master_memory", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shards", type=int, default=1_000_000, help="shards in the job")
    parser.add_argument("--conns", type=int, default=8, help="trainers (one lease connection each)")
    parser.add_argument("--lease-batch", type=int, default=1024,
                        help="leases each trainer holds at most in the headline epoch (1..1024)")
    parser.add_argument("--complete-conns", type=int, default=32, help="connections completing the leases, in all")
    parser.add_argument("--joins", type=int, default=4, help="concurrent plain-JSON creates of the same spec (joins)")
    parser.add_argument("--scrape-s", type=float, default=30.0,
                        help="GET /metrics this often, as the chart's Prometheus scrape does (30 s); 0: never")
    parser.add_argument("--restart", action=argparse.BooleanOptionalAction, default=None,
                        help="restart the master on the state at the end and measure the load (default: yes, "
                        "but for --quick)")
    parser.add_argument("--in-process", action=argparse.BooleanOptionalAction, default=True,
                        help="also parse the spec and drive the state machine in this process under tracemalloc "
                        "(the spec's and the lease state's live bytes)")
    parser.add_argument("--malloc-mmap-threshold", type=int, default=0, metavar="BYTES",
                        help="run the master with glibc's MALLOC_MMAP_THRESHOLD_ fixed at BYTES (0: glibc's dynamic default)")
    parser.add_argument("--trim", action=argparse.BooleanOptionalAction, default=True,
                        help="--no-trim: the master without its malloc_trim calls (what they give)")
    parser.add_argument("--tune", action=argparse.BooleanOptionalAction, default=True,
                        help="--no-tune: the master without its fixed M_MMAP_THRESHOLD (glibc's dynamic one)")
    parser.add_argument("--quick", action="store_true", help="100k shards, no restart: a smoke run of about a minute")
    parser.add_argument("--out", type=Path, default=None, help="default bench/results/master-memory[-quick].json")
    parser.add_argument("--keep", action="store_true", help="keep the temp dir (the master's log and state)")
    args = parser.parse_args(argv)
    if args.quick:
        args.shards, args.joins = 100_000, 2
    if args.restart is None:
        args.restart = not args.quick
    if not 1 <= args.lease_batch <= 1024:
        parser.error("--lease-batch must be in 1..1024 (the master's most leases per request)")
    out = args.out or RESULTS_DIR / ("master-memory-quick.json" if args.quick else "master-memory.json")
    workdir = Path(tempfile.mkdtemp(prefix="master-memory-"))
    # The master's files that differ from the commit machine_facts() names (a run of work in progress).
    dirty = subprocess.run(["git", "diff", "--name-only", "HEAD", "--", "loader/master"], cwd=REPO, capture_output=True, text=True)
    modified = sorted(dirty.stdout.split()) if dirty.returncode == 0 else None
    try:
        print(f"master memory: {args.shards:,} shards, state in {workdir}", flush=True)
        result = run(args, workdir)
    finally:
        if args.keep:
            print(f"kept {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    cost, headline, worst = result["cost"], result["headline"], result["worst_case"]
    print(f"job cost: created {cost['create_mib']} MiB ({cost['create_settled_mib']} after a later write), "
          f"after joins {cost['after_joins_mib']}, peak {cost['peak_mib']} MiB")
    print(f"  headline: one epoch, {args.conns} trainers x <= {args.lease_batch} leases: {headline['mib']} MiB")
    print(f"  worst case: every shard leased at once {worst['mib']} MiB, then all completed {worst['all_completed_mib']} MiB")
    if cost["restart_mib"] is not None:
        print(f"restart on that state: {cost['restart_mib']} MiB, peak {cost['restart_peak_mib']} MiB")
    print(f"job deleted: {cost['deleted_mib']} MiB above idle")
    spec = result["spec_in_process"]
    if spec:
        print(f"the spec alone: columns {spec['columns_bytes'] / 1e6:.1f} MB + text {spec['compressed_text_bytes'] / 1e6:.1f} MB "
              f"compressed; parse peak {spec['parse_peak_bytes'] / 1e6:.0f} MB (tracemalloc), parse {spec['parse_s']} s "
              f"+ build {spec['build_and_encode_s']} s, json_text {spec['json_text_s']} s")
    state = result["state_in_process"]
    if state:
        print(f"the state machine alone (live bytes): job created {state['state_bytes_after_create'] / 1e6:.1f} MB, "
              f"bounded epoch {state['state_bytes_after_bounded_epoch'] / 1e6:.1f} MB, "
              f"all leased {state['state_bytes_after_leasing_all'] / 1e6:.1f} MB, "
              f"all completed {state['state_bytes_after_completing'] / 1e6:.1f} MB")
    print(f"target (1M-shard job under 300 MB, the headline): {'met' if headline['under_300_mb'] else 'NOT met'}"
          + ("" if args.shards >= 1_000_000 else f" (this run: {args.shards:,} shards)"))
    path = write_results(out, {
        "benchmark": "master-memory",
        "what": "master RSS for one two-epoch job over HTTP, SQLite state: created (client gzip + digest join), joined "
                "(plain JSON), epoch 0 trained with bounded leases (the headline), epoch 1 leased at once then completed "
                "(the worst case), the master restarted on that state, the job deleted",
        "params": {"shards": args.shards, "conns": args.conns, "lease_batch": args.lease_batch,
                   "complete_conns": args.complete_conns, "joins": args.joins, "restart": args.restart,
                   "scrape_s": args.scrape_s, "trim": args.trim, "tune": args.tune,
                   "malloc_mmap_threshold": args.malloc_mmap_threshold or None},
        "master_files_modified_in_worktree": modified,
        "machine": machine_facts(),
        **result,
    })
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
