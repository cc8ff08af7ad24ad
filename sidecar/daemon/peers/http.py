"""The owner's side of a peer read, and ``GET /_shardcache/peers``.

:func:`peer_request` is the S3 API's hook: a request with the peer header is checked here
(``403 AccessDenied`` "not a peer" when it proves nothing: another secret, addressed to another
member, a replayed nonce, a changed range), and a valid one names the asking member, which the
S3 API puts in its :class:`~sidecar.daemon.reads.ReadContext`: the read skips ``--auth`` tenant
checks (the asking daemon checked its own caller), its bytes count as served to peers, and any
fill it starts reads the origin only.

Every answer to a valid peer request is signed (:func:`~.signing.sign_answer`), whatever path
answered it (an object, an S3 error, ``/readyz`` for a member's health check): one hook on the
app's responses, so no answer to a peer can leave unsigned. A request with a peer header that no
handler checked (``/readyz``) is checked there; one that proves nothing gets an unsigned answer,
which the asker takes for no member's.
"""

from __future__ import annotations

import logging
from typing import Any

from aiohttp import web

from sidecar.daemon.keys import CONTROL, ORIGIN, SETTINGS
from sidecar.daemon.peers.membership import Membership
from sidecar.daemon.peers.origin import ClusterOrigin
from sidecar.daemon.peers.replay import Nonces
from sidecar.daemon.peers.signing import ANSWER_HEADER, PEER_HEADER, PeerAsk, PeerRefused, sign_answer, verify
from sidecar.daemon.s3xml import error_response

__all__ = ["MEMBERSHIP", "NONCES", "cluster_stats", "peer_request", "peers_handler", "setup"]

log = logging.getLogger(__name__)

MEMBERSHIP = web.AppKey("membership", Membership)
NONCES = web.AppKey("peer_nonces", Nonces)
# The request's checked PeerAsk, or the PeerRefused it earned.
_ASK: web.RequestKey[PeerAsk | PeerRefused] = web.RequestKey("peer_ask")


def _check(request: web.Request) -> PeerAsk | PeerRefused:
    """The request's peer header checked, once per request (a nonce is taken once)."""
    done = request.get(_ASK)
    if done is not None:
        return done
    cluster = request.app[SETTINGS].cluster
    result: PeerAsk | PeerRefused
    try:
        if cluster is None:
            raise PeerRefused("this daemon is in no cluster (started without --peer/--peers-dns)")
        result = verify(cluster.secret, request.headers[PEER_HEADER], request.method, request.raw_path, request.headers,
                        cluster.self_id, request.app.get(NONCES), cluster.max_skew_s)
    except PeerRefused as exc:
        log.warning("refused a peer request for %s: %s", request.raw_path[:200], exc)
        result = exc
    request[_ASK] = result
    return result


def peer_request(request: web.Request) -> str | web.Response | None:
    """``None`` when the request is a client's, the asking member's id when it is a valid peer's,
    else the 403 answer to send."""
    if PEER_HEADER not in request.headers:
        return None
    ask = _check(request)
    if isinstance(ask, PeerRefused):
        return error_response(403, "AccessDenied", f"not a peer: {ask}", request.path)
    return ask.asker


async def _sign_answer(request: web.BaseRequest, response: web.StreamResponse) -> None:
    """on_response_prepare: the answer to a member's request says it is a member's, for that request."""
    if PEER_HEADER not in request.headers or not isinstance(request, web.Request):
        return
    ask = _check(request)
    cluster = request.app[SETTINGS].cluster
    if isinstance(ask, PeerAsk) and cluster is not None:
        signature = sign_answer(cluster.secret, ask, response.status, response.headers)
        if signature is not None:
            response.headers[ANSWER_HEADER] = signature


def cluster_stats(app: web.Application) -> dict[str, Any] | None:
    membership = app.get(MEMBERSHIP)
    settings = app[SETTINGS]
    if membership is None or settings.cluster is None:
        return None
    stats: dict[str, Any] = {
        "self": membership.self_id, "node": settings.node, "live": len(membership.live),
        "members": len(membership.members), "peer_links": settings.cluster.links,
    }
    origin = app.get(ORIGIN)
    if isinstance(origin, ClusterOrigin):
        # What checking peers' answers against the origin costs, and what it caught.
        stats.update(origin_heads=origin.vouches, origin_head_wait_s=round(origin.vouch_wait_s, 6),
                     peer_answers_disowned=origin.disowned, peer_fills_refused=origin.refusals)
    nonces = app.get(NONCES)
    if nonces is not None:
        stats["replay_cache"] = {"nonces": len(nonces), "capacity": nonces.max_entries, "replays": nonces.replays,
                                 "forgotten_early": nonces.forgotten_early}
    return stats


async def peers_handler(request: web.Request) -> web.Response:
    settings = request.app[SETTINGS]
    membership = request.app.get(MEMBERSHIP)
    if membership is None or settings.cluster is None:
        return web.json_response({"self": None, "node": settings.node, "peer_links": None, "members": []})
    return web.json_response({
        "self": membership.self_id, "node": settings.node, "peer_links": settings.cluster.links,
        "members": membership.describe(),
    })


def setup(app: web.Application) -> None:
    app.router.add_get(CONTROL + "peers", peers_handler)
    cluster = app[SETTINGS].cluster
    if cluster is not None:
        app[NONCES] = Nonces(cluster.replay_cache_entries, cluster.max_skew_s)
        app.on_response_prepare.append(_sign_answer)
