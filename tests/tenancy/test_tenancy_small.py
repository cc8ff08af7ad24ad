"""The smaller tenancy items of issue 29 (item 6), each against real processes: the IAM-enforcing
endpoint, a node daemon with ``--auth sigv4`` and a sidecar per pod.

* warm-ups belong to the exact principal (an assumed role's session name included), so two
  namespaces that share a role neither see nor cancel each other's;
* ``cached?url=`` tells a caller the cache state only of objects it proved it may read, never of
  what it may only list;
* in ``access-key`` identity mode an identity proof made for one daemon opens no session at another;
* a node's per-job figures are each tenant's own (issue 32).
"""

from __future__ import annotations

import re
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from sidecar.daemon.auth.proofs import SESSION_PATH, Target, prove_identity
from sidecar.daemon.auth.sigv4 import Credentials, amz_date
from tests.support.tenancy import SHARD, A, IamS3, Node, add_user, start_serve, tenant_node
from tests.support.waits import wait_until


@pytest.fixture(scope="module")
def node(iam_s3: IamS3, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    # Two pods of two namespaces that share the role reader-a (IRSA's usual setup when a platform
    # team hands one role to several teams), each with its own session name, as botocore gives.
    ns_a, ns_b = iam_s3.assume_reader_a("ns-a-pod"), iam_s3.assume_reader_a("ns-b-pod")
    # May list tenant-a but read none of it.
    lister = add_user(iam_s3, "lister", {"Effect": "Allow", "Action": "s3:ListBucket", "Resource": f"arn:aws:s3:::{A}"})
    pods = {"ns-a": ns_a, "ns-b": ns_b, "alice": "alice", "lister": lister}
    yield from tenant_node(tmp_path_factory.mktemp("small"), iam_s3, [], pods)


def test_warmups_of_one_role_are_per_session(node: Node) -> None:
    a, b = node.sidecars["ns-a"], node.sidecars["ns-b"]
    status, job = a.json("POST", "/_shardcache/warmups", {"id": "shared-role", "objects": [{"bucket": A, "key": SHARD}]})
    assert status == 201, job
    wait_until(lambda: a.json("GET", "/_shardcache/warmups/shared-role")[1]["state"] != "running", timeout=30,
               what="ns-a's warm-up")
    final = a.json("GET", "/_shardcache/warmups/shared-role")[1]
    assert final["state"] == "done", final
    # ns-b is the same role with another session name: not the owner.
    assert b.json("GET", "/_shardcache/warmups/shared-role")[0] == 404
    assert b.json("DELETE", "/_shardcache/warmups/shared-role")[0] == 404
    assert "shared-role" not in [j["id"] for j in b.json("GET", "/_shardcache/warmups")[1]["warmups"]]
    # ns-a still sees its own, and its id space is its own: ns-b may use the same id.
    assert "shared-role" in [j["id"] for j in a.json("GET", "/_shardcache/warmups")[1]["warmups"]]
    status, other = b.json("POST", "/_shardcache/warmups", {"id": "shared-role", "objects": [{"bucket": A, "key": SHARD}]})
    assert status == 201, other
    assert a.json("GET", "/_shardcache/warmups/shared-role")[0] == 200


def _list_requests(node: Node) -> float:
    with urllib.request.urlopen(node.daemon.url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    found = re.search(r'^shardcache_origin_request_duration_seconds_count\{op="list"\} (\S+)$', text, re.M)
    return float(found.group(1)) if found else 0.0


def test_cached_tells_only_what_the_caller_may_read(node: Node, iam_s3: IamS3) -> None:
    alice, lister = node.sidecars["alice"], node.sidecars["lister"]
    assert alice.client().get_object(Bucket=A, Key=SHARD)["Body"].read() == iam_s3.objects[(A, SHARD)]
    wait_until(lambda: alice.json("GET", "/_shardcache/stats")[1]["fills_in_flight"] == 0, what="alice's fill")
    before = _list_requests(node)
    status, answer = alice.json("GET", f"/_shardcache/cached?url=s3://{A}/train/")
    assert status == 200 and answer["cached"] >= 1, answer
    # The listing is an origin request like any other: timed in the origin-latency histogram.
    assert _list_requests(node) > before

    # The lister may list tenant-a, so it learns the keys and their sizes (as from S3), but not
    # which of them someone on this node read: no object is counted cached or missing for it.
    for url in (f"s3://{A}/train/", f"s3://{A}/{SHARD}"):
        status, answer = lister.json("GET", "/_shardcache/cached?url=" + url)
        assert status == 200, answer
        assert answer["objects"] >= 1 and answer["cached"] == 0 and answer["cached_bytes"] == 0, answer
        assert answer["missing"] == [] and answer["unproven"] == answer["objects"], answer
    # The lister cannot read the object either: the cache answers it as the origin would.
    status, _, _ = lister.raw("GET", f"/{A}/{SHARD}")
    assert status == 403


@pytest.mark.slow
def test_access_key_identity_proofs_are_for_one_daemon(iam_s3: IamS3, tmp_path: Path) -> None:
    args = ["--s3-endpoint", iam_s3.endpoint, "--auth", "sigv4", "--auth-identity", "access-key"]
    first = start_serve(tmp_path, "first", args, iam_s3.env("node"))
    try:
        second = start_serve(tmp_path, "second", args, iam_s3.env("node"))
        try:
            alice = Credentials(*iam_s3.users["alice"])
            targets = [Target.from_json(d.json("GET", "/_shardcache/auth")[1]) for d in (first, second)]
            assert targets[0].audience != targets[1].audience
            for_first = prove_identity(alice, targets[0], amz_date())
            # Captured at the first daemon (a hostile pod on that node, a log), replayed at the second.
            status, answer = second.json("POST", SESSION_PATH, for_first)
            assert status == 403, answer
            assert first.json("POST", SESSION_PATH, for_first)[0] == 201
            assert second.json("POST", SESSION_PATH, prove_identity(alice, targets[1], amz_date()))[0] == 201
        finally:
            second.stop()
    finally:
        first.stop()


def test_a_newer_sidecar_signs_what_an_older_daemon_replays() -> None:
    """A daemon before issue 29 publishes no ``object_proof`` (read as HEAD) and rebuilds
    ListBuckets without the audience; every daemon since asks for it."""
    from sidecar.daemon.auth.proofs import AUDIENCE_HEADER, identity_request

    new = Target("http://s3.local", "us-east-1", "path", "http://s3.local", "us-east-1", "aud-1", "access-key")
    assert identity_request(new, amz_date(), None)[2][AUDIENCE_HEADER] == "aud-1"
    old = Target.from_json({k: v for k, v in new.to_json().items() if k != "object_proof"})
    assert AUDIENCE_HEADER not in identity_request(old, amz_date(), None)[2]


def test_member_indexes_only_for_who_may_read_the_shard(node: Node, iam_s3: IamS3) -> None:
    """The daemon's member index of a cached shard tells its samples' names and sizes: only a
    caller that may read the object gets it (as its GET), never one that may only list."""
    alice, lister = node.sidecars["alice"], node.sidecars["lister"]
    assert alice.client().get_object(Bucket=A, Key=SHARD)["Body"].read() == iam_s3.objects[(A, SHARD)]
    wait_until(lambda: alice.json("GET", "/_shardcache/stats")[1]["fills_in_flight"] == 0, what="alice's fill")
    path = f"/_shardcache/members?bucket={A}&key={SHARD}"
    status, body, _ = alice.raw("GET", path)
    assert status == 200 and b"shardcache-members-v1" in body, body[:300]
    status, body, _ = lister.raw("GET", path)
    assert status == 403 and b"shardcache-members-v1" not in body, body[:300]
    status, body, _ = node.daemon.raw("GET", path)  # no session at all
    assert status == 403 and b"shardcache-members-v1" not in body, body[:300]


def test_job_figures_are_each_tenants_own(node: Node, iam_s3: IamS3) -> None:
    """Under ``--auth`` a job's name is its tenant's to know, and its figures its own readers':
    two tenants that name the same job count apart; ``/stats`` shows a caller only its tenant's
    jobs (none without a session), and ``/metrics``, which any pod on the node may scrape, no job."""
    alice, ns_a, lister = node.sidecars["alice"], node.sidecars["ns-a"], node.sidecars["lister"]
    size = len(iam_s3.objects[(A, SHARD)])
    path = f"/{A}/{SHARD}"
    assert alice.raw("GET", path, {"x-shardcache-job": "train-x"})[0] == 200
    wait_until(lambda: alice.json("GET", "/_shardcache/stats")[1]["fills_in_flight"] == 0, what="alice's fill")
    for _ in range(2):  # the other tenant (the role reader-a) names the same job, and alice's own
        assert ns_a.raw("GET", path, {"x-shardcache-job": "train-x"})[0] == 200
        assert ns_a.raw("GET", path, {"x-shardcache-job": "own-job"})[0] == 200
    # A caller that may not read the object counts nothing for the job it names.
    assert lister.raw("GET", path, {"x-shardcache-job": "train-x"})[0] == 403

    jobs = alice.json("GET", "/_shardcache/stats")[1]["jobs"]
    assert set(jobs) == {"train-x"}, jobs
    assert jobs["train-x"]["reads"] == 1
    assert jobs["train-x"]["hit_bytes"] + jobs["train-x"]["origin_bytes"] == size
    theirs = ns_a.json("GET", "/_shardcache/stats")[1]["jobs"]
    assert set(theirs) == {"train-x", "own-job"}, theirs
    assert theirs["train-x"]["reads"] == 2 and theirs["train-x"]["hit_bytes"] == 2 * size
    assert lister.json("GET", "/_shardcache/stats")[1]["jobs"] == {}
    assert node.daemon.json("GET", "/_shardcache/stats")[1]["jobs"] == {}  # no session
    with urllib.request.urlopen(node.daemon.url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    assert "own-job" not in text and "train-x" not in text
    assert "shardcache_jobs_folded_total" in text
