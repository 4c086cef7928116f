"""The job ``python -m fakegpu demo`` runs on every rank (started by torchrun, under fgpu).

A small decoder-only transformer trained with FSDP2 x tensor parallel on a 2-D DeviceMesh
("dp" x "tp") of CPU ranks, over the ``fakegpu`` backend, so every collective goes through the
NCCL shim to the coordinator, which models it on the cluster topology.  The data is a
learnable pattern (each token is the previous one plus a per-sequence stride), so the loss
visibly falls within a few steps.
"""
from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.head_dim = dim // heads
        self.attn_norm = nn.LayerNorm(dim)
        self.q, self.k, self.v = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.o = nn.Linear(dim, dim)
        self.mlp_norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        h = self.attn_norm(x)
        # Under tensor parallelism q/k/v hold only this rank's heads: derive the count.
        q, k, v = (proj(h).view(b, s, -1, self.head_dim).transpose(1, 2) for proj in (self.q, self.k, self.v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(att.transpose(1, 2).reshape(b, s, -1))
        return x + self.down(F.gelu(self.up(self.mlp_norm(x))))


class TinyTransformer(nn.Module):
    def __init__(self, vocab: int, dim: int, heads: int, layers: int, seq: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(seq, dim))
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def batch(step: int, dp_rank: int, rows: int, seq: int, vocab: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(7919 * step + dp_rank)
    start = torch.randint(0, vocab, (rows, 1), generator=g)
    stride = torch.randint(1, 4, (rows, 1), generator=g)
    return (start + stride * torch.arange(seq + 1)) % vocab


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--dp", type=int, default=2)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--vocab", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--backend", default="fakegpu")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.backend == "fakegpu" and not hasattr(dist.Backend, "FAKEGPU"):
        import fakegpu.torch  # noqa: F401 - registers the backend when autoload did not
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.set_num_threads(1)
    dist.init_process_group(args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != args.dp * args.tp:
        raise SystemExit(f"demo: world size {world} != dp {args.dp} x tp {args.tp}")
    mesh = init_device_mesh("cpu", (args.dp, args.tp), mesh_dim_names=("dp", "tp"))

    torch.manual_seed(0)
    model = TinyTransformer(args.vocab, args.dim, args.heads, args.layers, args.seq)
    plan = {"q": ColwiseParallel(), "k": ColwiseParallel(), "v": ColwiseParallel(),
            "o": RowwiseParallel(), "up": ColwiseParallel(), "down": RowwiseParallel()}
    for block in model.blocks:
        parallelize_module(block, mesh["tp"], plan)
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    dp_rank = mesh["dp"].get_local_rank()
    n_params = sum(p.numel() for p in TinyTransformer(args.vocab, args.dim, args.heads, args.layers,
                                                      args.seq).parameters())
    if rank == 0:
        print(f"demo: {n_params / 1e3:.1f}k-parameter transformer, {world} ranks = "
              f"dp {args.dp} (FSDP2) x tp {args.tp} (tensor parallel), backend {args.backend}",
              flush=True)
    for step in range(1, args.steps + 1):
        started = time.perf_counter()
        tokens = batch(step, dp_rank, args.batch, args.seq, args.vocab)
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, args.vocab), tokens[:, 1:].reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss, op=dist.ReduceOp.SUM)
        mean_loss /= world
        if rank == 0:
            print(f"step {step}/{args.steps}  loss {mean_loss.item():.4f}  "
                  f"({time.perf_counter() - started:.2f} s)", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
