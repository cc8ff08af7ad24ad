"""The object stores behind the cache, behind one interface: :class:`Origin` (and
:class:`FileOrigin`, the embedded ``file://`` default) in :mod:`.base`, any S3 endpoint in
:mod:`.s3`, whose bodies are read on threads through the kept-alive pool of :mod:`.httppool`."""

from sidecar.daemon.origins.base import Body, FileOrigin, ObjectInfo, Origin
from sidecar.daemon.origins.s3 import Boto3S3Origin, S3Origin, S3Settings

__all__ = ["Body", "ObjectInfo", "Origin", "FileOrigin", "S3Origin", "Boto3S3Origin", "S3Settings"]
