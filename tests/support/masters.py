"""The lease master in the tests: ``shardcache master`` as a real process (:class:`MasterProcess`,
restartable on its port and state, on :mod:`bench.servers`' launcher), a real etcd, job specs,
plain HTTP calls and trainer threads that check exactly-once delivery."""

from __future__ import annotations

import json
import os
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, ClassVar, Self

from bench import servers

__all__ = ["ETCD", "EtcdServer", "MasterProcess", "Trainers", "http", "job_spec", "running_master", "shards"]

ETCD = os.environ.get("SHARDCACHE_TEST_ETCD", servers.ETCD)


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


class EtcdServer(servers.EtcdServer):
    """A real etcd (v3 API) on free ports with its data in ``workdir``."""

    credentials: ClassVar[Mapping[str, str]] = {}

    def __init__(self, workdir: Path, binary: str = ETCD, data_dir: str = "data", log_level: str | None = "warn") -> None:
        super().__init__(workdir, binary=binary, data_dir=data_dir, log_level=log_level)


class MasterProcess(servers.MasterProcess):
    """``shardcache master`` as a real process, restartable on the same port and state; its log is
    ``workdir/<name>.log``. With ``advertise`` its URL is its ``--advertise-url``."""

    credentials: ClassVar[Mapping[str, str]] = {}

    def __init__(self, workdir: Path, state: str, *args: str, name: str = "master", advertise: bool = True) -> None:
        super().__init__(workdir / f"{name}.log", state, args, advertise=advertise)
        self.workdir = workdir

    def start(self, wait: str = "ready") -> Self:
        """Start and wait until ``/readyz`` (``wait="ready"``) or ``/healthz`` answers."""
        self.ready_path = "/readyz" if wait == "ready" else "/healthz"
        return super().start()


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
                    # The master's own pacing (retry_after_s), capped: a trainer honours it.
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
                        time.sleep(self.work_s)  # the training step the lease is held for
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


@contextmanager
def running_master(workdir: Path) -> Iterator[str]:
    """``shardcache master`` on SQLite state in ``workdir`` (its log ``master.log``), ready; yields
    its URL and stops it afterwards (the loader's and torchrun tests' ``master`` fixture)."""
    master = MasterProcess(workdir, f"sqlite://{workdir / 'master.db'}", advertise=False).start("healthz")
    try:
        yield master.url
    finally:
        master.stop()
