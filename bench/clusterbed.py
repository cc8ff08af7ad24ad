"""A cluster on one machine: N hosts as Linux network namespaces on one bridge, an origin host
(moto) on the same bridge behind a bandwidth cap, and one ``shardcache serve`` per host, for the
cluster-cache tests (``tests/cluster/``) and ``bench.cluster_bench``.

Topology (root only; :class:`Cluster` makes and removes all of it)::

    root ns ──ctl veth──┐                         (the test process: uploads, /stats, kill -9)
                        │  bridge, in a "switch" namespace of its own
    origin ns ──veth────┤   (no root-namespace bridge: the machine's own firewall and
    node0 ns ──veth─────┤    br_netfilter never see the cluster's traffic)
    node1 ns ──veth─────┘   ...

Every namespace is named ``scc-<pid>-<hex>-<role>``, every interface this bed creates in the root
namespace ``scc<hex>...``; the addresses are one free ``10.x.y.0/24`` (picked as
``bench.netbed`` picks its /30s: no interface or route of this machine uses it): ``.1`` the root
namespace's control end, ``.2`` the origin, ``.10+i`` node ``i``. Inside a host the link is
``eth0``.

Caps are ``tbf`` with netbed's settings (``TBF_BURST``/``TBF_LATENCY``, measured there): the origin
cap sits on the origin's ``eth0`` egress (what the origin sends) and on its switch port (what it is
sent); a per-host cap likewise on the host's ``eth0`` and its switch port, so it holds what the
host serves to peers and what it receives. ``netem`` does not exist on these kernels: a
per-request latency to the origin, when asked for, is a ``bench.latency_proxy`` on each host's
loopback in front of the origin (it only listens on 127.0.0.1), which that host's daemon uses as
its S3 endpoint.

Teardown stops what the bed started, then anything else still in its namespaces, deletes the
namespaces (which takes the veth pairs with them) and the control veth; also after an error, a
failed set-up step or Ctrl-C, and safe to call twice. Every wait is bounded.

``python -m bench.clusterbed read ...`` is the reader the tests and the benchmark run inside a
host: it GETs objects through that host's daemon, checks each one's xxh3-128, and appends one JSON
line per object (unbuffered, so a ``kill -9`` loses nothing already written).
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import ipaddress
import json
import os
import random
import secrets
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

from bench.common import machine_facts, spawn, stop_process, wait_until
from bench.netbed import TBF_BURST, TBF_LATENCY, FarHostUnavailable, link_exists, netns_exists, run_ip, used_networks
from bench.netbed import check_available as _netbed_check_available
from bench.servers import MotoServer

__all__ = [
    "ClusterUnavailable",
    "Cluster",
    "Host",
    "Daemon",
    "DAEMON_PORT",
    "NETNS_PREFIX",
    "check_available",
    "read_results",
    "http_json",
    "main",
]

NETNS_PREFIX = "scc-"
DAEMON_PORT = 8600
# Same range as netbed (10.200-254.x.x, away from VPN/Docker/VPC defaults), but /24s.
_SECOND_OCTETS = range(200, 255)
_FIRST_NODE = 10
_MAX_NODES = 200
# No proxy for anything this bed reaches: the hosts exist only here.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class ClusterUnavailable(RuntimeError):
    """This machine cannot build the cluster (not root, or no ``ip`` / ``tc``)."""


def check_available() -> None:
    """Raise :class:`ClusterUnavailable` saying why a :class:`Cluster` cannot be built here."""
    try:
        _netbed_check_available()
    except FarHostUnavailable as exc:
        raise ClusterUnavailable(str(exc).replace("the far host", "the cluster test bed")) from exc


def http_json(url: str, timeout: float = 10.0) -> Any:
    """GET ``url`` (no proxy) and decode its JSON body."""
    with _OPENER.open(url, timeout=timeout) as resp:
        return json.loads(resp.read())


def _http_ok(url: str) -> bool:
    try:
        with _OPENER.open(url, timeout=2) as resp:
            return 200 <= resp.status < 300
    except (OSError, urllib.error.URLError):
        return False


def _free_subnet() -> ipaddress.IPv4Network:
    used = used_networks()
    rng = random.Random(secrets.randbits(32))
    for _ in range(512):
        net = ipaddress.IPv4Network(f"10.{rng.choice(_SECOND_OCTETS)}.{rng.randrange(256)}.0/24")
        if not any(net.overlaps(other) for other in used):
            return net
    raise RuntimeError(f"no free 10.x.y.0/24 found for the cluster (networks in use: {', '.join(map(str, used))})")


@dataclass
class Host:
    """One namespace of the cluster: a node, or the origin."""

    role: str  # "node0", "node1", ..., "origin"
    netns: str
    address: str
    port_dev: str  # its port on the bridge, in the switch namespace
    cluster: Cluster

    @property
    def exec_prefix(self) -> list[str]:
        """The command prefix that runs a program inside this host."""
        return ["ip", "netns", "exec", self.netns]

    def spawn(self, args: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        """``bench.common.spawn`` inside this host (``ip netns exec`` execs the program, so the pid
        is the program's); stopped at teardown if still running."""
        proc = spawn(self.exec_prefix + args, log, env)
        self.cluster._procs.append(proc)
        return proc

    def run(self, args: list[str], timeout: float, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        """Run ``args`` inside this host to completion (bounded), output captured."""
        full_env = {**os.environ, **(env or {})}
        return subprocess.run(self.exec_prefix + args, capture_output=True, text=True, timeout=timeout,
                              env=full_env, check=False)


# Runs inside the origin's namespace (``ip netns exec`` mounts that namespace's sysfs): the bytes its
# link has sent, ten times a second, on the clock every process on the machine shares.
_LINK_SAMPLER = (
    "import sys, time\n"
    "path = '/sys/class/net/eth0/statistics/tx_bytes'\n"
    "while True:\n"
    "    with open(path) as f:\n"
    "        print(f'{time.monotonic():.4f} {f.read().strip()}', flush=True)\n"
    "    time.sleep(float(sys.argv[1]))\n"
)


class LinkMeter:
    """What the origin's link carried over time: a sampler in the origin's namespace reads its
    ``tx_bytes`` every ``period_s`` (the bytes it sent the nodes), so that a run can say where in an
    epoch the link was busy and where it idled (:meth:`busy_by_part`), not only its mean."""

    def __init__(self, log: Path) -> None:
        self.log = log
        self.proc: subprocess.Popen[bytes] | None = None
        self._samples: list[tuple[float, int]] = []
        self._read_to = 0  # bytes of the log parsed so far: each call reads only what came since

    def start(self, host: Host, period_s: float = 0.1) -> Self:
        self.proc = host.spawn([sys.executable, "-c", _LINK_SAMPLER, str(period_s)], self.log)
        return self

    def samples(self) -> list[tuple[float, int]]:
        with contextlib.suppress(OSError), open(self.log, "rb") as handle:
            handle.seek(self._read_to)
            new = handle.read()
            done = new.rfind(b"\n") + 1  # a line still being written is read next time
            self._read_to += done
            for line in new[:done].splitlines():
                parts = line.split()
                if len(parts) == 2:
                    with contextlib.suppress(ValueError):
                        self._samples.append((float(parts[0]), int(parts[1])))
        return self._samples

    def busy_by_part(self, start: float, end: float, capacity_bytes_s: float, parts: int = 10) -> list[float] | None:
        """Each ``parts``-th of ``[start, end]`` (``time.monotonic``): the bytes the link sent over
        what its cap carries in that time (linear between samples); None without samples around it."""
        got = self.samples()
        deadline = time.monotonic() + 2.0
        while self.proc is not None and got and got[-1][0] < end and time.monotonic() < deadline:  # the next sample is due
            time.sleep(0.05)
            got = self.samples()
        if len(got) < 2 or got[0][0] > start or got[-1][0] < end or end <= start or capacity_bytes_s <= 0:
            return None
        times = [t for t, _ in got]

        def sent_at(t: float) -> float:
            i = min(max(1, bisect.bisect_left(times, t)), len(got) - 1)
            (t0, b0), (t1, b1) = got[i - 1], got[i]
            return b0 + (b1 - b0) * (t - t0) / (t1 - t0) if t1 > t0 else float(b1)
        step = (end - start) / parts
        edges = [sent_at(start + k * step) for k in range(parts + 1)]
        return [round((edges[k + 1] - edges[k]) / (capacity_bytes_s * step), 3) for k in range(parts)]

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc, timeout=5)


class Daemon:
    """``shardcache serve`` on one host, listening on ``<host ip>:8600``; :meth:`kill` is ``kill -9``,
    :meth:`start` (again) is what a DaemonSet does after it: the same flags, the same cache dir."""

    def __init__(self, host: Host, args: list[str], log: Path) -> None:
        self.host = host
        self.url = f"http://{host.address}:{DAEMON_PORT}"
        self.args = args
        self.log = log
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 40.0) -> Self:
        self.proc = self.host.spawn(self.args, self.log)
        proc = self.proc
        wait_until(lambda: proc.poll() is not None or _http_ok(self.url + "/readyz"), timeout=timeout,
                   what=f"the daemon on {self.host.role} at {self.url} (log: {self.log})")
        if proc.poll() is not None:
            raise RuntimeError(f"the daemon on {self.host.role} exited with {proc.returncode}:\n"
                               f"{self.log.read_text(errors='replace')[-3000:]}")
        return self

    def kill(self) -> None:
        """``kill -9``: no shutdown of any kind."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc, timeout=10)

    def stats(self) -> dict[str, Any]:
        data: dict[str, Any] = http_json(self.url + "/_shardcache/stats")
        return data

    def peers(self) -> dict[str, Any]:
        data: dict[str, Any] = http_json(self.url + "/_shardcache/peers")
        return data

    def settle(self, timeout: float = 30.0) -> None:
        """Wait until no fill is in flight (a reader may finish before its fill is published)."""
        wait_until(lambda: self.stats().get("fills_in_flight", 0) == 0, timeout=timeout,
                   what=f"fills on {self.host.role} to finish")


class Cluster:
    """``nodes`` hosts and an origin on one bridge: ``with Cluster(3, workdir) as c: c.start_origin();
    c.start_daemons(...)``.

    ``origin_mbps``: the origin host's link (both directions; None: veth speed). ``host_mbps``: each
    node's link (None: uncapped). ``origin_latency_ms``: per-request delay to the origin, by a
    latency proxy on each node (0: none)."""

    def __init__(self, nodes: int, workdir: Path, origin_mbps: float | None = 800.0, host_mbps: float | None = None,
                 origin_latency_ms: float = 0.0) -> None:
        if not 1 <= nodes <= _MAX_NODES:
            raise ValueError(f"nodes must be 1..{_MAX_NODES}, not {nodes}")
        if (origin_mbps is not None and origin_mbps <= 0) or (host_mbps is not None and host_mbps <= 0):
            raise ValueError("origin_mbps and host_mbps must be > 0 (or None for no cap)")
        self.workdir = workdir
        self.origin_mbps = origin_mbps
        self.host_mbps = host_mbps
        self.origin_latency_ms = origin_latency_ms
        self.token = secrets.token_hex(3)
        base = f"{NETNS_PREFIX}{os.getpid()}-{self.token}"
        self.switch_ns = f"{base}-sw"
        self.bridge = "br0"  # inside the switch namespace: no clash with anything of this machine
        self.ctl_dev = f"scc{self.token}c"  # the root namespace's end of the control link
        self.subnet: ipaddress.IPv4Network | None = None
        self.control_address = ""
        self._node_count = nodes
        self.hosts: list[Host] = []
        self.origin_host: Host | None = None
        self.daemons: list[Daemon] = []
        self.moto: MotoServer | None = None
        self.s3_endpoint = ""  # the origin, as reached from the root namespace and from every host
        self._proxy_ports: dict[str, int] = {}
        self._procs: list[subprocess.Popen[bytes]] = []
        self._made = False

    # -- set-up --------------------------------------------------------------------------------

    def _namespaces(self) -> list[str]:
        base = f"{NETNS_PREFIX}{os.getpid()}-{self.token}"
        return [self.switch_ns, f"{base}-origin", *(f"{base}-n{i}" for i in range(self._node_count))]

    def __enter__(self) -> Self:
        check_available()
        try:
            self._setup()
        except BaseException:
            self.close()
            raise
        return self

    def _setup(self) -> None:
        names = self._namespaces()
        existing = set(run_ip(["ip", "netns", "list"]).split())
        if existing & set(names) or link_exists(self.ctl_dev):
            raise RuntimeError(f"a namespace or interface of this test bed ({self.switch_ns}) exists already")
        self.workdir.mkdir(parents=True, exist_ok=True)
        # Marked before the first command: teardown deletes what exists of these names, so a
        # Ctrl-C between the kernel acting and the command returning leaves nothing behind.
        self._made = True
        self.subnet = _free_subnet()
        addresses = list(self.subnet.hosts())
        prefix = self.subnet.prefixlen
        for name in names:
            run_ip(["ip", "netns", "add", name])
        sw = self.switch_ns
        run_ip(["ip", "-n", sw, "link", "add", self.bridge, "type", "bridge"])
        run_ip(["ip", "-n", sw, "link", "set", self.bridge, "up"])
        run_ip(["ip", "-n", sw, "link", "set", "lo", "up"])
        # the control link: root end keeps its name and .1, the other end is a bridge port
        self.control_address = str(addresses[0])
        run_ip(["ip", "link", "add", self.ctl_dev, "type", "veth", "peer", "name", "ctl", "netns", sw])
        run_ip(["ip", "-n", sw, "link", "set", "ctl", "master", self.bridge, "up"])
        run_ip(["ip", "addr", "add", f"{self.control_address}/{prefix}", "dev", self.ctl_dev])
        run_ip(["ip", "link", "set", self.ctl_dev, "up"])
        roles = ["origin", *(f"node{i}" for i in range(self._node_count))]
        ips = [addresses[1], *(addresses[_FIRST_NODE - 1 + i] for i in range(self._node_count))]
        for role, netns, ip in zip(roles, names[1:], ips, strict=True):
            port_dev = "p-" + role  # in the switch namespace
            run_ip(["ip", "-n", sw, "link", "add", port_dev, "type", "veth", "peer", "name", "eth0", "netns", netns])
            run_ip(["ip", "-n", sw, "link", "set", port_dev, "master", self.bridge, "up"])
            run_ip(["ip", "-n", netns, "addr", "add", f"{ip}/{prefix}", "dev", "eth0"])
            run_ip(["ip", "-n", netns, "link", "set", "eth0", "up"])
            run_ip(["ip", "-n", netns, "link", "set", "lo", "up"])
            host = Host(role, netns, str(ip), port_dev, self)
            if role == "origin":
                self.origin_host = host
            else:
                self.hosts.append(host)
        self.set_capped(True)
        wait_until(self._links_up, timeout=15, what="the cluster's links to come up")

    def _links_up(self) -> bool:
        # STP is off on the bridge (the default), so a port forwards as soon as its link is up.
        hosts = [h for h in (self.origin_host, *self.hosts) if h is not None]
        return all("state UP" in run_ip(["ip", "-n", h.netns, "-o", "link", "show", "eth0"]) for h in hosts)

    def _tbf(self, mbps: float) -> list[str]:
        return ["tbf", "rate", f"{mbps:g}mbit", "burst", TBF_BURST, "latency", TBF_LATENCY]

    def _cap(self, host: Host, mbps: float | None, capped: bool) -> None:
        for ns, dev in ((host.netns, "eth0"), (self.switch_ns, host.port_dev)):
            if capped and mbps is not None:
                run_ip(["tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", *self._tbf(mbps)])
            else:
                with contextlib.suppress(RuntimeError):  # no qdisc there: already uncapped
                    run_ip(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"])

    def set_capped(self, capped: bool) -> None:
        """Put every cap on (the origin's and each host's), or take them off."""
        if self.origin_host is not None:
            self._cap(self.origin_host, self.origin_mbps, capped)
        for host in self.hosts:
            self._cap(host, self.host_mbps, capped)

    @contextlib.contextmanager
    def uncapped(self) -> Iterator[None]:
        """Lift the caps for work that is not measured (uploading the dataset), then restore them."""
        self.set_capped(False)
        try:
            yield
        finally:
            self.set_capped(True)

    # -- what runs on it ----------------------------------------------------------------------

    def start_origin(self) -> str:
        """moto (objects in RAM) on the origin host; returns its endpoint (reachable from the root
        namespace, for uploads, and from every host)."""
        origin = self.origin_host
        assert origin is not None, "start_origin() inside the with"
        moto = MotoServer(self.workdir).listen_on(origin.address, origin.exec_prefix)
        self.moto = moto.__enter__()
        self.s3_endpoint = moto.endpoint
        if self.origin_latency_ms > 0:
            for host in self.hosts:
                self._start_latency_proxy(host)
        return self.s3_endpoint

    def _start_latency_proxy(self, host: Host) -> None:
        port = 9400  # a fresh namespace: every port is free
        upstream = self.s3_endpoint.removeprefix("http://")
        host.spawn([sys.executable, "-m", "bench.latency_proxy", "--port", str(port), "--upstream", upstream,
                    "--delay-ms", str(self.origin_latency_ms)], self.workdir / f"proxy-{host.role}.log")
        probe = [sys.executable, "-c", f"import socket; socket.create_connection(('127.0.0.1', {port}), 1)"]
        wait_until(lambda: host.run(probe, timeout=10).returncode == 0, timeout=20,
                   what=f"the latency proxy on {host.role}", interval=0.2)
        self._proxy_ports[host.role] = port

    def endpoint_for(self, host: Host) -> str:
        """The S3 endpoint ``host``'s daemon reads the origin at (its latency proxy, if any)."""
        port = self._proxy_ports.get(host.role)
        return f"http://127.0.0.1:{port}" if port else self.s3_endpoint

    def s3_client(self) -> Any:
        """A boto3 client for the origin, from the root namespace."""
        from bench.common import s3_client

        return s3_client(self.s3_endpoint)

    def upload(self, bucket: str, objects: dict[str, bytes]) -> None:
        """Create ``bucket`` and put ``objects`` into it, caps lifted meanwhile."""
        client = self.s3_client()
        with self.uncapped():
            with contextlib.suppress(client.exceptions.BucketAlreadyOwnedByYou):
                client.create_bucket(Bucket=bucket)
            for key, data in objects.items():
                client.put_object(Bucket=bucket, Key=key, Body=data)

    def daemon_args(self, host: Host, cache_size: str, peers: bool, secret_file: Path | None,
                    extra: Sequence[str] = (), name: str = "daemon") -> list[str]:
        """``shardcache serve`` for ``host``: its own cache dir (``<role>/<name>-cache``), the
        origin, its node's name (``--node``: the role), and with ``peers`` every other node as ``--peer``,
        itself as ``--advertise-url``."""
        url = f"http://{host.address}:{DAEMON_PORT}"
        args = [sys.executable, "-m", "sidecar.cli", "serve", "--listen", f"tcp://{host.address}:{DAEMON_PORT}",
                "--cache-dir", str(self.workdir / host.role / f"{name}-cache"), "--cache-size", cache_size,
                "--min-free", "0%", "--origin", "s3", "--s3-endpoint", self.endpoint_for(host),
                "--s3-region", "us-east-1", "--node", host.role]
        if peers:
            args += ["--advertise-url", url]
            for other in self.hosts:
                if other is not host:
                    args += ["--peer", f"http://{other.address}:{DAEMON_PORT}"]
            if secret_file is not None:
                args += ["--peer-secret-file", str(secret_file)]
        return [*args, *extra]

    def start_daemons(self, cache_size: str, peers: bool = True, secret: bool = True,
                      extra: Sequence[str] = (), name: str = "daemon") -> list[Daemon]:
        """One daemon per node, started at once (they must find each other without waiting on one
        another), each waited for until ready. ``name`` tells the cache dirs and logs of several
        sets apart (one set at a time: they all listen on port 8600; :meth:`stop_daemons`)."""
        secret_file: Path | None = None
        if peers and secret:
            secret_file = self.workdir / "peer-secret"
            secret_file.write_text(secrets.token_hex(32) + "\n")
            secret_file.chmod(0o600)
        daemons = []
        for host in self.hosts:
            (self.workdir / host.role).mkdir(parents=True, exist_ok=True)
            daemon = Daemon(host, self.daemon_args(host, cache_size, peers, secret_file, extra, name),
                            self.workdir / host.role / f"{name}.log")
            daemon.proc = host.spawn(daemon.args, daemon.log)
            daemons.append(daemon)
        for daemon in daemons:
            proc = daemon.proc
            assert proc is not None
            wait_until(lambda d=daemon, p=proc: p.poll() is not None or _http_ok(d.url + "/readyz"),  # type: ignore[misc]
                       timeout=60, what=f"the daemon on {daemon.host.role} (log: {daemon.log})")
            if proc.poll() is not None:
                raise RuntimeError(f"the daemon on {daemon.host.role} exited with {proc.returncode}:\n"
                                   f"{daemon.log.read_text(errors='replace')[-3000:]}")
        self.daemons = daemons
        return daemons

    def stop_daemons(self) -> None:
        """Stop (SIGTERM, bounded) the daemons :meth:`start_daemons` started."""
        for daemon in self.daemons:
            daemon.stop()
        self.daemons = []

    def wait_members(self, live: int, timeout: float = 20.0) -> None:
        """Wait until every running daemon sees ``live`` live members (itself included)."""
        def converged() -> bool:
            for daemon in self.daemons:
                if daemon.proc is None or daemon.proc.poll() is not None:
                    continue
                members = daemon.peers()["members"]
                if sum(1 for m in members if m.get("live")) != live:
                    return False
            return True

        wait_until(converged, timeout=timeout, what=f"every daemon to see {live} live members", interval=0.2)

    def start_reader(self, host: Host, endpoint: str, bucket: str, objects: list[dict[str, Any]], out: Path,
                     epochs: int = 1, delay_s: float = 0.0, retry_for_s: float = 0.0, seed: int | None = None
                     ) -> subprocess.Popen[bytes]:
        """``python -m bench.clusterbed read`` inside ``host`` (see :func:`main`)."""
        listing = out.with_suffix(".objects.json")
        listing.write_text(json.dumps(objects))
        args = [sys.executable, "-m", "bench.clusterbed", "read", "--endpoint", endpoint, "--bucket", bucket,
                "--objects", str(listing), "--out", str(out), "--epochs", str(epochs), "--delay", str(delay_s),
                "--retry-for", str(retry_for_s)]
        if seed is not None:
            args += ["--seed", str(seed)]
        return host.spawn(args, out.with_suffix(".log"))

    def facts(self) -> dict[str, Any]:
        """The setup, for result files."""
        return {
            "nodes": len(self.hosts), "subnet": str(self.subnet), "switch_netns": self.switch_ns,
            "origin": {"address": self.origin_host.address if self.origin_host else None,
                       "link_mbit": self.origin_mbps, "latency_ms": self.origin_latency_ms,
                       "latency_by": "bench.latency_proxy on each node's loopback" if self.origin_latency_ms else None},
            "host_link_mbit": self.host_mbps,
            "tbf": {"burst": TBF_BURST, "latency": TBF_LATENCY,
                    "on": "a host's eth0 egress and its bridge port's egress (both directions)"},
            "hosts": {h.role: h.address for h in self.hosts},
        }

    # -- teardown -----------------------------------------------------------------------------

    def _pids_in(self, netns: str) -> list[int]:
        try:
            return [int(word) for word in run_ip(["ip", "netns", "pids", netns]).split()]
        except RuntimeError:
            return []

    def _stop_inside(self, names: list[str]) -> None:
        """Stop what the bed started, then anything else still in its namespaces (a child that
        left its process group): a namespace with a process in it outlives ``netns del``."""
        for proc in self._procs:
            with contextlib.suppress(Exception):
                stop_process(proc, timeout=10)
        self._procs.clear()
        for sig in (signal.SIGTERM, signal.SIGKILL):
            pids = [pid for name in names for pid in self._pids_in(name)]
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
            deadline = time.monotonic() + 5
            while pids and time.monotonic() < deadline:
                time.sleep(0.05)
                pids = [pid for name in names for pid in self._pids_in(name)]
            if not pids:
                return

    def close(self) -> None:
        """Undo whatever set-up got done; each step runs even if the one before failed."""
        if not self._made:
            return
        names = self._namespaces()
        try:
            if self.moto is not None:
                with contextlib.suppress(Exception):
                    self.moto.__exit__()
                self.moto = None
            self._stop_inside(names)
        finally:
            try:
                for name in names:
                    with contextlib.suppress(RuntimeError):
                        if netns_exists(name):
                            run_ip(["ip", "netns", "del", name])
            finally:
                if link_exists(self.ctl_dev):
                    with contextlib.suppress(RuntimeError):  # gone with the switch namespace meanwhile
                        run_ip(["ip", "link", "del", self.ctl_dev])
                wait_until(lambda: not link_exists(self.ctl_dev), timeout=5, what=f"{self.ctl_dev} to go")
                self._made = False

    def gone(self) -> bool:
        """Nothing of this bed is left (namespaces, control veth)."""
        existing = set(run_ip(["ip", "netns", "list"]).split())
        return not (existing & set(self._namespaces())) and not link_exists(self.ctl_dev)

    def __exit__(self, *exc: object) -> None:
        self.close()


# -- the reader ---------------------------------------------------------------------------------


def read_results(out: Path) -> list[dict[str, Any]]:
    """The JSON lines a reader wrote (a torn last line after ``kill -9`` is skipped)."""
    rows = []
    if out.exists():
        for line in out.read_text().splitlines():
            with contextlib.suppress(ValueError):
                rows.append(json.loads(line))
    return rows


def _get(url: str, timeout: float) -> bytes:
    with _OPENER.open(url, timeout=timeout) as resp:
        return bytes(resp.read())


def _read(args: argparse.Namespace) -> int:
    import xxhash

    objects = json.loads(Path(args.objects).read_text())
    fd = os.open(args.out, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    errors = 0
    try:
        for epoch in range(args.epochs):
            order = list(objects)
            if args.seed is not None:
                random.Random(args.seed * 1000 + epoch).shuffle(order)
            for obj in order:
                url = f"{args.endpoint.rstrip('/')}/{args.bucket}/{obj['key']}"
                started = time.monotonic()
                deadline = started + args.retry_for
                attempts = 0
                row: dict[str, Any]
                while True:
                    attempts += 1
                    try:
                        data = _get(url, timeout=60)
                    except (OSError, urllib.error.URLError) as exc:
                        # Only connection-level failures are retried (a daemon restarting); an
                        # HTTP error answer is an answer.
                        retryable = not isinstance(exc, urllib.error.HTTPError)
                        if retryable and time.monotonic() < deadline:
                            time.sleep(0.2)
                            continue
                        row = {"error": f"{type(exc).__name__}: {exc}"}
                        break
                    digest = xxhash.xxh3_128_hexdigest(data)
                    row = {"bytes": len(data), "ok": digest == obj["xxh3_128"] and len(data) == obj["size"]}
                    if not row["ok"]:
                        row["error"] = f"wrong bytes: {len(data)} B, xxh3-128 {digest}"
                    break
                errors += "error" in row
                row.update({"e": epoch, "key": obj["key"], "attempts": attempts,
                            "t": round(time.monotonic() - started, 4)})
                os.write(fd, (json.dumps(row) + "\n").encode())
                if args.delay:
                    time.sleep(args.delay)
        os.write(fd, (json.dumps({"done": True, "errors": errors}) + "\n").encode())
    finally:
        os.close(fd)
    return 1 if errors else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.clusterbed",
                                     description="The cluster test bed: a reader to run inside a host, or a "
                                                 "set-up check (build the bed, start the daemons, tear down)")
    sub = parser.add_subparsers(dest="command", required=True)
    read = sub.add_parser("read", help="GET objects through a daemon, check each one's xxh3-128, one JSON line each")
    read.add_argument("--endpoint", required=True, help="the daemon, http://host:port")
    read.add_argument("--bucket", required=True)
    read.add_argument("--objects", required=True, help='JSON file: [{"key", "size", "xxh3_128"}, ...]')
    read.add_argument("--out", required=True, help="JSON lines, appended")
    read.add_argument("--epochs", type=int, default=1)
    read.add_argument("--delay", type=float, default=0.0, help="seconds to wait after each object")
    read.add_argument("--retry-for", type=float, default=0.0,
                      help="retry an object this long on connection errors (a daemon restarting); 0: no retry")
    read.add_argument("--seed", type=int, default=None, help="shuffle the order per epoch with this seed")
    check = sub.add_parser("check", help="build a cluster, start its daemons with peers, print it, tear it down")
    check.add_argument("--nodes", type=int, default=3)
    args = parser.parse_args(argv)
    if args.command == "read":
        return _read(args)
    try:
        check_available()
    except ClusterUnavailable as exc:
        parser.error(str(exc))
    import tempfile

    with tempfile.TemporaryDirectory(prefix="clusterbed-") as tmp, Cluster(args.nodes, Path(tmp)) as cluster:
        cluster.start_origin()
        cluster.start_daemons("64MiB")
        cluster.wait_members(args.nodes)
        print(json.dumps({"cluster": cluster.facts(), "peers": cluster.daemons[0].peers(),
                          "machine": machine_facts()}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
