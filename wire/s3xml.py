"""S3's XML, as both sides speak it: listing pages (ListObjectsV2 and v1), the bucket location and
error bodies (stdlib only).

The daemon builds listings for origins that are not S3 themselves (``file://``) and error bodies
for every S3 answer it refuses; it parses the origin's listings (``/_shardcache/cached``) and the
loader parses the daemon's (a dataset without a manifest). One module holds the namespace and the
element names, so a page built here is exactly a page parsed here.

Parsing is for bytes from the network: a document is bounded in size, must be UTF-8 (what S3
sends) and must not carry a DTD. S3 never sends one, and without a DTD there is no entity to
expand (billion laughs) and no external entity to resolve, whatever the XML library would do
with them. Everything malformed is one :class:`S3XMLError`.
"""

from __future__ import annotations

import datetime
import re
import urllib.parse
import xml.etree.ElementTree as ET
from collections.abc import Mapping
from dataclasses import dataclass

from wire.errors import WireError

__all__ = [
    "NAMESPACE",
    "MAX_LISTING_BYTES",
    "MAX_ERROR_BYTES",
    "S3XMLError",
    "ListedObject",
    "ListPage",
    "ErrorBody",
    "iso_time",
    "s3_url_encode",
    "list_page_xml",
    "location_xml",
    "parse_list_page",
    "error_xml",
    "parse_error",
]

NAMESPACE = "http://s3.amazonaws.com/doc/2006-03-01/"
MAX_LISTING_BYTES = 64 * 1024 * 1024
"""Largest listing page accepted: 1,000 keys of 1 KiB each are ~1.3 MB of XML."""
MAX_ERROR_BYTES = 64 * 1024
"""Error bodies are read and parsed up to this many bytes."""

_DECLARATION = '<?xml version="1.0" encoding="UTF-8"?>'
# Names of the detail elements an error body may carry: ASCII words, never request text.
_ELEMENT = re.compile(r"[A-Z][A-Za-z]{0,63}", re.ASCII)
# For error bodies that are cut off or not XML at all: the code is still worth reporting.
_CODE_RE = re.compile(r"<Code>([^<]{1,64})</Code>")
_MESSAGE_RE = re.compile(r"<Message>([^<]{0,1024})</Message>")


def _escape(text: str) -> str:
    """Text as XML character data (``xml.sax.saxutils.escape`` would import ``urllib.request``)."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


class S3XMLError(WireError, ValueError):
    """An S3 XML document is malformed, too large, or not what was asked for."""


@dataclass(frozen=True)
class ListedObject:
    """One object of a listing. In a :class:`ListPage` the key is the whole key and ``etag`` is
    as S3 sends it (quoted); the loader and the CLI keep keys relative to the dataset prefix
    (and the loader unquoted ETags) in the same record. ``last_modified`` is ISO 8601 as S3
    sends it (``2024-01-02T03:04:05.000Z``)."""

    key: str
    size: int
    etag: str | None = None
    last_modified: str | None = None


@dataclass(frozen=True)
class ListPage:
    """One listing answer, ListObjectsV2 or v1 (ListObjects). ``next_token`` continues a truncated
    v2 listing, ``next_marker`` a v1 one (S3 sends it only with a delimiter; without one the last
    key is the next marker). Keys, prefixes, the delimiter, ``start_after`` and the markers are
    always the names themselves: an answer with ``<EncodingType>url</EncodingType>`` is decoded
    when parsed, and :func:`list_page_xml` encodes them only when asked to."""

    bucket: str
    prefix: str = ""
    contents: tuple[ListedObject, ...] = ()
    common_prefixes: tuple[str, ...] = ()
    max_keys: int = 1000
    truncated: bool = False
    next_token: str | None = None
    delimiter: str | None = None
    continuation_token: str | None = None
    start_after: str | None = None
    marker: str | None = None
    next_marker: str | None = None

    @property
    def key_count(self) -> int:
        return len(self.contents) + len(self.common_prefixes)


@dataclass(frozen=True)
class ErrorBody:
    """What an S3 error body says: its ``<Code>`` and ``<Message>`` ("" when absent)."""

    code: str
    message: str


def iso_time(ts: float) -> str:
    """A POSIX time as a listing's ``LastModified``."""
    return datetime.datetime.fromtimestamp(ts, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.000Z")


def s3_url_encode(name: str) -> str:
    """A name as S3 writes it in a listing asked for with ``encoding-type=url``: UTF-8 percent
    encoding of all but letters, digits and ``-_.*/``, a space as ``+`` (so ``+`` is ``%2B``),
    ``~`` encoded too. :func:`urllib.parse.unquote_plus` (what botocore and :func:`parse_list_page`
    decode with) gives the name back."""
    return urllib.parse.quote_plus(name, safe="/*").replace("~", "%7E")


def list_page_xml(page: ListPage, *, v1: bool = False, encoding_type: str | None = None) -> bytes:
    """Render a ListObjectsV2 answer, or with ``v1`` a ListObjects one (for origins that are not
    S3 themselves). With ``encoding_type="url"`` the names are encoded as S3 encodes them, in
    the elements S3 encodes (Key, Prefix, Delimiter, StartAfter, Marker, NextMarker and the
    common prefixes; never the tokens), and the page says ``<EncodingType>url</EncodingType>``."""
    encode = encoding_type == "url"

    def name(text: str) -> str:
        return _escape(s3_url_encode(text) if encode else text)

    parts = [
        _DECLARATION,
        f'<ListBucketResult xmlns="{NAMESPACE}">',
        f"<Name>{_escape(page.bucket)}</Name><Prefix>{name(page.prefix)}</Prefix>",
    ]
    if v1:
        parts.append(f"<Marker>{name(page.marker or '')}</Marker>")
        if page.next_marker:
            parts.append(f"<NextMarker>{name(page.next_marker)}</NextMarker>")
    else:
        parts.append(f"<KeyCount>{page.key_count}</KeyCount>")
    parts.append(f"<MaxKeys>{page.max_keys}</MaxKeys>")
    if page.delimiter:
        parts.append(f"<Delimiter>{name(page.delimiter)}</Delimiter>")
    if encode:
        parts.append("<EncodingType>url</EncodingType>")
    parts.append(f"<IsTruncated>{'true' if page.truncated else 'false'}</IsTruncated>")
    if not v1:
        if page.continuation_token:
            parts.append(f"<ContinuationToken>{_escape(page.continuation_token)}</ContinuationToken>")
        if page.start_after:
            parts.append(f"<StartAfter>{name(page.start_after)}</StartAfter>")
        if page.next_token:
            parts.append(f"<NextContinuationToken>{_escape(page.next_token)}</NextContinuationToken>")
    for obj in page.contents:
        parts.append(f"<Contents><Key>{name(obj.key)}</Key>")
        if obj.last_modified is not None:
            parts.append(f"<LastModified>{_escape(obj.last_modified)}</LastModified>")
        if obj.etag is not None:
            parts.append(f"<ETag>{_escape(obj.etag)}</ETag>")
        parts.append(f"<Size>{obj.size}</Size><StorageClass>STANDARD</StorageClass></Contents>")
    for common in page.common_prefixes:
        parts.append(f"<CommonPrefixes><Prefix>{name(common)}</Prefix></CommonPrefixes>")
    parts.append("</ListBucketResult>")
    return "".join(parts).encode()


def location_xml(region: str | None) -> bytes:
    """A GetBucketLocation answer; ``None`` (or ``us-east-1``) is S3's empty constraint."""
    if not region or region == "us-east-1":
        return f'{_DECLARATION}<LocationConstraint xmlns="{NAMESPACE}"/>'.encode()
    return f'{_DECLARATION}<LocationConstraint xmlns="{NAMESPACE}">{_escape(region)}</LocationConstraint>'.encode()


def _document(data: bytes, limit: int, what: str) -> ET.Element:
    """The root element of ``data``, refusing what is too large, not UTF-8 or has a DTD."""
    if len(data) > limit:
        raise S3XMLError(f"{what}: larger than {limit} bytes")
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise S3XMLError(f"{what}: not UTF-8 ({exc.reason} at byte {exc.start})") from exc
    if "<!DOCTYPE" in text:  # XML is case-sensitive: every DTD, so every entity, starts so
        raise S3XMLError(f"{what}: has a document type declaration, which S3 never sends")
    try:
        # A str is parsed as the UTF-8 it was decoded from, whatever its declaration says.
        return ET.fromstring(text)
    except ET.ParseError as exc:
        raise S3XMLError(f"{what}: not well-formed XML ({exc})") from exc


def _local(tag: str) -> str:
    """An element's name without its namespace (S3 qualifies them; some servers do not)."""
    return tag.rsplit("}", 1)[-1]


def _children(element: ET.Element) -> dict[str, list[ET.Element]]:
    found: dict[str, list[ET.Element]] = {}
    for child in element:
        found.setdefault(_local(child.tag), []).append(child)
    return found


def _text(children: dict[str, list[ET.Element]], name: str) -> str | None:
    elements = children.get(name)
    if not elements:
        return None
    return elements[0].text or ""


def _count(text: str | None, name: str, what: str) -> int | None:
    if text is None:
        return None
    value = text.strip()
    if not value.isdigit() or not value.isascii():
        raise S3XMLError(f"{what}: <{name}> is not a non-negative integer: {value[:40]!r}")
    return int(value)


def parse_list_page(data: bytes, *, limit: int = MAX_LISTING_BYTES, what: str = "ListObjectsV2 answer") -> ListPage:
    """A ListObjectsV2 (or v1) answer as a :class:`ListPage`; :class:`S3XMLError` if it is not one."""
    root = _document(data, limit, what)
    if _local(root.tag) != "ListBucketResult":
        raise S3XMLError(f"{what}: the document is a <{_local(root.tag)[:40]}>, not a <ListBucketResult>")
    top = _children(root)
    # botocore asks for url-encoded names whenever it signs a listing (the daemon's S3 origin
    # does), and S3 then encodes these elements, not the continuation tokens.
    encoded = (_text(top, "EncodingType") or "").strip() == "url"

    def name(text: str | None) -> str | None:
        return urllib.parse.unquote_plus(text) if encoded and text is not None else text

    contents: list[ListedObject] = []
    for item in top.get("Contents", []):
        fields = _children(item)
        key = name(_text(fields, "Key"))
        if not key:
            raise S3XMLError(f"{what}: a <Contents> without a <Key>")
        size = _count(_text(fields, "Size"), "Size", what)
        contents.append(ListedObject(key, size or 0, _text(fields, "ETag"), _text(fields, "LastModified")))
    commons = [name(_text(_children(item), "Prefix")) or "" for item in top.get("CommonPrefixes", [])]
    truncated = (_text(top, "IsTruncated") or "false").strip().lower()
    if truncated not in ("true", "false"):
        raise S3XMLError(f"{what}: <IsTruncated> is {truncated[:40]!r}, not true or false")
    max_keys = _count(_text(top, "MaxKeys"), "MaxKeys", what)
    return ListPage(
        bucket=_text(top, "Name") or "",
        prefix=name(_text(top, "Prefix")) or "",
        contents=tuple(contents),
        common_prefixes=tuple(commons),
        max_keys=1000 if max_keys is None else max_keys,
        truncated=truncated == "true",
        next_token=_text(top, "NextContinuationToken") or None,
        delimiter=name(_text(top, "Delimiter")) or None,
        continuation_token=_text(top, "ContinuationToken") or None,
        start_after=name(_text(top, "StartAfter")) or None,
        marker=name(_text(top, "Marker")) or None,
        next_marker=name(_text(top, "NextMarker")) or None,
    )


# What an XML 1.0 document cannot carry, even as a character reference (C0 controls but tab, LF
# and CR; lone surrogates; U+FFFE and U+FFFF), plus what a parser would silently change (CR, and
# CR LF, become LF) or a reader cannot see (the other controls, DEL, C1).
_UNSAFE_RE = re.compile("[\x00-\x1f\x7f-\x9f\ud800-\udfff\ufffe\uffff]")


def _percent(match: re.Match[str]) -> str:
    return "".join(f"%{byte:02X}" for byte in match.group().encode("utf-8", "surrogatepass"))


def _echo(text: str) -> str:
    """Text an error body echoes (a request path, a key in a message) as XML character data:
    escaped, with what XML cannot carry percent-encoded as in a URL (``\\n`` is ``%0A``), so the
    body always parses and a client always reads its ``<Code>``."""
    return _escape(_UNSAFE_RE.sub(_percent, text))


def error_xml(
    code: str, message: str, resource: str = "", request_id: str = "", details: Mapping[str, str] | None = None
) -> bytes:
    """An S3 error body. ``details`` are the code's own elements after ``<Message>``, as S3 sends
    them (``<Key>`` with NoSuchKey, ``<BucketName>``, ``<Condition>``, ``<RangeRequested>``...).
    Every field may echo the request: see :func:`_echo`."""
    extra = "".join(f"<{name}>{_echo(value)}</{name}>" for name, value in (details or {}).items() if _ELEMENT.fullmatch(name))
    return (
        f"{_DECLARATION}<Error><Code>{_echo(code)}</Code><Message>{_echo(message)}</Message>{extra}"
        f"<Resource>{_echo(resource)}</Resource><RequestId>{_echo(request_id)}</RequestId></Error>"
    ).encode()


def parse_error(body: bytes) -> ErrorBody:
    """The code and message of an error answer's body, never raising: a body may be empty (HEAD),
    cut at :data:`MAX_ERROR_BYTES`, or not XML at all (a proxy's HTML page). Then the code is
    what a ``<Code>`` element says, if one can be found, and the message the body's start."""
    head = body[:MAX_ERROR_BYTES]
    try:
        root = _document(head, MAX_ERROR_BYTES, "error body")
    except S3XMLError:
        text = head.decode("utf-8", "replace")
        code = _CODE_RE.search(text)
        message = _MESSAGE_RE.search(text)
        return ErrorBody(
            code.group(1).strip() if code else "",
            message.group(1).strip() if message else text[:200].strip(),
        )
    fields = _children(root)
    return ErrorBody((_text(fields, "Code") or "").strip(), (_text(fields, "Message") or "").strip())
