"""Modeled GPU time of one aten op: a roofline with tile and wave quantization.

    time = max(flops / (peak[math] * efficiency), bytes / (hbm_bandwidth * HBM_EFFICIENCY)) + LAUNCH_S

Two steps, so that one capture can be costed on any GPU (a sweep over profiles re-runs
nothing): :func:`describe_op` turns an op call into an :class:`OpRecord` (what it is, its
shapes and dtypes, FLOPs, bytes, matmul / attention geometry), :func:`model_op` gives a record
its :class:`OpCost` on one GPU.  :func:`op_cost` does both.

* flops: torch's own formulas (``torch.utils.flop_counter.flop_registry``: matmuls,
  convolutions, SDPA / flash / efficient / cudnn attention forward and backward, flex
  attention); the CPU build's flash attention (what ``scaled_dot_product_attention`` runs on
  fake CPU tensors) is counted and modeled as the GPU's.  torch has no formula for the grouped
  matmuls of mixture-of-experts layers (``_grouped_mm``, ``_scaled_grouped_mm``): each output
  element of a group is a K-long dot product, 2 x K FLOPs (:func:`grouped_mm_flops`).  Other ops
  count 0 FLOPs and are bound by memory.
* bytes: the op's distinct tensor inputs plus its distinct tensor outputs (an in-place op
  reads and writes its tensor).  A view (outputs that only alias inputs), an allocation
  (``empty``) and a metadata query move nothing and launch no kernel.
* math kind: the operands' dtype (bf16, fp16, fp8, fp32, fp64).  A float32 matmul runs on the
  TF32 tensor cores when ``allow_tf32`` (by default the value of
  ``torch.backends.cuda.matmul.allow_tf32`` when the op ran; ``torch.backends.cudnn.allow_tf32``
  for convolutions), else at the FP32 rate.  FP8 on a GPU without FP8 tensor cores is costed
  at its BF16 rate and says so in ``OpCost.note``.
* efficiency of a matmul: ``BASE_EFFICIENCY`` x tile fill (a partial ``TILE`` of the output
  computes a whole one) x wave fill (tiles are spread over the SMs in waves; a last partial
  wave takes as long as a full one).
* a grouped matmul is costed as ``groups`` matmuls of one group's share: its rows (or, grouped
  along K, its reduction) split evenly over the groups, as a balanced router gives them
  (the offsets' values are not known on fake tensors).
* efficiency of attention (flash-style kernels: one block of ``ATTENTION_BLOCK`` query rows
  per thread block forward, one block of key rows backward, over batch x heads):
  ``ATTENTION_FWD_EFFICIENCY`` or ``ATTENTION_BWD_EFFICIENCY`` x block fill x wave fill.  A
  causal kernel skips the blocks above the diagonal, so it does ``(n + 1) / (2 n)`` of the work
  torch's formula counts (n blocks per side); the record keeps torch's count.
* communication ops (c10d functional collectives) are recorded with no compute cost: the
  timeline times them with fakegpu's communication cost model.

The efficiency constants and LAUNCH_S are starting values, to be fit on published training
throughput (issue 31's calibration); docs/planning.md says where each comes from.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import flop_registry

from .gpu_compute import GpuCompute, compute_of

LAUNCH_S = 4e-6                    # one kernel launch, seconds
BASE_EFFICIENCY = 0.75             # of dense peak, a matmul that fills its tiles and waves
TILE = (128, 128)                  # output tile of a tensor-core matmul (rows, columns)
ATTENTION_FWD_EFFICIENCY = 0.37    # flash attention forward filling its blocks and waves
ATTENTION_BWD_EFFICIENCY = 0.30    # flash attention backward
ATTENTION_BLOCK = 128              # query rows (forward) / key rows (backward) per thread block
CONV_EFFICIENCY = BASE_EFFICIENCY  # convolutions: no tile model yet
# FP8 GEMMs reach a smaller share of their (doubled) peak than BF16 ones: cuBLAS's H100 FP8
# GEMMs sustain ~1,300-1,450 of 1,979 TFLOP/s where BF16 sustains ~700-750 of 989.
FP8_EFFICIENCY_SCALE = 0.9
HBM_EFFICIENCY = 0.8               # share of the data-sheet bandwidth a memory-bound kernel reaches

aten = torch.ops.aten

_DTYPE_KIND = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float64: "fp64"}
for _name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"):
    if hasattr(torch, _name):
        _DTYPE_KIND[getattr(torch, _name)] = "fp8"

# (operand a, operand b) positions of each matmul; M x K times K x N, batched for bmm
_MATMUL_OPERANDS = {"mm": (0, 1), "addmm": (1, 2), "bmm": (0, 1), "baddbmm": (1, 2), "_scaled_mm": (0, 1)}
_MATMULS = set(_MATMUL_OPERANDS)
# mixture-of-experts grouped matmuls: (M x K) x (G x K x N), (G x M x K) x (G x K x N), (G x M x K)
# x (K x N·G) and, grouped along K (the weight gradient), (M x K·G) x (K·G x N) -> G x M x N
GROUPED_MATMULS = {"_grouped_mm", "_scaled_grouped_mm"}
_CONVOLUTIONS = {"convolution", "_convolution", "convolution_backward", "convolution_overrideable",
                 "cudnn_convolution", "_slow_conv2d_forward"}
# The CPU build's kernels for the same computation as a GPU op with a FLOP formula.
_SAME_AS = {"_scaled_dot_product_flash_attention_for_cpu":
                aten._scaled_dot_product_flash_attention,
            "_scaled_dot_product_flash_attention_for_cpu_backward":
                aten._scaled_dot_product_flash_attention_backward}
# Ops that allocate, reinterpret or answer a question without running a kernel
# (_unsafe_view: a view whose schema does not say so, as matmul's reshape of an mm output).
_NO_KERNEL = {"_unsafe_view", "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "empty_permuted",
              "resize_", "set_", "lift_fresh", "sym_size", "sym_stride", "sym_numel", "sym_storage_offset",
              "is_contiguous", "is_strides_like_format", "is_non_overlapping_and_dense", "size", "stride",
              "storage_offset", "numel", "dim", "record_stream"}
_COMMUNICATION_NAMESPACES = {"_c10d_functional", "_c10d_functional_autograd", "c10d_functional", "c10d"}


@dataclass(frozen=True)
class OpRecord:
    """One aten op as captured: enough to cost it on any GPU."""
    op: str                        # the overload, e.g. "aten.mm.default"
    name: str                      # its packet without the namespace, e.g. "mm"
    # matmul | attention | conv | flops (another op with a FLOP formula) | memory | view |
    # no_kernel | communication
    kind: str
    input_shapes: tuple
    input_dtypes: tuple
    output_shapes: tuple
    output_dtypes: tuple
    flops: int                     # torch's formula (0 where it has none)
    bytes: int                     # distinct inputs + distinct outputs
    math: Optional[str] = None     # fp64 | fp32 | bf16 | fp16 | fp8, for ops with FLOPs
    tf32_allowed: bool = False     # the backend's allow_tf32 flag when the op ran
    matmul: Optional[tuple] = None     # (batch, m, n, k) of the output batch x M x N
    attention: Optional[tuple] = None  # (batch x heads, query len, key len, causal, backward)
    # Share of torch's FLOP count the kernel does where a block mask says (flex attention's
    # sparsity: a causal mask computes about half); None: the causal rule above applies.
    work_fraction: Optional[float] = None
    # Filled by the recorder for the timeline: buffers read and written as (key, bytes), the
    # collective a communication op runs (fakegpu.plan.collectives.Collective), the phase of the
    # training step ("forward", "backward", "optimizer", ...) and the step's index.
    reads: tuple = ()
    writes: tuple = ()
    collective: Optional[object] = None
    phase: str = ""
    step: int = 0
    # run by activation checkpointing's recomputation of a forward inside the backward
    recomputed: bool = False
    # buffers this op leaves in float8 for the Float8 linears that read them (a tensor-parallel
    # all-gather in float8: fakegpu.plan.options.float8_tensor_parallel_gathers)
    float8_buffers: tuple = ()

    def to_dict(self) -> dict:
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in self.__dict__.items()
                if k not in ("reads", "writes", "collective", "float8_buffers")}


@dataclass(frozen=True)
class OpCost:
    name: str
    kind: str
    flops: int
    bytes: int
    seconds: float             # max(compute_seconds, memory_seconds) + launch; 0 without a kernel
    compute_seconds: float
    memory_seconds: float
    efficiency: float          # of the peak used, for ops with FLOPs
    peak_kind: Optional[str]   # the peak used: fp64 | fp32 | tf32 | bf16 | fp16 | fp8
    bound: str                 # "compute", "memory" or "none" (no kernel, or timed elsewhere)
    note: str = ""


def _tensors(values) -> list:
    return [v for v in tree_leaves(values) if isinstance(v, torch.Tensor)]


def _distinct_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        if id(t) not in seen:          # x + x reads x once
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


def _packet_name(func) -> str:
    packet = getattr(func, "overloadpacket", func)
    return getattr(packet, "__name__", str(packet)).split(".")[-1]


def _named_args(func, args, kwargs) -> dict:
    schema = getattr(func, "_schema", None)
    if schema is None:
        return {}
    named = {}
    for i, a in enumerate(schema.arguments):
        if i < len(args) and not a.kwarg_only:
            named[a.name] = args[i]
        elif a.name in kwargs:
            named[a.name] = kwargs[a.name]
        elif a.has_default_value():
            named[a.name] = a.default_value
    return named


def _aliases_only(func) -> bool:
    schema = getattr(func, "_schema", None)
    returns = schema.returns if schema is not None else ()
    return bool(returns) and all(r.alias_info is not None and not r.alias_info.is_write for r in returns)


def _mutated_tensors(func, args, kwargs) -> list:
    """The tensors an op writes in place (for ops that return nothing, e.g. _foreach_add_)."""
    schema = getattr(func, "_schema", None)
    if schema is None:
        return []
    named = _named_args(func, args, kwargs)
    return _tensors([named.get(a.name) for a in schema.arguments
                     if a.alias_info is not None and a.alias_info.is_write])


def _grouped_split(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> tuple[int, str]:
    """(groups, which side the groups split) of a grouped matmul: "rows" of a 2-D first operand,
    "batch" when both are 3-D, "columns" of a 2-D second operand, "k" when both are 2-D."""
    if a.dim() == 2 and b.dim() == 3:
        return int(b.shape[0]), "rows"
    if a.dim() == 3 and b.dim() == 3:
        return int(a.shape[0]), "batch"
    if a.dim() == 3 and b.dim() == 2:
        return int(a.shape[0]), "columns"
    return (int(out.shape[0]) if out.dim() == 3 else 1), "k"


def grouped_mm_flops(a, b, *args, out_val=None, **kwargs) -> int:
    """FLOPs of ``_grouped_mm`` / ``_scaled_grouped_mm``: 2 x K per output element of a group
    (grouped along K, each group's output sums over its share of K only)."""
    groups, split = _grouped_split(a, b, out_val)
    k = int(a.shape[-1])
    return 2 * int(out_val.numel()) * (k // max(1, groups) if split == "k" else k)


def flop_formula(func):
    """torch's FLOP formula for ``func`` (the GPU op's for a CPU kernel of the same math), or None."""
    packet = getattr(func, "overloadpacket", func)
    formula = flop_registry.get(packet)
    if formula is None and _packet_name(func) in GROUPED_MATMULS:
        formula = grouped_mm_flops
    if formula is None and _packet_name(func) in _SAME_AS:
        formula = flop_registry.get(_SAME_AS[_packet_name(func)])
    return formula


def op_flops(func, args, kwargs, out) -> int:
    """torch's FLOP count of ``func`` on these arguments (0 for an op it has no formula for)."""
    formula = flop_formula(func)
    return int(formula(*args, **(kwargs or {}), out_val=out)) if formula is not None else 0


def _math_kind(tensor) -> str:
    return _DTYPE_KIND.get(tensor.dtype, "fp32") if tensor is not None else "fp32"


def _matmul_geometry(name, args, out) -> tuple[Optional[tuple], Optional[torch.Tensor]]:
    ia, _ = _MATMUL_OPERANDS[name]
    a = args[ia] if len(args) > ia and isinstance(args[ia], torch.Tensor) else None
    result = out if isinstance(out, torch.Tensor) else (_tensors(out) or [None])[0]
    if a is None or result is None or result.dim() < 2:
        return None, a
    batch = math.prod(result.shape[:-2]) if result.dim() > 2 else 1
    return (int(batch), int(result.shape[-2]), int(result.shape[-1]), int(a.shape[-1])), a


def _grouped_matmul_geometry(args, out) -> tuple[Optional[tuple], Optional[torch.Tensor]]:
    """(groups, rows, columns, K) of one group's matmul, the groups' share split evenly."""
    a, b = (args[0], args[1]) if len(args) > 1 else (None, None)
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor) or not isinstance(out, torch.Tensor):
        return None, a if isinstance(a, torch.Tensor) else None
    groups, split = _grouped_split(a, b, out)
    g = max(1, groups)
    m, n, k = int(out.shape[-2]), int(out.shape[-1]), int(a.shape[-1])
    if split == "rows":
        m = math.ceil(m / g)
    elif split == "columns":
        n = math.ceil(n / g)
    elif split == "k":
        k = math.ceil(k / g)
    return (g, m, n, k), a


def _attention_geometry(name, named) -> tuple[Optional[tuple], Optional[torch.Tensor]]:
    q, k = named.get("query"), named.get("key")
    if not isinstance(q, torch.Tensor) or not isinstance(k, torch.Tensor) or q.dim() != 4:
        return None, q if isinstance(q, torch.Tensor) else None
    if name.startswith("_scaled_dot_product"):      # (batch, heads, seq, head dim)
        bh, sq, sk = q.shape[0] * q.shape[1], q.shape[2], k.shape[2]
    else:                                           # _flash / _efficient: (batch, seq, heads, head dim)
        bh, sq, sk = q.shape[0] * q.shape[2], q.shape[1], k.shape[1]
    causal = bool(named.get("is_causal", False)) or bool(named.get("custom_mask_type", 0))
    return (int(bh), int(sq), int(sk), causal, "backward" in name), q


def _block_mask_density(args) -> Optional[float]:
    """Share of (query block, key block) pairs a flex attention block mask computes: its
    partial and full block counts over all pairs.  None when the mask's tensors are fake (their
    values are unknown) or absent."""
    from torch._subclasses.fake_tensor import FakeTensor

    for value in args:
        if not isinstance(value, tuple):
            continue
        tensors = [t for t in value if isinstance(t, torch.Tensor)]
        if len(tensors) < 4 or any(isinstance(t, FakeTensor) for t in tensors[:4]):
            continue
        kv_num, kv_indices, full_num = tensors[0], tensors[1], tensors[2]
        pairs = kv_num.numel() * kv_indices.shape[-1]
        if pairs == 0 or kv_num.dtype not in (torch.int32, torch.int64):
            continue
        from torch.utils._python_dispatch import _disable_current_modes

        with _disable_current_modes():    # real counts, outside the fake and recording modes
            computed = int(kv_num.sum()) + (int(full_num.sum()) if full_num.shape == kv_num.shape else 0)
        return min(1.0, computed / pairs)
    return None


def _flex_geometry(name, args) -> tuple[Optional[tuple], Optional[torch.Tensor], Optional[float]]:
    """Flex attention (higher-order op): q, k in (batch, heads, seq, head dim) first."""
    q, k = (args[0], args[1]) if len(args) > 1 else (None, None)
    if not isinstance(q, torch.Tensor) or not isinstance(k, torch.Tensor) or q.dim() != 4:
        return None, None, None
    geometry = (int(q.shape[0] * q.shape[1]), int(q.shape[2]), int(k.shape[2]), False, "backward" in name)
    return geometry, q, _block_mask_density(args)


def describe_op(func, args, kwargs, out) -> OpRecord:
    """What an op call is, in the terms the model costs it by."""
    kwargs = kwargs or {}
    name = _packet_name(func)
    inputs = _tensors((args, {k: v for k, v in kwargs.items() if k != "out"}))
    outputs = _tensors(out) or _mutated_tensors(func, args, kwargs)
    shapes = (tuple(tuple(int(d) for d in t.shape) for t in inputs), tuple(str(t.dtype) for t in inputs),
              tuple(tuple(int(d) for d in t.shape) for t in outputs), tuple(str(t.dtype) for t in outputs))
    namespace = getattr(func, "namespace", "aten")
    if namespace in _COMMUNICATION_NAMESPACES:
        return OpRecord(str(func), name, "communication", *shapes, 0, _distinct_bytes(outputs))
    if (namespace == "prim" or name in _NO_KERNEL or not outputs) and not flop_formula(func):
        return OpRecord(str(func), name, "no_kernel", *shapes, 0, 0)
    if _aliases_only(func):
        return OpRecord(str(func), name, "view", *shapes, 0, 0)
    nbytes = _distinct_bytes(inputs) + _distinct_bytes(outputs)
    flops = op_flops(func, args, kwargs, out)
    if not flops:
        return OpRecord(str(func), name, "memory", *shapes, 0, nbytes)
    if name in _MATMULS or name in GROUPED_MATMULS:
        geometry, operand = (_grouped_matmul_geometry(args, out) if name in GROUPED_MATMULS
                             else _matmul_geometry(name, args, out))
        return OpRecord(str(func), name, "matmul", *shapes, flops, nbytes, _math_kind(operand),
                        bool(torch.backends.cuda.matmul.allow_tf32), matmul=geometry)
    if name in _CONVOLUTIONS:
        operand = inputs[1] if len(inputs) > 1 else inputs[0]
        return OpRecord(str(func), name, "conv", *shapes, flops, nbytes, _math_kind(operand),
                        bool(torch.backends.cudnn.allow_tf32))
    if "attention" in name:
        if name.startswith("flex_attention"):
            geometry, query, fraction = _flex_geometry(name, args)
        else:
            (geometry, query), fraction = _attention_geometry(name, _named_args(func, args, kwargs)), None
        return OpRecord(str(func), name, "attention", *shapes, flops, nbytes,
                        _math_kind(query if query is not None else inputs[0]), attention=geometry,
                        work_fraction=fraction)
    floats = [t for t in inputs if t.is_floating_point()]
    return OpRecord(str(func), name, "flops", *shapes, flops, nbytes, _math_kind(floats[0] if floats else None),
                    bool(torch.backends.cuda.matmul.allow_tf32))


def _fill(used: int, block: int) -> float:
    """Share of ceil(used / block) blocks that holds work."""
    return used / (math.ceil(used / block) * block) if used else 1.0


def wave_fill(blocks: int, sm_count: int) -> float:
    """Share of SM slots busy when ``blocks`` thread blocks run in waves of ``sm_count``."""
    if blocks <= 0:
        return 1.0
    return blocks / (math.ceil(blocks / sm_count) * sm_count)


def matmul_efficiency(m: int, n: int, batch: int, sm_count: int) -> float:
    """BASE_EFFICIENCY x tile fill x wave fill for a (batch x) M x N output."""
    tiles = batch * math.ceil(m / TILE[0]) * math.ceil(n / TILE[1])
    if tiles == 0:
        return BASE_EFFICIENCY
    return BASE_EFFICIENCY * _fill(m, TILE[0]) * _fill(n, TILE[1]) * wave_fill(tiles, sm_count)


def causal_work(sq: int, sk: int) -> float:
    """Share of the score blocks a causal flash kernel computes (the diagonal blocks whole)."""
    if sq != sk:
        return 1.0
    n = math.ceil(sq / ATTENTION_BLOCK)
    return (n + 1) / (2 * n)


def attention_efficiency(bh: int, sq: int, sk: int, backward: bool, sm_count: int) -> float:
    """Base x block fill (query and key sides) x wave fill of batch x heads x row blocks."""
    base = ATTENTION_BWD_EFFICIENCY if backward else ATTENTION_FWD_EFFICIENCY
    blocks = bh * math.ceil((sk if backward else sq) / ATTENTION_BLOCK)
    return base * _fill(sq, ATTENTION_BLOCK) * _fill(sk, ATTENTION_BLOCK) * wave_fill(blocks, sm_count)


def model_op(record: OpRecord, gpu: Union[str, GpuCompute, object],
             allow_tf32: Optional[bool] = None) -> OpCost:
    """The modeled cost of a captured op on ``gpu`` (a profile name, profile or GpuCompute).
    ``allow_tf32``: None keeps the flag the op ran under."""
    gpu = compute_of(gpu)
    if record.kind in ("view", "no_kernel", "communication"):
        return OpCost(record.name, record.kind, record.flops, record.bytes, 0.0, 0.0, 0.0, 0.0, None, "none")
    memory_s = record.bytes / (gpu.hbm_bytes_per_s * HBM_EFFICIENCY)
    if not record.flops:
        return OpCost(record.name, record.kind, 0, record.bytes, memory_s + LAUNCH_S, 0.0, memory_s, 0.0,
                      None, "memory")
    kind, note = record.math or "fp32", ""
    tf32 = record.tf32_allowed if allow_tf32 is None else allow_tf32
    if kind == "fp32" and tf32 and record.kind in ("matmul", "conv"):
        kind = "tf32"
    if gpu.peak(kind) is None:
        note = f"{gpu.name} has no {kind} tensor cores: costed at its bf16 rate"
        kind = "bf16"
    work = float(record.flops)
    if record.kind == "matmul" and record.matmul is not None:
        batch, m, n, _k = record.matmul
        efficiency = matmul_efficiency(m, n, batch, gpu.sm_count)
    elif record.kind == "attention" and record.attention is not None:
        bh, sq, sk, causal, backward = record.attention
        efficiency = attention_efficiency(bh, sq, sk, backward, gpu.sm_count)
        if record.work_fraction is not None:
            work *= record.work_fraction
        elif causal:
            work *= causal_work(sq, sk)
    elif record.kind == "attention":
        efficiency = ATTENTION_BWD_EFFICIENCY if "backward" in record.name else ATTENTION_FWD_EFFICIENCY
    elif record.kind == "conv":
        efficiency = CONV_EFFICIENCY
    else:
        efficiency = BASE_EFFICIENCY
    if kind == "fp8":
        efficiency *= FP8_EFFICIENCY_SCALE
    compute_s = work / (gpu.peak(kind) * efficiency)
    bound = "compute" if compute_s >= memory_s else "memory"
    return OpCost(record.name, record.kind, record.flops, record.bytes, max(compute_s, memory_s) + LAUNCH_S,
                  compute_s, memory_s, efficiency, kind, bound, note)


def op_cost(func, args, kwargs, out, gpu, allow_tf32: Optional[bool] = None) -> OpCost:
    """describe_op then model_op: the modeled cost of one op call on ``gpu``."""
    return model_op(describe_op(func, args, kwargs, out), gpu, allow_tf32)


def total_seconds(costs: Sequence[OpCost]) -> float:
    return sum(c.seconds for c in costs)
