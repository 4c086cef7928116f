"""Pipeline-parallel workload (torchrun script): torch.distributed.pipelining with one stage
per rank, GPipe or 1F1B, 4 micro-batches."""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe  # noqa: E402

import common  # noqa: E402

MICROBATCHES = 4
WIDTH = 8


def main() -> None:
    args = common.parse_args(__doc__, lambda p: p.add_argument("--schedule", choices=("gpipe", "1f1b"),
                                                               default="gpipe"))
    rank, world = common.init(args.backend)
    common.seed_model()
    # The full model is built identically everywhere; each rank keeps its own slice.
    layers = [nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(world)]
    stage_module = layers[rank]
    stage = PipelineStage(stage_module, rank, world, torch.device("cpu"))
    schedule_cls = ScheduleGPipe if args.schedule == "gpipe" else Schedule1F1B
    schedule = schedule_cls(stage, n_microbatches=MICROBATCHES, loss_fn=F.mse_loss)
    opt = torch.optim.SGD(stage_module.parameters(), lr=common.LR)
    losses_out = []
    for step in range(args.steps):
        opt.zero_grad()
        x, y = common.batch(step, 0, rows=2 * MICROBATCHES, features=WIDTH, outputs=WIDTH)
        if rank == 0:
            schedule.step(x)
        elif rank == world - 1:
            losses: list[torch.Tensor] = []
            schedule.step(target=y, losses=losses)
            losses_out.append(float(torch.stack(losses).mean()))
        else:
            schedule.step()
        opt.step()
    common.save(args.out, rank, stage_module.named_parameters(), losses_out)
    common.finish()


if __name__ == "__main__":
    main()
