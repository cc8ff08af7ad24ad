"""shardcache's node side: the cache daemon and pod sidecar (:mod:`sidecar.daemon`), Kubernetes
injection and the admission webhook (:mod:`sidecar.k8s`), and the ``shardcache`` command line
(:mod:`sidecar.cli`). The CLI may use the daemon and k8s parts; they never import the CLI or each
other (``.importlinter`` checks it).

Importing this package loads nothing but its errors, so ``import sidecar.cli`` stays light.
"""

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

__all__ = [
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
