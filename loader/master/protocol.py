"""The lease protocol's shapes, in one place both sides import: what the trainer sends with each
call (the body fields the master takes), what the master answers (a lease grant, a checkpoint
mark, a rewind), and the routes of the checkpoint calls. Stdlib only (trainers import it).

The master builds its answers from these types (``to_json``) and checks request bodies against
their field sets; the client parses answers with ``from_answer``, which raises
:class:`ProtocolError` (a :class:`~loader.master.errors.MasterError`) on an answer that does not
fit, so a malformed or foreign answer is one clear error, not a ``KeyError`` deep in a thread.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from json.encoder import encode_basestring_ascii
from typing import Any

from loader.master.errors import ProtocolError

__all__ = [
    "CHECKPOINT_FEATURE",
    "LEASE_FIELDS",
    "RENEW_FIELDS",
    "COMPLETE_FIELDS",
    "RELEASE_FIELDS",
    "FAIL_FIELDS",
    "MARK_FIELDS",
    "REWIND_FIELDS",
    "ProtocolError",
    "LeaseGrant",
    "MarkAnswer",
    "RewindAnswer",
    "marks_path",
    "rewind_path",
    "SPEC_FIELDS",
    "shards_sha256",
    "canonical_shards",
]

SPEC_FIELDS = frozenset(
    {"name", "dataset", "shards", "epochs", "seed", "shuffle", "lease_ttl_s", "max_failures", "locality_window"}
)
"""A job spec's fields (``POST /v1/jobs``): the master refuses others, the client joins by digest
only a spec made of these."""

CHECKPOINT_FEATURE = "marks"
"""Listed in ``GET /v1/version``'s ``features`` by a master that takes ``clock`` on renew,
release and complete, and the mark and rewind routes. A client sends ``clock`` only to such a
master (older ones refuse unknown body fields)."""

LEASE_FIELDS = frozenset({"trainer", "node", "count", "epoch", "request_id", "wait_s", "stream"})
RENEW_FIELDS = frozenset({"trainer", "offset", "clock"})
COMPLETE_FIELDS = frozenset({"trainer", "clock"})
RELEASE_FIELDS = frozenset({"trainer", "offset", "clock"})
FAIL_FIELDS = frozenset({"trainer", "error"})
MARK_FIELDS = frozenset({"trainer", "clock", "positions"})
REWIND_FIELDS = frozenset({"trainer", "mark", "clock", "job_created"})


def marks_path(job: str) -> str:
    """``POST``: a checkpoint's mark (``job`` already quoted)."""
    return f"/v1/jobs/{job}/marks"


def rewind_path(job: str) -> str:
    """``POST``: resume the job from a mark (``job`` already quoted)."""
    return f"/v1/jobs/{job}/rewind"


def _fields(kind: str, raw: Any, parse: Any) -> Any:
    try:
        return parse(raw)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise ProtocolError(f"the master answered a malformed {kind}: {str(raw)[:300]}") from exc


@dataclass(frozen=True)
class LeaseGrant:
    """One lease of a lease answer: the shard (its index and key) of an epoch, to read from
    sample ``offset``, for ``ttl_s`` seconds unless renewed."""

    lease: str
    key: str
    shard: int
    epoch: int
    offset: int
    size: int | None
    samples: int | None
    ttl_s: float

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_answer(cls, item: Any) -> LeaseGrant:
        def parse(raw: dict[str, Any]) -> LeaseGrant:
            return cls(
                lease=str(raw["lease"]), key=str(raw["key"]), shard=int(raw.get("shard", -1)),
                epoch=int(raw.get("epoch", -1)), offset=int(raw.get("offset") or 0),
                size=None if raw.get("size") is None else int(raw["size"]),
                samples=None if raw.get("samples") is None else int(raw["samples"]),
                ttl_s=float(raw.get("ttl_s") or 30.0),
            )

        return _fields("lease", item, parse)


@dataclass(frozen=True)
class MarkAnswer:
    """A checkpoint's mark: ``mark`` (its id in the job) at ``clock``; ``trainers`` reported at
    it so far; ``lost``: leases whose position could not be recorded (expired and re-issued:
    their next holder hands those samples out again); ``job_created``: the job's creation time,
    which a state carries so that a namesake job created later refuses it."""

    mark: int
    clock: int
    epoch: int
    trainers: int
    lost: tuple[str, ...]
    job_created: float

    @classmethod
    def from_answer(cls, raw: Any) -> MarkAnswer:
        return _fields("mark answer", raw, lambda r: cls(
            int(r["mark"]), int(r["clock"]), int(r["epoch"]), int(r["trainers"]),
            tuple(str(x) for x in r.get("lost") or ()), float(r.get("job_created") or 0.0),
        ))


@dataclass(frozen=True)
class RewindAnswer:
    """A rewind done: the job is at ``mark``'s ``clock`` again; ``epoch`` is its current epoch,
    ``revoked`` the leases taken back, ``undone`` the shards whose deliveries were undone."""

    mark: int
    clock: int
    epoch: int
    revoked: int
    undone: int
    finished: bool

    @classmethod
    def from_answer(cls, raw: Any) -> RewindAnswer:
        return _fields("rewind answer", raw, lambda r: cls(
            int(r["mark"]), int(r["clock"]), int(r["epoch"]), int(r["revoked"]), int(r["undone"]), bool(r["finished"]),
        ))


def shards_sha256(shards: list[Any]) -> str | None:
    """SHA-256 of the shard list as the master writes it (``spec.ShardTable.json_chunks``:
    compact JSON, every shard as {"key", "size", "samples"}); None for a list the master would
    refuse (it cannot be the list of an existing job)."""
    digest = hashlib.sha256()
    try:
        for chunk in canonical_shards(shards):
            digest.update(chunk.encode("ascii"))
    except (TypeError, ValueError):
        return None
    return digest.hexdigest()


def canonical_shards(shards: list[Any], block: int = 8192) -> Iterator[str]:
    """A shard list (dicts of ``key``, ``size``, ``samples``, or bare keys) as the master's
    canonical JSON text, in chunks: what ``spec.ShardTable.json_chunks`` writes for the list it
    keeps (``tests/master`` checks the two agree). ValueError for a list the master would refuse."""
    yield "["
    for start in range(0, len(shards), block):
        parts = []
        for item in shards[start : start + block]:
            key: Any
            if isinstance(item, str):
                key, size, samples = item, None, None
            elif isinstance(item, dict) and not set(item) - {"key", "size", "samples"}:
                key, size, samples = item.get("key"), item.get("size"), item.get("samples")
            else:
                raise ValueError("not a shard")
            if not isinstance(key, str) or any(v is not None and type(v) is not int for v in (size, samples)):
                raise ValueError("not a shard")
            parts.append(f'{{"key":{encode_basestring_ascii(key)},"size":{"null" if size is None else size},'
                         f'"samples":{"null" if samples is None else samples}}}')
        yield ("," if start else "") + ",".join(parts)
    yield "]"
