"""The daemon's side of S3's HTTP: error answers as ``aiohttp`` responses and ``Range`` headers.

The XML itself (error bodies, listings) is :mod:`wire.s3xml`, shared with the loader.
"""

from __future__ import annotations

import re
import uuid

from aiohttp import web

from sidecar.errors import InvalidRange
from wire.s3xml import error_xml

__all__ = ["error_response", "parse_range", "requested_range"]

_RANGE_RE = re.compile(r"^bytes=(\d*)-(\d*)$", re.ASCII)  # ASCII: "\d" is not every Unicode digit
_MAX_DIGITS = 19
_BEYOND = 10**_MAX_DIGITS


def error_response(
    status: int, code: str, message: str, resource: str = "", headers: dict[str, str] | None = None,
    details: dict[str, str] | None = None,
) -> web.Response:
    request_id = uuid.uuid4().hex[:16].upper()
    all_headers = {"x-amz-request-id": request_id}
    all_headers.update(headers or {})
    body = error_xml(code, message, resource, request_id, details)
    return web.Response(status=status, body=body, content_type="application/xml", headers=all_headers)


def _position(digits: str) -> int:
    """A byte position as the number it is, or one past every object for a longer number.

    ``int()`` refuses strings of more than 4,300 digits (a ValueError, which was a 500); a number
    of more than 19 digits is past any object's size (2**63), so its exact value does not matter.
    """
    digits = digits.lstrip("0") or "0"
    return int(digits) if len(digits) <= _MAX_DIGITS else _BEYOND


def _before(a: str, b: str) -> bool:
    """Whether the decimal ``a`` is less than ``b``, exactly, however long they are."""
    a, b = a.lstrip("0"), b.lstrip("0")
    return (len(a), a) < (len(b), b)


def parse_range(header: str | None, size: int) -> tuple[int, int] | None:
    """``Range`` → ``(start, end_exclusive)``, ``None`` for the whole object.

    Like S3: syntactically invalid or multi-range headers (and ``last < first``) are ignored
    (whole object); a range that starts at or beyond the end is 416; an end or a suffix past the
    end is clamped to the object. Numbers of any length are compared exactly.
    """
    if not header:
        return None
    match = _RANGE_RE.match(header.strip())
    if not match:
        return None
    first, last = match.group(1), match.group(2)
    if not first and not last:
        return None
    if not first:  # suffix: the last N bytes
        length = _position(last)
        if length == 0:
            raise InvalidRange("suffix range of zero bytes", size)
        return max(size - length, 0), size
    if last and _before(last, first):
        return None
    start = _position(first)
    end = size if not last else min(_position(last) + 1, size)
    if start >= size:
        shown = first if len(first) <= 40 else f"{first[:20]}...({len(first)} digits)"
        raise InvalidRange(f"range start {shown} is beyond the object's {size} bytes", size)
    return start, end


def requested_range(header: str | None) -> tuple[int, int] | None:
    """The ``[start, end)`` of a ``Range`` of one explicit span (``bytes=FIRST-LAST``, ``FIRST <=
    LAST``), before the object's size is known; ``None`` for anything else (no range, a suffix, an
    open end, several ranges, malformed, numbers past any object): those need the size first.
    The end may lie past the object's (clamped once the size is known, as :func:`parse_range` does)."""
    if not header:
        return None
    match = _RANGE_RE.match(header.strip())
    if not match or not match.group(1) or not match.group(2):
        return None
    first, last = _position(match.group(1)), _position(match.group(2))
    if last < first or last >= _BEYOND:
        return None
    return first, last + 1
