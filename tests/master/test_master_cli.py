"""``shardcache master`` as users run it: help with examples, one-line errors with what to do,
env-var defaults, a unix socket listener, and a client import that stays light."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from loader.master.client import MasterClient
from tests.support.masters import MasterProcess, job_spec
from tests.support.processes import PYTHON, REPO, free_port, spawn, stop
from tests.support.waits import wait_until


def run_cli(*args: str, env: dict[str, str] | None = None, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    import os

    return subprocess.run(
        [PYTHON, "-m", "sidecar.cli", *args], capture_output=True, text=True, timeout=timeout, cwd=str(REPO),
        env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})},
    )


def test_help_has_examples() -> None:
    result = run_cli("master", "--help")
    assert result.returncode == 0
    for text in ("--listen", "--state", "etcd://", "sqlite://", "examples:", "SHARDCACHE_STATE", "docs/master-api.md"):
        assert text in result.stdout


def test_bad_flags_are_one_clear_line(tmp_path: Path) -> None:
    result = run_cli("master", "--state", "mysql://nope")
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0 and "use sqlite:///path/to/master.db or etcd://" in result.stderr
    result = run_cli("master", "--listen", "http://0.0.0.0:80", "--state", f"sqlite://{tmp_path}/m.db")
    assert result.returncode == 2 and "invalid listen address" in result.stderr
    result = run_cli("master", "--lease-ttl", "soon", "--state", f"sqlite://{tmp_path}/m.db")
    assert result.returncode == 2 and "--lease-ttl" in result.stderr


def test_unusable_state_file_exits_unavailable(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    result = run_cli("master", "--listen", f"tcp://127.0.0.1:{free_port()}", "--state", f"sqlite://{tmp_path}/file/m.db")
    assert result.returncode == 69, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("shardcache master: error:") and "--state" in last


def test_second_master_on_the_same_file_is_refused(tmp_path: Path) -> None:
    state = f"sqlite://{tmp_path}/m.db"
    first = MasterProcess(tmp_path, state, name="m1", advertise=False).launch()  # the client waits for it
    try:
        client = MasterClient(first.url, retry_deadline_s=20)
        client.create_job(job_spec("solo", 2))
        result = run_cli("master", "--listen", f"tcp://127.0.0.1:{free_port()}", "--state", state)
        assert result.returncode == 69 and "another master is using" in result.stderr
        assert client.status("solo")["shards"]["total"] == 2
    finally:
        first.stop()


def test_env_defaults_and_unix_socket(tmp_path: Path) -> None:
    sock = tmp_path / "run" / "master.sock"
    env = {"SHARDCACHE_LISTEN": f"unix://{sock}", "SHARDCACHE_STATE": f"sqlite://{tmp_path}/m.db"}
    proc = spawn([PYTHON, "-m", "sidecar.cli", "master"], tmp_path / "m.log", env=env)
    try:
        wait_until(sock.exists, timeout=20, what="the unix socket")
        client = MasterClient(f"unix://{sock}", retry_deadline_s=20)
        assert client.create_job(job_spec("via-unix", 3))["shards"]["total"] == 3
        assert client.lease("via-unix", "t", "n", 2)["status"] == "ok"
    finally:
        stop(proc)
    assert proc.returncode == 0  # SIGTERM is a clean stop


def test_client_import_stays_light() -> None:
    code = (
        "import sys, json; import loader.master.client, loader.master; "
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('aiohttp', 'sqlite3', 'prometheus_client', 'torch', 'tensorflow', 'asyncio'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=str(REPO), check=True)
    assert json.loads(out.stdout) == []
