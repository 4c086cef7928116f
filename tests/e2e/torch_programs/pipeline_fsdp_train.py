"""A plain torch.distributed training program: 2 pipeline stages x FSDP2 over the data-parallel axis.

It knows nothing of fakegpu, so the same file runs under plain torchrun + gloo (every rank a
process) and under ``fgpu --dist-mode real_pp_fake_spmd`` (one process per stage, the
data-parallel axis fake).  The job is made SPMD-symmetric, so that what a fake world returns for
the absent ranks (every member holds what this rank holds) is exactly what they would have sent,
and the two launches must agree bit for bit:

- every data-parallel rank trains on the same batches (the gradient reduce-scatter then
  averages equal values);
- every weight, bias and input is two equal halves along each dimension (a random block tiled
  2 x 2), which training keeps: a Linear layer maps [u, u] to [Bu + Bu, Bu + Bu], and the
  gradients inherit the tiling.  FSDP2's dim-0 shards over 2 ranks are then equal, so an
  all-gather of "this rank's shard n times" is the real unsharded parameter.

    torchrun --nproc-per-node 4 pipeline_fsdp_train.py [--schedule gpipe|1f1b] [--steps N] [--pp-inner]

Prints one line ``RESULT {json}`` per process: its rank, the world size, the last stage's loss per
step, and a checksum of this rank's own parameter shards after training.
"""
from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

PIPELINE_STAGES = 2
WIDTH, BATCH, MICROBATCHES = 16, 8, 4


def tiled(block: torch.Tensor) -> torch.Tensor:
    """``block`` repeated twice along every dimension."""
    return block.repeat(*([2] * block.dim()))


def tiled_randn(*shape: int, generator: torch.Generator) -> torch.Tensor:
    return tiled(torch.randn(*(n // 2 for n in shape), generator=generator))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--schedule", choices=["gpipe", "1f1b"], default="1f1b")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--pp-inner", action="store_true",
                        help="mesh (dp, pp) instead of (pp, dp): pipeline groups of consecutive ranks")
    args = parser.parse_args()

    dist.init_process_group()   # env://, gloo on CPU
    world = dist.get_world_size()
    if args.pp_inner:
        mesh = init_device_mesh("cpu", (world // PIPELINE_STAGES, PIPELINE_STAGES), mesh_dim_names=("dp", "pp"))
    else:
        mesh = init_device_mesh("cpu", (PIPELINE_STAGES, world // PIPELINE_STAGES), mesh_dim_names=("pp", "dp"))
    stage_index = mesh.get_local_rank("pp")

    block = nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.Tanh(), nn.Linear(2 * WIDTH, WIDTH))
    weights = torch.Generator().manual_seed(100 + stage_index)   # each stage its own, equal across dp
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(tiled_randn(*p.shape, generator=weights) * 0.3)
    fully_shard(block, mesh=mesh["dp"])
    stage = PipelineStage(block, stage_index, PIPELINE_STAGES, torch.device("cpu"), group=mesh["pp"].get_group())
    schedule_class = ScheduleGPipe if args.schedule == "gpipe" else Schedule1F1B
    schedule = schedule_class(stage, n_microbatches=MICROBATCHES,
                              loss_fn=lambda out, target: (out - target).pow(2).mean())
    optimizer = torch.optim.SGD(block.parameters(), lr=0.05)

    losses = []
    for step in range(args.steps):
        data = torch.Generator().manual_seed(step)   # the same batch on every dp rank
        x = tiled_randn(BATCH, WIDTH, generator=data)
        y = torch.sin(x)
        if stage_index == 0:
            schedule.step(x)
        else:
            microbatch_losses = []
            schedule.step(target=y, losses=microbatch_losses)
            losses.append(float(torch.stack(microbatch_losses).sum()))
        optimizer.step()
        optimizer.zero_grad()

    # This rank's own parameter shards.
    checksum = float(sum(p.to_local().double().sum() for p in block.parameters()))
    result = {"rank": dist.get_rank(), "world": world, "stage": stage_index, "losses": losses,
              "shard_checksum": checksum, "env": [os.environ["WORLD_SIZE"], os.environ["RANK"]]}
    os.write(1, ("RESULT " + json.dumps(result) + "\n").encode())   # one write: ranks share the pipe
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
