"""``python -m bench.random_bench``: samples by index (issue 31) against the indexed readers users
would pick instead, in one run.

One dataset of WebDataset shards on a moto S3 server behind the latency proxy (20 ms per request,
as the suite), read in one seeded random order of sample indices (a shuffled sampler's), twice:
cold (nothing cached anywhere) and warm (the same order again, at least ten times over and for at
least 5 s, no pass begun after 30 s: ``WARM_REPEATS``, ``WARM_LEAST_S``, ``WARM_ENOUGH_S``). Readers, each in a process of its own,
with its own empty cache:

- ``limit``: no reader, the bound of those that copy: each sample's members sliced (copied) out of
  a mapping of a local copy of its shard, in memory beforehand, found by a list lookup. A peer's
  warm figure and the limit's, side by side, say how far any copying reader can outrun that peer;

- ``shardcache``: ``loader.ShardIndex`` (what ``ShardMapDataset`` reads by) through a node daemon
  with short-circuit by handle, the dataset's manifest with sample counts, one sample at a time;
  ``shardcache_batched``: the same in batches of 64 (``ShardIndex.samples``, what a DataLoader's
  ``__getitems__`` calls), the batch's cold shards hinted to the daemon together;
  ``shardcache_batched_per_sample``: the same batches with one ranged read per cold sample (no
  samples of a shard merged into one range: the choice the batched reader makes, measured);
  ``shardcache_zero_copy``: one at a time, fields as views of the mapping (``zero_copy=True``).
  The dataset is indexed with ``shardcache index --members``: a cold shard's samples are read by
  ranges (answered from the origin by range while the daemon fills the shard behind them);
  ``shardcache_whole`` reads as without member indexes (``by_range=False``: a cold shard is read
  whole before its first sample), the figure before ranged reads;
- ``wids``: webdataset's ``wids.ShardListDataset`` with its local cache, on the wids shard index
  ``shardcache index --wids`` wrote (its shards fetched with curl over HTTP through the proxy);
- ``streaming``: mosaicml-streaming ``StreamingDataset.__getitem__`` on the same samples
  converted to MDS with its ``MDSWriter``, its local cache;
- ``litdata``: LitData's ``StreamingDataset.__getitem__`` on the same samples converted with its
  ``optimize`` (dicts of the key, jpg and cls bytes, chunks of the tar shards' size), read through
  the proxy with ``storage_options={"endpoint_url": ...}``, whole chunks into its local cache.
  Two things of LitData 0.2.76 are set for that, both private: ``_on_demand_bytes = False``, and
  ``allow_http`` in the options of its obstore client. Left alone, an int index of a remote dataset
  reads the sample's bytes by range at the offsets of the chunk's item table, which ``optimize``
  leaves empty (every offset the table's end) when samples are dicts of str/bytes and pyarrow is
  installed: the rows are in an Arrow footer, so every item read that way is 0 bytes (the "empty
  items" of a first try, not the endpoint). And its obstore client for chunk downloads is built
  from the boto3 client's endpoint without ``allow_http``, so every chunk GET to an ``http://``
  endpoint fails (``BadScheme``). Whole chunks are what its iteration and slices read; against S3
  itself (https) the same code runs without the second setting.

A peer whose package is not installed is skipped, the reason in the results (``skipped``). After
the timed passes every sample of the order is read once more, untimed, and compared with the
generator's bytes (key, jpg, cls): a reader that returns wrong or empty samples fails the run.

Figures per pass: samples/s, time to the first sample (cold: against one ranged GET of a sample's
size through the proxy, measured in the same run), CPU seconds per GB of samples (the reader's
process, plus the daemon's for shardcache), and bytes fetched from the origin per sample (the
daemon's origin reads; the peers' downloaded files).

Writes ``bench/results/random.json`` (``random-quick.json`` with ``--quick``) and prints a table.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import importlib.util
import io
import json
import os
import random
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bench.common import (
    RESULTS_DIR,
    TEST_CREDENTIALS,
    fmt_size,
    log_line,
    machine_facts,
    make_samples,
    pack_shards,
    parse_size,
    spawn,
    write_results,
)
from bench.latency_proxy import LatencyProxy
from bench.peers_common import convert_to_mds, env_for_streaming, import_streaming, upload_dir
from bench.servers import MotoServer, ServeProcess

BUCKET = "bench"
PREFIX = "random/"
MDS_PREFIX = "random-mds/"
LITDATA_PREFIX = "random-litdata/"
READERS = ("limit", "shardcache", "shardcache_whole", "shardcache_batched", "shardcache_batched_per_sample", "shardcache_zero_copy",
           "wids", "streaming", "litdata")
PEER_PACKAGES = {"wids": ("wids", "wids"), "streaming": ("streaming", "mosaicml-streaming"), "litdata": ("litdata", "litdata")}
"""Peer reader -> (module it imports, its distribution): a reader whose module is missing is skipped."""
LITDATA_CACHE_SIZE = "4GB"
"""LitData's ``max_cache_size``, about the daemon's ``--cache-size 4GiB``: the dataset fits (its
default is 75% of the free disk, which on a full disk could be less than the dataset and delete
chunks it reads again)."""
WARM_REPEATS = 10
"""Warm passes are the order read at least this many times over..."""
WARM_LEAST_S = 5.0
"""... and for at least this long (0.5 s with ``--quick``; one pass of a fast reader takes 0.02-0.15 s, and ten of them
varied by 1.8x between runs: too short to time)..."""
WARM_ENOUGH_S = 30.0
"""... but no pass is begun after this long: one of LitData's takes minutes on the full dataset (it
reads a whole chunk each time the next sample is in another chunk), ten would take half an hour and
time no better. The pass's ``repeats`` says how many."""
BATCH = 64
"""Samples per batch of the ``shardcache_batched`` reader: ``ShardIndex.samples`` (what
``ShardMapDataset.__getitems__`` calls with a DataLoader's batch)."""
WIDS_INDEX = "shardindex.json"


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _proc_cpu_s(pid: int | None) -> float:
    if pid is None:
        return 0.0
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _dir_bytes(root: str) -> int:
    return sum(p.stat().st_size for p in Path(root).rglob("*") if p.is_file() and not p.name.endswith((".lock", ".db")))


def _chunk_bytes(root: str) -> int:
    """The chunk files LitData downloaded under ``root`` (not its index, locks or counters)."""
    return sum(p.stat().st_size for p in Path(root).rglob("chunk-*.bin") if p.is_file())


def _unavailable(reader: str) -> str | None:
    """Why ``reader`` cannot run here, or None."""
    module, dist = PEER_PACKAGES.get(reader, (None, None))
    if module is not None and importlib.util.find_spec(module) is None:
        return f"{dist} is not installed (pip install -c constraints.txt -e '.[bench]')"
    return None


# -- the reader processes ---------------------------------------------------------------------------


def _open_reader(spec: dict[str, Any]) -> tuple[Any, Any, Any]:
    """(lookup of sample i -> its payload bytes, origin bytes so far, samples of indices -> their
    dicts as the reader returns them, for the check)."""
    kind = spec["reader"]
    if kind == "limit":
        return _limit_reader(spec)
    if kind.startswith("shardcache"):
        from loader import LoaderSettings, ShardIndex

        if kind == "shardcache_batched_per_sample":
            import loader.shardindex

            loader.shardindex.SPAN_GAP_BYTES = -1  # every sample a range of its own

        index = ShardIndex(f"s3://{BUCKET}/{PREFIX}", endpoint=spec["daemon"],
                           settings=LoaderSettings(handles=spec["handles"], zero_copy=kind.endswith("zero_copy")),
                           by_range=kind != "shardcache_whole")

        def origin_bytes() -> tuple[int, int]:
            import urllib.request

            with urllib.request.urlopen(spec["daemon"] + "/_shardcache/stats", timeout=10) as resp:
                stats = json.load(resp)
            # Everything read from the origin, and of it the ranges answered straight from it.
            return int(stats["origin_read_bytes"]), int(stats["served_bytes"].get("range_origin", 0))

        if kind.startswith("shardcache_batched"):
            return (lambda batch: sum(len(v) for sample in index.samples(batch) for k, v in sample.items()
                                      if not k.startswith("__"))), origin_bytes, index.samples
        return ((lambda i: sum(len(v) for k, v in index.sample(i).items() if not k.startswith("__"))), origin_bytes,
                lambda indices: [index.sample(i) for i in indices])
    if kind == "wids":
        import wids

        ds = wids.ShardListDataset(spec["wids_index"], cache_dir=spec["cache"], transformations=[], lru_size=64)
        return (lambda i: sum(len(v.getvalue()) for k, v in ds[i].items() if k.startswith("."))), (
            lambda: (_dir_bytes(spec["cache"]), 0)), lambda indices: [ds[i] for i in indices]
    if kind == "streaming":
        os.environ.update(env_for_streaming(spec["endpoint"]))
        streaming = import_streaming()
        from streaming.base.util import clean_stale_shared_memory

        clean_stale_shared_memory()
        ds = streaming.StreamingDataset(remote=f"s3://{BUCKET}/{MDS_PREFIX}", local=spec["cache"], shuffle=False,
                                        batch_size=1)
        return (lambda i: _mds_bytes(ds[i])), (lambda: (_dir_bytes(spec["cache"]), 0)), lambda indices: [ds[i] for i in indices]
    if kind == "litdata":
        ds = _litdata_dataset(spec)
        return (lambda i: _mds_bytes(ds[i])), (lambda: (_chunk_bytes(spec["cache"]), 0)), lambda indices: [ds[i] for i in indices]
    raise ValueError(f"unknown reader {kind!r}")


def _limit_reader(spec: dict[str, Any]) -> tuple[Any, Any, Any]:
    """What any reader that hands out bytes costs at least: sample ``i``'s members sliced (copied)
    out of a mapping of its shard's file, read by this process once beforehand so that every pass
    is warm, found by a list lookup; no cache, no check, no dict of fields. Its "cold" pass is
    already warm (the files are local): only its warm figure is the limit."""
    import mmap
    import tarfile

    members: list[list[tuple[mmap.mmap, int, int]]] = []
    keys: list[str] = []
    for path in spec["local_shards"]:
        with open(path, "rb") as f:
            buf = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
        with tarfile.open(path) as tar:
            for info in tar:
                key = info.name.rsplit(".", 1)[0]
                if not keys or keys[-1] != key:
                    keys.append(key)
                    members.append([])
                members[-1].append((buf, info.offset_data, info.size))
        buf.madvise(mmap.MADV_WILLNEED)
        for at in range(0, len(buf), 1 << 20):  # every page in memory and mapped before the timing
            buf[at : at + 1]

    def lookup(i: int) -> int:
        return sum(len(buf[at : at + size]) for buf, at, size in members[i])

    def fetch(indices: list[int]) -> list[dict[str, Any]]:
        return [{"__key__": keys[i], **{name: buf[at : at + size] for name, (buf, at, size) in zip(("jpg", "cls"), members[i],
                                                                                                  strict=True)}}
                for i in indices]

    return lookup, (lambda: (0, 0)), fetch


def _litdata_dataset(spec: dict[str, Any]) -> Any:
    """LitData's ``StreamingDataset`` on the converted samples, through the proxy, whole chunks into
    ``spec["cache"]`` (the module docstring says why the two private settings)."""
    import litdata
    import litdata.streaming.downloader as downloader

    if spec["endpoint"].startswith("http://"):
        # Chunk GETs go through obstore, built from the boto3 client's endpoint with these client
        # options (downloader.py, _build_obstore_s3_store): without allow_http an http:// endpoint
        # is refused before any request (reqwest BadScheme).
        downloader._OBSTORE_CLIENT_OPTIONS = {**downloader._OBSTORE_CLIENT_OPTIONS, "allow_http": True}
    storage_options = {"endpoint_url": spec["endpoint"], "aws_access_key_id": TEST_CREDENTIALS["AWS_ACCESS_KEY_ID"],
                       "aws_secret_access_key": TEST_CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
                       "region_name": TEST_CREDENTIALS["AWS_DEFAULT_REGION"]}
    ds = litdata.StreamingDataset(f"s3://{BUCKET}/{LITDATA_PREFIX}", cache_dir=spec["cache"],
                                  storage_options=storage_options, max_cache_size=LITDATA_CACHE_SIZE)
    # An int index of a remote dataset otherwise reads the item by range at the offsets of the
    # chunk's item table (reader.py, read_item_bytes), empty in chunks with an Arrow footer: whole
    # chunks, as its iteration and slices read them. Set before the first read creates the cache.
    ds._on_demand_bytes = False
    return ds


def _mds_bytes(sample: dict[str, Any]) -> int:
    return len(sample["jpg"]) + len(sample["cls"])


def _fields(sample: dict[str, Any]) -> tuple[str, bytes, bytes]:
    """(key, jpg, cls) of a sample as any reader returns it: fields named ``jpg`` or ``.jpg``, bytes,
    views or wids' BytesIO."""
    named = {k.removeprefix("."): v for k, v in sample.items()}

    def raw(value: Any) -> bytes:
        return value.getvalue() if isinstance(value, io.BytesIO) else bytes(value)

    key = named["__key__"]
    return (key if isinstance(key, str) else raw(key).decode()), raw(named["jpg"]), raw(named["cls"])


def _check(fetch: Any, order: list[int], size: int, seed: int) -> int:
    """Every sample of ``order`` read once more (ascending, in batches of ``BATCH``) and compared with
    the generator's; returns how many. Raises on the first one that differs."""
    wanted = sorted(set(order))
    got: dict[int, tuple[str, bytes, bytes]] = {}
    checked = 0
    pending = iter(wanted)
    for n, sample in enumerate(make_samples(size, seed)):
        if not got:
            batch = [i for _, i in zip(range(BATCH), pending, strict=False)]
            if not batch:
                break
            got = {i: _fields(s) for i, s in zip(batch, fetch(batch), strict=True)}
        if n not in got:
            continue
        key, jpg, cls = got.pop(n)
        if (key, jpg, cls) != (sample.key, sample.jpg, sample.cls):
            raise RuntimeError(f"sample {n} differs from the generator's: key {key!r} (want {sample.key!r}), "
                               f"jpg {len(jpg)} bytes (want {len(sample.jpg)}, equal: {jpg == sample.jpg}), "
                               f"cls {cls!r} (want {sample.cls!r})")
        checked += 1
    if checked != len(wanted):
        raise RuntimeError(f"checked {checked} samples of {len(wanted)}: the dataset ended first")
    return checked


def child(spec: dict[str, Any]) -> dict[str, Any]:
    order = spec["order"]
    lookup, origin_bytes, fetch = _open_reader(spec)
    passes = {}
    for name, repeats in (("cold", 1), ("warm", WARM_REPEATS)):
        before_origin, before_ranges = origin_bytes()
        cpu0, daemon0 = _cpu_s(), _proc_cpu_s(spec.get("daemon_pid"))
        started = time.perf_counter()
        first = None
        payload = 0
        steps = [order[i : i + BATCH] for i in range(0, len(order), BATCH)] if "_batched" in spec["reader"] else order
        done = 0
        while True:
            for i in steps:
                payload += lookup(i)
                if first is None:
                    first = time.perf_counter() - started
            done += 1
            spent = time.perf_counter() - started
            if done >= repeats and (name == "cold" or spent >= spec.get("warm_least_s", WARM_LEAST_S)) or spent >= WARM_ENOUGH_S:
                break
        wall = time.perf_counter() - started
        cpu = _cpu_s() - cpu0 + _proc_cpu_s(spec.get("daemon_pid")) - daemon0
        after_origin, after_ranges = origin_bytes()
        fetched, ranged = after_origin - before_origin, after_ranges - before_ranges
        passes[name] = {
            "samples": len(order), "repeats": done, "seconds": round(wall, 3),
            "samples_per_s": round(done * len(order) / wall, 1),
            "first_sample_s": round(first or 0.0, 4), "payload_bytes": payload,
            "cpu_s_per_gb": round(cpu / (payload / 1e9), 2) if payload else None,
            "origin_bytes_per_sample": round(fetched / (done * len(order))),
            "origin_range_bytes": ranged,
        }
    return {"passes": passes, "verified_samples": _check(fetch, order, spec["size"], spec["seed"])}


# -- the run ---------------------------------------------------------------------------------------


def _litdata_samples(job: tuple[int, int]) -> Iterator[dict[str, Any]]:
    """``optimize``'s function: the generator's samples, as dicts of the fields the shards hold."""
    size, seed = job
    for sample in make_samples(size, seed):
        yield {"__key__": sample.key, "jpg": sample.jpg, "cls": sample.cls}


def convert_to_litdata(size: int, seed: int, chunk_bytes: int, out: Path, log: Path) -> dict[str, Any]:
    """The samples written with LitData's ``optimize`` into ``out``: one worker (the samples in the
    generator's order, sample i at index i), chunks of at most ``chunk_bytes``, no compression.
    Its worker process and its intermediate folders stay in ``out``'s parent; what it prints goes
    to ``log``."""
    import litdata

    env = {"DATA_OPTIMIZER_CACHE_FOLDER": str(out.parent / "litdata-chunks"),
           "DATA_OPTIMIZER_DATA_CACHE_FOLDER": str(out.parent / "litdata-data")}
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    sys.stdout.flush()
    sys.stderr.flush()
    # Its worker is a process of its own: its output is redirected where it is written, the
    # descriptors, not sys.stdout.
    kept = [os.dup(1), os.dup(2)]
    try:
        with open(log, "wb") as sink:
            os.dup2(sink.fileno(), 1)
            os.dup2(sink.fileno(), 2)
            litdata.optimize(fn=_litdata_samples, inputs=[(size, seed)], output_dir=str(out), chunk_bytes=chunk_bytes,
                             num_workers=1, verbose=False)
            sys.stdout.flush()
            sys.stderr.flush()
    finally:
        os.dup2(kept[0], 1)
        os.dup2(kept[1], 2)
        for fd in kept:
            os.close(fd)
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    files = sorted(p for p in out.iterdir() if p.is_file())
    chunks = json.loads((out / "index.json").read_text())["chunks"]
    return {"samples": sum(c["chunk_size"] for c in chunks), "files": len(files), "bytes": sum(p.stat().st_size for p in files)}


def _build(workdir: Path, store: MotoServer, size: int, shard_bytes: int, seed: int, readers: list[str]) -> dict[str, Any]:
    client = store.client()
    client.create_bucket(Bucket=BUCKET)
    # wids fetches its shards with curl, unsigned: the shards are public to read (a public dataset).
    client.put_bucket_policy(Bucket=BUCKET, Policy=json.dumps({"Version": "2012-10-17", "Statement": [{
        "Effect": "Allow", "Principal": "*", "Action": "s3:GetObject", "Resource": f"arn:aws:s3:::{BUCKET}/{PREFIX}*"}]}))
    keys, counts, total = [], [], 0
    local = workdir / "local-shards"  # the limit reader's copy
    local.mkdir(exist_ok=True)
    for name, data, count in pack_shards(make_samples(size, seed), shard_bytes):
        client.put_object(Bucket=BUCKET, Key=PREFIX + name, Body=data)
        (local / name).write_bytes(data)
        keys.append(name)
        counts.append(count)
        total += len(data)
    converted: dict[str, Any] = {}
    if "streaming" in readers:
        mds_dir = workdir / "mds-out"
        converted["mds"] = convert_to_mds(make_samples(size, seed), mds_dir)
        upload_dir(client, BUCKET, MDS_PREFIX, mds_dir)
        shutil.rmtree(mds_dir, ignore_errors=True)
    if "litdata" in readers:
        # Chunks of the shards' size (MDS keeps its writer's default, 64 MB), written here and
        # uploaded as the MDS files are.
        litdata_dir = workdir / "litdata-out"
        converted["litdata"] = convert_to_litdata(size, seed, shard_bytes, litdata_dir, workdir / "litdata-optimize.log")
        upload_dir(client, BUCKET, LITDATA_PREFIX, litdata_dir)
        shutil.rmtree(litdata_dir, ignore_errors=True)
    log = workdir / "index.log"
    proc = spawn([sys.executable, "-m", "sidecar.cli", "index", f"s3://{BUCKET}/{PREFIX}", "--s3-endpoint",
                  store.endpoint, "--wids", WIDS_INDEX, "--members", "--quiet", "--json"], log)
    if proc.wait(timeout=600) != 0:
        raise RuntimeError(f"shardcache index failed: {log.read_text()[-2000:]}")
    return {"keys": keys, "samples": sum(counts), "bytes": total, "local_shards": [str(local / k) for k in keys], **converted}


def _ranged_get_s(endpoint: str, key: str, length: int) -> float:
    """The median of 5 ranged GETs of ``length`` bytes through the proxy: one sample's worth."""
    from bench.common import s3_client

    client = s3_client(endpoint)
    times = []
    for _ in range(5):
        started = time.perf_counter()
        client.get_object(Bucket=BUCKET, Key=PREFIX + key, Range=f"bytes=0-{length - 1}")["Body"].read()
        times.append(time.perf_counter() - started)
    return sorted(times)[2]


def _run_child(spec: dict[str, Any], log: Path) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-m", "bench.random_bench", "--child", json.dumps(spec)],
                         capture_output=True, text=True, timeout=3600)
    log.write_text(out.stderr)
    if out.returncode != 0:
        raise RuntimeError(f"{spec['reader']} failed: {out.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def run(args: argparse.Namespace) -> dict[str, Any]:
    size = parse_size(args.size or ("64MiB" if args.quick else "512MiB"))
    shard_bytes = parse_size(args.shard_size or ("8MiB" if args.quick else "64MiB"))
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="shardcache-random-"))
    workdir.mkdir(parents=True, exist_ok=True)
    wanted = [r for r in (args.readers.split(",") if args.readers else READERS)]
    unknown = [r for r in wanted if r not in READERS]
    if unknown:
        raise SystemExit(f"unknown readers {unknown}: choose from {','.join(READERS)}")
    result: dict[str, Any] = {"benchmark": "random", "machine": machine_facts(), "readers": {}, "skipped": {},
                              "verified_samples": {}}
    for reader in wanted:
        reason = _unavailable(reader)
        if reason is not None:
            result["skipped"][reader] = reason
            log_line(f"reader {reader} skipped: {reason}")
    readers = [r for r in wanted if r not in result["skipped"]]
    # The peers' versions, and what LitData's chunks depend on: obstore downloads them, pyarrow
    # decides their layout (rows in an Arrow footer).
    for dist in [d for _, d in PEER_PACKAGES.values()] + ["obstore", "pyarrow"]:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            result["machine"]["packages"][dist] = importlib.metadata.version(dist)
    try:
        with contextlib.ExitStack() as stack:
            store = stack.enter_context(MotoServer(workdir))
            dataset = _build(workdir, store, size, shard_bytes, args.seed, readers)
            log_line(f"dataset: {len(dataset['keys'])} shards, {fmt_size(dataset['bytes'])}, {dataset['samples']} samples")
            proxy = stack.enter_context(LatencyProxy(store.endpoint, args.delay_ms, None, workdir / "proxy.log"))
            # wids reads its index as a local file, and its shards by URL through the proxy (curl).
            wids_doc = json.loads(store.client().get_object(Bucket=BUCKET, Key=PREFIX + WIDS_INDEX)["Body"].read())
            for shard in wids_doc["shardlist"]:
                shard["url"] = f"{proxy.endpoint}/{BUCKET}/{PREFIX}{shard['url']}"
            (workdir / WIDS_INDEX).write_text(json.dumps(wids_doc))
            rng = random.Random(args.seed)
            order = list(range(dataset["samples"]))
            rng.shuffle(order)
            order = order[: args.samples] if args.samples else order
            mean_sample = dataset["bytes"] // dataset["samples"]
            result["ranged_get_s"] = round(_ranged_get_s(proxy.endpoint, dataset["keys"][0], mean_sample), 4)
            for reader in readers:
                log_line(f"reader: {reader}")
                cache = workdir / f"cache-{reader}"
                spec: dict[str, Any] = {"reader": reader, "order": order, "endpoint": proxy.endpoint, "cache": str(cache),
                                        "wids_index": str(workdir / WIDS_INDEX), "size": size, "seed": args.seed,
                                        "local_shards": dataset["local_shards"],
                                        "warm_least_s": 0.5 if args.quick else WARM_LEAST_S}
                daemon = None
                if reader.startswith("shardcache"):
                    sockets = workdir / "sockets"
                    sockets.mkdir(exist_ok=True)
                    daemon = ServeProcess(workdir / "daemon.log", [
                        "--cache-dir", str(cache), "--cache-size", "4GiB", "--min-free", "0%", "--origin", "s3",
                        "--s3-endpoint", proxy.endpoint, "--handles", f"unix://{sockets}/handles.sock",
                    ], env={"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1"})
                    daemon.start()
                    spec.update(daemon=daemon.url, handles=f"unix://{sockets}/handles.sock", daemon_pid=daemon.pid)
                try:
                    ran = _run_child(spec, workdir / f"{reader}.log")
                finally:
                    if daemon is not None:
                        daemon.stop()
                result["readers"][reader] = ran["passes"]
                result["verified_samples"][reader] = ran["verified_samples"]
                for name, figures in result["readers"][reader].items():
                    log_line(f"  {name}: {figures['samples_per_s']} samples/s, first {figures['first_sample_s']} s, "
                             f"{figures['cpu_s_per_gb']} CPU s/GB, {figures['origin_bytes_per_sample']} origin B/sample")
                log_line(f"  {ran['verified_samples']} samples equal to the generator's")
        result["dataset"] = {"shards": len(dataset["keys"]), "bytes": dataset["bytes"], "samples": dataset["samples"],
                             "mean_sample_bytes": mean_sample, "order_samples": len(order), "delay_ms": args.delay_ms,
                             "converted": {k: dataset[k] for k in ("mds", "litdata") if k in dataset}}
        result["targets"] = _targets(result)
        return result
    finally:
        if not args.keep and args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)


def _targets(result: dict[str, Any]) -> dict[str, Any]:
    readers = result["readers"]
    ours = readers.get("shardcache")
    peers = {k: v for k, v in readers.items() if not k.startswith("shardcache") and k != "limit"}
    if not ours or not peers:
        return {}
    best_name = max(peers, key=lambda k: peers[k]["warm"]["samples_per_s"])
    best = peers[best_name]["warm"]["samples_per_s"]
    dataset = result["dataset"]
    warm: dict[str, Any] = {"peer": best_name, "ratio": round(ours["warm"]["samples_per_s"] / best, 2), "target": 2.0}
    zero_copy, limit = readers.get("shardcache_zero_copy"), readers.get("limit")
    if zero_copy:
        warm["zero_copy_ratio"] = round(zero_copy["warm"]["samples_per_s"] / best, 2)
    if limit:
        # The most a reader that copies each sample out (as the peer does) can reach, against the peer.
        warm["copy_limit_ratio"] = round(limit["warm"]["samples_per_s"] / best, 2)
        warm["of_copy_limit"] = round(ours["warm"]["samples_per_s"] / limit["warm"]["samples_per_s"], 2)
    return {
        "warm_vs_fastest_peer": warm,
        "cold_first_sample_vs_ranged_get": {"ratio": round(ours["cold"]["first_sample_s"] / result["ranged_get_s"], 2),
                                             "target": 2.0},
        "origin_bytes_per_epoch_over_dataset": {
            "ratio": round(ours["cold"]["origin_bytes_per_sample"] * dataset["order_samples"] / dataset["bytes"], 3),
            "target": 1.1,
        },
    }


def print_table(result: dict[str, Any]) -> None:
    print(f"\nrandom access: {result['dataset']['order_samples']} samples of {result['dataset']['samples']} "
          f"({fmt_size(result['dataset']['bytes'])}), one seeded order, {result['dataset']['delay_ms']:g} ms per "
          f"origin request; one ranged GET of a sample: {result['ranged_get_s'] * 1000:.0f} ms\n")
    print(f"{'reader':<12} {'pass':<5} {'samples/s':>10} {'first s':>8} {'CPU s/GB':>9} {'origin B/sample':>16}")
    for reader, passes in result["readers"].items():
        for name, f in passes.items():
            print(f"{reader:<12} {name:<5} {f['samples_per_s']:>10.1f} {f['first_sample_s']:>8.3f} "
                  f"{f['cpu_s_per_gb'] or 0:>9.2f} {f['origin_bytes_per_sample']:>16}")
    for reader, reason in result.get("skipped", {}).items():
        print(f"{reader:<12} skipped: {reason}")
    for name, target in result.get("targets", {}).items():
        print(f"{name}: {target}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.random_bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="CI-sized run (64 MiB in 8 MiB shards)")
    parser.add_argument("--size", default=None, help="dataset payload (default 512MiB)")
    parser.add_argument("--shard-size", default=None, help="shard size (default 64MiB)")
    parser.add_argument("--samples", type=int, default=0, help="samples per pass (default: all, one epoch)")
    parser.add_argument("--delay-ms", type=float, default=20.0, help="per-request delay of the origin")
    parser.add_argument("--readers", default=None, help=f"comma-separated subset of {','.join(READERS)}")
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
    path = write_results(Path(args.results_dir) / ("random-quick.json" if args.quick else "random.json"), result)
    print_table(result)
    print(f"\nresults: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
