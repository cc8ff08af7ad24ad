"""The master's events: what the lease state machine (:mod:`loader.master.server.state`) applies,
and their JSON form in the journal.

A store logs every event that changed the state as ``{"now": ..., "ev": <event_to_json>}`` and
replays the log through the machine on start, so an event's JSON is a durable format: fields
added later (``stream``, ``clock``, ``created``) are optional when read, so a journal written by
an older master replays as it did there.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from loader.master.server.spec import JobSpec
from wire.nodeplan import pack_hashes, unpack_hashes

__all__ = [
    "CreateJob",
    "create_head",
    "Lease",
    "Renew",
    "Complete",
    "Fail",
    "Release",
    "Resume",
    "DeleteJob",
    "Placement",
    "Holdings",
    "Mark",
    "Rewind",
    "Event",
    "event_to_json",
    "event_to_text",
    "event_from_json",
]


@dataclass(frozen=True)
class CreateJob:
    spec: JobSpec
    owner: str | None = None
    """The tenant the job belongs to (auth.py); None: the operator's, or a master without tenants.
    Not part of the spec: two tenants' equal specs are still two owners' jobs."""


@dataclass(frozen=True)
class Lease:
    job: str
    trainer: str
    node: str
    count: int
    epoch: int | None
    lease_ids: tuple[str, ...]
    """Fresh ids for the leases granted, supplied by the caller (the machine has no randomness)."""
    request_id: str | None = None
    stream: str | None = None
    """Which of the trainer's lease streams asks (a DataLoader worker: ``w0``, ``w1``...); the
    trainer holds the lease, any of its streams and the trainer itself may renew and close it."""


@dataclass(frozen=True)
class Renew:
    job: str
    lease: str
    trainer: str
    offset: int
    clock: int | None = None
    """The trainer's clock when its loop had received up to ``offset`` (marks.py); None: a
    client that keeps none (never undone by a rewind)."""


@dataclass(frozen=True)
class Complete:
    job: str
    lease: str
    trainer: str
    clock: int | None = None


@dataclass(frozen=True)
class Fail:
    job: str
    lease: str
    trainer: str
    error: str


@dataclass(frozen=True)
class Release:
    """A trainer gives a lease back before its end (it is leaving): the shard is handed out again
    at once, from ``offset``, instead of after the lease's TTL. Not a failure."""

    job: str
    lease: str
    trainer: str
    offset: int
    clock: int | None = None


@dataclass(frozen=True)
class Resume:
    """A master took over the state (start, restart, election): every live lease gets a full TTL
    from now, since its holder could not renew while no master was serving."""


@dataclass(frozen=True)
class DeleteJob:
    """Forget a job and all its state. Refused (``JobInUse``) while it has live leases, unless
    ``force``: its trainers' next calls then get ``NoSuchJob``."""

    job: str
    force: bool = False


@dataclass(frozen=True)
class Placement:
    """The cluster cache's live members, as a daemon lists them (``/_shardcache/peers``): pairs of
    (member id, node name or ""). Jobs with a ``locality_window`` place shards by it."""

    members: tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class Holdings:
    """What a node's daemon reported it caches (``POST /v1/nodes/{node}/report``), as the hashes
    of the objects' names (``wire.nodeplan.name_hash``). ``full``: ``held`` is everything the node
    holds (the node is first cleared from every job's holder table); else a delta: ``held`` were
    cached and ``dropped`` evicted since the report before (an object in both is held). Windowed
    jobs take each shard named as held by ``node`` (locality.py's holder), so leases prefer it
    there. The service keeps only the hashes that name a shard of some such job."""

    node: str
    full: bool
    held: tuple[int, ...]
    dropped: tuple[int, ...] = ()
    resolved: Any = field(default=None, compare=False, repr=False)
    """Not journaled, a shortcut only: the shards the service already found for these hashes off
    the event loop (holdings.Resolution.hint), taken for a job whose spec is the very one it was
    found for; replay finds them again, the same."""


@dataclass(frozen=True)
class Mark:
    """A checkpoint (``state_dict()``): ``trainer``'s loop had received each held lease up to its
    offset at clock ``clock``; the job's mark at that clock is made or joined (marks.py)."""

    job: str
    trainer: str
    clock: int
    positions: tuple[tuple[str, int], ...]


@dataclass(frozen=True)
class Rewind:
    """A job resumed from a checkpoint (``load_state_dict()``): every delivery past the mark's
    clock is undone, every lease revoked; from now on the master hands out exactly what the
    loops had not received at the mark."""

    job: str
    trainer: str
    mark: int
    clock: int
    created: float | None = None
    """The job's creation time the state recorded: a namesake job created since refuses it."""


Event = CreateJob | Lease | Renew | Complete | Fail | Release | Resume | DeleteJob | Placement | Holdings | Mark | Rewind


def event_to_json(event: Event) -> dict[str, Any]:
    if isinstance(event, CreateJob):
        return {"t": "create", **_owned(event.owner), "spec": event.spec.to_json()}
    if isinstance(event, Lease):
        return {
            "t": "lease", "job": event.job, "trainer": event.trainer, "node": event.node, "count": event.count,
            "epoch": event.epoch, "ids": list(event.lease_ids), "rid": event.request_id, "stream": event.stream,
        }
    if isinstance(event, Renew):
        return _clocked(event.clock, {"t": "renew", "job": event.job, "lease": event.lease, "trainer": event.trainer, "offset": event.offset})
    if isinstance(event, Complete):
        return _clocked(event.clock, {"t": "complete", "job": event.job, "lease": event.lease, "trainer": event.trainer})
    if isinstance(event, Fail):
        return {"t": "fail", "job": event.job, "lease": event.lease, "trainer": event.trainer, "error": event.error}
    if isinstance(event, Release):
        return _clocked(event.clock, {"t": "release", "job": event.job, "lease": event.lease, "trainer": event.trainer, "offset": event.offset})
    if isinstance(event, Mark):
        return {"t": "mark", "job": event.job, "trainer": event.trainer, "clock": event.clock,
                "positions": [list(p) for p in event.positions]}
    if isinstance(event, Rewind):
        return {"t": "rewind", "job": event.job, "trainer": event.trainer, "mark": event.mark, "clock": event.clock,
                "created": event.created}
    if isinstance(event, Resume):
        return {"t": "resume"}
    if isinstance(event, DeleteJob):
        return {"t": "delete", "job": event.job, "force": event.force}
    if isinstance(event, Placement):
        return {"t": "placement", "members": [list(m) for m in event.members]}
    if isinstance(event, Holdings):
        # Packed (8 bytes a hash, base64): a full report of 100,000 objects is a 1 MB record.
        return {"t": "holdings", "node": event.node, "full": event.full, "held": pack_hashes(event.held),
                "dropped": pack_hashes(event.dropped)}
    raise TypeError(f"not an event: {event!r}")


def _clocked(clock: int | None, out: dict[str, Any]) -> dict[str, Any]:
    if clock is not None:
        out["clock"] = clock  # only when set: a journal written before clocks reads as it was
    return out


def _owned(owner: str | None) -> dict[str, str]:
    # Written before the spec, and only when set: the service reads a create record's spec in
    # place (it ends the record), and a journal of a master without tenants reads as it was.
    return {"owner": owner} if owner is not None else {}


def create_head(owner: str | None) -> str:
    """A create record's text up to its spec's (event_to_text; read back by the service)."""
    return '{"t":"create",' + (f'"owner":{json.dumps(owner)},' if owner is not None else "") + '"spec":'


def event_to_text(event: Event) -> str:
    """``event_to_json`` as compact JSON text, reusing the cached text of a job spec."""
    if isinstance(event, CreateJob):
        return create_head(event.owner) + event.spec.json_text + "}"
    return json.dumps(event_to_json(event), separators=(",", ":"))


def event_from_json(raw: dict[str, Any]) -> Event:
    kind = raw["t"]
    if kind == "create":
        return CreateJob(JobSpec.from_log(raw["spec"]), raw.get("owner"))
    if kind == "lease":
        return Lease(
            raw["job"], raw["trainer"], raw["node"], raw["count"], raw["epoch"], tuple(raw["ids"]), raw["rid"],
            raw.get("stream"),
        )
    if kind == "renew":
        return Renew(raw["job"], raw["lease"], raw["trainer"], raw["offset"], raw.get("clock"))
    if kind == "complete":
        return Complete(raw["job"], raw["lease"], raw["trainer"], raw.get("clock"))
    if kind == "fail":
        return Fail(raw["job"], raw["lease"], raw["trainer"], raw["error"])
    if kind == "release":
        return Release(raw["job"], raw["lease"], raw["trainer"], raw["offset"], raw.get("clock"))
    if kind == "mark":
        return Mark(raw["job"], raw["trainer"], raw["clock"], tuple((str(lid), int(o)) for lid, o in raw["positions"]))
    if kind == "rewind":
        return Rewind(raw["job"], raw["trainer"], raw["mark"], raw["clock"], raw.get("created"))
    if kind == "resume":
        return Resume()
    if kind == "delete":
        return DeleteJob(raw["job"], bool(raw["force"]))
    if kind == "placement":
        return Placement(tuple((str(m), str(n)) for m, n in raw["members"]))
    if kind == "holdings":
        return Holdings(str(raw["node"]), bool(raw["full"]), tuple(unpack_hashes(raw["held"], "holdings.held")),
                        tuple(unpack_hashes(raw["dropped"], "holdings.dropped")))
    raise ValueError(f"unknown event type {kind!r}")
