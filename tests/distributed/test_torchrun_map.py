"""Map-style training under real torchrun (issue 31): two ranks, gloo, ``DistributedSampler`` over
``loader.torch.ShardMapDataset`` with DataLoader worker processes. Every index is read exactly
once per epoch across the ranks, and index ``i`` is the dataset's sample ``i``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.torchrun import TorchRun, make_dataset

SCRIPT = Path(__file__).with_name("train_map.py")

pytestmark = pytest.mark.timeout(300)


@pytest.mark.slow
def test_distributed_sampler_reads_every_index_once_per_epoch(tmp_path: Path, master: str) -> None:
    url, written = make_dataset(tmp_path, shards=5, per_shard=9)  # 45 samples: 2 ranks pad one
    out = tmp_path / "seen.json"
    with TorchRun(tmp_path, ["--url", url, "--out", str(out)], nproc=2, master=master, job="map", script=SCRIPT) as run:
        code = run.wait(timeout=240)
        assert code == 0, run.output.read_text(errors="replace")[-4000:]
    ranks = json.loads(out.read_text())
    order = [(shard, key) for shard in written.keys for key in written.order[shard]]
    assert {r["len"] for r in ranks} == {len(order)}
    for epoch in range(2):
        indices = [i for r in ranks for e, i, _, _ in r["seen"] if e == epoch]
        # Every index once; DistributedSampler repeats one to make 46 a multiple of 2 ranks.
        assert sorted(set(indices)) == list(range(len(order))) and len(indices) == len(order) + 1
        for r in ranks:
            for e, i, shard, key in r["seen"]:
                assert (shard, key) == order[i], (r["rank"], e, i)
