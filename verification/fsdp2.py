"""FSDP2 fully_shard workload (torchrun script): fp32, or bf16 parameters with fp32 reduction."""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # noqa: E402

import common  # noqa: E402


def main() -> None:
    args = common.parse_args(__doc__, lambda p: p.add_argument("--variant", choices=("fp32", "bf16"),
                                                               default="fp32"))
    rank, _ = common.init(args.backend)
    common.seed_model()
    model = common.MLP(hidden=32)
    mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
          if args.variant == "bf16" else MixedPrecisionPolicy())
    for layer in (model.fc1, model.fc2):
        fully_shard(layer, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    losses = common.train(model, args.steps, rank,
                          torch.bfloat16 if args.variant == "bf16" else None)
    common.save(args.out, rank, model.named_parameters(), losses)
    common.finish()


if __name__ == "__main__":
    main()
