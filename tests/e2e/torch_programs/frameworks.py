"""torch's own distributed frameworks as a GPU program uses them, or on CPU + gloo as their
reference (tests/e2e/test_fake_cuda_frameworks.py):

    torchrun ... frameworks.py CASES OUT cuda   (under fgpu: fake CUDA devices, NCCL)
    torchrun ... frameworks.py CASES OUT cpu    (plain torch: CPU, gloo)

CASES is a comma-separated list of
  zero      ZeroRedundancyOptimizer (AdamW) under DDP, 4 steps: losses and parameters;
  dcp       torch.distributed.checkpoint: async_save of an FSDP2 model and optimizer, load into a
            fresh one, train on: the loaded state equals the saved one, and the losses;
  jit       a torch.jit.script'ed module and a torch.compile'd one (aot_eager) under DDP: losses.
Each rank writes OUT/rankR.pt ({case: a dict of tensors and lists}) for the test to compare.
"""
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn

cases, out_dir, device_type = sys.argv[1].split(","), sys.argv[2], sys.argv[3]
dist.init_process_group("nccl" if device_type == "cuda" else "gloo")
rank, world = dist.get_rank(), dist.get_world_size()
if device_type == "cuda":
    torch.cuda.set_device(rank)
device = torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)).to(device)


def batches(n=4):
    generator = torch.Generator().manual_seed(100 + rank)
    return [(torch.randn(6, 8, generator=generator).to(device), torch.randn(6, 4, generator=generator).to(device))
            for _ in range(n)]


def train(module, optimizer, data):
    losses = []
    for x, y in data:
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(module(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def zero(result):
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    net = model()
    ddp = DDP(net, device_ids=[rank] if device_type == "cuda" else None)
    optimizer = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.AdamW, lr=0.01)
    result["losses"] = train(ddp, optimizer, batches())
    optimizer.consolidate_state_dict(to=0)
    if rank == 0:
        result["optimizer_steps"] = [float(s["step"]) for s in optimizer.state_dict()["state"].values()]
    result["params"] = [p.detach().cpu() for p in net.parameters()]


def dcp_case(result):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.fsdp import fully_shard

    def sharded():
        net = model()
        for layer in net:
            if isinstance(layer, nn.Linear):
                fully_shard(layer)
        fully_shard(net)
        return net, torch.optim.AdamW(net.parameters(), lr=0.01)

    net, optimizer = sharded()
    result["losses"] = train(net, optimizer, batches(2))
    model_sd, optim_sd = get_state_dict(net, optimizer)
    checkpoint = os.path.join(out_dir, "checkpoint")
    future = dcp.async_save({"model": model_sd, "optim": optim_sd}, checkpoint_id=checkpoint)
    future.result()
    saved = {k: v.full_tensor().cpu() for k, v in model_sd.items()}
    fresh, fresh_optimizer = sharded()
    fresh_model_sd, fresh_optim_sd = get_state_dict(fresh, fresh_optimizer)
    state = {"model": fresh_model_sd, "optim": fresh_optim_sd}
    dcp.load(state, checkpoint_id=checkpoint)
    set_state_dict(fresh, fresh_optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    loaded = {k: v.full_tensor().cpu() for k, v in get_state_dict(fresh, fresh_optimizer)[0].items()}
    result["loaded_equals_saved"] = [bool(torch.equal(saved[k], loaded[k])) for k in sorted(saved)]
    result["losses_after_load"] = train(fresh, fresh_optimizer, batches(2))


def jit(result):
    from torch.nn.parallel import DistributedDataParallel as DDP

    scripted = torch.jit.script(model())
    ddp = DDP(scripted, device_ids=[rank] if device_type == "cuda" else None)
    result["scripted_losses"] = train(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1), batches())
    compiled_net = model()
    compiled = torch.compile(DDP(compiled_net, device_ids=[rank] if device_type == "cuda" else None),
                             backend="aot_eager")
    result["compiled_losses"] = train(compiled, torch.optim.SGD(compiled_net.parameters(), lr=0.1), batches())



CASES = {"zero": zero, "dcp": dcp_case, "jit": jit}
unknown = [c for c in cases if c not in CASES]
if unknown:
    sys.exit(f"unknown case(s) {unknown}; known: {sorted(CASES)}")
results = {}
for case in cases:
    results[case] = {}
    CASES[case](results[case])

torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
dist.barrier()
dist.destroy_process_group()
