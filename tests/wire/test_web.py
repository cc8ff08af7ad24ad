"""wire.web against a real aiohttp server on 127.0.0.1: bounded bodies (declared and chunked),
JSON object bodies, and the error middleware's answers, bugs included."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from hypothesis import given
from hypothesis import strategies as st

from tests.support.processes import free_port
from wire.errors import BodyTooLarge, InvalidBody, WireError
from wire.web import (
    ConnectionGuard,
    ConnectionLimits,
    GuardedSite,
    decode_json_object,
    error_middleware,
    http_code,
    read_body,
    read_json_object,
)

LIMIT = 64 * 1024
log = logging.getLogger("tests.wire.web")


def answer(request: web.Request, exc: Exception) -> web.Response:
    """A test app's one error mapping, shaped like the master's."""
    if isinstance(exc, BodyTooLarge):
        return web.json_response({"error": "BodyTooLarge", "message": str(exc)}, status=413)
    if isinstance(exc, WireError):
        return web.json_response({"error": "BadRequest", "message": str(exc)}, status=400)
    if isinstance(exc, web.HTTPException):
        return web.json_response({"error": http_code(exc.status), "message": exc.reason}, status=exc.status)
    return web.json_response({"error": "InternalError", "message": "internal error; see the log"}, status=500)


async def echo_json(request: web.Request) -> web.Response:
    return web.json_response({"got": await read_json_object(request, LIMIT)})


async def echo_size(request: web.Request) -> web.Response:
    return web.json_response({"size": len(await read_body(request, LIMIT, advice="send less"))})


async def boom(request: web.Request) -> web.Response:
    raise RuntimeError("secret internals")


async def redirect(request: web.Request) -> web.Response:
    raise web.HTTPFound("/size")


async def half_sent(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse()
    await response.prepare(request)
    await response.write(b"partial")
    raise RuntimeError("failed after the answer started")


def make_app(mapping: Callable[[web.Request, Exception], web.StreamResponse] = answer) -> web.Application:
    app = web.Application(middlewares=[error_middleware(mapping, known=(WireError,), log=log)])
    app.router.add_post("/json", echo_json)
    app.router.add_post("/size", echo_size)
    app.router.add_get("/boom", boom)
    app.router.add_get("/redirect", redirect)
    app.router.add_get("/half", half_sent)
    return app


@asynccontextmanager
async def serving(app: web.Application) -> AsyncIterator[tuple[str, int]]:
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        host, port = runner.addresses[0][:2]
        yield f"http://{host}:{port}", port
    finally:
        await runner.cleanup()


def run(scenario: Callable[[str, int, aiohttp.ClientSession], Awaitable[None]], app: web.Application | None = None) -> None:
    async def main() -> None:
        async with serving(app or make_app()) as (url, port), aiohttp.ClientSession() as session:
            await scenario(url, port, session)

    asyncio.run(main())


async def post(session: aiohttp.ClientSession, url: str, data: Any) -> tuple[int, Any]:
    async with session.post(url, data=data, headers={"Content-Type": "application/json"}) as resp:
        return resp.status, await resp.json()


# -- bounded bodies ------------------------------------------------------------------------------


def test_body_at_the_limit_is_read_whole() -> None:
    async def scenario(url: str, port: int, session: aiohttp.ClientSession) -> None:
        assert await post(session, url + "/size", b"x" * LIMIT) == (200, {"size": LIMIT})
        assert await post(session, url + "/size", b"") == (200, {"size": 0})

    run(scenario)


def test_declared_oversized_body_is_413_before_it_is_sent() -> None:
    async def scenario(url: str, port: int, session: aiohttp.ClientSession) -> None:
        # Only the headers go out: the answer must come without the server waiting for the body.
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(
                b"POST /size HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                + f"Content-Length: {LIMIT + 1}\r\n\r\n".encode()
            )
            await writer.drain()
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        finally:
            writer.close()
        assert head.startswith(b"HTTP/1.1 413"), head
        status, body = await post(session, url + "/size", b"y" * (LIMIT + 1))
        assert status == 413 and body["error"] == "BodyTooLarge"
        assert f"{LIMIT + 1} bytes" in body["message"] and f"{LIMIT}-byte limit" in body["message"]
        assert body["message"].endswith("; send less")

    run(scenario)


def test_chunked_oversized_body_is_413_by_the_bytes_read() -> None:
    async def chunks(total: int) -> AsyncIterator[bytes]:
        piece = b" " * 16384
        for _ in range(total // len(piece)):
            yield piece

    async def scenario(url: str, port: int, session: aiohttp.ClientSession) -> None:
        # An async generator has no length: aiohttp sends it chunked, without Content-Length.
        status, body = await post(session, url + "/size", chunks(LIMIT * 4))
        assert status == 413 and body["error"] == "BodyTooLarge"
        assert "over the 65536-byte limit" in body["message"]
        status, body = await post(session, url + "/json", chunks(LIMIT * 4))
        assert status == 413 and body["error"] == "BodyTooLarge"
        # Within the limit, chunked is fine.
        assert await post(session, url + "/size", chunks(LIMIT)) == (200, {"size": LIMIT})

    run(scenario)


# -- JSON object bodies --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "fragment"),
    [
        (b"{not json", "not JSON"),
        (b"", "empty"),
        (b"[1, 2]", "must be a JSON object"),
        (b'"text"', "must be a JSON object"),
        (b"null", "must be a JSON object"),
        (b"\xff\xfe\x00garbage", "not UTF-8"),
        ('{"a": 1}'.encode("utf-16"), "not UTF-8"),
        (b"[" * 20_000 + b"]" * 20_000, "not JSON"),
    ],
    ids=["invalid", "empty", "array", "string", "null", "binary", "utf-16", "deep-nesting"],
)
def test_bad_json_bodies_are_400_with_a_clear_message(raw: bytes, fragment: str) -> None:
    async def scenario(url: str, port: int, session: aiohttp.ClientSession) -> None:
        status, body = await post(session, url + "/json", raw)
        assert status == 400 and body["error"] == "BadRequest" and fragment in body["message"], body

    run(scenario)


def test_json_object_body_is_decoded() -> None:
    async def scenario(url: str, port: int, session: aiohttp.ClientSession) -> None:
        doc = {"name": "caf\u00e9", "n": [1, 2.5, None, True]}
        assert await post(session, url + "/json", json.dumps(doc).encode()) == (200, {"got": doc})
        big = {"k": "v" * (LIMIT - 100)}  # just under the limit
        assert await post(session, url + "/json", json.dumps(big).encode()) == (200, {"got": big})

    run(scenario)


@given(st.dictionaries(st.text(), st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(), lambda kids: st.lists(kids) | st.dictionaries(st.text(), kids),
    max_leaves=10,
)))
def test_decode_round_trips_any_object(doc: dict[str, Any]) -> None:
    assert decode_json_object(json.dumps(doc, ensure_ascii=False).encode()) == doc


@given(st.binary(max_size=200))
def test_decode_raises_only_invalid_body(raw: bytes) -> None:
    try:
        body = decode_json_object(raw)
    except InvalidBody as exc:
        assert str(exc).startswith("request body ")
    else:
        assert isinstance(body, dict)


def test_decode_names_the_object_it_wants() -> None:
    with pytest.raises(InvalidBody, match="must be an AdmissionReview object"):
        decode_json_object(b"[]", what="an AdmissionReview object")
    with pytest.raises(InvalidBody, match="empty: send an AdmissionReview object"):
        decode_json_object(b"", what="an AdmissionReview object")
    assert issubclass(BodyTooLarge, InvalidBody) and issubclass(InvalidBody, ValueError)


# -- the error middleware ------------------------------------------------------------------------


def test_unexpected_exception_is_a_logged_500_with_a_body(caplog: pytest.LogCaptureFixture) -> None:
    async def scenario(url: str, port: int, session: aiohttp.ClientSession) -> None:
        async with session.get(url + "/boom") as resp:
            assert resp.status == 500 and resp.content_type == "application/json"
            body = await resp.json()
        assert body == {"error": "InternalError", "message": "internal error; see the log"}

    with caplog.at_level(logging.ERROR, logger=log.name):
        run(scenario)
    records = [r for r in caplog.records if r.name == log.name]
    assert records and "GET /boom" in records[0].getMessage()
    assert records[0].exc_info is not None and "secret internals" in str(records[0].exc_info[1])


def test_known_errors_are_answered_without_a_traceback(caplog: pytest.LogCaptureFixture) -> None:
    async def scenario(url: str, port: int, session: aiohttp.ClientSession) -> None:
        assert (await post(session, url + "/json", b"{bad"))[0] == 400

    with caplog.at_level(logging.ERROR, logger=log.name):
        run(scenario)
    assert not [r for r in caplog.records if r.name == log.name]


def test_aiohttp_errors_go_through_the_mapping_and_redirects_pass() -> None:
    async def scenario(url: str, port: int, session: aiohttp.ClientSession) -> None:
        async with session.get(url + "/nowhere") as resp:
            assert (resp.status, (await resp.json())["error"]) == (404, "NotFound")
        async with session.delete(url + "/json") as resp:
            assert (resp.status, (await resp.json())["error"]) == (405, "MethodNotAllowed")
        async with session.get(url + "/redirect", allow_redirects=False) as resp:
            assert resp.status == 302 and resp.headers["Location"] == "/size"

    run(scenario)


def test_a_failing_mapping_still_answers_500_with_a_body() -> None:
    def broken(request: web.Request, exc: Exception) -> web.Response:
        raise KeyError("the mapping has a bug too")

    async def scenario(url: str, port: int, session: aiohttp.ClientSession) -> None:
        async with session.get(url + "/boom") as resp:
            assert resp.status == 500 and (await resp.json())["error"] == "InternalError"

    run(scenario, make_app(broken))


def test_an_answer_already_under_way_is_not_followed_by_another() -> None:
    async def scenario(url: str, port: int, session: aiohttp.ClientSession) -> None:
        async with session.get(url + "/half") as resp:
            assert resp.status == 200
            try:
                data = await resp.read()
            except aiohttp.ClientPayloadError:
                data = b"partial"  # the connection was cut mid-answer: what aiohttp does
        assert b"InternalError" not in data
        async with session.get(url + "/boom") as resp:  # the server still serves
            assert resp.status == 500

    run(scenario)


# -- connection limits ---------------------------------------------------------------------------

# Short bounds, so that a test waits for them in well under a second each.
SHORT = ConnectionLimits(header_timeout_s=0.5, idle_timeout_s=0.5, max_connections=3)


@asynccontextmanager
async def guarded(limits: ConnectionLimits = SHORT, unix: str | None = None) -> AsyncIterator[tuple[ConnectionGuard, int]]:
    runner = web.AppRunner(make_app(), access_log=None, **limits.runner_args())
    await runner.setup()
    guard = ConnectionGuard(limits, log)
    site = GuardedSite(runner, guard, path=unix) if unix else GuardedSite(runner, guard, host="127.0.0.1", port=0)
    await site.start()
    try:
        yield guard, site.port
    finally:
        await runner.cleanup()


async def closed_within(reader: asyncio.StreamReader, seconds: float) -> bytes:
    """What the server sends before it closes the connection, failing if it is still open."""
    return await asyncio.wait_for(reader.read(), seconds)


async def wait_for(predicate: Callable[[], bool], seconds: float = 10.0) -> None:
    async def poll() -> None:
        while not predicate():
            await asyncio.sleep(0.01)

    await asyncio.wait_for(poll(), seconds)


async def get_size(port: int, body: bytes = b"x") -> int:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(b"POST /size HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                     + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        answer = await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()
    assert answer.startswith(b"HTTP/1.1 200"), answer
    return int(json.loads(answer.split(b"\r\n\r\n", 1)[1])["size"])


@pytest.mark.parametrize("sent", [b"", b"GET /size HTTP/1.1\r\nHost: x\r\nX-Half: "], ids=["nothing", "half-headers"])
def test_a_connection_without_a_whole_request_head_is_closed_within_the_bound(sent: bytes) -> None:
    async def main() -> None:
        async with guarded() as (guard, port):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            try:
                writer.write(sent)
                await writer.drain()
                await wait_for(lambda: guard.active == 1)
                assert await closed_within(reader, 5) == b""  # closed, nothing answered
            finally:
                writer.close()
            await wait_for(lambda: guard.active == 0)
            assert guard.timed_out == 1
            assert await get_size(port) == 1

    asyncio.run(main())


def test_a_head_trickled_in_pieces_is_served_and_the_header_timer_stops() -> None:
    async def main() -> None:
        async with guarded(ConnectionLimits(header_timeout_s=0.5, idle_timeout_s=30, max_connections=3)) as (guard, port):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            try:
                # The blank line split across writes, then a body longer than the header bound.
                for piece in (b"POST /size HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r", b"\n\r", b"\n", b"ab"):
                    writer.write(piece)
                    await writer.drain()
                    await asyncio.sleep(0.05)
                await asyncio.sleep(0.7)  # past the header bound: the head is in, the timer is off
                writer.write(b"cd")
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
                assert head.startswith(b"HTTP/1.1 200"), head
                assert guard.timed_out == 0
            finally:
                writer.close()

    asyncio.run(main())


def test_an_idle_kept_alive_connection_is_closed_after_the_idle_bound() -> None:
    async def main() -> None:
        async with guarded() as (guard, port):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            try:
                writer.write(b"POST /size HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\nab")
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
                assert head.startswith(b"HTTP/1.1 200") and b"close" not in head.lower()
                await asyncio.wait_for(reader.readuntil(b"}"), 10)  # the body: {"size": 2}
                writer.write(b"POST /size HTTP/1.1\r\nHost: x\r\n")  # and half of the next head
                assert await closed_within(reader, 5) == b""
            finally:
                writer.close()
            await wait_for(lambda: guard.active == 0)

    asyncio.run(main())


def test_connections_beyond_the_limit_are_refused_until_the_slow_ones_go() -> None:
    async def main() -> None:
        limits = ConnectionLimits(header_timeout_s=1.0, idle_timeout_s=1.0, max_connections=3)
        async with guarded(limits) as (guard, port):
            slow = [await asyncio.open_connection("127.0.0.1", port) for _ in range(3)]
            try:
                await wait_for(lambda: guard.active == 3)
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                answer = await closed_within(reader, 5)
                writer.close()
                assert answer.startswith(b"HTTP/1.1 503") and b"Retry-After: 1" in answer, answer
                assert guard.refused == 1 and guard.active == 3
                # The slow ones are closed by the header bound; then everyone is served again.
                for slow_reader, _ in slow:
                    assert await closed_within(slow_reader, 5) == b""
                await wait_for(lambda: guard.active == 0)
                sizes = await asyncio.gather(*(get_size(port, b"y" * n) for n in (1, 2, 3)))
                assert sizes == [1, 2, 3]
            finally:
                for _, slow_writer in slow:
                    slow_writer.close()

    asyncio.run(main())


def test_a_guarded_unix_socket_serves_and_bounds_the_same(tmp_path: Any) -> None:
    async def main() -> None:
        path = str(tmp_path / "s.sock")
        async with guarded(unix=path) as (guard, _):
            reader, writer = await asyncio.open_unix_connection(path)
            writer.write(b"POST /size HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\nabc")
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
            assert head.startswith(b"HTTP/1.1 200")
            writer.close()
            reader, writer = await asyncio.open_unix_connection(path)
            try:
                writer.write(b"GET /size HTTP/1.1\r\n")
                assert await closed_within(reader, 5) == b""
            finally:
                writer.close()
            assert guard.timed_out == 1

    asyncio.run(main())


def test_limits_are_validated() -> None:
    for bad in ({"header_timeout_s": 0}, {"idle_timeout_s": -1}, {"max_connections": 0}):
        with pytest.raises(ValueError):
            ConnectionLimits(**bad)
    assert ConnectionLimits().runner_args() == {"keepalive_timeout": 75.0}


# -- the other two servers: deep JSON is a 400, and the master's listeners are guarded -----------

DEEP = b'{"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
DEEP_SMALL = b'{"a": ' + b"[" * 30_000 + b"]" * 30_000 + b"}"  # within the master's 64 KiB small-body limit


def test_the_master_answers_deep_json_with_400_and_closes_slow_connections(tmp_path: Any) -> None:
    from loader.master.server.app import serve
    from loader.master.server.settings import MasterSettings

    async def main() -> None:
        port = free_port()
        settings = MasterSettings(listen=(f"tcp://127.0.0.1:{port}",), state=f"sqlite://{tmp_path}/m.db", connections=SHORT)
        stop, ready = asyncio.Event(), asyncio.Event()
        task = asyncio.create_task(serve(settings, stop=stop, on_ready=ready.set))
        try:
            await asyncio.wait_for(ready.wait(), 30)
            async with aiohttp.ClientSession() as session:
                status, body = await post(session, f"http://127.0.0.1:{port}/v1/jobs/j/leases", DEEP_SMALL)
                assert status == 400 and "nested too deeply" in body["message"], body
                # The create body is parsed as it streams (no recursion): refused at the first field
                # that cannot be a spec's, however deep the rest goes.
                for deep in (DEEP, b'{"name": "j", "dataset": "s3://b/", "shards": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"):
                    status, body = await post(session, f"http://127.0.0.1:{port}/v1/jobs", deep)
                    assert status == 400 and body["error"] == "BadRequest", body
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            try:
                writer.write(b"GET /healthz HTTP/1.1\r\nHo")
                assert await closed_within(reader, 5) == b""
            finally:
                writer.close()
        finally:
            stop.set()
            await asyncio.wait_for(task, 30)

    asyncio.run(main())


def test_the_webhook_answers_deep_json_with_400() -> None:
    from sidecar.k8s.webhook import WebhookSettings
    from sidecar.k8s.webhook import build_app as webhook_app

    async def scenario(url: str, port: int, session: aiohttp.ClientSession) -> None:
        status, body = await post(session, url + "/mutate", DEEP)
        assert status == 400 and "nested too deeply" in json.dumps(body), body

    run(scenario, webhook_app(WebhookSettings()))
