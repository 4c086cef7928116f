"""What each fake CUDA device says it is: name, memory, SM count, capability.

The profile comes from the cluster YAML (the GPU listed for this rank's node at the device's
index), else the default topology's H100.  SM counts, capabilities and the names
``torch.cuda.get_device_name`` prints are the vendors' published figures.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Optional

from fakegpu.topology.profiles import get_profile

# profile key -> (name as CUDA reports it, (major, minor), SMs, L2 bytes, warp size)
_CUDA_FACTS = {
    "a100": ("NVIDIA A100-SXM4-40GB", (8, 0), 108, 40 << 20),
    "a100-80gb": ("NVIDIA A100-SXM4-80GB", (8, 0), 108, 40 << 20),
    "h100": ("NVIDIA H100 80GB HBM3", (9, 0), 132, 50 << 20),
    "h100-96gb": ("NVIDIA H100", (9, 0), 132, 50 << 20),
    "h100-pcie": ("NVIDIA H100 PCIe", (9, 0), 114, 50 << 20),
    "h800": ("NVIDIA H800", (9, 0), 132, 50 << 20),
    "h200": ("NVIDIA H200", (9, 0), 132, 50 << 20),
    "b200": ("NVIDIA B200", (10, 0), 148, 126 << 20),
    "l40s": ("NVIDIA L40S", (8, 9), 142, 96 << 20),
    "rtx4090": ("NVIDIA GeForce RTX 4090", (8, 9), 128, 72 << 20),
    "rtx3090ti": ("NVIDIA GeForce RTX 3090 Ti", (8, 6), 84, 6 << 20),
    "rtx-pro-5000-blackwell": ("NVIDIA RTX PRO 5000 Blackwell Generation", (12, 0), 110, 96 << 20),
}
DEFAULT_PROFILE = "h100"


def capability_of(profile_name: str) -> tuple[int, int]:
    """The CUDA compute capability a catalogue GPU reports."""
    return _CUDA_FACTS.get(get_profile(profile_name).name, _CUDA_FACTS[DEFAULT_PROFILE])[1]


@dataclasses.dataclass(frozen=True)
class FakeDeviceProperties:
    """Mirrors ``torch._C._CudaDeviceProperties`` (the attributes programs read)."""
    name: str
    major: int
    minor: int
    multi_processor_count: int
    total_memory: int
    L2_cache_size: int
    profile: str
    index: int
    is_integrated: int = 0
    is_multi_gpu_board: int = 0
    max_threads_per_multi_processor: int = 2048
    max_threads_per_block: int = 1024
    regs_per_multiprocessor: int = 65536
    warp_size: int = 32
    gcnArchName: str = "NVIDIA CUDA GPU"  # noqa: N815 - torch's spelling
    shared_memory_per_block: int = 49152
    shared_memory_per_block_optin: int = 232448
    shared_memory_per_multiprocessor: int = 233472
    clock_rate: int = 1980000
    memory_clock_rate: int = 2619000
    memory_bus_width: int = 5120

    @property
    def uuid(self) -> str:
        return f"GPU-fakegpu-{self.profile}-{self.index:04d}"

    def __repr__(self) -> str:
        return (f"_CudaDeviceProperties(name='{self.name}', major={self.major}, minor={self.minor}, "
                f"total_memory={self.total_memory // (1 << 20)}MB, "
                f"multi_processor_count={self.multi_processor_count}, uuid={self.uuid}, "
                f"L2_cache_size={self.L2_cache_size // (1 << 20)}MB)")


def properties_for(profile_name: str, index: int) -> FakeDeviceProperties:
    profile = get_profile(profile_name)
    name, (major, minor), sms, l2 = _CUDA_FACTS.get(profile.name, _CUDA_FACTS[DEFAULT_PROFILE])
    # Marketed capacity in GB, as nvidia-smi's total is close to it (80 GB -> 79.x GiB there).
    total = int(profile.memory_gb * 1e9)
    return FakeDeviceProperties(name=name, major=major, minor=minor, multi_processor_count=sms,
                                total_memory=total, L2_cache_size=l2, profile=profile.name, index=index)


def profiles_for_this_process(count: int, environ=os.environ) -> list[str]:
    """Profile names of this process's ``count`` fake devices.

    Device k of a rank is GPU k of the rank's node in the cluster YAML (GPU
    ``CUDA_VISIBLE_DEVICES[k]`` when that narrows the devices); without a YAML (or when the node
    lists fewer GPUs) the default profile fills in.
    """
    from . import physical_device_count, visible_devices

    names = [DEFAULT_PROFILE] * count
    physical = visible_devices(physical_device_count(environ), environ)
    if len(physical) != count:   # an explicit count given to activate(): no narrowing
        physical = list(range(count))
    path = environ.get("FAKEGPU_CLUSTER_CONFIG")
    if not path:
        return names
    rank = _int(environ.get("RANK")) or 0
    try:
        from fakegpu.topology import load_cluster_config

        topology = load_cluster_config(path)
        node = topology.nodes[topology.node_of(rank)]
    except Exception:  # a broken YAML is the coordinator's error to report, not ours
        return names
    for k, gpu in enumerate(physical):
        if gpu < len(node.gpus):
            names[k] = node.gpus[gpu].name
    return names


def _int(value: Optional[str]) -> Optional[int]:
    try:
        return int(value) if value not in (None, "") else None
    except ValueError:
        return None
