"""The node daemon (and pod sidecar): the S3 read API (:mod:`.s3api`), the control API
(:mod:`.control`, :mod:`.warmups`), fills (:mod:`.fills`), prefetch and priorities, origins
(:mod:`.origins`), metrics, and running it (:mod:`.server`, :mod:`.forward` for sidecar mode).

Public API (the rest is internal)::

    from sidecar.daemon import ServeSettings, build_app, serve_forever

Its errors are :mod:`sidecar.errors` (``from sidecar import OriginError``).
"""

from sidecar.daemon.app import build_app
from sidecar.daemon.fills import FetchSettings
from sidecar.daemon.origins.base import FileOrigin, ObjectInfo, Origin
from sidecar.daemon.origins.s3 import S3Origin, S3Settings
from sidecar.daemon.server import serve_forever
from sidecar.daemon.settings import ServeSettings

__all__ = [
    "ServeSettings",
    "FetchSettings",
    "S3Settings",
    "build_app",
    "serve_forever",
    "Origin",
    "FileOrigin",
    "S3Origin",
    "ObjectInfo",
]
