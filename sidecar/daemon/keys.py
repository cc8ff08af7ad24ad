"""The daemon application's typed keys: where its resources live on the ``web.Application``.

One module of its own so that every part of the daemon (S3 API, control API, warm-ups) reads the
same keys without importing the module that builds the application.
"""

from __future__ import annotations

from aiohttp import web

from cache import Store
from sidecar.daemon.claims import Claims
from sidecar.daemon.fills import Fetcher
from sidecar.daemon.members import MemberIndexes
from sidecar.daemon.metrics import Metrics
from sidecar.daemon.origins import Origin
from sidecar.daemon.prefetch import Prefetcher
from sidecar.daemon.reads import ReadService
from sidecar.daemon.scrub import Scrubber
from sidecar.daemon.settings import ServeSettings

__all__ = [
    "SETTINGS", "STORE", "ORIGIN", "FETCHER", "METRICS", "PREFETCHER", "CLAIMS", "READS", "SCRUBBER", "STARTED", "CONTROL",
    "MEMBERS",
    "file_root",
]

SETTINGS = web.AppKey("settings", ServeSettings)
STORE = web.AppKey("store", Store)
ORIGIN = web.AppKey("origin", Origin)
FETCHER = web.AppKey("fetcher", Fetcher)
METRICS = web.AppKey("metrics", Metrics)
PREFETCHER = web.AppKey("prefetcher", Prefetcher)
CLAIMS = web.AppKey("claims", Claims)
READS = web.AppKey("reads", ReadService)
SCRUBBER = web.AppKey("scrubber", Scrubber)
STARTED = web.AppKey("started", float)
MEMBERS = web.AppKey("members", MemberIndexes)

CONTROL = "/_shardcache/"


def file_root(settings: ServeSettings) -> str | None:
    """The root of a ``file://`` origin (object URLs under it name bucket/key), else None."""
    return settings.origin[len("file://"):] if settings.origin.startswith("file://") else None
