"""The master's status page: ``GET /`` and its two assets, plain files served as they are.

No build step and no CDN: ``index.html``, ``page.js`` and ``page.css`` (package data beside this
module) are read once and served from memory. The page holds no data: it fetches ``GET /v1/jobs``
from the browser every 2 s, with the token the user typed (kept in ``sessionStorage``) when the
master runs with ``--token-file``. So these paths are served without the token
(``token_middleware(..., open_reads=PAGE_PATHS)``), while every ``/v1/`` call the page makes still needs it.
"""

from __future__ import annotations

from importlib import resources

from aiohttp import web

__all__ = ["PAGE_PATHS", "add_page_routes"]

# path -> (package file, content type)
_ASSETS = {
    "/": ("index.html", "text/html"),
    "/page/page.js": ("page.js", "text/javascript"),
    "/page/page.css": ("page.css", "text/css"),
}
PAGE_PATHS = frozenset(_ASSETS)

# The page builds its DOM with textContent only; the policy is a second line against injected
# markup (job and trainer names are user input): no inline script, nothing from elsewhere.
_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self'; "
        "form-action 'self'; base-uri 'none'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    # A master upgraded in place serves its new page on the next load.
    "Cache-Control": "no-cache",
}


def _asset(name: str) -> bytes:
    return resources.files(__package__).joinpath(name).read_bytes()


# Read at import (a missing file fails the master's start, not a request), never on the event
# loop: build_app runs inside serve()'s loop, where a file read would block every request.
_BODIES = {name: _asset(name) for name, _ in _ASSETS.values()}


def add_page_routes(app: web.Application) -> None:
    """Add ``GET /`` (and HEAD) and the page's assets to ``app``."""
    for path, (name, content_type) in _ASSETS.items():
        body = _BODIES[name]

        async def handler(request: web.Request, body: bytes = body, content_type: str = content_type) -> web.Response:
            return web.Response(body=body, content_type=content_type, charset="utf-8", headers=_HEADERS)

        app.router.add_get(path, handler)
