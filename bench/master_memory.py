"""Master memory: what one 1,000,000-shard job costs the master, created, leased and completed.

Starts a real ``shardcache master`` (SQLite state in a temp dir) and samples its memory from
``/proc/<pid>/status`` (``VmRSS``, and ``VmHWM``: the kernel's own peak) at each phase's end:

1. ``idle``: the master ready, no job;
2. ``created``: a job of ``--shards`` realistic shards (keys like
   ``imagenet/train/shard-000123.tar``, sizes ~1e8, ~1000 samples; ~70 MB of JSON) created the
   way a trainer does, through ``MasterClient.create_job`` (gzip, ~12 MB on the wire), then
   joined the same way (by digest: no shard list sent);
   ``settled``: a one-shard job created after it, so that the journal's writer and SQLite's
   cached statement, which hold the last record written until the next, let go of the create's;
3. ``joined``: ``--joins`` concurrent creates of the same spec sent as plain JSON (what an old
   client sends): each is compared with the job as it streams by, nothing kept;
4. ``leased``: every shard leased, 1024 a request, over ``--conns`` keep-alive connections;
5. ``completed``: every lease completed (one request each): the job (one epoch) is finished;
6. ``restarted`` (``--restart``): the master stopped and started again on the same state: what
   loading the snapshot and replaying the log cost.

The job's cost is RSS at a phase minus RSS when idle; the lease state's share of it is what
leasing and completing add (``completed`` minus ``joined``). RSS also counts memory the
allocator keeps after it was freed, so the live bytes are measured in this process too, under
``tracemalloc``: the same body parsed by ``SpecStream`` (the spec's columns and compressed text,
and the parse's peak), and the state machine driven directly with the same job (created, leased,
completed: the lease state's live bytes).

Run: ``python -m bench.master_memory`` (1M shards: the creates take seconds, the million
completions minutes) or ``--quick`` (100k shards, under a minute). Prints a table and writes
``bench/results/master-memory.json``. Target: a 1M-shard job costs the master under 300 MB.
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
        "name": name, "dataset": "s3://datasets/imagenet/", "epochs": 1, "seed": 7, "shuffle": True,
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


class _Master:
    def __init__(self, workdir: Path, extra_env: dict[str, str]) -> None:
        self.workdir = workdir
        self.env = extra_env
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.proc = spawn(
            [sys.executable, "-m", "sidecar.cli", "--log-level", "WARNING", "master", "--listen",
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


async def _lease_all(url: str, job: str, conns: int) -> list[tuple[str, list[str]]]:
    """Lease every shard, 1024 a request, over ``conns`` connections: [(trainer, lease ids)]."""
    host, port = url.rsplit("//", 1)[1].split(":")

    async def worker(idx: int) -> tuple[str, list[str]]:
        trainer = f"bench-{idx}"
        conn = _RawConnection(host, int(port))
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
    host, port = url.rsplit("//", 1)[1].split(":")
    done = 0

    async def worker(trainer: str, leases: list[str]) -> None:
        nonlocal done
        conn = _RawConnection(host, int(port))
        body = json.dumps({"trainer": trainer}).encode()
        try:
            for lease in leases:
                status, payload = await conn.post(f"/v1/jobs/{job}/leases/{lease}/complete", body)
                if status != 200:
                    raise RuntimeError(f"complete answered {status}: {payload[:300]!r}")
                done += 1
        finally:
            await conn.close()

    # Each trainer's leases split over ``conns_each`` connections (completion needs the holder's name).
    tasks = [worker(trainer, leases[k::conns_each]) for trainer, leases in held for k in range(conns_each)]
    await asyncio.gather(*tasks)
    return done


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


def measure_state_in_process(body: bytes) -> dict[str, Any]:
    """The lease state's share, live bytes only: the state machine driven here directly (no HTTP,
    no journal), the same job created, leased 1024 at a time and completed, under tracemalloc."""
    import base64
    import secrets

    from loader.master.server.spec_stream import SpecStream
    from loader.master.server.state import Complete, CreateJob, Lease, MasterState

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
    leases: list[str] = []
    while True:
        raw = base64.urlsafe_b64encode(secrets.token_bytes(12 * 1024)).decode()
        ids = tuple(raw[16 * i : 16 * i + 16] for i in range(1024))
        answer = state.apply(Lease(spec.name, "t", "n", 1024, None, ids), 2.0).answer
        if answer["status"] != "ok":
            break
        leases.extend(lease["lease"] for lease in answer["leases"])
    leases_bytes = sum(sys.getsizeof(lease) for lease in leases) + sys.getsizeof(leases)  # ours, not the state's
    after_lease = tracemalloc.get_traced_memory()[0] - base - leases_bytes
    for lease in leases:
        state.apply(Complete(spec.name, lease, "t"), 3.0)
    del leases
    after_complete = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    return {"state_bytes_after_create": after_create, "state_bytes_after_leasing": after_lease,
            "state_bytes_after_completing": after_complete, "finished": state.jobs[spec.name].finished}


def run(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    from loader.master.client import MasterClient

    env = {"MALLOC_MMAP_THRESHOLD_": str(args.malloc_mmap_threshold)} if args.malloc_mmap_threshold else {}
    master = _Master(workdir, env)
    phases: list[dict[str, Any]] = []

    def phase(name: str, started: float, sampler: RssSampler, **extra: Any) -> None:
        mem = _status_kib(master.pid)
        phases.append({"phase": name, "seconds": round(time.perf_counter() - started, 2), "rss_mib": round(mem["VmRSS"] / 1024, 1),
                       "hwm_mib": round(mem["VmHWM"] / 1024, 1), "max_sampled_rss_mib": round(sampler.max_rss_kib / 1024, 1), **extra})
        print(f"  {name:<10} {phases[-1]['seconds']:>8.1f} s  rss {phases[-1]['rss_mib']:>7.1f} MiB  "
              f"hwm {phases[-1]['hwm_mib']:>7.1f} MiB  {extra or ''}", flush=True)

    job = "imagenet-1m" if args.shards >= 1_000_000 else f"imagenet-{args.shards}"
    spec = make_spec(job, args.shards)
    plain = json.dumps(spec).encode()
    gz_len = len(gzip.compress(plain, compresslevel=1, mtime=0))
    print(f"spec: {args.shards:,} shards, {len(plain) / _MIB:.1f} MiB as JSON, {gz_len / _MIB:.1f} MiB gzipped", flush=True)
    master.start()
    try:
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
        phase("created", started, sampler)

        # The journal's writer task and SQLite's cached INSERT keep the last record written (here
        # the ~70 MB create record) until the next write: one tiny job makes it the last one.
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
            held = asyncio.run(_lease_all(master.url, job, args.conns))
        leased = sum(len(leases) for _, leases in held)
        assert leased == args.shards, f"leased {leased} of {args.shards}"
        phase("leased", started, sampler, leases=leased, leases_per_s=round(leased / (time.perf_counter() - started)))

        started = time.perf_counter()
        with RssSampler(master.pid) as sampler:
            done = asyncio.run(_complete_all(master.url, job, held, max(1, args.complete_conns // args.conns)))
        del held
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
    finally:
        master.stop()

    by = {p["phase"]: p for p in phases}
    base = by["idle"]["rss_mib"]
    in_process = measure_spec_in_process(plain) if args.in_process else None
    state_in_process = measure_state_in_process(plain) if args.in_process else None
    cost = {
        "create_mib": round(by["created"]["rss_mib"] - base, 1),
        "create_settled_mib": round(by["settled"]["rss_mib"] - base, 1),
        "after_joins_mib": round(by["joined"]["rss_mib"] - base, 1),
        "after_leasing_mib": round(by["leased"]["rss_mib"] - base, 1),
        "whole_run_mib": round(by["completed"]["rss_mib"] - base, 1),
        "lease_state_mib": round(by["completed"]["rss_mib"] - by["joined"]["rss_mib"], 1),
        "peak_mib": round(max(p["hwm_mib"] for p in phases if p["phase"] != "restarted") - base, 1),
        "restart_mib": round(by["restarted"]["rss_mib"] - base, 1) if "restarted" in by else None,
        "restart_peak_mib": round(by["restarted"]["hwm_mib"] - base, 1) if "restarted" in by else None,
    }
    cost["whole_run_under_300_mb"] = cost["whole_run_mib"] * _MIB < _TARGET_BYTES
    return {"phases": phases, "cost": cost, "spec_in_process": in_process, "state_in_process": state_in_process,
            "body_bytes": len(plain), "gzip_body_bytes": gz_len}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.master_memory", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shards", type=int, default=1_000_000, help="shards in the job")
    parser.add_argument("--conns", type=int, default=8, help="trainers (one connection each) leasing the shards")
    parser.add_argument("--complete-conns", type=int, default=32, help="connections completing the leases, in all")
    parser.add_argument("--joins", type=int, default=4, help="concurrent plain-JSON creates of the same spec (joins)")
    parser.add_argument("--restart", action=argparse.BooleanOptionalAction, default=True,
                        help="restart the master on the state at the end and measure the load")
    parser.add_argument("--in-process", action=argparse.BooleanOptionalAction, default=True,
                        help="also parse the spec and drive the state machine in this process under tracemalloc "
                        "(the spec's and the lease state's live bytes)")
    parser.add_argument("--malloc-mmap-threshold", type=int, default=0, metavar="BYTES",
                        help="run the master with glibc's MALLOC_MMAP_THRESHOLD_ fixed at BYTES (0: glibc's dynamic default)")
    parser.add_argument("--quick", action="store_true", help="100k shards, no restart: a smoke run under a minute")
    parser.add_argument("--out", type=Path, default=None, help="default bench/results/master-memory[-quick].json")
    parser.add_argument("--keep", action="store_true", help="keep the temp dir (the master's log and state)")
    args = parser.parse_args(argv)
    if args.quick:
        args.shards, args.restart, args.joins = 100_000, False, 2
    out = args.out or RESULTS_DIR / ("master-memory-quick.json" if args.quick else "master-memory.json")
    workdir = Path(tempfile.mkdtemp(prefix="master-memory-"))
    state_dirty = subprocess.run(["git", "diff", "--quiet", "--", "loader/master/server/state.py"], cwd=REPO).returncode != 0
    try:
        print(f"master memory: {args.shards:,} shards, state in {workdir}", flush=True)
        result = run(args, workdir)
    finally:
        if args.keep:
            print(f"kept {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    cost = result["cost"]
    print(f"job cost: created {cost['create_mib']} MiB ({cost['create_settled_mib']} once the last record is let go), "
          f"after joins {cost['after_joins_mib']}, leased {cost['after_leasing_mib']}, completed {cost['whole_run_mib']} MiB "
          f"(lease state {cost['lease_state_mib']}), peak {cost['peak_mib']} MiB")
    if cost["restart_mib"] is not None:
        print(f"restart on that state: {cost['restart_mib']} MiB, peak {cost['restart_peak_mib']} MiB")
    spec = result["spec_in_process"]
    if spec:
        print(f"the spec alone: columns {spec['columns_bytes'] / 1e6:.1f} MB + text {spec['compressed_text_bytes'] / 1e6:.1f} MB "
              f"compressed; parse peak {spec['parse_peak_bytes'] / 1e6:.0f} MB (tracemalloc), parse {spec['parse_s']} s "
              f"+ build {spec['build_and_encode_s']} s, json_text {spec['json_text_s']} s")
    state = result["state_in_process"]
    if state:
        print(f"the state machine alone (live bytes): job created {state['state_bytes_after_create'] / 1e6:.1f} MB, "
              f"all leased {state['state_bytes_after_leasing'] / 1e6:.1f} MB, all completed {state['state_bytes_after_completing'] / 1e6:.1f} MB")
    print(f"target (1M-shard job under 300 MB): {'met' if cost['whole_run_under_300_mb'] else 'NOT met'}"
          + ("" if args.shards >= 1_000_000 else f" (this run: {args.shards:,} shards)"))
    path = write_results(out, {
        "benchmark": "master-memory",
        "what": "master RSS for one job created (client gzip + digest join), joined (plain JSON), leased (1024/request) "
                "and completed over HTTP, SQLite state",
        "params": {"shards": args.shards, "conns": args.conns, "complete_conns": args.complete_conns, "joins": args.joins,
                   "restart": args.restart, "malloc_mmap_threshold": args.malloc_mmap_threshold or None},
        "state_py_modified_in_worktree": state_dirty,
        "machine": machine_facts(),
        **result,
    })
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
