"""``shardcache index``: build (or ``--verify``) a dataset's ``manifest.json``, and with
``--members`` a member index next to each shard (:mod:`wire.members`)."""

from __future__ import annotations

import argparse
import json
import sys
import threading
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from typing import Any

from sidecar.cli.datasets import (
    Counter,
    ListedObject,
    ObjectStore,
    ShardInfo,
    build_manifest,
    compare,
    dataset_errors,
    list_shards,
    manifest_bytes,
    members_problem,
    open_store,
    quiet_libraries,
    read_object,
    scan_and_index,
    scan_shard,
    write_object,
)
from sidecar.cli.progress import Display, Progress, ProgressLine, RateMeter, format_bytes
from sidecar.cli.util import EXIT_FAILED, EXIT_OK, RawDefaultsFormatter, UserError, add_flag
from wire.dataset import MANIFEST_NAME, ManifestShard, parse_dataset_url, parse_manifest, wids_index_bytes
from wire.members import MAX_MEMBERS_BYTES, MEMBERS_SUFFIX, members_key

__all__ = ["register", "run", "scan_all"]

EXAMPLES = """\
examples:
  # index an S3 dataset: writes s3://bucket/train/manifest.json
  shardcache index s3://bucket/train/

  # a local dataset tree (the first directory under the origin root is the bucket)
  shardcache index file:///data/bucket/train/

  # write the manifest somewhere else (S3, file:// or a local path; - for stdout)
  shardcache index s3://bucket/train/ --output /tmp/manifest.json

  # also a wids shard index (webdataset's indexed reader, wids.ShardListDataset) next to it
  shardcache index s3://bucket/train/ --wids shardindex.json

  # also a member index per shard (train-000000.tar.members.json next to train-000000.tar),
  # pinned in the manifest: any sample of a cold shard is then one ranged read
  shardcache index s3://bucket/train/ --members

  # re-check the objects against the existing manifest; exits 1 and lists every mismatch
  shardcache index s3://bucket/train/ --verify

  # against a MinIO/Ceph endpoint, 32 shards read at once
  AWS_ENDPOINT_URL=http://minio:9000 shardcache index s3://bucket/train/ --jobs 32

Samples are counted the way the loader reads them: tar members sharing a basename up to the
first dot (000123.jpg, 000123.cls) are one sample.

--members reads each shard once, as without it: a shard read from S3 is copied to a temporary
file (TMPDIR) while it is hashed, so up to --jobs shards' worth of disk is used at once. A shard
that cannot be indexed by sample (a sparse member, a field twice in a sample) is listed in the
manifest without a member index, reported, and the exit status is 1. --verify checks the member
indexes the manifest pins (present, their xxh3-128, and naming the shard's size and xxh3-128).
"""


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "index",
        help="build or verify a dataset's manifest.json (keys, sizes, xxh3-128, sample counts)",
        description="Read every *.tar shard under a dataset prefix and write manifest.json: shard keys, "
        "sizes, xxh3-128 checksums and sample counts. Trainers and warm-ups use it to verify what they read.",
        epilog=EXAMPLES,
        formatter_class=RawDefaultsFormatter,
    )
    parser.add_argument("url", metavar="URL", help="dataset prefix: s3://bucket/prefix/ or file:///root/bucket/prefix/")
    add_flag(parser, "--output", default=None, metavar="WHERE",
             help="where to write the manifest (s3://..., file://..., a path, or - for stdout); "
             "default URL/manifest.json. With --verify: the manifest to check")
    add_flag(parser, "--wids", default=None, metavar="NAME",
             help="also write a wids shard index (wids-shard-index-v1: url, nsamples, filesize) as URL/NAME, for "
             "wids.ShardListDataset and loader.ShardIndex(URL/NAME)")
    add_flag(parser, "--members", action="store_true", default=False,
             help=f"also write each shard's member index (where each sample lies, with its xxh3-64) as "
             f"<shard>{MEMBERS_SUFFIX} next to the shard, in the dataset's store whatever --output says, and pin "
             "it in the manifest (members_xxh3_128)")
    add_flag(parser, "--verify", action="store_true", default=False,
             help="re-check the objects against the existing manifest and report every mismatch; write nothing")
    add_flag(parser, "--jobs", default="8", metavar="N", help="shards read in parallel")
    add_flag(parser, "--s3-endpoint", default=None, metavar="URL",
             help="S3 endpoint (default: boto3's resolution, including AWS_ENDPOINT_URL)")
    add_flag(parser, "--json", action="store_true", default=False, help="print the result as JSON on stdout")
    add_flag(parser, "--quiet", action="store_true", default=False, help="no progress display")
    parser.set_defaults(func=run)


def _jobs(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise UserError(f"--jobs must be an integer, not {text!r}") from None
    if not 1 <= value <= 256:
        raise UserError("--jobs must be between 1 and 256")
    return value


def run(args: argparse.Namespace) -> int:
    quiet_libraries()
    try:
        dataset = parse_dataset_url(args.url)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    jobs = _jobs(args.jobs)
    target = args.output or dataset.object_url(MANIFEST_NAME)
    wids_target = _wids_target(args.wids, dataset.object_url) if args.wids else None  # checked before any read
    with dataset_errors():
        store = open_store(dataset, args.s3_endpoint)
        listing = store.list()
        shards = [obj for obj in listing if obj.key.endswith(".tar")] if not args.verify else list_shards(store)
        if args.verify:
            data = read_object(target, args.s3_endpoint) if target != "-" else sys.stdin.buffer.read()
            if data is None:
                raise UserError(f"no manifest at {target}: build one with `shardcache index {dataset.url}`")
            try:
                expected = parse_manifest(data, target)
            except ValueError as exc:
                raise UserError(str(exc), EXIT_FAILED) from None
            present = {obj.key: obj for obj in listing}
            to_scan = [present[shard.key] for shard in expected if shard.key in present]
            found = scan_all(store, to_scan, jobs, quiet=args.quiet or args.json, label="verify")
            by_key = {info.key: info for info in found}
            pinned = [shard for shard in expected if shard.members is not None and shard.key in by_key]
            checked = check_members(store, pinned, by_key, jobs)
            problems = compare(expected, by_key, [obj.key for obj in shards], checked)
            return _report_verify(args, dataset.url, target, expected, problems, len(pinned))
        if not shards:
            raise UserError(f"no *.tar shards under {dataset.url}: check the URL (it is a prefix, ending in /)")
        found = scan_all(store, shards, jobs, quiet=args.quiet or args.json,
                         label="index+members" if args.members else "index", members=args.members)
        broken = [info for info in found if info.error is not None]
        if broken:
            for info in broken:
                print(f"corrupt shard {dataset.url}{info.key}: {info.error}", file=sys.stderr)
            if args.json:
                print(json.dumps({"ok": False, "corrupt": [{"key": i.key, "error": i.error} for i in broken]}))
            print(f"shardcache index: {len(broken)} of {len(found)} shards are not readable WebDataset tars; "
                  "no manifest written (fix or remove them and index again)", file=sys.stderr)
            return EXIT_FAILED
        doc = build_manifest(found)
        data = manifest_bytes(doc)
        wids_where: str | None = None
        if target == "-":
            sys.stdout.write(data.decode())
            sys.stdout.flush()
            where = "stdout"
        else:
            try:
                where = write_object(target, data, args.s3_endpoint)
            except ValueError as exc:
                raise UserError(str(exc)) from None
        if wids_target is not None:
            listed = [ManifestShard(s["key"], s["size"], None, s["samples"]) for s in doc["shards"]]
            try:
                wids_where = write_object(wids_target, wids_index_bytes(listed), args.s3_endpoint)
            except ValueError as exc:
                raise UserError(str(exc)) from None
            if not args.json:
                print(f"wids shard index -> {wids_where}", file=sys.stderr if target == "-" else sys.stdout)
    samples = sum(info.samples or 0 for info in found)
    size = sum(info.size for info in found)
    written = sum(1 for info in found if info.members is not None)
    unindexed = sorted((info for info in found if info.members_error is not None), key=lambda info: info.key)
    for info in unindexed:
        print(f"no member index for {dataset.url}{info.key}: {info.members_error}", file=sys.stderr)
    members_line = (f"{written} member indexes -> next to the shards at {dataset.url} (<shard>{MEMBERS_SUFFIX})"
                    if args.members else "")
    if args.json and target != "-":
        print(json.dumps({"ok": not unindexed, "manifest": where, "shards": len(found), "samples": samples,
                          "bytes": size, **({"wids": wids_where} if wids_where else {}),
                          **({"members": written, "unindexed": [{"key": i.key, "error": i.members_error}
                                                                for i in unindexed]} if args.members else {})}))
    elif target != "-":
        print(f"indexed {len(found)} shards, {samples} samples, {format_bytes(size)} -> {where}")
        if members_line:
            print(members_line)
    elif members_line and not args.json:
        print(members_line, file=sys.stderr)
    if unindexed:
        print(f"shardcache index: {len(unindexed)} of {len(found)} shards cannot be indexed by sample; the manifest "
              "lists them without a member index (readers read them whole)", file=sys.stderr)
        return EXIT_FAILED
    return EXIT_OK


def _wids_target(name: str, object_url: Callable[[str], str]) -> str:
    """Where ``--wids NAME`` goes: a file name at the dataset prefix (wids reads shard URLs
    relative to its index, so the index lies beside them)."""
    if "/" in name or not name.endswith(".json") or name == MANIFEST_NAME:
        raise UserError(f"--wids takes a file name ending in .json other than {MANIFEST_NAME}, written at the dataset "
                        f"prefix beside the shards (wids reads their URLs relative to it), not {name!r}")
    return object_url(name)


def check_members(store: ObjectStore, pinned: list[ManifestShard], found: dict[str, ShardInfo],
                  jobs: int) -> dict[str, str]:
    """What is wrong with each member index the manifest pins for ``pinned`` (shards that were
    found), by shard key; read on ``jobs`` threads, one index in memory per thread."""

    def check(shard: ManifestShard) -> tuple[str, str | None]:
        name = members_key(shard.key)
        data = store.read_small(name, MAX_MEMBERS_BYTES)
        return shard.key, members_problem(data, shard, found[shard.key], store.dataset.object_url(name))

    if not pinned:
        return {}
    with ThreadPoolExecutor(max_workers=jobs, thread_name_prefix="members") as pool:
        return {key: problem for key, problem in pool.map(check, pinned) if problem is not None}


def _report_verify(args: argparse.Namespace, url: str, target: str, expected: list[Any], problems: list[Any],
                   pinned: int = 0) -> int:
    if args.json:
        print(json.dumps({
            "ok": not problems, "manifest": target, "shards": len(expected),
            **({"member_indexes": pinned} if pinned else {}),
            "mismatches": [p.as_dict() for p in problems],
        }))
    else:
        for problem in problems:
            print(f"MISMATCH {problem.problem:<10} {url}{problem.key}: {problem.detail}")
        if problems:
            keys = len({p.key for p in problems})
            print(f"{target}: {len(problems)} mismatches in {keys} shards of {len(expected)}; "
                  f"re-run `shardcache index {url}` once the dataset is as intended")
        else:
            checked = f"; {pinned} member indexes" if pinned else ""
            print(f"{target}: all {len(expected)} shards match (size, xxh3-128, samples{checked})")
    return EXIT_FAILED if problems else EXIT_OK


class _Stopped(Exception):
    """Raised in a reader thread to end its scan once :func:`scan_all` is leaving (Ctrl-C, or
    another scan's error). A signal, not an error: deliberately outside
    :class:`~sidecar.errors.SidecarError`, so that no handler of errors takes it for one (nothing
    collects a stopped scan's result)."""


def scan_all(store: ObjectStore, objects: list[ListedObject], jobs: int, quiet: bool, label: str,
             members: bool = False) -> list[ShardInfo]:
    """Scan shards on ``jobs`` threads with a progress display on stderr; Ctrl-C stops promptly
    (each reader checks a stop flag between reads). ``members``: also write each shard's member
    index next to it (:func:`~sidecar.cli.datasets.scan_and_index`)."""
    counter = Counter()
    stop = threading.Event()
    total_bytes = sum(obj.size for obj in objects)

    def on_bytes(count: int) -> None:
        if stop.is_set():
            raise _Stopped()
        counter.add_bytes(count)

    def scan(obj: ListedObject) -> ShardInfo:
        reader = store.open(obj.key)
        try:
            url = store.dataset.object_url(obj.key)
            if members:
                return scan_and_index(reader, obj.key, url, on_bytes, store.write)
            return scan_shard(reader, obj.key, url, on_bytes)
        finally:
            reader.close()
            counter.add_file()

    display = None if quiet else Display(sys.stderr)
    meter = RateMeter()

    def draw(force: bool = False, state: str = "running") -> None:
        if display is None:
            return
        rate = meter.update(counter.bytes) if state == "running" else meter.average(counter.bytes)
        eta = (total_bytes - counter.bytes) / rate if rate else None
        progress = Progress(counter.files, len(objects), counter.bytes, total_bytes, 0, rate, eta, state)
        display.update([ProgressLine(label, progress)], force=force)

    results: list[ShardInfo] = []
    pool = ThreadPoolExecutor(max_workers=jobs, thread_name_prefix="index")
    try:
        pending = {pool.submit(scan, obj) for obj in objects}
        while pending:
            done, pending = wait(pending, timeout=0.1, return_when=FIRST_COMPLETED)
            for future in done:
                results.append(future.result())
            draw()
        draw(force=True, state="done")
    finally:
        stop.set()
        pool.shutdown(wait=True, cancel_futures=True)
    return results
