"""The origin's blocking HTTP client against real HTTP servers on loopback sockets: kept-alive
connections are reused, one the server closed while idle costs a silent retry, a stalled or cut
body is an error that names how far it got, and ``abort`` unblocks a read on another thread."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from sidecar.daemon.origins.httppool import HTTPPool
from sidecar.errors import OriginBadResponse, OriginUnavailable
from tests.support.processes import free_port
from tests.support.threads import serving
from tests.support.waits import inside, wait_until

BODY = bytes(range(256)) * 4096  # 1 MiB


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as S3 answers

    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        server: _Server = self.server  # type: ignore[assignment]
        server.peers.add(self.client_address)
        if self.path == "/close-after":
            self.close_connection = True
        self.send_response(200)
        self.send_header("Content-Length", str(len(BODY)))  # every body is announced whole
        self.end_headers()
        if self.path == "/stall":  # 1000 bytes, then nothing until the test releases it
            self.wfile.write(BODY[:1000])
            self.wfile.flush()
            server.release.wait(10)
        elif self.path == "/cut":  # 5000 bytes, then the connection is gone
            self.wfile.write(BODY[:5000])
            self.wfile.flush()
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)
        else:
            self.wfile.write(BODY)


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", free_port()), _Handler)
        self.peers: set[tuple[str, int]] = set()
        self.release = threading.Event()
        self.closed = 0  # connections this server closed

    def close_request(self, request: socket.socket) -> None:  # type: ignore[override]
        super().close_request(request)
        self.closed += 1


@pytest.fixture
def server() -> Iterator[_Server]:
    srv = _Server()
    with serving(srv):
        yield srv
        srv.release.set()  # a handler parked in /stall must end before the server shuts down


def _url(srv: _Server, path: str) -> str:
    return f"http://127.0.0.1:{srv.server_address[1]}{path}"


def _read_all(pool: HTTPPool, url: str) -> bytes:
    resp = pool.request("GET", url)
    buf = bytearray(len(BODY) + 10)
    view = memoryview(buf)
    got = 0
    while count := resp.readinto(view[got:]):
        got += count
    resp.close()
    return bytes(buf[:got])


def test_connections_are_kept_alive_and_reused(server: _Server) -> None:
    pool = HTTPPool(read_timeout_s=5)
    for _ in range(5):
        assert _read_all(pool, _url(server, "/obj")) == BODY
    assert len(server.peers) == 1  # one client port: one connection for five requests
    pool.close()


def test_a_connection_the_server_closed_is_replaced_without_an_error(server: _Server) -> None:
    pool = HTTPPool(read_timeout_s=5)
    # The server announces nothing (no "Connection: close" header) and drops the connection after
    # answering, as an S3 front end does to an idle connection: the pooled one is dead when reused.
    assert _read_all(pool, _url(server, "/close-after")) == BODY
    assert len(pool._idle[("http", "127.0.0.1", server.server_address[1])]) == 1
    wait_until(lambda: server.closed == 1, timeout=5, what="the server to close the connection")
    assert _read_all(pool, _url(server, "/obj")) == BODY
    assert len(server.peers) == 2  # the dead one was replaced by a fresh connection
    pool.close()


def test_a_cut_body_is_an_error_and_its_connection_is_not_reused(server: _Server) -> None:
    pool = HTTPPool(read_timeout_s=5)
    resp = pool.request("GET", _url(server, "/cut"))
    buf = memoryview(bytearray(len(BODY)))
    got = resp.readinto(buf)  # http.client returns what arrived before the end of the stream
    assert 0 < got <= 5000
    assert resp.readinto(buf[got:]) == 0  # the caller checks the total against Content-Length
    resp.close()
    assert not pool._idle.get(("http", "127.0.0.1", server.server_address[1]))
    pool.close()


def test_a_stalled_body_times_out_with_a_clear_error(server: _Server) -> None:
    pool = HTTPPool(read_timeout_s=0.5)
    resp = pool.request("GET", _url(server, "/stall"))
    began = time.monotonic()
    with pytest.raises(OriginBadResponse, match="stalled"):
        resp.readinto(memoryview(bytearray(len(BODY))))
    assert time.monotonic() - began < 5
    resp.close()
    pool.close()


def test_abort_unblocks_a_read_on_another_thread(server: _Server) -> None:
    pool = HTTPPool(read_timeout_s=30)
    resp = pool.request("GET", _url(server, "/stall"))
    outcome: list[object] = []

    def reader() -> None:
        try:
            outcome.append(resp.readinto(memoryview(bytearray(len(BODY)))))
        except Exception as exc:  # noqa: BLE001 - the test looks at what it was
            outcome.append(exc)

    thread = threading.Thread(target=reader)
    thread.start()
    wait_until(lambda: inside(thread, "readinto"), timeout=5, what="the reader to block in readinto")
    resp.abort()
    thread.join(5)
    assert not thread.is_alive(), "abort() did not unblock the reader"
    resp.close()
    pool.close()


def test_a_closed_port_is_origin_unavailable() -> None:
    pool = HTTPPool(connect_timeout_s=2)
    with pytest.raises(OriginUnavailable, match="cannot connect"):
        pool.request("GET", f"http://127.0.0.1:{free_port()}/x")
    with pytest.raises(OriginUnavailable, match="not an http"):
        pool.request("GET", "ftp://127.0.0.1/x")
