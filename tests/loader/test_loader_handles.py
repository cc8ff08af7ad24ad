"""Short-circuit reads by file handle (``settings.handles``, ``wire.handles``), for real: a loader
reading shards from descriptors passed over a real unix socket (``SCM_RIGHTS``), against the real
``shardcache serve --handles`` (node daemon, and a pod sidecar relaying to it) and against a
handle server of this module's own that answers what a test needs (409 NotCached, 503, errors,
a corrupted copy, connections closed under the client). The HTTP side is always the real daemon.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import multiprocessing
import os
import socket
import threading
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from loader import AccessDenied, ConfigError, CorruptShard, LoaderSettings, ShardLoader, ShardNotFound
from loader.handles import HandleClient
from tests.support.daemons import DaemonProcess
from tests.support.shards import Written, delivered
from tests.support.waits import wait_until
from wire.handles import MAX_REQUEST, recv_message, send_message

pytestmark = pytest.mark.timeout(120)

# -- a handle server of the test's own ----------------------------------------------------------


class HandleServer:
    """``wire.handles`` over a real unix socket, a thread per connection. Serves ``files``
    (``(bucket, key) -> path``) or answers ``status`` (with ``code``) to every request;
    ``corrupt`` maps keys to a bad copy served unless the request says ``recheck``;
    ``hang_up`` closes each connection after its reply (as an idle timeout would)."""

    def __init__(self, path: Path, files: dict[tuple[str, str], Path]) -> None:
        self.path, self.files = path, files
        self.status, self.code = 200, ""
        self.corrupt: dict[str, Path] = {}
        self.wrong_digest: set[str] = set()
        self.size_off_by = 0
        self.hang_up = False
        self.requests: list[dict[str, Any]] = []
        self.connections = 0
        self._digests = {key: _xxh3(p) for key, p in files.items()}
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(str(path))
        self._listener.listen(16)
        self._listener.settimeout(0.1)
        self._stop = threading.Event()
        self._conns: list[socket.socket] = []
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self.connections += 1
            self._conns.append(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        conn.settimeout(30)
        with conn:
            while True:
                try:
                    got = recv_message(conn, MAX_REQUEST)
                except OSError:
                    return
                if got is None:
                    return
                request, fd = got
                if fd is not None:
                    os.close(fd)
                self.requests.append(request)
                self._reply(conn, request)
                if self.hang_up:
                    return

    def _reply(self, conn: socket.socket, request: dict[str, Any]) -> None:
        ident = (request.get("bucket", ""), request.get("key", ""))
        if self.status != 200:
            send_message(conn, {"status": self.status, "error": self.code, "message": f"test server: {self.code}"})
            return
        path = self.files.get(ident)
        if path is None:
            send_message(conn, {"status": 404, "error": "NoSuchKey", "message": "The specified key does not exist."})
            return
        if ident[1] in self.corrupt and not request.get("recheck"):
            path = self.corrupt[ident[1]]  # bit rot the daemon has not noticed: its hash is the good one
        digest = self._digests[ident]
        if ident[1] in self.wrong_digest and not request.get("recheck"):
            digest = "0" * 32
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            size = os.fstat(fd).st_size + self.size_off_by
            send_message(conn, {"status": 200, "size": size, "etag": "e1", "xxh3_128": digest, "cache": "hit"}, fd)
        finally:
            os.close(fd)

    def close(self) -> None:
        self._stop.set()
        self._listener.close()
        for conn in self._conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        self._thread.join(5)

    def opens(self, key: str) -> list[dict[str, Any]]:
        return [r for r in self.requests if r.get("key") == key]


def _xxh3(path: Path) -> str:
    import xxhash

    return xxhash.xxh3_128_hexdigest(path.read_bytes())


@pytest.fixture
def origin(dataset: tuple[str, Written], start_daemon: Callable[..., str]) -> tuple[str, Written, str]:
    """The file:// dataset and a real daemon serving its root over HTTP: (url, written, endpoint)."""
    url, written = dataset
    root = url[len("file://") :].split("/bkt/")[0]
    return url, written, start_daemon(f"file://{root}")


@pytest.fixture
def handle_server(origin: tuple[str, Written, str], tmp_path: Path) -> Iterator[HandleServer]:
    _, written, _ = origin
    server = HandleServer(tmp_path / "handles.sock", {("bkt", f"ds/{k}"): written.root / k for k in written.keys})
    try:
        yield server
    finally:
        server.close()


def _settings(sock: Path, **extra: Any) -> LoaderSettings:
    return LoaderSettings(handles=f"unix://{sock}", io_attempts=3, retry_backoff_s=0.01, **extra)


def _served(endpoint: str) -> dict[str, int]:
    """The daemon's bytes served over HTTP by source, less ``passthrough`` (the manifest: never
    cached, always read over HTTP); ``http`` sums the cache's own."""
    stats = json.load(urllib.request.urlopen(endpoint + "/_shardcache/stats", timeout=10))
    served = {k: int(v) for k, v in stats["served_bytes"].items() if k != "passthrough"}
    served["http"] = served["hit"] + served["miss"] + served["coalesced"]
    return served


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


# -- settings -----------------------------------------------------------------------------------


def test_handles_setting_from_the_environment_and_refused_values() -> None:
    settings = LoaderSettings.from_env({"SHARDCACHE_HANDLES": " unix:///run/shardcache-pod/handles.sock "})
    assert settings.handles == "unix:///run/shardcache-pod/handles.sock"
    assert LoaderSettings.from_env({}).handles is None
    assert LoaderSettings(handles="").handles is None
    for bad in ("http://127.0.0.1:8600", "/run/x.sock", "unix://relative.sock", "127.0.0.1:9"):
        with pytest.raises(ConfigError, match="unix:///run/shardcache-pod/handles.sock"):
            LoaderSettings(handles=bad)


# -- against the test's own handle server -------------------------------------------------------


def test_epoch_through_handles_reads_no_byte_over_http(origin: tuple[str, Written, str], handle_server: HandleServer) -> None:
    url, written, endpoint = origin
    before = _served(endpoint)
    loader = ShardLoader(url, endpoint=endpoint, seed=5, settings=_settings(handle_server.path))
    assert delivered(list(loader)) == written.samples
    after = _served(endpoint)
    assert after == before  # no shard byte over HTTP
    by_key = {f"ds/{s.key}": s.xxh3_128 for s in loader.shards}
    assert sorted(r["key"] for r in handle_server.requests) == sorted(by_key)
    assert all(r["op"] == "open" and r["bucket"] == "bkt" and r["xxh3_128"] == by_key[r["key"]] for r in handle_server.requests)
    assert not any(r.get("recheck") for r in handle_server.requests)
    # one kept-alive connection per thread: the loop's (the first shard) and the one that opens
    # the next shard while the current one is read (loader.ahead)
    assert handle_server.connections == 2
    reader = loader._source().open(loader.shards[0])
    try:
        assert type(reader).__name__ == "FileIO"
        assert os.readlink(f"/proc/self/fd/{reader.fileno()}") == str(written.root / written.keys[0])  # type: ignore[attr-defined]
    finally:
        reader.close()


def test_kept_alive_connection_closed_between_requests_is_replaced(origin: tuple[str, Written, str], handle_server: HandleServer) -> None:
    url, written, endpoint = origin
    handle_server.hang_up = True
    before = _served(endpoint)
    loader = ShardLoader(url, endpoint=endpoint, shuffle=False, settings=_settings(handle_server.path))
    assert delivered(list(loader)) == written.samples
    assert _served(endpoint) == before  # every shard still by handle
    assert len(handle_server.requests) == len(written.keys) == handle_server.connections


def test_socket_absent_reads_over_http_and_stops_asking(origin: tuple[str, Written, str], tmp_path: Path) -> None:
    url, written, endpoint = origin
    fds = _open_fds()
    loader = ShardLoader(url, endpoint=endpoint, seed=2, settings=_settings(tmp_path / "absent.sock"))
    assert delivered(list(loader)) == written.samples
    source = loader._source()
    assert source._handles is not None and not source._handles.available()  # type: ignore[attr-defined]
    served = _served(endpoint)
    # Over HTTP, not by path: a pod given a handle socket mounts no cache directory (the path
    # answer would be readable here, on the daemon's own machine, and must not be asked for).
    assert served["short_circuit"] == 0 and served["http"] > 0
    reader = source.open(loader.shards[0])
    try:
        assert type(reader).__name__ == "_Resuming"
    finally:
        reader.close()
    loader.close()
    assert _open_fds() <= fds + 1


def test_paused_socket_is_asked_again_after_a_while(origin: tuple[str, Written, str], tmp_path: Path) -> None:
    _, written, _ = origin
    sock = tmp_path / "later.sock"
    client = HandleClient(f"unix://{sock}", LoaderSettings(), retry_s=0.3)
    try:
        assert client.open("bkt", f"ds/{written.keys[0]}") is None
        assert not client.available()
        server = HandleServer(sock, {("bkt", f"ds/{written.keys[0]}"): written.root / written.keys[0]})
        try:
            wait_until(client.available, timeout=5, what="the pause to end")
            obj = client.open("bkt", f"ds/{written.keys[0]}")
            assert obj is not None and obj.fd is not None and obj.cache == "hit"
            with os.fdopen(obj.take_fd(), "rb") as handle:
                assert handle.read() == (written.root / written.keys[0]).read_bytes()
        finally:
            server.close()
    finally:
        client.close()


@pytest.mark.parametrize("status, code", [(409, "NotCached"), (503, "ServiceUnavailable")])
def test_no_handle_answers_read_over_http(origin: tuple[str, Written, str], handle_server: HandleServer, status: int, code: str) -> None:
    url, written, endpoint = origin
    handle_server.status, handle_server.code = status, code
    loader = ShardLoader(url, endpoint=endpoint, seed=1, settings=_settings(handle_server.path))
    assert delivered(list(loader)) == written.samples
    served = _served(endpoint)
    assert served["short_circuit"] == 0 and served["http"] > 0
    # Asked for every shard (these answers are about one object, not the socket) and answered
    # over HTTP each time.
    assert sorted(r["key"] for r in handle_server.requests) == sorted(f"ds/{k}" for k in written.keys)


@pytest.mark.parametrize("status, code, error, match", [
    (404, "NoSuchKey", ShardNotFound, "NoSuchKey"),
    (403, "AccessDenied", AccessDenied, "AccessDenied"),
    (409, "ChecksumMismatch", CorruptShard, "ChecksumMismatch"),
])
@pytest.mark.slow
def test_error_answers_map_as_over_http(
    origin: tuple[str, Written, str], handle_server: HandleServer, status: int, code: str, error: type, match: str
) -> None:
    url, written, endpoint = origin
    handle_server.status, handle_server.code = status, code
    fds = _open_fds()
    loader = ShardLoader(url, endpoint=endpoint, shuffle=False, settings=_settings(handle_server.path))
    with pytest.raises(error, match=f"handle socket unix://{handle_server.path}: open bkt/ds/{written.keys[0]}: {match}"):
        list(loader)
    first = handle_server.opens(f"ds/{written.keys[0]}")
    if error is CorruptShard:
        # The daemon's copy checks out and is not the manifest's: read once more with recheck.
        assert [bool(r.get("recheck")) for r in first] == [False, True]
    else:
        assert len(first) == 1
    assert _served(endpoint)["http"] == 0  # not asked over HTTP instead
    loader.close()
    assert _open_fds() <= fds + 1


def test_corrupted_read_is_read_again_with_recheck(
    origin: tuple[str, Written, str], handle_server: HandleServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    url, written, endpoint = origin
    bad = tmp_path / "bad.tar"
    data = bytearray((written.root / written.keys[0]).read_bytes())
    data[0] ^= 0x01  # the first member's name: its header checksum no longer holds
    bad.write_bytes(bytes(data))
    handle_server.corrupt[f"ds/{written.keys[0]}"] = bad
    handle_server.wrong_digest.add(f"ds/{written.keys[1]}")  # answered with a hash not the claim's
    before = _served(endpoint)
    loader = ShardLoader(url, endpoint=endpoint, shuffle=False, settings=_settings(handle_server.path))
    caplog.set_level("WARNING", logger="loader")
    assert delivered(list(loader)) == written.samples
    assert len([r for r in caplog.records if "reading it again" in r.getMessage()]) == 2
    assert _served(endpoint) == before  # both reread by handle
    for key in written.keys[:2]:
        opens = handle_server.opens(f"ds/{key}")
        assert [bool(r.get("recheck")) for r in opens] == [False, True], key
        assert all(r["xxh3_128"] == _xxh3(written.root / key) for r in opens)
    assert all(len(handle_server.opens(f"ds/{k}")) == 1 for k in written.keys[2:])


def test_descriptor_of_the_wrong_size_is_not_read(origin: tuple[str, Written, str], handle_server: HandleServer) -> None:
    url, written, endpoint = origin
    handle_server.size_off_by = 1
    fds = _open_fds()
    loader = ShardLoader(url, endpoint=endpoint, shuffle=False, settings=_settings(handle_server.path))
    assert delivered(list(loader)) == written.samples
    assert len(handle_server.requests) == 1  # then left alone for a while
    assert _served(endpoint)["http"] > 0
    loader.close()
    assert _open_fds() <= fds + 1


def test_forked_worker_opens_its_own_connection(origin: tuple[str, Written, str], handle_server: HandleServer) -> None:
    url, written, endpoint = origin
    loader = ShardLoader(url, endpoint=endpoint, shuffle=False, settings=_settings(handle_server.path))
    source = loader._source()
    source.open(loader.shards[0]).close()  # the parent's connection, kept alive
    assert handle_server.connections == 1
    ctx = multiprocessing.get_context("fork")  # as a DataLoader worker starts
    out = ctx.Queue()

    def child() -> None:  # forked, not pickled: it runs on the parent's source object
        reader = source.open(loader.shards[1])
        try:
            out.put((type(reader).__name__, hashlib.sha256(reader.read()).hexdigest()))
        finally:
            reader.close()

    worker = ctx.Process(target=child)
    worker.start()
    try:
        kind, digest = out.get(timeout=30)
    finally:
        worker.join(30)
    assert worker.exitcode == 0
    assert kind == "FileIO" and digest == hashlib.sha256((written.root / written.keys[1]).read_bytes()).hexdigest()
    assert handle_server.connections == 2  # the child's own: it never wrote on the parent's stream
    source.open(loader.shards[2]).close()  # and the parent's still works, on its first connection
    assert handle_server.connections == 2 and len(handle_server.requests) == 3
    loader.close()


# -- against the real daemon ----------------------------------------------------------------------


def _serve(tmp_path: Path, name: str, args: list[str]) -> tuple[DaemonProcess, str]:
    daemon = DaemonProcess(["--min-free", "0%", *args], tmp_path / f"{name}.log", ready_path="/healthz").start()
    return daemon, daemon.url


@pytest.fixture
def real_node(dataset: tuple[str, Written], tmp_path: Path) -> Iterator[tuple[str, Written, str, Path, Path, Path]]:
    """``shardcache serve --mode node --handles`` (a real process) on the dataset's root:
    (url, written, endpoint, handle socket, daemon socket, cache dir)."""
    url, written = dataset
    root = url[len("file://") :].split("/bkt/")[0]
    sockets = tmp_path / "node"
    sockets.mkdir()
    cache = tmp_path / "node-cache"
    proc, endpoint = _serve(tmp_path, "node", [
        "--listen", f"unix://{sockets}/daemon.sock", "--handles", f"unix://{sockets}/handles.sock",
        "--cache-dir", str(cache), "--cache-size", "1GiB", "--origin", f"file://{root}",
    ])
    try:
        wait_until(lambda: (sockets / "handles.sock").exists(), timeout=20, what="the daemon's handle socket")
        yield url, written, endpoint, sockets / "handles.sock", sockets / "daemon.sock", cache
    finally:
        proc.stop()


def _settle(endpoint: str) -> None:
    def idle() -> bool:
        stats = json.load(urllib.request.urlopen(endpoint + "/_shardcache/stats", timeout=10))
        return int(stats["fills_in_flight"]) == 0

    wait_until(idle, timeout=30, what="the daemon's fills to be published")


def test_warm_epoch_through_handles_reads_what_the_s3_api_reads(real_node: tuple[str, Written, str, Path, Path, Path]) -> None:
    url, written, endpoint, handles, _, cache = real_node
    over_http = list(ShardLoader(url, endpoint=endpoint, seed=4, settings=LoaderSettings(short_circuit=False)))
    _settle(endpoint)
    before = _served(endpoint)
    loader = ShardLoader(url, endpoint=endpoint, seed=4, settings=_settings(handles))
    by_handle = list(loader)
    assert delivered(by_handle) == delivered(over_http) == written.samples
    assert [(s["__url__"], s["__key__"]) for s in by_handle] == [(s["__url__"], s["__key__"]) for s in over_http]
    after = _served(endpoint)
    assert after["http"] == before["http"]  # no shard byte over HTTP: every one by descriptor
    assert after["short_circuit"] - before["short_circuit"] == sum(s.size or 0 for s in loader.shards)
    source = loader._source()
    assert source._handles is not None and source._handles.received == len(loader.shards)  # type: ignore[attr-defined]
    reader = loader._source().open(loader.shards[0])
    try:
        assert type(reader).__name__ == "FileIO"
        target = os.readlink(f"/proc/self/fd/{reader.fileno()}")  # type: ignore[attr-defined]
        assert target.startswith(str(cache) + os.sep)  # the daemon's cache file, not the origin's
    finally:
        reader.close()


def test_cache_file_changed_in_place_is_never_handed_out(
    real_node: tuple[str, Written, str, Path, Path, Path], caplog: pytest.LogCaptureFixture
) -> None:
    url, written, endpoint, handles, _, cache = real_node
    list(ShardLoader(url, endpoint=endpoint, settings=LoaderSettings(short_circuit=False)))
    _settle(endpoint)
    original = (written.root / written.keys[0]).read_bytes()
    cached = [p for p in cache.rglob("*") if p.is_file() and p.stat().st_size == len(original) and p.read_bytes() == original]
    assert len(cached) == 1, cached
    with open(cached[0], "r+b") as handle:  # bit rot behind the daemon's back: same size, one byte
        handle.seek(len(original) // 2)
        byte = handle.read(1)
        handle.seek(len(original) // 2)
        handle.write(bytes([byte[0] ^ 0xFF]))
    loader = ShardLoader(url, endpoint=endpoint, shuffle=False, settings=_settings(handles))
    caplog.set_level("WARNING", logger="loader")
    assert delivered(list(loader)) == written.samples
    # No read was found bad (the loader would have read the shard again, with recheck): the daemon
    # saw its published file's stamp move and handed out only a verified copy.
    assert not [r for r in caplog.records if "reading it again" in r.getMessage()]
    assert loader._source()._handles.received == len(written.keys)  # type: ignore[attr-defined]


def test_manifest_is_not_cached_and_a_miss_is_filled_for_its_handle(real_node: tuple[str, Written, str, Path, Path, Path]) -> None:
    url, written, endpoint, handles, _, _ = real_node
    client = HandleClient(f"unix://{handles}", LoaderSettings())
    try:
        assert client.open("bkt", "ds/manifest.json") is None  # 409 NotCached: over HTTP
        assert client.available()
        with pytest.raises(ShardNotFound, match="NoSuchKey"):
            client.open("bkt", "ds/no-such-shard.tar")
        obj = client.open("bkt", f"ds/{written.keys[0]}", xxh3_128=_xxh3(written.root / written.keys[0]))  # a miss
        assert obj is not None and obj.size == (written.root / written.keys[0]).stat().st_size
        with os.fdopen(obj.take_fd(), "rb") as handle:
            assert handle.read() == (written.root / written.keys[0]).read_bytes()
        with pytest.raises(CorruptShard, match="ChecksumMismatch"):
            client.open("bkt", f"ds/{written.keys[1]}", xxh3_128="0" * 32)
    finally:
        client.close()


@pytest.mark.slow
def test_epoch_through_a_pod_sidecar_relaying_handles(real_node: tuple[str, Written, str, Path, Path, Path], tmp_path: Path) -> None:
    url, written, _, _, daemon_sock, _ = real_node
    pod = tmp_path / "pod"
    pod.mkdir()
    proc, sidecar = _serve(tmp_path, "sidecar", [
        "--mode", "sidecar", "--upstream", f"unix://{daemon_sock}", "--handles", f"unix://{pod}/handles.sock",
        "--cache-dir", str(tmp_path / "sidecar-cache"), "--cache-size", "256MiB",
    ])
    try:
        wait_until(lambda: (pod / "handles.sock").exists(), timeout=20, what="the sidecar's handle socket")
        loader = ShardLoader(url, endpoint=sidecar, seed=9, settings=_settings(pod / "handles.sock"))
        assert delivered(list(loader)) == written.samples
        reader = loader._source().open(loader.shards[1])
        try:
            assert type(reader).__name__ == "FileIO"
        finally:
            reader.close()
    finally:
        proc.stop()


def test_the_loader_names_its_job_in_handle_requests(origin: tuple[str, Written, str], handle_server: HandleServer,
                                                     master: str) -> None:
    # The daemon counts what a job's readers read (issue 32), by descriptor too: the job rides in
    # each open request as it rides in x-shardcache-job over HTTP.
    url, written, endpoint = origin
    samples = list(ShardLoader(url, job="resnet-9", master=master, epochs=1, endpoint=endpoint,
                               settings=_settings(handle_server.path)))
    assert delivered(samples) == written.samples
    opens = [r for r in handle_server.requests if r.get("op") == "open"]
    assert len(opens) == len(written.keys) and all(r.get("job") == "resnet-9" for r in opens)
    list(ShardLoader(url, endpoint=endpoint, seed=1, settings=_settings(handle_server.path)))  # no job: none named
    assert all("job" not in r for r in handle_server.requests[len(opens):])
