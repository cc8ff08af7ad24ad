"""``shardcache status``: what the daemons and masters are doing, as a table or ``--json``."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from sidecar.cli.control import ControlClient, DaemonClientError
from sidecar.cli.daemons import add_daemon_flag, daemon_addresses
from sidecar.cli.progress import format_bytes, format_rate
from sidecar.cli.util import (
    EXIT_FAILED,
    EXIT_OK,
    EXIT_UNAVAILABLE,
    RawDefaultsFormatter,
    UserError,
    add_flag,
)

__all__ = [
    "CACHE_NODE_ROWS", "MEMBER_TIMEOUT_S", "cache_line", "cache_node_lines", "cache_nodes_worst_first", "cache_warnings",
    "checkpoint_line", "cluster_lines", "cluster_nodes", "daemon_report", "locality_line", "master_report", "node_rows",
    "register", "run",
    "tenant_lines", "trainer_rows", "wait_warnings",
]

EXAMPLES = """\
examples:
  # the local node daemon (SHARDCACHE_ENDPOINT, default http://127.0.0.1:8600)
  shardcache status

  # every node daemon behind a headless Service, and the master
  shardcache status --daemon shardcache-node.shardcache.svc:8600 --master http://shardcache-master:8700

  # one job on a highly available master set, as JSON
  shardcache status --master http://m1:8700,http://m2:8700 --job resnet50 --json

Columns: cache use, hit rate (hits / lookups since start), origin and served throughput (measured
over --interval), warm-ups; for masters each job's epoch, shard progress, trainers and failed shards,
and each trainer's wait for data: the share of the last 60 s its training loop spent waiting for
its next sample or batch (WAIT 60S), and the median and 99th percentile of single waits. A job whose
trainers waited more than --warn-wait of the last 60 s gets a WARNING line.

A job's cache line sums what the node daemons started with --master report to the master about it:
its hit rate (bytes served from the node's cache), the bytes read from the object store (origin)
and from other nodes (peer), what was prefetched, and how many nodes report. With --job, a table
of those nodes, the ones whose trainers waited most (then the lowest hit rate) first: their
trainers, hit rate, bytes, shards held of those planned for them, how many shards prefetch is
ahead of the leases (LEAD), the trainers' wait and the report's age. A job whose trainers wait
(--warn-wait) while its hit rate is under --warn-hit-rate gets a WARNING line too.

A daemon in a cluster (serve --peer/--peers-dns) adds a table of every member of its ring, each
asked for its own figures: what that node's clients read from its own cache (LOCAL), from other
members (PEER) and from the object store (ORIGIN) since it started, LOCAL HIT (the local share of
those bytes) and what it served to other members (TO PEERS). A member the ring has down is "dead";
one that does not answer within 5 s is "unreachable" (neither changes the exit status).
exit status: 0 everything answered; 1 --job not found; 69 a daemon or master could not be reached.
"""


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "status",
        help="cache use, hit rate, throughput, warm-ups, jobs and their epoch progress",
        description="Show node daemons (cache use, hit rate, origin throughput, warm-ups) and masters "
        "(jobs, epoch progress, trainers, failed shards).",
        epilog=EXAMPLES,
        formatter_class=RawDefaultsFormatter,
    )
    add_daemon_flag(parser)
    add_flag(parser, "--master", action="append", default=None, metavar="URL",
             help="master URL(s); comma-separated or repeated for an HA set (default SHARDCACHE_MASTER)")
    add_flag(parser, "--job", default=None, metavar="NAME", help="show only this job (with all its failed shards)")
    add_flag(parser, "--interval", default="1", metavar="SECONDS",
             help="measure throughput over this long (0: averages since each daemon started)")
    add_flag(parser, "--warn-wait", default="10", metavar="PERCENT",
             help="warn about a job whose trainers waited more than this share of the last 60 s for data")
    add_flag(parser, "--warn-hit-rate", default="50", metavar="PERCENT",
             help="warn about a job whose trainers wait (--warn-wait) while its cache hit rate is under this")
    add_flag(parser, "--json", action="store_true", default=False, help="print one JSON document")
    parser.set_defaults(func=run)


# -- gathering ------------------------------------------------------------------------------------


def _served(stats: dict[str, Any]) -> float:
    return float(sum((stats.get("served_bytes") or {}).values()))


def _peer_in(stats: dict[str, Any]) -> float:
    return float(stats.get("peer_read_bytes") or 0)


def _peer_out(stats: dict[str, Any]) -> float:
    return float((stats.get("served_bytes") or {}).get("peer") or 0)


def daemon_report(url: str, label: str, interval: float) -> dict[str, Any]:
    """Stats of one daemon, with throughput measured over ``interval`` seconds."""
    report: dict[str, Any] = {"daemon": label, "url": url, "error": None, "unreachable": False}
    with ControlClient(url, timeout=10.0) as client:
        try:
            first = client.stats()
            began = time.monotonic()
            if interval > 0:
                time.sleep(interval)
                stats = client.stats()
                elapsed = time.monotonic() - began
                origin_rate = (stats["origin_read_bytes"] - first["origin_read_bytes"]) / elapsed
                served_rate = (_served(stats) - _served(first)) / elapsed
                peer_in_rate = (_peer_in(stats) - _peer_in(first)) / elapsed
                peer_out_rate = (_peer_out(stats) - _peer_out(first)) / elapsed
            else:
                stats = first
                uptime = max(float(stats.get("uptime_s") or 0), 1e-9)
                origin_rate = stats["origin_read_bytes"] / uptime
                served_rate = _served(stats) / uptime
                peer_in_rate, peer_out_rate = _peer_in(stats) / uptime, _peer_out(stats) / uptime
            report.update(stats=stats, origin_bytes_per_s=round(origin_rate, 1), served_bytes_per_s=round(served_rate, 1))
            if isinstance(stats.get("cluster"), dict):
                report.update(peer_in_bytes_per_s=round(peer_in_rate, 1), peer_out_bytes_per_s=round(peer_out_rate, 1))
                try:
                    view = client.peers()
                    report["peers"] = None if view is None else dataclasses.asdict(view)
                except DaemonClientError:
                    report["peers"] = None  # the cluster block of /stats is still shown
            try:
                report["warmups"] = client.warmups()
            except DaemonClientError:
                report["warmups"] = None  # a daemon built without the warm-up API
        except DaemonClientError as exc:
            report["error"] = str(exc)
            report["unreachable"] = not hasattr(exc, "status")
    return report


MEMBER_TIMEOUT_S = 5.0
"""How long one ring member may take to connect and answer its ``/stats`` (all asked at once)."""


def _self_ids(report: dict[str, Any]) -> set[str]:
    """The member ids an answering daemon goes by: its ring's ``self``, and its stats' own."""
    ids: set[str] = set()
    view, cluster = report.get("peers"), (report.get("stats") or {}).get("cluster")
    if isinstance(view, dict) and view.get("self_id"):
        ids.add(str(view["self_id"]))
    if isinstance(cluster, dict) and cluster.get("self"):
        ids.add(str(cluster["self"]))
    return ids


def _node_figures(stats: dict[str, Any]) -> dict[str, Any]:
    """One member's row figures from its ``/stats`` (``None`` where a daemon older than the per-node
    figures has none)."""
    reads = stats.get("node_reads")
    return {
        "node_reads": reads if isinstance(reads, dict) else None,
        "served_to_peers_bytes": _peer_out(stats),
        "peer_read_bytes": _peer_in(stats),
        "origin_read_bytes": float(stats.get("origin_read_bytes") or 0),
    }


def _member_stats(url: str, timeout: float) -> tuple[dict[str, Any] | None, str | None, bool]:
    """(stats, error, unreachable) of one ring member, asked once."""
    try:
        with ControlClient(url, timeout=timeout) as client:
            return client.stats(), None, False
    except DaemonClientError as exc:
        return None, str(exc), not hasattr(exc, "status")
    except ValueError as exc:  # a member URL this client cannot address (another scheme)
        return None, f"cannot ask {url}: {exc}", True


def cluster_nodes(reports: list[dict[str, Any]], timeout: float = MEMBER_TIMEOUT_S) -> list[dict[str, Any]] | None:
    """Every member of the rings the answering daemons see, with its own figures: one row per
    member (by member id), the stats of daemons asked already reused, every other live member
    asked once, all at once, each within ``timeout``. ``None`` when no daemon is in a cluster, so
    a standalone daemon's output stays as it was."""
    members: dict[str, dict[str, Any]] = {}
    known: dict[str, dict[str, Any]] = {}  # member id -> the stats fetched already
    for report in reports:
        if report.get("error"):
            continue
        for ident in _self_ids(report):
            known[ident] = report["stats"]
        view = report.get("peers")
        for m in view.get("members") or () if isinstance(view, dict) else ():
            row = members.setdefault(str(m["id"]), {
                "member": str(m["id"]), "url": str(m["url"]), "node": m.get("node"), "live": False,
            })
            # Views may differ for a few seconds after a member comes or goes: live if any says so.
            row["live"] = bool(row["live"] or m.get("live"))
            row["node"] = row["node"] or m.get("node")
    if not members:
        return None
    asked = [row for ident, row in members.items() if row["live"] and ident not in known]
    answers: dict[str, tuple[dict[str, Any] | None, str | None, bool]] = {}
    if asked:
        with ThreadPoolExecutor(max_workers=min(len(asked), 32)) as pool:
            futures = {row["member"]: pool.submit(_member_stats, row["url"], timeout) for row in asked}
            answers = {ident: future.result() for ident, future in futures.items()}
    rows = []
    for ident, row in members.items():
        stats, error, unreachable = (known[ident], None, False) if ident in known else answers.get(ident, (None, None, False))
        if stats is not None:
            state = "live"
            row.update(_node_figures(stats))
            row["node"] = row["node"] or stats.get("node")
        else:
            state = "dead" if not row["live"] else ("unreachable" if unreachable else "error")
            row.update(node_reads=None, served_to_peers_bytes=None, peer_read_bytes=None, origin_read_bytes=None)
        row.update(state=state, error=error)
        rows.append(row)
    return sorted(rows, key=lambda r: (str(r["node"] or "~"), r["member"]))


def master_report(urls: list[str], job: str | None) -> dict[str, Any]:
    """Each master's role, and the jobs as the leader (or any answering master) reports them.

    Each master is asked on its own, once (``retry_deadline_s=0``): status reports what answers
    now, where a trainer's client would keep retrying and following the leader."""
    # Here and in _master_urls, not at the top: importing the loader package takes ~150 ms,
    # which `shardcache --help` and a status of daemons alone need not pay.
    from loader.master import MasterClient, MasterError, MasterUnavailable, NoSuchJob

    masters: list[dict[str, Any]] = []
    source: str | None = None
    for url in urls:
        entry: dict[str, Any] = {"master": url, "role": None, "leader": None, "error": None}
        with MasterClient(url, timeout_s=10.0, retry_deadline_s=0) as client:
            try:
                leader = client.leader()
                entry["role"], entry["leader"] = leader.get("role"), leader.get("leader")
                if entry["role"] == "leader" or (source is None and entry["role"] not in ("standby",)):
                    source = url
            except MasterUnavailable as exc:
                entry["error"] = _reason(exc)
                entry["unreachable"] = True
            except MasterError as exc:
                entry["error"] = str(exc)
        masters.append(entry)
    jobs: list[dict[str, Any]] = []
    missing_job = False
    error = None
    if source is None:
        leaders = [m["leader"] for m in masters if m.get("leader")]
        source = leaders[0] if leaders else None
    if source is not None:
        with MasterClient(source, timeout_s=10.0, retry_deadline_s=0) as client:
            try:
                jobs = [client.status(job)] if job else client.jobs()
            except NoSuchJob as exc:
                missing_job = True
                error = str(exc)
            except MasterUnavailable as exc:
                error = _reason(exc)
            except MasterError as exc:
                error = str(exc)
    elif urls:
        error = "no master answered"
    return {"masters": masters, "jobs": jobs, "jobs_from": source, "error": error, "missing_job": missing_job}


def _reason(exc: BaseException) -> str:
    """The root cause of an unreachable master, as the daemon table words it ("connection refused")."""
    cause = exc.__cause__ or exc
    message = getattr(cause, "message", None) or str(cause)
    return str(message)


def _master_urls(given: list[str] | None) -> list[str]:
    from loader.master.client import split_master_urls
    from loader.master.errors import BadRequest

    values = [value for value in (given or []) if value.strip(",").strip()]
    try:
        return split_master_urls(values) if values else []
    except BadRequest as exc:
        raise UserError(exc.message) from None


def _warn_percent(raw: str, flag: str = "--warn-wait", example: str = "10") -> float:
    """A ``--warn-*`` threshold as a fraction: a percentage, with or without its ``%``."""
    try:
        percent = float(str(raw).strip().removesuffix("%"))
    except ValueError:
        raise UserError(f"{flag} must be a percentage such as {example} or {example}%, not {raw!r}") from None
    if not 0 <= percent <= 100:
        raise UserError(f"{flag} must be between 0 and 100 (percent), not {raw!r}")
    return percent / 100


def run(args: argparse.Namespace) -> int:
    try:
        interval = float(args.interval)
    except ValueError:
        raise UserError(f"--interval must be a number of seconds, not {args.interval!r}") from None
    if not 0 <= interval <= 60:
        raise UserError("--interval must be between 0 and 60 seconds")
    warn_wait = _warn_percent(args.warn_wait)
    warn_hit = _warn_percent(args.warn_hit_rate, "--warn-hit-rate", "50")
    masters = _master_urls(args.master)
    # `--master URL` alone asks about masters only; daemons are shown when named or configured.
    show_daemons = bool(args.daemon) or not masters or bool(os.environ.get("SHARDCACHE_ENDPOINT", "").strip())
    daemons = daemon_addresses(args.daemon) if show_daemons else []
    with ThreadPoolExecutor(max_workers=min(max(len(daemons), 1), 32)) as pool:
        # In parallel: each daemon's throughput sample takes --interval.
        reports = list(pool.map(lambda d: daemon_report(d.url, d.label, interval), daemons))
    nodes = cluster_nodes(reports)
    master = master_report(masters, args.job) if masters else None
    if master is not None:
        master["wait_warnings"] = wait_warnings(master["jobs"], warn_wait)
        master["cache_warnings"] = cache_warnings(master["jobs"], warn_wait, warn_hit)
    if args.json:
        doc: dict[str, Any] = {"daemons": reports, "master": master}
        if nodes is not None:
            doc["cluster_nodes"] = nodes
        print(json.dumps(doc, indent=2))
    else:
        _print_daemons(reports)
        if nodes is not None:
            _print_nodes(nodes)
        if master is not None:
            _print_master(master, all_trainers=bool(args.job))
    if master is not None and master["missing_job"]:
        if not args.json:
            print(f"shardcache status: no job {args.job!r} on the master (see `shardcache status --master ...`)")
        return EXIT_FAILED
    unreachable = [r for r in reports if r["error"]]
    if master is not None:
        unreachable += [m for m in master["masters"] if m["error"]]
        if master["error"]:
            unreachable.append(master)
    return EXIT_UNAVAILABLE if unreachable else EXIT_OK


# -- printing -------------------------------------------------------------------------------------


def _table_lines(rows: list[list[str]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.ljust(widths[i]) for i, cell in enumerate(row)).rstrip() for row in rows]


def _table(rows: list[list[str]]) -> None:
    for line in _table_lines(rows):
        print(line)


def _print_daemons(reports: list[dict[str, Any]]) -> None:
    if not reports:
        return
    rows = [["DAEMON", "MODE", "CACHE USED", "ITEMS", "HIT RATE", "ORIGIN", "SERVED", "FILLS", "WARM-UPS"]]
    warmups: list[list[str]] = []
    for report in reports:
        if report["error"]:
            rows.append([report["daemon"], "-", "-", "-", "-", "-", "-", "-", "unreachable" if report["unreachable"] else "error"])
            continue
        stats = report["stats"]
        cache = stats.get("cache") or {}
        used, capacity = int(cache.get("used_bytes", 0)), int(cache.get("capacity_bytes", 0))
        percent = f" ({used / capacity * 100:.0f}%)" if capacity else ""
        ratio = (stats.get("requests") or {}).get("hit_ratio")
        running = [w for w in (report.get("warmups") or []) if w["state"] == "running"]
        rows.append([
            report["daemon"], str(stats.get("mode", "?")),
            f"{format_bytes(used)} / {format_bytes(capacity)}{percent}" if cache else "no cache",
            str(cache.get("items", "-")),
            f"{ratio * 100:.1f}%" if ratio is not None else "-",
            format_rate(report["origin_bytes_per_s"]), format_rate(report["served_bytes_per_s"]),
            str(stats.get("fills_in_flight", 0)),
            f"{len(running)} running" if running else str(len(report.get("warmups") or [])),
        ])
        for w in report.get("warmups") or []:
            files, size = w["files"], w["bytes"]
            warmups.append([
                w["id"], report["daemon"], w["state"], f"{files['done']}/{files['total']}",
                f"{format_bytes(size['done'])} / {format_bytes(size['total'])}", str(files["failed"]),
                format_rate(w.get("rate_bytes_per_s")) if w["state"] == "running" else "-",
            ])
    _table(rows)
    for report in reports:
        if report["error"]:
            print(f"{report['daemon']}: {report['error']}")
    for report in reports:
        if not report["error"]:
            for line in tenant_lines(report["stats"]):
                print(f"{report['daemon']}: {line}")
            for line in cluster_lines(report):
                print(f"{report['daemon']}: {line}")
    if warmups:
        print()
        _table([["WARM-UP", "DAEMON", "STATE", "FILES", "BYTES", "FAILED", "RATE"], *warmups])


def node_rows(nodes: list[dict[str, Any]]) -> list[list[str]]:
    """The rows of the per-node table (header first): each member's clients' bytes by where they
    came from, its local share and what it served to other members."""
    rows = [["NODE", "MEMBER", "LIVE", "LOCAL", "PEER", "ORIGIN", "LOCAL HIT", "TO PEERS"]]
    for row in nodes:
        state = {"live": "yes"}.get(row["state"], row["state"])
        reads = row.get("node_reads") or {}
        figures = reads.get("bytes")
        if isinstance(figures, dict):
            sources = [format_bytes(float(figures.get(s) or 0)) for s in ("local", "peer", "origin")]
            share = _percent(reads.get("local_hit_ratio"), 1)
        else:  # down, or a daemon older than the per-node figures
            sources, share = ["-", "-", "-"], "-"
        served = row.get("served_to_peers_bytes")
        rows.append([
            _printable(row.get("node") or "-"), _printable(row["member"]), state, *sources, share,
            format_bytes(served) if isinstance(served, (int, float)) else "-",
        ])
    return rows


def _print_nodes(nodes: list[dict[str, Any]]) -> None:
    print()
    _table(node_rows(nodes))
    answered = [n for n in nodes if isinstance((n.get("node_reads") or {}).get("bytes"), dict)]
    if len(answered) > 1:
        totals = {s: sum(float(n["node_reads"]["bytes"].get(s) or 0) for n in answered) for s in ("local", "peer", "origin")}
        total = sum(totals.values())
        shares = ", ".join(
            f"{source} {format_bytes(value)}" + (f" ({value / total * 100:.1f}%)" if total else "")
            for source, value in totals.items()
        )
        # A fill an owner made for a peer is no client's origin read: the egress is its own figure.
        egress = sum(float(n.get("origin_read_bytes") or 0) for n in answered)
        print(f"cluster: clients of {len(answered)} nodes read {format_bytes(total)}: {shares}; "
              f"these nodes read {format_bytes(egress)} from the origin in all")
    for n in nodes:
        if n.get("error"):
            print(_printable(f"{n['member']}: {n['error']}"))  # the member's URL comes from a daemon


def _count(value: Any) -> int | None:
    """A count in the stats' cluster block, which may give a number or the list itself."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, list):
        return len(value)
    return None


def cluster_lines(report: dict[str, Any]) -> list[str]:
    """One daemon's cluster: its identity, the members it sees (live/dead, node names), whether
    peer links are authenticated, and the bytes it read from and served to peers. Nothing for a
    daemon without peers' stats, so a standalone daemon's output stays as it was."""
    stats = report["stats"]
    block = stats.get("cluster")
    if not isinstance(block, dict):
        return []
    view = report.get("peers")
    members = view["members"] if isinstance(view, dict) else None
    total = len(members) if members is not None else _count(block.get("members"))
    live = sum(1 for m in members if m["live"]) if members is not None else _count(block.get("live"))
    links = str(block.get("peer_links") or (view or {}).get("peer_links") or "?")
    node = block.get("node") or (view or {}).get("node")
    ident = block.get("self") or (view or {}).get("self_id") or "?"
    head = f"cluster: member {ident}" + (f" on node {node}" if node else "")
    if total is not None:
        dead = f", {total - live} dead" if live is not None else ""
        head += f", {total} members ({live if live is not None else '?'} live{dead})"
    head += f", peer links {links}"
    if links == "open":
        head += " (no --peer-secret-file: any pod can read through the peer path)"
    lines = [head]
    for m in members or []:
        state = "live" if m["live"] else "DEAD"
        who = f" node {m['node']}" if m.get("node") else ""
        lines.append(f"  {state:<4} {m['url']}{who}{' (this daemon)' if m.get('self') else ''}")
    lines.append(
        f"peer bytes: in {format_bytes(_peer_in(stats))} ({format_rate(report.get('peer_in_bytes_per_s'))}), "
        f"out {format_bytes(_peer_out(stats))} ({format_rate(report.get('peer_out_bytes_per_s'))})"
    )
    return lines


def tenant_lines(stats: dict[str, Any]) -> list[str]:
    """The per-tenant quota of one daemon: its totals (``cache.tenants``, no names: every tenant
    reads them), and the caller's own use when the daemon knows who asks (top-level ``tenant``).
    Nothing for a daemon with no quota and no tenants, so output without auth stays as it was."""
    lines: list[str] = []
    block = (stats.get("cache") or {}).get("tenants")
    if isinstance(block, dict) and (block.get("quota_bytes") or block.get("count")):
        quota = block.get("quota_bytes")
        line = f"tenants: {int(block.get('count') or 0)} with entries, "
        if quota:
            line += (
                f"quota {format_bytes(quota)} each, {int(block.get('over_quota') or 0)} over it; "
                f"quota evictions {int(block.get('quota_evictions') or 0)} "
                f"({format_bytes(block.get('quota_evicted_bytes') or 0)}), "
                f"not cached for quota {int(block.get('rejected_quota') or 0)}"
            )
        else:
            line += "no quota"
        lines.append(line)
    own = stats.get("tenant")
    if isinstance(own, dict) and own.get("tenant"):
        # The name comes from the daemon: printed with anything unprintable replaced.
        name = "".join(c if c.isprintable() else "?" for c in str(own["tenant"]))
        used, reserved = int(own.get("used_bytes") or 0), int(own.get("reserved_bytes") or 0)
        filling = f" (+{format_bytes(reserved)} filling)" if reserved else ""
        quota = own.get("quota_bytes")
        of = f" of {format_bytes(quota)} quota" if quota else ", no quota"
        lines.append(f"tenant {name}: {format_bytes(used)}{filling}{of}, {int(own.get('items') or 0)} items")
    return lines


def _epoch(job: dict[str, Any]) -> str:
    """Epochs as people count them: the first is 1/N; a finished job shows N/N."""
    epochs = job.get("epochs")
    total = str(epochs) if epochs is not None else "∞"
    epoch = int(job.get("epoch") or 0)
    if job.get("finished"):
        return f"{epoch}/{total}"
    # A continuous job may have several epochs open at once (the next opens while the last
    # shards of the current one are still being read): "3-4/10".
    opened = [int(e.get("epoch") or 0) for e in job.get("open_epochs") or [] if isinstance(e, dict)]
    newest = max(opened, default=epoch)
    return f"{epoch + 1}-{newest + 1}/{total}" if newest > epoch else f"{epoch + 1}/{total}"


def _percent(fraction: Any, digits: int = 0) -> str:
    return "-" if not isinstance(fraction, (int, float)) or isinstance(fraction, bool) else f"{fraction * 100:.{digits}f}%"


def _seconds(value: Any) -> str:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return "-"
    return f"{value * 1000:.0f}ms" if value < 1 else f"{value:g}s"


def _printable(value: Any) -> str:
    # Names come from trainers, through the master: shown with anything unprintable replaced.
    return "".join(c if c.isprintable() else "?" for c in str(value))


def _trainer_wait(trainer: dict[str, Any]) -> dict[str, Any]:
    wait = trainer.get("wait")
    return wait if isinstance(wait, dict) else {}


def _by_wait(job: dict[str, Any]) -> list[dict[str, Any]]:
    """The job's trainers, those that waited most first (never-reported ones last)."""
    trainers = [t for t in job.get("trainers") or [] if isinstance(t, dict)]

    def share(t: dict[str, Any]) -> float:
        value = _trainer_wait(t).get("fraction_60s")
        return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else -1.0

    return sorted(trainers, key=lambda t: -share(t))


_TRAINER_ROWS = 20  # per job, unless --job asks for one job


def trainer_rows(job: dict[str, Any], limit: int | None = _TRAINER_ROWS) -> list[list[str]]:
    """One row per trainer of ``job``: its node, leases and wait for data (share of the last 60 s,
    total seconds, median and p99 of single waits); the ones that waited most first."""
    rows = []
    for t in _by_wait(job)[:limit]:
        wait = _trainer_wait(t)
        rows.append([
            _printable(job.get("name")), _printable(t.get("trainer")), _printable(t.get("node") or "-"),
            str(t.get("leases", 0)), _percent(wait.get("fraction_60s")),
            f"{wait['seconds']:.1f}s" if isinstance(wait.get("seconds"), (int, float)) else "-",
            _seconds(wait.get("p50_s")), _seconds(wait.get("p99_s")),
        ])
    return rows


def _named(items: list[str], limit: int = 8) -> str:
    """The first ``limit`` of a warning's names, and how many more there are."""
    named = ", ".join(items[:limit])
    return named + (f", +{len(items) - limit} more" if len(items) > limit else "")


def wait_warnings(jobs: list[dict[str, Any]], threshold: float) -> list[str]:
    """A WARNING line for each job whose trainers waited more than ``threshold`` (a fraction) of
    the last 60 s for data, naming the trainers that waited most and what to do about it."""
    lines = []
    for job in jobs:
        share = (job.get("wait") or {}).get("fraction_60s")
        if not isinstance(share, (int, float)) or isinstance(share, bool) or share <= threshold:
            continue
        reported = [t for t in _by_wait(job) if _trainer_wait(t).get("fraction_60s") is not None]
        named = _named([f"{_printable(t.get('trainer'))} {_percent(_trainer_wait(t)['fraction_60s'])}" for t in reported])
        lines.append(
            f"WARNING job {_printable(job.get('name'))}: trainers waited {_percent(share)} of the last 60 s for data "
            f"({named}): reading does not keep up with training. Warm the cache before the epoch "
            "(shardcache warmup), give the DataLoader more workers (num_workers) or a deeper prefetch, and check "
            "the daemons' hit rate and origin throughput above"
        )
    return lines


def checkpoint_line(job: dict[str, Any]) -> str | None:
    """A job that was checkpointed: its last mark (the clock, when, how many trainers reported),
    how many are kept, and the rewinds (resumes from a checkpoint) applied."""
    ck = job.get("checkpoints")
    if not isinstance(ck, dict) or not (ck.get("marks") or ck.get("rewinds")):
        return None
    last = ck.get("last") if isinstance(ck.get("last"), dict) else None
    text = f"{_printable(job.get('name'))}: checkpoints: {ck.get('marks', 0)} kept"
    if last is not None:
        text += (f", last mark {last.get('mark')} at clock {last.get('clock')} (epoch {last.get('epoch')}, "
                 f"{last.get('trainers')} trainer(s) reported)")
    return text + f", {ck.get('rewinds', 0)} rewind(s)"


def locality_line(job: dict[str, Any]) -> str | None:
    """A job with cache-aware leases (``locality_window``): its share of local leases, how far its
    order moved from the seeded one (the newest epoch), and the ring the master places by."""
    loc = job.get("locality")
    if not isinstance(loc, dict):
        return None
    leases = loc.get("leases") or {}
    ring = loc.get("ring") or {}
    newest = (loc.get("epochs") or [None])[-1]
    text = (f"{_printable(job.get('name'))}: local leases {_percent(loc.get('local_share'), 1)} "
            f"(owner {leases.get('owner', 0)}, cached {leases.get('cached', 0)}, other {leases.get('other', 0)}, "
            f"unplaced {leases.get('unplaced', 0)}), window {loc.get('window')}")
    if isinstance(newest, dict) and newest.get("mean_displacement") is not None:
        text += (f", epoch {newest.get('epoch')} order moved {newest['mean_displacement']:.1f} positions on average "
                 f"(max {newest.get('max_displacement')}, Spearman {newest.get('spearman')})")
    text += f"; ring of {ring.get('members', 0)} members on {ring.get('nodes', 0)} nodes"
    source = ring.get("source")
    if isinstance(source, dict) and source.get("error"):
        text += f" (ring source: {_printable(source['error'])[:200]})"
    elif source is None and not ring.get("members"):
        text += " (no --cluster on the master: only the 'cached' preference applies)"
    return text


# -- the per-job cache view (the ``cache`` section node daemons' reports feed on the master) -------

CACHE_NODE_ROWS = 50
"""Nodes shown in the ``--job`` table; ``--json`` has them all."""


def _number(value: Any) -> float | None:
    """A JSON number as a float; ``None`` for null, a missing field, a boolean, NaN or infinity
    (Python's JSON reader takes those) or anything else."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def _bytes(value: Any) -> str:
    number = _number(value)
    return "-" if number is None else format_bytes(number)


def _whole(value: Any) -> str:
    number = _number(value)
    return "-" if number is None else str(int(number))


def _age(value: Any) -> str:
    """A report's age: seconds under a minute, then minutes, then hours (a stale node stands out)."""
    seconds = _number(value)
    if seconds is None:
        return "-"
    if seconds < 60:
        return f"{seconds:.1f}s"
    if seconds < 3600:
        return f"{int(seconds // 60)}m{int(seconds % 60):02d}s"
    return f"{seconds / 3600:.1f}h"


def _cache(job: dict[str, Any]) -> dict[str, Any] | None:
    """The job's ``cache`` section; ``None`` from a master older than it (the output stays as it was)."""
    cache = job.get("cache")
    return cache if isinstance(cache, dict) else None


def _cache_nodes(cache: dict[str, Any]) -> list[dict[str, Any]]:
    nodes = cache.get("nodes")
    return [n for n in nodes if isinstance(n, dict)] if isinstance(nodes, list) else []


def _cache_totals(cache: dict[str, Any]) -> dict[str, Any]:
    totals = cache.get("totals")
    return totals if isinstance(totals, dict) else {}


def cache_nodes_worst_first(nodes: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Nodes whose trainers waited most first, then the lowest hit rate (unknown ones after the
    known ones in both), then by name: the nodes to look at come first, as the status page orders them."""

    def key(node: dict[str, Any]) -> tuple[bool, float, bool, float, str]:
        wait, hit = _number(node.get("wait_fraction")), _number(node.get("hit_rate"))
        return (wait is None, -(wait or 0.0), hit is None, hit or 0.0, str(node.get("node")))

    return sorted(nodes, key=key)


def cache_line(job: dict[str, Any]) -> str | None:
    """One line of the job's cache figures (summed over the nodes that report); ``None`` when the
    master has no ``cache`` section."""
    cache = _cache(job)
    if cache is None:
        return None
    name = _printable(job.get("name"))
    reporting = _number(cache.get("reporting_nodes"))
    if not reporting and not _cache_nodes(cache):
        return (f"{name}: cache: no node reports yet (node daemons started with --master report what their "
                "trainers read every few seconds)")
    totals = _cache_totals(cache)
    return (f"{name}: cache hit rate {_percent(totals.get('hit_rate'), 1)}, origin {_bytes(totals.get('origin_bytes'))}, "
            f"peer {_bytes(totals.get('peer_bytes'))}, prefetched {_bytes(totals.get('prefetch_bytes'))}, "
            f"{_whole(totals.get('reads'))} reads; {_whole(reporting)} node(s) reporting")


CACHE_NODE_HEADER = ["NODE", "TRAINERS", "HIT RATE", "ORIGIN", "PEER", "PREFETCHED", "HELD/PLANNED", "LEAD", "WAIT",
                     "REPORT AGE"]


def _lead(node: dict[str, Any]) -> str:
    """The prefetch lead, marked ``through`` while the node's plans fetch through the shards it
    kept (its trainers waited on the origin: the master-api's "fetching through")."""
    lead = _whole(node.get("prefetch_lead_shards"))
    return f"{lead} through" if node.get("fetching_through") is True else lead


def _cache_node_row(node: dict[str, Any]) -> list[str]:
    return [
        _printable(node.get("node") or "-"), _whole(node.get("trainers")), _percent(node.get("hit_rate"), 1),
        _bytes(node.get("origin_bytes")), _bytes(node.get("peer_bytes")), _bytes(node.get("prefetch_bytes")),
        f"{_whole(node.get('held_shards'))}/{_whole(node.get('planned_shards'))}", _lead(node),
        _percent(node.get("wait_fraction"), 1), _age(node.get("report_age_s")),
    ]


def cache_node_lines(job: dict[str, Any], limit: int = CACHE_NODE_ROWS) -> list[str]:
    """The ``--job`` table of the nodes reporting on the job, worst first, at most ``limit`` rows
    and a line counting the rest; nothing without a ``cache`` section or a node in it."""
    cache = _cache(job)
    if cache is None:
        return []
    nodes = cache_nodes_worst_first(_cache_nodes(cache))
    if not nodes:
        return []
    lines = _table_lines([CACHE_NODE_HEADER, *(_cache_node_row(n) for n in nodes[:limit])])
    more = _more_nodes(_printable(job.get("name")), max(0, len(nodes) - limit), int(_number(cache.get("nodes_omitted")) or 0))
    return lines + ([more] if more else [])


def _more_nodes(name: str, hidden: int, omitted: int) -> str | None:
    """The line counting the nodes not in the table: ``hidden`` past its rows (in ``--json``), and
    ``omitted`` ones the master itself does not list (it caps ``cache.nodes``; their figures are
    in the totals all the same)."""
    if not hidden and not omitted:
        return None
    if not omitted:
        return f"... and {hidden} more nodes (shardcache status --job {name} --json lists them all)"
    where = f"{hidden} in shardcache status --job {name} --json, " if hidden else ""
    return f"... and {hidden + omitted} more nodes ({where}{omitted} not listed by the master, counted in the totals)"


def _cache_advice(cache: dict[str, Any], slow: list[dict[str, Any]]) -> str:
    """What to do about a job's low hit rate, from what its nodes report."""
    behind = [n for n in slow if (_number(n.get("held_shards")) or 0) < (_number(n.get("planned_shards")) or 0)]
    advice = []
    if not _number(_cache_totals(cache).get("prefetch_bytes")):
        advice.append("Nothing was prefetched for it: start the node daemons with --master (shardcache serve --master URL --node NAME) "
                      "so they fetch the shards their trainers will be leased")
    if behind:
        n = behind[0]
        advice.append(f"{len(behind)} node(s) hold fewer shards than planned for them ({_printable(n.get('node'))}: "
                      f"{_whole(n.get('held_shards'))}/{_whole(n.get('planned_shards'))}): prefetch is behind or the cache "
                      "is too small for the job (shardcache serve --cache-size)")
    advice.append("Warm the cache before the epoch (shardcache warmup)")
    return ". ".join(advice)


def _below(value: Any, threshold: float) -> bool:
    number = _number(value)
    return number is not None and number < threshold


def cache_warnings(jobs: list[dict[str, Any]], wait_threshold: float, hit_threshold: float) -> list[str]:
    """A WARNING line for each job whose trainers waited more than ``wait_threshold`` of the last
    60 s while its cache hit rate is under ``hit_threshold`` (fractions): the reads that miss the
    cache are then the likely reason the trainers wait. It names the worst nodes and what to do."""
    lines = []
    for job in jobs:
        cache = _cache(job)
        if cache is None:
            continue
        totals = _cache_totals(cache)
        hit = _number(totals.get("hit_rate"))
        wait = job.get("wait")
        share = _number(wait.get("fraction_60s")) if isinstance(wait, dict) else None
        if hit is None or share is None or hit >= hit_threshold or share <= wait_threshold:
            continue
        # The nodes that miss: those with a known hit rate under the threshold, worst first.
        slow = [n for n in cache_nodes_worst_first(_cache_nodes(cache)) if _below(n.get("hit_rate"), hit_threshold)]
        named = _named([f"{_printable(n.get('node'))} hit {_percent(n.get('hit_rate'), 1)} wait "
                        f"{_percent(n.get('wait_fraction'), 1)}" for n in slow])
        lines.append(
            f"WARNING job {_printable(job.get('name'))}: cache hit rate {_percent(hit, 1)} while trainers waited "
            f"{_percent(share)} of the last 60 s for data (origin {_bytes(totals.get('origin_bytes'))}, "
            f"peer {_bytes(totals.get('peer_bytes'))}" + (f"; {named}" if named else "") + "): "
            "the trainers read what the node caches do not hold. " + _cache_advice(cache, slow)
        )
    return lines


def _print_master(master: dict[str, Any], *, all_trainers: bool = False) -> None:
    print()
    _table([["MASTER", "ROLE", "LEADER"]] + [
        [m["master"], m["role"] or ("unreachable" if m.get("unreachable") else "error"), m.get("leader") or "-"]
        for m in master["masters"]
    ])
    for m in master["masters"]:
        if m["error"]:
            print(f"{m['master']}: {m['error']}")
    if master["error"] and not master["missing_job"]:
        print(f"jobs: {master['error']}")
    if not master["jobs"]:
        if not master["error"]:
            print("no jobs")
        return
    print()
    rows = [["JOB", "EPOCH", "DONE", "LEASED", "TODO", "FAILED", "TRAINERS", "SAMPLES/S", "WAIT 60S", "STATE"]]
    for job in master["jobs"]:
        shards = job.get("shards") or {}
        rows.append([
            job["name"], _epoch(job),
            f"{shards.get('done', 0)}/{shards.get('total', 0)}", str(shards.get("leased", 0)),
            str(shards.get("todo", 0)), str(shards.get("failed", 0)), str(len(job.get("trainers") or [])),
            f"{job.get('samples_per_s') or 0:.1f}", _percent((job.get("wait") or {}).get("fraction_60s")),
            "finished" if job.get("finished") else "running",
        ])
    _table(rows)
    trainers: list[list[str]] = []
    hidden: list[str] = []
    for job in master["jobs"]:
        trainers += trainer_rows(job, None if all_trainers else _TRAINER_ROWS)
        more = len(job.get("trainers") or []) - _TRAINER_ROWS
        if not all_trainers and more > 0:
            hidden.append(f"{_printable(job['name'])}: {more} more trainers (shardcache status --job {_printable(job['name'])})")
    if trainers:
        print()
        _table([["JOB", "TRAINER", "NODE", "LEASES", "WAIT 60S", "WAITED", "P50", "P99"], *trainers])
        for line in hidden:
            print(line)
    for line in [*(master.get("wait_warnings") or []), *(master.get("cache_warnings") or [])]:
        print(line)
    for job in master["jobs"]:
        for extra in (cache_line(job), locality_line(job), checkpoint_line(job)):
            if extra:
                print(extra)
    if all_trainers:  # --job: the nodes behind the job's cache line
        for job in master["jobs"]:
            table = cache_node_lines(job)
            if table:
                print()
                print("\n".join(table))
    for job in master["jobs"]:
        for shard in job.get("failed_shards") or []:
            print(f"FAILED shard {job['name']}/{shard.get('key')} (epoch {_epoch(job)}, "
                  f"{shard.get('failures')} failures): {shard.get('last_error')}")
