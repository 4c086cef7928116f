"""A DDP trainer as written for a GPU cluster: hard-coded "cuda", NCCL, DDP(device_ids=...).

It also touches the CUDA APIs such scripts use around training (streams, events, nvtx,
the memory API, a checkpoint loaded with map_location="cuda:k").  fakegpu runs it unmodified
on fake CUDA devices; ddp_cpu.py is its hand port to CPU + gloo.  Usage: ddp_gpu.py OUT_DIR
[STEPS]; writes OUT_DIR/rank<r>.pt with the losses and final parameters.
"""
import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

out_dir = sys.argv[1]
steps = int(sys.argv[2]) if len(sys.argv) > 2 else 5
local_rank = int(os.environ["LOCAL_RANK"])
torch.cuda.set_device(local_rank)
dist.init_process_group("nccl")
rank = dist.get_rank()

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Dropout(0.1),
                            torch.nn.Linear(64, 8)).cuda()
ddp = DDP(model, device_ids=[local_rank], output_device=local_rank)
opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
side = torch.cuda.Stream()
start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

torch.cuda.manual_seed(100 + rank)
losses = []
start.record()
for step in range(steps):
    torch.cuda.nvtx.range_push(f"step {step}")
    with torch.cuda.stream(side):
        x = torch.randn(16, 32, device="cuda")
        y = torch.randn(16, 8).pin_memory().to(f"cuda:{local_rank}", non_blocking=True)
    torch.cuda.current_stream().wait_stream(side)
    x.record_stream(torch.cuda.current_stream())
    loss = torch.nn.functional.mse_loss(ddp(x), y)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    torch.cuda.nvtx.range_pop()
    losses.append(loss.item())
end.record()
torch.cuda.synchronize()
assert start.elapsed_time(end) >= 0

ckpt = os.path.join(out_dir, f"ckpt{rank}.pt")
torch.save(model.state_dict(), ckpt)
model.load_state_dict(torch.load(ckpt, map_location=f"cuda:{local_rank}"))

torch.save({"losses": losses,
            "params": {k: v.detach().cpu() for k, v in model.state_dict().items()},
            "device_count": torch.cuda.device_count(),
            "current_device": torch.cuda.current_device(),
            "max_memory_allocated": torch.cuda.max_memory_allocated()},
           os.path.join(out_dir, f"rank{rank}.pt"))
dist.barrier()
dist.destroy_process_group()
