"""``python -m bench.resume_bench``: the cost of resuming a shard at a sample (issue 31), before
and after member indexes.

One shard of ``--size`` (default 1 GiB) of WebDataset samples on a moto S3 server behind the
latency proxy (20 ms per request, as the other benchmarks), with its member index
(``<key>.members.json``, pinned in the manifest). A loader resumes it at its LAST sample (a static
``load_state_dict`` at that offset: dynamic mode's lease offset and a checkpoint's state take the
same path, ``ShardLoader._samples``) and the time to that first sample is measured, in a fresh
process each time (imports and the manifest read done before the clock starts; the member index
read is in the time):

- ``before``: today's path without an index (the manifest's pin dropped in the reader): the shard
  is read and hashed from its first byte, every sample before the last parsed and skipped;
- ``after``: with the index: the read starts at the last sample's first byte (a ranged GET, or a
  mapping sliced there), the sample checked against its own xxh3-64.

Cases: the node daemon over HTTP cold (a fresh daemon, nothing cached) and warm (the same daemon
again), the daemon's short-circuit warm (the cache file mapped), and S3 directly (boto3). Bytes
read: what the loader pulled from its reader (streams, counted), or for a mapped file the pages
it brought into the page cache (the same resume again with the file evicted first, counted with
``mincore``); with the daemon's figures: bytes it served, and bytes it read from the origin.

Writes ``bench/results/resume.json`` (``resume-quick.json`` with ``--quick``) and prints a table.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import ctypes.util
import dataclasses
import json
import mmap
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import RESULTS_DIR, fmt_size, log_line, machine_facts, make_samples, pack_shards, parse_size, write_results
from bench.latency_proxy import LatencyProxy
from bench.servers import MotoServer, ServeProcess

__all__ = ["CASES", "evict", "resident_bytes", "main"]

BUCKET = "bench"
PREFIX = "resume/"
CASES = ("http_cold", "http_warm", "short_circuit_warm", "s3")
_CREDENTIALS = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1"}


# -- the page cache ---------------------------------------------------------------------------------


def _libc() -> Any:
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    return libc


def resident_pages(path: str | Path) -> bytes:
    """One byte per page of the file at ``path``: 1 where the page is in the page cache (``mincore``
    of a mapping that touches nothing)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        if not size:
            return b""
        libc = _libc()
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), f"mmap of {path}")
        try:
            pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
            vec = (ctypes.c_ubyte * pages)()
            if libc.mincore(ctypes.c_void_p(addr), size, vec) != 0:
                raise OSError(ctypes.get_errno(), f"mincore of {path}")
            return bytes(v & 1 for v in vec)
        finally:
            libc.munmap(ctypes.c_void_p(addr), size)
    finally:
        os.close(fd)


def resident_bytes(path: str | Path, start: int = 0, end: int | None = None) -> int:
    """Bytes of the file's pages in ``[start, end)`` (whole pages) that are in the page cache."""
    pages = resident_pages(path)
    first = start // mmap.PAGESIZE
    last = len(pages) if end is None else (end + mmap.PAGESIZE - 1) // mmap.PAGESIZE
    return sum(pages[first:last]) * mmap.PAGESIZE


def evict(path: str | Path) -> bool:
    """Drop the file's pages from the page cache (written back first: a dirty page stays);
    whether none is left (a file system may keep them)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return resident_bytes(path) == 0


# -- the reader processes ---------------------------------------------------------------------------


class _CountingReader:
    def __init__(self, raw: Any, counts: dict[str, int]) -> None:
        self._raw, self._counts = raw, counts

    def read(self, n: int = -1, /) -> bytes:
        data: bytes = self._raw.read(n)
        self._counts["bytes"] += len(data)
        return data

    def close(self) -> None:
        self._raw.close()


class _CountingSource:
    """A source whose readers count the bytes the loader pulls (streams only: a file would no
    longer be mapped)."""

    def __init__(self, source: Any) -> None:
        self._source = source
        self.counts = {"bytes": 0}

    def __getattr__(self, name: str) -> Any:
        return getattr(self._source, name)

    def open(self, shard: Any, recheck: bool = False, on_sent: Any = None, offset: int = 0, **kwargs: Any) -> Any:
        return _CountingReader(self._source.open(shard, recheck, on_sent, offset, **kwargs), self.counts)


def _stats(daemon: str | None) -> dict[str, int]:
    if not daemon:
        return {"served": 0, "origin": 0}
    import urllib.request

    with urllib.request.urlopen(daemon + "/_shardcache/stats", timeout=10) as resp:
        stats = json.load(resp)
    return {"served": sum(int(v) for v in stats["served_bytes"].values()), "origin": int(stats["origin_read_bytes"])}


def _resume_once(spec: dict[str, Any], count: bool, find_path: bool = False) -> tuple[float, int, Any, str | None]:
    """(seconds to the first sample, bytes counted, the sample, with ``find_path`` the file a
    short-circuit read maps) of one resume at the shard's last sample, in a new loader."""
    from loader import LoaderSettings, ShardLoader

    settings = LoaderSettings(endpoint=spec["daemon"] or "", short_circuit=spec["case"] == "short_circuit_warm",
                              verify=True)
    loader = ShardLoader(f"s3://{BUCKET}/{PREFIX}", shuffle=False, settings=settings)
    shards = loader.shards  # the manifest, read before the clock starts
    if not spec["index"]:
        # Before: no member index at all, neither the dataset's nor the one the daemon builds of
        # a shard it holds.
        loader._shards = [dataclasses.replace(s, members=None) for s in shards]
        loader._source().cache_members = lambda shard: None  # type: ignore[attr-defined]
    counting = None
    path = None
    if count:
        counting = _CountingSource(loader._source())
        loader._runtime().source = counting
    elif find_path:
        reader = loader._source().open(shards[0])
        path = str(getattr(reader, "name", "")) or None
        reader.close()
    state = loader.state_dict()
    state.update(shard=0, offset=spec["resume_at"])
    loader.load_state_dict(state)
    started = time.perf_counter()
    sample = next(iter(loader))
    elapsed = time.perf_counter() - started
    loader.close()
    return elapsed, counting.counts["bytes"] if counting is not None else 0, sample, path


def child(spec: dict[str, Any]) -> dict[str, Any]:
    os.environ.update(_CREDENTIALS)
    if spec["s3_endpoint"]:
        os.environ["AWS_ENDPOINT_URL"] = spec["s3_endpoint"]
    mapped = spec["case"] == "short_circuit_warm"
    before = _stats(spec["daemon"])
    elapsed, counted, sample, _ = _resume_once(spec, count=not mapped)
    after = _stats(spec["daemon"])
    if sample["__key__"] != spec["last_key"]:
        raise RuntimeError(f"resumed at {sample['__key__']!r}, not the last sample {spec['last_key']!r}")
    result = {"first_sample_s": round(elapsed, 4), "sample_key": sample["__key__"],
              "daemon_served_bytes": after["served"] - before["served"],
              "origin_read_bytes": after["origin"] - before["origin"]}
    if mapped:
        # The pages a resume brings in: the same resume again, the cache file evicted first.
        path = _resume_once(spec, count=False, find_path=True)[3]
        if path is None or not evict(path):
            result["bytes_read"] = None
        else:
            _resume_once(spec, count=False)
            result["bytes_read"] = resident_bytes(path)
    else:
        result["bytes_read"] = counted
    return result


# -- the run ---------------------------------------------------------------------------------------


def _build(store: MotoServer, size: int, seed: int) -> dict[str, Any]:
    import xxhash

    from loader.members import index_shard
    from wire.members import members_bytes, members_key

    packed = list(pack_shards(make_samples(size, seed), size + (64 << 20)))
    assert len(packed) == 1, "one shard"
    name, data, count = packed[0]
    table = index_shard(data, name)
    doc = members_bytes(table)
    manifest = {"version": 1, "format": "webdataset", "shards": [{
        "key": name, "size": len(data), "xxh3_128": xxhash.xxh3_128_hexdigest(data), "samples": count,
        "members_xxh3_128": xxhash.xxh3_128_hexdigest(doc)}]}
    client = store.client()
    client.create_bucket(Bucket=BUCKET)
    client.put_object(Bucket=BUCKET, Key=PREFIX + name, Body=data)
    client.put_object(Bucket=BUCKET, Key=PREFIX + members_key(name), Body=doc)
    client.put_object(Bucket=BUCKET, Key=PREFIX + "manifest.json", Body=json.dumps(manifest).encode())
    return {"key": name, "bytes": len(data), "samples": count, "last_key": table.keys[-1],
            "last_start": table.start(count - 1), "last_bytes": table.ends[-1] - table.start(count - 1),
            "index_bytes": len(doc)}


def _ranged_get_s(endpoint: str, key: str, start: int, end: int) -> float:
    """The median of 3 ranged GETs of ``[start, end)`` through the proxy (boto3): the floor of a
    resume from S3 by index, as this origin answers it (moto reads a whole object for a range)."""
    from bench.common import s3_client

    os.environ.update(_CREDENTIALS)
    client = s3_client(endpoint)
    times = []
    for _ in range(3):
        started = time.perf_counter()
        client.get_object(Bucket=BUCKET, Key=PREFIX + key, Range=f"bytes={start}-{end - 1}")["Body"].read()
        times.append(time.perf_counter() - started)
    return sorted(times)[1]


def _run_child(spec: dict[str, Any], log: Path) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-m", "bench.resume_bench", "--child", json.dumps(spec)],
                         capture_output=True, text=True, timeout=1800)
    with log.open("a") as handle:
        handle.write(out.stderr)
    if out.returncode != 0:
        raise RuntimeError(f"{spec['case']} ({'after' if spec['index'] else 'before'}) failed: {out.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def run(args: argparse.Namespace) -> dict[str, Any]:
    size = parse_size(args.size or ("32MiB" if args.quick else "1GiB"))
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="shardcache-resume-"))
    workdir.mkdir(parents=True, exist_ok=True)
    cases = args.cases.split(",") if args.cases else list(CASES)
    result: dict[str, Any] = {"benchmark": "resume", "machine": machine_facts(), "cases": {}}
    try:
        with contextlib.ExitStack() as stack:
            store = stack.enter_context(MotoServer(workdir))
            shard = _build(store, size, args.seed)
            log_line(f"shard: {fmt_size(shard['bytes'])}, {shard['samples']} samples; resuming at the last, "
                     f"{shard['last_bytes']} bytes from byte {shard['last_start']}")
            proxy = stack.enter_context(LatencyProxy(store.endpoint, args.delay_ms, None, workdir / "proxy.log"))
            base = {"resume_at": shard["samples"] - 1, "last_key": shard["last_key"]}
            result["ranged_get_s"] = round(_ranged_get_s(proxy.endpoint, shard["key"], shard["last_start"],
                                                         shard["last_start"] + shard["last_bytes"]), 4)
            log_line(f"one ranged GET of the last sample through the proxy: {result['ranged_get_s']} s")
            for variant, index in (("before", False), ("after", True)):
                daemon: ServeProcess | None = None
                if any(c != "s3" for c in cases):
                    # A fresh daemon, an empty cache: the cold case is cold, then warm.
                    daemon = ServeProcess(workdir / f"daemon-{variant}.log", [
                        "--cache-dir", str(workdir / f"cache-{variant}"), "--cache-size", "8GiB", "--min-free", "0%",
                        "--origin", "s3", "--s3-endpoint", proxy.endpoint,
                    ], env=_CREDENTIALS)
                    daemon.start()
                try:
                    for case in cases:
                        spec = {**base, "case": case, "index": index, "daemon": None if case == "s3" else daemon.url,
                                "s3_endpoint": proxy.endpoint if case == "s3" else None}
                        if case == "http_warm" and "http_cold" not in cases and daemon is not None:
                            _run_child({**spec, "case": "http_cold"}, workdir / "warmup.log")
                        figures = _run_child(spec, workdir / f"{case}-{variant}.log")
                        result["cases"].setdefault(case, {})[variant] = figures
                        log_line(f"  {case} {variant}: first sample {figures['first_sample_s']} s, read "
                                 f"{figures['bytes_read']} B, daemon served {figures['daemon_served_bytes']} B, origin "
                                 f"{figures['origin_read_bytes']} B")
                        if case == "http_cold" and daemon is not None:
                            daemon.settle(timeout=600)
                finally:
                    if daemon is not None:
                        daemon.stop()
        result["shard"] = {**shard, "delay_ms": args.delay_ms}
        for figures in result["cases"].values():
            if "before" in figures and "after" in figures and figures["after"]["first_sample_s"]:
                figures["speedup"] = round(figures["before"]["first_sample_s"] / figures["after"]["first_sample_s"], 1)
        return result
    finally:
        if not args.keep and args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)


def _size(n: int | None) -> str:
    return "-" if n is None else fmt_size(n)


def print_table(result: dict[str, Any]) -> None:
    shard = result["shard"]
    print(f"\nresume at the last sample of a {fmt_size(shard['bytes'])} shard ({shard['samples']} samples, the last "
          f"{shard['last_bytes']} B), {shard['delay_ms']:g} ms per origin request; one ranged GET of the last "
          f"sample from the origin: {result['ranged_get_s'] * 1000:.0f} ms\n")
    print(f"{'case':<19} {'before s':>9} {'after s':>8} {'x':>6} {'read before':>12} {'read after':>11} "
          f"{'origin before':>14} {'origin after':>13}")
    for case, figures in result["cases"].items():
        b, a = figures.get("before", {}), figures.get("after", {})
        print(f"{case:<19} {b.get('first_sample_s', 0):>9.3f} {a.get('first_sample_s', 0):>8.3f} "
              f"{figures.get('speedup', 0):>6} {_size(b.get('bytes_read')):>12} {_size(a.get('bytes_read')):>11} "
              f"{_size(b.get('origin_read_bytes')):>14} {_size(a.get('origin_read_bytes')):>13}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.resume_bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="CI-sized run (a 32 MiB shard)")
    parser.add_argument("--size", default=None, help="the shard's payload (default 1GiB)")
    parser.add_argument("--delay-ms", type=float, default=20.0, help="per-request delay of the origin")
    parser.add_argument("--cases", default=None, help=f"comma-separated subset of {','.join(CASES)}")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--keep", action="store_true")
    parser.add_argument("--results-dir", default=str(RESULTS_DIR))
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return 0
    result = run(args)
    path = write_results(Path(args.results_dir) / ("resume-quick.json" if args.quick else "resume.json"), result)
    print_table(result)
    print(f"\nresults: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
