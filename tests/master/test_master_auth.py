"""``shardcache master --token-file``: a real master process that refuses every API call without
its bearer token (401, the usual JSON error), keeps the probes and metrics open, takes a rotated
token from the file without a restart, and serves trainers and ``shardcache status`` that send
``SHARDCACHE_MASTER_TOKEN``."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from loader import ShardLoader
from loader.master.client import MasterClient
from loader.master.errors import Unauthorized
from tests.support.masters import MasterProcess, http, job_spec
from tests.support.processes import PYTHON, REPO
from tests.support.shards import write_manifest, write_shards
from tests.support.waits import wait_until

TOKEN = "s3cret-token-0123456789abcdef"


@pytest.fixture
def guarded(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    master = MasterProcess(tmp_path, f"sqlite://{tmp_path / 'm.db'}", "--token-file", str(token_file), name="m", advertise=False)
    master.start("healthz")
    try:
        yield master.url, token_file
    finally:
        master.stop()


def test_calls_without_the_token_are_refused_and_the_probes_stay_open(guarded: tuple[str, Path]) -> None:
    url, _ = guarded
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {TOKEN}"}, {"Authorization": "Bearer"}):
        status, body = http("GET", url + "/v1/jobs", headers=headers)
        assert status == 401 and body["error"] == "Unauthorized" and "SHARDCACHE_MASTER_TOKEN" in body["message"], (headers, body)
        status, body = http("POST", url + "/v1/jobs", job_spec("j"), headers=headers)
        assert status == 401, body
    for path in ("/healthz", "/readyz", "/metrics"):
        assert http("GET", url + path)[0] == 200, path
    status, body = http("POST", url + "/v1/jobs", job_spec("j"), headers={"Authorization": f"Bearer {TOKEN}"})
    assert status == 201, body
    with pytest.raises(Unauthorized):
        MasterClient(url, retry_deadline_s=0, token="").status("j")
    assert MasterClient(url, token=TOKEN).status("j")["name"] == "j"


def test_a_rotated_token_is_taken_without_a_restart(guarded: tuple[str, Path]) -> None:
    url, token_file = guarded
    new = "rotated-token-fedcba9876543210"
    tmp = token_file.with_suffix(".new")
    tmp.write_text(new)
    os.replace(tmp, token_file)  # how a Secret volume updates: an atomic swap
    wait_until(lambda: http("GET", url + "/v1/jobs", headers={"Authorization": f"Bearer {new}"})[0] == 200, timeout=10, what="new token")
    # The old one keeps working for a grace period, so trainers that read the Secret later go on.
    assert http("GET", url + "/v1/jobs", headers={"Authorization": f"Bearer {TOKEN}"})[0] == 200


@pytest.mark.slow
def test_trainers_and_status_send_the_token_from_the_environment(guarded: tuple[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    url, _ = guarded
    written = write_shards(tmp_path / "root" / "b" / "ds", shards=3, per_shard=4)
    write_manifest(written)
    dataset = f"file://{tmp_path}/root/b/ds/"
    with pytest.raises(Unauthorized):
        list(ShardLoader(dataset, job="authjob", master=url, epochs=1))
    monkeypatch.setenv("SHARDCACHE_MASTER_TOKEN", TOKEN)
    assert len(list(ShardLoader(dataset, job="authjob", master=url, epochs=1))) == written.total()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    ok = subprocess.run([PYTHON, "-m", "sidecar.cli", "status", "--master", url, "--json"], capture_output=True, text=True, timeout=60, env=env)
    assert ok.returncode == 0 and "authjob" in ok.stdout, ok.stderr
    env.pop("SHARDCACHE_MASTER_TOKEN")
    refused = subprocess.run([PYTHON, "-m", "sidecar.cli", "status", "--master", url], capture_output=True, text=True, timeout=60, env=env)
    assert "token" in (refused.stdout + refused.stderr).lower(), (refused.stdout, refused.stderr)


def test_a_missing_or_empty_token_file_stops_the_start(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for content in (None, "  \n"):
        path = tmp_path / "token"
        if content is None:
            path.unlink(missing_ok=True)
        else:
            path.write_text(content)
        result = subprocess.run(
            MasterProcess(tmp_path, f"sqlite://{tmp_path / 'm.db'}", "--token-file", str(path), advertise=False).command(),
            capture_output=True, text=True, timeout=30, env=env,
        )
        assert result.returncode == 2 and "token file" in result.stderr and result.stderr.strip().count("\n") == 0, result.stderr
