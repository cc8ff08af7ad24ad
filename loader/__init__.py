"""shardcache loader: WebDataset samples from object storage through the node cache, statically
sharded or leased from a master.

``import loader`` imports neither torch nor tensorflow; the adapters are ``loader.torch`` and
``loader.tf``. Errors: :class:`LoaderError` (data, sources, arguments) and, in dynamic mode,
:class:`MasterError` from the master protocol (``loader.master`` has its subclasses).
"""

from __future__ import annotations

from loader.dataset import Shard, parse_manifest
from loader.errors import (
    AccessDenied,
    ConfigError,
    CorruptShard,
    DatasetNotFound,
    LoaderError,
    ManifestError,
    ShardNotFound,
    SourceError,
)
from loader.master.errors import MasterError
from loader.settings import LoaderSettings
from loader.shardindex import ShardIndex
from loader.shardloader import ShardLoader
from loader.static import epoch_order, rank_shards, worker_shards
from loader.tar import iter_members, iter_samples, split_name

__all__ = [
    "ShardLoader",
    "ShardIndex",
    "LoaderSettings",
    "Shard",
    "LoaderError",
    "ConfigError",
    "ManifestError",
    "DatasetNotFound",
    "ShardNotFound",
    "CorruptShard",
    "SourceError",
    "AccessDenied",
    "MasterError",
    "iter_samples",
    "iter_members",
    "split_name",
    "parse_manifest",
    "epoch_order",
    "rank_shards",
    "worker_shards",
]
