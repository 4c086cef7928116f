"""Pipeline parallel (torch.distributed.pipelining, one stage per rank, GPipe, 4 micro-batches)
as written for GPUs: stages on cuda:local_rank, NCCL.  pp_cpu.py is the hand port.
Usage: pp_gpu.py OUT_DIR."""
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

out_dir = sys.argv[1]
local_rank = int(os.environ["LOCAL_RANK"])
device = torch.device("cuda", local_rank)
torch.cuda.set_device(device)
dist.init_process_group("nccl", device_id=device)
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
layers = [torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh()) for _ in range(world)]
stage_module = layers[rank].to(device)
stage = PipelineStage(stage_module, rank, world, device)
schedule = ScheduleGPipe(stage, n_microbatches=4, loss_fn=F.mse_loss)
opt = torch.optim.SGD(stage_module.parameters(), lr=0.1)
torch.manual_seed(3)
losses_out = []
for step in range(3):
    opt.zero_grad()
    x, y = torch.randn(8, 8, device=device), torch.randn(8, 8, device=device)
    if rank == 0:
        schedule.step(x)
    elif rank == world - 1:
        losses = []
        schedule.step(target=y, losses=losses)
        losses_out.append(float(torch.stack(losses).mean()))
    else:
        schedule.step()
    opt.step()
params = {k: v.detach().cpu() for k, v in stage_module.named_parameters()}
torch.save({"losses": losses_out, "params": params, "device_count": torch.cuda.device_count()},
           os.path.join(out_dir, f"rank{rank}.pt"))
dist.barrier()
dist.destroy_process_group()
