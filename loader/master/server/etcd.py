"""A small async client of etcd's v3 JSON gateway (grpc-gateway), over aiohttp.

Only what the master needs: range, txn (compare-and-swap), delete, leases, compaction.
python-etcd3 is unmaintained and breaks on current protobuf; the gateway ships with every
etcd v3 server (``/v3/kv/range``, ``/v3/kv/txn``, ``/v3/lease/grant``, ...), speaks JSON with
base64 keys and values and int64 numbers as strings, and needs no generated code.
Errors (connection, timeout, gateway error answers) become :class:`EtcdError`.
"""

from __future__ import annotations

import base64
import urllib.parse
from dataclasses import dataclass
from typing import Any

import aiohttp

from loader.master.errors import StateError

__all__ = [
    "EtcdClient",
    "EtcdError",
    "KeyValue",
    "parse_etcd_url",
    "prefix_end",
    "op_put",
    "op_delete",
    "op_range",
    "cmp_create_revision",
]


class EtcdError(StateError):
    """etcd could not be reached or refused a request."""


@dataclass(frozen=True, slots=True)
class KeyValue:
    key: bytes
    value: bytes
    create_revision: int
    mod_revision: int
    lease: int


def parse_etcd_url(url: str) -> tuple[list[str], str]:
    """``etcd://h1:2379,h2:2379/shardcache`` -> (["http://h1:2379", "http://h2:2379"], "/shardcache")."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("etcd", "etcd+http", "etcd+https") or not parts.netloc:
        raise ValueError(f"invalid etcd URL {url!r}: use etcd://host:2379/prefix")
    scheme = "https" if parts.scheme == "etcd+https" else "http"
    endpoints = [f"{scheme}://{host.strip()}" for host in parts.netloc.split(",") if host.strip()]
    prefix = "/" + parts.path.strip("/") if parts.path.strip("/") else "/shardcache"
    return endpoints, prefix


def prefix_end(prefix: bytes) -> bytes:
    """The range_end that selects every key starting with ``prefix``."""
    end = bytearray(prefix)
    for i in range(len(end) - 1, -1, -1):
        if end[i] < 0xFF:
            end[i] += 1
            return bytes(end[: i + 1])
    return b"\x00"


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _unb64(text: str | None) -> bytes:
    return base64.b64decode(text) if text else b""


def op_put(key: bytes, value: bytes, lease: int = 0) -> dict[str, Any]:
    req: dict[str, Any] = {"key": _b64(key), "value": _b64(value)}
    if lease:
        req["lease"] = str(lease)
    return {"request_put": req}


def op_delete(key: bytes, range_end: bytes | None = None) -> dict[str, Any]:
    req = {"key": _b64(key)}
    if range_end is not None:
        req["range_end"] = _b64(range_end)
    return {"request_delete_range": req}


def op_range(key: bytes) -> dict[str, Any]:
    return {"request_range": {"key": _b64(key)}}


def cmp_create_revision(key: bytes, revision: int) -> dict[str, Any]:
    """True while ``key`` exists with this create revision (0: while it does not exist)."""
    return {"key": _b64(key), "target": "CREATE", "result": "EQUAL", "create_revision": str(revision)}


def _kv(raw: dict[str, Any]) -> KeyValue:
    return KeyValue(
        _unb64(raw.get("key")),
        _unb64(raw.get("value")),
        int(raw.get("create_revision", 0)),
        int(raw.get("mod_revision", 0)),
        int(raw.get("lease", 0)),
    )


class EtcdClient:
    def __init__(self, endpoints: list[str], *, timeout_s: float = 5.0) -> None:
        if not endpoints:
            raise ValueError("no etcd endpoint given")
        self._endpoints = list(endpoints)
        self._current = 0
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> EtcdClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(timeout=self._timeout)
        return self._session

    async def call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        last: BaseException | None = None
        for _ in range(len(self._endpoints)):
            endpoint = self._endpoints[self._current]
            try:
                async with self._http().post(endpoint + path, json=body) as resp:
                    answer = await resp.json(content_type=None)
                    if resp.status >= 400 or (isinstance(answer, dict) and "error" in answer and "header" not in answer):
                        message = answer.get("message") or answer.get("error") if isinstance(answer, dict) else answer
                        raise EtcdError(f"etcd {path} failed: HTTP {resp.status}: {message}")
                    return answer if isinstance(answer, dict) else {}
            except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
                last = exc
                self._current = (self._current + 1) % len(self._endpoints)
        raise EtcdError(f"etcd unreachable at {', '.join(self._endpoints)}: {last.__class__.__name__}: {last}") from last

    async def range(
        self, key: bytes, range_end: bytes | None = None, *, limit: int = 0, keys_only: bool = False
    ) -> tuple[list[KeyValue], bool, int]:
        """(key-values, more, header revision)."""
        body: dict[str, Any] = {"key": _b64(key)}
        if range_end is not None:
            body["range_end"] = _b64(range_end)
        if limit:
            body["limit"] = str(limit)
        if keys_only:
            body["keys_only"] = True
        answer = await self.call("/v3/kv/range", body)
        kvs = [_kv(item) for item in answer.get("kvs", [])]
        return kvs, bool(answer.get("more", False)), int(answer.get("header", {}).get("revision", 0))

    async def range_all(self, key: bytes, range_end: bytes, *, page: int = 500) -> list[KeyValue]:
        """Every key in [key, range_end), fetched in pages (values can be large)."""
        out: list[KeyValue] = []
        start = key
        while True:
            kvs, more, _ = await self.range(start, range_end, limit=page)
            out.extend(kvs)
            if not more or not kvs:
                return out
            start = kvs[-1].key + b"\x00"

    async def get(self, key: bytes) -> KeyValue | None:
        kvs, _, _ = await self.range(key)
        return kvs[0] if kvs else None

    async def put(self, key: bytes, value: bytes, lease: int = 0) -> None:
        await self.call("/v3/kv/put", op_put(key, value, lease)["request_put"])

    async def txn(
        self, compare: list[dict[str, Any]], success: list[dict[str, Any]], failure: list[dict[str, Any]] | None = None
    ) -> tuple[bool, list[dict[str, Any]], int]:
        """(succeeded, responses, header revision)."""
        answer = await self.call("/v3/kv/txn", {"compare": compare, "success": success, "failure": failure or []})
        return bool(answer.get("succeeded", False)), list(answer.get("responses", [])), int(answer.get("header", {}).get("revision", 0))

    @staticmethod
    def range_response(response: dict[str, Any]) -> list[KeyValue]:
        return [_kv(item) for item in response.get("response_range", {}).get("kvs", [])]

    async def delete(self, key: bytes, range_end: bytes | None = None) -> None:
        await self.call("/v3/kv/deleterange", op_delete(key, range_end)["request_delete_range"])

    async def lease_grant(self, ttl_s: int) -> tuple[int, int]:
        answer = await self.call("/v3/lease/grant", {"TTL": str(int(ttl_s))})
        if answer.get("error"):
            raise EtcdError(f"etcd refused a lease: {answer['error']}")
        return int(answer["ID"]), int(answer.get("TTL", ttl_s))

    async def lease_keepalive(self, lease: int) -> int:
        """The lease's remaining TTL after the refresh; 0 when it no longer exists."""
        answer = await self.call("/v3/lease/keepalive", {"ID": str(lease)})
        return int(answer.get("result", {}).get("TTL", 0))

    async def lease_revoke(self, lease: int) -> None:
        try:
            await self.call("/v3/lease/revoke", {"ID": str(lease)})
        except EtcdError as exc:
            if "not found" not in str(exc):
                raise

    async def compact(self, revision: int) -> None:
        try:
            await self.call("/v3/kv/compaction", {"revision": str(revision)})
        except EtcdError as exc:
            if "compacted" not in str(exc):
                raise
