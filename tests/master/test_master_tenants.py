"""Jobs that belong to tenants (issue 29, item 1): ``shardcache master --tenant-tokens DIR`` as a
real process. Each file of the directory is one tenant's token (a mounted Secret: file name = the
tenant, a training namespace); ``--token-file`` stays the operator's, who sees everything.

Tenant B must not read, lease, complete, fail, release, renew, mark, rewind, report waits on or
delete tenant A's job, nor see it in the list, in ``/metrics`` or through the status page's API;
every refusal is 403 ``Forbidden`` (never a 500), and nothing of A's job changes. Ownership is
journaled: it survives a restart from the log and from a snapshot.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from loader import ShardLoader
from loader.master.client import MasterClient
from loader.master.errors import Forbidden
from tests.support.masters import MasterProcess, http, job_spec
from tests.support.shards import write_manifest, write_shards
from tests.support.waits import wait_until

OPERATOR = "operator-token-0123456789abcdef"
TOKENS = {"team-a": "tenant-a-token-0123456789abcdef", "team-b": "tenant-b-token-0123456789abcdef"}


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


A, B, OP = bearer(TOKENS["team-a"]), bearer(TOKENS["team-b"]), bearer(OPERATOR)


def write_tenants(directory: Path, tokens: dict[str, str]) -> None:
    """The directory as a Secret volume lays it out: the files are links into a ``..data`` folder
    swapped atomically on update."""
    directory.mkdir(exist_ok=True)
    stamp = f"..{len(list(directory.iterdir()))}"
    real = directory / stamp
    real.mkdir()
    for name, token in tokens.items():
        (real / name).write_text(token + "\n")
    tmp = directory / "..data_tmp"
    tmp.symlink_to(stamp)
    os.replace(tmp, directory / "..data")
    for name in tokens:
        link = directory / name
        if not link.is_symlink():
            link.symlink_to(f"..data/{name}")
    for link in directory.iterdir():
        if link.is_symlink() and not link.name.startswith("..") and link.name not in tokens:
            link.unlink()


@pytest.fixture
def master(tmp_path: Path) -> Iterator[tuple[str, MasterProcess, Path]]:
    (tmp_path / "operator").write_text(OPERATOR)
    tenants = tmp_path / "tenants"
    write_tenants(tenants, TOKENS)
    proc = MasterProcess(
        tmp_path, f"sqlite://{tmp_path / 'm.db'}", "--token-file", str(tmp_path / "operator"),
        "--tenant-tokens", str(tenants), "--snapshot-events", "50", name="m", advertise=False,
    )
    proc.start()
    try:
        yield proc.url, proc, tenants
    finally:
        proc.stop()


def _lease(url: str, job: str, headers: dict[str, str], trainer: str = "t0") -> list[dict]:
    status, body = http("POST", f"{url}/v1/jobs/{job}/leases", {"trainer": trainer, "node": "n0", "count": 2}, headers=headers)
    assert status == 200, body
    return body["leases"]


def test_another_tenant_can_neither_touch_nor_see_a_job(master: tuple[str, MasterProcess, Path]) -> None:
    url, _, _ = master
    status, body = http("POST", url + "/v1/jobs", job_spec("a-job", 6), headers=A)
    assert status == 201 and body["owner"] == "team-a", body
    leases = _lease(url, "a-job", A)
    lid = leases[0]["lease"]
    before = http("GET", url + "/v1/jobs/a-job", headers=A)[1]

    job = f"{url}/v1/jobs/a-job"
    refused = [
        ("GET", job, None),
        ("POST", job + "/leases", {"trainer": "evil", "node": "n0", "count": 4}),
        ("POST", f"{job}/leases/{lid}/renew", {"trainer": "t0", "offset": 1}),
        ("POST", f"{job}/leases/{lid}/complete", {"trainer": "t0"}),
        ("POST", f"{job}/leases/{lid}/fail", {"trainer": "t0", "error": "x"}),
        ("POST", f"{job}/leases/{lid}/release", {"trainer": "t0", "offset": 0}),
        ("POST", job + "/marks", {"trainer": "t0", "clock": 1, "positions": []}),
        ("POST", job + "/rewind", {"trainer": "t0", "mark": 0, "clock": 0}),
        ("POST", job + "/wait", {"trainer": "t0", "wait": {"seconds": 1.0, "steps": 1, "buckets": [1] + [0] * 15}}),
        ("DELETE", job + "?force=true", None),
        ("POST", url + "/v1/jobs", job_spec("a-job", 6)),  # joining it, with the very same spec
    ]
    for method, target, payload in refused:
        status, body = http(method, target, payload, headers=B)
        assert status == 403 and body["error"] == "Forbidden", (method, target, status, body)
        assert "team-a" not in body["message"], body  # the owner is not told to others
    # Unknown job and someone else's job differ only in the code: no 500 either way.
    assert http("GET", url + "/v1/jobs/nope", headers=B)[0] == 404

    after = http("GET", url + "/v1/jobs/a-job", headers=A)[1]
    assert after["shards"] == before["shards"] and after["totals"] == before["totals"], (before, after)
    # The owner goes on: its lease is still its own.
    assert http("POST", f"{job}/leases/{lid}/complete", {"trainer": "t0"}, headers=A)[0] == 200

    # Lists: each tenant its own jobs, the operator all of them.
    assert http("POST", url + "/v1/jobs", job_spec("b-job", 4), headers=B)[0] == 201
    assert [j["name"] for j in http("GET", url + "/v1/jobs", headers=A)[1]["jobs"]] == ["a-job"]
    assert [j["name"] for j in http("GET", url + "/v1/jobs", headers=B)[1]["jobs"]] == ["b-job"]
    assert [j["name"] for j in http("GET", url + "/v1/jobs", headers=OP)[1]["jobs"]] == ["a-job", "b-job"]
    assert http("GET", url + "/v1/jobs/a-job", headers=OP)[1]["owner"] == "team-a"

    # Metrics: the master's own series for anyone; per-job series only for the job's owner.
    anonymous = http("GET", url + "/metrics")[1]
    assert "shardcache_master_requests_total" in anonymous and 'job="' not in anonymous, anonymous[:2000]
    for headers, shown, hidden in ((A, "a-job", "b-job"), (B, "b-job", "a-job")):
        text = http("GET", url + "/metrics", headers=headers)[1]
        assert f'job="{shown}"' in text and f'job="{hidden}"' not in text
    everything = http("GET", url + "/metrics", headers=OP)[1]
    assert 'job="a-job"' in everything and 'job="b-job"' in everything
    # A wrong token at /metrics is no one's: it sees what an anonymous scrape sees.
    assert 'job="' not in http("GET", url + "/metrics", headers=bearer("wrong"))[1]

    # The operator may act on any job.
    assert http("DELETE", url + "/v1/jobs/b-job?force=true", headers=OP)[0] == 200


def test_the_client_says_forbidden_and_a_loader_of_another_tenant_stops(
    master: tuple[str, MasterProcess, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    url, _, _ = master
    written = write_shards(tmp_path / "root" / "b" / "ds", shards=3, per_shard=4)
    write_manifest(written)
    dataset = f"file://{tmp_path}/root/b/ds/"
    monkeypatch.setenv("SHARDCACHE_MASTER_TOKEN", TOKENS["team-a"])
    owned = list(ShardLoader(dataset, job="shared-name", master=url, epochs=1))
    assert len(owned) == written.total()
    client_b = MasterClient(url, token=TOKENS["team-b"], retry_deadline_s=0)
    with pytest.raises(Forbidden) as info:
        client_b.status("shared-name")
    assert isinstance(info.value, PermissionError) and "another tenant" in str(info.value)
    monkeypatch.setenv("SHARDCACHE_MASTER_TOKEN", TOKENS["team-b"])
    with pytest.raises(Forbidden):
        list(ShardLoader(dataset, job="shared-name", master=url, epochs=1))


def test_ownership_survives_a_restart_from_the_log_and_from_a_snapshot(master: tuple[str, MasterProcess, Path]) -> None:
    url, proc, _ = master
    assert http("POST", url + "/v1/jobs", job_spec("kept", 4), headers=A)[0] == 201
    proc.stop()
    proc.start()
    assert http("GET", url + "/v1/jobs/kept", headers=B)[0] == 403
    assert http("GET", url + "/v1/jobs/kept", headers=A)[1]["owner"] == "team-a"
    # Enough events for a snapshot (--snapshot-events 50), then a restart that reads it.
    for _ in range(30):
        for lease in _lease(url, "kept", A):
            assert http("POST", f"{url}/v1/jobs/kept/leases/{lease['lease']}/complete", {"trainer": "t0"}, headers=A)[0] == 200
    proc.stop()
    proc.start()
    assert http("GET", url + "/v1/jobs/kept", headers=B)[0] == 403
    assert http("GET", url + "/v1/jobs/kept", headers=A)[1]["owner"] == "team-a"


def test_tenant_tokens_are_reread_added_removed_and_rotated(master: tuple[str, MasterProcess, Path]) -> None:
    url, _, tenants = master
    assert http("GET", url + "/v1/jobs", headers=bearer("team-c-token-0123456789abcdef"))[0] == 401
    rotated = {"team-a": "tenant-a-rotated-0123456789abcd", "team-c": "team-c-token-0123456789abcdef"}
    write_tenants(tenants, rotated)  # team-b removed, team-a rotated, team-c added
    wait_until(lambda: http("GET", url + "/v1/jobs", headers=bearer(rotated["team-c"]))[0] == 200, timeout=10,
               what="the new tenant's token")
    assert http("GET", url + "/v1/jobs", headers=bearer(rotated["team-a"]))[0] == 200
    # A removed tenant is cut off at once; a rotated token keeps working for the grace period.
    assert http("GET", url + "/v1/jobs", headers=B)[0] == 401
    assert http("GET", url + "/v1/jobs", headers=A)[0] == 200


def test_a_bad_tenant_directory_is_refused_at_start(tmp_path: Path) -> None:
    import subprocess

    from tests.support.processes import PYTHON, REPO

    tenants = tmp_path / "t"
    tenants.mkdir()
    (tenants / "team-a").write_text(TOKENS["team-a"])
    (tenants / "team-b").write_text(TOKENS["team-a"])  # one token for two tenants: whose is it?
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for args, said in (
        (["--tenant-tokens", str(tmp_path / "missing")], "cannot read"),
        (["--tenant-tokens", str(tenants)], "same token"),
    ):
        out = subprocess.run([PYTHON, "-m", "sidecar.cli", "master", "--listen", "tcp://127.0.0.1:0",
                              "--state", f"sqlite://{tmp_path / 'x.db'}", *args],
                             capture_output=True, text=True, timeout=60, env=env)
        assert out.returncode != 0 and said in out.stderr, (args, out.stderr[-2000:])
