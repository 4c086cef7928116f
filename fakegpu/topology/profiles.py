"""Catalogue of GPU profiles a cluster YAML may name.

A profile caps what the cost model lets a GPU move inside its node: over NVLink when
the intra-node fabric is NVLink and every GPU on the path has a switched NVLink port,
otherwise over PCIe. Bandwidths are per direction, in GB/s (1e9 bytes/s), from the
vendors' published data sheets; memory is the marketed capacity in GB.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class GpuProfile:
    name: str                       # canonical catalogue key, e.g. "h100"
    description: str
    memory_gb: float                # marketed capacity
    nvlink_gbs: Optional[float]     # per direction, through an NVSwitch; None = no switched NVLink
    pcie_gbs: float                 # per direction, x16 at the card's PCIe generation
    nvls: bool = False              # NVLink SHARP (in-switch reduction) available
    # per direction, GB/s, over an NVLink bridge joining two cards (a node's `nvlink_bridges`)
    nvlink_bridge_gbs: Optional[float] = None
    # per direction, GB/s of line rate, GPU to GPU over PCIe when the host's root complex, not the
    # card's link, is the limit (consumer PCIe Gen5 cards); None: the card's pcie_gbs
    pcie_p2p_gbs: Optional[float] = None

    def intra_node_cap_gbs(self, fabric_type: str) -> float:
        """Most this GPU can push to a node-local peer on the given fabric type."""
        if fabric_type in ("nvlink", "nvswitch") and self.nvlink_gbs:
            return self.nvlink_gbs
        return self.pcie_p2p_gbs or self.pcie_gbs

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "description": self.description,
            "memory_gb": self.memory_gb,
            "nvlink_gbs": self.nvlink_gbs,
            "pcie_gbs": self.pcie_gbs,
            "nvls": self.nvls,
            "nvlink_bridge_gbs": self.nvlink_bridge_gbs,
            "pcie_p2p_gbs": self.pcie_p2p_gbs,
        }


# PCIe x16 per-direction line rates: Gen4 ~32 GB/s, Gen5 ~64 GB/s.
# NVLink per direction: NVLink3 (A100) 300, NVLink4 (H100/H200) 450, NVLink5 (B200) 900.
_CATALOGUE = [
    GpuProfile("a100", "NVIDIA A100 SXM4 40GB (NVLink3)", 40, 300.0, 32.0),
    GpuProfile("a100-80gb", "NVIDIA A100 SXM4 80GB (NVLink3)", 80, 300.0, 32.0),
    GpuProfile("h100", "NVIDIA H100 SXM5 80GB (NVLink4)", 80, 450.0, 64.0, nvls=True),
    # The PCIe card's NVLink bridge joins two cards (a node's `nvlink_bridges`); NVIDIA quotes
    # 600 GB/s both ways, and nccl-tests reaches 116 GB/s busbw over it (NVIDIA/nccl-tests issue
    # 194), so the effective per-direction rate is 141 GB/s at NVLink's 0.82 efficiency.
    GpuProfile("h100-pcie", "NVIDIA H100 PCIe 80GB", 80, None, 64.0, nvlink_bridge_gbs=141.0),
    # The export H800 keeps NVLink4's switch and NVLS but 8 of its 18 links: 400 GB/s both ways.
    GpuProfile("h800", "NVIDIA H800 SXM5 80GB (NVLink4, 200 GB/s per direction)", 80, 200.0, 64.0, nvls=True),
    GpuProfile("h200", "NVIDIA H200 SXM 141GB (NVLink4)", 141, 450.0, 64.0, nvls=True),
    GpuProfile("b200", "NVIDIA B200 192GB (NVLink5)", 192, 900.0, 64.0, nvls=True),
    GpuProfile("l40s", "NVIDIA L40S 48GB (PCIe only)", 48, None, 32.0),
    GpuProfile("rtx4090", "NVIDIA GeForce RTX 4090 24GB (PCIe only)", 24, None, 32.0),
    # The 3090 Ti's NVLink bridge (112.5 GB/s both ways) joins two cards: `nvlink_bridges`.
    GpuProfile("rtx3090ti", "NVIDIA GeForce RTX 3090 Ti 24GB", 24, None, 32.0, nvlink_bridge_gbs=56.25),
    # PCIe Gen5, but GPU-to-GPU traffic is held by the host: 4x RTX 5090 reach 35 GB/s allreduce
    # busbw, 8x 28 (NVIDIA/nccl issue 1639), i.e. 43.75 GB/s of line rate at PCIe's 0.80.
    GpuProfile("rtx5090", "NVIDIA GeForce RTX 5090 32GB (PCIe Gen5)", 32, None, 64.0, pcie_p2p_gbs=43.75),
    GpuProfile("rtx-pro-5000-blackwell", "NVIDIA RTX PRO 5000 Blackwell 48GB (PCIe Gen5)", 48, None, 64.0),
]

PROFILES: dict[str, GpuProfile] = {p.name: p for p in _CATALOGUE}

# Spellings users write that mean a catalogue entry.
_ALIASES = {
    "a100-40gb": "a100",
    "a100-sxm": "a100",
    "a100-80g": "a100-80gb",
    "h100-sxm": "h100",
    "h100-80gb": "h100",
    "h200-sxm": "h200",
    "rtx-4090": "rtx4090",
    "rtx-5090": "rtx5090",
    "rtx-3090-ti": "rtx3090ti",
    "rtx3090-ti": "rtx3090ti",
    "rtx-pro-5000": "rtx-pro-5000-blackwell",
    "rtxpro5000": "rtx-pro-5000-blackwell",
}


def canonical_profile_name(name: str) -> Optional[str]:
    """The catalogue key for ``name`` (case and '_'/' ' insensitive), or None if unknown."""
    key = str(name).strip().lower().replace("_", "-").replace(" ", "-")
    if key in PROFILES:
        return key
    return _ALIASES.get(key)


def get_profile(name: str) -> GpuProfile:
    canonical = canonical_profile_name(name)
    if canonical is None:
        raise KeyError(f"unknown GPU profile {name!r}; known: {', '.join(sorted(PROFILES))}")
    return PROFILES[canonical]
