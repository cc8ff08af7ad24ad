"""wire.s3errors: one classification of S3 error answers, from botocore's ClientError (duck-typed)
and from raw HTTP answers."""

from __future__ import annotations

from typing import Any

import pytest

from wire.s3errors import TRANSIENT, S3ErrorKind, classify, from_client_error, from_http
from wire.s3xml import error_xml

K = S3ErrorKind


@pytest.mark.parametrize(
    ("status", "code", "kind"),
    [
        (404, "NoSuchBucket", K.NOT_FOUND_BUCKET),
        (404, "NoSuchKey", K.NOT_FOUND_KEY),
        (404, "", K.NOT_FOUND_KEY),  # a HEAD: no body, so no code
        (404, "404", K.NOT_FOUND_KEY),  # botocore's code for a bodiless 404
        (403, "AccessDenied", K.ACCESS_DENIED),
        (403, "", K.ACCESS_DENIED),
        (403, "SignatureDoesNotMatch", K.ACCESS_DENIED),
        (400, "ExpiredToken", K.ACCESS_DENIED),  # refused credentials, though S3 answers 400
        (416, "InvalidRange", K.INVALID_RANGE),
        (412, "PreconditionFailed", K.PRECONDITION_FAILED),
        (400, "InvalidArgument", K.BAD_REQUEST),
        (503, "SlowDown", K.THROTTLED),
        (503, "ServiceUnavailable", K.THROTTLED),
        (500, "InternalError", K.UNAVAILABLE),
        (502, "", K.UNAVAILABLE),
        (504, "", K.UNAVAILABLE),
        (405, "MethodNotAllowed", K.UNEXPECTED),
        (501, "NotImplemented", K.UNEXPECTED),
        (301, "PermanentRedirect", K.UNEXPECTED),
    ],
)
def test_classify(status: int, code: str, kind: S3ErrorKind) -> None:
    assert classify(status, code) is kind


def test_only_throttling_and_server_faults_are_transient() -> None:
    assert TRANSIENT == {K.THROTTLED, K.UNAVAILABLE}


class _ClientError(Exception):
    """What botocore's ClientError carries, without botocore."""

    def __init__(self, response: Any) -> None:
        super().__init__("An error occurred")
        self.response = response


def test_from_client_error_reads_the_response_dict() -> None:
    exc = _ClientError({"Error": {"Code": "NoSuchKey", "Message": "gone"}, "ResponseMetadata": {"HTTPStatusCode": 404}})
    answer = from_client_error(exc)
    assert (answer.status, answer.code, answer.message, answer.kind) == (404, "NoSuchKey", "gone", K.NOT_FOUND_KEY)
    assert answer.detail == "NoSuchKey"


def test_from_client_error_copes_with_what_is_missing() -> None:
    head = from_client_error(_ClientError({"Error": {"Code": "403", "Message": "Forbidden"}}))
    assert (head.status, head.kind, head.detail) == (403, K.ACCESS_DENIED, "403")
    for response in (None, {}, {"Error": "x", "ResponseMetadata": {"HTTPStatusCode": "junk"}}):
        assert from_client_error(_ClientError(response)).kind is K.UNEXPECTED


def test_from_client_error_against_botocore() -> None:
    botocore = pytest.importorskip("botocore.exceptions")
    exc = botocore.ClientError(
        {"Error": {"Code": "SlowDown", "Message": "Please reduce"}, "ResponseMetadata": {"HTTPStatusCode": 503}}, "GetObject"
    )
    assert from_client_error(exc).kind is K.THROTTLED


def test_from_http_reads_the_code_from_the_body() -> None:
    answer = from_http(404, error_xml("NoSuchBucket", "no bucket", "/b", "R"))
    assert (answer.code, answer.message, answer.kind) == ("NoSuchBucket", "no bucket", K.NOT_FOUND_BUCKET)
    bare = from_http(503, b"")
    assert (bare.code, bare.kind, bare.detail) == ("", K.THROTTLED, "503")
