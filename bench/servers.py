"""The servers the benchmarks and the tests start, one class each: the S3 stores (moto, s3rver),
etcd, ``shardcache serve`` (the daemon) and ``shardcache master``.

Each is a :class:`ServerProcess`: a process of its own on a free loopback port, started with
:func:`bench.common.spawn` and waited for until it answers. ``tests/support`` builds the tests'
servers on these classes (the benchmarks never import the tests), so a server is started the
same way wherever it runs.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar, Self

from bench.common import TEST_CREDENTIALS, free_port, http_ok, port_open, s3_client, spawn, stop_process, wait_until

__all__ = [
    "ETCD",
    "STORES",
    "STORE_DESCRIPTIONS",
    "EtcdServer",
    "MasterProcess",
    "MotoServer",
    "S3Server",
    "S3rverServer",
    "ServeProcess",
    "ServerExited",
    "ServerProcess",
    "store_server",
]

ETCD = "/usr/bin/etcd"  # Debian's etcd-server (scripts/test.sh installs it)


class ServerExited(RuntimeError):
    """A server process ended before it was ready (its log's tail is in the message)."""


class ServerProcess:
    """A server in its own process on a free loopback port: :meth:`start` (or ``with``) spawns it
    and waits until :meth:`ready`, :meth:`stop` (or the ``with``'s end) stops it and its children.
    A stopped server can be started again, on the same port.

    :meth:`launch` and :meth:`wait_ready` are the two halves of :meth:`start`, for servers that must
    start together (daemons that peer with each other wait on nothing but their own start).

    :meth:`listen_on` moves it elsewhere before it starts: another address (the far end of a
    ``bench.netbed.FarHost`` link) and a command prefix that runs it there (``ip netns exec``)."""

    name = "server"
    ready_timeout_s = 60.0
    # The credentials its environment gets (bench.common.spawn): the benchmarks' fixed test pair.
    # The tests' servers take the test session's own ({}: nothing added).
    credentials: ClassVar[Mapping[str, str]] = TEST_CREDENTIALS

    def __init__(self, log: Path) -> None:
        self.host = "127.0.0.1"
        self.port = free_port()
        self.endpoint = f"http://{self.host}:{self.port}"
        self.log = log
        self.launcher: list[str] = []
        self.proc: subprocess.Popen[bytes] | None = None

    def listen_on(self, host: str, launcher: list[str]) -> Self:
        """Listen on ``host`` and start through ``launcher``; call before ``__enter__``. The port
        stays the one :func:`free_port` found here: a fresh network namespace has every port free."""
        if self.running():
            raise RuntimeError(f"the {self.name} is already running")
        self.host = host
        self.endpoint = f"http://{host}:{self.port}"
        self.launcher = list(launcher)
        return self

    @property
    def url(self) -> str:
        return self.endpoint

    def command(self) -> list[str]:
        raise NotImplementedError

    def env(self) -> dict[str, str] | None:
        return None

    def ready(self) -> bool:
        return port_open(self.port, self.host)

    def launch(self) -> Self:
        """Spawn the process without waiting for it (:meth:`wait_ready` does)."""
        if self.running():
            raise RuntimeError(f"the {self.name} is already running")
        self.proc = spawn(self.launcher + self.command(), self.log, self.env(), credentials=self.credentials)
        return self

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def exited(self) -> bool:
        """Whether its process was started and has ended (a stopped server keeps its ``proc``)."""
        return self.proc is not None and self.proc.poll() is not None

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def wait_ready(self) -> Self:
        """Wait until :meth:`ready`; a process that ends first fails at once, with its log's tail."""
        wait_until(lambda: self.exited() or self.ready(), timeout=self.ready_timeout_s,
                   what=f"the {self.name} at {self.endpoint} (log: {self.log})")
        if self.exited():
            assert self.proc is not None
            raise ServerExited(f"the {self.name} at {self.endpoint} exited with {self.proc.returncode} "
                               f"(log: {self.log}):\n{self.log_tail()}")
        return self

    def start(self) -> Self:
        self.launch()
        try:
            return self.wait_ready()
        except BaseException:
            # ``with`` does not call __exit__ when __enter__ raises: a server that never became
            # ready would otherwise outlive the run.
            self.stop()
            raise

    def stop(self, timeout: float = 15.0) -> None:
        if self.proc is not None:
            stop_process(self.proc, timeout=timeout)

    def kill9(self) -> None:
        """``kill -9`` of its process group: no shutdown of any kind."""
        if self.proc is not None:
            stop_process(self.proc, timeout=10.0, sig=signal.SIGKILL)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def get_json(self, path: str, timeout: float = 10.0) -> Any:
        with urllib.request.urlopen(self.endpoint + path, timeout=timeout) as resp:
            return json.loads(resp.read())


# -- S3 stores ----------------------------------------------------------------------------------


class S3Server(ServerProcess):
    """An S3 endpoint for the benchmarks."""

    def client(self, max_pool: int = 16) -> Any:
        return s3_client(self.endpoint, max_pool)


S3_LIKE_MOTO = """
import sys
from moto.moto_server.werkzeug_app import DomainDispatcherApplication
from moto.s3.models import FakeKey

_call = DomainDispatcherApplication.__call__

def _checksum_mode_upper(self, environ, start_response):
    mode = environ.get("HTTP_X_AMZ_CHECKSUM_MODE")
    if mode:
        environ["HTTP_X_AMZ_CHECKSUM_MODE"] = mode.upper()
    return _call(self, environ, start_response)

DomainDispatcherApplication.__call__ = _checksum_mode_upper

_get, _set = FakeKey.value.fget, FakeKey.value.fset

def _cached_value(self):
    value = self.__dict__.get("_bench_value")
    if value is None:
        value = self.__dict__["_bench_value"] = _get(self)
    return value

def _set_value(self, new_value):
    self.__dict__.pop("_bench_value", None)
    _set(self, new_value)

FakeKey.value = property(_cached_value, _set_value)

import moto.server
moto.server.main(sys.argv[1:])
"""
"""``moto.server`` (5.x) with two differences from S3 removed, the same for every reader:

- moto copies an object's whole bytes out of its buffer for every GET, ranged or not, so each
  part of a download in parallel ranges (s3torchconnector's, the daemon's split fills and direct
  ranges, awscrt's) costs it a whole object: 8x the bytes for 64 MiB objects in 8 MiB parts, on
  the cores the readers use. Here each object's bytes are read once and kept as one immutable
  bytes object (moto then holds them twice), and a range costs the range, as on S3.
- moto answers a checksum only when ``x-amz-checksum-mode`` is exactly ``ENABLED``; awscrt sends
  ``enabled``, which S3 accepts. The value is upper-cased before moto reads it.
"""


class MotoServer(S3Server):
    """A moto S3 server in its own process, holding every object in memory.

    moto spools objects above ~5 MiB to temp files by default; ``MOTO_S3_DEFAULT_KEY_BUFFER_SIZE``
    keeps them in RAM, so the origin is not the disk the cache also sits on."""

    name = "moto server"

    def __init__(self, workdir: Path, in_memory: bool = True, s3_like: bool = False) -> None:
        super().__init__(workdir / "moto.log")
        self.in_memory = in_memory
        self.s3_like = s3_like
        """Patch moto where it differs from S3 in what the benchmarks measure (:data:`S3_LIKE_MOTO`)."""

    def module(self) -> str:
        """The module run as the server (a drop-in for ``moto.server`` may take its place)."""
        return "moto.server"

    def command(self) -> list[str]:
        if self.s3_like and self.module() == "moto.server":
            return [sys.executable, "-c", S3_LIKE_MOTO, "-H", self.host, "-p", str(self.port)]
        return [sys.executable, "-m", self.module(), "-H", self.host, "-p", str(self.port)]

    def env(self) -> dict[str, str] | None:
        return {"MOTO_S3_DEFAULT_KEY_BUFFER_SIZE": str(1 << 40)} if self.in_memory else None

    def ready(self) -> bool:
        return http_ok(self.endpoint + "/moto-api/")


class S3rverServer(S3Server):
    """s3rver (Node.js, npm ``s3rver``) in its own process: a second, independent S3 server for
    the benchmarks, objects in files under the work dir.

    Why a second store: moto answers a ranged GET by copying the whole object in Python first
    (``moto/s3/responses.py``, ``_handle_range_header``), so every part of a parallel ranged
    download costs it a full object: ``download_fileobj`` and the daemon's split fills measure
    moto, not the transfer. s3rver streams a range from its file, as S3, MinIO and Ceph do.
    It is installed on first use with npm into ``~/.cache/shardcache-bench`` (the machine needs
    ``node`` and ``npm``); signatures are accepted when well-formed, so the benchmark's test
    credentials (s3rver's own key pair) work unchanged."""

    name = "s3rver server"
    VERSION = "3.7.1"

    def __init__(self, workdir: Path) -> None:
        super().__init__(workdir / "s3rver.log")
        self.data = workdir / "s3rver-data"

    @classmethod
    def executable(cls) -> Path:
        prefix = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "shardcache-bench" / f"s3rver-{cls.VERSION}"
        binary = prefix / "node_modules" / ".bin" / "s3rver"
        if not binary.exists():
            if not shutil.which("npm") or not shutil.which("node"):
                raise RuntimeError("--store s3rver needs node and npm (apt-get install -y nodejs npm)")
            prefix.mkdir(parents=True, exist_ok=True)
            subprocess.run(["npm", "install", "--silent", "--no-audit", "--no-fund", "--prefix", str(prefix),
                            f"s3rver@{cls.VERSION}"], check=True, timeout=600)
        return binary

    def command(self) -> list[str]:
        self.data.mkdir(parents=True, exist_ok=True)
        return [str(self.executable()), "--directory", str(self.data), "--address", self.host,
                "--port", str(self.port), "--silent", "--allow-mismatched-signatures"]


STORES = ("moto", "s3rver")


def store_server(kind: str, workdir: Path, s3_like: bool = False) -> S3Server:
    """The S3 server a benchmark reads from: ``moto`` (objects in RAM; ``s3_like``: with
    :data:`S3_LIKE_MOTO`'s patches) or ``s3rver`` (in files)."""
    if kind == "moto":
        return MotoServer(workdir, s3_like=s3_like)
    if kind == "s3rver":
        return S3rverServer(workdir)
    raise ValueError(f"unknown store {kind!r}; known: {', '.join(STORES)}")


STORE_DESCRIPTIONS = {
    "moto": "moto server (own process, objects in RAM)",
    "s3rver": f"s3rver {S3rverServer.VERSION} (Node.js, own process, objects in files)",
}


# -- etcd ---------------------------------------------------------------------------------------


class EtcdServer(ServerProcess):
    """A real etcd (v3 API) on free loopback ports, its data under ``workdir`` (``data_dir``)."""

    name = "etcd"

    def __init__(self, workdir: Path, binary: str = ETCD, data_dir: str = "data", log_level: str | None = "warn") -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        super().__init__(workdir / "etcd.log")
        self.workdir = workdir
        self.binary = binary
        self.data_dir = workdir / data_dir
        self.log_level = log_level
        self.peer_port = free_port()

    def command(self) -> list[str]:
        peer = f"http://{self.host}:{self.peer_port}"
        args = [
            self.binary, "--name", "default", "--data-dir", str(self.data_dir),
            "--listen-client-urls", self.endpoint, "--advertise-client-urls", self.endpoint,
            "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer, "--initial-cluster", f"default={peer}",
        ]
        return args + (["--log-level", self.log_level] if self.log_level else [])

    def ready(self) -> bool:
        return http_ok(self.endpoint + "/health")


# -- shardcache -----------------------------------------------------------------------------------


class ServeProcess(ServerProcess):
    """``python -m sidecar.cli serve`` on a TCP listener of its own (``url``): ``args`` are the
    flags after it, ``mode`` (``--mode``) goes before it. Ready when ``ready_path`` answers 2xx."""

    name = "daemon"

    def __init__(self, log: Path, args: Sequence[str] = (), env: dict[str, str] | None = None, *,
                 mode: str | None = None, ready_path: str = "/readyz") -> None:
        super().__init__(log)
        self.args = list(args)
        self.extra_env = dict(env or {})
        self.mode = mode
        self.ready_path = ready_path

    def command(self) -> list[str]:
        mode = ["--mode", self.mode] if self.mode else []
        return [sys.executable, "-m", "sidecar.cli", "serve", *mode, "--listen", f"tcp://{self.host}:{self.port}", *self.args]

    def env(self) -> dict[str, str] | None:
        return self.extra_env or None

    def ready(self) -> bool:
        return http_ok(self.url + self.ready_path)

    def stats(self) -> dict[str, Any]:
        answer: dict[str, Any] = self.get_json("/_shardcache/stats")
        return answer

    def settle(self, timeout: float = 20.0) -> None:
        """Wait until no fill is in flight (a reader can finish before its fill is published)."""
        wait_until(lambda: self.stats()["fills_in_flight"] == 0, timeout=timeout, what=f"fills of the {self.name} to finish")


class MasterProcess(ServerProcess):
    """``python -m sidecar.cli master`` on a TCP listener of its own (``url``) with ``state``
    (``sqlite:///...``, ``etcd://...``), with ``advertise`` its ``url`` as ``--advertise-url``;
    ``args`` come after, ``cli_args`` (``--log-level``) before the subcommand. Ready when
    ``ready_path`` answers 2xx."""

    name = "master"

    def __init__(self, log: Path, state: str, args: Sequence[str] = (), *, cli_args: Sequence[str] = (),
                 env: dict[str, str] | None = None, ready_path: str = "/readyz", advertise: bool = False) -> None:
        super().__init__(log)
        self.state = state
        self.advertise = advertise
        self.args = list(args)
        self.cli_args = list(cli_args)
        self.extra_env = dict(env or {})
        self.ready_path = ready_path

    def command(self) -> list[str]:
        advertise = ["--advertise-url", self.url] if self.advertise else []
        return [sys.executable, "-m", "sidecar.cli", *self.cli_args, "master", "--listen", f"tcp://{self.host}:{self.port}",
                "--state", self.state, *advertise, *self.args]

    def env(self) -> dict[str, str] | None:
        return self.extra_env or None

    def ready(self) -> bool:
        return http_ok(self.url + self.ready_path)
