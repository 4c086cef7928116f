"""Fake CUDA devices for unmodified GPU programs on a torch without a usable GPU.

``fgpu`` (simulate mode) sets ``FAKEGPU_FAKE_CUDA=1``; the torch autoload hook then calls
:func:`activate_from_environment` right after ``import torch``.  The process then sees
``FAKEGPU_DEVICE_COUNT`` CUDA devices (default: torchrun's ``LOCAL_WORLD_SIZE``, else 1)
whose memory is host memory and whose kernels are torch's CPU kernels.  See docs/fake-cuda.md.
"""
from __future__ import annotations

import os
from typing import Mapping, Optional

ENABLE_ENV = "FAKEGPU_FAKE_CUDA"
COUNT_ENV = "FAKEGPU_DEVICE_COUNT"

_active = False


def requested(environ: Mapping[str, str] = os.environ) -> bool:
    return environ.get(ENABLE_ENV, "0").strip().lower() in ("1", "true", "yes", "on")


def device_count_from(environ: Mapping[str, str] = os.environ) -> int:
    for var in (COUNT_ENV, "LOCAL_WORLD_SIZE"):
        value = environ.get(var, "").strip()
        if value:
            try:
                count = int(value)
            except ValueError:
                raise ValueError(f"{var}={value!r}: expected a whole number of devices") from None
            if count < 1:
                raise ValueError(f"{var}={value!r}: need at least one device")
            return count
    return 1


def is_active() -> bool:
    return _active


def real_gpu_usable() -> bool:
    """A CUDA build that sees a GPU: fake devices stay off (that is hybrid mode's job)."""
    import torch

    try:
        return bool(torch.backends.cuda.is_built() and torch._C._cuda_getDeviceCount() > 0)
    except Exception:
        return False


def activate_from_environment(environ: Mapping[str, str] = os.environ) -> bool:
    """Activate when fgpu asked for fake devices and no real GPU is usable; True if active."""
    if not requested(environ) or environ.get("FAKEGPU_MODE", "simulate") != "simulate":
        return False
    if real_gpu_usable():
        return False
    activate(device_count_from(environ), environ=environ)
    return True


def activate(count: Optional[int] = None, environ: Mapping[str, str] = os.environ) -> None:
    """Give this process ``count`` fake CUDA devices (idempotent)."""
    global _active
    if _active:
        return
    from . import devices, runtime
    from ._patch import install

    count = device_count_from(environ) if count is None else int(count)
    runtime._state = runtime._State(count, devices.profiles_for_this_process(count, environ))
    install()
    _active = True


__all__ = ["activate", "activate_from_environment", "device_count_from", "is_active", "requested"]
