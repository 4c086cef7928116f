"""DDP workload (torchrun script): plain, no_sync accumulation, find_unused_parameters,
static_graph, gradient_as_bucket_view."""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

import common  # noqa: E402

VARIANTS = ("plain", "no_sync", "find_unused", "static_graph", "bucket_view")


def train(variant: str, rank: int, steps: int, out: str) -> None:
    common.seed_model()
    model = common.MLP(unused_branch=variant == "find_unused")
    ddp = DDP(model,
              find_unused_parameters=variant == "find_unused",
              static_graph=variant == "static_graph",
              gradient_as_bucket_view=variant == "bucket_view",
              bucket_cap_mb=0.0005)  # ~500 bytes: several buckets even for this tiny model
    opt = torch.optim.SGD(ddp.parameters(), lr=common.LR)
    losses = []
    for step in range(steps):
        opt.zero_grad()
        if variant == "no_sync":
            x, y = common.batch(step, rank, rows=8)
            with ddp.no_sync():  # first micro-batch: local accumulation only
                F.mse_loss(ddp(x[:4]), y[:4]).backward()
            loss = F.mse_loss(ddp(x[4:]), y[4:])
        else:
            x, y = common.batch(step, rank)
            kwargs = {"use_extra": step % 2 == 1} if variant == "find_unused" else {}
            loss = F.mse_loss(ddp(x, **kwargs), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    common.save(out, rank, model.named_parameters(), losses)


def main() -> None:
    args = common.parse_args(__doc__, lambda p: p.add_argument(
        "--variant", choices=(*VARIANTS, "all"), default="plain",
        help="'all' trains every variant in turn (one torchrun start), saving OUT/<variant>/"))
    rank, _ = common.init(args.backend)
    if args.variant == "all":
        for variant in VARIANTS:
            train(variant, rank, args.steps, os.path.join(args.out, variant))
    else:
        train(args.variant, rank, args.steps, args.out)
    common.finish()


if __name__ == "__main__":
    main()
