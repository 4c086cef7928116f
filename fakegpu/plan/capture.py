"""The aten ops a region runs, each with its modeled cost, on fake tensors (no memory).

``estimate_compute(fn, *args, gpu=...)`` runs ``fn`` (forward, backward, an optimizer step:
whatever it does) under torch's FakeTensorMode with :class:`CostRecorder` and returns the
per-op costs.  Arguments that are real tensors or modules are turned into fake ones first, so
a full-size model costs only its metadata."""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

from .compute import OpCost, op_cost
from .gpu_compute import GpuCompute


def _aliases_only(func) -> bool:
    schema = getattr(func, "_schema", None)
    returns = schema.returns if schema is not None else ()
    return bool(returns) and all(r.alias_info is not None and not r.alias_info.is_write for r in returns)


class CostRecorder(TorchDispatchMode):
    """Records every aten op below it with its cost on ``gpu``."""

    def __init__(self, gpu: GpuCompute, allow_tf32: bool = True):
        super().__init__()
        self.gpu, self.allow_tf32 = gpu, allow_tf32
        self.costs: list[OpCost] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.costs.append(op_cost(func, args, kwargs, out, self.gpu, self.allow_tf32,
                                  views=_aliases_only(func)))
        return out


def estimate_compute(fn: Callable, *args: Any, gpu: GpuCompute, allow_tf32: bool = True,
                     **kwargs: Any) -> list[OpCost]:
    """Per-op modeled costs of ``fn(*args, **kwargs)`` run on fake tensors."""
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake_args = tree_map(lambda v: mode.from_tensor(v) if isinstance(v, torch.Tensor) else v,
                             (args, kwargs))
        with CostRecorder(gpu, allow_tf32) as recorder:
            fn(*fake_args[0], **fake_args[1])
    return recorder.costs
