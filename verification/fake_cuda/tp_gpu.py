"""Tensor parallel (parallelize_module, colwise + rowwise) on init_device_mesh("cuda"), as
written for GPUs; tp_cpu.py is the hand port to a CPU mesh + gloo.  Usage: tp_gpu.py OUT_DIR."""
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

out_dir = sys.argv[1]
local_rank = int(os.environ["LOCAL_RANK"])
torch.cuda.set_device(local_rank)
mesh = init_device_mesh("cuda", (int(os.environ["WORLD_SIZE"]),))
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8)).cuda()
parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
opt = torch.optim.SGD(model.parameters(), lr=0.1)
torch.manual_seed(5)
losses = []
for _ in range(4):
    x = torch.randn(4, 8, device="cuda")
    loss = model(x).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    losses.append(loss.item())
params = {k: v.full_tensor().cpu() for k, v in model.named_parameters()}
torch.save({"losses": losses, "params": params, "device_count": torch.cuda.device_count()},
           os.path.join(out_dir, f"rank{dist.get_rank()}.pt"))
dist.barrier()
dist.destroy_process_group()
