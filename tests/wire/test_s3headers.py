"""S3's stored object headers and its conditional-request decision, as pure functions."""

from __future__ import annotations

import pytest

from wire.errors import HeadersTooLarge
from wire.s3headers import MAX_OBJECT_HEADER_BYTES, failed_condition, not_modified_headers, object_headers, precondition

ETAG = '"5d41402abc4b2a76b9719d911017c592"'
LM = "Tue, 01 Dec 2026 10:48:59 GMT"
BEFORE = "Mon, 30 Nov 2026 10:48:59 GMT"
AFTER = "Wed, 02 Dec 2026 10:48:59 GMT"


class Headers(dict[str, str]):
    """Case-insensitive lookups, as aiohttp's request headers do them."""

    def get(self, name: str, default: str | None = None) -> str | None:  # type: ignore[override]
        for key, value in self.items():
            if key.lower() == name.lower():
                return value
        return default


@pytest.mark.parametrize(("conditions", "status"), [
    ({}, 200),
    ({"If-Match": ETAG}, 200),
    ({"if-match": ETAG.strip('"')}, 200),  # quotes are optional
    ({"If-Match": '"other", ' + ETAG}, 200),  # a list
    ({"If-Match": '"other"'}, 412),
    ({"If-Match": "*"}, 200),
    ({"If-Match": "W/" + ETAG}, 412),  # If-Match compares strongly
    ({"If-None-Match": ETAG}, 304),
    ({"If-None-Match": "W/" + ETAG}, 304),  # If-None-Match compares weakly
    ({"If-None-Match": "*"}, 304),
    ({"If-None-Match": '"a", "b"'}, 200),
    ({"If-Modified-Since": BEFORE}, 200),
    ({"If-Modified-Since": LM}, 304),
    ({"If-Modified-Since": AFTER}, 304),
    ({"If-Unmodified-Since": BEFORE}, 412),
    ({"If-Unmodified-Since": LM}, 200),
    ({"If-Unmodified-Since": AFTER}, 200),
    # S3's precedence: If-Match over If-Unmodified-Since, If-None-Match over If-Modified-Since.
    ({"If-Match": ETAG, "If-Unmodified-Since": BEFORE}, 200),
    ({"If-Match": '"other"', "If-Unmodified-Since": AFTER}, 412),
    ({"If-None-Match": ETAG, "If-Modified-Since": BEFORE}, 304),
    ({"If-None-Match": '"other"', "If-Modified-Since": AFTER}, 200),
    # 412 before 304
    ({"If-Match": '"other"', "If-None-Match": ETAG}, 412),
    ({"If-Unmodified-Since": BEFORE, "If-None-Match": ETAG}, 412),
    ({"If-Match": ETAG, "If-Modified-Since": AFTER}, 304),
    # malformed or empty: ignored, as HTTP says (moto answers 500 to a bad date)
    ({"If-Modified-Since": "yesterday"}, 200),
    ({"If-Unmodified-Since": "Mon, 99 Foo 2026 99:99:99 GMT"}, 200),
    ({"If-Match": ""}, 200),
    ({"If-None-Match": "   "}, 200),
    # other date forms HTTP allows: the obsolete RFC 850 and asctime ones
    ({"If-Modified-Since": "Tuesday, 01-Dec-26 10:48:59 GMT"}, 304),
    ({"If-Modified-Since": "Tue Dec  1 10:48:59 2026"}, 304),
])
def test_precondition(conditions: dict[str, str], status: int) -> None:
    assert precondition(Headers(conditions), ETAG, LM) == status


def test_precondition_without_a_known_date_only_decides_on_etags() -> None:
    assert precondition(Headers({"If-Unmodified-Since": BEFORE}), ETAG, None) == 200
    assert precondition(Headers({"If-Modified-Since": AFTER}), ETAG, None) == 200
    assert precondition(Headers({"If-None-Match": ETAG}), ETAG, None) == 304
    assert precondition(Headers({"If-Match": '"x"'}), ETAG, "not a date") == 412


def test_object_headers_keeps_what_s3_stores() -> None:
    answer = [
        ("content-type", "text/plain"), ("ETag", ETAG), ("Content-Length", "5"), ("x-amz-meta-Shard", "7"),
        ("Cache-Control", "no-cache"), ("expires", LM), ("Content-Range", "bytes 0-4/5"), ("Date", LM),
        ("content-encoding", "gzip"), ("Content-Disposition", "inline"), ("content-language", "de"),
        ("x-amz-request-id", "r"),
    ]
    assert object_headers(answer) == (
        ("Content-Type", "text/plain"), ("x-amz-meta-shard", "7"), ("Cache-Control", "no-cache"),
        ("Expires", LM), ("Content-Encoding", "gzip"), ("Content-Disposition", "inline"),
        ("Content-Language", "de"),
    )
    assert not_modified_headers(object_headers(answer)) == (
        ("x-amz-meta-shard", "7"), ("Cache-Control", "no-cache"), ("Expires", LM),
    )


def test_object_headers_are_bounded() -> None:
    fits = [(f"x-amz-meta-k{i}", "v" * 100) for i in range(MAX_OBJECT_HEADER_BYTES // 120)]
    assert len(object_headers(fits)) == len(fits)
    with pytest.raises(HeadersTooLarge, match="b/k"):
        object_headers([("x-amz-meta-big", "v" * MAX_OBJECT_HEADER_BYTES)], "b/k")
    # what is not kept does not count
    assert object_headers([("x-amz-request-id", "v" * MAX_OBJECT_HEADER_BYTES)]) == ()


@pytest.mark.parametrize(
    ("conditions", "failed"),
    [
        ({"If-Match": '"other"'}, "If-Match"),
        ({"If-Match": '"other"', "If-Unmodified-Since": BEFORE}, "If-Match"),
        ({"If-Unmodified-Since": BEFORE}, "If-Unmodified-Since"),
    ],
)
def test_failed_condition_names_the_header_that_decided(conditions: dict[str, str], failed: str) -> None:
    assert precondition(Headers(conditions), ETAG, LM) == 412
    assert failed_condition(Headers(conditions)) == failed
