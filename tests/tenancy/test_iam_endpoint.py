"""The IAM-enforcing test endpoint answers as AWS would: each tenant reads its own bucket and gets
403 AccessDenied on the other's, by header signature and by presigned URL; bad signatures, unknown
keys, anonymous and expired requests are refused with AWS's codes; STS names the caller, user or
assumed role. Real boto3 clients sign; presigned URLs are fetched by a plain HTTP client (urllib)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
import urllib.error
import urllib.request
import uuid
from typing import Any

import pytest
from botocore.auth import SigV4QueryAuth
from botocore.awsrequest import AWSRequest
from botocore.credentials import Credentials
from botocore.exceptions import ClientError

from tests.support.processes import PYTHON

pytestmark = pytest.mark.timeout(60)

SHARD = "train/shard-000000.tar"
# (user, own bucket, the other tenant's bucket)
TENANCY = [("alice", "tenant-a", "tenant-b"), ("bob", "tenant-b", "tenant-a")]
# No proxy from the environment between the test and the loopback endpoint.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def fetch(url: str) -> tuple[int, bytes]:
    """GET ``url`` as it is (a presigned URL needs no signing client): status and body."""
    try:
        with _OPENER.open(url, timeout=10) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def refused(exc: pytest.ExceptionInfo[ClientError]) -> tuple[int, str]:
    error = exc.value.response
    return error["ResponseMetadata"]["HTTPStatusCode"], error["Error"]["Code"]


def keys_of(iam_s3: Any, bucket: str) -> list[str]:
    return sorted(k for b, k in iam_s3.objects if b == bucket)


@pytest.mark.parametrize(("user", "own", "other"), TENANCY)
def test_tenant_reads_own_bucket(iam_s3: Any, user: str, own: str, other: str) -> None:
    s3 = iam_s3.client(user)
    data = iam_s3.objects[(own, SHARD)]
    assert s3.get_object(Bucket=own, Key=SHARD)["Body"].read() == data

    ranged = s3.get_object(Bucket=own, Key=SHARD, Range="bytes=512-1535")
    assert ranged["ResponseMetadata"]["HTTPStatusCode"] == 206
    assert ranged["Body"].read() == data[512:1536]

    assert s3.head_object(Bucket=own, Key=SHARD)["ContentLength"] == len(data)
    # Prefix "train/" goes out as train%2F: stock moto refused every encoded query (bug 4).
    listed = s3.list_objects_v2(Bucket=own, Prefix="train/")
    assert sorted(o["Key"] for o in listed["Contents"]) == keys_of(iam_s3, own)

    status, body = fetch(s3.generate_presigned_url("get_object", Params={"Bucket": own, "Key": SHARD}, ExpiresIn=60))
    assert (status, body) == (200, data)
    status, body = fetch(s3.generate_presigned_url("list_objects_v2", Params={"Bucket": own, "Prefix": "train/"}, ExpiresIn=60))
    assert status == 200 and f"<Key>{SHARD}</Key>".encode() in body


@pytest.mark.parametrize(("user", "own", "other"), TENANCY)
def test_tenant_denied_other_bucket(iam_s3: Any, user: str, own: str, other: str) -> None:
    s3 = iam_s3.client(user)
    with pytest.raises(ClientError) as exc:
        s3.get_object(Bucket=other, Key=SHARD)
    assert refused(exc) == (403, "AccessDenied")
    with pytest.raises(ClientError) as exc:
        s3.list_objects_v2(Bucket=other, Prefix="train/")
    assert refused(exc) == (403, "AccessDenied")
    with pytest.raises(ClientError) as exc:
        s3.head_object(Bucket=other, Key=SHARD)
    assert refused(exc) == (403, "403")  # HEAD answers carry no body, so no code

    status, body = fetch(s3.generate_presigned_url("get_object", Params={"Bucket": other, "Key": SHARD}, ExpiresIn=60))
    assert status == 403 and b"<Code>AccessDenied</Code>" in body


def test_node_reads_every_tenant(iam_s3: Any) -> None:
    s3 = iam_s3.client("node")
    for bucket in ("tenant-a", "tenant-b"):
        assert s3.get_object(Bucket=bucket, Key=SHARD)["Body"].read() == iam_s3.objects[(bucket, SHARD)]
    assert iam_s3.objects[("tenant-a", SHARD)] != iam_s3.objects[("tenant-b", SHARD)]


def test_odd_and_empty_keys(iam_s3: Any) -> None:
    s3 = iam_s3.client("alice")
    data = iam_s3.objects[("tenant-a", iam_s3.ODD_KEY)]
    assert s3.get_object(Bucket="tenant-a", Key=iam_s3.ODD_KEY)["Body"].read() == data
    assert fetch(s3.generate_presigned_url("get_object", Params={"Bucket": "tenant-a", "Key": iam_s3.ODD_KEY}, ExpiresIn=60)) == (200, data)

    empty = s3.get_object(Bucket="tenant-a", Key=iam_s3.EMPTY_KEY)
    assert (empty["ContentLength"], empty["Body"].read()) == (0, b"")
    with pytest.raises(ClientError) as exc:
        iam_s3.client("bob").get_object(Bucket="tenant-a", Key=iam_s3.ODD_KEY)
    assert refused(exc) == (403, "AccessDenied")


def test_bad_credentials_refused(iam_s3: Any) -> None:
    akid, _ = iam_s3.users["alice"]
    with pytest.raises(ClientError) as exc:
        iam_s3.client((akid, "not-the-secret")).get_object(Bucket="tenant-a", Key=SHARD)
    assert refused(exc) == (403, "SignatureDoesNotMatch")
    with pytest.raises(ClientError) as exc:
        iam_s3.client(("AKIANOSUCHKEY0000000", "whatever")).get_object(Bucket="tenant-a", Key=SHARD)
    assert refused(exc) == (403, "InvalidAccessKeyId")
    # moto's administrator of the setup phase is refused too: IAM is enforced for everyone.
    with pytest.raises(ClientError) as exc:
        iam_s3.client(("testing", "testing")).get_object(Bucket="tenant-a", Key=SHARD)
    assert refused(exc) == (403, "InvalidAccessKeyId")
    # A presigned URL without one of its X-Amz-* parameters: 400, as S3 answers.
    url = iam_s3.client("alice").generate_presigned_url("get_object", Params={"Bucket": "tenant-a", "Key": SHARD}, ExpiresIn=60)
    status, body = fetch(re.sub(r"&X-Amz-Date=[^&]*", "", url))
    assert status == 400 and b"<Code>AuthorizationQueryParametersError</Code>" in body
    # Unsigned: AWS's 403 AccessDenied (stock moto: a 500 from a KeyError). An existing private
    # object is refused by moto's own ACL check first, with no body.
    assert fetch(f"{iam_s3.endpoint}/tenant-a/{SHARD}")[0] == 403
    status, body = fetch(f"{iam_s3.endpoint}/tenant-a?list-type=2")
    assert status == 403 and b"<Code>AccessDenied</Code>" in body


@pytest.mark.slow
def test_expired_presigned_url(iam_s3: Any) -> None:
    url = iam_s3.client("alice").generate_presigned_url("get_object", Params={"Bucket": "tenant-a", "Key": SHARD}, ExpiresIn=1)
    time.sleep(2)  # the URL expires on the real clock (the subject)
    status, body = fetch(url)
    assert status == 403 and b"<Code>AccessDenied</Code>" in body and b"Request has expired" in body


def presigned_caller_identity(iam_s3: Any, who: Any) -> str:
    """A presigned GetCallerIdentity signed by botocore's Python signer (the empty-body payload
    hash, as aws-iam-authenticator's Go SDK signs it); boto3's own presign goes through awscrt."""
    request = AWSRequest(method="GET", url=iam_s3.endpoint + "/", params={"Action": "GetCallerIdentity", "Version": "2011-06-15"})
    SigV4QueryAuth(Credentials(*iam_s3.creds(who)), "sts", iam_s3.region, expires=60).add_auth(request)
    return str(request.url)


@pytest.mark.parametrize("user", ["alice", "bob"])
def test_sts_names_the_user(iam_s3: Any, user: str) -> None:
    sts = iam_s3.client(user, "sts")
    assert sts.get_caller_identity()["Arn"] == iam_s3.arn(user)
    # Presigned, as a pod proves who it is: stock moto routed these to S3 and 500'd (bugs 1-3).
    # HttpMethod GET: botocore signs a query-protocol call as a POST otherwise, which fails as a GET.
    for url in (sts.generate_presigned_url("get_caller_identity", ExpiresIn=60, HttpMethod="GET"), presigned_caller_identity(iam_s3, user)):
        status, body = fetch(url)
        assert status == 200 and f"<Arn>{iam_s3.arn(user)}</Arn>".encode() in body
    # Another user's key id in the credential scope, this user's signature: refused.
    other = iam_s3.users["bob" if user == "alice" else "alice"][0]
    status, body = fetch(presigned_caller_identity(iam_s3, (other, iam_s3.users[user][1])))
    assert status == 403 and b"<Code>SignatureDoesNotMatch</Code>" in body


def test_assumed_role(iam_s3: Any) -> None:
    session = "pod-" + uuid.uuid4().hex[:8]
    creds = iam_s3.assume_reader_a(session)
    assert creds[0].startswith("ASIA") and creds[2]
    role_arn = f"arn:aws:sts::{iam_s3.account}:assumed-role/reader-a/{session}"
    assert iam_s3.client(creds, "sts").get_caller_identity()["Arn"] == role_arn
    status, body = fetch(presigned_caller_identity(iam_s3, creds))  # X-Amz-Security-Token in the query
    assert status == 200 and f"<Arn>{role_arn}</Arn>".encode() in body

    s3 = iam_s3.client(creds)
    assert s3.get_object(Bucket="tenant-a", Key=SHARD)["Body"].read() == iam_s3.objects[("tenant-a", SHARD)]
    assert fetch(s3.generate_presigned_url("get_object", Params={"Bucket": "tenant-a", "Key": SHARD}, ExpiresIn=60))[0] == 200
    with pytest.raises(ClientError) as exc:
        s3.get_object(Bucket="tenant-b", Key=SHARD)
    assert refused(exc) == (403, "AccessDenied")
    with pytest.raises(ClientError) as exc:  # the session token is part of the credentials
        iam_s3.client(creds[:2]).get_object(Bucket="tenant-a", Key=SHARD)
    assert refused(exc) == (403, "InvalidAccessKeyId")

    # The trust policy names alice only.
    with pytest.raises(ClientError) as exc:
        iam_s3.client("bob", "sts").assume_role(RoleArn=iam_s3.reader_a_arn, RoleSessionName="bob")
    assert refused(exc) == (403, "AccessDenied")


def test_env_selects_the_user_in_a_process(iam_s3: Any) -> None:
    """env() alone makes a child process act as that user: the session token tests/conftest.py
    exports, and any AWS config of this machine, do not leak in."""
    probe = (
        "import boto3, json; s = boto3.Session();"
        "print(json.dumps([boto3.client('sts').get_caller_identity()['Arn'], s.region_name,"
        " len(boto3.client('s3').list_objects_v2(Bucket='tenant-b')['Contents'])]))"
    )
    env = {**os.environ, **iam_s3.env("bob")}
    done = subprocess.run([PYTHON, "-c", probe], env=env, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == [iam_s3.arn("bob"), "us-east-1", len(keys_of(iam_s3, "tenant-b"))]


def test_launcher_default_mode_serves_as_moto(sigv4_s3: Any) -> None:
    """Without IAM enforced the patched server is stock moto for any client: any credentials,
    encoded keys, presigned URLs (SigV4 and SigV2), STS (presigned STS now reaches STS)."""
    odd = "train/a b é.tar"
    s3 = sigv4_s3.client(("testing", "testing"))
    s3.create_bucket(Bucket="plain")
    s3.put_object(Bucket="plain", Key=odd, Body=b"odd")
    assert s3.get_object(Bucket="plain", Key=odd)["Body"].read() == b"odd"
    assert [o["Key"] for o in s3.list_objects_v2(Bucket="plain", Prefix="train/")["Contents"]] == [odd]
    assert fetch(s3.generate_presigned_url("get_object", Params={"Bucket": "plain", "Key": odd})) == (200, b"odd")
    sigv2 = sigv4_s3.client(("anyone", "anything"))
    sigv2.meta.config.signature_version = "s3"
    assert fetch(sigv2.generate_presigned_url("get_object", Params={"Bucket": "plain", "Key": odd})) == (200, b"odd")

    sts = sigv4_s3.client(("testing", "testing"), "sts")
    arn = sts.get_caller_identity()["Arn"]
    status, body = fetch(sts.generate_presigned_url("get_caller_identity", ExpiresIn=60, HttpMethod="GET"))
    assert status == 200 and f"<Arn>{arn}</Arn>".encode() in body
