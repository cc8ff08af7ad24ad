"""Real processes for the loader tests: the master and the daemon, started and waited for."""

from __future__ import annotations

from pathlib import Path

from tests.helpers import PYTHON, http_ok, spawn, stop, wait_until


def master_args(port: int, db: Path) -> list[str]:
    return [PYTHON, "-m", "sidecar.cli", "master", "--listen", f"tcp://127.0.0.1:{port}", "--state", f"sqlite://{db}"]


class Proc:
    def __init__(self, name: str, args: list[str], log: Path, ready_url: str, env: dict[str, str] | None = None) -> None:
        self.name, self.args, self.log, self.ready_url, self.env = name, args, log, ready_url, env
        self.proc = spawn(args, log, env=env)
        try:
            wait_until(lambda: http_ok(ready_url) or self.proc.poll() is not None, timeout=30, what=name)
        except TimeoutError:
            stop(self.proc)
            raise
        if self.proc.poll() is not None:
            raise RuntimeError(f"{name} exited with {self.proc.returncode}:\n{log.read_text()[-3000:]}")

    def stop(self) -> None:
        stop(self.proc)
