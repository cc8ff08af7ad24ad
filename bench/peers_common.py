"""Helpers of the peer-comparison suite that ``bench.common`` does not hold: a stdlib WebDataset
sample reader (what a user of a plain S3 client writes), per-epoch resource accounting, the
simulated trainer, the MDS conversion for mosaicml-streaming and a few result-table utilities.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import resource
import tarfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any

__all__ = [
    "tar_samples",
    "EpochStat",
    "Meter",
    "paced_consume",
    "proc_status_kib",
    "daemon_stats",
    "convert_to_mds",
    "upload_dir",
    "MB",
    "import_streaming",
]

MB = 1_000_000


def tar_samples(fileobj: IO[bytes], url: str = "") -> Iterator[dict[str, Any]]:
    """WebDataset samples from a tar stream with :mod:`tarfile` in streaming mode (``r|``): what a
    user reading shards with a plain S3 client writes. Members sharing the basename up to the first
    dot form one sample."""
    current: dict[str, Any] | None = None
    with tarfile.open(fileobj=fileobj, mode="r|") as tar:
        for member in tar:
            if not member.isfile():
                continue
            base = member.name.rsplit("/", 1)[-1]
            key, _, ext = base.partition(".")
            handle = tar.extractfile(member)
            data = handle.read() if handle is not None else b""
            if current is None or current["__key__"] != key:
                if current is not None:
                    yield current
                current = {"__key__": key, "__url__": url}
            current[ext] = data
    if current is not None:
        yield current


def proc_status_kib(pid: int, name: str) -> int:
    try:
        with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as handle:
            for line in handle:
                if line.startswith(name + ":"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        return 0
    return 0


def daemon_stats(url: str | None) -> dict[str, Any]:
    """``GET /_shardcache/stats`` of a daemon, ``{}`` when there is none or it does not answer."""
    if not url:
        return {}
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/_shardcache/stats", timeout=5) as resp:
            return dict(json.loads(resp.read()))
    except Exception:
        return {}


@dataclass
class EpochStat:
    """One epoch of one reader process (times are ``time.monotonic()``, system-wide on Linux, so
    several processes' epochs can be merged)."""

    epoch: int
    start: float = 0.0
    first: float | None = None
    end: float = 0.0
    samples: int = 0
    payload_bytes: int = 0
    cpu_s: float = 0.0
    server_cpu_s: float = 0.0
    machine_busy_s: float = 0.0  # every process's CPU on this machine over the epoch (bench.common)
    stall_s: float | None = None
    paced_s: float | None = None
    daemon_before: dict[str, Any] = field(default_factory=dict)
    daemon_after: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _cpu_self_children() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


class Meter:
    """Measures an epoch: wall clock, time to first sample, this process's CPU (threads and waited
    children such as curl), the CPU of server processes (the daemon) and daemon stats."""

    def __init__(self, server_pids: list[int], daemon_url: str | None, with_stats: bool) -> None:
        from bench.common import cpu_seconds, machine_busy_seconds

        self._cpu_of = cpu_seconds
        self._busy = machine_busy_seconds
        self.server_pids = server_pids
        self.daemon_url = daemon_url
        self.with_stats = with_stats

    def _server_cpu(self) -> float:
        return sum(self._cpu_of(pid) for pid in self.server_pids)

    def run(self, epoch: int, samples: Iterable[dict[str, Any]], pace: float | None = None,
            cap_s: float | None = None, depth: int = 256) -> EpochStat:
        stat = EpochStat(epoch)
        if self.with_stats:
            stat.daemon_before = daemon_stats(self.daemon_url)
        cpu0, server0, busy0 = _cpu_self_children(), self._server_cpu(), self._busy()
        stat.start = time.monotonic()
        if pace:
            paced_consume(stat, samples, pace, cap_s, depth)
        else:
            for sample in samples:
                if stat.first is None:
                    stat.first = time.monotonic()
                stat.samples += 1
                stat.payload_bytes += sum(len(v) for k, v in sample.items() if isinstance(v, (bytes, bytearray, memoryview)))
        stat.end = time.monotonic()
        stat.cpu_s = _cpu_self_children() - cpu0
        stat.server_cpu_s = self._server_cpu() - server0
        stat.machine_busy_s = self._busy() - busy0
        if self.with_stats:
            stat.daemon_after = daemon_stats(self.daemon_url)
        return stat


def paced_consume(stat: EpochStat, samples: Iterable[dict[str, Any]], rate: float, cap_s: float | None,
                  depth: int) -> None:
    """A simulated trainer: it wants sample ``i`` at ``start + i / rate`` (plus the time it has
    already lost waiting) and spends the rest computing. The reader runs on its own thread into a
    queue of ``depth`` samples, as a DataLoader's workers prefetch. Time spent waiting for a sample
    that is not there yet is a stall; the stall fraction is stall / elapsed."""
    done = object()
    box: queue.Queue[Any] = queue.Queue(maxsize=depth)
    stop = threading.Event()
    failure: list[BaseException] = []

    def produce() -> None:
        try:
            for sample in samples:
                while not stop.is_set():
                    try:
                        box.put(sample, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if stop.is_set():
                    return
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer
            failure.append(exc)
        finally:
            with contextlib.suppress(queue.Full):
                box.put(done, timeout=5)

    producer = threading.Thread(target=produce, name="bench-reader", daemon=True)
    producer.start()
    stall = 0.0
    start = stat.start
    step = 1.0 / rate
    due = start
    try:
        while True:
            now = time.monotonic()
            if cap_s is not None and now - start >= cap_s:
                break
            if due > now:
                time.sleep(due - now)
            waited_from = time.monotonic()
            item = box.get(timeout=600)
            got = time.monotonic()
            if item is done:
                break
            waited = got - waited_from
            stall += waited
            if stat.first is None:
                stat.first = got
            stat.samples += 1
            stat.payload_bytes += sum(len(v) for v in item.values() if isinstance(v, (bytes, bytearray, memoryview)))
            # The trainer's own timeline: one compute period per sample, shifted only by waiting
            # for data. A sleep that wakes late (the reader thread held the GIL) is caught up on
            # the next steps instead of silently lowering the rate the trainer asks for.
            due += step + waited
    finally:
        stop.set()
        with contextlib.suppress(queue.Empty):
            while True:
                box.get_nowait()
        producer.join(10)
    if failure:
        raise failure[0]
    stat.stall_s = stall
    stat.paced_s = time.monotonic() - start


def import_streaming() -> Any:
    """``import streaming`` (mosaicml-streaming), working around a broken torchvision.

    ``streaming/__init__`` imports ``streaming.vision`` (its CIFAR/ImageNet dataset classes), which
    imports torchvision. Where the only torchvision on the index is a CUDA build that cannot load
    next to a CPU torch (``operator torchvision::nms does not exist``), that import fails although
    ``StreamingDataset`` and ``MDSWriter`` never use it; then ``streaming.vision`` is replaced by an
    empty module and nothing else changes."""
    import sys
    import types

    try:
        import torchvision  # noqa: F401
    except Exception:  # noqa: BLE001 - any failure of torchvision's own import
        for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
            del sys.modules[name]
        sys.modules.setdefault("streaming.vision", types.ModuleType("streaming.vision"))
        STREAMING_NOTES.append("torchvision does not import here (CUDA build next to CPU torch): "
                               "streaming.vision replaced by an empty module")
    import streaming

    return streaming


STREAMING_NOTES: list[str] = []


def convert_to_mds(samples: Iterable[Any], out: Path) -> dict[str, Any]:
    """Write ``samples`` (``bench.common.Sample``) as an MDS dataset with mosaicml-streaming's own
    ``MDSWriter`` and its default shard size limit, as its documentation shows."""
    MDSWriter = import_streaming().MDSWriter  # noqa: N806

    count = 0
    columns = {"__key__": "str", "jpg": "bytes", "cls": "bytes"}
    with MDSWriter(out=str(out), columns=columns) as writer:
        for sample in samples:
            writer.write({"__key__": sample.key, "jpg": sample.jpg, "cls": sample.cls})
            count += 1
    files = sorted(p for p in out.iterdir() if p.is_file())
    return {"samples": count, "files": len(files), "bytes": sum(p.stat().st_size for p in files)}


def upload_dir(client: Any, bucket: str, prefix: str, root: Path, workers: int = 8) -> int:
    """Upload every file under ``root`` to ``s3://bucket/prefix/<relative path>``; returns bytes."""
    from concurrent.futures import ThreadPoolExecutor

    paths = [p for p in sorted(root.rglob("*")) if p.is_file()]

    def put(path: Path) -> int:
        client.put_object(Bucket=bucket, Key=f"{prefix.rstrip('/')}/{path.relative_to(root).as_posix()}",
                          Body=path.read_bytes())
        return path.stat().st_size

    with ThreadPoolExecutor(workers) as pool:
        return sum(pool.map(put, paths))


def env_for_streaming(endpoint: str) -> dict[str, str]:
    return {"S3_ENDPOINT_URL": endpoint}


def merge_epochs(per_worker: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Epoch figures over several reader processes: wall clock from the first start to the last
    end, time to first sample from the first start to the first sample anywhere, sums of the rest."""
    merged = []
    for index in range(min(len(w) for w in per_worker)):
        parts = [w[index] for w in per_worker]
        firsts = [p["first"] for p in parts if p["first"] is not None]
        start = min(p["start"] for p in parts)
        stalls = [p["stall_s"] for p in parts if p["stall_s"] is not None]
        paced = [p["paced_s"] for p in parts if p["paced_s"] is not None]
        merged.append({
            "epoch": parts[0]["epoch"],
            "wall_s": max(p["end"] for p in parts) - start,
            "ttfs_s": (min(firsts) - start) if firsts else None,
            "samples": sum(p["samples"] for p in parts),
            "payload_bytes": sum(p["payload_bytes"] for p in parts),
            "cpu_s": sum(p["cpu_s"] for p in parts),
            # every worker sees the same daemon: take the widest window, not the sum
            "server_cpu_s": max(p["server_cpu_s"] for p in parts),
            "machine_busy_s": max(p.get("machine_busy_s", 0.0) for p in parts),  # the machine's: widest window
            "stall_fraction": (sum(stalls) / sum(paced)) if stalls and sum(paced) > 0 else None,
            "daemon_before": parts[0]["daemon_before"],
            "daemon_after": max((p["daemon_after"] for p in parts), key=lambda d: d.get("origin_read_bytes", 0), default={}),
        })
    return merged


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return round(a / b, 3)


def wait_pids(pids: list[int], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for pid in pids:
        while time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.05)


Reader = Callable[[int], Iterable[dict[str, Any]]]
