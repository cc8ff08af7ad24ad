"""Utilities shared by the tests: free ports, waiting for servers, real processes."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_until(predicate: Callable[[], bool], timeout: float = 20.0, interval: float = 0.05, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if predicate():
                return
        except Exception:
            pass
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout}s waiting for {what}")


def http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return 200 <= resp.status < 300
    except Exception:
        return False


def wait_port(port: int, host: str = "127.0.0.1", timeout: float = 20.0) -> None:
    def connectable() -> bool:
        with socket.create_connection((host, port), timeout=1):
            return True

    wait_until(connectable, timeout=timeout, what=f"{host}:{port} to accept connections")


def spawn(args: Sequence[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    """Start a process in its own session, output to ``log`` (read it when a test fails)."""
    full_env = dict(os.environ)
    full_env.update(env or {})
    full_env.setdefault("PYTHONPATH", str(REPO))
    handle = open(log, "ab")
    return subprocess.Popen(
        list(args), stdout=handle, stderr=subprocess.STDOUT, env=full_env, cwd=str(REPO), start_new_session=True
    )


def stop(proc: subprocess.Popen[bytes], sig: int = signal.SIGTERM, timeout: float = 10.0) -> None:
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        return
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=timeout)


def kill9(proc: subprocess.Popen[bytes]) -> None:
    stop(proc, signal.SIGKILL)


PYTHON = sys.executable
