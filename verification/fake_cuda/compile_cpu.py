"""compile_gpu.py ported by hand to the CPU: gloo, or the fakegpu backend on CPU tensors.

Usage: compile_cpu.py OUT_DIR COMPILE_BACKEND DIST_BACKEND [STEPS].
"""
import os
import sys

import torch
import torch.distributed as dist
from torch._dynamo.utils import counters
from torch.nn.parallel import DistributedDataParallel as DDP

out_dir, compile_backend = sys.argv[1], sys.argv[2]
dist_backend = sys.argv[3]
steps = int(sys.argv[4]) if len(sys.argv) > 4 else 3
local_rank = int(os.environ["LOCAL_RANK"])
dist.init_process_group(dist_backend)
rank = dist.get_rank()

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 8))
ddp = DDP(model)
compiled = torch.compile(ddp, backend=compile_backend)
opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
torch.manual_seed(1 + rank)
losses = []
for step in range(steps):
    x, y = torch.randn(16, 32), torch.randn(16, 8)
    loss = torch.nn.functional.mse_loss(compiled(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    losses.append(loss.item())
torch.save({"losses": losses, "params": {k: v.detach().cpu() for k, v in model.state_dict().items()},
            "frames_compiled": counters["frames"]["ok"]},
           os.path.join(out_dir, f"rank{rank}.pt"))
dist.destroy_process_group()
