"""Real processes for the tests: started in their own session (so stopping one takes its
children), output to a log file, stopped with SIGTERM then SIGKILL; free loopback ports.

The mechanics are :mod:`bench.common`'s; a test's process keeps the test session's environment
(tests/conftest.py's AWS test credentials) instead of the benchmarks' credential pair."""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from bench.common import free_port, stop_process
from bench.common import spawn as _spawn

__all__ = ["PYTHON", "REPO", "free_port", "kill9", "spawn", "stop"]

REPO = Path(__file__).resolve().parents[2]
PYTHON = sys.executable


def spawn(args: Sequence[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    """Start a process in its own session, output to ``log`` (read it when a test fails)."""
    return _spawn(list(args), log, env, credentials={})


def stop(proc: subprocess.Popen[bytes], sig: int = signal.SIGTERM, timeout: float = 10.0) -> None:
    stop_process(proc, timeout=timeout, sig=sig)


def kill9(proc: subprocess.Popen[bytes]) -> None:
    stop(proc, signal.SIGKILL)
