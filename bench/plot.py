"""The suite's markdown table and chart (throughput per reader, stall fraction per reader).

    python -m bench.plot bench/results/suite.json     # redraw suite.png and suite.md from a result
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

__all__ = ["markdown_table", "plot", "LABELS"]

LABELS = {
    "raw": "local disk, raw read (limit)",
    "boto3": "boto3 get_object",
    "boto3_transfer": "boto3 download_fileobj (TransferManager)",
    "s3fs": "s3fs",
    "webdataset": "webdataset + cache_dir",
    "streaming": "mosaicml-streaming (MDS)",
    "s3torchconnector": "s3torchconnector",
    "shardcache_s3api_boto3": "shardcache, boto3 via S3 API",
    "shardcache_loader": "shardcache ShardLoader (short-circuit)",
    "shardcache_loader_zero_copy": "shardcache ShardLoader (short-circuit, zero-copy)",
    "shardcache_loader_s3api": "shardcache ShardLoader (S3 API)",
    "shardcache_loader_4p": "shardcache ShardLoader x4 procs",
    "shardcache_master_4p": "shardcache ShardLoader x4, master",
    "half_cache_lru": "half-size cache, --eviction lru",
    "half_cache_hold": "half-size cache, --eviction hold",
}


def _fmt(value: Any, spec: str = ".0f", suffix: str = "") -> str:
    if value is None:
        return "–"
    return f"{value:{spec}}{suffix}"


def _pct(value: Any) -> str:
    return "–" if value is None else f"{value * 100:.1f}%"


def markdown_table(result: dict[str, Any], chart: str | None) -> str:
    rows = result["rows"]
    head = result["headline"]
    cfg = result["config"]
    ds = result["dataset"]
    machine = result["machine"]
    lines = [
        f"Command: `{result['command']}` — {machine['date']}, {machine['cpu_count']} CPUs ({machine['cpu_model']}), "
        f"{(machine['mem_total_bytes'] or 0) / 2**30:.0f} GiB RAM, git {machine.get('git_revision')}; "
        f"suite ran {result['elapsed_s'] / 60:.1f} min.",
        "",
        f"Dataset: {ds['shards']} WebDataset shards, {ds['bytes'] / 2**30:.2f} GiB, {ds['samples']} samples "
        f"(mean {ds['mean_sample_bytes'] / 1000:.0f} KB), "
        f"on {'an s3rver' if cfg.get('store') == 's3rver' else 'a moto'} S3 server"
        + ("" if cfg.get("store") == "s3rver" else " (stock: every GET copies the whole object)" if cfg.get("stock_moto", True)
           else " (a ranged GET costs the range, as on S3)")
        + " behind a proxy adding "
        f"{cfg['delay_ms']:g} ms per request" + (f" and {cfg['stream_mbps']:g} MB/s per connection" if cfg.get("stream_mbps") else "")
        + f"; shards uploaded with {_checksum_words(cfg.get('upload_checksum'))}"
        + f". Simulated trainer: {cfg['trainer_rate']:g} samples/s.",
        "",
        "**Headline ratios** (same run, same data):",
        "",
        "| target | measured | target | met |",
        "|---|---|---|---|",
    ]
    for name, check in head["targets"].items():
        value = check["value"]
        if "hit rate" in name or "stall" in name:
            shown, target = _pct(value), _pct(check["target"])
        elif "s/GB" in name:
            shown, target = _fmt(value, ".2f", " s/GB"), f"{check['target']:g} s/GB"
        else:
            shown, target = _fmt(value, ".2f", "×"), f"{check['target']:g}×"
        lines.append(f"| {name} | {shown} | {target} | {'yes' if check['met'] else '**no**'} |")
    lines += [
        "",
        f"shardcache row: {LABELS.get(head['shardcache_row'], head['shardcache_row'])}; fastest peer warm: "
        f"{LABELS.get(head['fastest_peer_warm'] or '', head['fastest_peer_warm'])}, cold: "
        f"{LABELS.get(head['fastest_peer_cold'] or '', head['fastest_peer_cold'])}.",
        "",
        "| reader | cold MB/s | warm MB/s | warm samples/s | first sample cold / warm (ms) | CPU s/GB cold / warm "
        "| cores busy cold / warm | peak RSS MB reader (+daemon) | stall cold / warm | epoch-2 byte hit rate |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, row in rows.items():
        label = LABELS.get(name, name)
        if "error" in row:
            lines.append(f"| {label} | failed: {row['error'][:80]} | | | | | | | | |")
            continue
        cold, warm = row.get("cold", {}), row.get("warm", {})
        incomplete = [phase for phase in ("cold", "warm") if phase in row and not row[phase].get("complete")]
        rss = _fmt(row.get("reader_peak_rss_mb"))
        if row.get("daemon_peak_rss_mb"):
            rss += f" (+{row['daemon_peak_rss_mb']:.0f})"
        stall_cold = (row.get("cold_paced") or {}).get("stall_fraction")
        stall_warm = (row.get("warm_paced") or {}).get("stall_fraction")
        hit = warm.get("byte_hit_rate") if name.startswith("half_cache") else None
        lines.append(
            f"| {label}{' (incomplete: ' + ', '.join(incomplete) + ')' if incomplete else ''} "
            f"| {_fmt(cold.get('mb_s'))} | {_fmt(warm.get('mb_s'))} | {_fmt(warm.get('samples_s'))} "
            f"| {_fmt(cold.get('ttfs_ms'))} / {_fmt(warm.get('ttfs_ms'))} "
            f"| {_fmt(cold.get('cpu_s_per_gb'), '.2f')} / {_fmt(warm.get('cpu_s_per_gb'), '.2f')} "
            f"| {_fmt(cold.get('machine_cores_busy'), '.2f')} / {_fmt(warm.get('machine_cores_busy'), '.2f')} | {rss} "
            f"| {_pct(stall_cold) if stall_cold is not None else '–'} / {_pct(stall_warm) if stall_warm is not None else '–'} "
            f"| {_pct(hit) if hit is not None else '–'} |")
    lines += [
        "",
        "MB/s: 10^6 bytes of tar shards per second, one epoch, wall clock. Cold: empty caches, data from the store "
        "through the proxy; warm: the second epoch (readers without a cache read the store again). CPU: reader "
        "processes plus the shardcache daemon, per 10^9 bytes (store and proxy excluded). Cores busy: every "
        f"process's CPU on the machine ({machine['cpu_count']} cores) over the epoch's wall time, store and proxy "
        "included; at the core count the epoch was bound by CPU. Raw: page cache dropped (cold), then warm.",
    ]
    if chart:
        lines += ["", f"![throughput and stall per reader]({chart})"]
    return "\n".join(lines) + "\n"


def plot(result: dict[str, Any], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = {n: r for n, r in result["rows"].items() if "error" not in r and not n.startswith("half_cache")}
    names = list(rows)
    labels = [LABELS.get(n, n) for n in names]
    cold = [rows[n].get("cold", {}).get("mb_s") or 0 for n in names]
    warm = [rows[n].get("warm", {}).get("mb_s") or 0 for n in names]
    stall_cold = [(rows[n].get("cold_paced") or {}).get("stall_fraction") for n in names]
    stall_warm = [(rows[n].get("warm_paced") or {}).get("stall_fraction") for n in names]

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(14, 0.45 * len(names) + 2.2), sharey=True,
                                   gridspec_kw={"width_ratios": [3, 2]})
    y = list(range(len(names)))
    h = 0.38
    ax1.barh([i - h / 2 for i in y], cold, height=h, label="cold (epoch 1)", color="#8da0cb")
    ax1.barh([i + h / 2 for i in y], warm, height=h, label="warm (epoch 2)", color="#fc8d62")
    raw_warm = rows.get("raw", {}).get("warm", {}).get("mb_s")
    if raw_warm:
        ax1.axvline(raw_warm, color="grey", linestyle="--", linewidth=1, label="raw local read, warm")
    ax1.set_yticks(y, labels)
    ax1.invert_yaxis()
    ax1.set_xlabel("MB/s (10^6 B/s of shards)")
    ax1.set_title("Throughput per reader")
    ax1.legend(loc="lower right", fontsize=8)
    ax1.grid(axis="x", alpha=0.3)

    ax2.barh([i - h / 2 for i in y], [100 * (v or 0) for v in stall_cold], height=h, label="cold", color="#8da0cb")
    ax2.barh([i + h / 2 for i in y], [100 * (v or 0) for v in stall_warm], height=h, label="warm", color="#fc8d62")
    for i, (c, w) in enumerate(zip(stall_cold, stall_warm, strict=True)):
        if c is None and w is None:
            ax2.text(0.5, i, "not measured", va="center", fontsize=7, color="grey")
    ax2.axvline(2, color="grey", linestyle=":", linewidth=1, label="2% target")
    ax2.set_xlabel(f"% of time the trainer waits ({result['config']['trainer_rate']:g} samples/s)")
    ax2.set_title("Data-stall fraction")
    ax2.set_xlim(0, 100)
    ax2.legend(loc="lower right", fontsize=8)
    ax2.grid(axis="x", alpha=0.3)
    cfg = result["config"]
    where = (result.get("setup") or {}).get("description") or f"S3 (moto) + {cfg['delay_ms']:g} ms/request"
    fig.suptitle(f"{result['dataset']['bytes'] / 2**30:.1f} GiB WebDataset, {where}, "
                 f"{result['machine']['cpu_count']} CPUs", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    import json

    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m bench.plot bench/results/suite.json", file=sys.stderr)
        return 2
    source = Path(args[0])
    result = json.loads(source.read_text())
    png = source.with_suffix(".png")
    plot(result, png)
    source.with_suffix(".md").write_text(markdown_table(result, png.name))
    print(f"wrote {png} and {source.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


def _checksum_words(algorithm: str | None) -> str:
    """How the shards were uploaded, which decides what a fill is verified against."""
    if algorithm in (None, "none"):  # None: results from before the option, uploaded without one
        return "no additional checksum (fills verified against the ETag's MD5)"
    return f"a {algorithm.upper()} checksum, as S3 stores for every new object (fills verified against it)"
