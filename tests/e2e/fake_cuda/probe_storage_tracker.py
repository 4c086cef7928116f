"""Memory accounting of fake CUDA devices through whichever tracker is active (the C++ one or
the Python mode, FAKEGPU_FAKE_CUDA_MEMORY=python): one JSON object of the figures at each
point, so that a test can run it both ways and compare."""
import functools
import json
import threading

import torch
import torch.nn as nn
import torch.nn.functional as F

from fakegpu.fake_cuda import runtime

out = {"native": runtime.state().memory.native is not None}


def figures(tag):
    out[tag] = [[torch.cuda.memory_allocated(d), torch.cuda.max_memory_allocated(d),
                 torch.cuda.memory_reserved(d)] for d in range(torch.cuda.device_count())]


# -- a training step on cuda:1 (not the current device), with autocast and attention
torch.manual_seed(0)
torch.cuda.set_device(0)
dev = torch.device("cuda", 1)
model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.LayerNorm(256), nn.Linear(256, 64)).to(dev)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
figures("model")
x = torch.randn(32, 64, device=dev)
for _ in range(2):
    with torch.autocast("cuda", dtype=torch.bfloat16):
        h = model(x).view(32, 4, 16).unsqueeze(0)
        loss = F.scaled_dot_product_attention(h, h, h, is_causal=True).float().pow(2).mean()
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
figures("step")
out["loss"] = float(loss)
del loss, h
figures("after_del")

# -- a storage freed and re-grown (FSDP's unsharded parameters)
flat = torch.empty(1 << 20, device=dev)
figures("flat")
flat.untyped_storage().resize_(0)
figures("flat_freed")
flat.untyped_storage().resize_(4 << 20)
figures("flat_regrown")
del flat

# -- a cuda device reaching aten below the Python API, and pin_memory
with torch._C.DisableTorchFunction():
    below = torch.empty(1000, device="cuda:1")
figures("below_api")
out["below_api_device"] = str(below.device)
del below

# -- CPU tensors stay off the devices
cpu = torch.randn(1 << 18)
cpu2 = cpu * 2
figures("cpu_only")
del cpu, cpu2

# -- a thread the program starts
def in_thread(box):
    box.append(torch.ones(1 << 16, device=dev) + 1)

box = []
worker = threading.Thread(target=in_thread, args=(box,))
worker.start()
worker.join()
figures("thread")
box.clear()
figures("thread_freed")

# -- a higher-order operator (checkpointing's wrapper) on fake-device tensors
from torch.utils.checkpoint import checkpoint  # noqa: E402

w = torch.randn(64, 64, device=dev, requires_grad=True)
checkpoint(lambda a: (a @ w).relu().sum(), torch.randn(8, 64, device=dev), use_reentrant=False).backward()
out["checkpoint_grad_sum"] = float(w.grad.sum())
del w
figures("checkpoint")

# -- a wrapper subclass (as DTensor is): its dispatch hides its inner ops from both trackers,
# so its memory shows in its inner tensors, as the op's inputs and outputs
from torch.testing._internal.two_tensor import TwoTensor  # noqa: E402

pair = TwoTensor(torch.randn(1024, device=dev), torch.randn(1024, device=dev))
figures("subclass_made")
pair_out = torch.zeros_like(pair) + pair * 2
figures("subclass_ops")
out["subclass_sum"] = float(pair_out.a.sum() + pair_out.b.sum())
del pair_out
figures("subclass_freed")
del pair

# -- a foreach op over a list of subclasses: every result is charged, and the device is taken
# from the first argument alone (each subclass the tracker asks about is one Python callback)
from fakegpu.fake_cuda import memory as fake_memory  # noqa: E402

pairs = [TwoTensor(torch.randn(256, device=dev), torch.randn(256, device=dev)) for _ in range(8)]
figures("foreach_made")
walks = [0]
walk_storages = fake_memory._storages


def counting_walk(value, found):
    walks[0] += type(value) is TwoTensor
    walk_storages(value, found)


fake_memory._storages = counting_walk
pairs_out = torch._foreach_add(pairs, 1.0)
fake_memory._storages = walk_storages
if out["native"]:  # the Python mode walks every argument itself
    out["foreach_subclass_walks"] = walks[0]
figures("foreach_ops")
del pairs, pairs_out

# -- out of memory: the allocator's message, raised from the op
torch.cuda.set_per_process_memory_fraction(0.001, 1)
try:
    torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    out["oom"] = None
except torch.OutOfMemoryError as exc:
    out["oom"] = str(exc).split(".")[0] + "|" + ("memory fraction" in str(exc)) * "fraction"
torch.cuda.set_per_process_memory_fraction(1.0, 1)
figures("after_oom")
print(json.dumps(out))
