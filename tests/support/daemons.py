"""The node daemon in the tests: its settings for an in-process daemon (:class:`DaemonThread` in
``tests.support.threads``), ``shardcache serve`` as a real process (:class:`DaemonProcess`, on
:mod:`bench.servers`' launcher), the CLI tests' daemon on a TCP port and a unix socket
(:class:`Daemon`) and daemons peered with each other (:class:`Cluster`)."""

from __future__ import annotations

import collections
import dataclasses
import functools
import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

from bench.servers import ServeProcess
from cache import StoreSettings
from sidecar.daemon.fills import FetchSettings
from sidecar.daemon.origins.base import FileOrigin
from sidecar.daemon.origins.s3 import S3Settings
from sidecar.daemon.settings import ServeSettings
from tests.support.processes import free_port
from tests.support.waits import wait_until
from wire.rendezvous import member_id

__all__ = [
    "FAST_RETRY",
    "PEER_SECRET",
    "Cluster",
    "Daemon",
    "DaemonProcess",
    "cache_files",
    "live_members",
    "make_settings",
    "replace_fetch",
    "http_get",
    "daemon_stats",
    "post_prefetch",
    "HeldOrigin",
]

FAST_RETRY = FetchSettings(retries=3, backoff_base_s=0.01, backoff_max_s=0.05, part_size=1024 * 1024)


def make_settings(
    cache_dir: Path,
    origin: str,
    endpoint: str | None = None,
    capacity: int = 1 << 30,
    eviction: str = "lru",
    fetch: FetchSettings = FAST_RETRY,
    extra_listen: tuple[str, ...] = (),
    **kwargs: Any,
) -> ServeSettings:
    return ServeSettings(
        store=StoreSettings(root=cache_dir, capacity_bytes=capacity, min_free_ratio=0.0, eviction=eviction),
        listen=(f"tcp://127.0.0.1:{free_port()}", *extra_listen),
        origin=origin,
        s3=S3Settings(endpoint_url=endpoint, read_timeout_s=5, connect_timeout_s=2),
        fetch=fetch,
        **kwargs,
    )


def replace_fetch(settings: ServeSettings, **changes: Any) -> ServeSettings:
    return dataclasses.replace(settings, fetch=dataclasses.replace(settings.fetch, **changes))


def cache_files(cache_dir: Path) -> list[Path]:
    return sorted(p for p in cache_dir.rglob("*") if p.is_file() and p.name != "LOCK")


class DaemonProcess(ServeProcess):
    """``shardcache serve`` as a real subprocess (for kill -9 and SIGTERM): ``args`` follow its
    TCP listener (``url``). ``start()`` returns once ``ready_path`` answers."""

    credentials: ClassVar[Mapping[str, str]] = {}

    def __init__(self, args: list[str], log: Path, env: dict[str, str] | None = None, *, ready_path: str = "/readyz") -> None:
        super().__init__(log, args, env, ready_path=ready_path)


class Daemon(DaemonProcess):
    """The CLI tests' daemon: a TCP port and a unix socket (``unix``), its cache and log in ``tmp``
    named by its port, the S3 origin at ``s3_endpoint`` or a ``file://`` one."""

    def __init__(self, tmp: Path, origin: str, s3_endpoint: str | None = None, cache_size: str = "1GiB",
                 extra: tuple[str, ...] = ()) -> None:
        super().__init__([], tmp / "daemon.log")
        self.log = tmp / f"daemon{self.port}.log"
        self.sock = tmp / f"d{self.port}.sock"
        self.unix = f"unix://{self.sock}"
        self.cache = tmp / f"cache{self.port}"
        self.args = [
            "--listen", self.unix, "--origin", origin, "--cache-dir", str(self.cache), "--cache-size", cache_size,
            "--min-free", "0", "--retries", "1", *extra,
        ]
        if s3_endpoint:
            self.args += ["--s3-endpoint", s3_endpoint]

    def get(self, path: str) -> Any:
        return self.get_json(path)

    def cached_keys(self) -> set[tuple[str, str]]:
        """(bucket, key) of every entry in the cache dir's published meta files."""
        found = set()
        for meta in (self.cache / "v1" / "meta").rglob("*.json"):
            doc = json.loads(meta.read_text())
            found.add((doc["bucket"], doc["key"]))
        return found


PEER_SECRET = b"0123456789abcdef0123456789abcdef"


def live_members(url: str) -> set[str]:
    """Ids of the members the daemon at ``url`` sees live (none while it does not answer)."""
    try:
        with urllib.request.urlopen(url + "/_shardcache/peers", timeout=20) as resp:
            return {m["id"] for m in json.loads(resp.read())["members"] if m["live"]}
    except OSError:
        return set()


class Cluster:
    """Daemon processes on the S3 origin at ``endpoint`` that name each other with ``--peer`` (one
    port each, chosen up front) and share a peer secret."""

    def __init__(self, tmp: Path, endpoint: str, count: int) -> None:
        secret_file = tmp / "secret"
        secret_file.write_bytes(PEER_SECRET + b"\n")
        self.daemons = [DaemonProcess([], tmp / f"d{i}.log") for i in range(count)]
        for i, daemon in enumerate(self.daemons):
            peers = [arg for other in self.daemons if other is not daemon for arg in ("--peer", other.url)]
            daemon.args += [
                "--origin", "s3", "--s3-endpoint", endpoint, "--cache-dir", str(tmp / f"cache{i}"),
                "--cache-size", "1GiB", "--min-free", "0", "--peer-secret-file", str(secret_file),
                "--node", f"node-{i}", "--scrub-rate", "0", *peers,
            ]
        self.ids = [member_id(d.url) for d in self.daemons]

    def start(self) -> None:
        for daemon in self.daemons:  # at once: no readiness waits on peers
            daemon.launch()
        for daemon in self.daemons:
            daemon.wait_ready()

    def wait_live(self, expected: set[str], among: list[DaemonProcess] | None = None, timeout: float = 15) -> float:
        """Wait until every daemon (of ``among``) sees exactly ``expected`` live; the seconds it took."""
        began = time.monotonic()
        for daemon in among or self.daemons:
            wait_until(functools.partial(_sees, daemon.url, expected), timeout=timeout, interval=0.1,
                       what=f"{daemon.url} to see {sorted(expected)} live")
        return time.monotonic() - began

    def stop(self) -> None:
        for daemon in self.daemons:
            daemon.stop()


def _sees(url: str, expected: set[str]) -> bool:
    return live_members(url) == expected


def http_get(url: str, headers: dict[str, str] | None = None, timeout: float = 20) -> tuple[int, bytes]:
    """One plain GET: (status, body), an HTTP error's too."""
    request = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def daemon_stats(url: str) -> dict[str, Any]:
    """A daemon's ``/_shardcache/stats`` at ``url``."""
    status, body = http_get(url + "/_shardcache/stats")
    assert status == 200, (status, body[:300])
    stats: dict[str, Any] = json.loads(body)
    return stats


def post_prefetch(url: str, keys: list[str], bucket: str = "bkt") -> int:
    """A reader's hint (``POST /_shardcache/prefetch``) of ``keys`` to the daemon at ``url``;
    asserts it was taken (202), returns how many objects the daemon accepted."""
    body = json.dumps({"objects": [{"bucket": bucket, "key": key} for key in keys]}).encode()
    request = urllib.request.Request(url + "/_shardcache/prefetch", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as resp:
        assert resp.status == 202
        accepted: int = json.loads(resp.read())["accepted"]
    return accepted


class HeldOrigin:
    """``file://`` origins (of a daemon in this process) whose first answer for ``held`` keys waits
    until :meth:`release`: a fill kept in flight, for as long as a test needs. Counts every key's
    first answers asked for (``opened``). Installed with ``monkeypatch``, gone with it."""

    def __init__(self, monkeypatch: Any, *held: str) -> None:
        self.held = set(held)
        self.opened: collections.Counter[str] = collections.Counter()
        self._release = threading.Event()
        real_open = FileOrigin.open_first

        def open_first(origin: FileOrigin, bucket: str, key: str, *, origin_only: bool = False) -> Any:
            self.opened[key] += 1
            if key in self.held:
                self._release.wait(20)
            return real_open(origin, bucket, key, origin_only=origin_only)

        monkeypatch.setattr(FileOrigin, "open_first", open_first)

    def release(self) -> None:
        self._release.set()
