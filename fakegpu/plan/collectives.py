"""What a captured communication op is, in the cost model's terms.

A rank's collectives reach a TorchDispatchMode as dispatcher ops: ``c10d.*`` (what
``torch.distributed.all_reduce`` and friends, FSDP2 among them, call) with the process group
as an argument, and ``_c10d_functional.*`` (DTensor, tensor parallelism, functional
collectives) with the group's name.  :func:`describe_collective` turns one call into a
:class:`Collective`: the NCCL kind, the per-rank element count in NCCL's convention (an
all-gather's send count, a reduce-scatter's receive count), the element size and the group's
global ranks, which is what ``fakegpu.costmodel.estimate`` times.

``wait_tensor`` and ``barrier``-like ops move nothing: they are dependencies, not transfers.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch.utils._pytree import tree_leaves

# op packet name -> (NCCL kind, the argument whose elements are NCCL's count)
_KINDS = {
    "allreduce_": ("AllReduce", "tensors"),
    "allreduce_coalesced_": ("AllReduce", "tensors"),
    "all_reduce": ("AllReduce", "input"),
    "all_reduce_": ("AllReduce", "input"),
    "all_reduce_coalesced": ("AllReduce", "inputs"),
    "all_reduce_coalesced_": ("AllReduce", "inputs"),
    "_allgather_base_": ("AllGather", "input_tensor"),
    "allgather_": ("AllGather", "input_tensors"),
    "allgather_into_tensor_coalesced_": ("AllGather", "input_tensors"),
    "all_gather_into_tensor": ("AllGather", "input"),
    "all_gather_into_tensor_out": ("AllGather", "input"),
    "all_gather_into_tensor_coalesced": ("AllGather", "inputs"),
    "_reduce_scatter_base_": ("ReduceScatter", "output_tensor"),
    "reduce_scatter_": ("ReduceScatter", "output_tensors"),
    "reduce_scatter_tensor_coalesced_": ("ReduceScatter", "output_tensors"),
    "reduce_scatter_tensor": ("ReduceScatter", None),     # output = input / group size
    "reduce_scatter_tensor_coalesced": ("ReduceScatter", None),
    "broadcast_": ("Broadcast", "tensors"),
    "broadcast": ("Broadcast", "input"),
    "alltoall_base_": ("AlltoAll", "input"),
    "all_to_all_single": ("AlltoAll", "input"),
    "reduce_": ("Reduce", "tensors"),
    "send": ("SendRecv", "tensors"),
    "recv_": ("SendRecv", "tensors"),
}


@dataclass(frozen=True)
class Collective:
    kind: str                  # NCCL kind (fakegpu.costmodel.KINDS)
    count: int                 # per-rank elements, NCCL's convention
    elem_size: int
    ranks: tuple               # the group's global ranks
    group: str                 # the group's name (one stream per group on a GPU)

    @property
    def nbytes(self) -> int:
        return self.count * self.elem_size


def _named(func, args, kwargs) -> dict:
    schema = func._schema
    named = {}
    for i, a in enumerate(schema.arguments):
        if i < len(args):
            named[a.name] = args[i]
        elif a.name in kwargs:
            named[a.name] = kwargs[a.name]
    return named


def _group(named: dict) -> tuple[Optional[str], Optional[tuple]]:
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    for value in named.values():
        if isinstance(value, torch.ScriptObject) and "ProcessGroup" in str(value._type()):
            pg = dist.ProcessGroup.unbox(value)
            return pg.group_name, tuple(dist.get_process_group_ranks(pg))
    name = named.get("group_name")
    if isinstance(name, str):
        pg = c10d._resolve_process_group(name)
        return name, tuple(dist.get_process_group_ranks(pg))
    return None, None


def describe_collective(func, args, kwargs) -> Optional[Collective]:
    """The collective an op call runs, or None for ops that move nothing (waits, barriers)."""
    packet = getattr(func, "overloadpacket", func)
    name = getattr(packet, "__name__", str(packet)).split(".")[-1]
    if name not in _KINDS:
        return None
    kind, counted = _KINDS[name]
    named = _named(func, args, kwargs or {})
    group, ranks = _group(named)
    if ranks is None:
        return None
    if counted is None:            # functional reduce-scatter: the input is size x the output
        tensors = [t for t in tree_leaves(named.get("input", named.get("inputs")))
                   if isinstance(t, torch.Tensor)]
        count = sum(t.numel() for t in tensors) // max(1, len(ranks))
    else:
        tensors = [t for t in tree_leaves(named.get(counted)) if isinstance(t, torch.Tensor)]
        count = sum(t.numel() for t in tensors)
    elem = tensors[0].element_size() if tensors else 1
    return Collective(kind, int(count), int(elem), ranks, group or "")
