"""The owner's side of a peer read, and ``GET /_shardcache/peers``.

:func:`peer_request` is the S3 API's hook: a request with the peer header is checked here
(``403 AccessDenied`` "not a peer" when it proves nothing), and a valid one names the asking
member, which the S3 API puts in its :class:`~sidecar.daemon.reads.ReadContext`: the read skips
``--auth`` tenant checks (the asking daemon checked its own caller), its bytes count as served to
peers, and any fill it starts reads the origin only.
"""

from __future__ import annotations

import logging
from typing import Any

from aiohttp import web

from sidecar.daemon.keys import CONTROL, SETTINGS
from sidecar.daemon.peers.membership import Membership
from sidecar.daemon.peers.signing import PEER_HEADER, PeerRefused, verify
from sidecar.daemon.s3xml import error_response

__all__ = ["MEMBERSHIP", "cluster_stats", "peer_request", "peers_handler", "setup"]

log = logging.getLogger(__name__)

MEMBERSHIP = web.AppKey("membership", Membership)


def peer_request(request: web.Request) -> str | web.Response | None:
    """``None`` when the request is a client's, the asking member's id when it is a valid peer's,
    else the 403 answer to send."""
    value = request.headers.get(PEER_HEADER)
    if value is None:
        return None
    cluster = request.app[SETTINGS].cluster
    try:
        if cluster is None:
            raise PeerRefused("this daemon is in no cluster (started without --peer/--peers-dns)")
        member = verify(cluster.secret, value, request.method, request.raw_path, cluster.max_skew_s)
    except PeerRefused as exc:
        log.warning("refused a peer request for %s: %s", request.raw_path[:200], exc)
        return error_response(403, "AccessDenied", f"not a peer: {exc}", request.path)
    return member


def cluster_stats(app: web.Application) -> dict[str, Any] | None:
    membership = app.get(MEMBERSHIP)
    settings = app[SETTINGS]
    if membership is None or settings.cluster is None:
        return None
    return {
        "self": membership.self_id, "node": settings.node, "live": len(membership.live),
        "members": len(membership.members), "peer_links": settings.cluster.links,
    }


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
