"""The small JSON clients' one exchange (``wire.httpclient.exchange``) against a real HTTP server
on a loopback socket, and through the three clients built on it: a connection the server closed
while idle costs one silent retry, a cut or oversized answer is an error and its connection is
never reused (an unread rest would be parsed as the next answer)."""

from __future__ import annotations

import http.client
import os
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from loader.daemon import DaemonClient as LoaderDaemonClient
from loader.master.client import MasterClient
from loader.master.errors import MasterUnavailable
from loader.settings import LoaderSettings
from sidecar.cli import control as daemon_client
from sidecar.cli.control import ControlClient, DaemonUnavailable
from tests.support.processes import free_port
from tests.support.threads import serving
from wire.httpclient import AnswerTooLarge, exchange

SMALL = b'{"ok": true}'


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive

    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:  # http.server's naming
        server: _Server = self.server  # type: ignore[assignment]
        server.peers.add(self.client_address)
        server.requests += 1
        body = {"/big": b"x" * 4096}.get(self.path.split("?")[0], SMALL)
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.path == "/cut":  # half the body, then the connection is gone
            self.wfile.write(body[:4])
            self.wfile.flush()
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)
            return
        self.wfile.write(body)
        if self.path == "/close-after":
            # Closed silently after a whole answer, no "Connection: close": what an idle timeout
            # on the server side looks like to the client's next request.
            self.close_connection = True

    do_POST = do_GET


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", free_port()), _Handler)
        self.peers: set[tuple[str, int]] = set()
        self.requests = 0


@pytest.fixture
def server() -> Iterator[_Server]:
    srv = _Server()
    with serving(srv):
        yield srv


class _Pool:
    """One pooled connection, as each client keeps (per thread)."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.conn: http.client.HTTPConnection | None = None
        self.made = 0
        self.discarded = 0

    def connection(self) -> http.client.HTTPConnection:
        if self.conn is None:
            self.conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=5)
            self.made += 1
        return self.conn

    def discard(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None
            self.discarded += 1

    def get(self, path: str, max_body: int = 1 << 20) -> tuple[int, bytes]:
        status, _, data = exchange(self.connection, self.discard, "GET", path, max_body=max_body)
        return status, data


def test_one_connection_serves_many_exchanges(server: _Server) -> None:
    pool = _Pool(server.server_address[1])
    for _ in range(5):
        assert pool.get("/obj") == (200, SMALL)
    assert len(server.peers) == 1 and pool.made == 1 and pool.discarded == 0
    pool.discard()


def test_a_connection_closed_while_idle_is_replaced_silently(server: _Server) -> None:
    pool = _Pool(server.server_address[1])
    assert pool.get("/close-after") == (200, SMALL)
    assert pool.conn is not None  # nothing announced the close: the client keeps it
    server.requests = 0
    assert pool.get("/obj") == (200, SMALL)
    assert pool.made == 2 and len(server.peers) == 2
    assert server.requests == 1  # the dead connection carried nothing: one request reached the server
    pool.discard()


def test_a_refused_connection_is_not_retried_here(server: _Server) -> None:
    pool = _Pool(free_port())  # nobody listens: the caller's own policy decides what to do
    with pytest.raises(ConnectionRefusedError):
        pool.get("/obj")
    assert pool.made == 1 and pool.discarded == 1


def test_a_cut_answer_is_an_error_and_its_connection_is_dropped(server: _Server) -> None:
    pool = _Pool(server.server_address[1])
    with pytest.raises(http.client.IncompleteRead):
        pool.get("/cut")
    assert pool.conn is None
    assert pool.get("/obj") == (200, SMALL)  # the next exchange starts clean
    pool.discard()


def test_an_oversized_answer_is_an_error_and_its_connection_is_dropped(server: _Server) -> None:
    pool = _Pool(server.server_address[1])
    with pytest.raises(AnswerTooLarge, match="larger than 1000 bytes"):
        pool.get("/big", max_body=1000)
    assert pool.conn is None  # 3 KiB of it unread: reusing the connection would misparse them
    assert pool.get("/obj") == (200, SMALL)
    assert pool.get("/big", max_body=4096)[1] == b"x" * 4096  # exactly the bound is fine
    pool.discard()


def test_the_cli_daemon_client_reconnects_and_rejects_cut_or_oversized_answers(
    server: _Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(daemon_client, "_MAX_ANSWER", 1000)
    with ControlClient(f"tcp://127.0.0.1:{server.server_address[1]}") as client:
        assert client.call("GET", "/close-after") == {"ok": True}
        assert client.call("GET", "/obj") == {"ok": True}  # silent reconnect, no error
        with pytest.raises(DaemonUnavailable, match="bytes read"):
            client.call("GET", "/cut")
        with pytest.raises(DaemonUnavailable, match="larger than 1000 bytes"):
            client.call("GET", "/big")
        assert client.call("GET", "/obj") == {"ok": True}


def test_the_master_client_moves_past_a_closed_port_and_gives_up_at_its_deadline(server: _Server) -> None:
    port = server.server_address[1]
    with MasterClient(f"http://127.0.0.1:{free_port()},http://127.0.0.1:{port}", retry_deadline_s=5) as client:
        assert client._call("GET", "/obj") == {"ok": True}
    with MasterClient(f"http://127.0.0.1:{free_port()}", retry_deadline_s=0.3) as client, \
            pytest.raises(MasterUnavailable, match="no master answered"):
        client._call("GET", "/obj")


def test_the_master_client_closes_the_connections_of_every_thread(server: _Server) -> None:
    client = MasterClient(f"http://127.0.0.1:{server.server_address[1]}")
    workers = [threading.Thread(target=client._call, args=("GET", "/obj")) for _ in range(3)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(10)
    opened = set(client._conns._open)
    assert len(opened) == 3 and len(server.peers) == 3  # one kept-alive connection per thread
    client.close()
    assert all(conn.sock is None for conn in opened)
    assert client._call("GET", "/obj") == {"ok": True}  # still usable: a fresh connection
    client.close()


def test_a_forked_child_never_talks_on_the_parents_connection(server: _Server) -> None:
    client = MasterClient(f"http://127.0.0.1:{server.server_address[1]}")
    assert client._call("GET", "/obj") == {"ok": True}
    pid = os.fork()
    if pid == 0:  # the child: the outcome is its exit status, nothing else may leave it
        code = 1
        try:
            code = 0 if client._call("GET", "/obj") == {"ok": True} and client._conns.open_count() == 1 else 2
            client.close()
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert len(server.peers) == 2  # the child opened its own connection
    assert client._call("GET", "/obj") == {"ok": True}  # and left the parent's alone
    assert len(server.peers) == 2
    client.close()


def test_the_loader_daemon_client_closes_the_connections_of_every_thread(server: _Server) -> None:
    client = LoaderDaemonClient(f"http://127.0.0.1:{server.server_address[1]}", LoaderSettings())
    readers = [threading.Thread(target=client.stats) for _ in range(2)]
    for reader in readers:
        reader.start()
    for reader in readers:
        reader.join(10)
    assert client.stats() == {"ok": True}
    opened = set(client._conns._open)
    assert len(opened) == 3 and len(server.peers) == 3
    client.close()  # what ShardLoader.close() reaches through its source
    assert all(conn.sock is None for conn in opened)
    assert client.stats() == {"ok": True}
    client.close()
