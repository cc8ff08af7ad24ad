"""Checkpoints of the loader in dynamic mode: the trainer's clock and the state a checkpoint saves.

A dynamic-mode state does not hold the job's progress (the master does, for every trainer of
the job): it names a **mark** on the master, the job as its training loops had received it at the
checkpoint, and the trainer's **clock** there. Loading it on any rank of any world size rewinds
the job to the mark: the master hands out, from then on, exactly what the loops had not received
at the checkpoint (``loader/master/server/marks.py`` has the rules, ``docs/master-api.md`` the
guarantee and its bounds).

The clock counts what this trainer's loop received: batches under ``loader.torch.DataLoader``,
samples under a bare ``ShardLoader``. Lock-step data-parallel ranks share it (the same step, the
same clock on every rank). With explicit epochs it restarts at each epoch (``lap`` is the epoch),
so ranks whose epochs hold different batch counts still agree inside the next one.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from loader.errors import ConfigError

__all__ = ["Clock", "DynamicState", "STATE_KIND"]

STATE_KIND = "shardcache-dynamic"
_VERSION = 1
_LAP_SHIFT = 40  # 1e12 items a lap, 8e6 laps: the clock stays an int64 on the wire


class Clock:
    """What this trainer's loop has received: ``lap`` (the epoch, with explicit epochs; else 0)
    and ``count`` (items in the lap), as one integer (``value``) that only grows."""

    __slots__ = ("laps", "lap", "count")

    def __init__(self, laps: bool) -> None:
        self.laps = laps
        self.lap = 0
        self.count = 0

    @property
    def value(self) -> int:
        return (self.lap << _LAP_SHIFT) | self.count

    def tick(self, epoch: int | None = None) -> int:
        """One more item received (of ``epoch``, with explicit epochs); the new value."""
        self.start_lap(epoch)
        self.count += 1
        return self.value

    def start_lap(self, epoch: int | None) -> None:
        """Explicit epochs: the loop finished its epoch and the job's current one is ``epoch``:
        every rank that ended the epoch has the same clock there, however many items each got."""
        if self.laps and epoch is not None and epoch > self.lap:
            self.lap, self.count = epoch, 0

    def restore(self, value: int) -> None:
        self.lap, self.count = value >> _LAP_SHIFT, value & ((1 << _LAP_SHIFT) - 1)


@dataclass(frozen=True)
class DynamicState:
    """What ``state_dict()`` returns in dynamic mode (as a plain dict: picklable, and what
    ``torch.distributed.checkpoint`` saves)."""

    job: str
    dataset: str
    seed: int
    shuffle: bool
    shards: int
    shards_sha256: str | None
    mark: int
    clock: int
    job_created: float

    def to_dict(self) -> dict[str, Any]:
        return {"kind": STATE_KIND, "version": _VERSION, **asdict(self)}

    @classmethod
    def from_dict(cls, state: Any) -> DynamicState:
        if not isinstance(state, dict) or state.get("kind") != STATE_KIND:
            raise ConfigError(
                "not a dynamic-mode loader state: pass what state_dict() of a ShardLoader (or loader.torch.DataLoader) "
                "with job= returned"
            )
        if state.get("version") != _VERSION:
            raise ConfigError(f"a dynamic-mode loader state of version {state.get('version')!r}: this shardcache reads "
                              f"version {_VERSION}")
        try:
            return cls(
                job=str(state["job"]), dataset=str(state["dataset"]), seed=int(state["seed"]),
                shuffle=bool(state["shuffle"]), shards=int(state["shards"]),
                shards_sha256=None if state.get("shards_sha256") is None else str(state["shards_sha256"]),
                mark=int(state["mark"]), clock=int(state["clock"]), job_created=float(state["job_created"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"malformed dynamic-mode loader state ({exc.__class__.__name__}: {exc})") from exc

    def check(self, mine: DynamicState) -> None:
        """Refuse a state of another job, dataset, seed or shard list, saying what differs."""
        differs = [
            f"{name} {getattr(self, name)!r} (this loader: {getattr(mine, name)!r})"
            for name in ("job", "dataset", "seed", "shuffle", "shards", "shards_sha256")
            if getattr(self, name) != getattr(mine, name)
        ]
        if differs:
            raise ConfigError(
                "this checkpoint is of another job: its " + "; ".join(differs) + ". Resume a job with the same job "
                "name, dataset and arguments it was saved with, or start fresh without loading it"
            )
