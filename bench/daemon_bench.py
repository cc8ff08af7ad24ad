"""Node daemon throughput: warm reads (raw file, S3 API over TCP, short-circuit) and cold reads
(through the daemon vs plain boto3 from the same origin), with the daemon's memory while serving.

One run, one generated dataset (WebDataset tar shards of JPEG-sized random samples), packed at
two shard sizes so the daemon's RSS can be seen not to grow with the object size. The S3 origin is
a moto server in its own process (objects held in RAM); the daemon is ``shardcache serve`` in its
own process, exactly as deployed. Every figure is measured ``--repeats`` times with the order of
the methods rotated between repeats (the machine is shared and noisy; ``download_fileobj``, which
leaves moto reclaiming gigabytes, always runs last and the origin settles after it); the median is
reported and the ratios are taken between medians of the same run.

    python -m bench.daemon_bench              # 1 GiB, 64 MiB and 512 MiB shards, 3 repeats
    python -m bench.daemon_bench --quick      # CI smoke run: 256 MiB, 1 repeat, < 2 minutes
    python -m bench.daemon_bench --size 4GiB --shard-sizes 128MiB,1GiB --repeats 5

Methods (MB/s = 10^6 bytes per second, payload bytes over wall time, single reader):

- ``raw``: the daemon's cached files read sequentially in Python (``readinto`` a 1 MiB buffer)
  from the page cache: the local limit every warm path is compared with.
- ``short_circuit``: per shard, ``GET`` with ``x-shardcache-short-circuit: 1`` over a kept-alive
  connection, then the same read of the file at ``x-shardcache-path``.
- ``boto3`` / ``aiohttp``: ``GET`` through the daemon's S3 API on TCP loopback.
- ``socket``: a minimal HTTP/1.1 client on a raw socket (``recv_into``), no client library: what
  the daemon itself can deliver over TCP, to tell daemon cost from client-library cost.
- cold, each on a fresh cache dir after dropping the page cache: ``origin_get_object`` (boto3
  ``get_object`` straight from moto), ``origin_download_fileobj`` (boto3's managed transfer: ranged
  GETs on 10 threads), ``daemon_cold`` (boto3 ``get_object`` through a fresh daemon with its default
  settings: one stream per object unless it is slow, bytes moved by aiohttp) and
  ``daemon_cold_boto3`` (the same daemon with ``--s3-client boto3``: boto3 calls on an executor),
  the measurement behind the daemon's choice of S3 client; ``daemon_cold_no_md5`` (the same
  daemon with ``--verify-etag-md5 off``): the benchmark uploads without additional checksums, so
  the default daemon verifies every fill against the ETag as an MD5 and this one verifies none,
  the measurement behind that setting's default; ``daemon_cold_buffered`` (``--direct-writes
  off``: fills written through the page cache, as streamed fills were until 2026-12-07), the
  measurement behind that one's; ``origin_get_object_x4`` and ``daemon_cold_x4``:
  four threads reading a quarter of the shards each, straight from the store and through a fresh
  daemon (several trainers of a node starting cold together); ``relay_x4``: the same four readers
  through ``bench.splice_relay``, a process that only moves the bytes (``splice``, no copy into
  user space): the least any process of its own on the read path costs, so its ratio to
  ``origin_get_object_x4`` bounds ``daemon_cold_x4``'s on the machine.

moto's objects are each read once before the first measurement: ``bench.servers.S3_LIKE_MOTO``
keeps an object's bytes from its first GET on, which would otherwise charge that copy to whichever
reader came first.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import http.client
import io
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import xxhash

from bench.common import (
    RESULTS_DIR,
    RssSampler,
    SendfileServer,
    cpu_seconds,
    drop_caches,
    fmt_size,
    machine_busy_seconds,
    machine_facts,
    make_samples,
    pack_shards,
    parse_size,
    s3_client,
    write_results,
)
from bench.latency_proxy import LatencyProxy
from bench.servers import STORE_DESCRIPTIONS, STORES, S3Server, ServeProcess, ServerProcess, store_server
from bench.splice_relay import SpliceRelay
from cache import aligned_buffer

BUCKET = "bench"
READ_CHUNK = 1024 * 1024
RSS_LIMIT_MB = 150.0

WARM_METHODS = ("raw", "short_circuit", "boto3", "aiohttp", "socket", "tcp_ceiling")
COLD_METHODS = ("origin_get_object", "origin_download_fileobj", "daemon_cold", "daemon_cold_boto3", "daemon_cold_no_md5",
                "daemon_cold_buffered", "origin_get_object_x4", "daemon_cold_x4", "relay_x4")
_COLD_FLAGS = {"daemon_cold": [], "daemon_cold_boto3": ["--s3-client", "boto3"], "daemon_cold_no_md5": ["--verify-etag-md5", "off"],
               "daemon_cold_buffered": ["--direct-writes", "off"],
               "daemon_cold_x4": []}
CONCURRENT_READERS = 4
"""Readers of the ``_x4`` methods: threads of one process, each reading every fourth shard."""

# (name, measured, baseline, minimum ratio): the targets, checked on medians.
TARGETS = (
    ("short_circuit_warm_vs_raw", "short_circuit", "raw", 0.9),
    ("daemon_warm_tcp_vs_raw", "best_tcp_client", "raw", 0.5),
    ("daemon_cold_vs_plain_boto3", "daemon_cold", "best_plain_boto3", 1.0),
    ("daemon_cold_x4_vs_plain_boto3_x4", "daemon_cold_x4", "origin_get_object_x4", 0.75),
)


class BenchError(RuntimeError):
    """A measurement that cannot be trusted (wrong byte count, a miss where a hit was expected)."""


@dataclass(frozen=True)
class Layout:
    """One packing of the dataset: shards of about ``shard_bytes`` under ``prefix``."""

    shard_bytes: int
    prefix: str
    keys: tuple[str, ...]
    sizes: tuple[int, ...]
    digests: tuple[str, ...]
    samples: int

    @property
    def total(self) -> int:
        return sum(self.sizes)

    @property
    def label(self) -> str:
        return fmt_size(self.shard_bytes).replace(".0 ", " ").replace(" ", "")


@dataclass
class Run:
    method: str
    seconds: float
    bytes: int
    cpu_s: dict[str, float] = field(default_factory=dict)
    """CPU seconds (user + system) each process spent during the run: client (this process),
    daemon, origin (moto), server (the loopback-ceiling server)."""
    machine_busy_s: float = 0.0
    """Every process's CPU on the machine over the run (``bench.common.machine_busy_seconds``)."""

    @property
    def mb_s(self) -> float:
        return self.bytes / self.seconds / 1e6


@dataclass
class LayoutResult:
    layout: Layout
    runs: dict[str, list[Run]] = field(default_factory=dict)
    rss: list[dict[str, Any]] = field(default_factory=list)
    ask_ms: list[float] = field(default_factory=list)
    warm_passes: int = 1

    def add(self, run: Run) -> None:
        self.runs.setdefault(run.method, []).append(run)

    def median(self, method: str) -> float | None:
        runs = self.runs.get(method)
        return statistics.median(r.mb_s for r in runs) if runs else None


# -- the daemon under test --------------------------------------------------------------------


class Daemon(ServeProcess):
    """``python -m sidecar.cli serve`` as a subprocess on a fresh cache dir, started (and ready)
    when made."""

    def __init__(self, workdir: Path, name: str, origin: str, cache_size: int, extra: list[str]) -> None:
        self.cache_dir = workdir / f"cache-{name}"
        shutil.rmtree(self.cache_dir, ignore_errors=True)
        super().__init__(workdir / f"daemon-{name}.log", [
            "--origin", "s3", "--s3-endpoint", origin, "--cache-dir", str(self.cache_dir),
            "--cache-size", str(cache_size), "--min-free", "0", *extra,
        ])
        self.start()

    def settle(self, timeout: float = 120.0) -> None:
        """A reader can finish before its fill is published (fsync, rename): wait for that."""
        super().settle(timeout)

    def stop(self, timeout: float = 15.0) -> None:
        super().stop(timeout)
        shutil.rmtree(self.cache_dir, ignore_errors=True)


# -- readers ----------------------------------------------------------------------------------


def read_file(path: str, buffer: memoryview) -> int:
    total = 0
    with open(path, "rb", buffering=0) as handle:
        while True:
            got = handle.readinto(buffer)
            if not got:
                return total
            total += got


def read_raw(paths: list[str]) -> int:
    buffer = aligned_buffer(READ_CHUNK)
    return sum(read_file(path, buffer) for path in paths)


def short_circuit_ask(conn: http.client.HTTPConnection, key: str) -> str:
    conn.request("GET", f"/{BUCKET}/{key}", headers={"x-shardcache-short-circuit": "1"})
    resp = conn.getresponse()
    resp.read()
    path = resp.getheader("x-shardcache-path")
    if resp.status != 200 or not path:
        raise BenchError(f"short-circuit GET of {key} answered {resp.status} without x-shardcache-path")
    return path


def read_short_circuit(port: int, keys: tuple[str, ...]) -> int:
    buffer = aligned_buffer(READ_CHUNK)
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        return sum(read_file(short_circuit_ask(conn, key), buffer) for key in keys)
    finally:
        conn.close()


def read_boto3(client: Any, keys: tuple[str, ...], expect_cache: str | None) -> int:
    total = 0
    for key in keys:
        resp = client.get_object(Bucket=BUCKET, Key=key)
        state = resp["ResponseMetadata"]["HTTPHeaders"].get("x-shardcache-cache")
        if expect_cache is not None and state != expect_cache:
            raise BenchError(f"{key}: x-shardcache-cache is {state!r}, expected {expect_cache!r}")
        body = resp["Body"]
        while chunk := body.read(READ_CHUNK):
            total += len(chunk)
    return total


def read_boto3_concurrently(client: Any, keys: tuple[str, ...], expect_cache: str | None) -> int:
    """:func:`read_boto3` on :data:`CONCURRENT_READERS` threads, each reading every fourth shard
    (boto3 clients are thread-safe): several trainers of one node starting cold together."""
    from concurrent.futures import ThreadPoolExecutor

    shares = [keys[i::CONCURRENT_READERS] for i in range(CONCURRENT_READERS)]
    with ThreadPoolExecutor(CONCURRENT_READERS) as pool:
        return sum(pool.map(lambda share: read_boto3(client, share, expect_cache), shares))


class CountingSink(io.RawIOBase):
    """A seekable file that keeps nothing: s3transfer writes parts as they land (to a non-seekable
    one it would queue out-of-order parts in RAM), and the bytes written are counted."""

    def __init__(self) -> None:
        self.count = 0
        self.position = 0

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        if whence != 0:
            raise OSError("CountingSink seeks from the start only")
        self.position = offset
        return offset

    def tell(self) -> int:
        return self.position

    def write(self, data: Any) -> int:
        size = len(memoryview(data).cast("B"))
        self.count += size
        self.position += size
        return size


def read_download_fileobj(client: Any, keys: tuple[str, ...]) -> int:
    """boto3's managed download (default TransferConfig: 8 MiB ranged GETs on 10 threads)."""
    total = 0
    for key in keys:
        sink = CountingSink()
        client.download_fileobj(BUCKET, key, sink)
        total += sink.count
    return total


def read_aiohttp(url: str, keys: tuple[str, ...]) -> int:
    async def main() -> int:
        total = 0
        # A read buffer above the 64 KiB default: fewer, larger reads (the best of the settings tried).
        async with aiohttp.ClientSession(read_bufsize=4 * READ_CHUNK, auto_decompress=False) as session:
            for key in keys:
                async with session.get(f"{url}/{BUCKET}/{key}") as resp:
                    if resp.status != 200 or resp.headers.get("x-shardcache-cache") != "hit":
                        raise BenchError(f"{key}: aiohttp GET answered {resp.status} "
                                         f"{resp.headers.get('x-shardcache-cache')!r}")
                    async for chunk in resp.content.iter_any():
                        total += len(chunk)
        return total

    return asyncio.run(main())


def read_socket(port: int, keys: tuple[str, ...], bucket: str = BUCKET) -> int:
    """HTTP/1.1 keep-alive GETs on one socket, bodies received with ``recv_into`` a 1 MiB buffer."""
    buffer = aligned_buffer(READ_CHUNK)
    total = 0
    path = f"/{bucket}/" if bucket else "/"
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        for key in keys:
            sock.sendall(f"GET {path}{key} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode())
            head = b""
            while b"\r\n\r\n" not in head:
                chunk = sock.recv(65536)
                if not chunk or len(head) > 65536:
                    raise BenchError(f"{key}: connection closed in the response head")
                head += chunk
            head, _, rest = head.partition(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            if not lines[0].startswith("HTTP/1.1 200"):
                raise BenchError(f"{key}: {lines[0]}")
            headers = {name.strip().lower(): value.strip() for name, _, value in (line.partition(":") for line in lines[1:])}
            remaining = int(headers["content-length"]) - len(rest)
            total += len(rest)
            while remaining > 0:
                got = sock.recv_into(buffer[:min(remaining, READ_CHUNK)])
                if not got:
                    raise BenchError(f"{key}: connection closed with {remaining} bytes to go")
                remaining -= got
                total += got
    return total


def _self_cpu() -> float:
    times = os.times()
    return times.user + times.system


def timed(method: str, expected: int, fn: Callable[[], int], pids: dict[str, int]) -> Run:
    """Run a reader once; its wall time, and the CPU time of this process and of ``pids``."""
    cpu_before = {name: cpu_seconds(pid) for name, pid in pids.items()}
    client_before = _self_cpu()
    busy_before = machine_busy_seconds()
    began = time.perf_counter()
    got = fn()
    seconds = time.perf_counter() - began
    busy = machine_busy_seconds() - busy_before
    cpu = {"client": _self_cpu() - client_before}
    cpu.update({name: cpu_seconds(pid) - cpu_before[name] for name, pid in pids.items()})
    if got != expected:
        raise BenchError(f"{method}: read {got} bytes, the dataset has {expected}")
    return Run(method, seconds, got, {name: round(value, 3) for name, value in cpu.items()}, round(busy, 3))


def ask_latency_ms(port: int, key: str, count: int = 200) -> float:
    """Median wall time of one short-circuit ask on a kept-alive connection (no file read)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        short_circuit_ask(conn, key)
        laps = []
        for _ in range(count):
            began = time.perf_counter()
            short_circuit_ask(conn, key)
            laps.append(time.perf_counter() - began)
    finally:
        conn.close()
    return statistics.median(laps) * 1000


# -- the run ----------------------------------------------------------------------------------


def upload(client: Any, size: int, shard_bytes: int, seed: int, checksum: str = "crc64nvme") -> Layout:
    """Put the shards; ``checksum`` is the additional checksum stored with each (``none``: only
    the ETag, an MD5: what a fill is then verified against, if at all)."""
    prefix = f"shards-{shard_bytes}/"
    keys, sizes, digests = [], [], []
    samples = 0
    extra = {} if checksum == "none" else {"ChecksumAlgorithm": checksum.upper()}
    for name, data, count in pack_shards(make_samples(size, seed), shard_bytes):
        key = prefix + name
        client.put_object(Bucket=BUCKET, Key=key, Body=data, **extra)
        keys.append(key)
        sizes.append(len(data))
        digests.append(xxhash.xxh3_128_hexdigest(data))
        samples += count
    return Layout(shard_bytes, prefix, tuple(keys), tuple(sizes), tuple(digests), samples)


def check_bytes(layout: Layout, daemon: Daemon, client: Any) -> None:
    """Untimed: the first shard read through each path is the shard that was uploaded."""
    key, digest = layout.keys[0], layout.digests[0]
    via_boto3 = client.get_object(Bucket=BUCKET, Key=key)["Body"].read()
    conn = http.client.HTTPConnection("127.0.0.1", daemon.port, timeout=60)
    try:
        with open(short_circuit_ask(conn, key), "rb") as handle:
            via_file = handle.read()
    finally:
        conn.close()
    for what, data in (("boto3 through the daemon", via_boto3), ("short-circuit file", via_file)):
        if xxhash.xxh3_128_hexdigest(data) != digest:
            raise BenchError(f"{key}: bytes read via {what} differ from the uploaded shard")


def rotate(items: tuple[str, ...], by: int) -> tuple[str, ...]:
    by %= len(items)
    return items[by:] + items[:by]


# Measured after download_fileobj on moto (a copy of the whole object per ranged GET: gigabytes of
# allocations the kernel then reclaims), a cold fill ran 10-15% slower at 25% more CPU. In a plain
# rotation the same method always follows it (daemon_cold did, and looked 2x worse than
# daemon_cold_boto3); so it runs last in each repeat, and the origin settles after it.
HEAVY_COLD = "origin_download_fileobj"


def cold_order(rep: int) -> tuple[str, ...]:
    light = tuple(m for m in COLD_METHODS if m != HEAVY_COLD)
    return (*rotate(light, rep), HEAVY_COLD)


class Bench:
    def __init__(self, args: argparse.Namespace, workdir: Path, store: S3Server, origin_endpoint: str,
                 origin_pids: dict[str, int]) -> None:
        self.args = args
        self.workdir = workdir
        self.upload_client = store.client()
        # Cold reads (plain boto3 and the daemon alike) go to the origin as configured: the store
        # itself, or the store behind the latency proxy (--origin-delay-ms / --origin-stream-mbps).
        self.origin_endpoint = origin_endpoint
        self.origin_client = s3_client(origin_endpoint)
        self.origin_pids = origin_pids
        self.dropped: list[bool] = []

    def say(self, text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    def cold_start(self) -> None:
        if not self.args.no_drop_caches:
            self.dropped.append(drop_caches())

    def settle_origin(self, idle_share: float = 0.05, limit_s: float = 30.0) -> None:
        """Wait until the origin processes use under ``idle_share`` of a core (at most
        ``limit_s``): what a heavy method left behind must not land in the next measurement."""
        deadline = time.monotonic() + limit_s
        while time.monotonic() < deadline:
            before = sum(cpu_seconds(pid) for pid in self.origin_pids.values())
            time.sleep(0.5)
            if sum(cpu_seconds(pid) for pid in self.origin_pids.values()) - before < 0.5 * idle_share:
                return

    def daemon(self, layout: Layout, name: str, extra: list[str] | None = None) -> Daemon:
        cache_size = max(4 << 30, 2 * layout.total)
        return Daemon(self.workdir, name, self.origin_endpoint, cache_size, extra or [])

    def run_layout(self, layout: Layout) -> LayoutResult:
        result = LayoutResult(layout)
        for rep in range(self.args.repeats):
            self.say(f"[{layout.label}] repeat {rep + 1}/{self.args.repeats}: cold")
            warm_daemon: Daemon | None = None
            try:
                for method in cold_order(rep):
                    daemon = self.cold(result, layout, method, rep)
                    if daemon is not None:
                        warm_daemon = daemon
                self.settle_origin()
                assert warm_daemon is not None
                if not self.args.cold_only:
                    self.say(f"[{layout.label}] repeat {rep + 1}/{self.args.repeats}: warm")
                    self.warm(result, layout, warm_daemon, rep)
            finally:
                if warm_daemon is not None:
                    warm_daemon.stop()
        return result

    def cold(self, result: LayoutResult, layout: Layout, method: str, rep: int) -> Daemon | None:
        """One cold measurement; returns the default daemon (kept, now warm) after ``daemon_cold``."""
        keys = layout.keys
        origin = dict(self.origin_pids)
        if method == "origin_get_object":
            self.cold_start()
            result.add(timed(method, layout.total, lambda: read_boto3(self.origin_client, keys, None), origin))
            return None
        if method == "origin_get_object_x4":
            self.cold_start()
            result.add(timed(method, layout.total,
                             lambda: read_boto3_concurrently(s3_client(self.origin_endpoint), keys, None), origin))
            return None
        if method == "relay_x4":
            # The same four readers through bench.splice_relay: the least any process of its own on
            # the read path costs, the bound of daemon_cold_x4 on this machine.
            with SpliceRelay(self.origin_endpoint.removeprefix("http://"), self.workdir / "relay.log") as relay:
                self.cold_start()
                result.add(timed(method, layout.total,
                                 lambda: read_boto3_concurrently(s3_client(relay.endpoint), keys, None),
                                 {**origin, "relay": relay.pid}))
            return None
        if method == "origin_download_fileobj":
            self.cold_start()
            result.add(timed(method, layout.total, lambda: read_download_fileobj(self.origin_client, keys), origin))
            return None
        extra = _COLD_FLAGS[method]
        daemon = self.daemon(layout, f"{layout.label}-{rep}-{method}", extra)
        try:
            client = s3_client(daemon.url)
            self.cold_start()
            read = read_boto3_concurrently if method.endswith("_x4") else read_boto3
            with RssSampler(daemon.pid) as rss:
                result.add(timed(method, layout.total, lambda: read(client, keys, "miss"),
                                 {**origin, "daemon": daemon.pid}))
                daemon.settle()
            result.rss.append({"phase": method, "repeat": rep, "max_vmrss_mb": rss.max_rss_kib / 1024,
                               "vmhwm_mb": rss.hwm_kib / 1024, "samples": rss.samples})
        except BaseException:
            daemon.stop()
            raise
        if method == "daemon_cold":
            return daemon
        daemon.stop()
        return None

    def warm(self, result: LayoutResult, layout: Layout, daemon: Daemon, rep: int) -> None:
        keys = layout.keys
        client = s3_client(daemon.url)
        check_bytes(layout, daemon, client)
        conn = http.client.HTTPConnection("127.0.0.1", daemon.port, timeout=60)
        try:
            paths = [short_circuit_ask(conn, key) for key in keys]
        finally:
            conn.close()
        read_raw(paths)  # the files were just written: make sure every page is resident
        # A page-cache read of 1 GiB takes ~0.1 s: read the dataset several times per measurement
        # so that each one lasts long enough to be above timer and scheduler noise.
        began = time.perf_counter()
        read_raw(paths)
        passes = max(1, min(50, round(self.args.warm_seconds / (time.perf_counter() - began))))
        result.warm_passes = passes
        result.ask_ms.append(ask_latency_ms(daemon.port, keys[0]))
        relative = [str(Path(path).relative_to(daemon.cache_dir)) for path in paths]
        served = {"daemon": daemon.pid}
        with SendfileServer(daemon.cache_dir, self.workdir / "sendfile.log") as ceiling, \
                RssSampler(daemon.pid) as rss:
            readers: dict[str, tuple[Callable[[], int], dict[str, int]]] = {
                "raw": (lambda: read_raw(paths), {}),
                "short_circuit": (lambda: read_short_circuit(daemon.port, keys), served),
                "boto3": (lambda: read_boto3(client, keys, "hit"), served),
                "aiohttp": (lambda: read_aiohttp(daemon.url, keys), served),
                "socket": (lambda: read_socket(daemon.port, keys), served),
                "tcp_ceiling": (lambda: read_socket(ceiling.port, tuple(relative), bucket=""),
                                {"server": ceiling.proc.pid}),  # type: ignore[union-attr]
            }
            for method in rotate(WARM_METHODS, rep):
                reader, pids = readers[method]
                result.add(timed(method, passes * layout.total,
                                 lambda: sum(reader() for _ in range(passes)), pids))  # noqa: B023
        result.rss.append({"phase": "warm", "repeat": rep, "max_vmrss_mb": rss.max_rss_kib / 1024,
                           "vmhwm_mb": rss.hwm_kib / 1024, "samples": rss.samples})
        if not self.args.no_drop_caches and drop_caches():
            # For context only: the cache files read back from the disk, page cache dropped.
            result.add(timed("raw_disk", layout.total, lambda: read_raw(paths), {}))


# -- report -----------------------------------------------------------------------------------


def summarize(result: LayoutResult) -> dict[str, Any]:
    layout = result.layout
    methods: dict[str, Any] = {}
    for method, runs in result.runs.items():
        rates = [r.mb_s for r in runs]
        names = sorted({name for r in runs for name in r.cpu_s})
        methods[method] = {
            "median_mb_s": round(statistics.median(rates), 1),
            "best_mb_s": round(max(rates), 1),
            "runs_mb_s": [round(rate, 1) for rate in rates],
            "runs_s": [round(r.seconds, 4) for r in runs],
            "bytes_per_run": runs[0].bytes,
            # CPU seconds per GB moved, per process: where the work goes on a 2-core machine.
            "cpu_s_per_gb": {name: round(statistics.median(r.cpu_s.get(name, 0.0) / (r.bytes / 1e9) for r in runs), 3)
                             for name in names},
            # At the machine's core count, the method was bound by CPU (whoever spent it).
            "machine_cores_busy": round(statistics.median(r.machine_busy_s / r.seconds for r in runs), 2),
        }
    med = result.median
    raw = med("raw")
    tcp = {m: med(m) for m in ("boto3", "aiohttp") if med(m) is not None}
    best_tcp = max(tcp, key=lambda m: tcp[m]) if tcp else None
    plain = {m: med(m) for m in ("origin_get_object", "origin_download_fileobj") if med(m) is not None}
    best_plain = max(plain, key=lambda m: plain[m]) if plain else None

    def ratio(a: float | None, b: float | None) -> float | None:
        return round(a / b, 3) if a is not None and b else None

    ratios = {
        "short_circuit/raw": ratio(med("short_circuit"), raw),
        "tcp_ceiling/raw": ratio(med("tcp_ceiling"), raw),
        "socket/tcp_ceiling": ratio(med("socket"), med("tcp_ceiling")),
        "aiohttp/tcp_ceiling": ratio(med("aiohttp"), med("tcp_ceiling")),
        "boto3/tcp_ceiling": ratio(med("boto3"), med("tcp_ceiling")),
        "boto3/raw": ratio(med("boto3"), raw),
        "aiohttp/raw": ratio(med("aiohttp"), raw),
        "socket/raw": ratio(med("socket"), raw),
        "daemon_cold/origin_get_object": ratio(med("daemon_cold"), med("origin_get_object")),
        "daemon_cold/origin_download_fileobj": ratio(med("daemon_cold"), med("origin_download_fileobj")),
        "daemon_cold_boto3/origin_get_object": ratio(med("daemon_cold_boto3"), med("origin_get_object")),
        "daemon_cold_boto3/origin_download_fileobj": ratio(
            med("daemon_cold_boto3"), med("origin_download_fileobj")),
        "daemon_cold_no_md5/origin_get_object": ratio(med("daemon_cold_no_md5"), med("origin_get_object")),
        "daemon_cold/daemon_cold_no_md5": ratio(med("daemon_cold"), med("daemon_cold_no_md5")),
        "daemon_cold_buffered/origin_get_object": ratio(med("daemon_cold_buffered"), med("origin_get_object")),
        "daemon_cold/daemon_cold_buffered": ratio(med("daemon_cold"), med("daemon_cold_buffered")),
        "daemon_cold_x4/origin_get_object_x4": ratio(med("daemon_cold_x4"), med("origin_get_object_x4")),
        "daemon_cold_x4/daemon_cold": ratio(med("daemon_cold_x4"), med("daemon_cold")),
        "relay_x4/origin_get_object_x4": ratio(med("relay_x4"), med("origin_get_object_x4")),
        "daemon_cold_x4/relay_x4": ratio(med("daemon_cold_x4"), med("relay_x4")),
    }
    values = {
        "short_circuit": med("short_circuit"), "raw": raw,
        "best_tcp_client": tcp[best_tcp] if best_tcp else None,
        "daemon_cold": med("daemon_cold"),
        "best_plain_boto3": plain[best_plain] if best_plain else None,
        "daemon_cold_x4": med("daemon_cold_x4"), "origin_get_object_x4": med("origin_get_object_x4"),
    }
    targets = {}
    for name, measured, baseline, minimum in TARGETS:
        value = ratio(values[measured], values[baseline])
        targets[name] = {"ratio": value, "target": minimum, "met": value is not None and value >= minimum,
                         "measured": measured if measured != "best_tcp_client" else best_tcp,
                         "baseline": baseline if baseline != "best_plain_boto3" else best_plain}
    if "relay_x4" in methods:
        # What a process of its own between the readers and the store allows here at most.
        targets["daemon_cold_x4_vs_plain_boto3_x4"]["bound"] = ratios["relay_x4/origin_get_object_x4"]
    peak = max((r["vmhwm_mb"] for r in result.rss), default=None)
    sampled = max((r["max_vmrss_mb"] for r in result.rss), default=None)
    targets["daemon_rss_under_150mb"] = {"peak_vmhwm_mb": round(peak, 1) if peak else None,
                                         "max_sampled_vmrss_mb": round(sampled, 1) if sampled else None,
                                         "target_mb": RSS_LIMIT_MB, "met": peak is not None and peak < RSS_LIMIT_MB}
    return {
        "shard_bytes": layout.shard_bytes, "shards": len(layout.keys), "dataset_bytes": layout.total,
        "samples": layout.samples, "mean_shard_bytes": layout.total // max(1, len(layout.keys)),
        "warm_passes": result.warm_passes,
        "short_circuit_ask_ms_median": round(statistics.median(result.ask_ms), 3) if result.ask_ms else None,
        "methods": methods, "ratios": ratios, "targets": targets,
        "rss": [{k: (round(v, 1) if isinstance(v, float) else v) for k, v in r.items()} for r in result.rss],
    }


def print_table(summaries: dict[str, dict[str, Any]]) -> None:
    rows = [("layout", "method", "median MB/s", "best MB/s", "vs", "ratio", "cores busy", "CPU s/GB")]
    for label, summary in summaries.items():
        methods, ratios = summary["methods"], summary["ratios"]
        for method in (*WARM_METHODS, "raw_disk", *COLD_METHODS):
            if method not in methods:
                continue
            vs, ratio = "", ""
            if method in ("short_circuit", "boto3", "aiohttp", "socket", "tcp_ceiling"):
                vs, ratio = "raw", ratios[f"{method}/raw"]
            elif method in ("daemon_cold_x4", "relay_x4"):
                vs, ratio = "get_object_x4", ratios[f"{method}/origin_get_object_x4"]
            elif method.startswith("daemon_cold"):
                vs, ratio = "get_object", ratios[f"{method}/origin_get_object"]
            cpu = " ".join(f"{name}={value:.2f}" for name, value in methods[method]["cpu_s_per_gb"].items())
            rows.append((label, method, f"{methods[method]['median_mb_s']:.0f}", f"{methods[method]['best_mb_s']:.0f}",
                         vs, "" if ratio in ("", None) else f"{ratio:.2f}x",
                         f"{methods[method].get('machine_cores_busy', 0):.2f}", cpu))
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(rows[0]))]
    for index, row in enumerate(rows):
        print("  ".join(str(cell).ljust(width) if i < 2 or i == 7 else str(cell).rjust(width)
                        for i, (cell, width) in enumerate(zip(row, widths, strict=True))))
        if index == 0:
            print("  ".join("-" * width for width in widths))
    print()
    for label, summary in summaries.items():
        print(f"[{label}] {summary['shards']} shards, warm figures over {summary['warm_passes']} pass(es) of the "
              f"dataset; one short-circuit ask takes {summary['short_circuit_ask_ms_median']} ms (median)")
    print()
    print("targets:")
    for label, summary in summaries.items():
        for name, target in summary["targets"].items():
            verdict = "MET" if target["met"] else "MISSED"
            if "ratio" in target:
                detail = (f"{target['measured']} / {target['baseline']} = {target['ratio']}x "
                          f"(target >= {target['target']}x)")
            else:
                detail = (f"peak VmHWM {target['peak_vmhwm_mb']} MB, max sampled VmRSS "
                          f"{target['max_sampled_vmrss_mb']} MB (target < {target['target_mb']:.0f} MB)")
            print(f"  [{label}] {name}: {verdict}  {detail}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.daemon_bench",
        description="Warm and cold read throughput of the node daemon against raw file reads and plain "
                    "boto3, and its memory while serving. Writes bench/results/daemon.json.",
        epilog="examples:\n  python -m bench.daemon_bench --quick\n"
               "  python -m bench.daemon_bench --size 2GiB --shard-sizes 64MiB,512MiB --repeats 5",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--size", default=None, help="dataset payload size (default 1GiB; 256MiB with --quick)")
    parser.add_argument("--shard-sizes", default=None,
                        help="comma-separated shard sizes (default 64MiB,512MiB; 32MiB,128MiB with --quick)")
    parser.add_argument("--repeats", type=int, default=None, help="measurements per method (default 3; 1 with --quick)")
    parser.add_argument("--quick", action="store_true", help="small CI smoke run")
    parser.add_argument("--seed", type=int, default=0, help="dataset seed")
    parser.add_argument("--warm-seconds", type=float, default=None,
                        help="read the dataset enough times that a raw read lasts this long (default 0.5; 0.2 with --quick)")
    parser.add_argument("--no-drop-caches", action="store_true", help="never drop the page cache")
    parser.add_argument("--workdir", type=Path, default=None, help="where caches and logs go (default: a temp dir)")
    parser.add_argument("--keep", action="store_true", help="keep the work dir (daemon and moto logs)")
    parser.add_argument("--origin-delay-ms", type=float, default=0.0,
                        help="put moto behind bench.latency_proxy with this delay per request (a remote store)")
    parser.add_argument("--origin-stream-mbps", type=float, default=None,
                        help="and cap each origin connection at this many MB/s (AWS: 85-90 MB/s per request)")
    parser.add_argument("--store", choices=STORES, default="moto",
                        help="the S3 server: moto (objects in RAM) or s3rver (objects in files; needs node and npm)")
    parser.add_argument("--stock-moto", action="store_true",
                        help="moto as shipped (every ranged GET copies the whole object); default: ranges cost the "
                             "range, as on S3 and as in the suite (bench.servers.S3_LIKE_MOTO)")
    parser.add_argument("--cold-only", action="store_true", help="measure the cold methods only")
    parser.add_argument("--upload-checksum", choices=["crc64nvme", "crc32", "none"], default="crc64nvme",
                        help="additional checksum stored with each shard: crc64nvme (default: what S3 stores for every "
                             "new object since 2024-12), crc32 (boto3's upload default), none (ETag only: fills are "
                             "verified as MD5, and daemon_cold_no_md5 measures what that costs)")
    parser.add_argument("--output", type=Path, default=None,
                        help="JSON result file (default bench/results/daemon.json; daemon-remote.json for a remote origin, "
                             "-cold for --cold-only, -none/-crc32 for --upload-checksum)")
    args = parser.parse_args(argv)
    if args.output is None:
        remote = args.origin_delay_ms > 0 or args.origin_stream_mbps
        name = ("daemon" + ("" if args.store == "moto" else f"-{args.store}") + ("-remote" if remote else "")
                + ("-cold" if args.cold_only else "") + ("" if args.upload_checksum == "crc64nvme" else f"-{args.upload_checksum}"))
        args.output = RESULTS_DIR / f"{name}.json"
    args.size = parse_size(args.size or ("256MiB" if args.quick else "1GiB"))
    args.shard_sizes = [parse_size(s) for s in (args.shard_sizes or ("32MiB,128MiB" if args.quick else "64MiB,512MiB"))
                        .split(",")]
    args.repeats = args.repeats or (1 if args.quick else 3)
    args.warm_seconds = args.warm_seconds if args.warm_seconds is not None else (0.2 if args.quick else 0.5)
    if args.repeats < 1 or args.size <= 0 or any(s <= 0 for s in args.shard_sizes):
        parser.error("--repeats, --size and --shard-sizes must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    began = time.monotonic()
    facts = machine_facts()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="shardcache-daemon-bench-"))
    workdir.mkdir(parents=True, exist_ok=True)
    summaries: dict[str, dict[str, Any]] = {}
    bench: Bench | None = None
    try:
        with store_server(args.store, workdir, s3_like=not args.stock_moto) as store, contextlib.ExitStack() as stack:
            origin: ServerProcess = store
            origin_pids = {"origin": store.pid}
            if args.origin_delay_ms > 0 or args.origin_stream_mbps:
                origin = stack.enter_context(LatencyProxy(store.endpoint, args.origin_delay_ms, args.origin_stream_mbps,
                                                          workdir / "proxy.log"))
                origin_pids["proxy"] = origin.pid
            bench = Bench(args, workdir, store, origin.endpoint, origin_pids)
            bench.upload_client.create_bucket(Bucket=BUCKET)
            layouts = []
            for shard_bytes in args.shard_sizes:
                t0 = time.perf_counter()
                layout = upload(bench.upload_client, args.size, shard_bytes, args.seed, args.upload_checksum)
                bench.say(f"uploaded {len(layout.keys)} shards of ~{fmt_size(shard_bytes)} "
                          f"({fmt_size(layout.total)}, {layout.samples} samples) in {time.perf_counter() - t0:.1f}s")
                layouts.append(layout)
            for layout in layouts:  # see the module's docstring: no reader pays moto's first copy
                for key in layout.keys:
                    bench.upload_client.get_object(Bucket=BUCKET, Key=key)["Body"].read()
            with RssSampler(store.pid) as store_rss:
                for layout in layouts:
                    summaries[layout.label] = summarize(bench.run_layout(layout))
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    dropped = bench.dropped if bench is not None else []
    page_cache = ("dropped before every cold run (echo 1 > /proc/sys/vm/drop_caches)" if dropped and all(dropped)
                  else "not dropped: --no-drop-caches" if args.no_drop_caches
                  else "not dropped: /proc/sys/vm/drop_caches is not writable here")
    facts["loadavg_end"] = os.getloadavg()
    all_met = all(t["met"] for s in summaries.values() for t in s["targets"].values())
    results = {
        "benchmark": "daemon",
        "machine": facts,
        "config": {"dataset_bytes": args.size, "shard_sizes": args.shard_sizes, "repeats": args.repeats,
                   "quick": args.quick, "seed": args.seed, "read_chunk_bytes": READ_CHUNK,
                   "origin": STORE_DESCRIPTIONS[args.store] + (
                       "" if args.store != "moto" else ", stock: every GET copies the whole object" if args.stock_moto
                       else ", a ranged GET costing the range as on S3 (bench.servers.S3_LIKE_MOTO)") + (
                       f" behind bench.latency_proxy: {args.origin_delay_ms:g} ms per request"
                       + (f", {args.origin_stream_mbps:g} MB/s per connection" if args.origin_stream_mbps else "")
                       if args.origin_delay_ms > 0 or args.origin_stream_mbps else ""),
                   "origin_delay_ms": args.origin_delay_ms, "origin_stream_mbps": args.origin_stream_mbps,
                   "cold_only": args.cold_only, "upload_checksum": args.upload_checksum,
                   "daemon": "python -m sidecar.cli serve",
                   "page_cache": page_cache, "store": args.store, "stock_moto": args.stock_moto,
                   "store_peak_rss_mb": round(store_rss.hwm_kib / 1024, 1),
                   "mb": "10^6 bytes", "statistic": "median of repeats; ratios of medians"},
        "layouts": summaries,
        "all_targets_met": all_met,
        "elapsed_s": round(time.monotonic() - began, 1),
    }
    path = write_results(args.output, results)
    print(f"daemon benchmark: {fmt_size(args.size)} dataset, {args.repeats} repeat(s), MB = 10^6 B, "
          f"median of repeats; page cache {page_cache}")
    print()
    print_table(summaries)
    print(f"\nall targets met: {'yes' if all_met else 'no'}; {results['elapsed_s']:.0f}s; results: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
