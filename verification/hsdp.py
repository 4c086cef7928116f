"""2-D HSDP workload (torchrun script, 4 ranks): fully_shard on a (replicate=2, shard=2)
DeviceMesh — reduce-scatter inside each shard group, all-reduce across replicas."""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402

import common  # noqa: E402


def main() -> None:
    args = common.parse_args(__doc__)
    rank, world = common.init(args.backend)
    if world != 4:
        raise SystemExit(f"hsdp.py needs 4 ranks, got {world}")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "dp_shard"))
    common.seed_model()
    model = common.MLP(hidden=32)
    for layer in (model.fc1, model.fc2):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    losses = common.train(model, args.steps, rank)
    common.save(args.out, rank, model.named_parameters(), losses)
    common.finish()


if __name__ == "__main__":
    main()
