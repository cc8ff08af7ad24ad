"""The shard-lease master (``shardcache master``) and its trainer-side client.

Importing this package stays light (stdlib only): the server side (aiohttp, SQLite, etcd) lives
in submodules imported explicitly (:mod:`loader.master.server.app`, :mod:`loader.master.server.service`).
"""

from __future__ import annotations

from loader.master.client import MasterClient
from loader.master.errors import (
    BadRequest,
    BodyTooLarge,
    CheckpointGone,
    Forbidden,
    JobConflict,
    JobInUse,
    LeaseLost,
    MasterError,
    MasterUnavailable,
    NoSuchJob,
    NotLeader,
    NotLeaseHolder,
    ProtocolError,
    StateError,
    TooManyJobs,
    Unauthorized,
)

__all__ = [
    "MasterClient",
    "MasterError",
    "BadRequest",
    "BodyTooLarge",
    "NoSuchJob",
    "JobConflict",
    "TooManyJobs",
    "Unauthorized",
    "Forbidden",
    "JobInUse",
    "LeaseLost",
    "CheckpointGone",
    "ProtocolError",
    "NotLeaseHolder",
    "MasterUnavailable",
    "NotLeader",
    "StateError",
]
