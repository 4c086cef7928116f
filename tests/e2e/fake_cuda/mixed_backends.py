"""torchrun script: "cuda:nccl,cpu:gloo" with device_id=, an object collective, an extra gloo
group for CPU tensors and get_default_backend_for_device("cuda"); writes OUT/rank<r>.json."""
import json
import os
import sys

import torch
import torch.distributed as dist

local_rank = int(os.environ["LOCAL_RANK"])
torch.cuda.set_device(local_rank)
dist.init_process_group("cuda:nccl,cpu:gloo", device_id=torch.device("cuda", local_rank))
rank, world = dist.get_rank(), dist.get_world_size()
t = torch.ones(4, device="cuda") * (rank + 1)
dist.all_reduce(t)
objects = [None] * world
dist.all_gather_object(objects, {"rank": rank})
gloo = dist.new_group(backend="gloo")
c = torch.ones(2)
dist.all_reduce(c, group=gloo)
dist.barrier()
result = {"sum": t.tolist(), "objects": objects, "gloo_sum": c.tolist(), "backend": dist.get_backend(),
          "default_for_cuda": dist.get_default_backend_for_device("cuda"),
          "gloo_backend": dist.get_backend(gloo)}
with open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w") as f:
    json.dump(result, f)
dist.destroy_process_group()
