"""Loader settings: one dataclass, built once (from arguments and ``SHARDCACHE_*`` variables)
when a :class:`~loader.ShardLoader` is made, then passed down. Nothing deeper reads the
environment, so a loader pickled into a DataLoader worker behaves exactly like its parent."""

from __future__ import annotations

import dataclasses
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from loader.errors import ConfigError
from wire.errors import InvalidName
from wire.names import Address, parse_connect
from wire.retry import Backoff

__all__ = ["LoaderSettings", "check_locality_window", "parse_endpoint"]

_TRUE = {"1", "true", "yes", "on"}
_RETRY_BACKOFF_MAX_S = 5.0


def parse_endpoint(endpoint: str) -> Address:
    """The cache daemon's address: ``http(s)://host[:port][/base]`` or ``unix:///path.sock``."""
    try:
        return parse_connect(endpoint, schemes=("http", "https"), base_path=True)
    except InvalidName:
        raise ConfigError(
            f"invalid cache endpoint {endpoint!r}: use http://127.0.0.1:8600 or "
            "unix:///run/shardcache/daemon.sock (or unset SHARDCACHE_ENDPOINT to read the origin)"
        ) from None
_FALSE = {"0", "false", "no", "off", ""}


def _check_handles(handles: str) -> str | None:
    """The handle socket as given, normalized; None for an empty value. Only a unix socket can
    carry descriptors, so anything else is a configuration error."""
    text = handles.strip().rstrip("/")
    if not text:
        return None
    try:
        address = parse_connect(text, schemes=())
    except InvalidName:
        address = None
    if address is None or address.kind != "unix":
        raise ConfigError(
            f"invalid handle socket {handles!r}: use unix:///run/shardcache-pod/handles.sock "
            "(descriptors travel only over a unix socket), or unset SHARDCACHE_HANDLES to read over HTTP"
        )
    return f"unix://{address.path}"


def check_locality_window(window: Any) -> int:
    """A loader's ``locality_window`` (the master checks the spec again, with the same bounds)."""
    if isinstance(window, bool) or not isinstance(window, int) or not 0 <= window <= 65536:
        raise ConfigError(f"locality_window must be an integer in [0, 65536] (0: the plain seeded shuffle), not {window!r}")
    return window

@dataclass(frozen=True)
class LoaderSettings:
    """How a loader reaches its data and its master. Defaults suit a pod with an injected sidecar."""

    endpoint: str | None = None
    """Cache daemon or sidecar (``http://127.0.0.1:8600`` or ``unix:///run/shardcache/daemon.sock``);
    None reads the origin directly. Env ``SHARDCACHE_ENDPOINT`` (set by the injected sidecar)."""

    master: str | None = None
    """Master URL(s), comma-separated, used when a job is named without ``master=``.
    Env ``SHARDCACHE_MASTER``."""

    node: str = ""
    """Node name reported to the master with each lease request (which node caches what).
    Env ``SHARDCACHE_NODE``, else ``NODE_NAME`` (Kubernetes downward API), else the host name."""

    locality_window: int = 0
    """The ``locality_window`` of jobs a :class:`~loader.ShardLoader` creates or joins when it is
    not given one (cache-aware leases; 0: the plain seeded shuffle). Env
    ``SHARDCACHE_LOCALITY_WINDOW``: a platform can turn cache-aware leases on for every trainer of
    a namespace without a code change (every trainer of a job must see the same value)."""

    short_circuit: bool = True
    """Read cached shards as local files instead of over HTTP: from a descriptor passed over
    :attr:`handles` where that is set, else from the cached file's path when it is readable here
    (cache dir mounted read-only, where one tenant owns the node). Env ``SHARDCACHE_SHORT_CIRCUIT``."""

    handles: str | None = None
    """The pod's handle socket (``unix:///run/shardcache-pod/handles.sock``, set by the
    injection): with :attr:`short_circuit`, each shard is asked for there first and read from the
    file descriptor the sidecar passes back (``wire.handles``), so the pod needs no cache
    directory mounted; answers without one are read over HTTP. None: path answers, as above.
    Env ``SHARDCACHE_HANDLES``."""

    lease_ahead: int = 1
    """Shards leased (dynamic) or planned (static) beyond the one being read; the daemon is asked
    to prefetch them with priority ``lease``. More hides origin latency; each one held also delays
    other trainers at the end of an epoch."""

    verify: bool = True
    """Check each shard's size and xxh3_128 against the manifest after reading it; a mismatch
    raises :class:`~loader.errors.CorruptShard` (and fails the lease with a master)."""

    read_chunk_bytes: int = 1 << 20
    """Bytes requested from the source per read call; the whole shard is never held in memory."""

    map_files: bool = True
    """Read shards that are local files (``file://`` datasets, short-circuit cache reads) through
    a memory mapping: one copy per byte instead of two. A mapped file that shrinks under the
    reader, or a disk or network file system (NFS, FUSE) failing a page in, kills the process
    with SIGBUS instead of raising an error: turn it off for datasets on such mounts. Env
    ``SHARDCACHE_MAP_FILES``."""

    zero_copy: bool = False
    """Sample fields as ``memoryview`` instead of ``bytes``: views of the page cache for mapped
    local shards, no copy at all (for consumers that take buffers: ``torch.frombuffer``,
    ``numpy.frombuffer``, ``PIL.Image.open(io.BytesIO(view))``). A view keeps its shard's mapping
    alive while it is held. ``bytes(view)`` where bytes are needed. Env ``SHARDCACHE_ZERO_COPY``."""

    rehash_warm: bool = True
    """With :attr:`verify`, hash every read of a shard, warm ones too. False: a shard this process
    has read and checked before, from the same file (device, inode, size, mtime, ctime: any write
    to it makes another), is not hashed again when it is read by its member table
    (:mod:`loader.tarindex`); its size is. What is given up is the loader's own check of a byte
    rotted on disk since (the daemon's scrubber re-hashes its files while idle; its stamp check on
    every open catches a file changed by a write). Measured on a 2-core VM: zero-copy warm epochs
    2.4x faster without it, copying ones no faster (the hash is what brings each sample into the
    CPU cache for the copy); see the README's cold and warm speed section. Env
    ``SHARDCACHE_REHASH_WARM``."""

    heap_trim_threshold_bytes: int = 64 << 20
    """Freed heap a reading process keeps for reuse rather than giving back to the kernel
    (glibc's ``M_TRIM_THRESHOLD``, set once per process; :mod:`loader.heap`): a batch of samples
    freed together would otherwise be given back and faulted in again by the next one (batches of
    64 read 7-9x slower warm). 0 leaves the allocator as it is; a process started with
    ``MALLOC_TRIM_THRESHOLD_`` keeps that. Env ``SHARDCACHE_HEAP_TRIM_THRESHOLD`` (bytes)."""

    max_member_bytes: int = 1 << 31
    """Largest tar member accepted (it is held in memory as one sample field); a header claiming
    more is treated as corruption rather than an allocation to attempt."""

    io_timeout_s: float = 60.0
    """Socket timeout for origin and daemon requests."""

    io_attempts: int = 5
    """Attempts per request (and per resumed stream) before :class:`~loader.errors.SourceError`."""

    retry_backoff_s: float = 0.2
    """First retry delay; doubles on each further attempt, capped at 5 s. Each delay is drawn
    uniformly below that bound (full jitter, :mod:`wire.retry`)."""

    master_deadline_s: float = 60.0
    """How long one master call keeps retrying an unreachable master before giving up."""

    wait_max_s: float = 5.0
    """Longest sleep between lease requests while the master answers ``wait``."""

    renew_fraction: float = 1 / 3
    """Leases are renewed every ``ttl * renew_fraction`` seconds."""

    def __post_init__(self) -> None:
        if not self.node.strip():
            object.__setattr__(self, "node", socket.gethostname() or "unknown")
        if self.lease_ahead < 0 or self.lease_ahead > 64:
            raise ConfigError(f"lease_ahead must be between 0 and 64, not {self.lease_ahead}")
        if self.read_chunk_bytes < 4096:
            raise ConfigError(f"read_chunk_bytes must be at least 4096, not {self.read_chunk_bytes}")
        if self.max_member_bytes < 1:
            raise ConfigError("max_member_bytes must be positive")
        if self.heap_trim_threshold_bytes < 0:
            raise ConfigError(f"heap_trim_threshold_bytes must be 0 or more, not {self.heap_trim_threshold_bytes}")
        if self.io_attempts < 1:
            raise ConfigError("io_attempts must be at least 1")
        if not self.retry_backoff_s >= 0:
            raise ConfigError(f"retry_backoff_s must be a non-negative number of seconds, not {self.retry_backoff_s}")
        if not 0 < self.renew_fraction < 1:
            raise ConfigError("renew_fraction must be between 0 and 1 (exclusive)")
        check_locality_window(self.locality_window)
        if self.endpoint is not None:
            endpoint = self.endpoint.strip().rstrip("/")
            if endpoint:
                parse_endpoint(endpoint)
            object.__setattr__(self, "endpoint", endpoint or None)
        if self.handles is not None:
            object.__setattr__(self, "handles", _check_handles(self.handles))

    @property
    def backoff(self) -> Backoff:
        """The retry policy of one daemon or origin request, and of one resumed stream."""
        return Backoff(self.retry_backoff_s, _RETRY_BACKOFF_MAX_S, attempts=self.io_attempts)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> LoaderSettings:
        """Settings from ``SHARDCACHE_*`` variables, then ``overrides`` (None values ignored)."""
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        if env.get("SHARDCACHE_ENDPOINT", "").strip():
            values["endpoint"] = env["SHARDCACHE_ENDPOINT"]
        if env.get("SHARDCACHE_HANDLES", "").strip():
            values["handles"] = env["SHARDCACHE_HANDLES"]
        if env.get("SHARDCACHE_MASTER", "").strip():
            values["master"] = env["SHARDCACHE_MASTER"].strip()
        values["node"] = (
            env.get("SHARDCACHE_NODE", "").strip() or env.get("NODE_NAME", "").strip() or socket.gethostname()
        )
        integers = (
            ("SHARDCACHE_LOCALITY_WINDOW", "locality_window", "a number of shards, e.g. 256 (0: the plain shuffle)"),
            ("SHARDCACHE_HEAP_TRIM_THRESHOLD", "heap_trim_threshold_bytes",
             "a number of bytes, e.g. 67108864 (0: glibc's own)"),
        )
        for name, field_name, hint in integers:
            raw_int = env.get(name, "").strip()
            if raw_int:
                try:
                    values[field_name] = int(raw_int)
                except ValueError:
                    raise ConfigError(f"{name}={raw_int!r}: use {hint}") from None
        flags = (
            ("SHARDCACHE_SHORT_CIRCUIT", "short_circuit"),
            ("SHARDCACHE_MAP_FILES", "map_files"),
            ("SHARDCACHE_ZERO_COPY", "zero_copy"),
            ("SHARDCACHE_REHASH_WARM", "rehash_warm"),
        )
        for name, field_name in flags:
            raw = env.get(name)
            if raw is not None:
                lowered = raw.strip().lower()
                if lowered not in _TRUE | _FALSE:
                    raise ConfigError(f"{name}={raw!r}: use 1 or 0")
                values[field_name] = lowered in _TRUE
        names = {f.name for f in dataclasses.fields(cls)}
        for key, value in overrides.items():
            if key not in names:
                raise ConfigError(f"unknown loader setting {key!r}; known: {', '.join(sorted(names))}")
            if value is not None:
                values[key] = value
        return cls(**values)
