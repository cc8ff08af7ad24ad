"""``shardcache demo``: the main job end to end on embedded defaults, in about half a minute.

It generates a small image dataset (real JPEG shards) on a ``file://`` origin in a temp dir,
indexes it, starts a node daemon and a master (``python -m sidecar.cli serve/master``), runs
trainer processes that read the dataset through ``loader.ShardLoader(job=..., master=...,
endpoint=<daemon>)`` for two epochs, kills one trainer with SIGKILL mid-epoch and adds another,
and prints what happened: cold vs warm throughput, cache hit rate, time trainers waited for data,
and the exactly-once check, from the master's own job status and from what the trainers received.

Every child runs in its own process group and is killed in ``finally``, whatever ends the demo
(success, failure, Ctrl-C, SIGTERM); the temp dir goes too (unless ``--keep``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from sidecar.cli.util import (
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_UNAVAILABLE,
    RawDefaultsFormatter,
    UserError,
    add_flag,
)

__all__ = ["register", "run", "trainer_main"]

JOB = "demo"
EXAMPLES = """\
examples:
  # the whole thing: dataset, daemon, master, 3 trainers (one killed, one added), 2 epochs
  shardcache demo

  # bigger, with more trainers, keeping the temp dir (dataset, cache, logs) to look at
  shardcache demo --shards 64 --trainers 4 --keep

  # the summary as JSON (exit status 1 if the exactly-once check fails)
  shardcache demo --json | jq .exactly_once
"""


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "demo",
        help="run the main job end to end: dataset, daemon, master, elastic trainers (start here)",
        description="Generate a small JPEG WebDataset on a file:// origin, start a node daemon and a master, "
        "and train two epochs with several trainer processes through the cache, one killed with SIGKILL "
        "mid-epoch and one added later; then print throughput, hit rate, data-wait time and the "
        "exactly-once check. Needs nothing but the package; cleans up after itself.",
        epilog=EXAMPLES,
        formatter_class=RawDefaultsFormatter,
    )
    add_flag(parser, "--shards", default="32", metavar="N", help="shards in the generated dataset")
    add_flag(parser, "--samples-per-shard", default="100", metavar="N", help="JPEG samples per shard")
    add_flag(parser, "--image-size", default="96", metavar="PX", help="width and height of each JPEG")
    add_flag(parser, "--trainers", default="3", metavar="N", help="trainers at the start (one is killed, one added)")
    add_flag(parser, "--step-ms", default="4", metavar="MS",
             help="simulated compute per sample, in milliseconds (the 'GPU' the data feeds)")
    add_flag(parser, "--lease-ttl", default="3", metavar="SECONDS",
             help="lease TTL of the job: how soon the killed trainer's shards are handed out again")
    add_flag(parser, "--timeout", default="110", metavar="SECONDS", help="give up (and fail) after this long")
    add_flag(parser, "--keep", action="store_true", default=False, help="keep the temp dir (dataset, cache, logs)")
    add_flag(parser, "--json", action="store_true", default=False, help="print the summary as JSON")
    parser.set_defaults(func=run)


def _int(text: str, flag: str, low: int, high: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise UserError(f"{flag} must be an integer, not {text!r}") from None
    if not low <= value <= high:
        raise UserError(f"{flag} must be between {low} and {high}")
    return value


def _float(text: str, flag: str, low: float, high: float) -> float:
    try:
        value = float(text)
    except ValueError:
        raise UserError(f"{flag} must be a number, not {text!r}") from None
    if not low <= value <= high:
        raise UserError(f"{flag} must be between {low:g} and {high:g}")
    return value


@dataclass
class DemoSettings:
    shards: int = 32
    """Shards in the generated dataset."""

    samples_per_shard: int = 100
    """Samples per shard."""

    image_size: int = 96
    """JPEG width and height."""

    trainers: int = 3
    """Trainers started at the beginning."""

    step_s: float = 0.004
    """Simulated compute per sample."""

    lease_ttl_s: float = 3.0
    """Lease TTL of the demo job."""

    timeout_s: float = 110.0
    """Overall deadline."""

    epochs: int = 2
    """Epochs of the job."""


# -- processes ------------------------------------------------------------------------------------


def _child_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHARDCACHE_")}
    # The children import this very package, installed or run from a checkout.
    package_root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH", "")) if p)
    env["NO_PROXY"] = "127.0.0.1,localhost"
    env.pop("AWS_ENDPOINT_URL", None)
    return env


@dataclass
class Child:
    name: str
    proc: subprocess.Popen[bytes]
    log: Path
    killed: bool = False

    def tail(self, lines: int = 15) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        return ""


@dataclass
class Children:
    """Every process the demo starts, each in its own process group, killed in ``close``."""

    items: list[Child] = field(default_factory=list)

    def start(self, name: str, args: list[str], log: Path) -> Child:
        # Ctrl-C between starting a process and recording it would leak it: hold signals meanwhile.
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
        try:
            with open(log, "ab") as handle:
                proc = subprocess.Popen(
                    [sys.executable, *args], stdout=handle, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                    env=_child_env(), start_new_session=True,
                )
            child = Child(name, proc, log)
            self.items.append(child)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        return child

    def close(self) -> None:
        alive = [c for c in self.items if c.proc.poll() is None]
        for child in alive:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 5
        for child in alive:
            try:
                child.proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(child.proc.pid, signal.SIGKILL)
                child.proc.wait(timeout=5)
        for child in self.items:  # a process group may hold grandchildren: make sure they are gone
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(child.proc.pid, signal.SIGKILL)


def _get(url: str, timeout: float = 5.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return json.loads(resp.read())


def _wait_ready(child: Child, url: str, deadline: float) -> None:
    while time.monotonic() < deadline:
        if child.proc.poll() is not None:
            raise UserError(f"the {child.name} exited with status {child.proc.returncode}:\n{child.tail()}",
                            EXIT_UNAVAILABLE)
        with contextlib.suppress(OSError, ValueError):
            _get(url, timeout=1)
            return
        time.sleep(0.05)
    raise UserError(f"the {child.name} did not become ready in time:\n{child.tail()}", EXIT_UNAVAILABLE)


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# -- the trainer ----------------------------------------------------------------------------------


def trainer_main(argv: list[str]) -> int:
    """One trainer: reads the job's shards through the cache, decodes each JPEG, simulates a
    training step, and logs every sample it was handed (epoch, key, time, time waited)."""
    parser = argparse.ArgumentParser(prog="shardcache-demo-trainer")
    parser.add_argument("--name", required=True)
    parser.add_argument("--url", required=True)
    parser.add_argument("--master", required=True)
    parser.add_argument("--endpoint", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--epochs", type=int, required=True)
    parser.add_argument("--lease-ttl", type=float, required=True)
    parser.add_argument("--step-s", type=float, required=True)
    args = parser.parse_args(argv)

    import io

    from PIL import Image

    from loader import ShardLoader

    loader = ShardLoader(
        args.url, job=JOB, master=args.master, endpoint=args.endpoint, trainer=args.name,
        epochs=args.epochs, lease_ttl_s=args.lease_ttl, seed=1,
    )
    with open(args.out, "a", buffering=1) as out:  # line-buffered: a SIGKILL loses at most a line
        out.write(json.dumps({"start": time.time()}) + "\n")
        while not loader.finished:
            iterator = iter(loader)
            epoch = None
            while True:
                began = time.time()
                try:
                    sample = next(iterator)
                except StopIteration:
                    out.write(json.dumps({"epoch_end": epoch, "t": time.time(), "w": time.time() - began}) + "\n")
                    break
                got = time.time()
                epoch = loader.epoch
                out.write(json.dumps({"e": epoch, "k": sample["__key__"], "t": got, "w": got - began}) + "\n")
                Image.open(io.BytesIO(sample["jpg"])).load()  # the real work a data pipeline does
                int(sample["cls"])
                time.sleep(args.step_s)  # the training step the data feeds
            if epoch is None and not loader.finished:
                time.sleep(0.1)  # joined between epochs: ask again
        out.write(json.dumps({"done": time.time()}) + "\n")
    loader.close()
    return 0


# -- the demo -------------------------------------------------------------------------------------


class Narrator:
    def __init__(self, quiet: bool, stream: IO[str] = sys.stdout) -> None:
        self.quiet = quiet
        self.stream = stream
        self.t0 = time.monotonic()

    def say(self, text: str) -> None:
        if not self.quiet:
            print(f"[{time.monotonic() - self.t0:5.1f}s] {text}", file=self.stream, flush=True)


def _records(path: Path) -> list[dict[str, Any]]:
    found = []
    with contextlib.suppress(FileNotFoundError):
        for line in path.read_text().splitlines():
            with contextlib.suppress(ValueError):  # a line cut by SIGKILL
                found.append(json.loads(line))
    return found


def _hits(stats: dict[str, Any]) -> tuple[float, float]:
    requests = stats["requests"]
    return float(requests["hits"]), float(requests["hits"] + requests["misses"] + requests["coalesced"])


def run(args: argparse.Namespace) -> int:
    settings = DemoSettings(
        shards=_int(args.shards, "--shards", 2, 10_000),
        samples_per_shard=_int(args.samples_per_shard, "--samples-per-shard", 1, 100_000),
        image_size=_int(args.image_size, "--image-size", 8, 2048),
        trainers=_int(args.trainers, "--trainers", 2, 64),
        step_s=_float(args.step_ms, "--step-ms", 0, 10_000) / 1000,
        lease_ttl_s=_float(args.lease_ttl, "--lease-ttl", 1, 600),
        timeout_s=_float(args.timeout, "--timeout", 5, 86_400),
    )
    try:
        import PIL  # noqa: F401
    except ImportError:
        raise UserError("the demo needs Pillow: pip install pillow", EXIT_FAILED) from None

    workdir = Path(tempfile.mkdtemp(prefix="shardcache-demo-"))
    children = Children()
    narrator = Narrator(quiet=args.json)
    previous_term = signal.getsignal(signal.SIGTERM)

    def on_term(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt  # same clean-up path as Ctrl-C

    signal.signal(signal.SIGTERM, on_term)
    try:
        return _demo(settings, workdir, children, narrator, args)
    except KeyboardInterrupt:
        print("shardcache demo: interrupted; stopping its processes and removing its files", file=sys.stderr)
        return EXIT_INTERRUPTED
    finally:
        # A second Ctrl-C must not cut the clean-up short.
        previous_int = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            children.close()
            if args.keep:
                print(f"kept {workdir} (dataset, cache, master state, logs)", file=sys.stderr)
            else:
                shutil.rmtree(workdir, ignore_errors=True)
        finally:
            signal.signal(signal.SIGINT, previous_int)
            signal.signal(signal.SIGTERM, previous_term)


def _demo(settings: DemoSettings, workdir: Path, children: Children, say: Narrator, args: argparse.Namespace) -> int:
    from sidecar.cli.datasets import (
        build_manifest,
        list_shards,
        manifest_bytes,
        open_store,
        scan_shard,
        write_object,
    )
    from sidecar.cli.demo_data import DatasetSpec, write_image_dataset
    from sidecar.cli.progress import format_bytes
    from wire.dataset import MANIFEST_NAME, parse_dataset_url

    deadline = time.monotonic() + settings.timeout_s
    origin = workdir / "origin"
    directory = origin / "demo" / "train"
    url = f"file://{directory}/"
    spec = DatasetSpec(shards=settings.shards, samples_per_shard=settings.samples_per_shard,
                       image_size=settings.image_size, seed=1)
    written = write_image_dataset(directory, spec)
    all_keys = {key for keys in written.values() for key in keys}
    dataset = parse_dataset_url(url)
    store = open_store(dataset)
    infos = []
    for obj in list_shards(store):
        with contextlib.closing(store.open(obj.key)) as reader:
            infos.append(scan_shard(reader, obj.key))
    write_object(dataset.object_url(MANIFEST_NAME), manifest_bytes(build_manifest(infos)))
    size = sum(info.size for info in infos)
    say.say(f"generated {settings.shards} shards x {settings.samples_per_shard} JPEG samples "
            f"({format_bytes(size)}) at {url} and indexed them (manifest.json)")

    daemon_port, master_port = _free_port(), _free_port()
    daemon_url, master_url = f"http://127.0.0.1:{daemon_port}", f"http://127.0.0.1:{master_port}"
    daemon = children.start("daemon", [
        "-m", "sidecar.cli", "--log-level", "WARNING", "serve", "--origin", f"file://{origin}",
        "--listen", f"tcp://127.0.0.1:{daemon_port}", "--cache-dir", str(workdir / "cache"),
        "--cache-size", "2GiB", "--min-free", "0",
    ], workdir / "daemon.log")
    master = children.start("master", [
        "-m", "sidecar.cli", "--log-level", "WARNING", "master", "--listen", f"tcp://127.0.0.1:{master_port}",
        "--state", f"sqlite://{workdir}/master.db",
    ], workdir / "master.log")
    _wait_ready(daemon, daemon_url + "/readyz", deadline)
    _wait_ready(master, master_url + "/readyz", deadline)
    say.say(f"node daemon at {daemon_url} (cache {workdir / 'cache'}), master at {master_url}")

    trainers: dict[str, Child] = {}
    outputs: dict[str, Path] = {}

    def start_trainer(name: str) -> None:
        outputs[name] = workdir / f"{name}.jsonl"
        trainers[name] = children.start(f"trainer {name}", [
            "-m", "sidecar.cli.commands.demo", "--name", name, "--url", url, "--master", master_url,
            "--endpoint", daemon_url, "--out", str(outputs[name]), "--epochs", str(settings.epochs),
            "--lease-ttl", str(settings.lease_ttl_s), "--step-s", str(settings.step_s),
        ], workdir / f"{name}.log")

    names = [f"t{i + 1}" for i in range(settings.trainers)]
    for name in names:
        start_trainer(name)
    say.say(f"started trainers {' '.join(names)}: job {JOB!r}, {settings.epochs} epochs, "
            f"lease TTL {settings.lease_ttl_s:g}s, reading through the daemon")

    per_epoch = settings.shards * settings.samples_per_shard
    victim, late = names[0], f"t{settings.trainers + 1}"
    kill_after = max(per_epoch // (settings.trainers * 8), 1)  # a few shards' worth into epoch 1
    killed_at: float | None = None
    epoch_seen = 0
    boundary_stats: dict[int, dict[str, Any]] = {}
    status: dict[str, Any] = {}
    last_report = time.monotonic()
    while True:
        if time.monotonic() > deadline:
            raise UserError(f"the demo did not finish within {settings.timeout_s:g}s (see --timeout); "
                            f"re-run with --keep and read the logs in the temp dir", EXIT_FAILED)
        for name, child in trainers.items():
            code = child.proc.poll()
            if code not in (None, 0) and not child.killed:
                raise UserError(f"trainer {name} failed with status {code}:\n{child.tail()}", EXIT_FAILED)
        for child in (daemon, master):
            if child.proc.poll() is not None:
                raise UserError(f"the {child.name} died (status {child.proc.returncode}):\n{child.tail()}",
                                EXIT_FAILED)
        with contextlib.suppress(urllib.error.HTTPError, OSError, ValueError):
            status = _get(f"{master_url}/v1/jobs/{JOB}")
            if int(status.get("epoch", 0)) > epoch_seen or status.get("finished"):
                stats = _get(f"{daemon_url}/_shardcache/stats")
                while epoch_seen < int(status.get("epoch", 0)):
                    boundary_stats[epoch_seen] = stats
                    say.say(f"epoch {epoch_seen + 1} complete on the master "
                            f"({status['shards']['total']} shards)")
                    epoch_seen += 1
        if killed_at is None:
            got = [r for r in _records(outputs[victim]) if r.get("e") == 0]
            if len(got) >= kill_after:
                os.killpg(trainers[victim].proc.pid, signal.SIGKILL)
                trainers[victim].killed = True
                trainers[victim].proc.wait(timeout=10)
                killed_at = time.time()
                say.say(f"killed trainer {victim} with SIGKILL mid-epoch 1, after {len(got)} samples "
                        "(its leases expire and are handed out again, resuming at the last renewed offset)")
                start_trainer(late)
                say.say(f"started trainer {late} (joins the running job)")
        if status.get("finished") and all(c.proc.poll() is not None for c in trainers.values()):
            break
        if status and not status.get("finished") and time.monotonic() - last_report >= 2.0:
            last_report = time.monotonic()
            shards = status["shards"]
            active = sorted(t["trainer"] for t in status.get("trainers") or [] if t.get("leases"))
            say.say(f"epoch {int(status['epoch']) + 1}/{settings.epochs}: {shards['done']}/{shards['total']} shards "
                    f"done, {shards['leased']} leased by {' '.join(active) or 'nobody'}, "
                    f"{status.get('samples_per_s') or 0:.0f} samples/s")
        time.sleep(0.1)

    final_stats = _get(f"{daemon_url}/_shardcache/stats")
    status = _get(f"{master_url}/v1/jobs/{JOB}")
    say.say("job finished; every trainer exited")
    summary = _summarize(settings, status, final_stats, boundary_stats, outputs, all_keys, victim, late, killed_at)
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        _print_summary(summary)
    return EXIT_OK if summary["exactly_once"]["ok"] else EXIT_FAILED


def _summarize(
    settings: DemoSettings, status: dict[str, Any], stats: dict[str, Any], boundary: dict[int, dict[str, Any]],
    outputs: dict[str, Path], all_keys: set[str], victim: str, late: str, killed_at: float | None,
) -> dict[str, Any]:
    records = {name: _records(path) for name, path in outputs.items()}
    epochs: list[dict[str, Any]] = []
    seen_per_epoch: list[dict[str, int]] = []
    previous_hits, previous_lookups = 0.0, 0.0
    for epoch in range(settings.epochs):
        samples = [r for rs in records.values() for r in rs if r.get("e") == epoch]
        ends = [r for rs in records.values() for r in rs if "epoch_end" in r and r["epoch_end"] == epoch]
        counts: dict[str, int] = {}
        for r in samples:
            counts[r["k"]] = counts.get(r["k"], 0) + 1
        seen_per_epoch.append(counts)
        if samples:
            first = min(r["t"] - r["w"] for r in samples)
            last = max(r["t"] for r in samples)
        else:
            first = last = 0.0
        snap = boundary.get(epoch, stats)
        hits, lookups = _hits(snap)
        epoch_hits, epoch_lookups = hits - previous_hits, lookups - previous_lookups
        previous_hits, previous_lookups = hits, lookups
        epochs.append({
            "epoch": epoch + 1,
            "samples": len(samples),
            "seconds": round(last - first, 3),
            "samples_per_s": round(len(samples) / (last - first), 1) if last > first else None,
            "data_wait_s": round(sum(r["w"] for r in samples), 3),
            "end_of_epoch_wait_s": round(sum(r["w"] for r in ends), 3),
            "cache_lookups": int(epoch_lookups),
            "hit_rate": round(epoch_hits / epoch_lookups, 4) if epoch_lookups else None,
        })
    shards = status.get("shards") or {}
    totals = status.get("totals") or {}
    expected = int(shards.get("total", 0)) * settings.epochs
    master_ok = bool(
        status.get("finished") and int(totals.get("completed", -1)) == expected
        and not status.get("failed_shards") and not status.get("failed_previous_epoch")
        and int(totals.get("failures", 0)) == 0
    )
    missing = [sorted(all_keys - set(counts))[:5] for counts in seen_per_epoch]
    samples_ok = all(not m for m in missing)
    duplicates = [sum(c - 1 for c in counts.values()) for counts in seen_per_epoch]
    hits, lookups = _hits(stats)
    return {
        "dataset": {"shards": settings.shards, "samples_per_epoch": len(all_keys), "epochs": settings.epochs},
        "step_ms": settings.step_s * 1000,
        "trainers": {name: {"samples": sum(1 for r in rs if "k" in r), "killed": name == victim and killed_at is not None,
                            "added_later": name == late} for name, rs in records.items()},
        "epochs": epochs,
        "cache": {"hit_rate": round(hits / lookups, 4) if lookups else None, "lookups": int(lookups),
                  "origin_read_bytes": stats.get("origin_read_bytes"), "items": (stats.get("cache") or {}).get("items")},
        "master": {"completed": totals.get("completed"), "expected_completions": expected,
                   "reissued": totals.get("reissued"), "expired": totals.get("expired"),
                   "failures": totals.get("failures"), "finished": status.get("finished")},
        "exactly_once": {
            "ok": master_ok and samples_ok,
            "shards_completed_exactly_once": master_ok,
            "every_sample_delivered": samples_ok,
            "missing_samples": missing,
            "samples_delivered_twice": duplicates,
        },
    }


def _print_summary(s: dict[str, Any]) -> None:
    from sidecar.cli.progress import format_bytes

    e1, e2 = s["epochs"][0], s["epochs"][-1]

    def rate(e: dict[str, Any]) -> str:
        return f"{e['samples_per_s']:.0f} samples/s" if e["samples_per_s"] else "-"

    def hit(e: dict[str, Any]) -> str:
        return f"{e['hit_rate'] * 100:.0f}% ({e['cache_lookups']} reads)" if e["hit_rate"] is not None else "-"

    rows = [
        ("", "epoch 1 (cold)", f"epoch {e2['epoch']} (warm)"),
        ("samples", str(e1["samples"]), str(e2["samples"])),
        ("throughput", rate(e1), rate(e2)),
        ("cache hit rate", hit(e1), hit(e2)),
        ("trainers waited for data", f"{e1['data_wait_s']:.2f} s", f"{e2['data_wait_s']:.2f} s"),
        ("  + end-of-epoch waits", f"{e1['end_of_epoch_wait_s']:.2f} s", f"{e2['end_of_epoch_wait_s']:.2f} s"),
    ]
    print()
    print("summary")
    width = max(len(r[0]) for r in rows)
    for label, a, b in rows:
        print(f"  {label:<{width}}  {a:>18}  {b:>18}")
    if e1["samples_per_s"] and e2["samples_per_s"] and abs(e1["samples_per_s"] - e2["samples_per_s"]) < 0.15 * e2["samples_per_s"]:
        print(f"  (both epochs run at the pace of the simulated training step, {s['step_ms']:g} ms a sample: the "
              "origin here is a local directory; the wait rows show what the cache saves)")
    if e1["hit_rate"]:
        print(f"  (the cold epoch already hit the cache {e1['hit_rate'] * 100:.0f}% of the time: while a trainer reads "
              "one leased shard, the daemon prefetches its next one)")
    cache = s["cache"]
    print(f"  overall hit rate {cache['hit_rate'] * 100:.0f}% ({cache['lookups']} reads of whole shards); "
          f"origin read {format_bytes(cache['origin_read_bytes'] or 0)}; {cache['items']} objects cached")
    for name, t in s["trainers"].items():
        note = " (killed with SIGKILL mid-epoch 1)" if t["killed"] else " (added after the kill)" if t["added_later"] else ""
        print(f"  trainer {name}: {t['samples']} samples{note}")
    m, x = s["master"], s["exactly_once"]
    print(f"  master: {m['completed']} shard completions for {m['expected_completions']} "
          f"(shards x epochs); {m['expired']} leases expired, {m['reissued']} re-issued, {m['failures']} failures")
    shard_line = ("every shard of every epoch completed exactly once" if x["shards_completed_exactly_once"]
                  else "shard completions do not add up (see the master line above)")
    sample_line = ("every sample delivered at least once" if x["every_sample_delivered"]
                   else f"samples never delivered, e.g. {x['missing_samples']}")
    twice = ", ".join(str(n) for n in x["samples_delivered_twice"])
    print(f"exactly-once check: {'OK' if x['ok'] else 'FAILED'}: {shard_line}; {sample_line} "
          f"(delivered twice per epoch: {twice}, the killed trainer's samples after its last renew)")


if __name__ == "__main__":  # the demo's trainer processes: python -m sidecar.cli.commands.demo --name ...
    sys.exit(trainer_main(sys.argv[1:]))
