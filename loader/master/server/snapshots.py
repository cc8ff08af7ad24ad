"""The formats a master's state is saved in: the snapshot a store keeps beside its journal.

A store writes a snapshot of the whole state now and then and, on start, reads it back and
replays the events logged after it (:mod:`loader.master.server.events`). The state machine
(:class:`~loader.master.server.state.MasterState`) writes and reads its own objects' JSON; what is
here is the document around them and the formats it has had:

- version 2 (written): ``{"version": 2, "last_now": t, "ring": ..., "jobs": [job, ...]}``, the
  ring only once a placement was applied, each job as ``JobState.to_json()`` (its ``spec`` first).
  It is written as text spliced from each spec's cached JSON text (:func:`write_text`) and read in
  place (:func:`read_text`): each spec by :func:`~loader.master.server.spec.read_log_spec` into
  columns, never a dict a shard (``json.loads`` made ~600 MB of them for 1M shards), the rest of
  each job with ``json``;
- version 1 (read only): a job had exactly one open epoch, its done shards as a list; each such job
  is upgraded to version 2's members on reading (:func:`upgrade_v1_job`).
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from loader.master.server.spec import JobSpec, read_log_spec

__all__ = ["VERSION", "Snapshot", "document", "write_text", "read_text", "read_document", "upgrade_v1_job"]

VERSION = 2
"""The version written; versions 1 and 2 are read."""
_READ_VERSIONS = (1, 2)
_HEAD = f'{{"version":{VERSION},"last_now":'
_DECODER = json.JSONDecoder()


@dataclass
class Snapshot:
    """A snapshot as read, before the machine builds its state from it."""

    last_now: float
    ring: Any
    """The ring's JSON (``Ring.to_json()``), or None when the snapshot has none."""
    jobs: Iterable[tuple[JobSpec, dict[str, Any]]]
    """Each job's spec and its other members, as version 2 writes them; read as they are taken
    (one job's members in memory at a time)."""


def document(last_now: float, ring: Any, jobs: list[dict[str, Any]]) -> dict[str, Any]:
    """The version-2 document of the state's time, ring JSON (None: none) and jobs' JSON."""
    out: dict[str, Any] = {"version": VERSION, "last_now": last_now}
    if ring is not None:
        out["ring"] = ring
    out["jobs"] = jobs
    return out


def write_text(last_now: float, ring: Any, jobs: Iterable[tuple[str, dict[str, Any]]]) -> str:
    """:func:`document` as JSON text, spliced from each job's (spec's cached JSON text, other
    members): the only part that grows with the shard count is then the per-epoch progress, not
    the shard list."""
    parts = []
    for spec_text, rest in jobs:
        members = json.dumps(rest, separators=(",", ":"))
        parts.append('{"spec":' + spec_text + "," + members[1:])
    ring_text = ',"ring":' + json.dumps(ring, separators=(",", ":")) if ring is not None else ""
    return _HEAD + json.dumps(last_now) + ring_text + ',"jobs":[' + ",".join(parts) + "]}"


def read_text(text: str) -> Snapshot | None:
    """The snapshot in ``text`` as :func:`write_text` writes it, read in place; None for any other
    text (an older master's: decode it whole and take it to :func:`read_document`). ValueError,
    KeyError or TypeError, also while its jobs are taken, when it is not as written."""
    if not text.startswith(_HEAD):
        return None
    last_now, i = _DECODER.raw_decode(text, len(_HEAD))
    ring = None
    if text.startswith(',"ring":', i):
        ring, i = _DECODER.raw_decode(text, i + len(',"ring":'))
    return Snapshot(float(last_now), ring, _jobs_in_text(text, _expect(text, i, ',"jobs":[')))


def _jobs_in_text(text: str, i: int) -> Iterator[tuple[JobSpec, dict[str, Any]]]:
    first = True
    while not text.startswith("]}", i):
        if not first:
            i = _expect(text, i, ",")
        first = False
        spec, i = read_log_spec(text, _expect(text, i, '{"spec":'))
        rest: dict[str, Any] = {}
        while text.startswith(",", i):  # the job's other members, each decoded alone
            key, i = _DECODER.raw_decode(text, i + 1)
            rest[key], i = _DECODER.raw_decode(text, _expect(text, i, ":"))
        i = _expect(text, i, "}")
        yield spec, rest
    if i + 2 != len(text):
        raise ValueError("trailing text after the snapshot")


def read_document(raw: dict[str, Any]) -> Snapshot:
    """The snapshot of a decoded document of any version read (ValueError for another)."""
    if raw.get("version") not in _READ_VERSIONS:
        raise ValueError(f"unsupported master state version {raw.get('version')!r}")
    return Snapshot(float(raw["last_now"]), raw["ring"] if "ring" in raw else None, _jobs_in_document(raw["jobs"]))


def _jobs_in_document(items: list[dict[str, Any]]) -> Iterator[tuple[JobSpec, dict[str, Any]]]:
    for item in items:
        spec = JobSpec.from_log(item["spec"])
        yield spec, item if "open" in item else upgrade_v1_job(item, spec)


def upgrade_v1_job(raw: dict[str, Any], spec: JobSpec) -> dict[str, Any]:
    """A job of a version-1 snapshot (written before epochs could overlap: one open epoch) as
    version 2's members: a finished job keeps its last two epochs' reports, an unfinished one
    its open epoch and leases."""
    epoch, finished = raw["epoch"], raw["finished"]
    prev = list(raw.get("prev_failed") or [])
    job: dict[str, Any] = {"next_epoch": epoch + (0 if finished else 1), "finished": finished, "open": [], "leases": []}
    if finished:
        progress = {s: (f, e) for s, _, f, e, _ in raw["progress"]}
        last = [
            {"key": spec.shards[s].key, "shard": s, "failures": progress.get(s, (0, None))[0],
             "last_error": progress.get(s, (0, None))[1]}
            for s in sorted(set(raw["failed"]))
        ]
        job["recent"] = [{"epoch": epoch - 1, "done": len(raw["done"]), "failed": last}, {"epoch": epoch - 2, "done": 0, "failed": prev}]
    else:
        done = set(raw["done"])
        # Version 2's "done" is the epoch's bitset as EpochState keeps it (shard s is bit s & 7 of
        # byte s >> 3), in base64; a done shard has no progress left.
        bits = bytearray((len(spec.shards) + 7) // 8)
        for shard in done:
            bits[shard >> 3] |= 1 << (shard & 7)
        job["open"] = [{
            "epoch": epoch, "cursor": raw["cursor"], "requeue": raw["requeue"],
            "progress": [item for item in raw["progress"] if item[0] not in done],
            "done": base64.b64encode(bits).decode(), "done_count": len(raw["done"]), "failed": raw["failed"],
        }]
        job["recent"] = [{"epoch": epoch - 1, "done": 0, "failed": prev}] if epoch > 0 else []
        job["leases"] = [[lid, shard, epoch, trainer, "", node, exp] for lid, shard, trainer, node, exp in raw["leases"]]
    job["closed"] = [*raw.get("closed_prev", []), *raw.get("closed", [])]
    job["last_request"] = [[t, "", rid, ids] for t, rid, ids in raw.get("last_request", [])]
    job["totals"] = raw["totals"]
    return job


def _expect(text: str, i: int, literal: str) -> int:
    """The index after ``literal``, which must be at ``text[i]`` (ValueError otherwise)."""
    if not text.startswith(literal, i):
        raise ValueError(f"expected {literal!r} at {i}")
    return i + len(literal)
