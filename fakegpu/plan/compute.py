"""Modeled GPU time of one aten op: a roofline with tile and wave quantization.

    time = max(flops / (peak[dtype] * efficiency), bytes / hbm_bandwidth) + LAUNCH_S

* flops: torch's own formulas (torch.utils.flop_counter's registry: matmuls, convolutions,
  SDPA / flash / efficient / cudnn attention forward and backward, flex attention); other ops
  count 0 and are bound by memory.
* bytes: what the op reads and writes, the sum of its tensor inputs' and outputs' sizes; an op
  whose outputs all alias its inputs (a view) moves nothing and launches nothing.
* efficiency of a matmul (and of attention, a matmul chain): BASE_EFFICIENCY times the share
  of useful work in the output tiles (a partial tile computes a whole one) times the share of
  SMs busy over the waves of tiles (the last wave may be partial).
* dtype: the tensor-core rate of the inputs' dtype; float32 matmuls use the tf32 rate when
  ``allow_tf32`` (torch.backends.cuda.matmul.allow_tf32 on the GPU) and the fp32 rate otherwise.

BASE_EFFICIENCY and LAUNCH_S are starting values, to be fit on published training throughput
(issue 31's calibration), not measurements of ours.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import flop_registry

from .gpu_compute import GpuCompute

BASE_EFFICIENCY = 0.75     # of dense peak, for a matmul that fills its tiles and waves
LAUNCH_S = 4e-6            # one kernel launch, seconds
TILE = (128, 128)          # output tile of a tensor-core matmul (M, N)

_DTYPE_CLASS = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32",
                torch.float64: "fp64", torch.float8_e4m3fn: "fp8", torch.float8_e5m2: "fp8"}
_MATMULS = {"mm", "addmm", "bmm", "baddbmm", "_scaled_mm"}


@dataclass(frozen=True)
class OpCost:
    name: str
    flops: int
    bytes: int
    seconds: float
    bound: str                 # "compute", "memory" or "none" (a view: no kernel)


def _tensors(values) -> list[torch.Tensor]:
    return [v for v in tree_leaves(values) if isinstance(v, torch.Tensor)]


def op_flops(func, args, kwargs, out) -> int:
    """torch's FLOP count of ``func`` on these arguments (0 for an op it has no formula for)."""
    formula = flop_registry.get(getattr(func, "overloadpacket", func))
    return int(formula(*args, **(kwargs or {}), out_val=out)) if formula is not None else 0


def op_bytes(args, kwargs, out) -> int:
    seen, total = set(), 0
    for t in _tensors((args, kwargs)) + _tensors(out):
        if id(t) not in seen:   # a tensor passed twice (x + x) is read once
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


def matmul_efficiency(m: int, n: int, batch: int, sm_count: int) -> float:
    """BASE_EFFICIENCY x tile fill x wave fill for a (batch x) M x N output."""
    tiles_m, tiles_n = math.ceil(m / TILE[0]), math.ceil(n / TILE[1])
    tiles = batch * tiles_m * tiles_n
    if tiles == 0:
        return BASE_EFFICIENCY
    tile_fill = (m * n) / (tiles_m * TILE[0] * tiles_n * TILE[1])
    waves = math.ceil(tiles / sm_count)
    wave_fill = tiles / (waves * sm_count)
    return BASE_EFFICIENCY * tile_fill * wave_fill


def _output_shape(name: str, args, out) -> Optional[tuple[int, int, int]]:
    """(M, N, batch) of a matmul's output."""
    result = out if isinstance(out, torch.Tensor) else (_tensors(out) or [None])[0]
    if result is None or result.dim() < 2:
        return None
    batch = math.prod(result.shape[:-2]) if result.dim() > 2 else 1
    return result.shape[-2], result.shape[-1], batch


def dtype_class(args, allow_tf32: bool) -> str:
    floats = [t.dtype for t in _tensors(args) if t.is_floating_point()]
    cls = _DTYPE_CLASS.get(floats[0], "fp32") if floats else "fp32"
    return "tf32" if cls == "fp32" and allow_tf32 else cls


def op_cost(func, args, kwargs, out, gpu: GpuCompute, allow_tf32: bool = True,
            views: bool = False) -> OpCost:
    """The modeled cost of one op; ``views``: its outputs all alias inputs (no kernel)."""
    name = str(getattr(func, "overloadpacket", func)).replace("aten.", "")
    if views:
        return OpCost(name, 0, 0, 0.0, "none")
    flops = op_flops(func, args, kwargs, out)
    nbytes = op_bytes(args, kwargs, out)
    memory_s = nbytes / (gpu.hbm_gbs * 1e9)
    compute_s = 0.0
    if flops:
        cls = dtype_class(args, allow_tf32)
        peak = gpu.peak(cls) or gpu.peak("fp32")
        efficiency = BASE_EFFICIENCY
        shape = _output_shape(name, args, out) if name in _MATMULS else None
        if shape is not None:
            efficiency = matmul_efficiency(shape[0], shape[1], shape[2], gpu.sm_count)
        compute_s = flops / (peak * efficiency)
    bound = "compute" if compute_s >= memory_s and flops else "memory"
    return OpCost(name, flops, nbytes, max(compute_s, memory_s) + LAUNCH_S, bound)


def total_seconds(costs: Sequence[OpCost]) -> float:
    return sum(c.seconds for c in costs)
