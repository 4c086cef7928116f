"""FSDP2 training with its forward and backward in a CUDA graph, as TorchTitan captures them
(warm-up step eager, then capture once and replay each step; optimizer outside the graph,
gradients zeroed in place), against the same training run eagerly in the same process.  The
graph holds FSDP's all-gathers and reduce-scatters (the backend's calls) and a functional
all-reduce (a dispatcher op).  Writes OUT_DIR/rank<r>.json (argv[1]): the ranks share one
stdout, where their lines can interleave."""
import os, sys, torch, torch.distributed as dist, json
from torch.distributed.fsdp import fully_shard
import torch.distributed._functional_collectives as funcol
dist.init_process_group("nccl")
rank = dist.get_rank(); torch.cuda.set_device(rank)
def build():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8), torch.nn.GELU(), torch.nn.Linear(8, 1)).cuda()
    for layer in m:
        if isinstance(layer, torch.nn.Linear): fully_shard(layer)
    fully_shard(m)
    return m, torch.optim.AdamW(m.parameters(), lr=0.01)
torch.manual_seed(1 + rank)
data = [(torch.randn(4, 8, device="cuda"), torch.randn(4, 1, device="cuda")) for _ in range(5)]
def fwd_bwd(m, x, y):
    loss = torch.nn.functional.mse_loss(m(x), y)
    loss.backward()
    # The mean loss over ranks, by a functional collective (wait_tensor follows it).
    return funcol.all_reduce(loss.detach(), "avg", dist.group.WORLD).wait()
def train(graphed):
    m, opt = build()
    sx, sy = torch.zeros(4, 8, device="cuda"), torch.zeros(4, 1, device="cuda")
    g = None; out = None; losses = []; norms = []
    for i, (x, y) in enumerate(data):
        opt.zero_grad(set_to_none=not graphed)
        if not graphed or i == 0:
            loss = fwd_bwd(m, x, y)
        else:
            if g is None:
                sx.copy_(x); sy.copy_(y)
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    out = fwd_bwd(m, sx, sy)
            sx.copy_(x); sy.copy_(y)
            g.replay(); loss = out
        norms.append(float(torch.nn.utils.clip_grad_norm_(m.parameters(), 100.0).full_tensor()))
        opt.step()
        losses.append(float(loss))
    return losses, norms
e = train(False); gr = train(True)
with open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w") as f:
    json.dump({"rank": rank, "eager": e, "graph": gr, "equal": e == gr}, f)
dist.destroy_process_group()
