"""What a job is: its validated spec (the shard list and the settings every trainer agrees on).

A spec never changes once accepted: two creations with equal specs are the same job. Every rule
about what a spec may hold lives here; the state machine (``state.py``) only reads specs.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from loader.master.errors import BadRequest
from wire.names import ID_RULE, is_id

__all__ = ["ShardSpec", "JobSpec", "spec_diff", "validate_job_name", "check_ident", "check_int", "check_opt_int", "MAX_INT"]

MAX_INT = 2**63 - 1
_MAX_IDENT = 256
_MAX_KEY = 1024
_SPEC_FIELDS = {"name", "dataset", "shards", "epochs", "seed", "shuffle", "lease_ttl_s", "max_failures"}


def validate_job_name(name: Any) -> str:
    if not is_id(name):
        raise BadRequest(f"invalid job name {str(name)[:80]!r}: use {ID_RULE}")
    return name


def check_ident(value: Any, what: str) -> str:
    if not isinstance(value, str) or not value or len(value) > _MAX_IDENT or not value.isprintable():
        raise BadRequest(f"'{what}' must be a non-empty printable string of at most {_MAX_IDENT} characters")
    return value


def check_int(value: Any, what: str, lo: int = 0, hi: int = MAX_INT) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise BadRequest(f"'{what}' must be an integer in [{lo}, {hi}], got {str(value)[:40]!r}")
    return value


def check_opt_int(value: Any, what: str, lo: int = 0, hi: int = MAX_INT) -> int | None:
    return None if value is None else check_int(value, what, lo, hi)


# -- spec ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ShardSpec:
    key: str
    """Object key relative to the job's dataset URL."""
    size: int | None = None
    """Bytes, when known."""
    samples: int | None = None
    """Samples in the shard, when known (bounds the offsets a renew may report)."""

    def to_json(self) -> dict[str, Any]:
        return {"key": self.key, "size": self.size, "samples": self.samples}


@dataclass(frozen=True)
class JobSpec:
    """What a job is; two creations with equal specs are the same job (idempotent create)."""

    name: str
    dataset: str
    shards: tuple[ShardSpec, ...]
    epochs: int | None = None
    """Epochs to run; None runs until stopped."""
    seed: int = 0
    shuffle: bool = True
    lease_ttl_s: float = 30.0
    max_failures: int = 3

    @classmethod
    def from_json(
        cls, raw: Any, *, default_ttl_s: float = 30.0, default_max_failures: int = 3, max_shards: int = 1_000_000
    ) -> JobSpec:
        """Validate a create-job body; every problem is a :class:`BadRequest` naming the field."""
        if not isinstance(raw, dict):
            raise BadRequest("the job spec must be a JSON object")
        unknown = sorted(set(raw) - _SPEC_FIELDS)
        if unknown:
            raise BadRequest(f"unknown job spec field(s) {unknown}: expected some of {sorted(_SPEC_FIELDS)}")
        name = validate_job_name(raw.get("name"))
        dataset = raw.get("dataset")
        if not isinstance(dataset, str) or not dataset or len(dataset) > 4096 or "\x00" in dataset:
            raise BadRequest("'dataset' must be the dataset URL, e.g. s3://bucket/train/")
        shards_raw = raw.get("shards")
        if not isinstance(shards_raw, list) or not shards_raw:
            raise BadRequest("'shards' must be a non-empty list of {\"key\", \"size\", \"samples\"}")
        if len(shards_raw) > max_shards:
            raise BadRequest(f"too many shards ({len(shards_raw)}): this master accepts at most {max_shards} per job")
        shards: list[ShardSpec] = []
        seen: set[str] = set()
        for i, item in enumerate(shards_raw):
            if isinstance(item, str):
                item = {"key": item}
            if not isinstance(item, dict) or set(item) - {"key", "size", "samples"}:
                raise BadRequest(f"shards[{i}] must be an object with 'key' and optional 'size', 'samples'")
            key = item.get("key")
            if not isinstance(key, str) or not key or len(key) > _MAX_KEY or "\x00" in key:
                raise BadRequest(f"shards[{i}].key must be a non-empty string of at most {_MAX_KEY} characters")
            if key in seen:
                raise BadRequest(f"shards[{i}].key {key[:80]!r} appears twice")
            seen.add(key)
            shards.append(
                ShardSpec(key, check_opt_int(item.get("size"), f"shards[{i}].size"), check_opt_int(item.get("samples"), f"shards[{i}].samples"))
            )
        epochs = check_opt_int(raw.get("epochs"), "epochs", 1, 1_000_000_000)
        seed = check_int(raw.get("seed", 0), "seed", -MAX_INT, MAX_INT)
        shuffle = raw.get("shuffle", True)
        if not isinstance(shuffle, bool):
            raise BadRequest("'shuffle' must be true or false")
        ttl = raw.get("lease_ttl_s", default_ttl_s)
        if ttl is None:
            ttl = default_ttl_s
        if isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not math.isfinite(ttl) or not 1 <= ttl <= 86400:
            raise BadRequest("'lease_ttl_s' must be a number of seconds in [1, 86400]")
        max_failures = raw.get("max_failures", default_max_failures)
        if max_failures is None:
            max_failures = default_max_failures
        max_failures = check_int(max_failures, "max_failures", 1, 1_000_000)
        return cls(name, dataset, tuple(shards), epochs, seed, shuffle, float(ttl), max_failures)

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "dataset": self.dataset,
            "shards": [s.to_json() for s in self.shards],
            "epochs": self.epochs,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "lease_ttl_s": self.lease_ttl_s,
            "max_failures": self.max_failures,
        }

    @cached_property
    def json_text(self) -> str:
        """The spec as compact JSON, computed once: specs never change, and a large one (its
        shard list) would otherwise be re-encoded in every log record and snapshot."""
        return json.dumps(self.to_json(), separators=(",", ":"))

    def summary(self) -> dict[str, Any]:
        """The spec without its shard list (status answers stay small)."""
        out = self.to_json()
        out["shards"] = len(self.shards)
        return out

    @classmethod
    def from_log(cls, s: dict[str, Any]) -> JobSpec:
        """A spec from the journal or a snapshot: it was validated when it was accepted, so it is
        rebuilt as it was, without defaults applied again."""
        return cls(
            s["name"], s["dataset"], tuple(ShardSpec(x["key"], x["size"], x["samples"]) for x in s["shards"]),
            s["epochs"], s["seed"], s["shuffle"], float(s["lease_ttl_s"]), s["max_failures"],
        )


def spec_diff(a: JobSpec, b: JobSpec) -> list[str]:
    ja, jb = a.to_json(), b.to_json()
    return sorted(k for k in ja if ja[k] != jb[k])
