"""2-D parallelism as written for GPUs: FSDP2 over the "dp" axis and tensor parallel over the
"tp" axis of init_device_mesh("cuda", (2, 2)), then a DCP checkpoint saved and loaded back.
fsdp_tp_dcp_cpu.py is the hand port.  Usage: fsdp_tp_dcp_gpu.py OUT_DIR (4 ranks)."""
import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

out_dir = sys.argv[1]
local_rank = int(os.environ["LOCAL_RANK"])
torch.cuda.set_device(local_rank)
dist.init_process_group("nccl")
mesh = init_device_mesh("cuda", (2, 2), mesh_dim_names=("dp", "tp"))
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8)).cuda()
parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
fully_shard(model, mesh=mesh["dp"])
opt = torch.optim.AdamW(model.parameters(), lr=0.05)
torch.manual_seed(11 + mesh["dp"].get_local_rank())
losses = []
for _ in range(3):
    x = torch.randn(4, 8, device="cuda")
    loss = model(x).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    losses.append(loss.item())
ckpt = os.path.join(out_dir, "dcp")
dcp.save({"model": model.state_dict()}, checkpoint_id=ckpt)
state = {"model": model.state_dict()}
with torch.no_grad():
    for p in model.parameters():
        p.zero_()
dcp.load(state, checkpoint_id=ckpt)
model.load_state_dict(state["model"])
params = {k: v.full_tensor().cpu() for k, v in model.named_parameters()}
torch.save({"losses": losses, "params": params, "device_count": torch.cuda.device_count()},
           os.path.join(out_dir, f"rank{dist.get_rank()}.pt"))
dist.barrier()
dist.destroy_process_group()
