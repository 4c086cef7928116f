"""torch.compile of a DDP model, as written for a GPU cluster ("cuda", NCCL, device_ids).

Usage: compile_gpu.py OUT_DIR COMPILE_BACKEND [STEPS]; writes OUT_DIR/rank<r>.pt with the
losses, the final parameters and how many frames dynamo compiled.  compile_cpu.py is its hand
port to the CPU (gloo, or the fakegpu backend on CPU tensors).
"""
import os
import sys

import torch
import torch.distributed as dist
from torch._dynamo.utils import counters
from torch.nn.parallel import DistributedDataParallel as DDP

out_dir, compile_backend = sys.argv[1], sys.argv[2]
steps = int(sys.argv[3]) if len(sys.argv) > 3 else 3
local_rank = int(os.environ["LOCAL_RANK"])
torch.cuda.set_device(local_rank)
dist.init_process_group("nccl")
rank = dist.get_rank()

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 8)).cuda()
ddp = DDP(model, device_ids=[local_rank])
compiled = torch.compile(ddp, backend=compile_backend)
opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
torch.manual_seed(1 + rank)
losses = []
for step in range(steps):
    x, y = torch.randn(16, 32, device="cuda"), torch.randn(16, 8, device="cuda")
    loss = torch.nn.functional.mse_loss(compiled(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    losses.append(loss.item())
torch.save({"losses": losses, "params": {k: v.detach().cpu() for k, v in model.state_dict().items()},
            "frames_compiled": counters["frames"]["ok"]},
           os.path.join(out_dir, f"rank{rank}.pt"))
dist.destroy_process_group()
