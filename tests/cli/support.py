"""Helpers for the CLI tests: run ``python -m sidecar.cli`` (plain, piped or under a pty), real
daemon subprocesses, an in-process daemon (so the blocking-call guard sees its loop), datasets."""

from __future__ import annotations

import fcntl
import io
import json
import os
import pty
import random
import select
import signal
import struct
import subprocess
import tarfile
import termios
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import xxhash

from tests.helpers import (
    PYTHON,
    REPO,
    DaemonThread,
    free_port,
    http_ok,
    spawn,
    stop,
    wait_until,
)

__all__ = [
    "Daemon",
    "ThreadDaemon",
    "make_shards",
    "make_tar",
    "put_dataset",
    "read_json_lines",
    "run_cli",
    "run_pty",
    "start_cli",
    "write_dataset",
    "xxh3",
]


def xxh3(data: bytes) -> str:
    return xxhash.xxh3_128_hexdigest(data)


def make_tar(samples: int, member_bytes: int, seed: int, first: int = 0) -> bytes:
    """A WebDataset shard: ``samples`` samples of ``.bin`` + ``.cls`` members (random bytes)."""
    rng = random.Random(seed)
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for n in range(first, first + samples):
            for ext, data in ((".bin", rng.randbytes(member_bytes)), (".cls", str(n % 7).encode())):
                info = tarfile.TarInfo(f"{n:06d}{ext}")
                info.size = len(data)
                info.mtime = 1_700_000_000
                tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


def make_shards(count: int, samples: int = 4, member_bytes: int = 4096, seed: int = 0) -> dict[str, bytes]:
    return {
        f"train-{i:06d}.tar": make_tar(samples, member_bytes, seed * 1000 + i, first=i * samples)
        for i in range(count)
    }


def put_dataset(client: Any, bucket: str, prefix: str, shards: dict[str, bytes]) -> None:
    for key, data in shards.items():
        client.put_object(Bucket=bucket, Key=prefix + key, Body=data)


def write_dataset(directory: Path, shards: dict[str, bytes]) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for key, data in shards.items():
        (directory / key).write_bytes(data)


# -- running the CLI ------------------------------------------------------------------------------


def _env(env: dict[str, str] | None) -> dict[str, str]:
    full = {k: v for k, v in os.environ.items() if not k.startswith("SHARDCACHE_")}
    full["PYTHONPATH"] = str(REPO)
    full["NO_PROXY"] = "*"
    full.update(env or {})
    return full


def run_cli(args: list[str], env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [PYTHON, "-m", "sidecar.cli", *args], env=_env(env), cwd=str(REPO), capture_output=True,
        text=True, timeout=timeout, check=False,
    )


def start_cli(args: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    """The CLI with pipes, in its own session (signals reach only it)."""
    return subprocess.Popen(
        [PYTHON, "-m", "sidecar.cli", *args], env=_env(env), cwd=str(REPO), stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, start_new_session=True,
    )


def read_json_lines(proc: subprocess.Popen[str], until: Callable[[dict[str, Any]], bool], timeout: float) -> list[dict[str, Any]]:
    """Read JSON events from the CLI's stdout until one matches ``until`` (or fail after ``timeout``)."""
    assert proc.stdout is not None
    events: list[dict[str, Any]] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], max(deadline - time.monotonic(), 0))
        if not ready:
            break
        line = proc.stdout.readline()
        if not line:
            break
        event = json.loads(line)
        events.append(event)
        if until(event):
            return events
    raise AssertionError(f"no matching event within {timeout}s; got {events}")


def run_pty(
    args: list[str], env: dict[str, str] | None = None, timeout: float = 60, columns: int = 120,
    on_output: Callable[[bytes, int], None] | None = None,
) -> tuple[int, str]:
    """Run the CLI on a pseudo-terminal ``columns`` wide; returns (exit status, everything drawn)."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, columns, 0, 0))
    proc = subprocess.Popen(
        [PYTHON, "-m", "sidecar.cli", *args], env=_env({"TERM": "xterm", **(env or {})}), cwd=str(REPO),
        stdin=slave, stdout=slave, stderr=slave, start_new_session=True, close_fds=True,
    )
    os.close(slave)
    out = b""
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 0.2)
            if ready:
                try:
                    data = os.read(master, 65536)
                except OSError:  # EIO: the child closed the terminal
                    break
                if not data:
                    break
                out += data
                if on_output is not None:
                    on_output(out, proc.pid)
            elif proc.poll() is not None:
                break
        else:
            raise AssertionError(f"CLI still running after {timeout}s; drew {out[-2000:]!r}")
        return proc.wait(timeout=10), out.decode("utf-8", "replace")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        os.close(master)


# -- daemons --------------------------------------------------------------------------------------


class Daemon:
    """``shardcache serve`` as a subprocess on a TCP port and a unix socket."""

    def __init__(self, tmp: Path, origin: str, s3_endpoint: str | None = None, cache_size: str = "1GiB",
                 extra: tuple[str, ...] = ()) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.sock = tmp / f"d{self.port}.sock"
        self.unix = f"unix://{self.sock}"
        self.cache = tmp / f"cache{self.port}"
        self.log = tmp / f"daemon{self.port}.log"
        self.args = [
            PYTHON, "-m", "sidecar.cli", "serve", "--listen", f"tcp://127.0.0.1:{self.port}", "--listen", self.unix,
            "--origin", origin, "--cache-dir", str(self.cache), "--cache-size", cache_size, "--min-free", "0",
            "--retries", "1", *extra,
        ]
        if s3_endpoint:
            self.args += ["--s3-endpoint", s3_endpoint]
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Daemon:
        self.proc = spawn(self.args, self.log)
        try:
            wait_until(lambda: http_ok(self.url + "/readyz"), timeout=30, what="daemon readiness")
        except TimeoutError:
            raise AssertionError(f"daemon did not start: {self.log.read_text()[-3000:]}") from None
        return self

    def stop(self) -> None:
        if self.proc is not None:
            stop(self.proc)

    def kill9(self) -> None:
        if self.proc is not None:
            stop(self.proc, signal.SIGKILL)

    def get(self, path: str) -> Any:
        with urllib.request.urlopen(self.url + path, timeout=10) as resp:
            return json.loads(resp.read())

    def stats(self) -> dict[str, Any]:
        return self.get("/_shardcache/stats")

    def cached_keys(self) -> set[tuple[str, str]]:
        """(bucket, key) of every entry in the cache dir's published meta files."""
        found = set()
        for meta in (self.cache / "v1" / "meta").rglob("*.json"):
            doc = json.loads(meta.read_text())
            found.add((doc["bucket"], doc["key"]))
        return found


# The daemon app on a thread of this process, so the blocking-call guard watches its loop.
ThreadDaemon = DaemonThread
