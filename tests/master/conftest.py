"""Master fixtures: a real etcd server, masters as real processes (for kill -9), and a master
in this process on its own thread (so the blocking-call guard sees its event loop)."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from loader.master.client import MasterClient
from loader.master.server.settings import MasterSettings
from tests.helpers import (
    PYTHON,
    ServerThread,
    free_port,
    http_ok,
    kill9,
    spawn,
    stop,
    wait_until,
)

ETCD = os.environ.get("SHARDCACHE_TEST_ETCD", "/usr/bin/etcd")


def shards(n: int, samples: int | None = 10) -> list[dict[str, Any]]:
    return [{"key": f"train-{i:06d}.tar", "size": 1000 + i, "samples": samples} for i in range(n)]


def job_spec(name: str, n: int = 8, **extra: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {"name": name, "dataset": "s3://bucket/train/", "shards": shards(n), "seed": 7}
    spec.update(extra)
    return spec


def http(method: str, url: str, body: Any = None, *, raw: bytes | None = None, headers: dict[str, str] | None = None,
         timeout: float = 10.0) -> tuple[int, Any]:
    """One plain HTTP exchange (no client library between the test and the server)."""
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            payload = resp.read()
            status = resp.status
    except urllib.error.HTTPError as exc:
        payload = exc.read()
        status = exc.code
    try:
        return status, json.loads(payload) if payload else None
    except ValueError:
        return status, payload.decode("utf-8", "replace")


class EtcdServer:
    """A real etcd (v3 API) on free ports with its data in a temp dir."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.port = free_port()
        self.peer_port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        peer = f"http://127.0.0.1:{self.peer_port}"
        self.proc = spawn(
            [
                ETCD, "--name", "default", "--data-dir", str(self.workdir / "data"),
                "--listen-client-urls", self.endpoint, "--advertise-client-urls", self.endpoint,
                "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                "--initial-cluster", f"default={peer}", "--log-level", "warn",
            ],
            self.workdir / "etcd.log",
        )
        wait_until(lambda: http_ok(self.endpoint + "/health"), timeout=30, what="etcd")

    def stop(self) -> None:
        if self.proc is not None:
            stop(self.proc)
            self.proc = None


@pytest.fixture(scope="session")
def etcd_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdServer]:
    if not (os.path.exists(ETCD) or shutil.which("etcd")):
        pytest.fail(f"{ETCD} is missing: install it with `apt-get update && apt-get install -y etcd-server` "
                    "(scripts/test.sh does this)")
    server = EtcdServer(tmp_path_factory.mktemp("etcd"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


class MasterProcess:
    """``shardcache master`` as a real process, restartable on the same port and state."""

    def __init__(self, workdir: Path, state: str, *args: str, name: str = "master") -> None:
        self.workdir = workdir
        self.state = state
        self.args = list(args)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = workdir / f"{name}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, wait: str = "ready") -> MasterProcess:
        self.proc = spawn(
            [PYTHON, "-m", "sidecar.cli", "master", "--listen", f"tcp://127.0.0.1:{self.port}", "--state", self.state,
             "--advertise-url", self.url, *self.args],
            self.log,
        )
        path = "/readyz" if wait == "ready" else "/healthz"
        wait_until(lambda: self._alive() and http_ok(self.url + path), timeout=30, what=f"master on {self.url}{path}")
        return self

    def _alive(self) -> bool:
        if self.proc is not None and self.proc.poll() is not None:
            raise RuntimeError(f"master exited with {self.proc.returncode}:\n{self.log.read_text()[-3000:]}")
        return True

    def kill9(self) -> None:
        if self.proc is not None:
            kill9(self.proc)
            self.proc = None

    def stop(self) -> None:
        if self.proc is not None:
            stop(self.proc)
            self.proc = None


@pytest.fixture
def master_procs(tmp_path: Path) -> Iterator[list[MasterProcess]]:
    """Registry of master processes started by a test; every one is stopped afterwards."""
    procs: list[MasterProcess] = []
    try:
        yield procs
    finally:
        for proc in procs:
            proc.stop()


class MasterThread(ServerThread):
    """A master serving in this process, on a thread with its own event loop."""

    def __init__(self, settings: MasterSettings) -> None:
        super().__init__("master")
        self.settings = settings
        self.port = int(settings.listen[0].rsplit(":", 1)[1])
        self.url = f"http://127.0.0.1:{self.port}"

    async def serve(self, stop: asyncio.Event, on_ready: Callable[[], None]) -> None:
        from loader.master.server.app import serve

        await serve(self.settings, stop=stop, on_ready=on_ready)


@pytest.fixture(scope="module")
def inproc_master(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MasterThread]:
    workdir = tmp_path_factory.mktemp("master")
    settings = MasterSettings(
        listen=(f"tcp://127.0.0.1:{free_port()}", f"unix://{workdir}/master.sock"),
        state=f"sqlite://{workdir}/master.db",
        max_body_bytes=256 * 1024,
        lease_ttl_s=30,
    )
    master = MasterThread(settings).start()
    try:
        yield master
    finally:
        master.stop()


class Trainers:
    """Trainer threads using the real client against real masters, recording what they were told.

    Every trainer leases, renews, then completes; ``abandon_every`` makes trainer 0 walk away from
    some leases after a renew (as if killed), so they expire and are re-issued at that offset.
    Any acknowledged completion or renew is recorded; assertions are made at the end, on this
    thread."""

    def __init__(self, urls: str, job: str, count: int = 4, *, lease_count: int = 2, abandon_every: int = 0,
                 work_s: float = 0.002, deadline_s: float = 60.0) -> None:
        self.urls = urls
        self.job = job
        self.lease_count = lease_count
        self.abandon_every = abandon_every
        self.work_s = work_s
        self.deadline_s = deadline_s
        self.lock = threading.Lock()
        self.completions: list[tuple[int, int]] = []
        self.renewed: dict[tuple[int, int], int] = {}
        self.resumed: list[tuple[int, int, int, int]] = []  # (epoch, shard, offset given, offset expected)
        self.lost = 0
        self.errors: list[BaseException] = []
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(i,), name=f"trainer-{i}") for i in range(count)]

    def start(self) -> Trainers:
        for t in self.threads:
            t.start()
        return self

    def join(self, timeout: float = 90.0) -> None:
        for t in self.threads:
            t.join(timeout)
        assert not any(t.is_alive() for t in self.threads), "trainers did not finish in time"
        assert not self.errors, self.errors

    def _run(self, idx: int) -> None:
        import random
        import time

        from loader.master.client import LeaseLost, MasterClient

        client = MasterClient(self.urls, timeout_s=5, retry_deadline_s=self.deadline_s, backoff_max_s=0.3)
        name = f"trainer-{idx}"
        leased = 0
        try:
            while not self.stop.is_set():
                answer = client.lease(self.job, name, f"node-{idx % 2}", self.lease_count)
                if answer["status"] == "finished":
                    return
                if answer["status"] != "ok":
                    time.sleep(min(answer["retry_after_s"] or 0.1, 0.2))
                    continue
                for lease in answer["leases"]:
                    key = (lease["epoch"], lease["shard"])
                    with self.lock:
                        self.resumed.append((*key, lease["offset"], self.renewed.get(key, 0)))
                    leased += 1
                    try:
                        offset = min(lease["offset"] + random.randint(1, 3), lease["samples"])
                        client.renew(self.job, lease["lease"], name, offset)
                        with self.lock:
                            self.renewed[key] = max(self.renewed.get(key, 0), offset)
                        if self.abandon_every and idx == 0 and leased % self.abandon_every == 0:
                            continue  # walk away: the lease expires and is re-issued elsewhere
                        time.sleep(self.work_s)
                        client.complete(self.job, lease["lease"], name)
                        with self.lock:
                            self.completions.append(key)
                    except LeaseLost:
                        with self.lock:
                            self.lost += 1
        except BaseException as exc:
            self.errors.append(exc)

    def check_exactly_once(self, n: int, epochs: int) -> None:
        from collections import Counter

        counts = Counter(self.completions)
        dup = [k for k, c in counts.items() if c > 1]
        assert not dup, f"completed more than once: {dup[:5]}"
        for epoch in range(epochs):
            done = sorted(s for e, s in counts if e == epoch)
            assert done == list(range(n)), f"epoch {epoch}: missing {sorted(set(range(n)) - set(done))[:10]}"
        wrong = [r for r in self.resumed if r[2] != r[3]]
        assert not wrong, f"leases not resumed at the last renewed offset (epoch, shard, given, expected): {wrong[:5]}"


@pytest.fixture
def clients() -> Iterator[Callable[..., MasterClient]]:
    """``clients(urls, **options)`` makes a MasterClient that is closed when the test ends."""
    made: list[MasterClient] = []

    def make(*args: Any, **kwargs: Any) -> MasterClient:
        made.append(MasterClient(*args, **kwargs))
        return made[-1]

    yield make
    for client in made:
        client.close()
