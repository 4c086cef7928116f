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
    """The devices this process sees: the physical count (below), narrowed by
    ``CUDA_VISIBLE_DEVICES`` as the CUDA runtime narrows it."""
    return len(visible_devices(physical_device_count(environ), environ))


def visible_devices(physical: int, environ: Mapping[str, str] = os.environ) -> list:
    """The physical devices behind this process's device 0, 1, ...: ``CUDA_VISIBLE_DEVICES``
    read as CUDA reads a list of indices (the list ends at the first entry that is not a
    valid index: out of range, negative, repeated or not a number), or all of them when unset.
    GPU UUIDs (``GPU-...``, ``MIG-...``) name no fake device, so a list of them is not applied."""
    raw = environ.get("CUDA_VISIBLE_DEVICES")
    if raw is None:
        return list(range(physical))
    entries = [e.strip() for e in raw.split(",")] if raw.strip() else []
    if any(e.upper().startswith(("GPU-", "MIG-")) for e in entries):
        return list(range(physical))
    visible: list = []
    for entry in entries:
        if not entry.isdigit() or int(entry) >= physical or int(entry) in visible:
            break
        visible.append(int(entry))
    return visible


def physical_device_count(environ: Mapping[str, str] = os.environ) -> int:
    """N of the fake machine: ``FAKEGPU_DEVICE_COUNT``, else torchrun's LOCAL_WORLD_SIZE, else 1."""
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
    count = device_count_from(environ)
    if count == 0:
        return False   # CUDA_VISIBLE_DEVICES hides every device: a machine without GPUs
    activate(count, environ=environ)
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


__all__ = ["activate", "activate_from_environment", "device_count_from", "is_active", "physical_device_count",
           "requested", "visible_devices"]
