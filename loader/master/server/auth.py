"""Who calls the master: bearer tokens, the operator's and the tenants'.

``shardcache master --token-file PATH`` is the operator's token: it may do everything, on every
job. ``--tenant-tokens DIR`` adds one token per tenant: each file of the directory is named after
a tenant (a training namespace) and holds its token (a Kubernetes Secret mounted as a volume is
exactly that; the chart generates one per namespace in ``master.auth.tenants``). A tenant's job
belongs to it from its creation; only its owner and the operator see or change it (the rule is
:meth:`Caller.may`, applied by the service). Without either flag the master is open and every
caller is the operator.

Every call but the probes (``/healthz``, ``/readyz``), ``/metrics`` and the status page's own
files must carry ``Authorization: Bearer <token>``; otherwise 401 ``Unauthorized``. The open paths
still read a token that is sent: ``/metrics`` shows a caller the series of the jobs it may see,
and nobody's without one.

Files are looked at again at most once a second and re-read when they changed, so rotating the
Secret takes effect without a restart. During a rotation both the old and the new token of a
tenant (or of the operator) work for ``ROTATION_GRACE_S``, so trainers that read the new Secret
later are not cut off at once; a tenant whose file is removed is cut off at once (removing it is
how access is revoked).

Tokens are compared as SHA-256 digests: the operator's in constant time, a tenant's through a
dict of digests (a lookup's timing can tell nothing about a token from the digest of a guess).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from loader.master.errors import Unauthorized

__all__ = [
    "Caller",
    "OPERATOR",
    "ANONYMOUS",
    "Identities",
    "TokenFile",
    "TenantTokens",
    "auth_middleware",
    "caller_of",
    "OPEN_PATHS",
    "ROTATION_GRACE_S",
    "TENANT_NAME",
]

log = logging.getLogger(__name__)

OPEN_PATHS = frozenset({"/healthz", "/readyz", "/metrics"})
ROTATION_GRACE_S = 300.0
_CHECK_EVERY_S = 1.0
TENANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
"""A tenant's name: a namespace's (DNS label) fits, as do most team names; no path characters."""
_MAX_TENANTS = 10_000
_MAX_TOKEN_BYTES = 4096


@dataclass(frozen=True)
class Caller:
    """Who made a call: the operator, a tenant, or nobody known (an open path without a token)."""

    tenant: str | None = None
    """The tenant's name; None for the operator and for nobody."""
    operator: bool = False

    def may(self, owner: str | None) -> bool:
        """Whether this caller may see and act on a job owned by ``owner`` (None: the operator's).
        The one rule of job ownership."""
        return self.operator or (self.tenant is not None and self.tenant == owner)

    @property
    def owner(self) -> str | None:
        """The owner a job this caller creates gets."""
        return self.tenant

    def __str__(self) -> str:
        return "the operator" if self.operator else f"tenant {self.tenant}" if self.tenant else "an anonymous caller"


OPERATOR = Caller(operator=True)
ANONYMOUS = Caller()
_CALLER_KEY = "shardcache_caller"


def _digest(token: bytes) -> bytes:
    return hashlib.sha256(token).digest()


def _read_token(path: Path) -> bytes:
    with open(path, "rb") as f:
        token = f.read(_MAX_TOKEN_BYTES + 1).strip()
    if len(token) > _MAX_TOKEN_BYTES:
        raise ValueError(f"more than {_MAX_TOKEN_BYTES} bytes")
    return token


class TokenFile:
    """The operator's token in a file, re-read when the file changes."""

    def __init__(self, path: Path, clock: Callable[[], float] = time.monotonic) -> None:
        self.path = path
        self._clock = clock
        self._stamp: tuple[int, int, int] | None = None
        self._token = b""
        self._previous: tuple[bytes, float] | None = None  # (old token, accepted until)
        self._checked = -1e18
        self._load(initial=True)

    def _load(self, initial: bool = False) -> None:
        try:
            st = os.stat(self.path)
            stamp = (st.st_ino, st.st_size, st.st_mtime_ns)
            if stamp == self._stamp:
                return
            token = _read_token(self.path)
        except (OSError, ValueError) as exc:
            if initial:
                raise ValueError(f"cannot read the master token file {self.path}: {exc}") from exc
            log.error("cannot re-read the master token file %s (%s); keeping the token read before", self.path, exc)
            return
        if not token:
            if initial:
                raise ValueError(f"the master token file {self.path} is empty: put the token in it")
            log.error("the master token file %s became empty; keeping the token read before", self.path)
            return
        if token != self._token and self._token:
            self._previous = (self._token, self._clock() + ROTATION_GRACE_S)
            log.info("master token rotated (the previous one is accepted for %.0f s more)", ROTATION_GRACE_S)
        self._token, self._stamp = token, stamp

    def refresh(self) -> None:
        now = self._clock()
        if now - self._checked >= _CHECK_EVERY_S:
            self._checked = now
            self._load()

    def accepts(self, presented: bytes) -> bool:
        self.refresh()
        if hmac.compare_digest(presented, self._token):
            return True
        prev = self._previous
        return prev is not None and self._clock() < prev[1] and hmac.compare_digest(presented, prev[0])

    @property
    def digest(self) -> bytes:
        return _digest(self._token)


class TenantTokens:
    """The tenants' tokens: one file per tenant in ``directory``, named after it.

    Names starting with ``.`` are skipped (a Secret volume's ``..data`` links and timestamped
    folders). Two tenants with one token would make a caller ambiguous: neither is accepted, and
    the start fails. A file that cannot be read keeps the token read before (the next look may
    find it)."""

    def __init__(self, directory: Path, clock: Callable[[], float] = time.monotonic) -> None:
        self.directory = directory
        self._clock = clock
        self._stamps: dict[str, tuple[int, int, int]] = {}
        self._tokens: dict[str, bytes] = {}  # tenant -> digest of its token
        self._by_digest: dict[bytes, str] = {}
        self._previous: dict[bytes, tuple[str, float]] = {}  # digest of a rotated-out token -> (tenant, until)
        self._checked = -1e18
        problems = self._load()
        if problems:
            raise ValueError(f"--tenant-tokens {directory}: " + "; ".join(problems))

    def _scan(self) -> list[str]:
        names = []
        for entry in os.scandir(self.directory):
            if entry.name.startswith("."):
                continue
            names.append(entry.name)
            if len(names) > _MAX_TENANTS:
                raise ValueError(f"more than {_MAX_TENANTS} files: one per tenant is expected")
        return sorted(names)

    def _load(self) -> list[str]:
        """Look at the directory again; what is wrong with it, as sentences."""
        try:
            names = self._scan()
        except (OSError, ValueError) as exc:
            return [f"cannot read the tenant token directory ({exc})"]
        problems: list[str] = []
        tokens: dict[str, bytes] = {}
        stamps: dict[str, tuple[int, int, int]] = {}
        for name in names:
            if not TENANT_NAME.fullmatch(name):
                problems.append(f"{name[:80]!r} is not a tenant name (letters, digits, '.', '_', '-', up to 128)")
                continue
            path = self.directory / name
            try:
                st = os.stat(path)  # follows the Secret volume's link to the current data
                stamp = (st.st_ino, st.st_size, st.st_mtime_ns)
                if stamp == self._stamps.get(name) and name in self._tokens:
                    tokens[name], stamps[name] = self._tokens[name], stamp
                    continue
                token = _read_token(path)
            except (OSError, ValueError) as exc:
                if name in self._tokens:  # keep what was read before
                    tokens[name], stamps[name] = self._tokens[name], self._stamps[name]
                problems.append(f"cannot read the token of tenant {name} ({exc})")
                continue
            if not token:
                problems.append(f"the token file of tenant {name} is empty")
                continue
            tokens[name], stamps[name] = _digest(token), stamp
        by_digest: dict[bytes, str] = {}
        shared: set[bytes] = set()
        for name, digest in tokens.items():
            if digest in by_digest:
                shared.add(digest)
                problems.append(f"tenants {by_digest[digest]} and {name} have the same token: give each its own")
            by_digest.setdefault(digest, name)
        for digest in shared:
            del by_digest[digest]
        now = self._clock()
        for name, digest in self._tokens.items():
            if name in tokens and tokens[name] != digest:
                self._previous[digest] = (name, now + ROTATION_GRACE_S)
                log.info("the master token of tenant %s rotated (the previous one is accepted for %.0f s more)",
                         name, ROTATION_GRACE_S)
        # A removed tenant is revoked at once, its rotated-out tokens too.
        self._previous = {d: (n, until) for d, (n, until) in self._previous.items() if n in tokens and until > now}
        added, removed = set(tokens) - set(self._tokens), set(self._tokens) - set(tokens)
        if self._stamps and (added or removed):
            log.info("tenant tokens: %d added (%s), %d removed (%s)", len(added), ", ".join(sorted(added)[:10]),
                     len(removed), ", ".join(sorted(removed)[:10]))
        self._tokens, self._stamps, self._by_digest = tokens, stamps, by_digest
        return problems

    def refresh(self) -> None:
        now = self._clock()
        if now - self._checked >= _CHECK_EVERY_S:
            self._checked = now
            for problem in self._load():
                log.error("--tenant-tokens %s: %s", self.directory, problem)

    def tenant(self, digest: bytes) -> str | None:
        self.refresh()
        name = self._by_digest.get(digest)
        if name is not None:
            return name
        prev = self._previous.get(digest)
        return prev[0] if prev is not None and self._clock() < prev[1] else None

    def holds(self, digest: bytes) -> bool:
        """Whether some tenant's current token has this digest."""
        return digest in self._tokens.values()


class Identities:
    """Who a presented token is: the operator, a tenant, or nobody (None)."""

    def __init__(self, operator: TokenFile | None, tenants: TenantTokens | None) -> None:
        self.operator = operator
        self.tenants = tenants
        if operator is not None and tenants is not None and tenants.holds(operator.digest):
            raise ValueError("a tenant has the operator's token (--token-file): give each tenant a token of its own")

    @property
    def open(self) -> bool:
        """No token configured: every caller is the operator."""
        return self.operator is None and self.tenants is None

    def identify(self, presented: bytes) -> Caller | None:
        if self.open:
            return OPERATOR
        if not presented:
            return None
        if self.operator is not None and self.operator.accepts(presented):
            return OPERATOR
        if self.tenants is not None:
            name = self.tenants.tenant(_digest(presented))
            if name is not None:
                return Caller(tenant=name)
        return None


def caller_of(request: web.Request) -> Caller:
    """The caller :func:`auth_middleware` identified (the operator on an app built without it)."""
    caller = request.get(_CALLER_KEY)
    return caller if isinstance(caller, Caller) else OPERATOR


def auth_middleware(identities: Identities, open_reads: frozenset[str] = frozenset()) -> Middleware:
    """Identify the caller of every request; refuse every call without a known token but
    :data:`OPEN_PATHS`, and GET/HEAD of ``open_reads`` (the status page's own files: they hold no
    data, and the browser loads the page before it can ask for the token)."""

    @web.middleware
    async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
        scheme, _, presented = request.headers.get("Authorization", "").partition(" ")
        token = presented.strip().encode("utf-8", "surrogateescape") if scheme.lower() == "bearer" else b""
        caller = identities.identify(token)
        is_open = request.path in OPEN_PATHS or (request.method in ("GET", "HEAD") and request.path in open_reads)
        if caller is None and not is_open:
            raise Unauthorized(
                "this master requires a token: send 'Authorization: Bearer <token>' (trainers and "
                "shardcache status read it from SHARDCACHE_MASTER_TOKEN; the chart's NOTES say where it is)"
            )
        request[_CALLER_KEY] = caller or ANONYMOUS
        return await handler(request)

    return check
