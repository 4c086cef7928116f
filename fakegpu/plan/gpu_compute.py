"""What a GPU computes per second: dense peak by dtype, HBM bandwidth, SMs and clock.

Figures are NVIDIA's published data-sheet values for dense (not 2:4 sparse) math, in
TFLOP/s; HBM bandwidth in GB/s (1e9 bytes/s). Keyed by the catalogue names of
fakegpu/topology/profiles.py (tests/unit/test_plan_compute.py checks every profile has one).

Sources: NVIDIA H100 Tensor Core GPU data sheet (SXM5: 989 bf16/fp16, 1979 fp8, 494 tf32,
67 fp32 TFLOP/s, 3.35 TB/s; PCIe: 756 / 1513 / 378 / 51, 2.0 TB/s; 132 / 114 SMs, 1.98 / 1.755
GHz boost); H200 data sheet (H100 SXM5 compute, 4.8 TB/s); H800 (H100 SXM5 compute, 3.35
TB/s); A100 data sheet (312 bf16, 156 tf32, 19.5 fp32; 1.555 TB/s for 40 GB, 2.039 TB/s for
80 GB; 108 SMs, 1.41 GHz; no fp8); B200 (HGX B200 per GPU: 2250 bf16, 4500 fp8, 1100 tf32,
75 fp32 dense, 8 TB/s, 148 SMs); L40S data sheet (362 bf16, 733 fp8, 183 tf32, 91.6 fp32, 864
GB/s, 142 SMs); the Ada, Ampere and Blackwell GeForce whitepapers for the RTX 4090 (165
bf16/fp16 and 330 fp8 with fp32 accumulation, 82.6 tf32/fp32, 1008 GB/s, 128 SMs), 3090 Ti (80
bf16/fp16 with fp32 accumulation, 40 tf32/fp32, 1008 GB/s, 84 SMs) and 5090 (209.5 bf16/fp16,
419 fp8, 104.8 tf32/fp32, 1792 GB/s, 170 SMs). GeForce cards run fp32-accumulating tensor math
at half the fp16-accumulating rate; training accumulates in fp32, so those are the figures.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class GpuCompute:
    peak_tflops: dict          # dtype class ("fp8", "bf16", "fp16", "tf32", "fp32", "fp64") -> dense TFLOP/s
    hbm_gbs: float             # HBM bandwidth, GB/s
    sm_count: int
    boost_ghz: float

    def peak(self, dtype_class: str) -> Optional[float]:
        """Dense FLOP/s for ``dtype_class``, or None when the GPU has no tensor-core path for it."""
        tflops = self.peak_tflops.get(dtype_class)
        return None if tflops is None else tflops * 1e12


def _hopper(hbm_gbs: float) -> GpuCompute:
    return GpuCompute({"fp8": 1979.0, "bf16": 989.0, "fp16": 989.0, "tf32": 494.0, "fp32": 67.0,
                       "fp64": 67.0}, hbm_gbs, 132, 1.98)


def _ampere(hbm_gbs: float) -> GpuCompute:
    return GpuCompute({"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5, "fp64": 19.5},
                      hbm_gbs, 108, 1.41)


COMPUTE: dict[str, GpuCompute] = {
    "a100": _ampere(1555.0),
    "a100-80gb": _ampere(2039.0),
    "h100": _hopper(3350.0),
    "h100-pcie": GpuCompute({"fp8": 1513.0, "bf16": 756.0, "fp16": 756.0, "tf32": 378.0, "fp32": 51.0,
                             "fp64": 51.0}, 2000.0, 114, 1.755),
    "h800": _hopper(3350.0),
    "h200": _hopper(4800.0),
    "b200": GpuCompute({"fp8": 4500.0, "bf16": 2250.0, "fp16": 2250.0, "tf32": 1100.0, "fp32": 75.0,
                        "fp64": 37.0}, 8000.0, 148, 1.965),
    "l40s": GpuCompute({"fp8": 733.0, "bf16": 362.0, "fp16": 362.0, "tf32": 183.0, "fp32": 91.6,
                        "fp64": 1.4}, 864.0, 142, 2.52),
    "rtx4090": GpuCompute({"fp8": 330.0, "bf16": 165.0, "fp16": 165.0, "tf32": 82.6, "fp32": 82.6,
                           "fp64": 1.3}, 1008.0, 128, 2.52),
    "rtx3090ti": GpuCompute({"bf16": 80.0, "fp16": 80.0, "tf32": 40.0, "fp32": 40.0, "fp64": 0.6},
                            1008.0, 84, 1.86),
    "rtx5090": GpuCompute({"fp8": 419.0, "bf16": 209.5, "fp16": 209.5, "tf32": 104.8, "fp32": 104.8,
                           "fp64": 1.6}, 1792.0, 170, 2.41),
}
# Profiles without figures yet, and why (compute_of says so).
MISSING = {"rtx-pro-5000-blackwell": "NVIDIA publishes only sparse tensor figures for it so far"}


def compute_of(profile_name: str) -> GpuCompute:
    """The compute figures of a catalogue profile; a clear error for one without them."""
    try:
        return COMPUTE[profile_name]
    except KeyError:
        why = MISSING.get(profile_name, "not a catalogue profile")
        raise KeyError(f"fakegpu: no compute figures for GPU profile {profile_name!r} ({why}); "
                       f"known: {', '.join(sorted(COMPUTE))}") from None
