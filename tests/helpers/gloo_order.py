"""A numpy model of the order in which torch 2.13's CPU ProcessGroupGloo reduces floats, bit for
bit, so a fakegpu result can be compared with (or made equal to) a gloo one.

What torch calls, and what gloo does with it (gloo sources read: gloo/allreduce.cc ``ring``,
gloo/reduce.cc ``reduce``, gloo/math.h / math.cc ``sum<float16>``, gloo/types.h ``float16``;
torch: ProcessGroupGloo.cpp ``AsyncAllreduceWork``, ``AsyncAllreduceCoalescedWork``,
``AsyncReduceWork``, ``reduce_scatter_tensor_coalesced``):

* ``all_reduce``, ``all_reduce_coalesced`` and all_reduces inside ``_coalescing_manager``
  (both: one all-reduce of the flattened concatenation) and DDP's bucket all-reduce run gloo's
  ring all-reduce on one buffer (``plan_allreduce``). DDP (measured, one Linear): the bucket is
  the gradients in parameter order, each multiplied by float32(1 / world) before the
  all-reduce (the reducer's mul_out), then summed by this plan.
* ``reduce_scatter_tensor`` (FSDP2's) clones the whole input, all-reduces it (the same ring,
  on ``world * n`` elements) and copies chunk ``rank`` out: element ``j`` of rank ``r``'s
  output is element ``r * n + j`` of that all-reduce.
* ``reduce_scatter`` (the list form) all-reduces each of the ``world`` input tensors on its
  own (``n`` elements each) and rank ``r`` keeps the ``r``-th: a different chunking from
  ``reduce_scatter_tensor`` for the same data.
* ``reduce`` runs gloo's ring reduce (``plan_reduce``), whose segments are sized differently, and
  leaves partial sums in the non-root ranks' tensors (``reduce`` models those too).

The rule (both rings): the buffer is cut into ``world`` chunks, chunk ``c`` being elements
``[c * C, min((c + 1) * C, count))`` (the last chunks may be short or empty). Chunk ``c`` is
accumulated around the ring from rank ``c - 1`` downwards: ``acc = x[c-1]``, then
``acc = x[c-2] + acc``, ..., ``acc = x[c] + acc`` (ranks mod world; in a subgroup these are
group ranks: new_group's sorted list, or its order with sort_ranks=False), every step rounded to
the tensor's own type (float16 and bfloat16 add in float32 and round to half after every
step). Only the chunk length ``C`` differs:

    all_reduce: S = roundUp(max(ceil(bytes / M), 2 * world), world) segments,
                s = roundUp(ceil(bytes / S), elem) bytes each, C = (S / world) * s / elem
    reduce:     s = roundUp(min(ceil(bytes / (2 * world)), M), elem),
                S = roundUp(max(ceil(bytes / s), 2 * world), world), C = (S / world) * s / elem

with ``M = 1 MiB`` rounded down to a multiple of the element size (gloo's default
``maxSegmentSize``; for reduce measured, its header was not read). Floating addition and multiplication are commutative, so only the
association above matters, not which operand gloo puts first (except NaN payloads, which
this model does not try to reproduce).

ReduceOp.AVG (supported by torch 2.13's gloo) is the SUM above, then every rank's tensor is
divided by the group size (true division in the tensor's type, float32 for half types).
MAX / MIN follow the same chains; see ``_combine`` for how NaN fares.
"""
from __future__ import annotations

from typing import List, Sequence, Tuple

import numpy as np

MAX_SEGMENT_BYTES = 1024 * 1024  # gloo AllreduceOptions / ReduceOptions kMaxSegmentSize

Plan = List[Tuple[int, int, List[int]]]


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _chunk_plan(world: int, count: int, chunk_elems: int) -> Plan:
    plan: Plan = []
    for c in range(world):
        begin, end = c * chunk_elems, min((c + 1) * chunk_elems, count)
        if begin < end:
            plan.append((begin, end, [(c - 1 - k) % world for k in range(world)]))
    return plan


def allreduce_geometry(world: int, count: int, elem_size: int,
                       max_segment_bytes: int = MAX_SEGMENT_BYTES) -> Tuple[int, int]:
    """(number of segments, bytes per segment) of gloo's ring all-reduce (gloo/allreduce.cc)."""
    total = count * elem_size
    max_seg = elem_size * max(1, max_segment_bytes // elem_size)
    nseg = _round_up(max(_ceil_div(total, max_seg), 2 * world), world)
    return nseg, _round_up(_ceil_div(total, nseg), elem_size)


def reduce_geometry(world: int, count: int, elem_size: int,
                    max_segment_bytes: int = MAX_SEGMENT_BYTES) -> Tuple[int, int]:
    """(number of segments, bytes per segment) of gloo's ring reduce (gloo/reduce.cc)."""
    total = count * elem_size
    max_seg = elem_size * max(1, max_segment_bytes // elem_size)
    seg = _round_up(min(_ceil_div(total, 2 * world), max_seg), elem_size)
    return _round_up(max(_ceil_div(total, seg), 2 * world), world), seg


def plan_allreduce(world: int, count: int, elem_size: int) -> Plan:
    """[(begin, end, ranks)]: elements [begin, end) are folded as
    ((x[ranks[0]] + x[ranks[1]]) + x[ranks[2]]) + ... (ranks[0] first)."""
    if count <= 0:
        return []
    if world == 1:
        return [(0, count, [0])]
    nseg, seg = allreduce_geometry(world, count, elem_size)
    return _chunk_plan(world, count, (nseg // world) * seg // elem_size)


def plan_reduce(world: int, count: int, elem_size: int) -> Plan:
    """The root's result of dist.reduce, in plan_allreduce's form."""
    if count <= 0:
        return []
    if world == 1:
        return [(0, count, [0])]
    nseg, seg = reduce_geometry(world, count, elem_size)
    return _chunk_plan(world, count, (nseg // world) * seg // elem_size)


def plan_reduce_scatter_tensor(world: int, out_count: int, elem_size: int, rank: int) -> Plan:
    """Rank ``rank``'s output of reduce_scatter_tensor (indices into its output)."""
    lo, hi = rank * out_count, (rank + 1) * out_count
    plan: Plan = []
    for begin, end, ranks in plan_allreduce(world, world * out_count, elem_size):
        b, e = max(begin, lo), min(end, hi)
        if b < e:
            plan.append((b - lo, e - lo, ranks))
    return plan


# --- arithmetic ------------------------------------------------------------------------

def _is_bfloat16(dtype: np.dtype) -> bool:
    return dtype.name == "bfloat16"


def _combine(op: str, acc: np.ndarray, x: np.ndarray) -> np.ndarray:
    """One gloo reduction step ``x op acc`` in the element type, ``x`` being the local rank's
    value and ``acc`` the partial result received from the next rank: float16 / bfloat16
    compute in float32 and round back (gloo::float16 operator+ / F16C, c10::BFloat16
    operator+). max / min are std::max(x, acc) / std::min(x, acc), which keep ``x`` when
    either is NaN (so a NaN survives only where it is the last rank's own value or every
    later partial is NaN; measured the same for float16, bfloat16, float32, float64)."""
    if op == "max":
        return np.where(x < acc, acc, x)
    if op == "min":
        return np.where(acc < x, acc, x)
    if op not in ("sum", "prod"):
        raise ValueError(f"unknown op {op!r}")
    dtype = acc.dtype
    if dtype == np.float16 or _is_bfloat16(dtype):
        a, b = acc.astype(np.float32), x.astype(np.float32)
        return (a + b if op == "sum" else a * b).astype(dtype)
    return acc + x if op == "sum" else acc * x


def _average(outs: List[np.ndarray], world: int) -> List[np.ndarray]:
    """ReduceOp.AVG on gloo (torch 2.13): the SUM's result divided by the group size in every
    rank's tensor, a true division in the tensor's type (float32 for the half types)."""
    res = []
    for o in outs:
        if o.dtype == np.float16 or _is_bfloat16(o.dtype):
            res.append((o.astype(np.float32) / np.float32(world)).astype(o.dtype))
        else:
            res.append(o / o.dtype.type(world))
    return res


def fold(inputs: Sequence[np.ndarray], op: str, plan: Plan) -> np.ndarray:
    """Apply a plan to flat per-rank arrays (indices of the plan index the arrays)."""
    out = np.array(inputs[0], copy=True)
    for begin, end, ranks in plan:
        acc = np.array(inputs[ranks[0]][begin:end], copy=True)
        for r in ranks[1:]:
            acc = _combine(op, acc, inputs[r][begin:end])
        out[begin:end] = acc
    return out


def _flat(inputs: Sequence[np.ndarray]) -> List[np.ndarray]:
    arrays = [np.ascontiguousarray(a).reshape(-1) for a in inputs]
    if len({(a.dtype, a.size) for a in arrays}) != 1:
        raise ValueError("every rank needs an array of the same dtype and size")
    return arrays


def all_reduce(inputs: Sequence[np.ndarray], op: str = "sum") -> List[np.ndarray]:
    """What dist.all_reduce leaves in each rank's tensor (the same bits on every rank)."""
    xs = _flat(inputs)
    out = fold(xs, "sum" if op == "avg" else op, plan_allreduce(len(xs), xs[0].size, xs[0].itemsize))
    outs = [out.reshape(np.shape(inputs[0])).copy() for _ in xs]
    return _average(outs, len(xs)) if op == "avg" else outs


def reduce_scatter_tensor(inputs: Sequence[np.ndarray], op: str = "sum") -> List[np.ndarray]:
    """Each rank's output of dist.reduce_scatter_tensor(output, input) for inputs of
    world * n elements along the first dimension."""
    xs = _flat(inputs)
    world = len(xs)
    if xs[0].size % world:
        raise ValueError("the input must hold world * n elements")
    full = all_reduce(xs, op)[0]
    n = xs[0].size // world
    shape = (np.shape(inputs[0])[0] // world,) + tuple(np.shape(inputs[0])[1:])
    return [full[r * n:(r + 1) * n].reshape(shape).copy() for r in range(world)]


def reduce_scatter(inputs: Sequence[Sequence[np.ndarray]], op: str = "sum") -> List[np.ndarray]:
    """Each rank's output of dist.reduce_scatter(output, input_list): ``inputs[r][j]`` is
    rank r's j-th input tensor; output j is the all-reduce of every rank's j-th tensor."""
    world = len(inputs)
    if any(len(lst) != world for lst in inputs):
        raise ValueError("every rank needs world input tensors")
    return [all_reduce([inputs[r][j] for r in range(world)], op)[0] for j in range(world)]


def plan_reduce_scatter(world: int, out_count: int, elem_size: int) -> Plan:
    """Every rank's output of the list form (the same plan for each output)."""
    return plan_allreduce(world, out_count, elem_size)


def reduce(inputs: Sequence[np.ndarray], op: str = "sum", root: int = 0) -> List[np.ndarray]:
    """What dist.reduce leaves in every rank's tensor: the reduction on ``root``, and gloo's
    left-over partial results on the others (simulated step by step, see simulate_reduce)."""
    xs = _flat(inputs)
    outs = simulate_reduce(xs, "sum" if op == "avg" else op, root)
    outs = _average(outs, len(xs)) if op == "avg" else outs
    return [o.reshape(np.shape(inputs[0])) for o in outs]


# --- step-by-step simulations of gloo's two rings (cross-checks of the plans) -------------

def _segment_ranges(offset_seg: int, nseg: int, seg: int, total: int, elem: int):
    off = (offset_seg % nseg) * seg
    length = min(seg, total - off)
    return off // elem, (off + max(length, 0)) // elem, length > 0


def simulate_allreduce(inputs: Sequence[np.ndarray], op: str = "sum") -> List[np.ndarray]:
    """gloo/allreduce.cc ``ring`` replayed message by message (every rank's buffer)."""
    xs = [np.array(a, copy=True) for a in _flat(inputs)]
    world, count, elem = len(xs), xs[0].size, xs[0].itemsize
    if world == 1 or count == 0:
        return xs
    nseg, seg = allreduce_geometry(world, count, elem)
    per = nseg // world
    total = count * elem
    steps = nseg - per
    inflight = {}  # (iteration, receiving rank) -> data sent by rank + 1
    for i in range(steps + 2):
        if i >= 2:
            for r in range(world):
                b, e, ok = _segment_ranges((r + 2) * per + i - 2, nseg, seg, total, elem)
                if ok:
                    xs[r][b:e] = _combine(op, xs[r][b:e], inflight.pop((i - 2, r)))
        if i < steps:
            for r in range(world):
                b, e, ok = _segment_ranges((r + 1) * per + i, nseg, seg, total, elem)
                if ok:
                    inflight[(i, (r - 1) % world)] = xs[r][b:e].copy()
    out = np.empty_like(xs[0])
    for c in range(world):  # the all-gather: chunk c comes from rank c
        b, e = min(c * per * seg // elem, count), min((c + 1) * per * seg // elem, count)
        out[b:e] = xs[c][b:e]
    return [out.copy() for _ in range(world)]


def simulate_reduce(inputs: Sequence[np.ndarray], op: str = "sum", root: int = 0) -> List[np.ndarray]:
    """gloo/reduce.cc replayed message by message with the input as the output buffer (as
    torch calls it): numSegments iterations, the last ones re-reducing finished segments
    into the neighbours' buffers, then the gather of chunk k from rank k to the root."""
    xs = [np.array(a, copy=True) for a in _flat(inputs)]
    world, count, elem = len(xs), xs[0].size, xs[0].itemsize
    if world == 1 or count == 0:
        return xs
    nseg, seg = reduce_geometry(world, count, elem)
    per = nseg // world
    total = count * elem
    inflight = {}
    for i in range(nseg):
        if i >= 2:
            for r in range(world):
                b, e, ok = _segment_ranges((r + 2) * per + i - 2, nseg, seg, total, elem)
                if ok:
                    xs[r][b:e] = _combine(op, xs[r][b:e], inflight.pop((i - 2, r)))
        if i < nseg - 2:
            for r in range(world):
                b, e, ok = _segment_ranges((r + 1) * per + i, nseg, seg, total, elem)
                if ok:
                    inflight[(i, (r - 1) % world)] = xs[r][b:e].copy()
    chunk = per * seg // elem
    for k in range(world):
        if k != root:
            b, e = min(k * chunk, count), min((k + 1) * chunk, count)
            xs[root][b:e] = xs[k][b:e]
    return xs


def expected(case: dict, xs: Sequence[np.ndarray], world: int) -> List[np.ndarray]:
    """What gloo gives each (group) rank for a probe ``case`` (tests/helpers/gloo_probe.py:
    ``coll``, ``op``, ``root``); ``xs`` are the ranks' flat inputs in group-rank order.
    Coalesced all-reduces are one all-reduce of the concatenation, as in gloo."""
    coll, op = case["coll"], case["op"]
    if coll in ("all_reduce", "all_reduce_coalesced"):
        return all_reduce(xs, op)
    if coll == "reduce_scatter_tensor":
        return reduce_scatter_tensor(xs, op)
    if coll == "reduce_scatter":
        n = xs[0].size // world
        return reduce_scatter([[x[j * n:(j + 1) * n] for j in range(world)] for x in xs], op)
    if coll == "reduce":
        return reduce(xs, op, case["root"])
    raise ValueError(f"no gloo model for {coll!r}")
