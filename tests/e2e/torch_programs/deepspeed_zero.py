"""DeepSpeed as its users launch it (torchrun, deepspeed.initialize with a torch optimizer), on
fake CUDA devices under fgpu or on CPU + gloo (DS_ACCELERATOR=cpu) as the reference
(tests/e2e/test_fake_cuda_frameworks.py):

    torchrun ... deepspeed_zero.py STAGES OUT     e.g. STAGES = 1,2,3
    torchrun ... deepspeed_zero.py fused OUT      DeepSpeed's own FusedAdam (a CUDA extension)

Each ZeRO stage trains the same model 4 steps; each rank writes OUT/rankR.pt ({stage: losses
and the gathered parameters})."""
import os
import sys

import deepspeed
import torch
import torch.nn as nn

what, out_dir = sys.argv[1], sys.argv[2]
deepspeed.init_distributed()
import torch.distributed as dist  # noqa: E402  (after DeepSpeed has made the group)

rank = dist.get_rank()


def config(stage: int, **extra) -> dict:
    return {"train_micro_batch_size_per_gpu": 6, "gradient_accumulation_steps": 1,
            "zero_optimization": {"stage": stage}, "steps_per_print": 1000, **extra}


if what == "fused":   # the optimizer from the config: DeepSpeed builds its FusedAdam
    net = nn.Linear(8, 4)
    deepspeed.initialize(model=net, model_parameters=net.parameters(),
                         config=config(1, optimizer={"type": "AdamW", "params": {"lr": 0.01}}))
    sys.exit("FusedAdam was built and loaded: not expected on fake CUDA devices")

results = {}
for stage in (int(s) for s in what.split(",")):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    engine, _, _, _ = deepspeed.initialize(model=net, optimizer=torch.optim.AdamW(net.parameters(), lr=0.01),
                                           config=config(stage))
    generator = torch.Generator().manual_seed(100 + rank)
    losses = []
    for _ in range(4):
        x = torch.randn(6, 8, generator=generator).to(engine.device)
        y = torch.randn(6, 4, generator=generator).to(engine.device)
        loss = nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    params = []
    for p in engine.module.parameters():   # ZeRO-3 holds a shard: gather the whole parameter
        with deepspeed.zero.GatheredParameters([p], enabled=stage == 3):
            params.append(p.detach().cpu().clone())
    results[stage] = {"losses": losses, "params": params, "device_type": engine.device.type
                      if isinstance(engine.device, torch.device) else torch.device(engine.device).type}
torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
dist.barrier()
