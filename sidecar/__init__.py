"""shardcache's node daemon and pod sidecar: origins, the S3-speaking cache server, the CLI.

Public API (the rest is internal)::

    from sidecar import ServeSettings, build_app, serve_forever
"""

from sidecar.daemon import build_app
from sidecar.errors import (
    AccessDenied,
    BadRequest,
    BucketNotFound,
    InvalidRange,
    ObjectNotFound,
    OriginBadResponse,
    OriginError,
    OriginThrottled,
    OriginUnavailable,
    SidecarError,
)
from sidecar.fetcher import FetchSettings
from sidecar.origin import FileOrigin, ObjectInfo, Origin
from sidecar.s3origin import S3Origin, S3Settings
from sidecar.server import serve_forever
from sidecar.settings import ServeSettings

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
    "SidecarError",
    "BadRequest",
    "OriginError",
    "ObjectNotFound",
    "BucketNotFound",
    "AccessDenied",
    "InvalidRange",
    "OriginUnavailable",
    "OriginThrottled",
    "OriginBadResponse",
]
