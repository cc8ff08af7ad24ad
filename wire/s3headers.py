"""S3's object headers: which ones an object keeps, how much of them, and conditional requests.

S3 stores a few headers with each object and answers them on every GET and HEAD: the
``Content-*`` ones and ``Expires`` it was put with, and the user metadata (``x-amz-meta-*``).
A cache in front of S3 keeps them with its copy and answers them as the origin sent them;
clients act on them (``aws s3 cp`` needs ``Last-Modified``, s3fs reports it as the mtime, a
``Content-Encoding`` changes how a body is read).
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable, Mapping
from email.utils import parsedate_to_datetime

from wire.errors import HeadersTooLarge

__all__ = [
    "DEFAULT_CONTENT_TYPE",
    "MAX_OBJECT_HEADER_BYTES",
    "ObjectHeaders",
    "object_headers",
    "not_modified_headers",
    "failed_condition",
    "precondition",
]

ObjectHeaders = tuple[tuple[str, str], ...]
"""``(name, value)`` pairs in the origin's order; names as :data:`_STORED` spells them."""

DEFAULT_CONTENT_TYPE = "binary/octet-stream"
"""What S3 answers for an object put without a ``Content-Type`` (moto does the same)."""

MAX_OBJECT_HEADER_BYTES = 8 * 1024
"""Names and values of the stored headers together. S3 allows 2 KB of user metadata and 8 KB of
request headers in all, so an origin sending more is broken or hostile: nothing of it is kept."""

_STORED = {
    name.lower(): name
    for name in ("Content-Type", "Cache-Control", "Content-Disposition", "Content-Encoding", "Content-Language", "Expires")
}
_META_PREFIX = "x-amz-meta-"


def object_headers(items: Iterable[tuple[str, str]], what: str = "object") -> ObjectHeaders:
    """The headers S3 stores with an object, picked from an origin's answer (names are
    case-insensitive there; user metadata names are lower case, as S3 keeps them). Raises
    :class:`~wire.errors.HeadersTooLarge` past :data:`MAX_OBJECT_HEADER_BYTES`."""
    kept: list[tuple[str, str]] = []
    total = 0
    for name, value in items:
        lower = name.lower()
        canonical = _STORED.get(lower) or (lower if lower.startswith(_META_PREFIX) else None)
        if canonical is None:
            continue
        total += len(canonical) + len(value)
        if total > MAX_OBJECT_HEADER_BYTES:
            raise HeadersTooLarge(f"{what}: the origin sent more than {MAX_OBJECT_HEADER_BYTES} bytes of object headers")
        kept.append((canonical, value))
    return tuple(kept)


def not_modified_headers(stored: ObjectHeaders) -> ObjectHeaders:
    """What a 304 repeats of them: S3 (like RFC 9110 15.4.5) sends no ``Content-*`` without content."""
    return tuple((name, value) for name, value in stored if not name.lower().startswith("content-"))


# -- conditional requests (RFC 9110 13.2.2, as S3 documents it for GetObject and HeadObject) ----


def precondition(headers: Mapping[str, str], etag: str, last_modified: str | None) -> int:
    """200 (answer the object), 304 (Not Modified) or 412 (Precondition Failed) for a GET or
    HEAD of an object with ``etag`` and ``last_modified`` (an HTTP date; ``None`` when unknown,
    then the date conditions cannot fail). ``headers`` is the request's, case-insensitive.

    S3's precedence: ``If-Match`` decides alone when present (true wins over a false
    ``If-Unmodified-Since``); so does ``If-None-Match`` over ``If-Modified-Since`` (a matching
    ``If-None-Match`` is 304 even if the object was modified since). A malformed date is ignored,
    as HTTP says. Every read asks: one without conditions costs four header lookups, and dates
    are parsed only for a date condition that decides."""
    if_match = _present(headers, "If-Match")
    if if_match is not None:
        if not _matches(if_match, etag, weak=False):
            return 412
    else:
        since = _http_date(_present(headers, "If-Unmodified-Since"))
        if since is not None and (modified := _http_date(last_modified)) is not None and modified > since:
            return 412
    if_none_match = _present(headers, "If-None-Match")
    if if_none_match is not None:
        return 304 if _matches(if_none_match, etag, weak=True) else 200
    since = _http_date(_present(headers, "If-Modified-Since"))
    if since is not None and (modified := _http_date(last_modified)) is not None and modified <= since:
        return 304
    return 200


def failed_condition(headers: Mapping[str, str]) -> str:
    """The header a 412 from :func:`precondition` failed on, for S3's ``<Condition>``:
    ``If-Match`` decides alone when present, so it is the one whenever it was sent."""
    return "If-Match" if _present(headers, "If-Match") is not None else "If-Unmodified-Since"


def _present(headers: Mapping[str, str], name: str) -> str | None:
    value = headers.get(name)
    return value.strip() if value is not None and value.strip() else None


def _matches(condition: str, etag: str, weak: bool) -> bool:
    """Whether the ``If-Match``/``If-None-Match`` list names ``etag``. Quotes are optional (S3
    takes ``If-Match: abc`` for ``"abc"``); ``*`` matches any object, since this one exists;
    a weak tag (``W/"abc"``) only counts for ``If-None-Match``, as HTTP compares them."""
    bare = etag.strip().removeprefix("W/").strip('"')
    for tag in condition.split(","):
        tag = tag.strip()
        if tag == "*":
            return True
        if tag.startswith("W/"):
            if not weak:
                continue
            tag = tag[2:]
        if tag.strip('"') == bare:
            return True
    return False


def _http_date(value: str | None) -> float | None:
    """Seconds since the epoch, whole (HTTP dates have no fractions); ``None`` if not a date."""
    if not value:
        return None
    try:
        parsed = parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError, OverflowError):
        return None
    if parsed.tzinfo is None:  # "-0000" or an obsolete form without a zone: HTTP dates are GMT
        parsed = parsed.replace(tzinfo=datetime.UTC)
    return float(int(parsed.timestamp()))
