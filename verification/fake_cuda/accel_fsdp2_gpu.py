"""GPU-style FSDP2 trainer in PyTorch's device-agnostic style (torch.accelerator only).

Written as it would be for a GPU cluster; fakegpu runs it unmodified on fake CUDA devices.
The hand port to CPU + gloo is accel_fsdp2_cpu.py. Writes losses and final parameters to
OUT/rank<r>.pt.
"""
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

out_dir = sys.argv[1]
# "bf16": FSDP2's mixed precision (bfloat16 compute, float32 reduce-scatter), as TorchTitan runs
mixed = len(sys.argv) > 2 and sys.argv[2] == "bf16"
policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mixed \
    else MixedPrecisionPolicy()
acc = torch.accelerator.current_accelerator()
assert torch.accelerator.is_available(), "no GPUs"
local_rank = int(os.environ["LOCAL_RANK"])
torch.accelerator.set_device_index(local_rank)
device = torch.device(acc.type, local_rank)
dist.init_process_group(backend=dist.get_default_backend_for_device(device), device_id=device)
world = dist.get_world_size()
mesh = init_device_mesh(acc.type, (world,))

torch.manual_seed(0)
with torch.device(device):
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 32),
                                torch.nn.GELU(), torch.nn.Linear(32, 4))
for layer in model:
    if isinstance(layer, torch.nn.Linear):
        fully_shard(layer, mesh=mesh, mp_policy=policy)
fully_shard(model, mesh=mesh, mp_policy=policy)
opt = torch.optim.Adam(model.parameters(), lr=1e-2)
torch.manual_seed(1 + dist.get_rank())
losses = []
for step in range(4):
    x = torch.randn(8, 16, device=device)
    y = torch.randn(8, 4, device=device)
    loss = torch.nn.functional.mse_loss(model(x).float(), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    torch.accelerator.synchronize()
    losses.append(loss.detach().item())
params = {name: p.full_tensor().cpu() for name, p in model.named_parameters()}
torch.save({"losses": losses, "params": params, "device_count": torch.accelerator.device_count()},
           os.path.join(out_dir, f"rank{dist.get_rank()}.pt"))
dist.barrier()
dist.destroy_process_group()
