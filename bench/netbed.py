"""A far host for the benchmarks: a Linux network namespace on its own private link, capped with
``tc``, so that an origin inside it is far away by the network's doing, not by a CPU-bound proxy.

:class:`FarHost` (root only) creates a namespace ``scb-<pid>-<hex>``, a veth pair whose host end
stays in the root namespace, a private ``10.x.y.0/30`` that no interface or route uses yet, and a
``tbf`` qdisc of the same rate on both ends: the namespace end's egress caps what the origin sends
(answers), the host end's egress what clients send (requests, uploads). A server started with
:meth:`FarHost.spawn` listens on :attr:`FarHost.address`; clients in the root namespace reach it
across the link. Teardown stops whatever still runs in the namespace, then deletes the namespace
and the host veth, also after an error or Ctrl-C; a setup step that fails undoes the earlier ones.

Why these tbf settings (measured on the 2-core VM, ``python -m bench.netbed --mbps N``, 1 and 8
TCP streams of 0.3-1.5 GB each from a Python sender inside): with ``burst 256kb`` one stream and
eight streams both reach the cap at 200, 400, 800, 1,600, 4,000 and 10,000 Mbit/s (95.3-95.8% of
it as TCP payload; the rest is Ethernet/IP/TCP headers, which tbf counts). Other bursts changed
nothing that matters: 1 MiB (4 MiB at 4,000-10,000 Mbit/s) only adds its own size to a transfer
(+0.3% on 300 MB), 32 KiB lost 1.8% with eight streams at 1,600 Mbit/s. ``latency 20ms`` (the queue
limit: rate x latency + burst): 16 streams at 800 Mbit/s dropped no packet (5 ms dropped 308),
and a connection opened under load saw a 4-6 ms round trip at 5, 20 and 50 ms alike, because TCP
small queues keep local senders from filling the queue; a longer queue would buy nothing.
``netem`` (delay) is not available on these kernels: latency comes from ``bench.latency_proxy``
in front, or is left out.

``flow_mbps`` adds what makes S3 far in practice, a per-connection limit (AWS plans 85-90 MB/s
per request): the namespace end then runs HTB instead of tbf, the link's rate on a parent class
and 256 leaf classes of ``ceil flow_mbps``, a u32 filter hashing each TCP packet to a leaf by the
low byte of its destination port (the client's port: one leaf per connection, two connections
sharing a leaf only when their ports share that byte). Neither ``fq maxrate`` nor the ``flow``
classifier exists on these kernels. Measured at 1,600 Mbit/s with 400 Mbit/s per flow: 1, 2, 4
and 8 streams got 47.8, 95.6, 191.2 and 191.0 MB/s.

    python -m bench.netbed --mbps 400               # what a stream and 8 streams get through the cap
"""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import os
import random
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Self

from bench.common import spawn, stop_process, wait_until

__all__ = ["run_ip", "used_networks", "FarHost", "FarHostUnavailable", "check_available", "TBF_BURST", "TBF_LATENCY", "NETNS_PREFIX",
           "sender_command", "listening", "measure_mb_s", "netns_exists", "link_exists", "main"]

NETNS_PREFIX = "scb-"
TBF_BURST = "256kb"
TBF_LATENCY = "20ms"
_CMD_TIMEOUT_S = 15.0
# Pick /30s out of 10.200.0.0-10.254.255.0: well away from the 10.0.x.0 networks that VPNs,
# Docker and cloud VPCs tend to take, and wide enough that two runs at once do not collide.
_SECOND_OCTETS = range(200, 255)


class FarHostUnavailable(RuntimeError):
    """This machine cannot build the far host (not root, or no ``ip`` / ``tc``)."""


def check_available() -> None:
    """Raise :class:`FarHostUnavailable` saying why a :class:`FarHost` cannot be built here."""
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise FarHostUnavailable(f"the far host needs iproute2's {' and '.join(missing)} "
                                 "(apt-get install -y iproute2)")
    if os.geteuid() != 0:
        raise FarHostUnavailable("the far host needs root: it creates a network namespace, a veth pair and tc "
                                 "qdiscs (run as root, e.g. sudo -E python -m bench ...)")


def run_ip(args: list[str], timeout: float = _CMD_TIMEOUT_S, stdin: str | None = None) -> str:
    """Run one ``ip``/``tc`` command (``stdin``: what to feed it), bounded; raise with its own
    error message on failure."""
    try:
        proc = subprocess.run(args, input=stdin, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired as exc:
        raise RuntimeError(f"{' '.join(args)}: no answer after {timeout:.0f}s") from exc
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed ({proc.returncode}): {proc.stderr.strip() or proc.stdout.strip()}")
    return proc.stdout


def netns_exists(name: str) -> bool:
    return name in run_ip(["ip", "netns", "list"]).split()


def link_exists(name: str) -> bool:
    """Whether a network interface of that name exists in the root namespace."""
    return os.path.exists(f"/sys/class/net/{name}")


def used_networks() -> list[ipaddress.IPv4Network]:
    """Every IPv4 network an interface holds or a route points at, in the root namespace."""
    used = []
    for line in run_ip(["ip", "-o", "-4", "addr", "show"]).splitlines():
        words = line.split()
        if "inet" in words:
            used.append(ipaddress.IPv4Interface(words[words.index("inet") + 1]).network)
    for line in run_ip(["ip", "-4", "route", "show", "table", "all"]).splitlines():
        words = line.split()
        # "default via ...", "local 10.1.2.3 dev ...", "10.8.0.0/16 dev tun0": the destination
        # is the first word that parses as a network.
        for word in words[:2]:
            with contextlib.suppress(ValueError):
                used.append(ipaddress.IPv4Network(word, strict=False))
                break
    return [net for net in used if net.prefixlen > 0]  # a default route overlaps everything


def _free_subnet() -> ipaddress.IPv4Network:
    used = used_networks()
    rng = random.Random(secrets.randbits(32))
    for _ in range(512):
        net = ipaddress.IPv4Network(f"10.{rng.choice(_SECOND_OCTETS)}.{rng.randrange(256)}.0/30")
        if not any(net.overlaps(other) for other in used):
            return net
    raise RuntimeError(f"no free 10.x.y.0/30 found for the far host (networks in use: {', '.join(map(str, used))})")


class FarHost:
    """A network namespace behind a ``mbps`` Mbit/s link (both directions): ``with FarHost(800) as
    far: far.spawn([...], log)``; :attr:`address` is the namespace's end of the link.

    ``mbps`` is the link rate tbf enforces on frames (headers included): TCP payload gets ~95.6%.
    """

    def __init__(self, mbps: float, burst: str = TBF_BURST, latency: str = TBF_LATENCY,
                 flow_mbps: float | None = None) -> None:
        if mbps <= 0 or (flow_mbps is not None and flow_mbps <= 0):
            raise ValueError("mbps and flow_mbps must be > 0")
        self.mbps = mbps
        self.flow_mbps = flow_mbps
        self.burst = burst
        self.latency = latency
        token = secrets.token_hex(3)
        self.name = f"{NETNS_PREFIX}{os.getpid()}-{token}"
        # Interface names are at most 15 bytes: the token alone keeps them unique.
        self.host_veth = f"scb{token}h"
        self.ns_veth = f"scb{token}n"
        self.subnet: ipaddress.IPv4Network | None = None
        self.host_address = ""
        self.address = ""
        self._made = False
        self._procs: list[subprocess.Popen[bytes]] = []

    # -- what callers use ----------------------------------------------------------------------

    @property
    def exec_prefix(self) -> list[str]:
        """The command prefix that runs a program inside the namespace."""
        return ["ip", "netns", "exec", self.name]

    def spawn(self, args: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        """``bench.common.spawn`` of ``args`` inside the namespace (``ip netns exec`` execs the
        program itself, so the pid is the program's); stopped at teardown if still running."""
        proc = spawn(self.exec_prefix + args, log, env)
        self._procs.append(proc)
        return proc

    def tbf_args(self) -> list[str]:
        return ["tbf", "rate", f"{self.mbps:g}mbit", "burst", self.burst, "latency", self.latency]

    def _flow_batch(self) -> str:
        """``tc -batch`` lines of the per-connection cap on the namespace end (module docstring)."""
        dev, rate = self.ns_veth, self.mbps
        lines = [f"qdisc add dev {dev} root handle 1: htb default 100 r2q 10000",
                 f"class add dev {dev} parent 1: classid 1:1 htb rate {rate:g}mbit ceil {rate:g}mbit "
                 f"burst {self.burst} cburst {self.burst}"]
        for leaf in range(256):
            lines.append(f"class add dev {dev} parent 1:1 classid 1:{0x100 + leaf:x} htb rate {rate / 256:.3f}mbit "
                         f"ceil {self.flow_mbps:g}mbit burst 64k cburst 64k quantum 60000")
        lines.append(f"filter add dev {dev} parent 1: prio 1 handle 2: protocol ip u32 divisor 256")
        for leaf in range(256):
            lines.append(f"filter add dev {dev} parent 1: prio 1 protocol ip u32 ht 2:{leaf:x}: match u32 0 0 "
                         f"flowid 1:{0x100 + leaf:x}")
        # TCP (protocol 6) hashed on the byte at 23 (the low byte of the destination port; no IP options).
        lines.append(f"filter add dev {dev} parent 1: prio 1 protocol ip u32 ht 800:: match ip protocol 6 0xff "
                     "hashkey mask 0x000000ff at 20 link 2:")
        return "\n".join(lines) + "\n"

    def set_capped(self, capped: bool) -> None:
        """Put the cap on both ends, or take it off (the link then runs at veth speed)."""
        for prefix, dev in ((["tc"], self.host_veth), (["tc", "-n", self.name], self.ns_veth)):
            if capped and self.flow_mbps is not None and dev == self.ns_veth:
                with contextlib.suppress(RuntimeError):
                    run_ip([*prefix, "qdisc", "del", "dev", dev, "root"])
                run_ip([*prefix, "-force", "-batch", "-"], stdin=self._flow_batch())
            elif capped:
                run_ip([*prefix, "qdisc", "replace", "dev", dev, "root", *self.tbf_args()])
            else:
                with contextlib.suppress(RuntimeError):  # no qdisc there: already uncapped
                    run_ip([*prefix, "qdisc", "del", "dev", dev, "root"])

    @contextlib.contextmanager
    def uncapped(self) -> Iterator[None]:
        """Lift the cap for work that is not measured (uploading the dataset), then restore it."""
        self.set_capped(False)
        try:
            yield
        finally:
            self.set_capped(True)

    def facts(self) -> dict[str, Any]:
        """The setup, for result files."""
        return {
            "netns": self.name, "address": self.address, "host_address": self.host_address,
            "subnet": str(self.subnet), "link_mbit": self.mbps, "flow_mbit": self.flow_mbps,
            "tbf": {"rate": f"{self.mbps:g}mbit", "burst": self.burst, "latency": self.latency,
                    "on": "both veth ends (origin->client: the namespace end's egress)"},
        }

    # -- set-up and teardown -------------------------------------------------------------------

    def __enter__(self) -> Self:
        check_available()
        try:
            self._setup()
        except BaseException:
            self.close()
            raise
        return self

    def _setup(self) -> None:
        # Teardown deletes by name: never one this far host did not make.
        if netns_exists(self.name) or link_exists(self.host_veth) or link_exists(self.ns_veth):
            raise RuntimeError(f"network namespace {self.name} or veth {self.host_veth} exists already")
        # Marked before the first command runs, and teardown checks what exists: a Ctrl-C between
        # the kernel acting and the command returning leaves nothing behind either.
        self._made = True
        run_ip(["ip", "netns", "add", self.name])
        run_ip(["ip", "link", "add", self.host_veth, "type", "veth", "peer", "name", self.ns_veth])
        run_ip(["ip", "link", "set", self.ns_veth, "netns", self.name])
        self.subnet = _free_subnet()
        host, far = list(self.subnet.hosts())
        self.host_address, self.address = str(host), str(far)
        run_ip(["ip", "addr", "add", f"{host}/{self.subnet.prefixlen}", "dev", self.host_veth])
        run_ip(["ip", "link", "set", self.host_veth, "up"])
        run_ip(["ip", "-n", self.name, "addr", "add", f"{far}/{self.subnet.prefixlen}", "dev", self.ns_veth])
        run_ip(["ip", "-n", self.name, "link", "set", self.ns_veth, "up"])
        run_ip(["ip", "-n", self.name, "link", "set", "lo", "up"])
        self.set_capped(True)
        wait_until(self._carrier_up, timeout=10, what=f"the far host's link {self.host_veth} to come up")

    def _carrier_up(self) -> bool:
        state = Path(f"/sys/class/net/{self.host_veth}/operstate").read_text().strip()
        return state == "up" and "state UP" in run_ip(["ip", "-n", self.name, "-o", "link", "show", self.ns_veth])

    def _stop_inside(self) -> None:
        """Stop what this far host started, then anything else still in its namespace (a child
        that left its process group): a namespace with a process in it outlives ``netns del``."""
        for proc in self._procs:
            with contextlib.suppress(Exception):
                stop_process(proc, timeout=10)
        self._procs.clear()
        for sig in (signal.SIGTERM, signal.SIGKILL):
            pids = self.pids_inside()
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
            deadline = time.monotonic() + 5
            while pids and time.monotonic() < deadline:
                time.sleep(0.05)
                pids = self.pids_inside()
            if not pids:
                return

    def pids_inside(self) -> list[int]:
        """Every process in the namespace (``ip netns pids``); [] once it is gone."""
        try:
            return [int(word) for word in run_ip(["ip", "netns", "pids", self.name]).split()]
        except RuntimeError:
            return []

    def _delete_host_veth(self) -> None:
        if link_exists(self.host_veth):
            with contextlib.suppress(RuntimeError):  # gone with the namespace meanwhile
                run_ip(["ip", "link", "del", self.host_veth])
        # The kernel frees a pair whose namespace end went with its namespace asynchronously.
        wait_until(lambda: not link_exists(self.host_veth), timeout=5, what=f"{self.host_veth} to go")

    def close(self) -> None:
        """Undo whatever set-up got done: the processes inside, the namespace (which takes its
        veth end and so the pair with it), then the host end if it is still there. Each step runs
        even if the one before failed; safe to call twice."""
        if not self._made:
            return
        try:
            self._stop_inside()
        finally:
            try:
                if netns_exists(self.name):
                    run_ip(["ip", "netns", "del", self.name])
            finally:
                self._delete_host_veth()
                self._made = False

    def __exit__(self, *exc: object) -> None:
        self.close()


# -- measuring the bed --------------------------------------------------------------------------

_SENDER = """
import socket, sys, threading
srv = socket.socket()
srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind((sys.argv[1], int(sys.argv[2])))
srv.listen(64)
block = memoryview(bytes(1 << 20))
def serve(conn):
    # a client sends the byte count it wants, then reads that many bytes
    with conn:
        asked = conn.recv(32)
        left = int(asked) if asked.strip() else 0  # a bare connect (readiness probe) asks nothing
        while left > 0:
            left -= conn.send(block[:min(left, len(block))])
while True:
    conn, _ = srv.accept()
    threading.Thread(target=serve, args=(conn,), daemon=True).start()
"""


def sender_command(host: str, port: int) -> list[str]:
    """A tiny TCP sender: each connection gets the number of bytes it asks for."""
    return [sys.executable, "-c", _SENDER, host, str(port)]


def listening(host: str, port: int) -> bool:
    """Whether something accepts connections at ``host:port`` (raises when nothing does)."""
    with socket.create_connection((host, port), timeout=1):
        return True


def measure_mb_s(host: str, port: int, streams: int, total_bytes: int, timeout: float = 60.0) -> float:
    """MB/s (10^6 B/s) of ``total_bytes`` received from a :func:`sender_command` over ``streams``
    parallel connections."""
    per = total_bytes // streams
    errors: list[BaseException] = []

    def one() -> None:
        try:
            with socket.create_connection((host, port), timeout=timeout) as sock:
                sock.sendall(str(per).encode())
                buffer = bytearray(1 << 20)
                got = 0
                while got < per:
                    n = sock.recv_into(buffer)
                    if not n:
                        raise ConnectionError(f"sender closed after {got} of {per} bytes")
                    got += n
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            errors.append(exc)

    started = time.monotonic()
    threads = [threading.Thread(target=one, name=f"netbed-recv-{i}", daemon=True) for i in range(streams)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout)
    elapsed = time.monotonic() - started
    if errors:
        raise errors[0]
    if any(thread.is_alive() for thread in threads):
        raise TimeoutError(f"transfer not done after {timeout:.0f}s")
    return per * streams / elapsed / 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.netbed",
                                     description="Build a far host and measure what TCP streams get through its cap")
    parser.add_argument("--mbps", type=float, default=400.0, help="link cap, Mbit/s (default 400)")
    parser.add_argument("--burst", default=TBF_BURST, help=f"tbf burst (default {TBF_BURST})")
    parser.add_argument("--latency", default=TBF_LATENCY, help=f"tbf latency, the queue length (default {TBF_LATENCY})")
    parser.add_argument("--streams", default="1,8", help="comma-separated parallel stream counts (default 1,8)")
    parser.add_argument("--seconds", type=float, default=3.0, help="about how long each transfer takes at the cap")
    parser.add_argument("--flow-mbps", type=float, default=None, help="per-connection cap, Mbit/s (default: none)")
    args = parser.parse_args(argv)
    try:
        check_available()
    except FarHostUnavailable as exc:
        parser.error(str(exc))
    import tempfile

    port = 9000
    with tempfile.TemporaryDirectory(prefix="netbed-") as tmp, FarHost(args.mbps, burst=args.burst,
                                                                        latency=args.latency,
                                                                        flow_mbps=args.flow_mbps) as far:
        far.spawn(sender_command(far.address, port), Path(tmp) / "sender.log")
        wait_until(lambda: listening(far.address, port), timeout=10, what="the sender")
        total = int(args.mbps * 1e6 / 8 * args.seconds)
        for streams in (int(s) for s in args.streams.split(",")):
            got = measure_mb_s(far.address, port, streams, total)
            print(f"{args.mbps:g} Mbit/s (per connection {args.flow_mbps or args.mbps:g}), burst {args.burst}, "
                  f"latency {args.latency}, {streams} stream(s): "
                  f"{got:.1f} MB/s ({got * 8 / args.mbps:.1%} of the cap)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
