"""``shardcache warmup`` against real daemon subprocesses and a real S3 endpoint."""

from __future__ import annotations

import json
import re
import signal
import time
from collections.abc import Callable
from typing import Any

import pytest

from tests.support.cli import read_json_lines, run_cli, run_pty, start_cli
from tests.support.daemons import Daemon
from tests.support.datasets import Dataset
from tests.support.processes import free_port


def events(stdout: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in stdout.splitlines() if line.strip()]


def summary(stdout: str) -> dict[str, Any]:
    found = [e for e in events(stdout) if e["event"] == "summary"]
    assert len(found) == 1, stdout
    return found[0]


def dataset_keys(dataset: Dataset) -> set[tuple[str, str]]:
    return {(dataset.bucket, dataset.prefix + key) for key in dataset.shards}


@pytest.mark.slow
def test_warms_every_daemon_over_tcp_and_unix_socket(
    s3_dataset: Dataset, daemon_factory: Callable[..., Daemon], s3_server: Any, cli_env: dict[str, str]
):
    one = daemon_factory("s3", s3_server.endpoint)
    two = daemon_factory("s3", s3_server.endpoint)
    assert run_cli(["index", s3_dataset.url], env=cli_env).returncode == 0

    check = run_cli(["warmup", s3_dataset.url, "--daemon", one.url, "--daemon", two.unix, "--check"], env=cli_env)
    assert check.returncode == 1  # nothing cached yet
    assert re.search(r"\s0\.0%\s+0/6", check.stdout), check.stdout

    result = run_cli(["warmup", s3_dataset.url, "--daemon", one.url, "--daemon", two.unix], env=cli_env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("done: 6/6 shards verified in cache") == 2, result.stdout
    assert one.cached_keys() == dataset_keys(s3_dataset) == two.cached_keys()
    assert one.stats()["origin_read_bytes"] == s3_dataset.total_bytes  # each shard fetched once

    check = run_cli(["warmup", s3_dataset.url, "--daemon", one.unix, "--daemon", two.url, "--check", "--json"],
                    env=cli_env)
    assert check.returncode == 0, check.stdout + check.stderr
    rows = [e for e in events(check.stdout) if e["event"] == "check"]
    assert [(r["fraction"], r["cached_files"], r["cached_bytes"]) for r in rows] == [
        (1.0, 6, s3_dataset.total_bytes)
    ] * 2


def test_default_daemon_comes_from_the_environment(
    file_dataset: Dataset, daemon_factory: Callable[..., Daemon], tmp_path: Any
):
    daemon = daemon_factory(f"file://{tmp_path}/root")
    result = run_cli(["warmup", file_dataset.url, "--json"], env={"SHARDCACHE_ENDPOINT": daemon.unix})
    assert result.returncode == 0, result.stdout + result.stderr
    assert summary(result.stdout)["ok"] is True
    assert daemon.cached_keys() == dataset_keys(file_dataset)
    # Without a manifest nothing is checksum-verified, and the user is told so.
    assert "no manifest.json" not in result.stderr  # --json output stays machine-only
    human = run_cli(["warmup", file_dataset.url, "--daemon", daemon.url])
    assert "no manifest.json" in human.stderr and human.returncode == 0
    # SHARDCACHE_DAEMON (the flag's own variable) wins over SHARDCACHE_ENDPOINT.
    down = f"http://127.0.0.1:{free_port()}"
    flag_env = run_cli(["warmup", file_dataset.url, "--check"],
                       env={"SHARDCACHE_DAEMON": daemon.url, "SHARDCACHE_ENDPOINT": down})
    assert flag_env.returncode == 0, flag_env.stderr


@pytest.mark.slow
def test_dry_run_fetches_nothing_and_spread_places_each_shard_once(
    s3_dataset: Dataset, daemon_factory: Callable[..., Daemon], s3_server: Any, cli_env: dict[str, str]
):
    daemons = [daemon_factory("s3", s3_server.endpoint) for _ in range(3)]
    flags = [arg for d in daemons for arg in ("--daemon", d.url)]
    dry = run_cli(["warmup", s3_dataset.url, *flags, "--spread", "--dry-run", "--json"], env=cli_env)
    assert dry.returncode == 0, dry.stderr
    plans = [e for e in events(dry.stdout) if e["event"] == "plan"]
    planned = [key for plan in plans for key in plan["keys"]]
    assert sorted(planned) == sorted(s3_dataset.prefix + k for k in s3_dataset.shards)  # each exactly once
    assert all(d.stats()["origin_read_bytes"] == 0 and not d.cached_keys() for d in daemons)

    result = run_cli(["warmup", s3_dataset.url, *flags, "--spread", "--json"], env=cli_env)
    assert result.returncode == 0, result.stdout + result.stderr
    placed = {plan["daemon"]: {(s3_dataset.bucket, k) for k in plan["keys"]} for plan in plans}
    for daemon in daemons:
        assert daemon.cached_keys() == placed.get(daemon.url, set())
    assert summary(result.stdout)["ok"] is True
    # --check in spread mode counts each daemon's own shards.
    check = run_cli(["warmup", s3_dataset.url, *flags, "--spread", "--check", "--json"], env=cli_env)
    assert check.returncode == 0, check.stdout
    assert all(row["fraction"] == 1.0 for row in events(check.stdout) if row["event"] == "check")


@pytest.mark.slow
def test_a_corrupt_shard_is_reported_and_the_rest_is_warmed(
    s3_dataset: Dataset, s3_daemon: Daemon, s3_server: Any, cli_env: dict[str, str]
):
    assert run_cli(["index", s3_dataset.url], env=cli_env).returncode == 0
    corrupt = bytearray(s3_dataset.shards["train-000004.tar"])
    corrupt[1500] ^= 0x01
    s3_server.client().put_object(Bucket=s3_dataset.bucket, Key="train/train-000004.tar", Body=bytes(corrupt))

    verify = run_cli(["index", s3_dataset.url, "--verify"], env=cli_env)
    assert verify.returncode == 1 and "train-000004.tar" in verify.stdout and "xxh3_128" in verify.stdout

    result = run_cli(["warmup", s3_dataset.url, "--daemon", s3_daemon.url], env=cli_env)
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    failed = [line for line in result.stdout.splitlines() if line.startswith("FAILED")]
    assert len(failed) == 1 and "train/train-000004.tar" in failed[0] and "checksum mismatch" in failed[0]
    assert "1 shards failed" in result.stderr
    assert "5/6 shards verified" in result.stdout
    # The manifest is stale, not the origin: the object as the origin now has it (and vouches for
    # with its checksum) is cached, and the warm-up says the manifest disagrees.
    assert s3_daemon.cached_keys() == dataset_keys(s3_dataset)

    as_json = run_cli(["warmup", s3_dataset.url, "--daemon", s3_daemon.unix, "--json"], env=cli_env)
    assert as_json.returncode == 1
    report = summary(as_json.stdout)
    assert report["ok"] is False
    assert [f["key"] for f in report["failed"]] == ["train/train-000004.tar"]
    assert report["daemons"][0]["files"]["cached_before"] == 5


@pytest.mark.slow
def test_daemon_down(s3_dataset: Dataset, s3_daemon: Daemon, cli_env: dict[str, str]):
    down = f"http://127.0.0.1:{free_port()}"
    result = run_cli(["warmup", s3_dataset.url, "--daemon", down], env=cli_env)
    assert result.returncode == 69
    assert "Traceback" not in result.stderr
    assert "connection refused" in result.stderr and down in result.stderr
    # One daemon down, one up: the live one is warmed, the exit status still says "unavailable".
    mixed = run_cli(["warmup", s3_dataset.url, "--daemon", down, "--daemon", s3_daemon.url], env=cli_env)
    assert mixed.returncode == 69, mixed.stdout + mixed.stderr
    assert s3_daemon.cached_keys() == dataset_keys(s3_dataset)
    check = run_cli(["warmup", s3_dataset.url, "--daemon", down, "--check"], env=cli_env)
    assert check.returncode == 69
    socket_gone = run_cli(["warmup", s3_dataset.url, "--daemon", "unix:///nonexistent/d.sock"], env=cli_env)
    assert socket_gone.returncode == 69 and "no such socket" in socket_gone.stderr


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--daemon", "ftp://x"], "use http://host:port"),
        (["--bandwidth", "lots"], "invalid size"),
        (["--concurrency", "0"], "--concurrency"),
        (["--id", "../etc"], "--id"),
        (["--check", "--dry-run"], "do not go together"),
    ],
)
def test_usage_errors(s3_dataset: Dataset, args: list[str], needle: str, cli_env: dict[str, str]):
    result = run_cli(["warmup", s3_dataset.url, *args], env=cli_env)
    assert result.returncode == 2
    assert needle in result.stderr and "Traceback" not in result.stderr


@pytest.mark.slow
def test_interrupt_then_reattach(
    big_s3_dataset: Dataset, s3_daemon: Daemon, cli_env: dict[str, str]
):
    """SIGINT stops the CLI, not the warm-up; the same command attaches and finishes it, and no
    shard is fetched twice."""
    assert run_cli(["index", big_s3_dataset.url], env=cli_env).returncode == 0
    args = ["warmup", big_s3_dataset.url, "--daemon", s3_daemon.url, "--bandwidth", "600KiB", "--json"]
    proc = start_cli(args, env=cli_env)
    try:
        seen = read_json_lines(proc, lambda e: e["event"] == "progress" and e["files"]["done"] >= 1, timeout=30)
        started = [e for e in seen if e["event"] == "started"]
        assert len(started) == 1
        job = started[0]["id"]
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=15)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err
    assert "run the same command to re-attach" in err
    assert "Traceback" not in err
    state = s3_daemon.get(f"/_shardcache/warmups/{job}")
    assert state["state"] == "running" and state["files"]["done"] < 6  # still going without the CLI

    again = run_cli(args, env=cli_env, timeout=60)
    assert again.returncode == 0, again.stdout + again.stderr
    assert [e["id"] for e in events(again.stdout) if e["event"] == "attached"] == [job]
    assert summary(again.stdout)["daemons"][0]["files"]["done"] == 6
    assert s3_daemon.stats()["origin_read_bytes"] == big_s3_dataset.total_bytes
    assert s3_daemon.cached_keys() == dataset_keys(big_s3_dataset)


@pytest.mark.slow
def test_detach_and_cancel(big_s3_dataset: Dataset, s3_daemon: Daemon, cli_env: dict[str, str]):
    args = ["warmup", big_s3_dataset.url, "--daemon", s3_daemon.url, "--bandwidth", "300KiB"]
    began = time.monotonic()
    detached = run_cli([*args, "--detach"], env=cli_env)
    assert detached.returncode == 0, detached.stderr
    assert time.monotonic() - began < 10
    match = re.search(r"started warm-up (\S+) on", detached.stdout)
    assert match, detached.stdout
    job = match.group(1)
    assert s3_daemon.get(f"/_shardcache/warmups/{job}")["state"] == "running"
    # Detaching again finds the same job.
    again = run_cli([*args, "--detach"], env=cli_env)
    assert f"attached to warm-up {job} on" in again.stdout
    cancelled = run_cli([*args, "--cancel"], env=cli_env)
    assert cancelled.returncode == 0, cancelled.stderr
    assert f"warm-up {job} on {s3_daemon.url}: cancelled" in cancelled.stdout
    assert s3_daemon.get(f"/_shardcache/warmups/{job}")["state"] == "cancelled"


@pytest.mark.slow
def test_daemon_restart_while_watching_resubmits(
    big_s3_dataset: Dataset, s3_daemon: Daemon, cli_env: dict[str, str]
):
    """A daemon that restarts forgets its jobs; the CLI submits again and shards already cached
    count at once."""
    args = ["warmup", big_s3_dataset.url, "--daemon", s3_daemon.url, "--bandwidth", "600KiB", "--json"]
    proc = start_cli(args, env=cli_env)
    try:
        read_json_lines(proc, lambda e: e["event"] == "progress" and e["files"]["done"] >= 2, timeout=30)
        s3_daemon.kill9()
        s3_daemon.start()
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out + err
    final = summary(out)
    assert final["ok"] is True
    assert any(e["event"] == "resubmitted" for e in events(out))
    assert final["daemons"][0]["files"]["cached_before"] >= 2
    assert s3_daemon.cached_keys() == dataset_keys(big_s3_dataset)


@pytest.mark.slow
def test_progress_display_on_a_terminal(
    big_s3_dataset: Dataset, daemon_factory: Callable[..., Daemon], s3_server: Any, cli_env: dict[str, str]
):
    one = daemon_factory("s3", s3_server.endpoint)
    two = daemon_factory("s3", s3_server.endpoint)
    code, drawn = run_pty(
        ["warmup", big_s3_dataset.url, "--daemon", one.url, "--daemon", two.unix, "--bandwidth", "1MiB"],
        env=cli_env, columns=120,
    )
    assert code == 0, drawn
    assert "\x1b[3F" in drawn  # the 3-line block (2 daemons + total) is redrawn in place
    frames = drawn.split("\x1b[3F")
    assert len(frames) >= 3, drawn  # it moved while we watched
    middle = [line.replace("\x1b[2K", "") for line in frames[1].splitlines() if line.strip()]
    last = [line.replace("\x1b[2K", "") for line in frames[-1].splitlines() if line.strip()][:3]
    for lines in (middle, last):
        # Labels too long for a quarter of the terminal keep their distinctive end.
        assert lines[0].startswith(one.url) and lines[2].startswith("total  ")
        assert lines[1].startswith("…") and lines[1].split()[0].endswith(two.sock.name)
        for line in lines:
            assert len(line) <= 119
            assert re.search(r"\[[█▏▎▍▌▋▊▉ ]{10,40}\]  +\d+\.\d%  \d+/\d+ files  [\d.]+( \w+)?/[\d.]+ \w+  ", line), line
            assert "/s" in line and "ETA " in line
    assert all("100.0%" in line and "ETA 0:00" in line for line in last)
    assert last[2].count("12/12 files") == 1
    assert any("ETA" in line and "100.0%" not in line for line in middle)
    assert "done: 6/6 shards verified in cache" in drawn


@pytest.mark.slow
def test_a_dataset_larger_than_the_cache_is_never_reported_done(
    file_dataset: Dataset, daemon_factory: Callable[..., Daemon], tmp_path: Any
):
    """Shards evicted by later ones while the warm-up ran are failures with a reason, not 'done'."""
    shard = max(len(v) for v in file_dataset.shards.values())
    daemon = daemon_factory(f"file://{tmp_path}/root", cache_size=str(shard * 2 + shard // 2))
    result = run_cli(["warmup", file_dataset.url, "--daemon", daemon.url, "--json", "--concurrency", "1"])
    assert result.returncode == 1, result.stdout + result.stderr
    report = summary(result.stdout)
    files = report["daemons"][0]["files"]
    assert report["ok"] is False and report["daemons"][0]["state"] == "failed"
    assert files["done"] == len(daemon.cached_keys()) == 2
    assert files["failed"] == 3 and all("evicted" in f["reason"] for f in report["failed"])
    held = {key for _, key in daemon.cached_keys()}
    assert held.isdisjoint(f["key"] for f in report["failed"])  # every failure is truly not cached
