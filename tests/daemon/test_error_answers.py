"""The daemon's one error answer (sidecar.daemon.app.error_answer): S3 XML on the S3 API, JSON on
the control API, a bug's details kept out of both."""

from __future__ import annotations

import json

from aiohttp import web
from aiohttp.test_utils import make_mocked_request

from sidecar.daemon.app import error_answer
from sidecar.errors import Busy, InvalidRange
from wire.errors import BodyTooLarge, InvalidBody


def body(resp: web.Response) -> bytes:
    assert isinstance(resp.body, bytes)
    return resp.body


def test_a_bug_on_the_s3_api_is_an_xml_500_without_its_details() -> None:
    resp = error_answer(make_mocked_request("GET", "/bk/train/0.tar"), RuntimeError("secret internals"))
    assert resp.status == 500 and resp.content_type == "application/xml"
    assert b"<Code>InternalError</Code>" in body(resp) and b"secret internals" not in body(resp)


def test_a_bug_on_the_control_api_is_a_json_500() -> None:
    resp = error_answer(make_mocked_request("POST", "/_shardcache/prefetch"), KeyError("secret internals"))
    assert resp.status == 500
    answer = json.loads(body(resp))
    assert answer["error"] == "InternalError" and "secret" not in answer["message"]


def test_body_errors_on_the_control_api() -> None:
    request = make_mocked_request("POST", "/_shardcache/warmups")
    resp = error_answer(request, BodyTooLarge("request body is over the 10-byte limit", 10))
    assert (resp.status, json.loads(body(resp))) == (413, {"error": "BodyTooLarge", "message": "request body is over the 10-byte limit"})
    resp = error_answer(request, InvalidBody("request body is not JSON: x"))
    assert (resp.status, json.loads(body(resp))["error"]) == (400, "InvalidArgument")


def test_busy_says_when_to_retry_and_ranges_say_the_size() -> None:
    resp = error_answer(make_mocked_request("POST", "/_shardcache/warmups"), Busy("64 running", retry_after=5))
    assert (resp.status, resp.headers["Retry-After"], json.loads(body(resp))["error"]) == (503, "5", "SlowDown")
    resp = error_answer(make_mocked_request("GET", "/bk/k"), InvalidRange("beyond the end", size=10))
    assert (resp.status, resp.headers["Content-Range"]) == (416, "bytes */10")


def test_aiohttp_errors_keep_their_status_in_either_format() -> None:
    resp = error_answer(make_mocked_request("GET", "/_shardcache/stats"), web.HTTPRequestEntityTooLarge(max_size=1, actual_size=2))
    assert (resp.status, json.loads(body(resp))["error"]) == (413, "BodyTooLarge")
    resp = error_answer(make_mocked_request("PUT", "/bk/k"), web.HTTPMethodNotAllowed("PUT", ["GET"]))
    assert resp.status == 405 and b"<Code>MethodNotAllowed</Code>" in body(resp)
