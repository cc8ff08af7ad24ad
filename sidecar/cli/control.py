"""A small synchronous client of the daemon's control API, for the CLI (TCP or unix socket).

Addresses are ``http://host:port``, ``tcp://host:port``, ``host:port`` or ``unix:///path.sock``.
A host name that is not an IP literal is resolved to all of its A records and each address is one
daemon (a headless Kubernetes Service resolves to every node daemon this way).
"""

from __future__ import annotations

import http.client
import ipaddress
import json
import socket
import urllib.parse
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Self

from sidecar.errors import SidecarError
from wire import jsontext
from wire.httpclient import UnixHTTPConnection, exchange
from wire.names import DAEMON_PORT, Address, parse_connect
from wire.peerview import PeerView, RingMember, parse_peers  # re-exported: the CLI's callers import them here

__all__ = [
    "DEFAULT_DAEMON",
    "DaemonAPIError",
    "DaemonAddress",
    "ControlClient",
    "DaemonClientError",
    "DaemonUnavailable",
    "PeerView",
    "RingMember",
    "parse_address",
    "parse_peers",
    "resolve_addresses",
]

DEFAULT_DAEMON = "http://127.0.0.1:8600"
_MAX_ANSWER = 64 << 20


class DaemonClientError(SidecarError):
    """Root of the errors of this client."""


class DaemonUnavailable(DaemonClientError, ConnectionError):
    """The daemon could not be reached (refused, timed out, reset)."""


class DaemonAPIError(DaemonClientError):
    """The daemon answered with an error status."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(f"{code} ({status}): {message}")
        self.status = status
        self.code = code
        self.message = message


@dataclass(frozen=True)
class DaemonAddress:
    """One daemon: ``url`` is what we connect to, ``name`` what the user typed (for display)."""

    url: str  # http://ip:port or unix:///path.sock
    name: str

    @property
    def label(self) -> str:
        return self.url if self.name == self.url else f"{self.name} ({self.url.split('://', 1)[1]})"


def parse_address(address: str) -> Address:
    """A daemon's address: ``http://host:port``, ``tcp://host:port``, ``host[:port]`` (port 8600
    by default) or ``unix:///path.sock``; ``InvalidName`` (a ValueError) says what to write."""
    return parse_connect(address, DAEMON_PORT, schemes=("http", "tcp"))


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _system_resolver(host: str, port: int) -> list[str]:
    infos = socket.getaddrinfo(host, port, socket.AF_INET, socket.SOCK_STREAM)
    return [str(info[4][0]) for info in infos]


def resolve_addresses(
    addresses: Iterable[str], resolver: Callable[[str, int], list[str]] = _system_resolver
) -> list[DaemonAddress]:
    """Expand each address into daemons: a DNS name into one daemon per A record.

    ``localhost`` is kept as it is (it means this machine, whatever it resolves to). Raises
    ValueError for a malformed address, OSError (socket.gaierror) for a name that does not resolve.
    """
    found: list[DaemonAddress] = []
    seen: set[str] = set()
    for address in addresses:
        parsed = parse_address(address)
        host, port = parsed.host, parsed.port
        if parsed.kind == "unix" or _is_ip(host) or host == "localhost":
            named = [(parsed.url, parsed.url)]
        else:
            ips = sorted(set(resolver(host, port)), key=ipaddress.ip_address)
            if not ips:
                raise socket.gaierror(f"{host} has no A records")
            named = [(f"http://{ip}:{port}", host) for ip in ips]
        for url, name in named:
            if url not in seen:
                seen.add(url)
                found.append(DaemonAddress(url, name))
    return found


class ControlClient:
    """Control-API calls to one daemon over one keep-alive connection (not thread-safe)."""

    def __init__(self, address: str, timeout: float = 30.0) -> None:
        self.address = address
        self.timeout = timeout
        self._address = parse_address(address)
        self._conn: http.client.HTTPConnection | None = None

    def _connection(self) -> http.client.HTTPConnection:
        if self._conn is None:
            if self._address.kind == "unix":
                self._conn = UnixHTTPConnection(self._address.path, self.timeout)
            else:
                self._conn = http.client.HTTPConnection(self._address.host, self._address.port, timeout=self.timeout)
        return self._conn

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def request(
        self, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None
    ) -> tuple[int, dict[str, str], bytes]:
        payload = None if body is None else json.dumps(body).encode()
        send_headers = {"User-Agent": "shardcache-cli/1", **(headers or {})}
        if payload is not None:
            send_headers["Content-Type"] = "application/json"
        try:
            status, message, data = exchange(
                self._connection, self.close, method, path, body=payload, headers=send_headers, max_body=_MAX_ANSWER
            )
        except (OSError, http.client.HTTPException) as exc:
            raise DaemonUnavailable(f"cannot reach the daemon at {self.address}: {_reason(exc)}") from exc
        return status, {k.lower(): v for k, v in message.items()}, data

    def call(self, method: str, path: str, body: Any = None, ok: tuple[int, ...] = (200,)) -> Any:
        status, _, data = self.request(method, path, body)
        if status not in ok:
            raise _api_error(status, data)
        try:
            return jsontext.loads(data)
        except ValueError as exc:
            raise DaemonAPIError(status, "BadAnswer", f"the daemon answered {data[:120]!r}, not JSON") from exc

    # -- the control API ------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        return self.call("GET", "/_shardcache/stats")

    def peers(self) -> PeerView | None:
        """This daemon's ring, or None for a daemon that has none to tell: one older than the
        cluster cache answers 404, or 400 (it takes the path for an S3 GET of bucket ``_shardcache``)."""
        status, _, data = self.request("GET", "/_shardcache/peers")
        if status in (400, 404, 405, 501):
            return None
        if status != 200:
            raise _api_error(status, data)
        try:
            doc = jsontext.loads(data)
            if isinstance(doc, dict) and not doc.get("self"):
                return None  # a daemon without peers: not part of any ring
            return parse_peers(doc)
        except ValueError as exc:
            raise DaemonAPIError(status, "BadAnswer", f"/_shardcache/peers: {exc}") from exc

    def cached(self, url: str) -> dict[str, Any]:
        return self.call("GET", "/_shardcache/cached?" + urllib.parse.urlencode({"url": url}))

    def create_warmup(self, body: dict[str, Any]) -> tuple[bool, dict[str, Any]]:
        """→ (created, status): ``created`` is False when this attached to a job in progress."""
        status, _, data = self.request("POST", "/_shardcache/warmups", body)
        if status not in (200, 201):
            raise _api_error(status, data)
        try:
            return status == 201, jsontext.loads(data)
        except ValueError as exc:
            raise DaemonAPIError(status, "BadAnswer", f"the daemon answered {data[:120]!r}, not JSON") from exc

    def warmup(self, ident: str) -> dict[str, Any]:
        return self.call("GET", "/_shardcache/warmups/" + urllib.parse.quote(ident, safe=""))

    def warmups(self) -> list[dict[str, Any]]:
        return self.call("GET", "/_shardcache/warmups")["warmups"]

    def cancel_warmup(self, ident: str) -> dict[str, Any]:
        return self.call("DELETE", "/_shardcache/warmups/" + urllib.parse.quote(ident, safe=""))

    def head_object(self, bucket: str, key: str, xxh3_128: str | None = None) -> str | None:
        """``hit`` when cached (with that checksum, if given), ``miss`` otherwise; None if absent."""
        headers = {"x-shardcache-xxh3-128": xxh3_128} if xxh3_128 else {}
        path = "/" + urllib.parse.quote(bucket) + "/" + urllib.parse.quote(key)
        status, answer, _ = self.request("HEAD", path, headers=headers)
        if status == 404:
            return None
        if status != 200:
            raise DaemonAPIError(status, "HeadFailed", f"HEAD {bucket}/{key} answered {status}")
        return answer.get("x-shardcache-cache")


def _reason(exc: BaseException) -> str:
    if isinstance(exc, socket.timeout):
        return "timed out"
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused (is `shardcache serve` running there?)"
    if isinstance(exc, FileNotFoundError):
        return "no such socket (is `shardcache serve` running with that --listen?)"
    return str(exc) or type(exc).__name__


def _api_error(status: int, data: bytes) -> DaemonAPIError:
    try:
        doc = jsontext.loads(data)
        return DaemonAPIError(status, str(doc.get("error", f"HTTP{status}")), str(doc.get("message", "")))
    except (ValueError, AttributeError):
        # Not our JSON (a proxy, or aiohttp's own 500 page): one line of it is enough.
        text = " ".join(data[:300].decode("utf-8", "replace").split())
        return DaemonAPIError(status, f"HTTP{status}", text)
