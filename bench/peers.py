"""The readers the suite compares, each used the way its documentation shows, all yielding
WebDataset samples (``{"__key__": ..., "jpg": b"...", "cls": b"..."}``) of the same data:

- ``raw``: the shards as local files, read sequentially (1 MiB ``readinto``), no parsing: the
  local physical limit (page cache cold, then warm).
- ``boto3``: ``get_object`` per shard, the body streamed through :mod:`tarfile` (``r|``).
- ``boto3_transfer``: boto3's managed ``download_fileobj`` per shard into memory (its
  TransferManager defaults: 8 MiB parts on 10 threads), then the same :mod:`tarfile` parse: the
  strongest single-reader cold peer where one connection is slower than the link.
- ``s3fs``: ``S3FileSystem.open`` per shard (its default read-ahead block cache), through tarfile.
- ``webdataset``: ``wds.WebDataset(urls, cache_dir=...)``: its shard cache; the URLs are
  presigned ``http://`` URLs read by its default ``curl`` handler (its ``pipe:aws s3 cp``
  recipe costs ~1.8 s of CLI start-up per shard here, which would say more about the CLI).
- ``streaming``: mosaicml-streaming ``StreamingDataset(remote="s3://.../mds/", local=cache)`` on
  the same samples converted to MDS with its ``MDSWriter``; ``S3_ENDPOINT_URL`` selects the
  endpoint, as its documentation says for S3-compatible stores.
- ``s3torchconnector``: ``S3IterableDataset.from_objects`` (the AWS CRT client), each
  ``S3Reader`` through tarfile.
- ``loader``: ``loader.ShardLoader`` through a shardcache daemon, static (``rank``/``world_size``)
  or leased from a master (``job``/``master``), short-circuit reads on or off.

``python -m bench.peers SPEC.json OUT.json`` runs one reader for the epochs in the spec (in
``procs`` processes) and writes per-epoch figures; the suite runs every reader this way so each
has its own process, memory peak and CPU account.
"""

from __future__ import annotations

import io
import json
import multiprocessing as mp
import os
import resource
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from bench.common import TEST_CREDENTIALS
from bench.peers_common import Meter, import_streaming, merge_epochs, proc_status_kib, tar_samples
from cache import aligned_buffer

__all__ = ["READERS", "make_reader", "run_spec", "main"]

READERS = ("raw", "boto3", "boto3_transfer", "s3fs", "webdataset", "streaming", "s3torchconnector", "loader")

def _raw(spec: dict[str, Any]) -> Any:
    paths = [os.path.join(spec["local_dir"], key) for key in spec["keys"]]
    counts = spec["samples_per_key"]
    buffer = aligned_buffer(1 << 20)

    def epoch(_index: int) -> Iterator[dict[str, Any]]:
        # No parsing: one pseudo-sample per shard carrying the shard's byte count, so the meter's
        # byte total is the file bytes; the suite takes the sample count from the manifest.
        for path, count in zip(paths, counts, strict=True):
            total = 0
            with open(path, "rb", buffering=0) as handle:
                while n := handle.readinto(buffer):
                    total += n
            yield {"__key__": path, "__raw_bytes__": total, "__samples__": count}

    return epoch


def _boto3(spec: dict[str, Any]) -> Any:
    from bench.common import s3_client

    client = s3_client(spec["endpoint"], max_pool=16)
    bucket, prefix = spec["bucket"], spec["prefix"]

    def epoch(_index: int) -> Iterator[dict[str, Any]]:
        for key in spec["keys"]:
            body = client.get_object(Bucket=bucket, Key=prefix + key)["Body"]
            try:
                yield from tar_samples(body, f"s3://{bucket}/{prefix}{key}")
            finally:
                body.close()

    return epoch


def _boto3_transfer(spec: dict[str, Any]) -> Any:
    from boto3.s3.transfer import TransferConfig

    from bench.common import s3_client

    # More pooled connections than the transfer's 10 threads, so none waits for a connection.
    client = s3_client(spec["endpoint"], max_pool=16)
    # boto3's defaults (multipart above 8 MiB, 8 MiB parts, 10 threads), with the classic
    # TransferManager pinned: "auto" would switch to the CRT client on the EC2 types awscrt
    # optimises for, which is s3torchconnector's client, another peer.
    config = TransferConfig(preferred_transfer_client="classic")
    bucket, prefix = spec["bucket"], spec["prefix"]

    def epoch(_index: int) -> Iterator[dict[str, Any]]:
        for key in spec["keys"]:
            # A BytesIO, as a user holding a shard in memory writes it: parts land at their
            # offsets (seek + write) as they complete. The whole shard is there before its first
            # sample, which the first-sample time shows.
            buffer = io.BytesIO()
            client.download_fileobj(bucket, prefix + key, buffer, Config=config)
            buffer.seek(0)
            yield from tar_samples(buffer, f"s3://{bucket}/{prefix}{key}")

    return epoch


def _s3fs(spec: dict[str, Any]) -> Any:
    import s3fs

    fs = s3fs.S3FileSystem(key=TEST_CREDENTIALS["AWS_ACCESS_KEY_ID"], secret=TEST_CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
                           endpoint_url=spec["endpoint"], client_kwargs={"region_name": "us-east-1"})
    bucket, prefix = spec["bucket"], spec["prefix"]

    def epoch(_index: int) -> Iterator[dict[str, Any]]:
        for key in spec["keys"]:
            with fs.open(f"{bucket}/{prefix}{key}", "rb") as handle:
                yield from tar_samples(handle, f"s3://{bucket}/{prefix}{key}")

    return epoch


def _webdataset(spec: dict[str, Any]) -> Any:
    import webdataset as wds

    from bench.common import s3_client

    client = s3_client(spec["endpoint"])
    urls = [client.generate_presigned_url("get_object", Params={"Bucket": spec["bucket"], "Key": spec["prefix"] + key},
                                          ExpiresIn=6 * 3600) for key in spec["keys"]]
    Path(spec["cache_dir"]).mkdir(parents=True, exist_ok=True)
    dataset = wds.WebDataset(urls, cache_dir=spec["cache_dir"], shardshuffle=False, empty_check=False)

    def epoch(_index: int) -> Iterable[dict[str, Any]]:
        return dataset

    return epoch


def _streaming(spec: dict[str, Any]) -> Any:
    os.environ["S3_ENDPOINT_URL"] = spec["endpoint"]
    StreamingDataset = import_streaming().StreamingDataset  # noqa: N806
    from streaming.base.util import clean_stale_shared_memory

    clean_stale_shared_memory()
    dataset = StreamingDataset(remote=f"s3://{spec['bucket']}/{spec['mds_prefix']}", local=spec["cache_dir"],
                               shuffle=False, batch_size=64)

    def epoch(_index: int) -> Iterable[dict[str, Any]]:
        return dataset

    return epoch


def _s3torchconnector(spec: dict[str, Any]) -> Any:
    from s3torchconnector import S3ClientConfig, S3IterableDataset

    uris = [f"s3://{spec['bucket']}/{spec['prefix']}{key}" for key in spec["keys"]]
    # force_path_style: moto (like MinIO/Ceph) serves path-style addressing on a bare host:port.
    dataset = S3IterableDataset.from_objects(uris, region="us-east-1", endpoint=spec["endpoint"],
                                             s3client_config=S3ClientConfig(force_path_style=True))

    def epoch(_index: int) -> Iterator[dict[str, Any]]:
        for reader in dataset:
            yield from tar_samples(reader, reader.bucket + "/" + reader.key)

    return epoch


def _loader(spec: dict[str, Any], rank: int, world: int) -> Any:
    from loader import LoaderSettings, ShardLoader

    settings = LoaderSettings.from_env(endpoint=spec["daemon"], short_circuit=spec.get("short_circuit", True),
                                       zero_copy=spec.get("zero_copy", False))
    url = f"s3://{spec['bucket']}/{spec['prefix']}"
    if spec.get("master"):
        shard_loader = ShardLoader(url, job=spec["job"], master=spec["master"], epochs=len(spec["epochs"]),
                                   seed=spec.get("seed", 0), trainer=f"bench-{rank}", settings=settings)
    else:
        shard_loader = ShardLoader(url, rank=rank, world_size=world, seed=spec.get("seed", 0), epoch=0,
                                   settings=settings)

    def epoch(_index: int) -> Iterable[dict[str, Any]]:
        return shard_loader

    return epoch


def make_reader(spec: dict[str, Any], rank: int = 0, world: int = 1) -> Any:
    """``epoch(index) -> iterable of samples`` for ``spec["reader"]``."""
    name = spec["reader"]
    if name == "loader":
        return _loader(spec, rank, world)
    if world != 1:
        raise ValueError(f"reader {name!r} runs in one process")
    makers = {"raw": _raw, "boto3": _boto3, "boto3_transfer": _boto3_transfer, "s3fs": _s3fs, "webdataset": _webdataset, "streaming": _streaming,
              "s3torchconnector": _s3torchconnector}
    if name not in makers:
        raise ValueError(f"unknown reader {name!r}; known: {', '.join(READERS)}")
    return makers[name](spec)


def _raw_view(samples: Iterable[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """For ``raw``: turn per-shard byte counts into the byte/sample totals the meter adds up."""
    for item in samples:
        count = max(1, item["__samples__"])
        per = item["__raw_bytes__"] // count
        rest = item["__raw_bytes__"] - per * count
        blob = memoryview(bytes(per + rest))
        for index in range(count):
            yield {"__key__": str(index), "b": blob if index == 0 else blob[:per]}


def _worker(spec: dict[str, Any], rank: int, world: int, barrier: Any) -> dict[str, Any]:
    for name, value in TEST_CREDENTIALS.items():
        os.environ.setdefault(name, value)
    epoch_of = make_reader(spec, rank, world)
    meter = Meter(spec.get("server_pids", []), spec.get("daemon"), spec.get("with_stats", False))
    stats = []
    for index, plan in enumerate(spec["epochs"]):
        if barrier is not None:
            barrier.wait(timeout=600)
        samples = epoch_of(index)
        if spec["reader"] == "raw":
            samples = _raw_view(samples)
        stat = meter.run(index, samples, pace=plan.get("pace"), cap_s=plan.get("cap_s"))
        stats.append(stat.as_dict())
    # VmHWM, not ru_maxrss: Linux carries ru_maxrss over exec from the parent (the suite, which
    # held the dataset), while VmHWM belongs to this process's own address space.
    peak = proc_status_kib(os.getpid(), "VmHWM") or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"rank": rank, "epochs": stats, "peak_rss_kib": peak}


def _child(spec: dict[str, Any], rank: int, world: int, barrier: Any, out: Any) -> None:
    try:
        out.put(_worker(spec, rank, world, barrier))
    except BaseException as exc:
        out.put({"rank": rank, "error": f"{type(exc).__name__}: {exc}"})
        raise


def run_spec(spec: dict[str, Any]) -> dict[str, Any]:
    """Run a spec in this process (``procs`` 1) or in ``procs`` spawned processes."""
    procs = int(spec.get("procs", 1))
    started = time.monotonic()
    if procs == 1:
        results = [_worker(spec, 0, 1, None)]
    else:
        ctx = mp.get_context("spawn")
        barrier = ctx.Barrier(procs)
        out = ctx.Queue()
        children = [ctx.Process(target=_child, args=(spec, rank, procs, barrier, out), name=f"bench-reader-{rank}")
                    for rank in range(procs)]
        for child in children:
            child.start()
        results = [out.get(timeout=1800) for _ in children]
        for child in children:
            child.join(60)
        errors = [r["error"] for r in results if "error" in r]
        if errors:
            raise RuntimeError("; ".join(errors))
    server_hwm = {str(pid): proc_status_kib(pid, "VmHWM") for pid in spec.get("server_pids", [])}
    return {
        "reader": spec["reader"],
        "procs": procs,
        "epochs": merge_epochs([r["epochs"] for r in results]),
        "reader_peak_rss_kib": sum(r["peak_rss_kib"] for r in results),
        "server_hwm_kib": server_hwm,
        "elapsed_s": time.monotonic() - started,
    }


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -m bench.peers SPEC.json OUT.json", file=sys.stderr)
        return 2
    spec = json.loads(Path(args[0]).read_text())
    try:
        result = run_spec(spec)
    except Exception as exc:  # the suite records what failed and goes on with the other readers
        import traceback

        traceback.print_exc()
        result = {"reader": spec.get("reader"), "error": f"{type(exc).__name__}: {exc}"}
    from bench.common import write_results

    write_results(Path(args[1]), result)
    return 0 if "error" not in result else 1


if __name__ == "__main__":
    raise SystemExit(main())
