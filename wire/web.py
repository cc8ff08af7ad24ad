"""The aiohttp request plumbing of the three servers (the node daemon, the lease master and the
admission webhook): bounded request bodies, JSON object bodies, and the middleware that turns
every error into the app's own error answer.

The only :mod:`wire` module that imports aiohttp; only servers import it. What an error looks
like on the wire (S3 XML, ``{"error", "message"}`` JSON, the webhook's ``{"error"}``) stays with
each app: it hands :func:`error_middleware` one function that maps an exception to its answer.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from typing import Any

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from wire.errors import BodyTooLarge, InvalidBody

__all__ = [
    "HTTP_CODES",
    "ErrorAnswer",
    "decode_json_object",
    "error_middleware",
    "http_code",
    "read_body",
    "read_json_object",
]

ErrorAnswer = Callable[[web.Request, Exception], web.StreamResponse]
"""An app's one mapping from an exception (aiohttp's ``HTTPException`` included) to its answer."""

HTTP_CODES = {
    400: "BadRequest",
    404: "NotFound",
    405: "MethodNotAllowed",
    413: "BodyTooLarge",
    431: "HeadersTooLarge",
}
"""The ``"error"`` code of JSON answers to aiohttp's own errors (unknown route, wrong method)."""

_READ_CHUNK = 1 << 20
# Decoding a few megabytes of JSON takes milliseconds of CPU: larger bodies decode off the loop.
_OFFLOAD_BYTES = 1 << 20


def http_code(status: int) -> str:
    """The JSON error code of an aiohttp error status (``"HTTPError"`` for the rare others)."""
    return HTTP_CODES.get(status, "HTTPError")


async def read_body(request: web.Request, limit: int, advice: str = "") -> bytes:
    """The whole request body, at most ``limit`` bytes, or :class:`~wire.errors.BodyTooLarge`.

    A declared ``Content-Length`` over the limit is refused before reading anything; a chunked
    body (or one that lies about its length) is refused as soon as the bytes read pass the limit,
    so a client cannot make the server buffer more than ``limit`` whatever its headers say.
    """
    tail = f"; {advice}" if advice else ""
    length = request.content_length
    if length is not None and length > limit:
        raise BodyTooLarge(f"request body of {length} bytes is over the {limit}-byte limit{tail}", limit)
    data = bytearray()
    while True:
        # StreamReader.read(n) returns what has arrived, up to n bytes: loop to EOF.
        chunk = await request.content.read(_READ_CHUNK)
        if not chunk:
            return bytes(data)
        data += chunk
        if len(data) > limit:
            raise BodyTooLarge(f"request body is over the {limit}-byte limit{tail}", limit)


def decode_json_object(raw: bytes, what: str = "a JSON object") -> dict[str, Any]:
    """The JSON object in ``raw`` (UTF-8, as RFC 8259 requires), or :class:`~wire.errors.InvalidBody`.

    ``what`` names the object in the messages (``"an AdmissionReview object"``). Pure CPU work:
    callers with large bodies run it on a thread (:func:`read_json_object` does).
    """
    if not raw:
        raise InvalidBody(f"request body is empty: send {what}")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidBody(f"request body is not JSON: it is not UTF-8 ({exc})") from None
    try:
        body = json.loads(text)
    except ValueError as exc:
        raise InvalidBody(f"request body is not JSON: {str(exc)[:200]}") from None
    except RecursionError:
        raise InvalidBody("request body is not JSON: nested too deeply") from None
    if not isinstance(body, dict):
        raise InvalidBody(f"request body must be {what}")
    return body


async def read_json_object(request: web.Request, limit: int, advice: str = "") -> dict[str, Any]:
    """:func:`read_body` then :func:`decode_json_object`, large bodies decoded off the event loop."""
    raw = await read_body(request, limit, advice)
    if len(raw) > _OFFLOAD_BYTES:
        return await asyncio.to_thread(decode_json_object, raw)
    return decode_json_object(raw)


def error_middleware(answer: ErrorAnswer, *, known: tuple[type[Exception], ...], log: logging.Logger) -> Middleware:
    """A middleware that answers every error of a handler through ``answer(request, exc)``.

    ``exc`` is aiohttp's ``HTTPException`` (4xx/5xx: unknown route, wrong method, oversized body),
    one of the app's ``known`` errors, or anything else: a bug, logged here with its traceback;
    ``answer`` gives it a 500 in the app's format, so no error is answered with aiohttp's bare
    text page. Redirects and other non-error ``HTTPException``\\ s pass through as answers.
    """

    @web.middleware
    async def errors(request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            error: Exception = exc
        except Exception as exc:
            if request.writer.output_size > 0:
                # The answer was already under way: another one cannot follow on this connection.
                # aiohttp logs it and closes the connection.
                raise
            if not isinstance(exc, known):
                log.exception("internal error serving %s %s", request.method, request.path[:200])
            error = exc
        try:
            return answer(request, error)
        except Exception:  # the error answer itself failed: still answer, and say so in the log
            log.exception("cannot answer the error of %s %s", request.method, request.path[:200])
            return web.json_response({"error": "InternalError", "message": "internal error; see the server's log"},
                                     status=500)

    return errors
