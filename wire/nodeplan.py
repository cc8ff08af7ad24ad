"""What a node daemon tells the lease master about its cache, and the plan the master answers with.

A daemon started with ``--master URL`` posts a **report** to ``POST /v1/nodes/{node}/report``
every few seconds. The answer is the node's **plan**. Both are JSON documents checked here, by
the one pair of functions each side uses (:func:`parse_report`, :func:`parse_plan`), so the
daemon and the master read them alike and neither trusts the other's bytes.

Objects are named by :func:`name_hash`, the xxh3-64 of ``bucket/key`` (the name rendezvous
hashing uses): 8 bytes an object, whatever its key's length. Lists of hashes travel packed
(:func:`pack_hashes`: little-endian unsigned 64-bit integers, base64), so a report of 10,000
objects is 107 KB of JSON and a delta of one object 12 bytes.

The report::

    {"kind": "shardcache-node-report-v1",
     "daemon": "<the daemon instance's id: random per start>",
     "seq": 7,                 # this instance's report number, from 1
     "base": 6,                # the report this one is a delta on; null: a full report
     "held": "<packed hashes>",     # full: every object cached; delta: those cached since base
     "dropped": "<packed hashes>",  # delta only: those evicted or removed since base
     "capacity_bytes": 1099511627776, "used_bytes": 42, "mean_entry_bytes": 67108864,
     "jobs": {"<job>": {"reads": 10, "hit_bytes": 1, "origin_bytes": 2, "peer_bytes": 3,
                        "prefetch_bytes": 4}}}    # counters since the daemon started

A delta applies only on the report it names: the master answers ``"resend": "full"`` when it does
not hold that one (a master restarted or newly elected, a report lost, a job created since), and
the daemon's next report is full. ``jobs`` carries the daemon's cumulative per-job counters
(:data:`JOB_COUNTERS`) for the jobs its readers named (``x-shardcache-job``; at most
:data:`MAX_JOBS` of them, the rest counted under :data:`OTHER_JOB`).

The plan::

    {"kind": "shardcache-node-plan-v1",
     "seq": 7,                 # the report it answers
     "resend": null,           # or "full"
     "interval_s": 2.0,        # when to report next
     "prefetch": [{"job": "j", "bucket": "b", "key": "k", "next_use": 1234}, ...],
     "keep": "<packed hashes>"}  # the objects to keep, soonest needed first

``prefetch`` lists objects the node's trainers will be leased, not cached on the node, in the
order they will be needed (at most :data:`MAX_PREFETCH`). ``keep`` ranks the cached objects the
master's order still needs, soonest first (at most :data:`MAX_KEEP`): evicting, the daemon takes
what ``keep`` does not name first (by its own policy), then what it names last (Belady's rule
over the known order). ``next_use`` is the object's place in the job's leases to come (epoch x
shards + position in that epoch's seeded order), for the daemon's log and status only.
"""

from __future__ import annotations

import base64
import re
from array import array
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import xxhash

from wire.errors import BadRequest

__all__ = [
    "REPORT_KIND",
    "PLAN_KIND",
    "JOB_COUNTERS",
    "MAX_JOBS",
    "MAX_JOB_NAME",
    "OTHER_JOB",
    "MAX_HASHES",
    "MAX_PREFETCH",
    "MAX_KEEP",
    "MAX_REPORT_BYTES",
    "MAX_PLAN_BYTES",
    "JOB_HEADER",
    "name_hash",
    "pack_hashes",
    "unpack_hashes",
    "job_name",
    "NodeReport",
    "PrefetchItem",
    "NodePlan",
    "parse_report",
    "parse_plan",
]

REPORT_KIND = "shardcache-node-report-v1"
PLAN_KIND = "shardcache-node-plan-v1"
JOB_HEADER = "x-shardcache-job"
"""The request header by which a reader names its job to the daemon (the loader sends it)."""
JOB_COUNTERS = ("reads", "hit_bytes", "origin_bytes", "peer_bytes", "prefetch_bytes")
"""The per-job counters a report carries, cumulative since the daemon started."""
MAX_JOBS = 256
"""Most jobs a daemon counts apart; the reads of any more are counted under :data:`OTHER_JOB`."""
OTHER_JOB = "(other)"
MAX_JOB_NAME = 128
MAX_HASHES = 4_000_000
"""Most hashes one list of a report may hold (a full report of 4 million cached objects)."""
MAX_PREFETCH = 1024
MAX_KEEP = 1_000_000
MAX_REPORT_BYTES = 48 << 20
MAX_PLAN_BYTES = 16 << 20
_JOB = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@/+=-]*")
_DAEMON = re.compile(r"[A-Za-z0-9._-]{1,64}")
_MAX_SEQ = 1 << 62
_MAX_BYTES = 1 << 62


def name_hash(bucket: str, key: str) -> int:
    """The 64-bit name of the object ``bucket/key`` in reports and plans."""
    return xxhash.xxh3_64_intdigest(f"{bucket}/{key}".encode("utf-8", "surrogatepass"))


def pack_hashes(hashes: Iterable[int]) -> str:
    packed = array("Q", hashes)
    if packed.itemsize != 8:  # pragma: no cover - every platform we run on has a 64-bit "Q"
        raise RuntimeError("array('Q') is not 64-bit here")
    if array("H", [1]).tobytes() != b"\x01\x00":  # pragma: no cover - big-endian host
        packed.byteswap()
    return base64.b64encode(packed.tobytes()).decode("ascii")


def unpack_hashes(text: Any, what: str, limit: int = MAX_HASHES) -> array[int]:
    """The hashes packed in ``text``; :class:`BadRequest` naming ``what`` when it is not that."""
    if not isinstance(text, str):
        raise BadRequest(f"{what}: expected a base64 string of packed 64-bit hashes")
    if len(text) > (limit * 8 * 4) // 3 + 4:
        raise BadRequest(f"{what}: more than {limit} hashes")
    try:
        raw = base64.b64decode(text, validate=True)
    except ValueError:
        raise BadRequest(f"{what}: not base64") from None
    if len(raw) % 8:
        raise BadRequest(f"{what}: {len(raw)} bytes is not a whole number of 64-bit hashes")
    out = array("Q")
    out.frombytes(raw)
    if array("H", [1]).tobytes() != b"\x01\x00":  # pragma: no cover - big-endian host
        out.byteswap()
    return out


def job_name(value: Any, what: str = "job") -> str:
    """``value`` as a job name a daemon counts under; :class:`BadRequest` when it is not one."""
    if not isinstance(value, str) or not 0 < len(value) <= MAX_JOB_NAME or not _JOB.fullmatch(value):
        if value == OTHER_JOB:
            return value
        raise BadRequest(f"{what}: a job name is 1-{MAX_JOB_NAME} characters of letters, digits and ._:@/+=- "
                         f"starting with a letter or digit")
    return value


def _int(value: Any, what: str, *, low: int = 0, high: int = _MAX_BYTES) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise BadRequest(f"{what}: expected an integer in [{low}, {high}]")
    return value


def _object(value: Any, what: str) -> Mapping[str, Any]:
    if not isinstance(value, dict):
        raise BadRequest(f"{what}: expected a JSON object")
    return value


def _only(doc: Mapping[str, Any], allowed: set[str], required: set[str], what: str) -> None:
    extra = sorted(set(doc) - allowed)
    if extra:
        raise BadRequest(f"{what}: unknown field {extra[0]!r}")
    missing = sorted(required - set(doc))
    if missing:
        raise BadRequest(f"{what}: missing field {missing[0]!r}")


@dataclass(frozen=True)
class NodeReport:
    daemon: str
    seq: int
    base: int | None
    """The report this one is a delta on; None: a full report (``held`` is everything cached)."""
    held: array[int]
    dropped: array[int]
    capacity_bytes: int
    used_bytes: int
    mean_entry_bytes: int
    jobs: dict[str, dict[str, int]] = field(default_factory=dict)

    @property
    def full(self) -> bool:
        return self.base is None

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": REPORT_KIND, "daemon": self.daemon, "seq": self.seq, "base": self.base,
            "held": pack_hashes(self.held), "dropped": pack_hashes(self.dropped),
            "capacity_bytes": self.capacity_bytes, "used_bytes": self.used_bytes,
            "mean_entry_bytes": self.mean_entry_bytes, "jobs": self.jobs,
        }


_REPORT_FIELDS = {"kind", "daemon", "seq", "base", "held", "dropped", "capacity_bytes", "used_bytes",
                  "mean_entry_bytes", "jobs"}


def parse_report(doc: Any) -> NodeReport:
    """A report document, checked; :class:`BadRequest` naming what is wrong."""
    doc = _object(doc, "report")
    _only(doc, _REPORT_FIELDS, _REPORT_FIELDS, "report")
    if doc["kind"] != REPORT_KIND:
        raise BadRequest(f"report: kind is not {REPORT_KIND!r}")
    daemon = doc["daemon"]
    if not isinstance(daemon, str) or not _DAEMON.fullmatch(daemon):
        raise BadRequest("report.daemon: 1-64 characters of letters, digits and ._-")
    seq = _int(doc["seq"], "report.seq", low=1, high=_MAX_SEQ)
    base = None if doc["base"] is None else _int(doc["base"], "report.base", low=1, high=seq - 1)
    held = unpack_hashes(doc["held"], "report.held")
    dropped = unpack_hashes(doc["dropped"], "report.dropped")
    if base is None and dropped:
        raise BadRequest("report.dropped: a full report drops nothing")
    jobs_doc = _object(doc["jobs"], "report.jobs")
    if len(jobs_doc) > MAX_JOBS + 1:
        raise BadRequest(f"report.jobs: more than {MAX_JOBS + 1} jobs")
    jobs: dict[str, dict[str, int]] = {}
    for name, counters in jobs_doc.items():
        job = job_name(name, "report.jobs")
        counters = _object(counters, f"report.jobs[{job!r}]")
        _only(counters, set(JOB_COUNTERS), set(JOB_COUNTERS), f"report.jobs[{job!r}]")
        jobs[job] = {c: _int(counters[c], f"report.jobs[{job!r}].{c}") for c in JOB_COUNTERS}
    return NodeReport(
        daemon=daemon, seq=seq, base=base, held=held, dropped=dropped,
        capacity_bytes=_int(doc["capacity_bytes"], "report.capacity_bytes"),
        used_bytes=_int(doc["used_bytes"], "report.used_bytes"),
        mean_entry_bytes=_int(doc["mean_entry_bytes"], "report.mean_entry_bytes"),
        jobs=jobs,
    )


@dataclass(frozen=True)
class PrefetchItem:
    job: str
    bucket: str
    key: str
    next_use: int

    def to_json(self) -> dict[str, Any]:
        return {"job": self.job, "bucket": self.bucket, "key": self.key, "next_use": self.next_use}


@dataclass(frozen=True)
class NodePlan:
    seq: int
    resend: str | None = None
    """``"full"``: the master cannot apply the next delta; send a full report."""
    interval_s: float = 2.0
    prefetch: tuple[PrefetchItem, ...] = ()
    keep: array[int] = field(default_factory=lambda: array("Q"))

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": PLAN_KIND, "seq": self.seq, "resend": self.resend, "interval_s": self.interval_s,
            "prefetch": [item.to_json() for item in self.prefetch], "keep": pack_hashes(self.keep),
        }


_PLAN_FIELDS = {"kind", "seq", "resend", "interval_s", "prefetch", "keep"}
_MAX_NAME = 4096


def _text(value: Any, what: str, limit: int = _MAX_NAME) -> str:
    if not isinstance(value, str) or not 0 < len(value) <= limit:
        raise BadRequest(f"{what}: expected a string of 1-{limit} characters")
    return value


def parse_plan(doc: Any) -> NodePlan:
    """A plan document, checked; :class:`BadRequest` naming what is wrong."""
    doc = _object(doc, "plan")
    _only(doc, _PLAN_FIELDS, _PLAN_FIELDS, "plan")
    if doc["kind"] != PLAN_KIND:
        raise BadRequest(f"plan: kind is not {PLAN_KIND!r}")
    resend = doc["resend"]
    if resend not in (None, "full"):
        raise BadRequest("plan.resend: null or \"full\"")
    interval = doc["interval_s"]
    if isinstance(interval, bool) or not isinstance(interval, (int, float)) or not 0.1 <= interval <= 3600:
        raise BadRequest("plan.interval_s: a number of seconds in [0.1, 3600]")
    items = doc["prefetch"]
    if not isinstance(items, list) or len(items) > MAX_PREFETCH:
        raise BadRequest(f"plan.prefetch: a list of at most {MAX_PREFETCH} objects")
    prefetch = []
    for i, raw in enumerate(items):
        item = _object(raw, f"plan.prefetch[{i}]")
        _only(item, {"job", "bucket", "key", "next_use"}, {"job", "bucket", "key", "next_use"}, f"plan.prefetch[{i}]")
        prefetch.append(PrefetchItem(
            job=job_name(item["job"], f"plan.prefetch[{i}].job"),
            bucket=_text(item["bucket"], f"plan.prefetch[{i}].bucket", 255),
            key=_text(item["key"], f"plan.prefetch[{i}].key"),
            next_use=_int(item["next_use"], f"plan.prefetch[{i}].next_use"),
        ))
    return NodePlan(
        seq=_int(doc["seq"], "plan.seq", low=1, high=_MAX_SEQ), resend=resend, interval_s=float(interval),
        prefetch=tuple(prefetch), keep=unpack_hashes(doc["keep"], "plan.keep", MAX_KEEP),
    )
