"""Short-circuit reads by file handle (``serve --handles``; protocol :mod:`wire.handles`).

Real processes and real unix sockets throughout: a node daemon with ``--handles`` on its socket
directory, a pod sidecar with ``--handles`` on a pod-local socket relaying to it, and the test
process as the app container, which gets descriptors with ``SCM_RIGHTS`` and reads the bytes
from them. Then the same under ``--auth sigv4`` against the IAM-enforcing moto of
``tests/tenancy``: a tenant gets no descriptor of another tenant's cached object.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import xxhash

from sidecar.daemon.auth.proofs import SESSION_PATH, Target, prove, prove_identity
from sidecar.daemon.auth.sigv4 import Credentials, amz_date
from tests.support.handles import ask, connect, read_fd, read_handle, refused
from tests.support.tenancy import NO_CREDENTIALS, SHARD, A, B, IamS3, Serve, start_iam_s3, start_serve
from tests.support.waits import wait_until
from wire.handles import MAX_REPLY, MAX_REQUEST, exchange, recv_message, send_message

IDLE_TIMEOUT_S = 3  # --idle-timeout of every process here: a stalled request is cut quickly
MAX_CONNECTIONS = 64  # --max-connections of the node daemons here (HTTP and handles, each)
OBJECTS = {
    "train/shard-000000.tar": os.urandom(3 * 1024 * 1024 + 17),
    "train/shard-000001.tar": os.urandom(200_000),
    "train/shard-000002.tar": os.urandom(100_000),
    "train/empty.bin": b"",
    "train/a b é.tar": os.urandom(5000),
    "train/manifest.json": b'{"shards": []}',
}
SHARD0, SHARD1, SHARD2 = "train/shard-000000.tar", "train/shard-000001.tar", "train/shard-000002.tar"


def open_files_under(pid: int, root: Path) -> list[str]:
    """What process ``pid`` holds open below ``root`` (its cache directory)."""
    found = []
    for entry in os.scandir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(entry.path)
        except OSError:
            continue  # closed meanwhile
        if target.startswith(str(root)):
            found.append(target)
    return found


def closes_cache_files(pid: int, root: Path) -> None:
    wait_until(lambda: not open_files_under(pid, root), timeout=10, what=f"pid {pid} to close its cache files")


# -- a node and a pod, no tenants -----------------------------------------------------------------


@dataclass
class Pod:
    daemon: Serve
    daemon_args: list[str]
    node_handles: Path
    sidecar: Serve
    pod_handles: Path
    bucket: str


def _daemon_args(sockets: Path, endpoint: str, extra: list[str] = []) -> list[str]:  # noqa: B006 (read only)
    return ["--listen", f"unix://{sockets}/daemon.sock", "--handles", f"unix://{sockets}/handles.sock",
            "--s3-endpoint", endpoint, "--idle-timeout", str(IDLE_TIMEOUT_S), "--max-connections", str(MAX_CONNECTIONS),
            *extra]


def _sidecar_args(sockets: Path, pod: Path, endpoint: str) -> list[str]:
    # No --upstream-handles: handles.sock next to the --upstream socket, as in the chart.
    return ["--mode", "sidecar", "--upstream", f"unix://{sockets}/daemon.sock", "--handles", f"unix://{pod}/handles.sock",
            "--s3-endpoint", endpoint, "--idle-timeout", str(IDLE_TIMEOUT_S)]


@pytest.fixture(scope="module")
def pod(s3_server: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pod]:
    bucket = s3_server.new_bucket()
    client = s3_server.client()
    for key, data in OBJECTS.items():
        client.put_object(Bucket=bucket, Key=key, Body=data)
    tmp = tmp_path_factory.mktemp("handles")
    sockets, pod_dir = tmp / "node", tmp / "pod"
    args = _daemon_args(sockets, s3_server.endpoint)
    daemon = start_serve(tmp, "daemon", args, {})
    try:
        sidecar = start_serve(tmp, "sidecar", _sidecar_args(sockets, pod_dir, s3_server.endpoint), {})
    except BaseException:
        daemon.stop()
        raise
    try:
        yield Pod(daemon, args, sockets / "handles.sock", sidecar, pod_dir / "handles.sock", bucket)
    finally:
        sidecar.stop()
        daemon.stop()


def test_a_miss_then_a_hit_through_the_sidecar(pod: Pod) -> None:
    # As daemon.sock: open to every user; the socket directory's mount is what guards it.
    for path in (pod.node_handles, pod.pod_handles):
        assert path.stat().st_mode & 0o777 == 0o666
    reply, data = read_handle(pod.pod_handles, pod.bucket, SHARD0)
    assert data == OBJECTS[SHARD0]
    assert reply["cache"] in ("miss", "coalesced") and reply["size"] == len(data)
    assert reply["xxh3_128"] == xxhash.xxh3_128_hexdigest(data) and reply["etag"]
    reply, fd = ask(pod.pod_handles, pod.bucket, SHARD0)
    assert reply["status"] == 200 and reply["cache"] == "hit" and fd is not None
    try:
        # Read-only, close-on-exec, and the daemon's published file itself (no copy).
        assert fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDONLY
        assert fcntl.fcntl(fd, fcntl.F_GETFD) & fcntl.FD_CLOEXEC
        with pytest.raises(OSError) as denied:
            os.write(fd, b"x")
        assert denied.value.errno == errno.EBADF
        assert os.readlink(f"/proc/self/fd/{fd}").startswith(str(pod.daemon.cache))
        # Neither the daemon nor the sidecar keeps a copy once it is sent, while the app holds it.
        for pid in (pod.daemon.proc.pid, pod.sidecar.proc.pid):
            closes_cache_files(pid, pod.daemon.cache / "v1" / "data")
    finally:
        os.close(fd)
    # The odd keys: a 0-byte object, spaces and unicode; and the node socket serves directly too.
    for key in ("train/empty.bin", "train/a b é.tar", SHARD1):
        for path in (pod.pod_handles, pod.node_handles):
            assert read_handle(path, pod.bucket, key)[1] == OBJECTS[key]


def test_a_kept_alive_connection_serves_request_after_request(pod: Pod) -> None:
    with connect(pod.pod_handles) as sock:
        for _ in range(20):
            reply, fd = exchange(sock, {"op": "open", "bucket": pod.bucket, "key": SHARD1})
            assert reply["status"] == 200 and fd is not None
            assert read_fd(fd) == OBJECTS[SHARD1]


def test_claims_as_over_http(pod: Pod) -> None:
    digest = xxhash.xxh3_128_hexdigest(OBJECTS[SHARD2])
    # A miss with the right claim, then a hit with it, then a re-hash asked for.
    assert read_handle(pod.pod_handles, pod.bucket, SHARD2, xxh3_128=digest)[1] == OBJECTS[SHARD2]
    reply, data = read_handle(pod.pod_handles, pod.bucket, SHARD2, xxh3_128=digest.upper(), recheck=True)
    assert data == OBJECTS[SHARD2] and reply["cache"] == "hit"
    # A stale manifest's checksum: the origin vouched for the copy, so 409, and no descriptor.
    wrong = "0" * 32
    reply = refused(pod.pod_handles, pod.bucket, SHARD2, xxh3_128=wrong)
    assert reply["status"] == 409 and reply["error"] == "ChecksumMismatch" and wrong in reply["message"]
    reply = refused(pod.pod_handles, pod.bucket, "train/a b é.tar", xxh3_128=wrong)  # a miss compares too
    assert reply["status"] == 409 and reply["error"] == "ChecksumMismatch"


def test_missing_keys_and_what_is_never_cached(pod: Pod) -> None:
    for path in (pod.pod_handles, pod.node_handles):
        reply = refused(path, pod.bucket, "train/no-such-shard.tar")
        assert reply["status"] == 404 and reply["error"] == "NoSuchKey"
        reply = refused(path, "no-such-bucket-here", SHARD0)
        assert reply["status"] == 404 and reply["error"] == "NoSuchBucket"
        # The manifest is never cached: the client reads it over HTTP.
        reply = refused(path, pod.bucket, "train/manifest.json")
        assert reply["status"] == 409 and reply["error"] == "NotCached"


def test_never_a_handle_to_a_file_changed_since_it_was_published(pod: Pod) -> None:
    key = "train/a b é.tar"
    read_handle(pod.pod_handles, pod.bucket, key)  # cached
    data_dir = pod.daemon.cache / "v1" / "data"
    victims = [p for p in data_dir.rglob("*") if p.is_file() and p.read_bytes() == OBJECTS[key]]
    assert len(victims) == 1
    path = victims[0]
    before = path.stat()
    path.chmod(0o644)
    with open(path, "r+b") as handle:
        handle.write(b"X" * 100)  # same size, other bytes
    path.chmod(0o444)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))  # the mtime put back: the ctime moved all the same
    reply, data = read_handle(pod.pod_handles, pod.bucket, key)
    assert data == OBJECTS[key] and reply["cache"] == "miss"  # re-hashed, dropped, fetched again


HOSTILE: list[tuple[str, bytes]] = [
    ("not JSON", b"hello\n"),
    ("not an object", b"[1, 2]\n"),
    ("too long", b'{"op": "open", "key": "' + b"k" * (MAX_REQUEST + 100) + b'"}\n'),
    ("not UTF-8", b'{"op": "open", "bucket": "\xff\xfe"}\n'),
    ("two at once", b'{"op": "open"}\n{"op": "open"}\n'),
    ("a NUL", b"\x00\n"),
    # Deeper than json's recursion limit: RecursionError, not ValueError (wire/jsontext.py).
    ("nested too deeply", b"[" * 5000 + b"\n"),
]
BAD_REQUESTS: list[dict[str, Any]] = [
    {}, {"op": "delete", "bucket": "b-x", "key": "k"}, {"op": 5}, {"op": "open"},
    {"op": "open", "bucket": "..", "key": "k"}, {"op": "open", "bucket": "a", "key": "k"},
    {"op": "open", "bucket": "b-x", "key": "../../etc/passwd"}, {"op": "open", "bucket": "b-x", "key": "a\nb"},
    {"op": "open", "bucket": "b-x", "key": ""}, {"op": "open", "bucket": "b-x", "key": "/abs"},
    {"op": "open", "bucket": 5, "key": "k"}, {"op": "open", "bucket": "b-x", "key": ["k"]},
    {"op": "open", "bucket": "b-x", "key": "k" * 2000}, {"op": "open", "bucket": "b-x", "key": "k", "xxh3_128": "zz"},
    {"op": "open", "bucket": "b-x", "key": "k", "xxh3_128": 5}, {"op": "open", "bucket": "b-x", "key": "k", "recheck": "yes"},
    {"op": "open", "bucket": "b-x", "key": "k", "session": 5}, {"op": "open", "bucket": "b-x", "key": "k", "proof": {}},
]


def _error_or_closed(sock: socket.socket, what: str) -> dict[str, Any] | None:
    """The reply to a hostile request: an error without a descriptor, or ``None`` (hung up)."""
    try:
        received = recv_message(sock, MAX_REPLY)
    except (ConnectionResetError, BrokenPipeError):
        return None
    if received is None:
        return None
    reply, fd = received
    assert fd is None, (what, reply)
    assert reply["status"] == 400 and reply["error"] == "InvalidArgument", (what, reply)
    return reply


@pytest.mark.parametrize("where", ["node", "pod"])
@pytest.mark.slow
def test_hostile_requests_get_an_error_or_a_closed_connection(pod: Pod, where: str) -> None:
    path = pod.node_handles if where == "node" else pod.pod_handles
    for name, data in HOSTILE:
        with connect(path, timeout=10) as sock:
            try:
                sock.sendall(data)
            except (BrokenPipeError, ConnectionResetError):
                continue  # hung up before all was read: fine
            _error_or_closed(sock, name)
    # Well-formed but wrong: 400 each, and the connection goes on serving.
    with connect(path) as sock:
        for bad in BAD_REQUESTS:
            reply, fd = exchange(sock, bad)
            assert fd is None and reply["status"] == 400 and reply["error"] == "InvalidArgument", (bad, reply)
        reply, fd = exchange(sock, {"op": "open", "bucket": pod.bucket, "key": SHARD1})
        assert fd is not None and read_fd(fd) == OBJECTS[SHARD1]
    # Descriptors sent by the client: refused (and closed), never passed on or kept.
    with connect(path) as sock, open("/dev/null", "rb") as null:
        send_message(sock, {"op": "open", "bucket": pod.bucket, "key": SHARD1}, null.fileno())
        answer = _error_or_closed(sock, "a descriptor attached")
        assert answer is not None and "descriptor" in answer["message"]
        reply, fd = exchange(sock, {"op": "open", "bucket": pod.bucket, "key": SHARD1})
        assert fd is not None
        os.close(fd)
    with connect(path) as sock, open("/dev/null", "rb") as null:
        fds = [null.fileno()] * 6  # more than the receiver has room for
        socket.send_fds(sock, [b'{"op": "open"}\n'], fds)
        _error_or_closed(sock, "six descriptors attached")
    # A request that never ends, and one that never starts: cut after the idle timeout.
    for data in (b'{"op": "open", "bu', b""):
        with connect(path, timeout=IDLE_TIMEOUT_S * 5) as sock:
            sock.sendall(data)
            began = time.monotonic()
            assert sock.recv(100) == b""
            assert time.monotonic() - began < IDLE_TIMEOUT_S * 4
    # Connected and gone at once, a half-sent request and a hang-up: nothing to answer.
    for data in (b"", b'{"op":'):
        with connect(path) as sock:
            sock.sendall(data)
    assert pod.daemon.proc.poll() is None and pod.sidecar.proc.poll() is None
    assert read_handle(path, pod.bucket, SHARD1)[1] == OBJECTS[SHARD1]


def test_connections_beyond_the_limit_are_refused(pod: Pod) -> None:
    held: list[socket.socket] = []
    try:
        for _ in range(MAX_CONNECTIONS):
            held.append(connect(pod.node_handles, timeout=10))
        with connect(pod.node_handles, timeout=10) as extra:
            received = recv_message(extra, MAX_REPLY)
            assert received is not None and received[1] is None
            assert received[0]["status"] == 503 and received[0]["error"] == "SlowDown"
            assert extra.recv(10) == b""
        # The first of them is served all the same.
        reply, fd = exchange(held[0], {"op": "open", "bucket": pod.bucket, "key": SHARD1})
        assert reply["status"] == 200 and fd is not None
        os.close(fd)
    finally:
        for sock in held:
            sock.close()

    def served() -> bool:
        reply, fd = ask(pod.node_handles, pod.bucket, SHARD1)
        if fd is not None:
            os.close(fd)
        return reply["status"] == 200

    wait_until(served, timeout=20, what="the daemon to serve new connections again")


def test_a_restarted_daemon_behind_a_kept_alive_connection(pod: Pod) -> None:
    """The sidecar's connection to the daemon dies with it; the next request opens a new one."""
    with connect(pod.pod_handles) as sock:
        reply, fd = exchange(sock, {"op": "open", "bucket": pod.bucket, "key": SHARD1})
        assert fd is not None
        os.close(fd)
        pod.daemon.kill9()
        reply, fd = exchange(sock, {"op": "open", "bucket": pod.bucket, "key": SHARD1})
        assert fd is None and reply["status"] == 503, reply  # no node daemon: the app reads over HTTP
        pod.daemon.start()  # the same command, cache and log
        reply, fd = exchange(sock, {"op": "open", "bucket": pod.bucket, "key": SHARD1})
        assert reply["status"] == 200 and fd is not None, reply
        assert read_fd(fd) == OBJECTS[SHARD1]


def test_a_sidecar_without_a_node_daemon_answers_503(s3_server: Any, tmp_path_factory: pytest.TempPathFactory) -> None:
    tmp = tmp_path_factory.mktemp("alone")
    sidecar = start_serve(tmp, "sidecar", _sidecar_args(tmp / "nobody", tmp / "pod", s3_server.endpoint), {})
    try:
        reply = refused(tmp / "pod" / "handles.sock", "some-bucket", SHARD0)
        assert reply["status"] == 503 and reply["error"] == "ServiceUnavailable" and "HTTP" in reply["message"]
    finally:
        sidecar.stop()


# -- tenants: --auth sigv4 ------------------------------------------------------------------------


@dataclass
class Tenants:
    iam: IamS3
    daemon: Serve
    node_handles: Path
    pods: dict[str, Path]  # tenant name -> its pod's handle socket
    sidecars: dict[str, Serve]


@pytest.fixture(scope="module")
def tenants(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Tenants]:
    tmp = tmp_path_factory.mktemp("tenant-handles")
    with start_iam_s3(tmp / "moto.log") as iam:
        sockets = tmp / "node"
        daemon = start_serve(tmp, "daemon", _daemon_args(sockets, iam.endpoint, ["--auth", "sigv4"]), iam.env("node"))
        sidecars: dict[str, Serve] = {}
        try:
            for name, who in {"alice": "alice", "bob": "bob", "nobody": None}.items():
                env = iam.env(who) if who is not None else {**iam.env("node"), **NO_CREDENTIALS}
                sidecars[name] = start_serve(tmp, f"sidecar-{name}", _sidecar_args(sockets, tmp / f"pod-{name}", iam.endpoint), env)
            pods = {name: tmp / f"pod-{name}" / "handles.sock" for name in sidecars}
            yield Tenants(iam, daemon, sockets / "handles.sock", pods, sidecars)
        finally:
            for serve in [*sidecars.values(), daemon]:
                serve.stop()


def _cached(daemon: Serve) -> set[tuple[str, str]]:
    found = set()
    for meta in (daemon.cache / "v1" / "meta").rglob("*.json"):
        doc = json.loads(meta.read_text())
        found.add((doc["bucket"], doc["key"]))
    return found


@pytest.mark.slow
def test_a_tenant_gets_no_handle_to_another_tenants_object(tenants: Tenants) -> None:
    alice, bob = tenants.pods["alice"], tenants.pods["bob"]
    objects = tenants.iam.objects
    # bob first, while nothing is cached: refused, and nothing was fetched for him.
    reply = refused(bob, A, SHARD)
    assert reply["status"] == 403 and reply["error"] == "AccessDenied"
    assert (A, SHARD) not in _cached(tenants.daemon)

    reply, data = read_handle(alice, A, SHARD)
    assert data == objects[(A, SHARD)] and reply["cache"] in ("miss", "coalesced")
    reply, data = read_handle(alice, A, SHARD)
    assert data == objects[(A, SHARD)] and reply["cache"] == "hit"

    # Cached now: still no descriptor for bob, whatever he adds (his sidecar drops a session or
    # proof he sends and proves with his own credentials).
    digest = xxhash.xxh3_128_hexdigest(objects[(A, SHARD)])
    for fields in ({}, {"xxh3_128": digest}, {"recheck": True}, {"session": "forged", "proof": "a;b;c"}):
        reply = refused(bob, A, SHARD, **fields)
        assert reply["status"] == 403 and reply["error"] == "AccessDenied", (fields, reply)
    assert read_handle(bob, B, SHARD, session="forged")[1] == objects[(B, SHARD)]
    assert read_handle(alice, A, "train/a b é.tar")[1] == objects[(A, "train/a b é.tar")]
    # A pod without credentials is told what it lacks, and gets nothing.
    reply = refused(tenants.pods["nobody"], A, SHARD)
    assert reply["status"] == 403 and "found none" in reply["message"], reply


def test_straight_to_the_daemon_no_session_no_descriptor(tenants: Tenants) -> None:
    node, iam = tenants.node_handles, tenants.iam
    read_handle(tenants.pods["alice"], A, SHARD)  # cached
    reply = refused(node, A, SHARD)
    assert reply["status"] == 403 and reply["error"] == "AccessDenied" and reply.get("renew") is True
    reply = refused(node, A, SHARD, session="forged-token", proof="a;b;c")
    assert reply["status"] == 403 and reply["error"] == "AccessDenied"
    # bob's real session, with a proof alice signed, or his own proof: refused.
    target = Target.from_json(tenants.daemon.json("GET", "/_shardcache/auth")[1])
    bob_creds, alice_creds = Credentials(*iam.users["bob"]), Credentials(*iam.users["alice"])
    status, session = tenants.daemon.json("POST", SESSION_PATH, prove_identity(bob_creds, target, amz_date()))
    assert status == 201
    for creds in (alice_creds, bob_creds):
        proof = prove(creds, target, amz_date(), A, SHARD).to_header()
        reply = refused(node, A, SHARD, session=session["session"], proof=proof)
        assert reply["status"] == 403, reply
    # The protocol as the sidecar speaks it: alice's session and proof get the descriptor.
    status, session = tenants.daemon.json("POST", SESSION_PATH, prove_identity(alice_creds, target, amz_date()))
    assert status == 201
    proof = prove(alice_creds, target, amz_date(), A, SHARD).to_header()
    assert read_handle(node, A, SHARD, session=session["session"], proof=proof)[1] == iam.objects[(A, SHARD)]


def test_a_restarted_daemon_gets_a_new_session_unnoticed(tenants: Tenants) -> None:
    """The sidecar's session is unknown to a restarted daemon: 403 with renew, a new session, and
    the request once more, without the app seeing any of it."""
    daemon = tenants.daemon
    key = "train/shard-000001.tar"
    assert read_handle(tenants.pods["alice"], A, key)[1] == tenants.iam.objects[(A, key)]
    daemon.kill9()
    daemon.start()  # the same command, environment (the node's credentials), cache and log
    assert read_handle(tenants.pods["alice"], A, key)[1] == tenants.iam.objects[(A, key)]
    assert daemon.json("GET", "/_shardcache/stats")[1]["auth"]["sessions"] == 1  # alice's new one
    assert refused(tenants.pods["bob"], A, key)["status"] == 403


# -- the flags ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("argv", "error"), [
    (["--handles", "tcp://127.0.0.1:8601"], "unix sockets only"),
    (["--handles", "unix://relative.sock"], "absolute path"),
    (["--upstream-handles", "unix:///run/shardcache/handles.sock"], "--mode sidecar --handles"),
    (["--mode", "sidecar", "--upstream", "tcp://127.0.0.1:8600", "--handles", "unix:///pod/h.sock"], "--upstream-handles"),
])
@pytest.mark.slow
def test_handle_flags_refused_with_what_to_do(argv: list[str], error: str) -> None:
    from sidecar.cli.commands.serve import build_settings
    from sidecar.cli.dispatch import build_parser
    from sidecar.cli.util import UserError

    with pytest.raises(UserError, match=error.replace("-", r"\-")):
        build_settings(build_parser().parse_args(["serve", *argv]))


@pytest.mark.slow
def test_handle_flags_and_their_env(monkeypatch: pytest.MonkeyPatch) -> None:
    from sidecar.cli.commands.serve import build_settings
    from sidecar.cli.dispatch import build_parser

    monkeypatch.setenv("SHARDCACHE_HANDLES", "unix:///pod/handles.sock")
    args = ["serve", "--mode", "sidecar", "--upstream", "unix:///run/shardcache/daemon.sock"]
    settings = build_settings(build_parser().parse_args(args))
    assert settings.handles == "unix:///pod/handles.sock"
    assert settings.upstream_handles_path() == "/run/shardcache/handles.sock"  # next to daemon.sock
    settings = build_settings(build_parser().parse_args([*args, "--upstream-handles", "unix:///node/h.sock"]))
    assert settings.upstream_handles_path() == "/node/h.sock"
    monkeypatch.setenv("SHARDCACHE_HANDLES", "")  # empty: off
    assert build_settings(build_parser().parse_args(["serve"])).handles is None
