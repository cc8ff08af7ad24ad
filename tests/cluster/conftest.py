"""Cluster fixtures: the test bed of ``bench.clusterbed`` (three hosts and an origin as network
namespaces on one bridge) with a WebDataset dataset on its origin (helpers:
tests/support/clusterbed.py). Root is required; without it every test here skips with the reason."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import xxhash

from bench.clusterbed import Cluster, ClusterUnavailable, check_available
from tests.support.clusterbed import BUCKET, NODES, ORIGIN_MBPS, Bed, make_dataset


@pytest.fixture(scope="session")
def dataset() -> dict[str, bytes]:
    return make_dataset()


@pytest.fixture
def bed(tmp_path: Path, dataset: dict[str, bytes]) -> Iterator[Bed]:
    try:
        check_available()
    except ClusterUnavailable as exc:
        pytest.skip(str(exc))
    cluster = Cluster(NODES, tmp_path / "bed", origin_mbps=ORIGIN_MBPS)
    with cluster:
        cluster.start_origin()
        cluster.upload(BUCKET, dataset)
        objects = [{"key": key, "size": len(data), "xxh3_128": xxhash.xxh3_128_hexdigest(data)}
                   for key, data in sorted(dataset.items()) if key.endswith(".tar")]
        yield Bed(cluster, objects, tmp_path)
    assert cluster.gone(), "the test bed left namespaces or interfaces behind"
