"""Trainer-side client of ``shardcache master``: small, synchronous, thread-safe, stdlib only.

Usage::

    from loader.master.client import MasterClient

    client = MasterClient("http://m1:8700,http://m2:8700")      # several masters: follows the leader
    client.create_job({"name": "resnet50", "dataset": "s3://b/train/",
                       "shards": [{"key": "train-000000.tar", "size": 123, "samples": 100}],
                       "epochs": 10, "seed": 1})
    answer = client.lease("resnet50", trainer="t1", node="node-a", count=2)
    for lease in answer["leases"]:
        ttl = client.renew("resnet50", lease["lease"], "t1", offset=57)
        client.complete("resnet50", lease["lease"], "t1")

Methods (the HTTP contract is ``docs/master-api.md``):

- ``create_job(spec) -> dict``: create the job or join the identical existing one; returns its
  status. :class:`JobConflict` if a job with that name has a different spec,
  :class:`TooManyJobs` if it is new and the master holds its ``--max-jobs``.
- ``delete_job(job, force=False) -> dict``: ``{"deleted": True}``: the job and its state are
  gone. :class:`JobInUse` while trainers hold live leases on it, unless ``force`` (they then get
  :class:`NoSuchJob`); :class:`NoSuchJob` if there is no such job.
- ``lease(job, trainer, node, count, epoch=None) -> dict``: ``{"status": "ok"|"wait"|"epoch_done"|
  "finished", "epoch": int, "leases": [{"lease", "key", "shard", "epoch", "offset", "size",
  "samples", "ttl_s"}], "retry_after_s": float|None}``. ``offset`` is the sample to resume at.
  ``epoch=None`` takes whatever epoch is current (continuous mode). A retried request (lost
  answer) returns the leases already granted to it instead of granting more.
- ``renew(job, lease, trainer, offset) -> float``: records the sample offset reached and extends
  the lease; returns its TTL in seconds. :class:`LeaseLost` when it expired or was re-issued.
- ``complete(job, lease, trainer) -> None``: the shard is done for this epoch (exactly once).
  :class:`LeaseLost` when the lease expired or was re-issued: the completion counted nowhere.
  Completing the same lease again (a retry after a lost answer) succeeds and counts once.
- ``fail(job, lease, trainer, error) -> str``: report that the shard could not be read;
  returns ``"todo"`` (it will be re-issued) or ``"failed"`` (it reached ``max_failures`` and is
  skipped this epoch).
- ``report_wait(job, trainer, epoch=None) -> bool``: send the attached :attr:`wait_source`'s delta
  (``POST /v1/jobs/{job}/wait``, ``wire.stall``); False when there was nothing to send or the
  master does not take wait reports.
- ``status(job) -> dict`` and ``jobs() -> list[dict]``: job status as in the API doc;
  ``leader() -> dict``: the answering master's role and the leader it knows.

Errors are typed, under :class:`MasterError`: :class:`NoSuchJob`, :class:`JobConflict`,
:class:`TooManyJobs`, :class:`JobInUse`, :class:`LeaseLost`, :class:`NotLeaseHolder`,
:class:`BadRequest`, and :class:`MasterUnavailable`
once every master stayed unreachable (connection errors, 503, ``NotLeader`` without a reachable
leader) for ``retry_deadline_s``. Connection errors and 503 answers are retried with exponential
backoff and jitter, trying the next master of the list and following ``NotLeader`` hints.

One instance may be shared by threads: each thread keeps its own keep-alive connection per
master, and the known leader is shared.

Wait reports (``wire.stall``): with :attr:`MasterClient.wait_source` set (a
``loader.stall.WaitMeter``, in the process whose training loop it times), renew, release and
complete bodies carry the loop's wait since the last acknowledged report. Only to a master whose
``GET /v1/version`` lists the ``wait`` feature (one look per client): older masters refuse unknown
body fields. A call that fails gives its delta back to the meter, so the next report carries it
(but for ``LeaseLost``/``NotLeaseHolder``: the master counted the wait of those).
"""

from __future__ import annotations

import gzip
import http.client
import json
import os
import threading
import time
import urllib.parse
import uuid
from collections.abc import Mapping
from typing import Any

from loader.master.errors import (
    BadRequest,
    JobConflict,
    JobInUse,
    LeaseLost,
    MasterError,
    MasterUnavailable,
    NoSuchJob,
    NotLeader,
    NotLeaseHolder,
    TooManyJobs,
    Unauthorized,
    error_from_answer,
)
from loader.master.protocol import (
    CHECKPOINT_FEATURE,
    SPEC_FIELDS,
    MarkAnswer,
    RewindAnswer,
    marks_path,
    rewind_path,
    shards_sha256,
)
from wire import jsontext
from wire.errors import InvalidName
from wire.httpclient import ThreadConnections, UnixHTTPConnection, exchange
from wire.names import Address, parse_connect
from wire.retry import Backoff
from wire.stall import VERSION_PATH, WAIT_FEATURE, wait_path

# The errors are re-exported so a trainer needs one import line.
__all__ = [
    "BadRequest",
    "JobConflict",
    "JobInUse",
    "LeaseLost",
    "MasterClient",
    "MasterError",
    "MasterUnavailable",
    "NoSuchJob",
    "NotLeaseHolder",
    "TooManyJobs",
    "Unauthorized",
]

_USER_AGENT = "shardcache-master-client/1"
TOKEN_ENV = "SHARDCACHE_MASTER_TOKEN"
"""Where trainers and ``shardcache status`` find the master's bearer token."""
# Lease answers and job status are kilobytes; a far larger answer is not from a master.
_MAX_ANSWER = 64 << 20
# A create body this large goes gzip-compressed (a 1M-shard spec: ~70 MB as JSON, ~12 MB so).
# Any master takes it: aiohttp's server decompresses request bodies, and the master counts its
# --max-body limit after decompression.
_GZIP_BODY_BYTES = 1 << 20
# A spec with this many shards is looked up first: a trainer joining a job that exists with this
# very spec then sends no shard list at all (a new master says the list's digest in the status).
_LOOKUP_FIRST_SHARDS = 10_000
_DEFAULTED = ("lease_ttl_s", "max_failures")  # defaults the master chooses: unknown here
# The version probe is a nicety: an unreachable master is not waited for as long as a lease call.
_PROBE_DEADLINE_S = 5.0


def split_master_urls(master: str | list[str] | tuple[str, ...]) -> list[str]:
    """One master URL or several (a list, or comma-separated) as the client uses them; every one
    checked, :class:`BadRequest` naming the first that is not a master address."""
    raw = master.split(",") if isinstance(master, str) else list(master)
    urls = [u.strip().rstrip("/") for u in raw if u and u.strip()]
    if not urls:
        raise BadRequest("no master URL given: use http://host:8700 (or several, comma-separated)")
    for url in urls:
        _address(url)
    return urls


def _address(url: str) -> Address:
    try:
        return parse_connect(url, schemes=("http", "https"), base_path=True)
    except InvalidName:
        raise BadRequest(f"invalid master address {url!r}: use http://host:port, https://host:port or unix:///path/to.sock") from None


class MasterClient:
    """Synchronous, thread-safe client of the master HTTP API (see the module docstring)."""

    def __init__(
        self,
        master: str | list[str] | tuple[str, ...],
        *,
        timeout_s: float = 10.0,
        retry_deadline_s: float = 60.0,
        backoff_initial_s: float = 0.05,
        backoff_max_s: float = 2.0,
        token: str | None = None,
    ) -> None:
        """``master``: one URL or several (list, or comma-separated string).
        ``timeout_s``: per HTTP exchange. ``retry_deadline_s``: how long one call keeps retrying
        connection errors and 503 answers before raising :class:`MasterUnavailable`.
        ``token``: the master's bearer token (``--token-file``); default ``SHARDCACHE_MASTER_TOKEN``."""
        self._urls = split_master_urls(master)
        token = os.environ.get(TOKEN_ENV, "") if token is None else token
        self._auth = {"Authorization": f"Bearer {token.strip()}"} if token.strip() else {}
        self._timeout = float(timeout_s)
        self._long_poll = True
        self._deadline = float(retry_deadline_s)
        # Unbounded attempts: a call stops at its deadline instead.
        self._backoff = Backoff(float(backoff_initial_s), float(backoff_max_s))
        self._lock = threading.Lock()
        self._preferred = 0  # index into self._urls of the master believed to lead
        self._conns = ThreadConnections(self._new_connection)
        self.wait_source: Any = None
        """A ``loader.stall.WaitMeter`` whose delta rides on renew/release/complete (None: none)."""
        self._wait_ok: bool | None = None  # does the master take ``wait``? None: not asked yet
        self._features_seen: frozenset[str] | None = None  # the master's features; None: not asked yet

    @property
    def urls(self) -> list[str]:
        with self._lock:
            return list(self._urls)

    # -- API ------------------------------------------------------------------------------

    def create_job(self, spec: Mapping[str, Any]) -> dict[str, Any]:
        """Create the job or join the identical one; returns its status.

        A large spec is first compared with the job's status (its shard list's SHA-256): when
        the job exists with this very spec, joining sends no shard list (the answer is the one
        the create would give). Otherwise the spec is sent, gzip-compressed when large."""
        body = dict(spec)
        shards = body.get("shards")
        if isinstance(shards, list) and len(shards) >= _LOOKUP_FIRST_SHARDS:
            status = self._joined_without_sending(body)
            if status is not None:
                return status
        payload = json.dumps(body, separators=(",", ":")).encode()
        headers: dict[str, str] = {}
        if len(payload) >= _GZIP_BODY_BYTES:
            payload = gzip.compress(payload, compresslevel=1, mtime=0)
            headers["Content-Encoding"] = "gzip"
        return self._call("POST", "/v1/jobs", encoded=(payload, headers))

    def _joined_without_sending(self, body: dict[str, Any]) -> dict[str, Any] | None:
        """The job's status if it exists with exactly ``body`` as its spec, else None (then the
        create says what it says: 201, 409 naming the differences, 400...)."""
        name = body.get("name")
        if set(body) - SPEC_FIELDS or not isinstance(name, str) or any(body.get(f) is None for f in _DEFAULTED):
            return None
        digest = shards_sha256(body["shards"])
        if digest is None:
            return None
        try:
            status = self._call("GET", f"/v1/jobs/{_q(name)}")
        except (NoSuchJob, BadRequest):
            return None
        have = status.get("spec")
        if not isinstance(have, dict) or have.get("shards_sha256") != digest or have.get("shards") != len(body["shards"]):
            return None
        want = {"name": name, "dataset": body.get("dataset"), "epochs": body.get("epochs"), "seed": body.get("seed", 0),
                "shuffle": body.get("shuffle", True), "max_failures": body.get("max_failures"),
                "locality_window": body.get("locality_window", 0)}
        if any(type(v) is not type(have.get(k)) or v != have.get(k) for k, v in want.items()):
            return None
        ttl = body["lease_ttl_s"]
        if isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or float(ttl) != have.get("lease_ttl_s"):
            return None
        return status

    def delete_job(self, job: str, force: bool = False) -> dict[str, Any]:
        """Delete ``job`` and everything the master holds for it: ``{"deleted": True}``.

        :class:`JobInUse` while trainers hold live leases on it (wait until they are done, or
        pass ``force``: their next call gets :class:`NoSuchJob`); :class:`NoSuchJob` if there is
        no such job. A delete retried after its answer was lost (the master unreachable or
        failing over meanwhile) that then finds no job answers ``{"deleted": True, "already": True}``."""
        path = f"/v1/jobs/{_q(job)}" + ("?force=true" if force else "")
        retried: list[MasterError] = []
        try:
            return self._call("DELETE", path, retried=retried)
        except NoSuchJob:
            if not retried:
                raise
            return {"deleted": True, "already": True}

    def jobs(self) -> list[dict[str, Any]]:
        return list(self._call("GET", "/v1/jobs")["jobs"])

    def status(self, job: str) -> dict[str, Any]:
        return self._call("GET", f"/v1/jobs/{_q(job)}")

    def leader(self) -> dict[str, Any]:
        """This master's view of leadership: ``{"leader": url|None, "role": "leader"|"standby"|...,
        "self": url}``. Any master answers it, a standby too (it is not redirected)."""
        return self._call("GET", "/v1/leader")

    def lease(
        self, job: str, trainer: str, node: str, count: int = 1, epoch: int | None = None, wait_s: float = 0.0,
        stream: str | None = None,
    ) -> dict[str, Any]:
        """Ask for up to ``count`` leases. ``wait_s`` > 0: when none is free, the master holds the
        request until the job changes or its retry hint is due (at most ``wait_s``, kept below
        this client's HTTP timeout), and the answer carries ``waited_s``. ``stream``: which of the
        trainer's lease streams asks (a DataLoader worker); the trainer holds the leases."""
        body: dict[str, Any] = {"trainer": trainer, "node": node, "count": count, "request_id": uuid.uuid4().hex}
        if epoch is not None:
            body["epoch"] = epoch
        if stream is not None:
            body["stream"] = stream
        if wait_s > 0 and self._long_poll:
            body["wait_s"] = round(min(wait_s, self._timeout / 2), 3)
        try:
            return self._call("POST", f"/v1/jobs/{_q(job)}/leases", body)
        except BadRequest as exc:
            if "wait_s" not in body or "wait_s" not in exc.message:
                raise
            self._long_poll = False  # a master from before long polls: ask as it knows how
            del body["wait_s"]
            return self._call("POST", f"/v1/jobs/{_q(job)}/leases", body)

    def renew(self, job: str, lease: str, trainer: str, offset: int, clock: int | None = None) -> float:
        """``clock``: the trainer's clock at which its loop had received up to ``offset``
        (checkpoint marks; sent to a master that takes it)."""
        path = f"/v1/jobs/{_q(job)}/leases/{_q(lease)}/renew"
        answer = self._reporting(path, self._clocked({"trainer": trainer, "offset": offset}, clock))
        return float(answer["ttl_s"])

    def complete(self, job: str, lease: str, trainer: str, clock: int | None = None) -> None:
        self._reporting(f"/v1/jobs/{_q(job)}/leases/{_q(lease)}/complete", self._clocked({"trainer": trainer}, clock))

    def mark(self, job: str, trainer: str, clock: int, positions: list[tuple[str, int]]) -> MarkAnswer:
        """A checkpoint: this trainer's loop had received each held lease up to its offset at
        ``clock``; the job's mark at that clock (made, or joined when another rank reported at
        the same clock). :class:`MasterError` from a master without checkpoints."""
        self._require_checkpoints()
        body = {"trainer": trainer, "clock": clock, "positions": [[lease, offset] for lease, offset in positions]}
        return MarkAnswer.from_answer(self._call("POST", marks_path(_q(job)), body))

    def rewind(self, job: str, trainer: str, mark: int, clock: int, job_created: float | None = None) -> RewindAnswer:
        """Resume ``job`` from checkpoint ``mark`` (at ``clock``): every delivery after it is
        handed out again, every lease revoked. :class:`CheckpointGone` when the master no longer
        keeps that mark."""
        self._require_checkpoints()
        body: dict[str, Any] = {"trainer": trainer, "mark": mark, "clock": clock}
        if job_created:
            body["job_created"] = job_created
        return RewindAnswer.from_answer(self._call("POST", rewind_path(_q(job)), body))

    def knows_checkpoints(self) -> bool:
        """Whether the master takes clocks, marks and rewinds (``GET /v1/version``, asked once)."""
        return CHECKPOINT_FEATURE in self._features()

    def _require_checkpoints(self) -> None:
        if not self.knows_checkpoints():
            raise BadRequest(
                "this master does not keep checkpoint marks (a shardcache master from before them): upgrade the "
                "master to checkpoint the loader in dynamic mode"
            )

    def _clocked(self, body: dict[str, Any], clock: int | None) -> dict[str, Any]:
        if clock is not None and self.knows_checkpoints():
            body["clock"] = clock
        return body

    def fail(self, job: str, lease: str, trainer: str, error: str) -> str:
        answer = self._call("POST", f"/v1/jobs/{_q(job)}/leases/{_q(lease)}/fail", {"trainer": trainer, "error": str(error)})
        return str(answer["shard_state"])

    def release(self, job: str, lease: str, trainer: str, offset: int, clock: int | None = None) -> str:
        """Give a lease back before its end (the trainer is leaving): the shard is handed out again
        at once, from ``offset``. Returns the shard's state (``todo``)."""
        path = f"/v1/jobs/{_q(job)}/leases/{_q(lease)}/release"
        answer = self._reporting(path, self._clocked({"trainer": trainer, "offset": offset}, clock))
        return str(answer["shard_state"])

    def report_wait(self, job: str, trainer: str, epoch: int | None = None) -> bool:
        """Send the wait since the last report on its own (a trainer with no lease to renew);
        False when there was nothing to send or the master does not take it."""
        source = self.wait_source
        if source is None or not self.knows_wait():
            return False
        body: dict[str, Any] = {"trainer": trainer}
        if epoch is not None:
            body["epoch"] = epoch
        # Bounded like the probe: a report is never worth holding up the loop's end for a minute.
        sent = self._reporting(wait_path(_q(job)), body, only_with_wait=True, deadline_s=_PROBE_DEADLINE_S)
        return sent is not None

    def knows_wait(self) -> bool:
        """Whether the master takes ``wait`` fields (asked once: ``GET /v1/version``)."""
        if self._wait_ok is None:
            features = self._features()
            if self._features_seen is None:
                return False  # unreachable: ask again with the next report
            self._wait_ok = WAIT_FEATURE in features
        return self._wait_ok

    def _features(self) -> frozenset[str]:
        """What the master takes beyond the first v1 (``GET /v1/version``, asked once; empty
        while no master answers, asked again next time)."""
        if self._features_seen is None:
            try:
                version = self._call("GET", VERSION_PATH, deadline_s=_PROBE_DEADLINE_S)
            except MasterUnavailable:
                return frozenset()
            except MasterError:
                version = {}  # 404: a master from before the version route
            raw = version.get("features")
            self._features_seen = frozenset(f for f in raw if isinstance(f, str)) if isinstance(raw, list) else frozenset()
        return self._features_seen

    def _reporting(
        self, path: str, body: dict[str, Any], only_with_wait: bool = False, deadline_s: float | None = None
    ) -> Any:
        """POST ``body`` with the wait since the last report attached (if any and the master takes
        it); the delta goes back to the meter if the call fails. ``only_with_wait``: send nothing
        (None) when there is no delta."""
        source = self.wait_source
        taken = source.take() if source is not None and self.knows_wait() else None
        if taken is None:
            return None if only_with_wait else self._call("POST", path, body)
        try:
            answer = self._call("POST", path, {**body, "wait": taken.field()}, deadline_s=deadline_s)
        except BadRequest as exc:
            source.restore(taken)
            if "'wait" not in exc.message:
                raise
            # A master that says it knows wait reports yet refuses this one (an older leader after
            # a failover, or a bug on either side): stop sending them, never fail training on it.
            self._wait_ok = False
            if only_with_wait:
                return None
            return self._call("POST", path, body)
        except (LeaseLost, NotLeaseHolder):
            source.commit(taken)  # the master counts the wait of a refused lease call (wire.stall)
            raise
        except BaseException:
            source.restore(taken)
            raise
        source.commit(taken)
        return answer

    def close(self) -> None:
        """Close every connection of this client, made on any thread (a call in flight on another
        thread fails over to a fresh one). The client stays usable."""
        self._conns.close()

    def __enter__(self) -> MasterClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- transport ------------------------------------------------------------------------

    def _call(
        self, method: str, path: str, body: dict[str, Any] | None = None, *, encoded: tuple[bytes, dict[str, str]] | None = None,
        retried: list[MasterError] | None = None, deadline_s: float | None = None,
    ) -> dict[str, Any]:
        """One API call with retries; ``encoded``: the body already encoded, and its headers;
        ``retried`` collects the error of every attempt that was retried; ``deadline_s``: retry
        for this long instead of ``retry_deadline_s``."""
        payload = encoded[0] if encoded is not None else None if body is None else json.dumps(body).encode()
        extra = encoded[1] if encoded is not None else {}
        limit = self._deadline if deadline_s is None else min(self._deadline, deadline_s)
        deadline = time.monotonic() + limit
        retries = 0
        last: MasterError | None = None
        hops = 0
        while True:
            with self._lock:
                index = self._preferred
                url = self._urls[index]
            try:
                status, answer = self._exchange(url, method, path, payload, extra)
            except (OSError, http.client.HTTPException) as exc:
                last = MasterUnavailable(f"master {url} unreachable: {exc.__class__.__name__}: {exc}")
                self._rotate(index)
            else:
                if status < 400:
                    return answer if isinstance(answer, dict) else {}
                err = error_from_answer(status, answer)
                if not isinstance(err, MasterUnavailable):
                    raise err
                last = err
                leader = err.details.get("leader") if isinstance(err, NotLeader) else None
                if isinstance(leader, str) and leader and self._follow(leader, index):
                    hops += 1
                    if hops <= len(self._urls) + 1:
                        continue  # a hint to a different master: try it right away
                else:
                    self._rotate(index)
            retries += 1
            if retried is not None and last is not None:
                retried.append(last)
            if time.monotonic() + self._backoff.bound(retries) > deadline:
                assert last is not None
                raise MasterUnavailable(
                    f"no master answered {method} {path} within {limit:g}s "
                    f"(tried {', '.join(self.urls)}); last error: {last.message}. "
                    "Check that `shardcache master` is running and reachable."
                ) from last
            time.sleep(self._backoff.delay(retries))

    def _rotate(self, failed_index: int) -> None:
        with self._lock:
            if self._preferred == failed_index:
                self._preferred = (failed_index + 1) % len(self._urls)

    def _follow(self, leader: str, current: int) -> bool:
        """Prefer ``leader`` from now on; False if it is the master that just declined."""
        leader = leader.rstrip("/")
        with self._lock:
            if leader not in self._urls:
                try:
                    split_master_urls(leader)
                except BadRequest:
                    return False
                self._urls.append(leader)
            index = self._urls.index(leader)
            if index == current:
                return False
            self._preferred = index
            return True

    def _new_connection(self, url: str) -> http.client.HTTPConnection:
        address = _address(url)
        if address.kind == "unix":
            return UnixHTTPConnection(address.path, self._timeout)
        if address.tls:
            return http.client.HTTPSConnection(address.host, address.port, timeout=self._timeout)
        return http.client.HTTPConnection(address.host, address.port, timeout=self._timeout)

    def _exchange(
        self, url: str, method: str, path: str, payload: bytes | None, extra: Mapping[str, str] | None = None
    ) -> tuple[int, Any]:
        prefix = _address(url).base
        headers = {"User-Agent": _USER_AGENT, "Accept": "application/json", **self._auth}
        if payload is not None:
            headers["Content-Type"] = "application/json"
        headers.update(extra or {})
        status, _, raw = exchange(
            lambda: self._conns.get(url), lambda: self._conns.discard(url), method, prefix + path, body=payload, headers=headers,
            max_body=_MAX_ANSWER,
        )
        try:
            answer = jsontext.loads(raw) if raw else {}
        except ValueError:
            answer = raw.decode("utf-8", "replace")
        return status, answer


def _q(part: str) -> str:
    if not isinstance(part, str) or not part:
        raise BadRequest(f"invalid identifier {part!r}")
    return urllib.parse.quote(part, safe="")
