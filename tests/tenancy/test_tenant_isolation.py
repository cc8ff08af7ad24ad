"""Many tenants on one node daemon (``--auth sigv4``), none reading another's data.

Real processes throughout: an S3 endpoint enforcing IAM (moto, patched by tests/support/moto_sigv4.py so
that presigned requests, which the daemon's default HTTP client sends, work as on AWS), the node
daemon with the ``node`` user's credentials (which may read everything), and one sidecar per
tenant with that tenant's own credentials, talking to the daemon over its unix socket.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from botocore.exceptions import ClientError

from sidecar.daemon.auth.proofs import SESSION_PATH, Target, prove, prove_identity
from sidecar.daemon.auth.sigv4 import Credentials, amz_date
from tests.support.processes import PYTHON
from tests.support.tenancy import ACCOUNT, SHARD, A, B, IamS3, Node, Serve, tenant_node
from tests.support.waits import wait_until


@pytest.fixture(scope="module")
def node(iam_s3: IamS3, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    yield from tenant_node(tmp_path_factory.mktemp("tenancy"), iam_s3, [], {"alice": "alice", "bob": "bob"})


def _cached(node: Node) -> set[tuple[str, str]]:
    found = set()
    for meta in (node.daemon.cache / "v1" / "meta").rglob("*.json"):
        doc = json.loads(meta.read_text())
        found.add((doc["bucket"], doc["key"]))
    return found


def _settled(serve: Serve) -> bool:
    return bool(serve.json("GET", "/_shardcache/stats")[1]["fills_in_flight"] == 0)


def _code(exc: pytest.ExceptionInfo[ClientError]) -> str:
    return str(exc.value.response["Error"]["Code"])


def test_each_tenant_reads_its_own_and_not_the_others(node: Node, iam_s3: IamS3) -> None:
    alice, bob = node.sidecars["alice"].client(), node.sidecars["bob"].client()
    # bob first, while nothing is cached: refused, and nothing was fetched for him.
    with pytest.raises(ClientError) as denied:
        bob.get_object(Bucket=A, Key="train/shard-000001.tar")
    assert _code(denied) == "AccessDenied"
    assert (A, "train/shard-000001.tar") not in _cached(node)

    first = alice.get_object(Bucket=A, Key=SHARD)
    assert first["Body"].read() == iam_s3.objects[(A, SHARD)]
    wait_until(lambda: (A, SHARD) in _cached(node), timeout=20, what="alice's read cached")
    again = alice.get_object(Bucket=A, Key=SHARD)
    assert again["Body"].read() == iam_s3.objects[(A, SHARD)]
    assert again["ResponseMetadata"]["HTTPHeaders"]["x-shardcache-cache"] == "hit"

    # Cached now: still refused to bob, for a GET, a ranged GET and a HEAD.
    for call in (lambda: bob.get_object(Bucket=A, Key=SHARD), lambda: bob.get_object(Bucket=A, Key=SHARD, Range="bytes=0-9")):
        with pytest.raises(ClientError) as denied:
            call()
        assert _code(denied) == "AccessDenied"
    with pytest.raises(ClientError) as denied:
        bob.head_object(Bucket=A, Key=SHARD)
    assert denied.value.response["ResponseMetadata"]["HTTPStatusCode"] == 403

    assert bob.get_object(Bucket=B, Key=SHARD)["Body"].read() == iam_s3.objects[(B, SHARD)]
    # The odd keys: a 0-byte object and spaces + unicode.
    assert alice.get_object(Bucket=A, Key="train/empty.bin")["Body"].read() == b""
    assert alice.get_object(Bucket=A, Key="train/a b é.tar")["Body"].read() == iam_s3.objects[(A, "train/a b é.tar")]
    with pytest.raises(ClientError) as denied:
        bob.get_object(Bucket=A, Key="train/a b é.tar")
    assert _code(denied) == "AccessDenied"
    # No path answers with tenants: whoever shares the cache directory could open any of them.
    status, body, headers = node.sidecars["alice"].raw("GET", f"/{A}/{SHARD}", {"x-shardcache-short-circuit": "1"})
    assert status == 200 and body == iam_s3.objects[(A, SHARD)] and "x-shardcache-path" not in headers


def test_listing_is_per_tenant(node: Node) -> None:
    alice, bob = node.sidecars["alice"].client(), node.sidecars["bob"].client()
    keys = [o["Key"] for o in alice.list_objects_v2(Bucket=A, Prefix="train/")["Contents"]]
    assert SHARD in keys
    for call in (lambda: bob.list_objects_v2(Bucket=A, Prefix="train/"), lambda: bob.list_objects(Bucket=A),
                 lambda: bob.head_bucket(Bucket=A)):
        with pytest.raises(ClientError) as denied:
            call()
        assert denied.value.response["ResponseMetadata"]["HTTPStatusCode"] == 403
    assert bob.list_objects_v2(Bucket=B)["KeyCount"] > 0
    status, _ = node.sidecars["bob"].json("GET", f"/_shardcache/cached?url=s3://{A}/train/")
    assert status == 403
    status, answer = node.sidecars["alice"].json("GET", f"/_shardcache/cached?url=s3://{A}/train/")
    assert status == 200 and answer["cached"] >= 1


def test_no_proof_or_a_forged_one_is_refused(node: Node, iam_s3: IamS3) -> None:
    daemon = node.daemon
    status, body, headers = daemon.raw("GET", f"/{A}/{SHARD}")
    assert status == 403 and b"<Code>AccessDenied</Code>" in body and b"sidecar" in body
    assert headers.get("x-shardcache-auth") == "renew"
    status, body, _ = daemon.raw("GET", f"/{A}/{SHARD}", {"x-shardcache-session": "forged-token"})
    assert status == 403 and b"AccessDenied" in body
    # A real session of bob's, with a proof alice signed: the proof is not bob's.
    target = Target.from_json(daemon.json("GET", "/_shardcache/auth")[1])
    bob_creds, alice_creds = Credentials(*iam_s3.users["bob"]), Credentials(*iam_s3.users["alice"])
    status, session = daemon.json("POST", SESSION_PATH, prove_identity(bob_creds, target, amz_date()))
    assert status == 201 and session["tenant"] == f"arn:aws:iam::{ACCOUNT}:user/bob"
    stolen = prove(alice_creds, target, amz_date(), A, "train/shard-000002.tar").to_header()
    status, body, _ = daemon.raw("GET", f"/{A}/train/shard-000002.tar",
                                 {"x-shardcache-session": session["session"], "x-shardcache-proof": stolen})
    assert status == 403
    # bob's own proof for alice's object: the origin refuses it.
    own = prove(bob_creds, target, amz_date(), A, "train/shard-000002.tar").to_header()
    status, body, _ = daemon.raw("GET", f"/{A}/train/shard-000002.tar",
                                 {"x-shardcache-session": session["session"], "x-shardcache-proof": own})
    assert status == 403 and b"AccessDenied" in body
    # A wrong secret cannot open a session: STS refuses the signature.
    status, answer = daemon.json("POST", SESSION_PATH, prove_identity(Credentials(bob_creds.access_key, "wrong"), target, amz_date()))
    assert status == 403 and answer["error"] == "AccessDenied"
    # Hostile proofs: answered 403 (or 400), never a 500.
    for value in ("", "a;b;c", "x" * 600, "AKIA0000000000000000/20261201/us-east-1/s3/aws4_request;20261201T000000Z;" + "g" * 64,
                  "AKIA0000000000000000/20261201/eu-west-9/s3/aws4_request;20261201T000000Z;" + "0" * 64, "\u00e9;\u00e9;\u00e9"):
        status, _, _ = daemon.raw("GET", f"/{A}/train/shard-000003.tar",
                                  {"x-shardcache-session": session["session"], "x-shardcache-proof": value.encode("utf-8").decode("latin-1")})
        assert status in (400, 403), value
    for body in ({}, {"proof": 1}, {"proof": "x;y;z"}, {"proof": "a" * 10_000}, {"proof": stolen, "security_token": 5}, []):
        status, _ = daemon.json("POST", SESSION_PATH, body)
        assert status in (400, 403), body
    # Bodies that name objects, sent around the sidecar with bob's session: refused, never a 500.
    auth = {"x-shardcache-session": session["session"]}
    uncached = "train/shard-000003.tar"  # of bob's: nothing read it yet, so a prefetch counts
    objects = [{"bucket": B, "key": uncached}]
    date = amz_date()
    good = prove(bob_creds, target, date, B, uncached)
    for proofs in (None, "x", {"credential": good.credential, "date": date, "signatures": ""},
                   {"credential": good.credential, "date": date, "signatures": "z" * 64},
                   {"credential": good.credential, "date": "20200101T000000Z", "signatures": good.signature},
                   {"credential": "AKIA/x", "date": date, "signatures": good.signature}):
        body: dict[str, Any] = {"objects": objects} if proofs is None else {"objects": objects, "proofs": proofs}
        for path in ("/_shardcache/prefetch", "/_shardcache/warmups"):
            status, answer = daemon.json("POST", path, body, auth)
            assert status in (202, 400, 403), (path, proofs, status, answer)
            if status == 202:
                assert answer["accepted"] == 0, answer
    status, answer = daemon.json("POST", "/_shardcache/prefetch", {"objects": objects, "proofs": {
        "credential": good.credential, "date": date, "signatures": good.signature}}, auth)
    assert status == 202 and answer["accepted"] == 1, answer
    assert (A, "train/shard-000002.tar") not in _cached(node) and (A, "train/shard-000003.tar") not in _cached(node)


def test_prefetch_and_warmups_only_for_what_the_tenant_proved(node: Node, iam_s3: IamS3) -> None:
    alice, bob = node.sidecars["alice"], node.sidecars["bob"]
    status, answer = bob.json("POST", "/_shardcache/prefetch", {"objects": [{"bucket": A, "key": "train/shard-000003.tar"}]})
    assert status == 202 and answer["accepted"] == 0 and answer["refused"] == 1
    status, answer = alice.json("POST", "/_shardcache/prefetch", {"objects": [{"bucket": A, "key": "train/shard-000003.tar"}]})
    assert status == 202 and answer["accepted"] == 1 and "refused" not in answer
    wait_until(lambda: (A, "train/shard-000003.tar") in _cached(node), timeout=20, what="alice's prefetch cached")

    # bob's warm-up of alice's objects fails object by object, and fetches nothing.
    status, job = bob.json("POST", "/_shardcache/warmups", {"id": "steal", "objects": [{"bucket": A, "key": "train/shard-000002.tar"}]})
    assert status == 201

    def finished(sidecar: Any, ident: str) -> dict[str, Any]:
        answer: dict[str, Any] = {}

        def done() -> bool:
            nonlocal answer
            answer = sidecar.json("GET", f"/_shardcache/warmups/{ident}")[1]
            return answer["state"] != "running"
        wait_until(done, timeout=30, what=f"warm-up {ident}")
        return answer

    stolen = finished(bob, "steal")
    assert stolen["state"] == "failed" and "access refused" in json.dumps(stolen)
    assert (A, "train/shard-000002.tar") not in _cached(node)

    # alice warms her dataset with the CLI, through her sidecar as a pod would.
    env = {**iam_s3.env("alice"), "AWS_ENDPOINT_URL": alice.url, "AWS_ENDPOINT_URL_S3": alice.url}
    import subprocess

    done = subprocess.run([PYTHON, "-m", "sidecar.cli", "warmup", f"s3://{A}/train/", "--daemon", alice.url, "--json", "--id", "mine"],
                          env={**os.environ, **env}, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert (A, "train/shard-000002.tar") in _cached(node)
    # bob neither sees nor cancels alice's warm-up; his own id space is his.
    assert bob.json("GET", "/_shardcache/warmups/mine")[0] == 404
    assert bob.json("DELETE", "/_shardcache/warmups/mine")[0] == 404
    assert "mine" not in [j["id"] for j in bob.json("GET", "/_shardcache/warmups")[1]["warmups"]]
    assert "mine" in [j["id"] for j in alice.json("GET", "/_shardcache/warmups")[1]["warmups"]]
    # Without a session nobody lists warm-ups.
    assert node.daemon.json("GET", "/_shardcache/warmups")[0] == 403


def test_stats_show_each_tenant_only_its_own(node: Node) -> None:
    status, alice = node.sidecars["alice"].json("GET", "/_shardcache/stats")
    assert status == 200 and alice["tenant"]["tenant"] == f"arn:aws:iam::{ACCOUNT}:user/alice"
    assert alice["tenant"]["used_bytes"] > 0 and alice["auth"]["mode"] == "sigv4"
    status, anyone = node.daemon.json("GET", "/_shardcache/stats")
    assert status == 200 and "tenant" not in anyone and "alice" not in json.dumps(anyone)


@pytest.mark.slow
def test_temporary_credentials_are_the_role(iam_s3: IamS3, tmp_path: Path) -> None:
    role = iam_s3.assume_reader_a("pod-1")
    for node in tenant_node(tmp_path, iam_s3, [], {"pod": role}):
        client = node.sidecars["pod"].client()
        assert client.get_object(Bucket=A, Key=SHARD)["Body"].read() == iam_s3.objects[(A, SHARD)]
        with pytest.raises(ClientError):
            client.get_object(Bucket=B, Key=SHARD)
        stats = node.sidecars["pod"].json("GET", "/_shardcache/stats")[1]
        # The role, not the session: stable across IRSA's key rotation.
        assert stats["tenant"]["tenant"] == f"arn:aws:iam::{ACCOUNT}:role/reader-a"


@pytest.mark.slow
def test_access_key_identity(iam_s3: IamS3, tmp_path: Path) -> None:
    for node in tenant_node(tmp_path, iam_s3, ["--auth-identity", "access-key"], {"alice": "alice"}):
        client = node.sidecars["alice"].client()
        assert client.get_object(Bucket=A, Key=SHARD)["Body"].read() == iam_s3.objects[(A, SHARD)]
        with pytest.raises(ClientError):
            client.get_object(Bucket=B, Key=SHARD)
        stats = node.sidecars["alice"].json("GET", "/_shardcache/stats")[1]
        assert stats["tenant"]["tenant"] == f"key:{iam_s3.users['alice'][0]}"
        target = Target.from_json(node.daemon.json("GET", "/_shardcache/auth")[1])
        forged = prove_identity(Credentials(iam_s3.users["alice"][0], "wrong"), target, amz_date())
        assert node.daemon.json("POST", SESSION_PATH, forged)[0] == 403


@pytest.mark.slow
def test_tenant_quota_evicts_the_tenants_own_entries_first(iam_s3: IamS3, tmp_path: Path) -> None:
    sizes = [len(iam_s3.objects[(A, f"train/shard-{i:06d}.tar")]) for i in range(4)]
    quota = sizes[0] + sizes[1] + sizes[2] // 2  # two of alice's shards fit, not three
    for node in tenant_node(tmp_path, iam_s3, ["--tenant-quota", str(quota)], {"alice": "alice", "bob": "bob"}):
        alice, bob = node.sidecars["alice"].client(), node.sidecars["bob"].client()
        bob.get_object(Bucket=B, Key=SHARD)["Body"].read()
        for i in range(4):
            alice.get_object(Bucket=A, Key=f"train/shard-{i:06d}.tar")["Body"].read()
            # Published (and counted against the quota) before the next: a reader can finish first.
            wait_until(functools.partial(_settled, node.daemon), what="the fill to publish")
        cached = _cached(node)
        assert (B, SHARD) in cached  # bob's entry is not alice's to evict
        assert {(A, "train/shard-000002.tar"), (A, "train/shard-000003.tar")} <= cached
        assert (A, SHARD) not in cached
        stats = node.sidecars["alice"].json("GET", "/_shardcache/stats")[1]
        assert stats["tenant"]["used_bytes"] <= quota
        assert stats["cache"]["tenants"]["quota_evictions"] >= 2


@pytest.mark.slow
def test_a_restarted_daemon_gets_a_new_session_unnoticed(iam_s3: IamS3, tmp_path: Path) -> None:
    """Sessions live in the daemon's memory: after a kill -9 and a restart the sidecar's session is
    unknown, the daemon says so (x-shardcache-auth: renew) and the sidecar opens a new one."""
    for node in tenant_node(tmp_path, iam_s3, [], {"alice": "alice"}):
        client = node.sidecars["alice"].client()
        assert client.get_object(Bucket=A, Key=SHARD)["Body"].read() == iam_s3.objects[(A, SHARD)]
        node.daemon.kill9()
        node.daemon.start()  # the same command, environment (the node's credentials) and cache
        got = client.get_object(Bucket=A, Key=SHARD)
        assert got["Body"].read() == iam_s3.objects[(A, SHARD)]
        assert got["ResponseMetadata"]["HTTPHeaders"].get("x-shardcache-via") == "upstream"
        assert node.daemon.json("GET", "/_shardcache/stats")[1]["auth"]["sessions"] == 1


@pytest.mark.slow
def test_a_sidecar_without_credentials(iam_s3: IamS3, tmp_path: Path) -> None:
    """Where the daemon checks nothing, a pod needs no credentials (as before --auth); where it
    does, the pod is told what is missing."""
    for node in tenant_node(tmp_path / "plain", iam_s3, [], {"pod": None}, auth="none"):
        assert node.sidecars["pod"].client().get_object(Bucket=A, Key=SHARD)["Body"].read() == iam_s3.objects[(A, SHARD)]
    for node in tenant_node(tmp_path / "auth", iam_s3, [], {"pod": None}):
        status, body, _ = node.sidecars["pod"].raw("GET", f"/{A}/{SHARD}")
        assert status == 403 and b"found none" in body, body
