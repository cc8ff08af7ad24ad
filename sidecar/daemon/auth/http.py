"""``--auth sigv4`` in the daemon's handlers: the auth routes, and the checks the S3 and control
handlers call before they answer (each a no-op returning tenant ``""`` without ``--auth``)."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from sidecar.daemon.auth.authorizer import Authorizer, Session
from sidecar.daemon.auth.proofs import AUTH_PATH, PROOF_HEADER, SESSION_HEADER, SESSION_PATH, ProofBatch
from sidecar.errors import BadRequest, NotAuthorized
from wire.web import read_json_object

__all__ = ["AUTH", "caller", "optional_caller", "object_access", "listing_access", "batch_access", "setup"]

AUTH = web.AppKey("auth", Authorizer)


def caller(request: web.Request) -> Session | None:
    """The request's session (raises ``NotAuthorized``), or ``None`` when the daemon checks nothing."""
    auth = request.app.get(AUTH)
    return None if auth is None else auth.session(request.headers.get(SESSION_HEADER))


def optional_caller(request: web.Request) -> Session | None:
    """The request's session if it has a valid one (for what anyone may see, with more for it)."""
    try:
        return caller(request)
    except NotAuthorized:
        return None


async def object_access(request: web.Request, bucket: str, key: str) -> str:
    """Raise unless the caller may read ``bucket/key``; its tenant."""
    session = caller(request)
    if session is None:
        return ""
    await request.app[AUTH].authorize(session, request.headers.get(PROOF_HEADER), bucket, key)
    return session.tenant


async def listing_access(request: web.Request, bucket: str, prefix: str) -> str:
    """Raise unless the caller may list ``prefix`` in ``bucket``; its tenant."""
    session = caller(request)
    if session is None:
        return ""
    await request.app[AUTH].authorize(session, request.headers.get(PROOF_HEADER), bucket, None, prefix)
    return session.tenant


async def batch_access(request: web.Request, body: dict[str, Any], objects: list[tuple[str, str]]
                       ) -> tuple[str, list[BaseException | None]]:
    """(tenant, each object's refusal or ``None``) for a body that names objects with ``proofs``."""
    session = caller(request)
    if session is None:
        return "", [None] * len(objects)
    batch = ProofBatch.from_json(body.get("proofs"), len(objects))
    return session.tenant, await request.app[AUTH].authorize_batch(session, batch, objects)


async def describe_handler(request: web.Request) -> web.Response:
    auth = request.app.get(AUTH)
    return web.json_response(auth.describe() if auth is not None else {"auth": "none"})


async def session_handler(request: web.Request) -> web.Response:
    auth = request.app.get(AUTH)
    if auth is None:
        raise BadRequest("this daemon checks no proofs (started without --auth sigv4): no session needed")
    session = await auth.open_session(await read_json_object(request, 64 * 1024))
    return web.json_response(
        {"session": session.token, "tenant": session.tenant, "principal": session.principal,
         "expires_in_s": auth.settings.session_ttl_s},
        status=201,
    )


def setup(app: web.Application) -> None:
    app.router.add_get(AUTH_PATH, describe_handler)
    app.router.add_post(SESSION_PATH, session_handler)
