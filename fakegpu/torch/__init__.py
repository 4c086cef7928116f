"""The ``fakegpu`` torch.distributed backend for CPU tensors.

``import fakegpu.torch`` registers it; under ``fgpu`` (or with fakegpu installed, through
torch's ``torch.backends`` plugin entry point) it is registered automatically, so a script
only needs ``dist.init_process_group("fakegpu")``.

Every collective runs the shim's NCCL API (:mod:`fakegpu.nccl`) on the tensors' host memory,
so the bytes take the same shim + coordinator path as a GPU job, with the same results,
cost model and report.

Supported torch versions: 2.5 to 2.14 (tested in CI with torch 2.13.0, the CPU build).
"""
from __future__ import annotations

import torch.distributed as dist

from .process_group import (
    BACKEND_NAME,
    FakeGpuProcessGroup,
    create_fakegpu_process_group,
    library,
)
from .monitored import monitored_barrier
from .work import FakeGpuWork

__all__ = [
    "BACKEND_NAME",
    "FakeGpuProcessGroup",
    "FakeGpuWork",
    "create_fakegpu_process_group",
    "is_registered",
    "library",
    "monitored_barrier",
    "register",
    "split_group",
]

SUPPORTED_TORCH_VERSIONS = (">=2.5", "<2.15")


def is_registered() -> bool:
    return BACKEND_NAME.upper() in getattr(dist.Backend, "_plugins", {})


def register() -> None:
    """Register backend ``fakegpu`` for CPU tensors with torch.distributed (idempotent)."""
    if is_registered():
        return
    dist.Backend.register_backend(BACKEND_NAME, create_fakegpu_process_group, devices=["cpu"])
    from .dynamo_skip import skip_fakegpu

    skip_fakegpu()


def split_group(parent_pg=None, split_ranks=None, timeout=None, group_desc=None):
    """``dist.split_group`` for fakegpu groups on CPU.

    torch's own ``split_group`` insists on an accelerator-bound default group, which a CPU job
    does not have.  This does the same through ``ncclCommSplit``: every rank of ``parent_pg``
    calls it with the same ``split_ranks`` (lists of ranks of the parent group); each rank gets
    the group it is in, registered with torch.distributed like any other, or None.
    """
    from torch.distributed import distributed_c10d as c10d

    parent = parent_pg or c10d._get_default_group()
    if not isinstance(parent, FakeGpuProcessGroup):
        raise TypeError(f"fakegpu.torch.split_group needs a fakegpu process group, got {type(parent).__name__}")
    if not split_ranks:
        raise ValueError("split_ranks must be a non-empty list of lists of ranks")
    parent_to_global = {g: gl for gl, g in c10d._world.pg_group_ranks[parent].items()}
    my_ranks = next((sorted(r) for r in split_ranks if parent.rank() in r), None)
    seen: set[int] = set()
    for ranks in split_ranks:
        if not ranks or len(set(ranks)) != len(ranks) or seen & set(ranks):
            raise ValueError(f"split_ranks {split_ranks!r}: each split must be non-empty, "
                             "without duplicates, and not overlap another")
        seen |= set(ranks)
    group_name = c10d._process_group_name(my_ranks or [], use_hashed_name=True)
    child = parent.split_group(my_ranks or [], timeout=timeout, group_name=group_name,
                               group_desc=group_desc)
    if child is None:
        return None
    global_ranks = [parent_to_global[r] for r in my_ranks]
    c10d._world.pg_map[child] = (BACKEND_NAME, child._store)
    c10d._world.pg_names[child] = group_name
    c10d._register_process_group(group_name, child)
    c10d._world.pg_backend_config[child] = f"cpu:{BACKEND_NAME}"
    c10d._world.pg_group_ranks[child] = {g: i for i, g in enumerate(global_ranks)}
    c10d._world.tags_to_pg.setdefault("", []).append(child)
    tag = f"ptd:{group_name}"
    c10d._world.tags_to_pg.setdefault(tag, []).append(child)
    c10d._world.pg_to_tag[child] = tag
    return child


register()
