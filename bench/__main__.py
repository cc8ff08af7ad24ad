"""``python -m bench``: the whole comparison suite (shardcache vs peers vs the local limit).

    python -m bench                      # 2 GiB, 20 ms per request: the published table (< 20 min)
    python -m bench --smoke              # CI: small dataset, every reader once (< 3 min)
    python -m bench --delay-ms 50 --stream-mbps 100 --size 4GiB
    python -m bench --readers raw,boto3,shardcache_loader
    python -m bench --store s3rver --far-host-mbps 800 --delay-ms 0   # root: the store on a far host, no proxy

Writes ``bench/results/suite-<UTC time>.json`` (machine facts, versions, every figure),
``suite.json``/``suite.md``/``suite.png`` (the latest), ``suite-smoke*`` for ``--smoke``.

One component at a time, each its own module (``--quick`` for a smoke run of each):
``python -m bench.daemon_bench`` (the node daemon's reads), ``python -m bench.stall_bench`` (a
trainer's data stall), ``python -m bench.master_bench`` (lease round trips per second) and
``python -m bench.master_memory`` (what a 1,000,000-shard job costs the master's memory) and
``python -m bench.auth_bench`` (what ``--auth sigv4`` costs warm reads), ``python -m bench.handles_bench``
(short-circuit by handle vs path), ``python -m bench.cluster_bench`` (one cache per cluster on a netns test
bed), ``python -m bench.locality_bench`` (cache-aware leases: per-node caches vs the cluster cache vs
cache-aware leases, real trainers of one job on the netns bed), ``python -m bench.cluster_sim`` (a model of
one cache per cluster at 1,000 nodes over the real lease master; also run at the end of ``python -m bench``,
``--no-sim`` skips it) and ``python -m bench.accelerator_bench`` (emulated accelerators kept >= 90% busy,
MLPerf Storage's method).
"""

from __future__ import annotations

import argparse
import shlex
import signal
import sys
from pathlib import Path
from types import FrameType

from bench.common import RESULTS_DIR, parse_size
from bench.servers import STORES
from bench.suite import PEERS, SHARDCACHE_RUNS, SuiteConfig, publish, run_suite

RUN_NAMES = ("raw", *PEERS, *SHARDCACHE_RUNS, "half_cache_lru", "half_cache_hold")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench",
        description="Benchmark shardcache against boto3 (get_object, download_fileobj), s3fs, webdataset, "
        "mosaicml-streaming and s3torchconnector on the same generated WebDataset on an S3 server behind a latency "
        "proxy or a capped network link, and against raw local reads.",
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--smoke", action="store_true", help="small CI run: 192MiB, 16MiB shards, 2 s stall windows")
    parser.add_argument("--size", default=None, help="dataset payload size (default 2GiB; 192MiB with --smoke)")
    parser.add_argument("--shard-size", default=None, help="tar shard size (default 64MiB; 16MiB with --smoke)")
    parser.add_argument("--delay-ms", type=float, default=20.0,
                        help="per-request delay of the store (default 20); 0 with --far-host-mbps: no proxy at all")
    parser.add_argument("--stream-mbps", type=float, default=None,
                        help="per-connection rate cap of the store in MB/s (default: none, loopback speed)")
    parser.add_argument("--far-host-mbps", type=float, default=None,
                        help="run the store on a far host: its own network namespace behind a link of this many "
                        "Mbit/s (tc tbf, both directions; needs root, ip and tc). With --delay-ms 0 no latency proxy "
                        "runs: readers and daemons reach the store directly")
    parser.add_argument("--far-host-flow-mbps", type=float, default=None,
                        help="with --far-host-mbps: each connection's own cap on the far link, Mbit/s (S3 limits "
                             "one request to 85-90 MB/s); default: the link's rate only")
    parser.add_argument("--store", choices=STORES, default="moto",
                        help="S3 server behind the proxy: moto (RAM) or s3rver (files; needs node and npm)")
    parser.add_argument("--stock-moto", action="store_true",
                        help="moto as released (every GET copies the whole object, so a ranged GET costs a whole "
                             "object); default: ranges cost the range, as on S3 (bench.servers.S3_LIKE_MOTO)")
    parser.add_argument("--trainer-rate", type=float, default=1000.0,
                        help="samples/s the simulated trainer consumes (default 1000)")
    parser.add_argument("--stall-seconds", type=float, default=None,
                        help="length of each stall measurement (default 10; 2 with --smoke)")
    parser.add_argument("--readers", default=None, help=f"comma-separated subset of: {', '.join(RUN_NAMES)}")
    parser.add_argument("--upload-checksum", choices=("crc64nvme", "crc32c", "crc32", "none"), default="crc64nvme",
                        help="additional checksum stored with each shard (default crc64nvme, what S3 stores for "
                             "every new object; none: only the ETag, which a fill then verifies as an MD5)")
    parser.add_argument("--seed", type=int, default=0, help="dataset seed")
    parser.add_argument("--workdir", type=Path, default=None, help="where caches and logs go (default: a temp dir, removed)")
    parser.add_argument("--keep", action="store_true", help="keep the temp work dir (logs)")
    parser.add_argument("--results-dir", type=Path, default=RESULTS_DIR, help="where results are written")
    parser.add_argument("--no-sim", action="store_true",
                        help="skip the 1,000-node model of one cache per cluster (bench.cluster_sim)")
    args = parser.parse_args(argv)
    if args.readers:
        unknown = set(args.readers.split(",")) - set(RUN_NAMES)
        if unknown:
            parser.error(f"unknown reader(s) {', '.join(sorted(unknown))}; known: {', '.join(RUN_NAMES)}")
    if args.delay_ms < 0 or args.trainer_rate <= 0:
        parser.error("--delay-ms must be >= 0 and --trainer-rate > 0")
    if args.far_host_flow_mbps is not None and args.far_host_mbps is None:
        parser.error("--far-host-flow-mbps needs --far-host-mbps")
    if args.far_host_mbps is not None:
        from bench.netbed import FarHostUnavailable, check_available

        if args.far_host_mbps <= 0 or (args.far_host_flow_mbps is not None and args.far_host_flow_mbps <= 0):
            parser.error("--far-host-mbps and --far-host-flow-mbps must be > 0")
        try:
            check_available()
        except FarHostUnavailable as exc:
            parser.error(f"--far-host-mbps: {exc}")
    return args


def _interrupt(signum: int, _frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        size = parse_size(args.size or ("192MiB" if args.smoke else "2GiB"))
        shard = parse_size(args.shard_size or ("16MiB" if args.smoke else "64MiB"))
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    cfg = SuiteConfig(
        size=size, shard_bytes=shard, delay_ms=args.delay_ms, stream_mbps=args.stream_mbps,
        far_host_mbps=args.far_host_mbps, far_host_flow_mbps=args.far_host_flow_mbps, store=args.store, stock_moto=args.stock_moto,
        trainer_rate=args.trainer_rate,
        stall_cap_s=args.stall_seconds if args.stall_seconds is not None else (2.0 if args.smoke else 10.0),
        upload_checksum=args.upload_checksum, seed=args.seed, smoke=args.smoke, readers=tuple(args.readers.split(",")) if args.readers else None,
        workdir=args.workdir, keep=args.keep, results_dir=args.results_dir,
        command="python -m bench" + ("" if argv is None and len(sys.argv) == 1 else " " + shlex.join(sys.argv[1:] if argv is None else argv)),
        timeout_s=300.0 if args.smoke else 900.0,
    )
    if cfg.far_host_mbps:
        # A network namespace outlives a killed process: SIGTERM unwinds like Ctrl-C, so the far
        # host and the store in it are torn down.
        signal.signal(signal.SIGTERM, _interrupt)
    result = run_suite(cfg)
    paths = publish(result, cfg)
    print(paths["md"].read_text())
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    if not args.no_sim:
        from bench.cluster_sim import main as cluster_sim_main

        # The model of one cache per cluster (seconds): its JSON and plot next to the suite's.
        name = "cluster_sim-smoke.json" if args.smoke else "cluster_sim.json"
        cluster_sim_main(["--quick"] * args.smoke + ["--out", str(args.results_dir / name)])
    failed = [name for name, row in result["rows"].items() if "error" in row]
    if failed:
        print(f"readers that failed: {', '.join(failed)} (see the JSON for their errors)", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
