"""The cluster cache (issue 17): node daemons that are one cache.

Each object has an owner among the live members (:mod:`wire.rendezvous` over ``bucket/key``); a
daemon that misses an object it does not own reads it from the owner's S3 API with a signed peer
header (:mod:`.signing`), and the owner fills it from the origin once for the whole cluster. Both
ends of a peer link are authenticated (issue 29): a request is signed for one member, one range,
once (:mod:`.replay`); the answer is signed by the member asked, for that request; and a peer's
bytes are checked against what the origin says the object is (:mod:`.origin`).

- :mod:`.config`: the settings (``--peer``, ``--peers-dns``, ``--advertise-url``, ``--peer-secret-file``).
- :mod:`.membership`: who is in the ring (static peers, DNS re-resolution, signed health checks).
- :mod:`.signing`, :mod:`.replay`: the peer header, the signed answer, the nonces a member took.
- :mod:`.origin`: :class:`ClusterOrigin`, the origin the fetcher reads through (peer, then origin).
- :mod:`.http`: the owner's side (checking the peer header) and ``GET /_shardcache/peers``.
"""

from sidecar.daemon.peers.config import ClusterSettings

__all__ = ["ClusterSettings"]
