"""The CLI as the tests run it: ``python -m sidecar.cli`` plain, with pipes, or under a
pseudo-terminal, without the developer's ``SHARDCACHE_*`` settings."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import select
import signal
import struct
import subprocess
import termios
import time
from collections.abc import Callable
from typing import Any

from tests.support.processes import PYTHON, REPO

__all__ = ["read_json_lines", "run_cli", "run_pty", "start_cli"]


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


def _default_sigint() -> None:
    # A suite started as a background job (`cmd &` in a script) inherits SIGINT ignored, and a
    # Python started so keeps ignoring it (no KeyboardInterrupt): the tests that press Ctrl-C would
    # then see a CLI that never heard it. The CLI is given the terminal's default, as a user's is.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def start_cli(args: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    """The CLI with pipes, in its own session (signals reach only it), with SIGINT's default
    disposition whatever the suite's own is."""
    return subprocess.Popen(
        [PYTHON, "-m", "sidecar.cli", *args], env=_env(env), cwd=str(REPO), stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, start_new_session=True, preexec_fn=_default_sigint,
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
