"""The proofs' own SigV4 signer agrees with botocore's on every request it signs."""

from __future__ import annotations

import datetime as dt

import botocore.auth
import pytest
from botocore.auth import S3SigV4Auth, SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.credentials import Credentials as BotoCredentials

from sidecar.daemon.auth.proofs import (
    OBJECT_RANGE,
    STS_BODY,
    Target,
    identity_request,
    list_url,
    object_url,
    prove,
    prove_batch,
    prove_identity,
)
from sidecar.daemon.auth.sigv4 import Credentials, amz_date, canonical_host

AT = dt.datetime(2026, 12, 1, 17, 45, 0, tzinfo=dt.UTC)
KEYS = ["train/shard-000000.tar", "a b é.tar", "dir/x+y=z&w.tar", "~tilde/(paren)!*'.tar", "%41literal.tar", "日本/データ.tar"]
CREDS = [Credentials("AKIDEXAMPLE0000000", "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY"),
         Credentials("ASIAEXAMPLE0000000", "secret/with+chars", "FwoGZXIvYXdzEJr//////////token+/=")]


def _target(style: str = "path", endpoint: str = "http://127.0.0.1:5055", object_proof: str = "GET") -> Target:
    return Target(endpoint, "eu-west-1", style, endpoint, "eu-west-1", "aud123", object_proof=object_proof)


def _botocore(creds: Credentials, method: str, url: str, service: str, region: str,
              headers: dict[str, str] | None = None, body: bytes = b"") -> str:
    request = AWSRequest(method=method, url=url, headers=headers or {}, data=body)
    signer = (S3SigV4Auth if service == "s3" else SigV4Auth)(
        BotoCredentials(creds.access_key, creds.secret_key, creds.token), service, region)
    saved = botocore.auth.get_current_datetime
    botocore.auth.get_current_datetime = lambda: AT.replace(tzinfo=None)
    try:
        signer.add_auth(request)
    finally:
        botocore.auth.get_current_datetime = saved
    return request.headers["Authorization"].rsplit("Signature=", 1)[1]


@pytest.mark.parametrize("creds", CREDS, ids=["keys", "temporary"])
@pytest.mark.parametrize("key", KEYS)
def test_object_and_listing_proofs_match_botocore(creds: Credentials, key: str) -> None:
    target = _target()
    date = amz_date(AT)
    proof = prove(creds, target, date, "tenant-a", key)
    # A read of the first byte, the range signed (botocore signs every header it is given).
    url = object_url(target, "tenant-a", key)
    assert proof.signature == _botocore(creds, "GET", url, "s3", "eu-west-1", {"Range": OBJECT_RANGE})
    assert prove_batch(creds, target, date, [("tenant-a", key)]).signatures == proof.signature
    listing = prove(creds, target, date, "tenant-a", prefix=key)
    assert listing.signature == _botocore(creds, "GET", list_url(target, "tenant-a", key), "s3", "eu-west-1")
    # For a daemon older than GET proofs (it publishes no object_proof), the HEAD it replays.
    older = _target(object_proof="HEAD")
    assert prove(creds, older, date, "tenant-a", key).signature == _botocore(creds, "HEAD", url, "s3", "eu-west-1")


def test_virtual_hosted_urls() -> None:
    target = _target("virtual", "https://s3.eu-west-1.amazonaws.com")
    assert object_url(target, "tenant-a", "a b") == "https://tenant-a.s3.eu-west-1.amazonaws.com/a%20b"
    # Dots cannot go in a TLS host name the certificate covers, so path style (as botocore does).
    assert object_url(target, "my.bucket", "k") == "https://s3.eu-west-1.amazonaws.com/my.bucket/k"
    assert canonical_host("https://s3.amazonaws.com:443/x") == "s3.amazonaws.com"
    assert canonical_host("http://127.0.0.1:8080/x") == "127.0.0.1:8080"


@pytest.mark.parametrize("creds", CREDS, ids=["keys", "temporary"])
def test_identity_proof_matches_botocore(creds: Credentials) -> None:
    target = _target()
    date = amz_date(AT)
    body = prove_identity(creds, target, date)
    method, url, headers, payload = identity_request(target, date, creds.token)
    assert payload == STS_BODY and method == "POST"
    unsigned = {k: v for k, v in headers.items() if k not in ("host", "x-amz-date", "x-amz-security-token")}
    assert body["proof"].rsplit(";", 1)[1] == _botocore(creds, method, url, "sts", "eu-west-1", unsigned, payload)
    assert body["security_token"] == creds.token and body["object_proof"] == "GET"


@pytest.mark.parametrize("key", ["minioadmin", "testing", "AKIDEXAMPLE0000000"])
def test_proofs_of_any_store_key_parse(key: str) -> None:
    """MinIO's and moto's default key ids are not AWS-shaped, and still sign proofs."""
    from sidecar.daemon.auth.proofs import Proof

    proof = prove(Credentials(key, "secret"), _target(), amz_date(AT), "tenant-a", "k")
    assert Proof.from_header(proof.to_header()) == proof


@pytest.mark.parametrize("key", ["a/b", "a;b", "a b", "ab", "x" * 129])
def test_key_ids_that_would_break_the_header_are_refused(key: str) -> None:
    from sidecar.daemon.auth.proofs import InvalidProof, Proof

    with pytest.raises(InvalidProof, match="access key id"):
        Proof.parse(f"{key}/20261201/us-east-1/s3/aws4_request", "20261201T174500Z", "0" * 64)
