"""Bearer-token authentication of the master's API (``shardcache master --token-file PATH``).

Every call but the probes (``/healthz``, ``/readyz``) and ``/metrics`` (scraped by Prometheus
from pod annotations) must carry ``Authorization: Bearer <token>``, compared in constant time;
otherwise 401 ``Unauthorized``. The token is the file's content, stripped; the file is looked
at again at most once a second and re-read when it changed, so rotating the Secret it comes
from takes effect without a restart (during a rotation both the old and the new token work
for ``ROTATION_GRACE_S``, so trainers that read the new Secret later are not cut off at once).
"""

from __future__ import annotations

import hmac
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from loader.master.errors import Unauthorized

__all__ = ["TokenFile", "token_middleware", "OPEN_PATHS", "ROTATION_GRACE_S"]

log = logging.getLogger(__name__)

OPEN_PATHS = frozenset({"/healthz", "/readyz", "/metrics"})
ROTATION_GRACE_S = 300.0
_CHECK_EVERY_S = 1.0


class TokenFile:
    """The token in a file, re-read when the file changes."""

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
            token = self.path.read_bytes().strip()
        except OSError as exc:
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

    def accepts(self, presented: bytes) -> bool:
        now = self._clock()
        if now - self._checked >= _CHECK_EVERY_S:
            self._checked = now
            self._load()
        if hmac.compare_digest(presented, self._token):
            return True
        prev = self._previous
        return prev is not None and now < prev[1] and hmac.compare_digest(presented, prev[0])


def token_middleware(tokens: TokenFile, open_reads: frozenset[str] = frozenset()) -> Middleware:
    """Refuse every call without the token but :data:`OPEN_PATHS`, and GET/HEAD of ``open_reads``
    (the status page's own files: they hold no data, and the browser loads the page before it can
    ask for the token)."""

    @web.middleware
    async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
        is_open = request.path in OPEN_PATHS or (request.method in ("GET", "HEAD") and request.path in open_reads)
        if not is_open:
            scheme, _, presented = request.headers.get("Authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not tokens.accepts(presented.strip().encode()):
                raise Unauthorized(
                    "this master requires a token: send 'Authorization: Bearer <token>' (trainers and "
                    "shardcache status read it from SHARDCACHE_MASTER_TOKEN; the chart's NOTES say where it is)"
                )
        return await handler(request)

    return check
