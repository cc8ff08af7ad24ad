"""What ``--auth sigv4`` decides is for one credential, proves a read, and keeps per tenant.

With the IAM-enforcing endpoint (tests/support/moto_sigv4.py, which also enforces AssumeRole's
session policies and asks ``kms:Decrypt`` of a GET of an SSE-KMS object, not of a HEAD, as AWS
does): two sessions that STS names alike but that may read different things get their own
answers; a proof signed with other credentials than its session's is refused before anything is
shared; an object proof is a read, so a caller with ``s3:GetObject`` but no right on the object's
KMS key gets nothing through the daemon; one tenant opening sessions and asking for decisions by
the dozen drops only its own.
"""

from __future__ import annotations

import asyncio
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from botocore.exceptions import ClientError

from sidecar.daemon.auth.authorizer import Authorizer, AuthSettings, Session, _Owned
from sidecar.daemon.auth.proofs import SESSION_PATH, Target, prove, prove_identity
from sidecar.daemon.auth.sigv4 import Credentials, amz_date
from sidecar.errors import NotAuthorized
from tests.support.tenancy import ACCOUNT, EMPTY_KEY, SHARD, A, B, IamS3, Node, iam_lifted, tenant_node

pytestmark = pytest.mark.timeout(120)

OTHER = "train/shard-000001.tar"
SECRET = "kms/secret.bin"  # in tenant-a, SSE-KMS with a key alice has no right on
SECRET_BYTES = b"plaintext only for who may decrypt" * 8
# No proxy from the environment between the test and the loopback endpoint.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _only(key: str) -> dict[str, Any]:
    """A session policy that allows reading one object of tenant-a."""
    return {"Version": "2012-10-17", "Statement": [
        {"Effect": "Allow", "Action": "s3:GetObject", "Resource": f"arn:aws:s3:::{A}/{key}"}]}


@pytest.fixture(scope="module")
def kms_object(iam_s3: IamS3) -> str:
    """tenant-a/kms/secret.bin, encrypted with a KMS key that only the node daemon may use."""
    with iam_lifted(iam_s3) as admin:
        key_arn = admin("kms").create_key(Description="tenant-a's secrets")["KeyMetadata"]["Arn"]
        admin("s3").put_object(Bucket=A, Key=SECRET, Body=SECRET_BYTES, ServerSideEncryption="aws:kms", SSEKMSKeyId=key_arn)
        admin("iam").put_user_policy(UserName="node", PolicyName="kms", PolicyDocument=(
            '{"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "kms:Decrypt", "Resource": "*"}]}'))
    return key_arn


@pytest.fixture(scope="module")
def node(iam_s3: IamS3, kms_object: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    """A node daemon alone: the tests sign their own proofs, as a sidecar would."""
    yield from tenant_node(tmp_path_factory.mktemp("credentials"), iam_s3, [], {})


def _target(node: Node) -> Target:
    return Target.from_json(node.daemon.json("GET", "/_shardcache/auth")[1])


def _session(node: Node, creds: Credentials) -> dict[str, Any]:
    status, answer = node.daemon.json("POST", SESSION_PATH, prove_identity(creds, _target(node), amz_date()))
    assert status == 201, answer
    return answer


def _read(node: Node, session: dict[str, Any], key: str, proof: str | None) -> tuple[int, bytes]:
    headers = {"x-shardcache-session": session["session"]}
    if proof is not None:
        headers["x-shardcache-proof"] = proof
    status, body, _ = node.daemon.raw("GET", f"/{A}/{key}", headers)
    return status, body


def _replays(node: Node) -> int:
    return int(node.daemon.json("GET", "/_shardcache/stats")[1]["auth"]["replays"])


def test_sessions_of_one_role_with_different_session_policies_get_their_own_answers(node: Node, iam_s3: IamS3) -> None:
    wide = Credentials(*iam_s3.assume_reader_a("pod"))
    narrow = Credentials(*iam_s3.assume_reader_a("pod", policy=_only(OTHER)))
    # The endpoint enforces the session policy: narrow may read OTHER, not SHARD.
    with pytest.raises(ClientError):
        iam_s3.client((narrow.access_key, narrow.secret_key, narrow.token or "")).get_object(Bucket=A, Key=SHARD)
    target = _target(node)
    wide_session, narrow_session = _session(node, wide), _session(node, narrow)
    # STS names both alike: only their credentials tell them apart.
    assert wide_session["principal"] == narrow_session["principal"] == f"arn:aws:sts::{ACCOUNT}:assumed-role/reader-a/pod"

    status, body = _read(node, wide_session, SHARD, prove(wide, target, amz_date(), A, SHARD).to_header())
    assert (status, body) == (200, iam_s3.objects[(A, SHARD)])
    # wide's yes is not narrow's: without a proof it is refused, never served from wide's decision...
    replays = _replays(node)
    status, body = _read(node, narrow_session, SHARD, None)
    assert status == 403 and b"no proof" in body, body
    assert _replays(node) == replays
    # ...and with its own proof the origin is asked, and says no.
    status, body = _read(node, narrow_session, SHARD, prove(narrow, target, amz_date(), A, SHARD).to_header())
    assert status == 403 and b"AccessDenied" in body, body
    assert _replays(node) == replays + 1
    # The other way round: narrow's yes is not wide's either.
    status, body = _read(node, narrow_session, OTHER, prove(narrow, target, amz_date(), A, OTHER).to_header())
    assert (status, body) == (200, iam_s3.objects[(A, OTHER)])
    status, _ = _read(node, wide_session, OTHER, None)
    assert status == 403


def test_a_proof_signed_by_other_credentials_than_the_sessions_is_refused(node: Node, iam_s3: IamS3) -> None:
    wide = Credentials(*iam_s3.assume_reader_a("pod-2"))
    narrow = Credentials(*iam_s3.assume_reader_a("pod-2", policy=_only(OTHER)))
    target = _target(node)
    wide_session, narrow_session = _session(node, wide), _session(node, narrow)
    wide_proof = prove(wide, target, amz_date(), A, SHARD).to_header()
    assert _read(node, wide_session, SHARD, wide_proof)[0] == 200
    # narrow presenting wide's proof (same principal, a decision for it cached): refused, and says why.
    replays = _replays(node)
    status, body = _read(node, narrow_session, SHARD, wide_proof)
    assert status == 403 and b"access key" in body, body
    assert _replays(node) == replays


def test_an_object_proof_is_a_read_so_kms_decrypt_is_asked(node: Node, iam_s3: IamS3, kms_object: str) -> None:
    alice = Credentials(*iam_s3.users["alice"])
    # What the endpoint does, as AWS: alice may HEAD the SSE-KMS object, not GET it (no kms:Decrypt).
    s3 = iam_s3.client("alice")
    assert s3.head_object(Bucket=A, Key=SECRET)["ServerSideEncryption"] == "aws:kms"
    with pytest.raises(ClientError) as refused:
        s3.get_object(Bucket=A, Key=SECRET, Range="bytes=0-0")
    assert refused.value.response["Error"]["Code"] == "AccessDenied"
    # The node daemon may read it (its own kms:Decrypt): it must not do so for alice.
    assert iam_s3.client("node").get_object(Bucket=A, Key=SECRET)["Body"].read() == SECRET_BYTES
    session = _session(node, alice)
    status, body = _read(node, session, SECRET, prove(alice, _target(node), amz_date(), A, SECRET).to_header())
    assert status == 403 and SECRET_BYTES not in body, body
    # Her own objects still read, the empty one too: S3 (and moto) answer a range past the end
    # with 416 InvalidRange, which says the GET was allowed.
    with pytest.raises(ClientError) as empty:
        s3.get_object(Bucket=A, Key=EMPTY_KEY, Range="bytes=0-0")
    assert empty.value.response["Error"]["Code"] == "InvalidRange"
    status, body = _read(node, session, EMPTY_KEY, prove(alice, _target(node), amz_date(), A, EMPTY_KEY).to_header())
    assert (status, body) == (200, b"")


def test_a_sidecar_that_proves_reads_with_heads_is_told_to_upgrade(node: Node, iam_s3: IamS3) -> None:
    alice = Credentials(*iam_s3.users["alice"])
    target = _target(node)
    assert target.object_proof == "GET"
    # What a sidecar before this daemon sends: no object_proof. Refused before any replay, in words.
    replays = _replays(node)
    old = prove_identity(alice, target, amz_date())
    del old["object_proof"]
    status, answer = node.daemon.json("POST", SESSION_PATH, old)
    assert status == 403 and "Upgrade the sidecar" in answer["message"], answer
    assert _replays(node) == replays
    # A signed HEAD with a session anyway: the daemon replays a GET, and the signature does not fit.
    session = _session(node, alice)
    head = Target(target.s3_endpoint, target.region, target.addressing_style, target.sts_endpoint,
                  target.sts_region, target.audience, target.identity, "HEAD")
    status, body = _read(node, session, OTHER, prove(alice, head, amz_date(), A, OTHER).to_header())
    assert status == 403 and b"SignatureDoesNotMatch" in body, body
    # A sidecar of this version still signs HEADs for an older daemon (one that publishes no object_proof).
    described = node.daemon.json("GET", "/_shardcache/auth")[1]
    del described["object_proof"]
    assert Target.from_json(described).object_proof == "HEAD"
    with pytest.raises(ValueError, match="object_proof"):
        Target.from_json({**described, "object_proof": "PUT"})


# -- bounds per tenant --------------------------------------------------------------------------


def _replay_to(endpoint: str) -> Any:
    """An Authorizer's replay, as the daemon's origin sends it: the request as signed, to ``endpoint``."""

    def send(method: str, url: str, headers: dict[str, str], body: bytes) -> tuple[int, bytes]:
        assert url.startswith(endpoint.rstrip("/"))
        request = urllib.request.Request(url, data=body or None, method=method, headers=headers)
        try:
            with _OPENER.open(request, timeout=10) as resp:
                return resp.status, resp.read(64 * 1024)
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read(64 * 1024)

    async def replay(method: str, url: str, headers: dict[str, str], body: bytes) -> tuple[int, bytes]:
        return await asyncio.to_thread(send, method, url, headers, body)

    return replay


def test_one_tenants_flood_drops_only_its_own_sessions_and_decisions(iam_s3: IamS3) -> None:
    settings = AuthSettings(mode="sigv4", max_sessions=6, max_sessions_per_tenant=3, max_decisions=8,
                            max_decisions_per_tenant=4)

    async def run() -> None:
        auth = Authorizer(settings, _replay_to(iam_s3.endpoint), iam_s3.endpoint, iam_s3.region, "path")
        target = auth.target

        async def session(who: str) -> tuple[Session, Credentials]:
            creds = Credentials(*iam_s3.users[who])
            return await auth.open_session(prove_identity(creds, target, amz_date())), creds

        bob, bob_creds = await session("bob")
        for key in (SHARD, OTHER):
            await auth.authorize(bob, prove(bob_creds, target, amz_date(), B, key), B, key)
        # alice opens sessions and lists prefixes by the dozen; node (a third tenant) fills its share.
        alices = [await session("alice") for _ in range(8)]
        last, alice_creds = alices[-1]
        for index in range(10):
            prefix = f"train/{index}"
            await auth.authorize(last, prove(alice_creds, target, amz_date(), A, prefix=prefix), A, None, prefix)
        for _ in range(3):
            await session("node")
        node_session, node_creds = await session("node")
        for index in range(4):
            prefix = f"train/{index}"
            await auth.authorize(node_session, prove(node_creds, target, amz_date(), B, prefix=prefix), B, None, prefix)

        # bob's session and decisions are all there: no proof needed, no replay.
        assert auth.session(bob.token) == bob
        replays = auth.counts["replays"]
        for key in (SHARD, OTHER):
            assert auth.cached(bob, B, key) is True
            await auth.authorize(bob, None, B, key)
        assert auth.counts["replays"] == replays
        # alice's first sessions and listings were her own to lose; the bounds hold.
        with pytest.raises(NotAuthorized, match="unknown or expired session"):
            auth.session(alices[0][0].token)
        assert auth.session(last.token) == last
        assert auth.cached(last, A, None, "train/0") is None and auth.cached(last, A, None, "train/9") is True
        assert len(auth._sessions) <= 6 and len(auth._decisions) <= 8
        assert auth._sessions.held(last.tenant) <= 3 and auth._decisions.held(last.tenant) <= 4

    asyncio.run(run())


def test_the_global_bound_takes_from_the_tenant_holding_most() -> None:
    owned: _Owned[str, int] = _Owned(per_owner=4, total=6)
    owned.put("small", "s1", 1)
    for index in range(4):
        owned.put("big", f"b{index}", index)
    owned.put("mid", "m1", 1)
    owned.put("mid", "m2", 2)  # 7 > 6: big (4) gives up its oldest
    assert len(owned) == 6 and owned.get("b0") is None and owned.get("b1") == 1
    assert owned.get("s1") == 1 and owned.held("big") == 3
    owned.pop("small", "s1")
    assert owned.held("small") == 0 and owned.get("s1") is None
    with pytest.raises(ValueError, match="max_sessions_per_tenant"):
        AuthSettings(mode="sigv4", max_sessions=2, max_sessions_per_tenant=3)
