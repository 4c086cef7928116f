"""FSDP1 (FullyShardedDataParallel, device_id=torch.cuda.current_device()) as written for GPUs;
fsdp1_cpu.py is the hand port (device_id=torch.device("cpu"), gloo).  Usage: fsdp1_gpu.py OUT_DIR."""
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

out_dir = sys.argv[1]
local_rank = int(os.environ["LOCAL_RANK"])
torch.cuda.set_device(local_rank)
dist.init_process_group("nccl")
torch.manual_seed(0)
model = FSDP(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8)),
             device_id=torch.cuda.current_device(), use_orig_params=True)
opt = torch.optim.Adam(model.parameters(), lr=0.05)
torch.manual_seed(7 + dist.get_rank())
losses = []
for _ in range(4):
    x = torch.randn(4, 8, device="cuda")
    loss = model(x).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    losses.append(loss.item())
params = {k: v.detach().clone().cpu() for k, v in model.named_parameters()}
torch.save({"losses": losses, "params": params, "device_count": torch.cuda.device_count()},
           os.path.join(out_dir, f"rank{dist.get_rank()}.pt"))
dist.barrier()
dist.destroy_process_group()
