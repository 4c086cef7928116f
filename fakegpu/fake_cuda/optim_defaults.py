"""Optimizer implementation defaults as on a GPU: the foreach path for fake-device parameters.

torch.optim picks its implementation from the parameters' device when the program does not
say (``foreach=None``): the foreach kernels for CUDA parameters, the per-tensor loop for CPU
ones.  Fake-device tensors are CPU tensors (docs/fake-cuda.md), so without this an optimizer
of an unmodified GPU program would take the CPU's per-tensor loop: a different code path
from the one the program takes on its GPUs, and several times the operations (each one a
trip through fakegpu's dispatch modes).  Here a parameter whose storage lives on a fake
device counts as a CUDA parameter for that choice, so the optimizer takes the path it takes
on a GPU.  On CPU kernels the foreach and per-tensor paths of SGD, Adam and AdamW give the
same bits (tests/e2e/test_fake_cuda.py); the other optimizers' foreach paths are within float
rounding of their loops, as on a GPU.  ``fused`` stays what it is on a GPU: only when asked.
"""
from __future__ import annotations

import sys


def _on_fake_device(tensor, memory) -> bool:
    from .memory import _storages

    if memory is None:  # FAKEGPU_FAKE_CUDA_MEMORY=0: no per-storage placement; a fake CUDA
        return True     # program's parameters are its GPUs' (the memory mode's docs say so)
    storages: list = []
    _storages(tensor, storages)
    return bool(storages) and all(memory.device_of_storage(s) is not None for s in storages)


def install(memory) -> None:
    """Wrap ``_default_to_fused_or_foreach`` where torch.optim's modules hold it.

    ``memory``: the process's :class:`DeviceMemory` when memory tracking is on, else None."""
    import torch.optim  # noqa: F401  (imports every optimizer module)
    from torch.optim import optimizer as optimizer_module

    original = optimizer_module._default_to_fused_or_foreach
    if getattr(original, "__fakegpu__", False):
        return

    def _default_to_fused_or_foreach(params, differentiable, use_fused=False):
        fused, foreach = original(params, differentiable, use_fused)
        if fused or foreach or torch.jit.is_scripting() or differentiable:
            return fused, foreach
        supported = optimizer_module._foreach_supported_types
        present = [p for p in params if p is not None]
        if present and all(type(p) in supported and p.device.type == "cpu" and _on_fake_device(p, memory)
                           for p in present):
            return False, True
        return fused, foreach

    _default_to_fused_or_foreach.__fakegpu__ = True
    _default_to_fused_or_foreach.__wrapped__ = original
    for name, module in list(sys.modules.items()):
        if (name == "torch.optim" or name.startswith("torch.optim.")) and \
                getattr(module, "_default_to_fused_or_foreach", None) is original:
            module._default_to_fused_or_foreach = _default_to_fused_or_foreach
