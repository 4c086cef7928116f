"""Hand port of fsdp1_gpu.py to the CPU + gloo (the reference for its numerics)."""
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

out_dir = sys.argv[1]
local_rank = int(os.environ["LOCAL_RANK"])
dist.init_process_group("gloo")
torch.manual_seed(0)
model = FSDP(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8)),
             device_id=torch.device("cpu"), use_orig_params=True)
opt = torch.optim.Adam(model.parameters(), lr=0.05)
torch.manual_seed(7 + dist.get_rank())
losses = []
for _ in range(4):
    x = torch.randn(4, 8)
    loss = model(x).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    losses.append(loss.item())
params = {k: v.detach().clone().cpu() for k, v in model.named_parameters()}
torch.save({"losses": losses, "params": params, "device_count": 0},
           os.path.join(out_dir, f"rank{dist.get_rank()}.pt"))
dist.barrier()
dist.destroy_process_group()
# The reference's results are saved; leave without interpreter teardown, where torch's gloo
# threads sometimes abort the process ("terminate called without an active exception"), which
# would fail the comparison for a reason that has nothing to do with the results.
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
