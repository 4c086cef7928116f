"""FSDP1 FULL_SHARD workload (torchrun script)."""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, ShardingStrategy  # noqa: E402

import common  # noqa: E402


def main() -> None:
    args = common.parse_args(__doc__)
    rank, _ = common.init(args.backend)
    common.seed_model()
    model = FSDP(common.MLP(), sharding_strategy=ShardingStrategy.FULL_SHARD,
                 device_id=torch.device("cpu"), use_orig_params=False)
    losses = common.train(model, args.steps, rank)
    # The local flat-parameter shard of each rank.
    common.save(args.out, rank, model.named_parameters(), losses)
    common.finish()


if __name__ == "__main__":
    main()
