"""The cluster tests' bed: ``bench.clusterbed``'s hosts and an origin as network namespaces on
one bridge, with a WebDataset dataset on its origin, readers on every node, and the daemons'
counters added up."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xxhash

from bench.clusterbed import Cluster, Daemon, Host, read_results
from bench.common import make_samples, pack_shards
from tests.support.waits import wait_until
from wire.rendezvous import member_id, owner

__all__ = ["BUCKET", "NODES", "ORIGIN_MBPS", "PREFIX", "Bed", "make_dataset", "origin_bytes", "owned_bytes", "run_readers",
           "wait_readers"]

BUCKET = "cluster-data"
PREFIX = "ds/"
NODES = 3
DATASET_BYTES = 24 << 20  # 24 shards of ~1 MiB: big enough to spread, small enough for 2 cores
SHARD_BYTES = 1 << 20
ORIGIN_MBPS = 400.0  # ~48 MB/s: an epoch of one node takes ~0.5 s of origin time


@dataclass
class Bed:
    """The cluster with its dataset uploaded: ``objects`` are ``{"key", "size", "xxh3_128"}`` with
    keys under the bucket (``ds/train-000000.tar``)."""

    cluster: Cluster
    objects: list[dict[str, Any]]
    workdir: Path

    @property
    def dataset_bytes(self) -> int:
        return sum(obj["size"] for obj in self.objects)

    @property
    def url(self) -> str:
        return f"s3://{BUCKET}/{PREFIX}"


def make_dataset() -> dict[str, bytes]:
    """The bed's dataset: WebDataset shards of ~1 MiB and their manifest, by key under the bucket."""
    shards = {f"{PREFIX}{name}": data for name, data, _ in pack_shards(make_samples(DATASET_BYTES, seed=17), SHARD_BYTES)}
    manifest = {"version": 1, "format": "webdataset", "shards": [
        {"key": key.removeprefix(PREFIX), "size": len(data), "xxh3_128": xxhash.xxh3_128_hexdigest(data)}
        for key, data in shards.items()]}
    return {**shards, f"{PREFIX}manifest.json": json.dumps(manifest).encode()}


def origin_bytes(daemons: list[Daemon]) -> int:
    """Bytes the cluster read from the origin: the sum of the daemons' ``origin_read_bytes``."""
    return sum(int(d.stats()["origin_read_bytes"]) for d in daemons)


def owned_bytes(bed: Bed, host: Host) -> int:
    """Bytes of the dataset ``host``'s daemon owns in the full ring (``wire.rendezvous``)."""
    members = [member_id(d.url) for d in bed.cluster.daemons]
    mine = member_id(f"http://{host.address}:8600")
    return sum(obj["size"] for obj in bed.objects if owner(members, f"{BUCKET}/{obj['key']}") == mine)


def run_readers(bed: Bed, name: str, delay_s: float = 0.0, retry_for: dict[str, float] | None = None,
                epochs: int = 1) -> dict[str, Path]:
    """A reader on every node through its own daemon, each in its own order; returns their outputs."""
    outs = {}
    for i, host in enumerate(bed.cluster.hosts):
        out = bed.workdir / f"{name}-{host.role}.jsonl"
        bed.cluster.start_reader(host, f"http://{host.address}:8600", BUCKET, bed.objects, out, epochs=epochs,
                                 delay_s=delay_s, retry_for_s=(retry_for or {}).get(host.role, 0.0), seed=i)
        outs[host.role] = out
    return outs


def wait_readers(outs: dict[str, Path], timeout: float) -> dict[str, list[dict[str, Any]]]:
    """Wait (bounded) for every reader's ``done`` line; returns each reader's object rows."""
    rows: dict[str, list[dict[str, Any]]] = {}

    def done() -> bool:
        rows.update({role: read_results(out) for role, out in outs.items()})
        return all(r and r[-1].get("done") for r in rows.values())

    try:
        wait_until(done, timeout=timeout, interval=0.1, what="every reader's done line")
    except TimeoutError:
        tails = {role: read_results(out)[-2:] for role, out in outs.items()}
        raise TimeoutError(f"readers not done after {timeout:.0f}s: {tails}") from None
    return {role: r[:-1] for role, r in rows.items()}
