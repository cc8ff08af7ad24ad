"""What ``shardcache serve --auth sigv4`` costs warm reads: the same objects, read through a pod
sidecar in front of a plain node daemon and through one in front of an ``--auth sigv4`` daemon,
in the same run, on the same machine, from the same origin.

    python -m bench.auth_bench             # 512 x 4 KiB and 24 x 16 MiB objects, 9 rounds (~2 min)
    python -m bench.auth_bench --quick     # CI-sized: 128 x 4 KiB, 4 x 16 MiB, 3 short rounds (< 30 s)

The set-up, every part its own process as deployed: one moto S3 server (bench/common.py, objects in
RAM) and three node daemons on it, each listening on a unix socket with one pod sidecar
(``--mode sidecar --upstream unix://...``, credentials in its environment: ``POD_CREDENTIALS``):

- ``plain``: no access check, the baseline;
- ``auth``: ``--auth sigv4``, its decision cache at the default ``--auth-cache-ttl``;
- ``control``: a second plain one. Two identical set-ups on a shared two-core machine differ by
  several per cent (where the scheduler puts them, what else runs): ``control/plain`` is that
  noise floor, measured in the same run, and ``auth/plain`` means something only beyond it.

moto in its default mode accepts every signature, so the identity proof and each object's proof
pass. That is enough here: a warm read is answered from the daemon's decision cache without asking
the origin, and what it costs (the sidecar signing each request, the daemon looking up the session
and the decision) is the same whatever the origin would have said. Refusals are the tenancy
tests' job (tests/tenancy/, with an IAM-enforcing moto).

Per kind of object, right before its rounds (so the decisions stay younger than their TTL): every
object is read once through each sidecar (a miss, which also fills the decision cache), the
daemons publish them, and a pass expecting hits follows. Then warm reads through each sidecar,
every answer checked to be ``x-shardcache-cache: hit`` and ``x-shardcache-via: upstream`` (served
by the daemon, not the sidecar's standalone fallback) with the object's length:

- small objects (4 KiB): per-request overhead dominates; requests/s and p50/p99 latency;
- shard-sized objects (16 MiB): MB/s (10^6 bytes per second) and p50/p99 latency per object;

by ``--threads`` client threads, each with its own kept-alive ``http.client`` connection. Not
boto3: its own per-request CPU (building, signing and parsing each request, ~1 ms) runs in this
process on the same two cores as the sidecars and the daemons and would add the same large cost to
every variant, hiding the difference under test. Rounds interleave the variants, their order
rotated each round, so drift of the machine hits all of them and none always goes first; figures
are medians over rounds, ratios are those medians over plain's, and ``paired_median`` is the
median of same-round ratios. CPU seconds of each sidecar and daemon are read from /proc per round:
per request (small) or per GB (large), which other processes' noise moves less than wall time.
``sidecar_sign_us`` is the CPU one proof costs (date, signature, header), timed in this process
with the sidecar's own functions: the part of the check that grows with requests.

The cold path: the daemon's ``auth.replays`` over the first reads, less the one identity replay
per session, per object: the extra origin request (a signed ``GET`` of the object's first byte) a
first read costs, and ``replay_ms``, how long the daemon waited for the origin's answer to one
(``auth.replay_us`` over ``auth.replays``; with the fills of the same reads in flight on the same
origin). Replays during the measured rounds are reported too (0 while the decisions are fresh).

Writes ``bench/results/auth.json`` (``auth-quick.json`` with ``--quick``) and prints a table.
"""

from __future__ import annotations

import argparse
import http.client
import itertools
import os
import random
import shutil
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

from bench.common import (
    RESULTS_DIR,
    cpu_seconds,
    fmt_size,
    in_workdir,
    machine_facts,
    parse_size,
    wait_until,
    write_results,
)
from bench.servers import STORE_DESCRIPTIONS, MotoServer, ServeProcess, ServerExited
from sidecar.daemon.auth.proofs import Target, prove
from sidecar.daemon.auth.sigv4 import Credentials, amz_date

__all__ = ["VARIANTS", "KINDS", "POD_CREDENTIALS", "BenchError", "Node", "Objects", "Round", "measure_round", "summarize",
           "signing_cost_us", "run", "main"]

BUCKET = "authbench"
VARIANTS = ("plain", "auth", "control")
KINDS = ("small", "large")
READ_CHUNK = 1024 * 1024
# control: a second plain node, to tell what auth changes from what two identical set-ups differ by.
_VARIANT_FLAGS: dict[str, list[str]] = {"plain": [], "auth": ["--auth", "sigv4"], "control": []}


class BenchError(RuntimeError):
    """A measurement that cannot be trusted (a miss where a hit was expected, a short body)."""


@dataclass(frozen=True)
class Objects:
    """One class of objects in the bucket: ``count`` keys of ``size`` bytes each."""

    kind: str
    keys: tuple[str, ...]
    size: int

    @property
    def total(self) -> int:
        return self.size * len(self.keys)


def upload(client: Any, kind: str, count: int, size: int, rng: random.Random) -> Objects:
    """Random (incompressible) objects under ``{kind}/``; the same for the same seed."""
    keys = []
    for index in range(count):
        key = f"{kind}/obj-{index:06d}.bin"
        client.put_object(Bucket=BUCKET, Key=key, Body=rng.randbytes(size))
        keys.append(key)
    return Objects(kind, tuple(keys), size)


# -- the processes under test -----------------------------------------------------------------

# What the pod's sidecar proves with. AWS-shaped on purpose: proofs.py accepts access key ids of
# 16-128 upper-case letters and digits only, so moto's ``testing`` (or bench/common.py's
# ``S3RVER``) is refused as a malformed proof before the origin is asked. moto takes any pair.
POD_CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "AKIAAUTHBENCH0000000",
    "AWS_SECRET_ACCESS_KEY": "authbench-pod-secret-not-a-real-one",
    "AWS_DEFAULT_REGION": "us-east-1",
}


class Serve(ServeProcess):
    """``python -m sidecar.cli serve`` as a subprocess on a fresh cache dir, with a TCP listener
    (``url``) besides whatever ``extra`` adds; launched when made, :meth:`wait_ready` waits for it."""

    def __init__(self, workdir: Path, name: str, origin: str, cache_size: int, extra: list[str],
                 env: dict[str, str] | None = None) -> None:
        self.cache_dir = workdir / f"cache-{name}"
        shutil.rmtree(self.cache_dir, ignore_errors=True)
        super().__init__(workdir / f"{name}.log", [
            "--origin", "s3", "--s3-endpoint", origin, "--cache-dir", str(self.cache_dir),
            "--cache-size", str(cache_size), "--min-free", "0", *extra,
        ], env)
        self.name = name
        self.launch()

    def wait_ready(self) -> Self:
        try:
            return super().wait_ready()
        except ServerExited as exc:
            raise BenchError(str(exc)) from None

    def stop(self, timeout: float = 15.0) -> None:
        super().stop(timeout)
        shutil.rmtree(self.cache_dir, ignore_errors=True)


class Node:
    """One variant: a node daemon (unix socket for its sidecar, TCP for this benchmark's stats
    calls) and the pod sidecar forwarding to it."""

    def __init__(self, workdir: Path, variant: str, origin: str, cache_size: int) -> None:
        self.variant = variant
        self.sock = workdir / f"daemon-{variant}.sock"
        self.daemon = Serve(workdir, f"daemon-{variant}", origin, cache_size,
                            ["--listen", f"unix://{self.sock}", *_VARIANT_FLAGS[variant]])
        # The sidecar's own cache is the standalone fallback only (no node daemon reachable);
        # every measured answer is checked to have come from the daemon instead.
        try:
            self.sidecar = Serve(workdir, f"sidecar-{variant}", origin, 256 << 20,
                                 ["--mode", "sidecar", "--upstream", f"unix://{self.sock}"], POD_CREDENTIALS)
        except BaseException:
            self.daemon.stop()
            raise

    def wait_ready(self) -> None:
        try:
            self.daemon.wait_ready()
            self.sidecar.wait_ready()
            wait_until(lambda: bool(self.sidecar.get_json("/readyz").get("upstream")), timeout=30,
                       what=f"the {self.variant} sidecar to reach its daemon (log: {self.sidecar.log})")
        except BaseException:
            self.stop()
            raise

    @property
    def port(self) -> int:
        return self.sidecar.port

    @property
    def pids(self) -> dict[str, int]:
        return {"sidecar": self.sidecar.pid, "daemon": self.daemon.pid}

    def stats(self) -> dict[str, Any]:
        return self.daemon.get_json("/_shardcache/stats")

    def settle(self) -> None:
        """A reader can finish before its fill is published (fsync, rename): wait for that."""
        wait_until(lambda: self.stats()["fills_in_flight"] == 0, timeout=120, what=f"the {self.variant} daemon's fills")

    def stop(self) -> None:
        for serve in (self.sidecar, self.daemon):
            serve.stop()


# -- reads ------------------------------------------------------------------------------------


@dataclass
class Round:
    """One pass of reads through one sidecar by all client threads."""

    variant: str
    kind: str
    seconds: float
    requests: int
    bytes: int
    latencies_s: list[float]
    states: dict[str, int]
    cpu_s: dict[str, float] = field(default_factory=dict)

    @property
    def rps(self) -> float:
        return self.requests / self.seconds

    @property
    def mb_s(self) -> float:
        return self.bytes / self.seconds / 1e6

    def percentile_ms(self, q: float) -> float:
        return percentile(self.latencies_s, q) * 1000


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile ``q`` (0-100) of ``values``."""
    ordered = sorted(values)
    rank = max(1, min(len(ordered), round(q / 100 * len(ordered) + 0.5)))
    return ordered[rank - 1]


def _read_one(conn: http.client.HTTPConnection, key: str, size: int, buffer: memoryview) -> tuple[int, str]:
    """GET ``key`` on ``conn``; (bytes received, ``x-shardcache-cache``). Raises on anything but
    a 200 of ``size`` bytes from the daemon."""
    conn.request("GET", f"/{BUCKET}/{key}")
    resp = conn.getresponse()
    got = 0
    while True:
        n = resp.readinto(buffer)
        if not n:
            break
        got += n
    state = resp.getheader("x-shardcache-cache") or ""
    via = resp.getheader("x-shardcache-via")
    if resp.status != 200 or got != size or via != "upstream":
        raise BenchError(f"{key}: answered {resp.status} with {got} of {size} bytes, via {via!r} "
                         "(expected 200 from the node daemon: see the sidecar's log)")
    return got, state


def measure_round(port: int, variant: str, objects: Objects, passes: int, threads: int, expect: str | None,
                  pids: dict[str, int]) -> Round:
    """Read every object ``passes`` times through the sidecar on ``port`` with ``threads``
    kept-alive connections, each thread taking the next object as it is free. ``expect``: the
    ``x-shardcache-cache`` every answer must carry (``None``: any)."""
    work = list(objects.keys) * passes
    taken = itertools.count()  # next() is atomic under the GIL: a lock-free work queue
    latencies: list[list[float]] = [[] for _ in range(threads)]
    states: list[dict[str, int]] = [{} for _ in range(threads)]
    received = [0] * threads
    errors: list[BaseException] = []
    # Connections open before the clock starts; the barrier releases every thread at once.
    start = threading.Barrier(threads + 1)

    def worker(index: int) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        buffer = memoryview(bytearray(min(objects.size, READ_CHUNK) or 1))
        try:
            conn.connect()
            start.wait(timeout=60)
            while (i := next(taken)) < len(work):
                began = time.perf_counter()
                got, state = _read_one(conn, work[i], objects.size, buffer)
                latencies[index].append(time.perf_counter() - began)
                received[index] += got
                states[index][state] = states[index].get(state, 0) + 1
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)
            start.abort()
        finally:
            conn.close()

    pool = [threading.Thread(target=worker, args=(i,), name=f"reader-{i}", daemon=True) for i in range(threads)]
    for thread in pool:
        thread.start()
    try:
        start.wait(timeout=60)
    except threading.BrokenBarrierError:
        pass
    cpu_before = {name: cpu_seconds(pid) for name, pid in pids.items()}
    client_before = _self_cpu()
    began = time.perf_counter()
    for thread in pool:
        thread.join(timeout=max(0.0, began + 600 - time.perf_counter()))
    seconds = time.perf_counter() - began
    cpu = {name: cpu_seconds(pid) - cpu_before[name] for name, pid in pids.items()}
    cpu["client"] = _self_cpu() - client_before
    if errors:
        raise BenchError(f"{variant} {objects.kind} reads failed: {errors[0]!r}") from errors[0]
    if any(thread.is_alive() for thread in pool):
        raise BenchError(f"{variant} {objects.kind} reads still running after 600 s")
    merged: dict[str, int] = {}
    for found in states:
        for state, count in found.items():
            merged[state] = merged.get(state, 0) + count
    if expect is not None and merged.get(expect, 0) != len(work):
        raise BenchError(f"{variant} {objects.kind}: x-shardcache-cache was {merged}, every answer should be {expect!r}")
    return Round(variant, objects.kind, seconds, len(work), sum(received), [x for lap in latencies for x in lap],
                 merged, {name: round(value, 4) for name, value in cpu.items()})


def _self_cpu() -> float:
    times = os.times()
    return times.user + times.system


# -- the run ----------------------------------------------------------------------------------


def say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def warm(nodes: dict[str, Node], objects: Objects, threads: int) -> dict[str, Any]:
    """Read every object once through each sidecar (misses: fills and, under auth, decisions),
    then again until every answer is a hit. Returns what the cold pass cost: its wall time and,
    under auth, the origin replays."""
    cold: dict[str, Any] = {}
    for variant, node in nodes.items():
        before = node.stats()
        first = measure_round(node.port, variant, objects, 1, threads, None, node.pids)
        after = node.stats()
        cold[variant] = {"seconds": round(first.seconds, 3), "states": first.states,
                         "origin_read_bytes": after["origin_read_bytes"] - before["origin_read_bytes"]}
        if after["auth"]["mode"] == "sigv4":
            sessions = after["auth"]["sessions"] - before["auth"]["sessions"]
            replays = after["auth"]["replays"] - before["auth"]["replays"]
            # One identity replay opens each session; the rest is one signed ranged GET per object.
            cold[variant].update({"sessions": sessions, "replays": replays,
                                  "replays_per_object": round((replays - sessions) / len(objects.keys), 4)})
            if "replay_us" in after["auth"]:  # the daemon's wait on the origin per replay
                waited = after["auth"]["replay_us"] - before["auth"]["replay_us"]
                cold[variant]["replay_ms"] = round(waited / max(replays, 1) / 1000, 3)
    for variant, node in nodes.items():
        # A reader can finish before its fill is published (fsync, rename), and a read that
        # finds it unpublished is a miss again: wait for the fills, read, until all are hits.
        for _attempt in range(5):
            node.settle()
            check = measure_round(node.port, variant, objects, 1, threads, None, node.pids)
            if check.states.get("hit", 0) == len(objects.keys):
                break
        else:
            raise BenchError(f"the {variant} daemon still answers {check.states} for {len(objects.keys)} {objects.kind} "
                             f"objects after 5 settled passes (log: {node.daemon.log})")
    return cold


def calibrate(node: Node, objects: Objects, threads: int, round_s: float, max_passes: int) -> int:
    """Passes over ``objects`` that make one round last about ``round_s`` (timed on ``node``)."""
    probe = measure_round(node.port, node.variant, objects, 1, threads, "hit", node.pids)
    return max(1, min(max_passes, round(round_s / max(probe.seconds, 1e-6))))


def run_rounds(nodes: dict[str, Node], objects: Objects, passes: int, rounds: int, threads: int) -> dict[str, list[Round]]:
    """``rounds`` rounds of every variant, the order rotated each round: each variant takes each
    place in turn, so what drifts during a round's sequence does not favour one of them."""
    results: dict[str, list[Round]] = {variant: [] for variant in VARIANTS}
    for index in range(rounds):
        order = VARIANTS[index % len(VARIANTS):] + VARIANTS[:index % len(VARIANTS)]
        for variant in order:
            node = nodes[variant]
            results[variant].append(measure_round(node.port, variant, objects, passes, threads, "hit", node.pids))

        def figure(r: Round) -> str:
            return f"{r.rps:.0f} req/s" if objects.kind == "small" else f"{r.mb_s:.0f} MB/s"

        say(f"  [{objects.kind}] round {index + 1}/{rounds}: " + ", ".join(f"{v} {figure(results[v][-1])}" for v in VARIANTS))
    return results


def _median(values: list[float]) -> float:
    return statistics.median(values)


def _row(kind: str, runs: list[Round]) -> dict[str, Any]:
    """One variant's figures: medians over its rounds, and every round's."""
    cpu_names = sorted({name for r in runs for name in r.cpu_s})
    row: dict[str, Any] = {
        "requests_per_round": runs[0].requests,
        "bytes_per_round": runs[0].bytes,
        "requests_per_s": round(_median([r.rps for r in runs]), 1),
        "mb_s": round(_median([r.mb_s for r in runs]), 1),
        "p50_ms": round(_median([r.percentile_ms(50) for r in runs]), 3),
        "p99_ms": round(_median([r.percentile_ms(99) for r in runs]), 3),
        "rounds_requests_per_s": [round(r.rps, 1) for r in runs],
        "rounds_mb_s": [round(r.mb_s, 1) for r in runs],
        "rounds_s": [round(r.seconds, 4) for r in runs],
    }
    if kind == "small":
        # What each request costs each process, in CPU microseconds.
        row["cpu_us_per_request"] = {name: round(_median([r.cpu_s.get(name, 0.0) / r.requests * 1e6 for r in runs]), 1)
                                     for name in cpu_names}
    else:
        row["cpu_s_per_gb"] = {name: round(_median([r.cpu_s.get(name, 0.0) / (r.bytes / 1e9) for r in runs]), 3)
                               for name in cpu_names}
    return row


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 4) if b else None


def summarize(objects: Objects, passes: int, rounds: dict[str, list[Round]]) -> dict[str, Any]:
    """Per variant: its figures; ``ratios`` and ``deltas``: ``auth`` and ``control`` against
    ``plain`` (``control/plain`` is how far two identical set-ups differ in this run: the noise
    floor ``auth/plain`` is to be read against)."""
    variants = {variant: _row(objects.kind, runs) for variant, runs in rounds.items()}
    cpu_key = "cpu_us_per_request" if objects.kind == "small" else "cpu_s_per_gb"
    plain = variants["plain"]

    def figure(r: Round) -> float:
        return r.rps if objects.kind == "small" else r.mb_s

    ratios: dict[str, Any] = {}
    deltas: dict[str, Any] = {}
    for variant in ("auth", "control"):
        row = variants[variant]
        # Same-round pairs too: each round's figure over plain's in that round, and their median.
        pairs = [figure(a) / figure(p) for a, p in zip(rounds[variant], rounds["plain"], strict=True) if figure(p)]
        ratios[f"{variant}/plain"] = {
            **{name: _ratio(row[name], plain[name]) for name in ("requests_per_s", "mb_s", "p50_ms", "p99_ms")},
            cpu_key: {name: _ratio(row[cpu_key][name], plain[cpu_key][name]) for name in plain[cpu_key]},
            "paired_median": round(_median(pairs), 4) if pairs else None,
            "paired_rounds": [round(x, 4) for x in pairs],
        }
        # In absolute terms: what the variant adds to each request (negative: it took less).
        deltas[f"{variant}-plain"] = {
            "p50_us": round((row["p50_ms"] - plain["p50_ms"]) * 1000, 1),
            "p99_us": round((row["p99_ms"] - plain["p99_ms"]) * 1000, 1),
            cpu_key: {name: round(row[cpu_key][name] - plain[cpu_key][name], 3) for name in plain[cpu_key]},
        }
    return {"objects": len(objects.keys), "object_bytes": objects.size, "passes_per_round": passes,
            "rounds": len(rounds["plain"]), "variants": variants, "ratios": ratios, "deltas": deltas}


def signing_cost_us(target: Target, count: int = 20_000) -> float:
    """CPU microseconds the sidecar spends making one object proof (date, signature, header),
    timed in this process with the sidecar's own functions: the part of the check's cost that
    grows with requests, free of the noise of a shared machine."""
    creds = Credentials(POD_CREDENTIALS["AWS_ACCESS_KEY_ID"], POD_CREDENTIALS["AWS_SECRET_ACCESS_KEY"])
    prove(creds, target, amz_date(), BUCKET, "warm/up").to_header()  # the day's signing key, derived once
    began = time.process_time()
    for index in range(count):
        prove(creds, target, amz_date(), BUCKET, f"small/obj-{index % 512:06d}.bin").to_header()
    return (time.process_time() - began) / count * 1e6


def print_table(results: dict[str, Any]) -> None:
    rows: list[tuple[str, ...]] = [("objects", "figure", *VARIANTS, "auth/plain", "control/plain")]
    for kind, names in (("small", (("requests/s", "requests_per_s"), ("p50 ms", "p50_ms"), ("p99 ms", "p99_ms"))),
                        ("large", (("MB/s", "mb_s"), ("p50 ms", "p50_ms"), ("p99 ms", "p99_ms")))):
        summary = results[kind]
        label = f"{summary['objects']} x {fmt_size(summary['object_bytes'])}"
        v, r = summary["variants"], summary["ratios"]
        ratio_names = ("auth/plain", "control/plain")
        for title, key in names:
            rows.append((label, title, *(f"{v[x][key]:.2f}" for x in VARIANTS), *(f"{r[x][key]:.3f}" for x in ratio_names)))
        cpu_key, unit = ("cpu_us_per_request", "CPU us/req") if kind == "small" else ("cpu_s_per_gb", "CPU s/GB")
        for name in ("sidecar", "daemon"):
            rows.append((label, f"{unit} {name}", *(f"{v[x][cpu_key][name]:.2f}" for x in VARIANTS),
                         *(f"{r[x][cpu_key][name]:.3f}" for x in ratio_names)))
        rows.append((label, "paired round ratio", "", "", "", *(f"{r[x]['paired_median']:.3f}" for x in ratio_names)))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for index, row in enumerate(rows):
        print("  ".join(cell.ljust(w) if i < 2 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths, strict=True))))
        if index == 0:
            print("  ".join("-" * w for w in widths))
    cold = results["cold"]
    replays = sum(c["auth"]["replays"] for c in cold.values())
    sessions = sum(c["auth"]["sessions"] for c in cold.values())
    objects = sum(results[kind]["objects"] for kind in KINDS)
    print(f"\ncold path under --auth: {(replays - sessions) / objects:.2f} extra origin request(s) per object "
          f"({replays} replays for {objects} objects and {sessions} session(s)); replays during the measured "
          f"rounds: {results['measured_replays']}; one proof costs the sidecar {results['sidecar_sign_us']:.1f} us of CPU")
    waits = [c["auth"]["replay_ms"] for c in cold.values() if "replay_ms" in c["auth"]]
    if waits:
        print("a replay (the origin's answer to one proof) kept the daemon waiting "
              + ", ".join(f"{kind} {c['auth']['replay_ms']:.2f} ms" for kind, c in cold.items() if "replay_ms" in c["auth"]))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.auth_bench",
        description="Warm reads through a pod sidecar in front of a plain node daemon and one in front of an "
                    "--auth sigv4 daemon, same origin, same run, with a second plain one as the noise floor: "
                    "requests/s and latency of small objects, MB/s of shard-sized ones, ratios against plain. "
                    "Writes bench/results/auth.json.",
        epilog="examples:\n  python -m bench.auth_bench --quick\n  python -m bench.auth_bench --rounds 9 --threads 8",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--quick", action="store_true", help="CI-sized run (< 60 s)")
    parser.add_argument("--small-count", type=int, default=None, help="small objects (default 512; 128 with --quick)")
    parser.add_argument("--small-size", default="4KiB", help="size of each small object (default 4KiB)")
    parser.add_argument("--large-count", type=int, default=None, help="shard-sized objects (default 24; 4 with --quick)")
    parser.add_argument("--large-size", default="16MiB", help="size of each shard-sized object (default 16MiB)")
    parser.add_argument("--rounds", type=int, default=None,
                        help="measured rounds per variant (default 9; 3 with --quick): a multiple of 3 puts each "
                             "variant in each place of the order equally often")
    parser.add_argument("--round-seconds", type=float, default=None,
                        help="about how long one variant's round lasts (default 1.5; 0.4 with --quick)")
    parser.add_argument("--threads", type=int, default=4, help="client threads, one kept-alive connection each (default 4)")
    parser.add_argument("--seed", type=int, default=0, help="object contents seed")
    parser.add_argument("--workdir", type=Path, default=None, help="where caches, sockets and logs go (default: a temp dir)")
    parser.add_argument("--keep", action="store_true", help="keep the work dir (daemon, sidecar and moto logs)")
    parser.add_argument("--results-dir", type=Path, default=RESULTS_DIR, help="where the result file is written")
    args = parser.parse_args(argv)
    args.small_count = args.small_count or (128 if args.quick else 512)
    args.large_count = args.large_count or (4 if args.quick else 24)
    args.rounds = args.rounds or (3 if args.quick else 9)
    args.round_seconds = args.round_seconds if args.round_seconds is not None else (0.4 if args.quick else 1.5)
    try:
        args.small_size = parse_size(args.small_size)
        args.large_size = parse_size(args.large_size)
    except ValueError as exc:
        parser.error(str(exc))
    if min(args.small_count, args.large_count, args.rounds, args.threads, args.small_size, args.large_size) <= 0:
        parser.error("counts, sizes, --rounds and --threads must be positive")
    if args.round_seconds <= 0:
        parser.error("--round-seconds must be positive")
    return args


def run(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """Everything measured, in the shape of the result file (less the machine and the config)."""
    nodes: dict[str, Node] = {}
    try:
        with MotoServer(workdir) as store:
            client = store.client()
            client.create_bucket(Bucket=BUCKET)
            rng = random.Random(args.seed)
            sets = [upload(client, "small", args.small_count, args.small_size, rng),
                    upload(client, "large", args.large_count, args.large_size, rng)]
            cache_size = max(1 << 30, 2 * sum(objects.total for objects in sets))
            # All started at once (each start is a second or two of imports), then waited for.
            for variant in VARIANTS:
                nodes[variant] = Node(workdir, variant, store.endpoint, cache_size)
            for node in nodes.values():
                node.wait_ready()
            described = nodes["auth"].daemon.get_json("/_shardcache/auth")
            if described.get("auth") != "sigv4":
                raise BenchError(f"the auth daemon does not check proofs: GET /_shardcache/auth answered {described}")
            summaries: dict[str, Any] = {}
            cold: dict[str, Any] = {}
            measured_replays = 0
            for objects in sets:
                # Warmed right before its rounds: the decisions are then younger than their TTL
                # throughout (a warm read that found one expired would replay its proof).
                say(f"[{objects.kind}] warming {len(objects.keys)} x {fmt_size(objects.size)} through every sidecar")
                cold[objects.kind] = warm(nodes, objects, args.threads)
                passes = calibrate(nodes["plain"], objects, args.threads, args.round_seconds,
                                   max_passes=200 if objects.kind == "small" else 50)
                say(f"[{objects.kind}] {args.rounds} rounds of {passes} pass(es) per variant")
                replays_before = nodes["auth"].stats()["auth"]["replays"]
                summaries[objects.kind] = summarize(objects, passes, run_rounds(nodes, objects, passes, args.rounds, args.threads))
                measured_replays += nodes["auth"].stats()["auth"]["replays"] - replays_before
            auth_counts = nodes["auth"].stats()["auth"]
    finally:
        for node in nodes.values():
            node.stop()
    return {**summaries, "cold": cold, "measured_replays": measured_replays, "auth_counts": auth_counts,
            "auth_decision_ttl_s": described.get("decision_ttl_s"), "sidecar_sign_us": round(signing_cost_us(Target.from_json(described)), 2)}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    began = time.monotonic()
    facts = machine_facts()
    measured = in_workdir(args.workdir, "shardcache-auth-bench-", args.keep, lambda workdir: run(args, workdir))
    facts["loadavg_end"] = os.getloadavg()
    results: dict[str, Any] = {
        "benchmark": "auth",
        "machine": facts,
        "config": {
            "quick": args.quick, "threads": args.threads, "rounds": args.rounds, "round_seconds": args.round_seconds,
            "seed": args.seed, "origin": STORE_DESCRIPTIONS["moto"] + ", default mode: every signature accepted",
            "variants": {v: "python -m sidecar.cli serve --mode node " + " ".join(_VARIANT_FLAGS[v]) for v in VARIANTS},
            "sidecar": "python -m sidecar.cli serve --mode sidecar --upstream unix://<daemon socket>, "
                       f"AWS_ACCESS_KEY_ID={POD_CREDENTIALS['AWS_ACCESS_KEY_ID']} in its environment",
            "auth_decision_ttl_s": measured.pop("auth_decision_ttl_s"),
            "client": "http.client in this process, one kept-alive connection per thread, bodies read with readinto",
            "order": "rounds interleaved, the variants' order rotated each round",
            "statistic": "median over rounds; ratios of the medians against plain; paired_median: median of same-round ratios",
            "mb": "10^6 bytes",
        },
        **measured,
        "elapsed_s": round(time.monotonic() - began, 1),
    }
    path = write_results(args.results_dir / ("auth-quick.json" if args.quick else "auth.json"), results)
    print(f"--auth sigv4 on warm reads: {args.threads} client threads, median of {args.rounds} interleaved rounds, "
          "MB = 10^6 B; control: a second plain daemon (the noise floor)\n")
    print_table(results)
    print(f"\n{results['elapsed_s']:.0f}s; results: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
