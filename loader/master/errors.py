"""Exceptions of the master, shared by the server (which maps them to HTTP answers) and the
trainer-side client (which maps HTTP answers back to them): one table, one place.

Every error has a stable ``code`` (the ``"error"`` field of the JSON answer) and an HTTP
``status``. Subclasses also inherit the matching builtin, so callers that only know Python's
exceptions still catch them sensibly (``except ConnectionError`` catches ``MasterUnavailable``).
The root, :class:`MasterError`, is a :class:`~loader.errors.LoaderError`: ``except LoaderError``
catches everything the loader raises. A malformed request and a body too large are
:mod:`wire.errors`' (what the daemon means by them too); the classes here are those, with the
master's root, code and status.
"""

from __future__ import annotations

from typing import Any

from loader.errors import LoaderError
from wire import errors as wire_errors

__all__ = [
    "MasterError",
    "BadRequest",
    "BodyTooLarge",
    "NoSuchJob",
    "JobConflict",
    "TooManyJobs",
    "JobInUse",
    "LeaseLost",
    "CheckpointGone",
    "ProtocolError",
    "NotLeaseHolder",
    "Unauthorized",
    "Forbidden",
    "MasterUnavailable",
    "NotLeader",
    "StateError",
    "ERRORS_BY_CODE",
    "error_from_answer",
]


class MasterError(LoaderError):
    """Root of every error raised by :mod:`loader.master`."""

    code: str = "InternalError"
    status: int = 500

    def __init__(self, message: str = "", **details: Any) -> None:
        super().__init__(message or self.__class__.__doc__ or self.code)
        self.message = message or (self.__class__.__doc__ or self.code).strip()
        self.details: dict[str, Any] = details

    def to_json(self) -> dict[str, Any]:
        return {"error": self.code, "message": self.message, **self.details}


class BadRequest(MasterError, wire_errors.BadRequest):
    """The request is malformed (bad JSON, missing or out-of-range field)."""

    code = "BadRequest"
    status = 400


class BodyTooLarge(BadRequest, wire_errors.BodyTooLarge):
    """The request body is larger than the master accepts."""

    code = "BodyTooLarge"
    status = 413


class NoSuchJob(MasterError, LookupError):
    """No job with that name exists on the master."""

    code = "NoSuchJob"
    status = 404


class JobConflict(MasterError, ValueError):
    """A job with that name exists with a different spec."""

    code = "JobConflict"
    status = 409


class TooManyJobs(MasterError):
    """The master holds as many jobs as its ``--max-jobs`` allows; joining an existing job still works."""

    code = "TooManyJobs"
    status = 409


class JobInUse(MasterError):
    """The job has live leases, so it is not deleted: wait until its trainers are done, or delete it
    with ``force`` (its trainers then get :class:`NoSuchJob`)."""

    code = "JobInUse"
    status = 409


class LeaseLost(MasterError):
    """The lease expired, was re-issued, failed or is unknown: drop the shard and lease another.

    Whatever the trainer did with the shard is counted nowhere."""

    code = "LeaseLost"
    status = 409


class CheckpointGone(MasterError, LookupError):
    """The checkpoint mark a state names is not kept by the master: too old, undone by a rewind
    to an earlier one, or never made by this job. Resume from a newer checkpoint, or restart the
    epoch (a fresh loader state)."""

    code = "CheckpointGone"
    status = 409


class ProtocolError(MasterError):
    """The master's answer does not have the protocol's shape (not a shardcache master, or a
    version that does not match this client)."""

    code = "ProtocolError"
    status = 502


class NotLeaseHolder(MasterError, PermissionError):
    """The lease is held by another trainer."""

    code = "NotLeaseHolder"
    status = 403


class MasterUnavailable(MasterError, ConnectionError):
    """No master answered (connection refused, timeouts, 5xx) within the retry budget."""

    code = "Unavailable"
    status = 503


class NotLeader(MasterUnavailable):
    """This master is a standby; ``details["leader"]`` names the leader's URL when known."""

    code = "NotLeader"
    status = 503


class StateError(MasterError, OSError):
    """The master could not make a transition durable (disk or etcd failure); nothing was changed."""

    code = "StateUnavailable"
    status = 503


class Unauthorized(MasterError, PermissionError):
    """The master requires a token (``--token-file``) and the call carried none or another one."""

    code = "Unauthorized"
    status = 401


class Forbidden(MasterError, PermissionError):
    """The job belongs to another tenant (``--tenant-tokens``): only its owner and the operator may
    see or change it."""

    code = "Forbidden"
    status = 403


ERRORS_BY_CODE: dict[str, type[MasterError]] = {
    cls.code: cls
    for cls in (
        MasterError,
        BadRequest,
        BodyTooLarge,
        NoSuchJob,
        Forbidden,
        JobConflict,
        TooManyJobs,
        JobInUse,
        LeaseLost,
        CheckpointGone,
        ProtocolError,
        NotLeaseHolder,
        Unauthorized,
        MasterUnavailable,
        NotLeader,
        StateError,
    )
}


def error_from_answer(status: int, body: Any) -> MasterError:
    """Rebuild the typed error from an HTTP error answer (used by the client)."""
    if isinstance(body, dict) and isinstance(body.get("error"), str):
        code = body["error"]
        message = str(body.get("message") or code)
        details = {k: v for k, v in body.items() if k not in ("error", "message")}
        cls = ERRORS_BY_CODE.get(code)
        if cls is None:
            cls = BadRequest if 400 <= status < 500 else MasterUnavailable if status >= 500 else MasterError
        err = cls(message, **details)
        return err
    if status == 413:
        return BodyTooLarge(f"HTTP {status}: request body too large")
    if 400 <= status < 500:
        return BadRequest(f"HTTP {status}: {str(body)[:200]}")
    return MasterUnavailable(f"HTTP {status}: {str(body)[:200]}")
