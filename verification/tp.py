"""Tensor-parallel workload (torchrun script): parallelize_module with colwise / rowwise
linears on a 1-D DeviceMesh named "tp"."""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module  # noqa: E402

import common  # noqa: E402


def main() -> None:
    args = common.parse_args(__doc__)
    rank, world = common.init(args.backend)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    common.seed_model()
    model = common.MLP(hidden=16)
    parallelize_module(model, mesh, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    losses = common.train(model, args.steps, 0)  # TP: every rank sees the same batch
    common.save(args.out, rank, model.named_parameters(), losses)
    common.finish()


if __name__ == "__main__":
    main()
