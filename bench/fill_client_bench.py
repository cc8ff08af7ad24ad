"""Cold fills through a native S3 client (awscrt) against the daemon's own fill path and plain
boto3, in one run, on the same objects (issue 28: "if the Python fill path itself is the bound,
consider a native client for fills").

    python -m bench.fill_client_bench              # 8 objects of 64 MiB, 1 and 4 at once, 3 repeats
    python -m bench.fill_client_bench --quick      # smoke: 4 objects of 16 MiB, 1 repeat (< 1 minute)
    python -m bench.fill_client_bench --objects 16 --object-size 128MiB --delay-ms 50 --repeats 5

The origin is a moto server (own process, objects in RAM) behind ``bench.latency_proxy`` (20 ms
per request by default), holding ``--objects`` random objects uploaded with a CRC64NVME
full-object checksum. Each measurement fills every object cold, ``--concurrency`` objects in
flight at a time (a thread per object in flight), each object written to a file on the local disk
and fsync'ed (the daemon fsyncs what it publishes, so every path pays for it), and every object
verified against its whole-object checksum. Paths:

- ``daemon``: a fresh ``shardcache serve`` (default settings, fresh cache dir) in front of the
  proxy, read cold through its S3 API: boto3 ``get_object`` of each object (answered
  ``x-shardcache-cache: miss``), body discarded as it arrives, and the clock stops when the daemon
  has no fill in flight (every entry sealed, verified, fsync'ed and published), as
  ``bench.daemon_bench``'s ``daemon_cold``. The daemon writes its cache file with ``O_DIRECT``
  where the file system takes it (its default). Its CPU is the daemon process's (``/proc/<pid>/stat``);
  verification is the daemon's own (its ``/stats`` must count one CRC64NVME-verified fill per
  object).
- ``awscrt``: ``awscrt.s3.S3Client`` (``GET_OBJECT`` meta requests: a HEAD, then ``--part-size``
  ranged GETs in parallel, checksums in C) writing with ``recv_filepath``, response checksum
  validation on (``S3ChecksumConfig(validate_response=True)``): every object must come back with
  ``did_validate_checksum`` and CRC64NVME. Plain HTTP (``tls_mode=DISABLED``), path-style request
  (``/bucket/key``), ``Host: 127.0.0.1:<proxy port>`` (the CRT connects to the Host header's
  host and port), static credentials. Buffered writes, as the boto3 paths'.
- ``awscrt_direct``: the same with ``fio_options=S3FileIoOptions(direct_io=True)``: the CRT writes
  the parts with ``O_DIRECT``, as the daemon writes its fills (``--direct-writes on``, its default):
  the like-for-like comparison with ``daemon``.
- ``awscrt_on_body``: the same client with an ``on_body`` callback that ``pwrite``\\ s each chunk
  into the file (what a daemon that keeps its own file, and streams to readers as it fills, would
  do: every chunk crosses into Python).
- ``boto3_get_object``: one plain boto3 ``get_object`` per object (``ChecksumMode=ENABLED``:
  botocore validates the CRC64NVME as the body streams), body written to the file in 1 MiB reads.
  The baseline every ratio is taken against.
- ``boto3_ranged_x4``: per object, a HEAD (size and CRC64NVME), then 4 ranged GETs on 4 threads,
  each ``pwrite``\\ ing its quarter and computing its CRC64NVME (awscrt's C CRC), the 4 combined and
  compared with the HEAD's.

For awscrt and boto3 the CPU is this process's (``getrusage(RUSAGE_SELF)``: every thread,
awscrt's native event-loop threads included), over the measurement. Every figure is the median of
``--repeats`` (the path order rotated between repeats); ratios are to ``boto3_get_object`` at the
same concurrency in the same run. Untimed after each measurement, every file written (for the
daemon, its cache file, found with a short-circuit ask) is read back and its CRC64NVME compared
with the uploaded object's.

The moto server is ``moto.server`` with two changes (:data:`bench.servers.S3_LIKE_MOTO`), the same for every path:

- moto (5.x) answers a checksum only when ``x-amz-checksum-mode`` is exactly ``ENABLED``; awscrt
  sends ``enabled``, which S3 accepts. The header's value is upper-cased before moto sees it
  (boto3 and the daemon send ``ENABLED`` already). Without it awscrt's fills complete unvalidated.
- stock moto copies an object's whole bytes for every GET, ranged or not, so every part of a split
  fill (the daemon's, awscrt's, the ranged boto3 path's) costs it a whole object: 8x the bytes for
  64 MiB objects in 8 MiB parts, on the cores the fillers use. Each object's bytes are kept as one
  immutable bytes object instead, and a range costs the range. ``--stock-moto-ranges`` measures
  stock moto.

MB/s is 10^6 bytes per second; CPU s/GB is CPU seconds per 10^9 bytes filled.
"""

from __future__ import annotations

import argparse
import base64
import http.client
import os
import random
import resource
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

from awscrt.auth import AwsCredentialsProvider  # type: ignore[import-untyped]
from awscrt.checksums import combine_crc64nvme, crc64nvme  # type: ignore[import-untyped]
from awscrt.http import HttpHeaders, HttpRequest  # type: ignore[import-untyped]
from awscrt.s3 import (  # type: ignore[import-untyped]
    S3ChecksumConfig,
    S3Client,
    S3FileIoOptions,
    S3RequestTlsMode,
    S3RequestType,
    create_default_s3_signing_config,
)

from bench.common import (
    RESULTS_DIR,
    TEST_CREDENTIALS,
    cpu_seconds,
    fmt_size,
    log_line,
    machine_busy_seconds,
    machine_facts,
    parse_size,
    s3_client,
    write_results,
)
from bench.daemon_bench import Daemon, read_boto3, short_circuit_ask
from bench.latency_proxy import LatencyProxy
from bench.servers import MotoServer

BUCKET = "bench"
PREFIX = "fill/"
READ_CHUNK = 1024 * 1024
RANGES_PER_OBJECT = 4
BASELINE = "boto3_get_object"
PATHS = ("daemon", "awscrt", "awscrt_direct", "awscrt_on_body", "boto3_get_object", "boto3_ranged_x4")
FILLER = {path: "daemon" if path == "daemon" else "bench" for path in PATHS}
"""Whose CPU is the fill's: the daemon process, or this one (getrusage of the bench process)."""

REQUEST_TIMEOUT_S = 300.0

class BenchError(RuntimeError):
    """A measurement that cannot be trusted (wrong bytes, a fill not verified)."""


@dataclass(frozen=True)
class Obj:
    key: str
    size: int
    crc: int
    """CRC64NVME of the bytes (computed here, and equal to what moto stored: checked at upload)."""


@dataclass
class Run:
    path: str
    concurrency: int
    repeat: int
    seconds: float
    bytes: int
    cpu_s: dict[str, float]
    """CPU seconds over the run: ``bench`` (this process; also split as ``bench_user`` and
    ``bench_system``), ``daemon``, ``origin`` (moto), ``proxy``."""
    machine_busy_s: float
    verified: dict[str, Any] = field(default_factory=dict)

    @property
    def mb_s(self) -> float:
        return self.bytes / self.seconds / 1e6

    def cpu_per_gb(self, name: str) -> float:
        return self.cpu_s.get(name, 0.0) / (self.bytes / 1e9)


def _self_cpu() -> tuple[float, float]:
    """(user, system) CPU seconds of this process so far, every thread."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime, usage.ru_stime


def b64_crc(crc: int) -> str:
    return base64.b64encode(crc.to_bytes(8, "big")).decode()


def file_crc(path: str | Path) -> tuple[int, int]:
    """(size, CRC64NVME) of a file, read back in 8 MiB reads."""
    crc = 0
    size = 0
    with open(path, "rb", buffering=0) as handle:
        buffer = bytearray(8 * READ_CHUNK)
        view = memoryview(buffer)
        while got := handle.readinto(buffer):
            crc = crc64nvme(view[:got], crc)
            size += got
    return size, crc


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def each_object(concurrency: int, objects: Iterable[Obj], fill: Callable[[Obj], int]) -> int:
    """``fill`` every object, ``concurrency`` of them in flight at a time; the bytes filled."""
    with ThreadPoolExecutor(concurrency, thread_name_prefix="fill") as pool:
        return sum(pool.map(fill, objects))


# -- the paths --------------------------------------------------------------------------------


class CrtFiller:
    """awscrt's S3 client pointed at a plain-HTTP, path-style endpoint (``host:port``)."""

    def __init__(self, endpoint: str, part_size: int, throughput_gbps: float, on_body: bool, direct_io: bool = False) -> None:
        self.host = endpoint.removeprefix("http://").rstrip("/")
        self.on_body = on_body
        self.direct_io = direct_io
        credentials = AwsCredentialsProvider.new_static(TEST_CREDENTIALS["AWS_ACCESS_KEY_ID"],
                                                        TEST_CREDENTIALS["AWS_SECRET_ACCESS_KEY"])
        region = TEST_CREDENTIALS["AWS_DEFAULT_REGION"]
        self.client = S3Client(
            region=region,
            signing_config=create_default_s3_signing_config(region=region, credential_provider=credentials),
            tls_mode=S3RequestTlsMode.DISABLED,
            part_size=part_size,
            throughput_target_gbps=throughput_gbps,
        )

    def fill(self, obj: Obj, path: Path) -> tuple[int, dict[str, Any]]:
        request = HttpRequest("GET", f"/{BUCKET}/{quote(obj.key)}", HttpHeaders([("Host", self.host)]))
        done = threading.Event()
        outcome: dict[str, Any] = {}

        def on_done(**kwargs: Any) -> None:  # the future is resolved before on_done runs: wait for this
            outcome.update(kwargs)
            done.set()

        options: dict[str, Any] = {"type": S3RequestType.GET_OBJECT, "request": request,
                                   "checksum_config": S3ChecksumConfig(validate_response=True), "on_done": on_done}
        fd = -1
        if self.on_body:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            options["on_body"] = self._pwriter(fd)
        else:
            options["recv_filepath"] = str(path)
            if self.direct_io:
                options["fio_options"] = S3FileIoOptions(direct_io=True)
        try:
            meta = self.client.make_request(**options)
            meta.finished_future.result(REQUEST_TIMEOUT_S)
            if not done.wait(REQUEST_TIMEOUT_S):
                raise BenchError(f"awscrt: {obj.key}: on_done never came")
            if outcome.get("error") is not None:
                raise BenchError(f"awscrt: {obj.key}: {outcome['error']!r} (status {outcome.get('status_code')})")
            if fd >= 0:
                os.fsync(fd)
        finally:
            if fd >= 0:
                os.close(fd)
        if fd < 0:
            fsync_path(path)
        algorithm = outcome.get("checksum_validation_algorithm")
        return path.stat().st_size, {"validated": bool(outcome.get("did_validate_checksum")),
                                     "algorithm": algorithm.name.lower() if algorithm is not None else None}

    @staticmethod
    def _pwriter(fd: int) -> Callable[..., None]:
        def on_body(chunk: Any, offset: int, **_kwargs: Any) -> None:
            view = memoryview(chunk).cast("B")
            while view:
                written = os.pwrite(fd, view, offset)
                view = view[written:]
                offset += written

        return on_body

    def close(self) -> None:
        shutdown = self.client.shutdown_event
        del self.client
        shutdown.wait(10)


def boto3_fill(client: Any, obj: Obj, path: Path) -> tuple[int, dict[str, Any]]:
    """One ``get_object``, CRC64NVME validated by botocore as the body streams."""
    resp = client.get_object(Bucket=BUCKET, Key=obj.key, ChecksumMode="ENABLED")
    body = resp["Body"]
    # botocore wraps the body in a StreamingChecksumBody only when it validates a checksum; its
    # read() raises FlexibleChecksumError at the end of a body that does not match.
    validating = type(body).__name__ == "StreamingChecksumBody"
    header = resp["ResponseMetadata"]["HTTPHeaders"].get("x-amz-checksum-crc64nvme")
    total = 0
    with open(path, "wb", buffering=0) as handle:
        while chunk := body.read(READ_CHUNK):
            handle.write(chunk)
            total += len(chunk)
        os.fsync(handle.fileno())
    return total, {"validated": validating and header == b64_crc(obj.crc), "algorithm": "crc64nvme" if header else None}


def boto3_ranged_fill(client: Any, ranges_pool: ThreadPoolExecutor, obj: Obj, path: Path) -> tuple[int, dict[str, Any]]:
    """A HEAD (size, CRC64NVME), then :data:`RANGES_PER_OBJECT` ranged GETs on threads, each
    writing its part and computing its CRC; the part CRCs combined are checked against the HEAD's."""
    head = client.head_object(Bucket=BUCKET, Key=obj.key, ChecksumMode="ENABLED")
    size = int(head["ContentLength"])
    expected = head.get("ChecksumCRC64NVME")
    step = -(-size // RANGES_PER_OBJECT)
    bounds = [(start, min(size, start + step)) for start in range(0, size, step)]
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.ftruncate(fd, size)

        def part(bound: tuple[int, int]) -> tuple[int, int]:
            start, end = bound
            body = client.get_object(Bucket=BUCKET, Key=obj.key, Range=f"bytes={start}-{end - 1}")["Body"]
            crc = 0
            offset = start
            while chunk := body.read(READ_CHUNK):
                crc = crc64nvme(chunk, crc)
                view = memoryview(chunk)
                while view:
                    written = os.pwrite(fd, view, offset)
                    view = view[written:]
                    offset += written
            return offset - start, crc

        parts = list(ranges_pool.map(part, bounds))
        os.fsync(fd)
    finally:
        os.close(fd)
    total = sum(got for got, _ in parts)
    crc = parts[0][1] if parts else 0
    for (got, part_crc) in parts[1:]:
        crc = combine_crc64nvme(crc, part_crc, got)
    if expected is not None and b64_crc(crc) != expected:
        raise BenchError(f"boto3_ranged_x4: {obj.key}: combined CRC64NVME {b64_crc(crc)} != {expected}")
    return total, {"validated": expected is not None, "algorithm": "crc64nvme" if expected else None}


# -- the run ----------------------------------------------------------------------------------


class Bench:
    def __init__(self, args: argparse.Namespace, workdir: Path, store: MotoServer, proxy: LatencyProxy) -> None:
        self.args = args
        self.workdir = workdir
        self.store = store
        self.proxy = proxy
        self.objects: list[Obj] = []

    def upload(self) -> None:
        client = self.store.client()
        client.create_bucket(Bucket=BUCKET)
        rng = random.Random(self.args.seed)
        for index in range(self.args.objects):
            data = rng.randbytes(self.args.object_size)
            key = f"{PREFIX}obj-{index:04d}"
            resp = client.put_object(Bucket=BUCKET, Key=key, Body=data, ChecksumAlgorithm="CRC64NVME")
            crc = crc64nvme(data)
            if resp.get("ChecksumCRC64NVME") != b64_crc(crc):
                raise BenchError(f"{key}: moto stored CRC64NVME {resp.get('ChecksumCRC64NVME')}, expected {b64_crc(crc)}")
            self.objects.append(Obj(key, len(data), crc))
            del data
            # Untimed: the origin's first read of an object (with cheap ranges, the one copy kept).
            client.get_object(Bucket=BUCKET, Key=key, Range="bytes=0-0")["Body"].read()

    @property
    def total(self) -> int:
        return sum(obj.size for obj in self.objects)

    def measure(self, path: str, concurrency: int, repeat: int) -> Run:
        out = self.workdir / f"fill-{path}-{concurrency}-{repeat}"
        out.mkdir(parents=True, exist_ok=True)
        try:
            if path == "daemon":
                return self._daemon(concurrency, repeat)
            return self._in_process(path, concurrency, repeat, out)
        finally:
            shutil.rmtree(out, ignore_errors=True)

    def _pids(self) -> dict[str, int]:
        return {"origin": self.store.pid, "proxy": self.proxy.pid}

    def _timed(self, path: str, concurrency: int, repeat: int, fill: Callable[[], int], pids: dict[str, int]) -> Run:
        os.sync()  # what an earlier measurement left dirty is written back outside this one
        before = {name: cpu_seconds(pid) for name, pid in pids.items()}
        bench_before = _self_cpu()
        busy_before = machine_busy_seconds()
        began = time.perf_counter()
        got = fill()
        seconds = time.perf_counter() - began
        busy = machine_busy_seconds() - busy_before
        bench_after = _self_cpu()
        user, system = bench_after[0] - bench_before[0], bench_after[1] - bench_before[1]
        cpu = {"bench": user + system, "bench_user": user, "bench_system": system}
        cpu.update({name: cpu_seconds(pid) - before[name] for name, pid in pids.items()})
        if got != self.total:
            raise BenchError(f"{path} x{concurrency}: filled {got} bytes, the objects hold {self.total}")
        return Run(path, concurrency, repeat, seconds, got, {k: round(v, 3) for k, v in cpu.items()}, round(busy, 3))

    def _check_files(self, path: str, files: dict[str, Path]) -> None:
        """Untimed: every file written holds the uploaded object's bytes."""
        for obj in self.objects:
            size, crc = file_crc(files[obj.key])
            if size != obj.size or crc != obj.crc:
                raise BenchError(f"{path}: {obj.key}: the file written has {size} bytes, CRC64NVME {b64_crc(crc)}; "
                                 f"the object has {obj.size}, {b64_crc(obj.crc)}")

    def _in_process(self, path: str, concurrency: int, repeat: int, out: Path) -> Run:
        files = {obj.key: out / obj.key.replace("/", "_") for obj in self.objects}
        checks: dict[str, dict[str, Any]] = {}
        lock = threading.Lock()
        closers: list[Callable[[], None]] = []
        one: Callable[[Obj, Path], tuple[int, dict[str, Any]]]
        if path.startswith("awscrt"):
            crt = CrtFiller(self.proxy.endpoint, self.args.part_size, self.args.throughput_gbps, path == "awscrt_on_body",
                            direct_io=path == "awscrt_direct")
            closers.append(crt.close)
            one = crt.fill
        elif path == "boto3_get_object":
            client = s3_client(self.proxy.endpoint, max_pool=max(16, concurrency))
            one = lambda obj, file: boto3_fill(client, obj, file)  # noqa: E731
        elif path == "boto3_ranged_x4":
            client = s3_client(self.proxy.endpoint, max_pool=max(16, concurrency * (RANGES_PER_OBJECT + 1)))
            ranges = ThreadPoolExecutor(concurrency * RANGES_PER_OBJECT, thread_name_prefix="range")
            closers.append(ranges.shutdown)
            one = lambda obj, file: boto3_ranged_fill(client, ranges, obj, file)  # noqa: E731
        else:
            raise ValueError(f"unknown path {path!r}")

        def fill(obj: Obj) -> int:
            got, check = one(obj, files[obj.key])
            with lock:
                checks[obj.key] = check
            return got

        try:
            run = self._timed(path, concurrency, repeat, lambda: each_object(concurrency, self.objects, fill), self._pids())
        finally:
            for close in closers:
                close()
        not_validated = [key for key, check in checks.items() if not check["validated"]]
        algorithms = sorted({str(check["algorithm"]) for check in checks.values()})
        if not_validated:
            raise BenchError(f"{path} x{concurrency}: not checksum-validated: {', '.join(not_validated)} ({checks})")
        self._check_files(path, files)
        run.verified = {"checksum_ok": True, "validated_objects": len(checks), "algorithms": algorithms,
                        "by": {"awscrt": "awscrt (did_validate_checksum)", "awscrt_direct": "awscrt (did_validate_checksum)",
                               "awscrt_on_body": "awscrt (did_validate_checksum)",
                               "boto3_get_object": "botocore (StreamingChecksumBody)",
                               "boto3_ranged_x4": "bench (part CRCs combined vs HEAD)"}[path],
                        "files_read_back_ok": True}
        return run

    def _daemon(self, concurrency: int, repeat: int) -> Run:
        cache_size = max(4 << 30, 2 * self.total)
        # The daemon's log stays in the work dir (--keep keeps it); its cache dir goes when it stops.
        daemon = Daemon(self.workdir, f"x{concurrency}-{repeat}", self.proxy.endpoint, cache_size, list(self.args.daemon_args))
        try:
            client = s3_client(daemon.url, max_pool=max(16, concurrency))
            before = daemon.stats()["verification"]

            def fill() -> int:
                got = each_object(concurrency, self.objects, lambda obj: read_boto3(client, (obj.key,), "miss"))
                daemon.settle()  # every entry sealed, verified and published
                return got

            run = self._timed("daemon", concurrency, repeat, fill, {**self._pids(), "daemon": daemon.pid})
            after = daemon.stats()["verification"]
            verified = after["fills"]["verified"] - before["fills"]["verified"]
            by_crc = after["fills_by_algorithm"].get("crc64nvme", 0) - before["fills_by_algorithm"].get("crc64nvme", 0)
            failed = after["fills"]["failed"] - before["fills"]["failed"]
            if verified != len(self.objects) or by_crc != len(self.objects) or failed:
                raise BenchError(f"daemon x{concurrency}: {verified} fills verified ({by_crc} by CRC64NVME, {failed} failed) "
                                 f"for {len(self.objects)} objects")
            conn = http.client.HTTPConnection("127.0.0.1", daemon.port, timeout=60)
            try:
                files = {obj.key: Path(short_circuit_ask(conn, obj.key)) for obj in self.objects}
            finally:
                conn.close()
            self._check_files("daemon", files)
            run.verified = {"checksum_ok": True, "validated_objects": int(verified), "algorithms": ["crc64nvme"],
                            "by": "the daemon (/stats verification.fills_by_algorithm)", "files_read_back_ok": True}
            return run
        finally:
            daemon.stop()


def order(paths: tuple[str, ...], repeat: int) -> tuple[str, ...]:
    by = repeat % len(paths)
    return paths[by:] + paths[:by]


# -- report -----------------------------------------------------------------------------------


def summarize(runs: list[Run], paths: tuple[str, ...], concurrencies: list[int]) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    medians: dict[tuple[str, int], tuple[float, float]] = {}
    for concurrency in concurrencies:
        for path in paths:
            mine = [r for r in runs if r.path == path and r.concurrency == concurrency]
            if not mine:
                continue
            filler = FILLER[path]
            mb_s = statistics.median(r.mb_s for r in mine)
            cpu = statistics.median(r.cpu_per_gb(filler) for r in mine)
            medians[(path, concurrency)] = (mb_s, cpu)
            names = sorted({name for r in mine for name in r.cpu_s})
            rows.append({
                "path": path,
                "concurrency": concurrency,
                "mb_s": round(mb_s, 1),
                "runs_mb_s": [round(r.mb_s, 1) for r in mine],
                "runs_s": [round(r.seconds, 3) for r in mine],
                "bytes_per_run": mine[0].bytes,
                "filler_process": filler,
                "cpu_s_per_gb": round(cpu, 3),
                "cpu_s_per_gb_by_process": {name: round(statistics.median(r.cpu_per_gb(name) for r in mine), 3)
                                            for name in names},
                "machine_cores_busy": round(statistics.median(r.machine_busy_s / r.seconds for r in mine), 2),
                "verified": mine[-1].verified,
            })
    for row in rows:
        base = medians.get((BASELINE, row["concurrency"]))
        row["mb_s_vs_boto3_get_object"] = round(row["mb_s"] / base[0], 3) if base and base[0] else None
        row["cpu_vs_boto3_get_object"] = round(row["cpu_s_per_gb"] / base[1], 3) if base and base[1] else None
    return rows


HEADER = ("path", "objects at once", "MB/s", "CPU s/GB (filler)", "MB/s vs boto3", "CPU vs boto3", "checksum")


def table_rows(rows: list[dict[str, Any]]) -> list[tuple[str, ...]]:
    def ratio(value: float | None) -> str:
        return "" if value is None else f"{value:.2f}x"

    return [(row["path"], str(row["concurrency"]), f"{row['mb_s']:.0f}",
             f"{row['cpu_s_per_gb']:.2f} ({row['filler_process']})", ratio(row["mb_s_vs_boto3_get_object"]),
             ratio(row["cpu_vs_boto3_get_object"]),
             ("ok " + "/".join(row["verified"].get("algorithms", []))) if row["verified"].get("checksum_ok") else "NOT VERIFIED")
            for row in rows]


def print_table(rows: list[dict[str, Any]]) -> None:
    lines = [HEADER, *table_rows(rows)]
    widths = [max(len(line[i]) for line in lines) for i in range(len(HEADER))]
    for index, line in enumerate(lines):
        print("  ".join(cell.ljust(width) if i in (0, 3, 6) else cell.rjust(width)
                        for i, (cell, width) in enumerate(zip(line, widths, strict=True))))
        if index == 0:
            print("  ".join("-" * width for width in widths))


def markdown(results: dict[str, Any]) -> str:
    config, machine = results["config"], results["machine"]
    lines = [
        "# Cold fills: the daemon vs awscrt's S3 client vs boto3",
        "",
        f"`{results['command']}`: {config['objects']} objects of {fmt_size(config['object_size'])}, "
        f"{config['origin']}; median of {config['repeats']} repeat(s); MB = 10^6 B; CPU s/GB of the process doing the fill "
        "(the daemon's for `daemon`, this benchmark's own for the others). Ratios are to `boto3_get_object` at the same "
        "concurrency, same run.",
        "",
        "| " + " | ".join(HEADER) + " |",
        "|" + "|".join("---" for _ in HEADER) + "|",
    ]
    lines += ["| " + " | ".join(cells) + " |" for cells in table_rows(results["rows"])]
    lines += [
        "",
        f"Machine: {machine.get('cpu_count')} CPUs ({machine.get('cpu_model')}), Python {machine.get('python')}, "
        f"awscrt {machine['packages'].get('awscrt')}, boto3 {machine['packages'].get('boto3')}, "
        f"moto {machine['packages'].get('moto')}; load average at start {machine.get('loadavg_start')}; "
        f"{results['date']}.",
        "",
        *[f"- {note}" for note in results["notes"]],
        "",
    ]
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.fill_client_bench",
        description="Cold fills of the same objects through the daemon, awscrt's S3 client and boto3, from moto behind "
                    "the latency proxy: MB/s and CPU s/GB of the filling process. Writes bench/results/fill_client.{json,md}.",
        epilog="examples:\n  python -m bench.fill_client_bench --quick\n"
               "  python -m bench.fill_client_bench --objects 16 --object-size 128MiB --repeats 5",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--quick", action="store_true", help="smoke run: 4 objects of 16 MiB, 1 repeat")
    parser.add_argument("--objects", type=int, default=None, help="objects filled per measurement (default 8; 4 with --quick)")
    parser.add_argument("--object-size", default=None, help="bytes per object (default 64MiB; 16MiB with --quick)")
    parser.add_argument("--concurrency", default="1,4", help="objects in flight at once, comma-separated (default 1,4)")
    parser.add_argument("--repeats", type=int, default=None, help="measurements per path and concurrency (default 3; 1 with --quick)")
    parser.add_argument("--paths", default=",".join(PATHS), help=f"comma-separated, of {', '.join(PATHS)} (default: all)")
    parser.add_argument("--delay-ms", type=float, default=20.0, help="latency proxy: one-way delay per request (default 20)")
    parser.add_argument("--stream-mbps", type=float, default=None, help="latency proxy: per-connection cap, MB/s (default none)")
    parser.add_argument("--part-size", default="8MiB", help="awscrt part size (default 8MiB, as the daemon's --part-size)")
    parser.add_argument("--throughput-gbps", type=float, default=10.0,
                        help="awscrt throughput_target_gbps (default 10: above what loopback moto serves, so the CRT's "
                             "connection count is bound by the parts of the objects in flight)")
    parser.add_argument("--daemon-args", default="", help="extra flags for shardcache serve, one string (default: none)")
    parser.add_argument("--stock-moto-ranges", action="store_true",
                        help="serve ranged GETs as stock moto does: a copy of the whole object per GET (see bench.servers.S3_LIKE_MOTO)")
    parser.add_argument("--seed", type=int, default=0, help="object bytes seed")
    parser.add_argument("--workdir", type=Path, default=None, help="where files, caches and logs go (default: a temp dir)")
    parser.add_argument("--keep", action="store_true", help="keep the work dir (logs)")
    parser.add_argument("--output", type=Path, default=None,
                        help="JSON result file (default bench/results/fill_client.json); the .md table goes beside it")
    args = parser.parse_args(argv)
    args.objects = args.objects or (4 if args.quick else 8)
    args.object_size = parse_size(args.object_size or ("16MiB" if args.quick else "64MiB"))
    args.repeats = args.repeats or (1 if args.quick else 3)
    args.part_size = parse_size(args.part_size)
    args.concurrency = [int(c) for c in args.concurrency.split(",") if c.strip()]
    args.paths = tuple(p.strip() for p in args.paths.split(",") if p.strip())
    args.daemon_args = args.daemon_args.split()
    unknown = [p for p in args.paths if p not in PATHS]
    if unknown:
        parser.error(f"unknown paths {unknown}; known: {', '.join(PATHS)}")
    if args.objects < 1 or args.object_size < 1 or args.repeats < 1 or not args.concurrency or min(args.concurrency) < 1:
        parser.error("--objects, --object-size, --repeats and --concurrency must be positive")
    args.output = args.output or RESULTS_DIR / "fill_client.json"
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    began = time.monotonic()
    facts = machine_facts(("awscrt", "boto3", "botocore", "moto", "werkzeug", "aiohttp", "shardcache"))
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="shardcache-fill-client-bench-"))
    workdir.mkdir(parents=True, exist_ok=True)
    runs: list[Run] = []
    try:
        with MotoServer(workdir, s3_like=not args.stock_moto_ranges) as store, \
                LatencyProxy(store.endpoint, args.delay_ms, args.stream_mbps, workdir / "proxy.log") as proxy:
            bench = Bench(args, workdir, store, proxy)
            t0 = time.perf_counter()
            bench.upload()
            log_line(f"uploaded {args.objects} objects of {fmt_size(args.object_size)} with CRC64NVME "
                     f"in {time.perf_counter() - t0:.1f}s")
            for repeat in range(args.repeats):
                for concurrency in args.concurrency:
                    for path in order(args.paths, repeat):
                        run = bench.measure(path, concurrency, repeat)
                        runs.append(run)
                        log_line(f"repeat {repeat + 1}/{args.repeats} x{concurrency} {path}: {run.mb_s:.0f} MB/s, "
                                 f"{run.cpu_per_gb(FILLER[path]):.2f} CPU s/GB ({FILLER[path]})")
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    facts["loadavg_end"] = os.getloadavg()
    rows = summarize(runs, args.paths, args.concurrency)
    origin = f"moto {facts['packages'].get('moto')} (own process, objects in RAM) behind bench.latency_proxy: " \
             f"{args.delay_ms:g} ms per request" + (f", {args.stream_mbps:g} MB/s per connection" if args.stream_mbps else "")
    results: dict[str, Any] = {
        "benchmark": "fill_client",
        "command": "python -m bench.fill_client_bench" + (" " + " ".join(argv if argv is not None else sys.argv[1:])).rstrip(),
        "date": facts["date"],
        "machine": facts,
        "config": {
            "objects": args.objects, "object_size": args.object_size, "bytes_per_run": args.objects * args.object_size,
            "concurrency": args.concurrency, "repeats": args.repeats, "paths": list(args.paths), "seed": args.seed,
            "quick": args.quick, "origin": origin, "delay_ms": args.delay_ms, "stream_mbps": args.stream_mbps,
            "upload_checksum": "crc64nvme",
            "moto_patches": ["x-amz-checksum-mode upper-cased before moto reads it"] + (
                [] if args.stock_moto_ranges else ["each object's bytes read once and kept: a (ranged) GET costs the bytes it answers"]),
            "awscrt": {"part_size": args.part_size, "throughput_target_gbps": args.throughput_gbps,
                       "tls_mode": "DISABLED", "checksum_config": "S3ChecksumConfig(validate_response=True)",
                       "addressing": "path style, Host: 127.0.0.1:<proxy port>"},
            "daemon": "python -m sidecar.cli serve (default settings" + (
                f"; {' '.join(args.daemon_args)}" if args.daemon_args else "") + "), fresh cache dir per measurement",
            "boto3": "bench.common.s3_client (path style, no retries); get_object with ChecksumMode=ENABLED",
            "read_chunk_bytes": READ_CHUNK, "ranges_per_object": RANGES_PER_OBJECT,
            "mb": "10^6 bytes", "statistic": "median of repeats; ratios of medians, same concurrency",
        },
        "rows": rows,
        "notes": [
            "Every path writes each object to a file on the local disk and fsyncs it (the daemon fsyncs what it publishes) "
            "and verifies it against its whole-object CRC64NVME; untimed, every file is read back and compared too.",
            "daemon: boto3 get_object through a fresh daemon (x-shardcache-cache: miss), body discarded; the clock stops "
            "when the daemon has no fill in flight. CPU s/GB is the daemon process's; the reader's is under "
            "cpu_s_per_gb_by_process.bench.",
            "awscrt: S3Client GET_OBJECT, recv_filepath (buffered writes), validate_response=True; it does a HEAD before "
            "its ranged GETs (one more round trip per object). awscrt_direct: the same writing with O_DIRECT "
            "(S3FileIoOptions(direct_io=True)), as the daemon writes its fills by default: the like-for-like row for "
            "`daemon`. awscrt_on_body: an on_body callback that pwrites each chunk (every chunk crosses into Python).",
            "The bench process's CPU is split into user and system time under cpu_s_per_gb_by_process "
            "(bench_user, bench_system): page-cache writes show as system time.",
            "moto compares x-amz-checksum-mode case-sensitively with ENABLED and awscrt sends 'enabled' (S3 accepts either): "
            "the moto server here upper-cases that header before moto reads it, or awscrt would fill unvalidated.",
            ("moto as shipped: every GET copies the whole object, so each part of a split fill (daemon, awscrt, "
             "boto3_ranged_x4) costs the origin a whole object" if args.stock_moto_ranges else
             "moto keeps each object's bytes as one bytes object (read once), so a ranged GET costs it the range, not "
             "the whole object as stock moto (--stock-moto-ranges measures that)") + ".",
            "On a small machine moto and the proxy (Python) share the cores with the filler: MB/s may be bound by the origin "
            "side (see machine_cores_busy and cpu_s_per_gb_by_process.origin/proxy); CPU s/GB of the filler is the "
            "figure that carries over to a real S3.",
        ],
        "elapsed_s": round(time.monotonic() - began, 1),
    }
    written = write_results(args.output, results)
    table = written.with_suffix(".md")
    table.write_text(markdown(results), encoding="utf-8")
    print(f"\ncold fills: {args.objects} x {fmt_size(args.object_size)}, {origin}; median of {args.repeats}; MB = 10^6 B\n")
    print_table(rows)
    print(f"\n{results['elapsed_s']:.0f}s; results: {written} and {table.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
