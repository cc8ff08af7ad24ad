"""wire.s3xml: listing pages round-trip, S3's own documents parse, and hostile or invalid XML is
one clear S3XMLError (no entity is ever expanded)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from wire.errors import WireError
from wire.s3xml import (
    MAX_ERROR_BYTES,
    NAMESPACE,
    ErrorBody,
    ListedObject,
    ListPage,
    S3XMLError,
    error_xml,
    iso_time,
    list_page_xml,
    parse_error,
    parse_list_page,
)

# What a key can hold in XML 1.0 character data (S3 itself needs encoding-type=url for the rest).
_TEXT = st.text(st.characters(blacklist_categories=("Cs", "Cc", "Cn")), max_size=40)
_KEY = _TEXT.filter(bool)
_TOKEN = st.none() | _TEXT.filter(bool)

_OBJECTS = st.builds(
    ListedObject,
    key=_KEY,
    size=st.integers(0, 2**63),
    etag=st.none() | _TEXT.map(lambda t: f'"{t}"'),
    last_modified=st.none() | st.floats(0, 4e9).map(iso_time),
)
_PAGES = st.builds(
    ListPage,
    bucket=st.from_regex(r"[a-z0-9][a-z0-9.-]{1,20}", fullmatch=True),
    prefix=_TEXT,
    contents=st.lists(_OBJECTS, max_size=8).map(tuple),
    common_prefixes=st.lists(_KEY, max_size=4).map(tuple),
    max_keys=st.integers(0, 1000),
    truncated=st.booleans(),
    next_token=_TOKEN,
    delimiter=_TOKEN,
    continuation_token=_TOKEN,
    start_after=_TOKEN,
)


@given(_PAGES)
def test_a_listing_page_round_trips(page: ListPage) -> None:
    assert parse_list_page(list_page_xml(page)) == page


def test_a_built_page_is_s3s_document() -> None:
    page = ListPage("bkt", "ds/", (ListedObject("ds/a&b<c>.tar", 10, '"e1"', "2024-01-02T03:04:05.000Z"),),
                    max_keys=1, truncated=True, next_token="tok")
    data = list_page_xml(page)
    assert data.startswith(b'<?xml version="1.0" encoding="UTF-8"?>')
    assert f'<ListBucketResult xmlns="{NAMESPACE}">'.encode() in data
    assert b"<Key>ds/a&amp;b&lt;c&gt;.tar</Key>" in data
    assert b"<KeyCount>1</KeyCount><MaxKeys>1</MaxKeys><IsTruncated>true</IsTruncated>" in data
    assert b"<NextContinuationToken>tok</NextContinuationToken>" in data
    assert page.key_count == 1


def test_an_aws_answer_parses() -> None:
    """As AWS sends it: namespaced, pretty-printed, with owners and checksums we ignore."""
    data = f"""<?xml version="1.0" encoding="UTF-8"?>
<ListBucketResult xmlns="{NAMESPACE}">
  <Name>bucket</Name>
  <Prefix>train/</Prefix>
  <NextContinuationToken>1ueGcxLPRx1Tr/XYExHnhbYLgveDs2J/wm36Hy4vbOwM=</NextContinuationToken>
  <KeyCount>2</KeyCount>
  <MaxKeys>2</MaxKeys>
  <IsTruncated>true</IsTruncated>
  <Contents>
    <Key>train/0.tar</Key>
    <LastModified>2009-10-12T17:50:30.000Z</LastModified>
    <ETag>"fba9dede5f27731c9771645a39863328"</ETag>
    <ChecksumAlgorithm>CRC32</ChecksumAlgorithm>
    <Size>434234</Size>
    <Owner><ID>owner</ID></Owner>
    <StorageClass>STANDARD</StorageClass>
  </Contents>
  <Contents>
    <Key>train/1.tar</Key>
    <Size>7</Size>
  </Contents>
</ListBucketResult>
""".encode()
    page = parse_list_page(data)
    assert page.bucket == "bucket" and page.prefix == "train/"
    assert page.truncated and page.next_token == "1ueGcxLPRx1Tr/XYExHnhbYLgveDs2J/wm36Hy4vbOwM="
    assert page.contents == (
        ListedObject("train/0.tar", 434234, '"fba9dede5f27731c9771645a39863328"', "2009-10-12T17:50:30.000Z"),
        ListedObject("train/1.tar", 7),
    )


def test_an_unqualified_answer_parses_too() -> None:
    data = b"<ListBucketResult><Contents><Key>k</Key><Size>3</Size></Contents><IsTruncated>false</IsTruncated></ListBucketResult>"
    page = parse_list_page(data)
    assert page.contents == (ListedObject("k", 3),) and not page.truncated and page.next_token is None


def test_url_encoded_names_are_decoded() -> None:
    """botocore signs listings with encoding-type=url (the daemon's S3 origin does): S3 then
    encodes keys, prefixes, the delimiter and start-after, but not the continuation tokens."""
    data = f"""<?xml version="1.0" encoding="utf-8"?>
<ListBucketResult xmlns="{NAMESPACE}"><IsTruncated>true</IsTruncated>
<Contents><Key>ds/a%20b%2Bc+%C3%A9.tar</Key><Size>3</Size></Contents>
<CommonPrefixes><Prefix>ds/sub%2F1/</Prefix></CommonPrefixes>
<Name>bkt</Name><Prefix>ds/</Prefix><Delimiter>%2F</Delimiter><StartAfter>ds/%3D</StartAfter>
<NextContinuationToken>a%2Bb</NextContinuationToken><EncodingType>url</EncodingType></ListBucketResult>""".encode()
    page = parse_list_page(data)
    assert [obj.key for obj in page.contents] == ["ds/a b+c \u00e9.tar"]
    assert page.common_prefixes == ("ds/sub/1/",)
    assert (page.prefix, page.delimiter, page.start_after, page.next_token) == ("ds/", "/", "ds/=", "a%2Bb")
    # Without the element, the same text is a name of its own.
    assert parse_list_page(data.replace(b"<EncodingType>url</EncodingType>", b"")).contents[0].key == "ds/a%20b%2Bc+%C3%A9.tar"


_BILLION_LAUGHS = b"""<?xml version="1.0"?>
<!DOCTYPE lolz [
 <!ENTITY lol "lol">
 <!ENTITY lol2 "&lol;&lol;&lol;&lol;&lol;&lol;&lol;&lol;&lol;&lol;">
 <!ENTITY lol3 "&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;">
]>
<ListBucketResult><Contents><Key>&lol3;</Key><Size>1</Size></Contents></ListBucketResult>"""

_EXTERNAL = b"""<?xml version="1.0"?>
<!DOCTYPE r [<!ENTITY x SYSTEM "file:///etc/passwd">]>
<ListBucketResult><Contents><Key>&x;</Key><Size>1</Size></Contents></ListBucketResult>"""


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (_BILLION_LAUGHS, "document type declaration"),
        (_EXTERNAL, "document type declaration"),
        ("<ListBucketResult/>".encode("utf-16"), "not UTF-8"),
        (b"<ListBucketResult><Contents>", "not well-formed"),
        (b"", "not well-formed"),
        (b"<Error><Code>NoSuchBucket</Code></Error>", "not a <ListBucketResult>"),
        (b"<ListBucketResult><Contents><Size>1</Size></Contents></ListBucketResult>", "without a <Key>"),
        (b"<ListBucketResult><Contents><Key>k</Key><Size>-1</Size></Contents></ListBucketResult>", "<Size>"),
        (b"<ListBucketResult><Contents><Key>k</Key><Size>1e9</Size></Contents></ListBucketResult>", "<Size>"),
        (b"<ListBucketResult><MaxKeys>many</MaxKeys></ListBucketResult>", "<MaxKeys>"),
        (b"<ListBucketResult><IsTruncated>maybe</IsTruncated></ListBucketResult>", "<IsTruncated>"),
    ],
)
def test_hostile_or_invalid_listings_are_one_clear_error(data: bytes, message: str) -> None:
    with pytest.raises(S3XMLError, match=message) as err:
        parse_list_page(data, what="listing of bkt")
    assert str(err.value).startswith("listing of bkt: ")
    assert isinstance(err.value, WireError) and isinstance(err.value, ValueError)


def test_a_listing_over_the_bound_is_refused_before_parsing() -> None:
    page = list_page_xml(ListPage("bkt", contents=tuple(ListedObject(f"k{i}", i) for i in range(100))))
    with pytest.raises(S3XMLError, match="larger than 1000 bytes"):
        parse_list_page(page, limit=1000)


@given(code=_TEXT, message=_TEXT, resource=_TEXT)
def test_an_error_body_round_trips(code: str, message: str, resource: str) -> None:
    assert parse_error(error_xml(code, message, resource, "REQ1")) == ErrorBody(code.strip(), message.strip())


def test_error_bodies_as_s3_and_proxies_send_them() -> None:
    assert parse_error(b"") == ErrorBody("", "")  # a HEAD has no body
    namespaced = f'<Error xmlns="{NAMESPACE}"><Code>SlowDown</Code><Message>Reduce your rate</Message></Error>'
    assert parse_error(namespaced.encode()) == ErrorBody("SlowDown", "Reduce your rate")
    # Cut off at the read bound, or not XML at all: the code is still found, the message is the start.
    cut = b"<Error><Code>NoSuchKey</Code><Message>The key does not exist</Message><Resource>" + b"x" * MAX_ERROR_BYTES
    assert parse_error(cut) == ErrorBody("NoSuchKey", "The key does not exist")
    assert parse_error(b"<html><body>502 Bad Gateway") == ErrorBody("", "<html><body>502 Bad Gateway")
    assert parse_error(_BILLION_LAUGHS).code == ""


def test_an_error_body_escapes_what_it_carries() -> None:
    body = error_xml("InvalidArgument", "key <a&b>", "/bkt/<a&b>", "REQ1")
    assert b"<Code>InvalidArgument</Code>" in body
    assert b"<Message>key &lt;a&amp;b&gt;</Message>" in body
    assert b"<Resource>/bkt/&lt;a&amp;b&gt;</Resource><RequestId>REQ1</RequestId>" in body


def test_iso_time_is_s3s_format() -> None:
    assert iso_time(0) == "1970-01-01T00:00:00.000Z"
    assert iso_time(1_700_000_000.9) == "2023-11-14T22:13:20.000Z"
