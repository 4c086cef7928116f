"""One-line hints when a GPU program asks a CPU-only torch for CUDA or NCCL outside fake devices.

Installed by the torch autoload hook (fgpu's ``sitecustomize``, or the ``torch.backends``
entry point of an installed fakegpu) when fake CUDA devices are not active.  Only errors
torch raises anyway change: the message becomes one line naming ``fgpu``.
"""
from __future__ import annotations

import functools
import os

_installed = False


def hint(what: str) -> str:
    if os.environ.get("FAKEGPU_COORDINATOR_ADDR") or os.environ.get("FAKEGPU_MODE"):
        how = ("fake CUDA devices are off in this fgpu run "
               f"(FAKEGPU_FAKE_CUDA={os.environ.get('FAKEGPU_FAKE_CUDA', 'unset')}, "
               f"FAKEGPU_MODE={os.environ.get('FAKEGPU_MODE', 'simulate')}); "
               "run with --mode simulate and without FAKEGPU_FAKE_CUDA=0")
    else:
        how = ("run it under fakegpu, which gives it fake CUDA devices and an NCCL stand-in: "
               "fgpu [--device-count N] -- torchrun --nproc-per-node N your_script.py")
    return f"fakegpu: {what}, and this torch has no usable GPU; {how}"


def install_hints() -> None:
    global _installed
    import torch

    if _installed or (torch.backends.cuda.is_built() and torch.cuda.is_available()):
        return
    _installed = True
    import torch.cuda
    from torch.distributed import distributed_c10d as c10d

    original_helper = c10d._new_process_group_helper

    @functools.wraps(original_helper)
    def new_process_group_helper(*args, **kwargs):
        try:
            return original_helper(*args, **kwargs)
        except RuntimeError as exc:
            if "doesn't have NCCL built in" in str(exc):
                raise RuntimeError(hint("the program asked torch.distributed for NCCL")) from None
            raise

    c10d._new_process_group_helper = new_process_group_helper

    original_lazy_init = torch.cuda._lazy_init

    @functools.wraps(original_lazy_init)
    def lazy_init():
        try:
            original_lazy_init()
        except (AssertionError, RuntimeError) as exc:
            text = str(exc)
            if "not compiled with CUDA" in text or "no NVIDIA driver" in text or "Found no NVIDIA" in text:
                raise AssertionError(hint("the program uses CUDA")) from None
            raise

    torch.cuda._lazy_init = lazy_init
