"""The daemon's side of S3's HTTP: error answers as ``aiohttp`` responses and ``Range`` headers.

The XML itself (error bodies, listings) is :mod:`wire.s3xml`, shared with the loader.
"""

from __future__ import annotations

import re
import uuid

from aiohttp import web

from sidecar.errors import InvalidRange
from wire.s3xml import error_xml

__all__ = ["error_response", "parse_range"]

_RANGE_RE = re.compile(r"^bytes=(\d*)-(\d*)$")


def error_response(status: int, code: str, message: str, resource: str = "", headers: dict[str, str] | None = None) -> web.Response:
    request_id = uuid.uuid4().hex[:16].upper()
    all_headers = {"x-amz-request-id": request_id}
    all_headers.update(headers or {})
    body = error_xml(code, message, resource, request_id)
    return web.Response(status=status, body=body, content_type="application/xml", headers=all_headers)


def parse_range(header: str | None, size: int) -> tuple[int, int] | None:
    """``Range`` → ``(start, end_exclusive)``, ``None`` for the whole object.

    Like S3: syntactically invalid or multi-range headers are ignored (whole object); a range that
    starts at or beyond the end is 416.
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
        length = int(last)
        if length == 0:
            raise InvalidRange("suffix range of zero bytes", size)
        return max(size - length, 0), size
    start = int(first)
    end = size if not last else min(int(last) + 1, size)
    if last and int(last) < start:
        return None
    if start >= size:
        raise InvalidRange(f"range start {start} is beyond the object's {size} bytes", size)
    return start, end
