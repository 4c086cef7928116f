"""Shared pieces of the verification workloads (each one is a torchrun script).

Every workload: parses ``--backend`` and ``--out``, initialises the default group, trains a
tiny model for a few steps on data that depends only on (step, rank), and saves each rank's
*local* parameters (shards for FSDP / TP, the stage for PP) and its losses to
``OUT/rank<R>.pt``.  ``run_case.py`` compares those files between gloo and fakegpu.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Iterable

import torch
import torch.distributed as dist
import torch.nn as nn

STEPS = 3
LR = 0.1


def parse_args(description: str, extra=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--backend", default="fakegpu", help="torch.distributed backend (gloo or fakegpu)")
    parser.add_argument("--out", required=True, help="folder for rank<R>.pt result files")
    parser.add_argument("--steps", type=int, default=STEPS)
    if extra is not None:
        extra(parser)
    return parser.parse_args()


def init(backend: str) -> tuple[int, int]:
    if backend == "fakegpu" and "FAKEGPU" not in dist.Backend.__dict__:
        # Normally registered already (entry point or fgpu's autoload); a plain checkout needs this.
        repo = str(Path(__file__).resolve().parent.parent)
        if repo not in sys.path:
            sys.path.insert(0, repo)
        import fakegpu.torch  # noqa: F401
    torch.set_num_threads(1)  # same kernels, same summation order, on both backends
    torch.use_deterministic_algorithms(True)
    dist.init_process_group(backend)
    return dist.get_rank(), dist.get_world_size()


def seed_model(seed: int = 1234) -> None:
    torch.manual_seed(seed)


def batch(step: int, rank: int, rows: int = 4, features: int = 8, outputs: int = 4,
          dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(rows, features, generator=g).to(dtype)
    y = torch.randn(rows, outputs, generator=g).to(dtype)
    return x, y


class MLP(nn.Module):
    def __init__(self, features: int = 8, hidden: int = 16, outputs: int = 4, unused_branch: bool = False):
        super().__init__()
        self.fc1 = nn.Linear(features, hidden)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(hidden, outputs)
        # A layer that only some steps use: exercises find_unused_parameters.
        self.extra = nn.Linear(hidden, outputs) if unused_branch else None

    def forward(self, x, use_extra: bool = False):
        h = self.act(self.fc1(x))
        out = self.fc2(h)
        if self.extra is not None and use_extra:
            out = out + self.extra(h)
        return out


def train(model: nn.Module, steps: int, batch_rank: int,
          input_dtype: "torch.dtype | None" = None) -> list[float]:
    """The shared SGD loop of the sharded workloads; returns the loss of each step.

    ``batch_rank`` picks the data: the rank itself for data parallelism, 0 where every rank
    must see the same batch (tensor parallelism).
    """
    import torch.nn.functional as F

    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for step in range(steps):
        opt.zero_grad()
        x, y = batch(step, batch_rank)
        if input_dtype is not None:
            x = x.to(input_dtype)
        loss = F.mse_loss(model(x).float(), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    to_local = getattr(t, "to_local", None)
    t = to_local() if callable(to_local) else t
    return t.detach().to(torch.float32).clone()


def save(out: str, rank: int, named: Iterable[tuple[str, torch.Tensor]], losses: list[float]) -> None:
    os.makedirs(out, exist_ok=True)
    params = {name: local_tensor(p) for name, p in named}
    torch.save({"params": params, "losses": [float(v) for v in losses]}, os.path.join(out, f"rank{rank}.pt"))


def finish() -> None:
    reference = dist.get_backend() == "gloo"
    dist.barrier()
    dist.destroy_process_group()
    if reference:
        # The gloo reference's results are saved; leave without interpreter teardown, where
        # torch's gloo threads now and then abort the process ("terminate called without an
        # active exception", seen in CI on fsdp1), which would fail the comparison for a reason
        # that has nothing to do with the results.  The fakegpu side exits normally: its
        # teardown is part of what is tested.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
