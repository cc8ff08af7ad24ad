"""What the benchmarks share: the generated dataset, processes, machine facts, RSS sampling,
page-cache dropping and result files (the servers they start are in :mod:`bench.servers`).

The dataset is deterministic for a seed: WebDataset tar shards of "JPEG-sized" random samples
(``000123.jpg`` of 80-140 KB, as ImageNet JPEGs average ~110 KB, plus ``000123.cls``), written
with :mod:`tarfile`. The same sample stream can be packed at several shard sizes, so two layouts
of one run hold the same bytes.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import importlib.metadata
import io
import json
import os
import platform
import random
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

__all__ = [
    "REPO",
    "RESULTS_DIR",
    "Sample",
    "make_samples",
    "pack_shards",
    "write_dataset_dir",
    "port_open",
    "RssSampler",
    "s3_client",
    "free_port",
    "wait_until",
    "http_ok",
    "spawn",
    "stop_process",
    "drop_caches",
    "machine_facts",
    "write_results",
    "in_workdir",
    "parse_size",
    "fmt_size",
    "TEST_CREDENTIALS",
    "machine_busy_seconds",
    "SendfileServer",
    "cpu_seconds",
    "log_line",
]

REPO = Path(__file__).resolve().parent.parent
RESULTS_DIR = REPO / "bench" / "results"


def log_line(text: str) -> None:
    """A progress line on stdout, stamped with the wall-clock time (what every long benchmark prints)."""
    print(f"[{time.strftime('%H:%M:%S')}] {text}", flush=True)

# moto accepts any credentials; fixed ones keep a developer's real AWS account out of every run.
# moto takes any key; s3rver knows only its built-in S3RVER/S3RVER pair.
TEST_CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "S3RVER",
    "AWS_SECRET_ACCESS_KEY": "S3RVER",
    "AWS_DEFAULT_REGION": "us-east-1",
}

_SIZE_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
               "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4}


def parse_size(text: str) -> int:
    """``"1GiB"`` → 1073741824; ``"256MiB"``, ``"500MB"``, ``"12345"``."""
    raw = text.strip().lower().replace(" ", "")
    number = raw.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = raw[len(number):]
    if unit not in _SIZE_UNITS or not number:
        raise ValueError(f"not a size: {text!r} (use e.g. 1GiB, 256MiB)")
    return int(float(number) * _SIZE_UNITS[unit])


def fmt_size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


# -- dataset --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sample:
    key: str
    jpg: bytes
    cls: bytes


def make_samples(total_bytes: int, seed: int = 0, min_size: int = 80_000, max_size: int = 140_000) -> Iterator[Sample]:
    """Random, incompressible samples until ``total_bytes`` of payload; the same for the same seed."""
    rng = random.Random(seed)
    produced = 0
    index = 0
    while produced < total_bytes:
        size = rng.randint(min_size, max_size)
        jpg = rng.randbytes(size)
        cls = str(rng.randrange(1000)).encode()
        yield Sample(f"{index:06d}", jpg, cls)
        produced += size + len(cls)
        index += 1


def _add_member(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mtime = 1_700_000_000  # fixed: the same seed gives byte-identical shards
    info.mode = 0o644
    tar.addfile(info, io.BytesIO(data))


def pack_shards(samples: Iterator[Sample], shard_bytes: int, prefix: str = "train-") -> Iterator[tuple[str, bytes, int]]:
    """Pack samples into tar shards of about ``shard_bytes``: yields ``(name, tar bytes, samples)``.

    A shard closes before the sample that would take it past ``shard_bytes`` (so shards are a bit
    under the target, never over it by more than one sample)."""
    index = 0
    buffer = io.BytesIO()
    tar = tarfile.open(fileobj=buffer, mode="w", format=tarfile.USTAR_FORMAT)
    count = 0
    for sample in samples:
        # 512-byte header per member, payload padded to 512: what the sample adds to the tar.
        cost = 1024 + (len(sample.jpg) + 511) // 512 * 512 + 512
        if count and buffer.tell() + cost + 1024 > shard_bytes:
            tar.close()
            yield f"{prefix}{index:06d}.tar", buffer.getvalue(), count
            index += 1
            buffer = io.BytesIO()
            tar = tarfile.open(fileobj=buffer, mode="w", format=tarfile.USTAR_FORMAT)
            count = 0
        _add_member(tar, f"{sample.key}.jpg", sample.jpg)
        _add_member(tar, f"{sample.key}.cls", sample.cls)
        count += 1
    tar.close()
    if count:
        yield f"{prefix}{index:06d}.tar", buffer.getvalue(), count


def write_dataset_dir(root: Path, total_bytes: int, shard_bytes: int, seed: int = 0) -> list[Path]:
    """Write the dataset as tar files under ``root`` (for ``file://`` origins); returns the paths."""
    root.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, data, _count in pack_shards(make_samples(total_bytes, seed), shard_bytes):
        path = root / name
        tmp = path.with_suffix(".tmp")
        with open(tmp, "wb") as handle:
            handle.write(data)
        os.replace(tmp, path)
        paths.append(path)
    return paths


# -- processes and servers ------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_until(predicate: Callable[[], bool], timeout: float, what: str, interval: float = 0.05) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(Exception):
            if predicate():
                return
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")


def http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return 200 <= resp.status < 300
    except Exception:
        return False


def spawn(args: list[str], log: Path, env: dict[str, str] | None = None, *,
          credentials: Mapping[str, str] = TEST_CREDENTIALS) -> subprocess.Popen[bytes]:
    """A process in its own session (so stopping it takes its children too), output to ``log``.
    Its environment is this one's with ``credentials`` (the benchmarks' test pair; the tests pass
    ``{}``: their session's own), loopback reached without a proxy, and ``env`` over all."""
    full_env = {**os.environ, **credentials, "NO_PROXY": "127.0.0.1,localhost", **(env or {})}
    full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), full_env.get("PYTHONPATH")]))
    full_env.pop("AWS_PROFILE", None)
    handle = open(log, "ab")  # noqa: SIM115 - the child owns it
    try:
        return subprocess.Popen(args, stdout=handle, stderr=subprocess.STDOUT, env=full_env, cwd=str(REPO),
                                start_new_session=True)
    finally:
        handle.close()


def stop_process(proc: subprocess.Popen[bytes], timeout: float = 15.0, sig: int = signal.SIGTERM) -> None:
    """Send ``sig`` to the process's group, then SIGKILL if it is still there after ``timeout``."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, sig)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=timeout)


def port_open(port: int, host: str = "127.0.0.1") -> bool:
    """Whether something accepts connections on ``host:port`` (raises when nothing does)."""
    with socket.create_connection((host, port), timeout=1):
        return True


def s3_client(endpoint: str, max_pool: int = 16) -> Any:
    """A boto3 S3 client for ``endpoint``, path style, no retries (a failure shows, not hides).

    Checksums only when required: botocore's default CRC of every body would slow the plain-boto3
    baseline, which only makes the baseline stricter to beat if left out."""
    import boto3
    from botocore.config import Config

    for name, value in TEST_CREDENTIALS.items():
        os.environ.setdefault(name, value)
    return boto3.session.Session().client(
        "s3",
        endpoint_url=endpoint,
        config=Config(
            s3={"addressing_style": "path"},
            retries={"total_max_attempts": 1, "mode": "standard"},
            max_pool_connections=max_pool,
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
            read_timeout=120,
        ),
    )


# -- measurement helpers ----------------------------------------------------------------------


def _status_kib(pid: int, field_name: str) -> int | None:
    try:
        with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as handle:
            for line in handle:
                if line.startswith(field_name + ":"):
                    return int(line.split()[1])
    except (FileNotFoundError, ProcessLookupError, ValueError):
        return None
    return None


@dataclass
class RssSampler:
    """Samples ``VmRSS`` of a process every ``interval_s`` on a thread; ``VmHWM`` (the kernel's own
    peak, which catches spikes between samples) is read when the sampler stops."""

    pid: int
    interval_s: float = 0.02
    max_rss_kib: int = 0
    hwm_kib: int = 0
    samples: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def __enter__(self) -> RssSampler:
        self._thread = threading.Thread(target=self._run, name=f"rss-{self.pid}", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()

    def _sample(self) -> None:
        rss = _status_kib(self.pid, "VmRSS")
        if rss is not None:
            self.max_rss_kib = max(self.max_rss_kib, rss)
            self.samples += 1

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        self._sample()
        self.hwm_kib = max(self.hwm_kib, _status_kib(self.pid, "VmHWM") or 0)

    def current_kib(self) -> int:
        return _status_kib(self.pid, "VmRSS") or 0


def drop_caches() -> bool:
    """Write back dirty pages and drop the page cache (needs root); ``False`` where not allowed."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w", encoding="ascii") as handle:
            handle.write("1\n")
        return True
    except OSError:
        return False


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def machine_facts(packages: tuple[str, ...] = ("aiohttp", "boto3", "botocore", "moto", "werkzeug", "xxhash",
                                                 "urllib3", "shardcache")) -> dict[str, Any]:
    cpu_model = None
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break
    mem_total = None
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem_total = int(line.split()[1]) * 1024
    git_rev = None
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        git_rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                                 text=True, timeout=5).stdout.strip() or None
    return {
        "date": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "hostname": platform.node(),
        "cpu_count": os.cpu_count(),
        "cpu_affinity": len(os.sched_getaffinity(0)),
        "cpu_model": cpu_model,
        "mem_total_bytes": mem_total,
        "kernel": platform.release(),
        "python": sys.version.split()[0],
        "packages": {name: _version(name) for name in packages},
        "git_revision": git_rev,
        "loadavg_start": os.getloadavg(),
        "memory": memory_facts(),
    }


PAGE_REPORTING = Path("/sys/module/page_reporting/parameters")


def memory_facts(probe_bytes: int = 64 << 20) -> dict[str, Any]:
    """What fresh memory costs the machine now: the seconds per GiB of writing once to each page
    of ``probe_bytes`` of new anonymous memory, and the VM's free page reporting where the
    kernel has it (``reported_kib``: memory handed back to the host so far).

    Why: on a VM that hands free memory back to its host (virtio-balloon free page reporting),
    the first write to a page the host took back costs a fault on the host: measured on this
    project's VM, 1 GiB written to fresh page-cache pages took 0.22 s of kernel time when the
    memory was the VM's and up to 5.5 s when it had been handed back (``dd``, after a process had
    used and freed 6-8 GiB); buffered writes, new buffers and page-cache fills of every reader pay
    it, by amounts that depend on what ran in the seconds before. The probe says which case a run
    began in."""
    import mmap

    facts: dict[str, Any] = {}
    buf = mmap.mmap(-1, probe_bytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        started = time.perf_counter()
        for at in range(0, probe_bytes, mmap.PAGESIZE):
            buf[at] = 1
        facts["first_touch_s_per_gib"] = round((time.perf_counter() - started) * (1 << 30) / probe_bytes, 3)
    finally:
        buf.close()
    if PAGE_REPORTING.is_dir():
        reporting: dict[str, str] = {}
        for name in ("reported_kib", "page_reporting_order", "min_free_ms"):
            with contextlib.suppress(OSError):
                reporting[name] = (PAGE_REPORTING / name).read_text().strip()
        facts["free_page_reporting"] = reporting
    return facts


def in_workdir(workdir: Path | None, prefix: str, keep: bool, run: Callable[[Path], T]) -> T:
    """``run(workdir)`` in ``workdir`` (created), or in a fresh temporary directory; removed
    afterwards unless ``keep``."""
    where = workdir or Path(tempfile.mkdtemp(prefix=prefix))
    where.mkdir(parents=True, exist_ok=True)
    try:
        return run(where)
    finally:
        if not keep:
            shutil.rmtree(where, ignore_errors=True)


def write_results(path: Path, data: dict[str, Any]) -> Path:
    """Atomically write ``data`` as JSON (temp file in the same directory, fsync, rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            json.dump(data, handle, indent=2, sort_keys=False)
            handle.write("\n")
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    return path


# -- the loopback ceiling ---------------------------------------------------------------------


def _sendfile_main(port: int, root: str) -> None:
    """A minimal keep-alive HTTP/1.1 server: ``GET /<path under root>`` answers the file with
    ``os.sendfile`` from a blocking thread per connection. No parsing beyond the request line, no
    event loop: what any server can do over TCP loopback on this machine."""
    import socketserver

    base = os.path.realpath(root)

    class Handler(socketserver.BaseRequestHandler):
        def handle(self) -> None:
            sock = self.request
            pending = b""
            while True:
                while b"\r\n\r\n" not in pending:
                    chunk = sock.recv(65536)
                    if not chunk or len(pending) > 65536:
                        return
                    pending += chunk
                head, _, pending = pending.partition(b"\r\n\r\n")
                target = head.split(b"\r\n", 1)[0].split(b" ")[1].decode()
                path = os.path.realpath(os.path.join(base, target.lstrip("/")))
                if not path.startswith(base + os.sep) or not os.path.isfile(path):
                    sock.sendall(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n")
                    continue
                fd = os.open(path, os.O_RDONLY)
                try:
                    size = os.fstat(fd).st_size
                    sock.sendall(f"HTTP/1.1 200 OK\r\nContent-Length: {size}\r\n\r\n".encode())
                    offset = 0
                    while offset < size:
                        sent = os.sendfile(sock.fileno(), fd, offset, size - offset)
                        if sent == 0:
                            return
                        offset += sent
                finally:
                    os.close(fd)

    class Server(socketserver.ThreadingTCPServer):
        daemon_threads = True
        allow_reuse_address = True

    with Server(("127.0.0.1", port), Handler) as server:
        server.serve_forever()


class SendfileServer:
    """:func:`_sendfile_main` in its own process, serving files under ``root``."""

    def __init__(self, root: Path, log: Path) -> None:
        self.port = free_port()
        self.root = root
        self.log = log
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> SendfileServer:
        code = f"from bench.common import _sendfile_main; _sendfile_main({self.port}, {str(self.root)!r})"
        self.proc = spawn([sys.executable, "-c", code], self.log)

        def listening() -> bool:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                return True

        wait_until(listening, timeout=30, what="the sendfile server")
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None:
            stop_process(self.proc)
            self.proc = None


def machine_busy_seconds() -> float:
    """CPU seconds every core of this machine has spent busy so far, whoever ran (``/proc/stat``:
    user, nice, system, irq and softirq; not idle, iowait or steal). Over a run, divided by its
    wall time, it is how many cores were busy: at the machine's core count, the run was bound by
    CPU, not by latency or a server, whatever its readers did."""
    with open("/proc/stat", encoding="ascii") as handle:
        fields = [int(x) for x in handle.readline().split()[1:8]]
    user, nice, system, _idle, _iowait, irq, softirq = fields
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process (all its threads) so far; 0.0 if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as handle:
            fields = handle.read().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return 0.0
    # After the ")" that ends the command name: state is field 3, utime 14 and stime 15 (1-based).
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
