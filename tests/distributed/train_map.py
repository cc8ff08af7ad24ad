"""What torchrun runs for the map-style test (tests/distributed/test_torchrun_map.py): each rank
reads its DistributedSampler's indices of a ShardMapDataset through loader.torch.DataLoader with
worker processes, for two epochs, and rank 0 writes every rank's (epoch, index, shard, key) it
gathered over gloo to --out."""

from __future__ import annotations

import argparse
import json

import torch.distributed as dist
import torch.utils.data

from loader.torch import DataLoader, ShardMapDataset


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    ds = ShardMapDataset(args.url, endpoint="", transform=lambda s: (s["__url__"].rsplit("/", 1)[-1], s["__key__"]))
    sampler = torch.utils.data.DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=True, seed=11)
    seen = []
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        indices = list(sampler)
        loader = DataLoader(ds, batch_size=5, sampler=sampler, num_workers=args.workers, collate_fn=lambda b: b)
        items = [item for batch in loader for item in batch]
        assert len(items) == len(indices)
        seen.extend([epoch, i, shard, key] for i, (shard, key) in zip(indices, items, strict=True))
    gathered: list[object] = [None] * world
    dist.all_gather_object(gathered, {"rank": rank, "seen": seen, "len": len(ds)})
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(gathered, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
