"""Hand port of ddp_gpu.py to CPU + gloo: the reference for its numerics (same seeds, same
steps; the CUDA-only calls removed, "cuda" replaced by the CPU)."""
import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

out_dir = sys.argv[1]
steps = int(sys.argv[2]) if len(sys.argv) > 2 else 5
local_rank = int(os.environ["LOCAL_RANK"])
dist.init_process_group("gloo")
rank = dist.get_rank()

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Dropout(0.1),
                            torch.nn.Linear(64, 8))
ddp = DDP(model)
opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)

torch.manual_seed(100 + rank)
losses = []
for step in range(steps):
    x = torch.randn(16, 32)
    y = torch.randn(16, 8)
    loss = torch.nn.functional.mse_loss(ddp(x), y)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    losses.append(loss.item())

ckpt = os.path.join(out_dir, f"ckpt{rank}.pt")
torch.save(model.state_dict(), ckpt)
model.load_state_dict(torch.load(ckpt))

torch.save({"losses": losses,
            "params": {k: v.detach() for k, v in model.state_dict().items()},
            "device_count": 0, "current_device": -1, "max_memory_allocated": 0},
           os.path.join(out_dir, f"rank{rank}.pt"))
dist.barrier()
dist.destroy_process_group()
# The reference's results are saved; leave without interpreter teardown, where torch's gloo
# threads sometimes abort the process ("terminate called without an active exception"), which
# would fail the comparison for a reason that has nothing to do with the results.
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
