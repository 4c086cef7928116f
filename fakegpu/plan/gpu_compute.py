"""What a GPU computes per second, as the compute model reads it.

The figures live on the catalogue's profiles (fakegpu/topology/profiles.py: dense peak
TFLOP/s per dtype, device-memory bandwidth, SM count, boost clock, board power, and the
public source of each row); this module turns a profile into the units the model uses
(FLOP/s, bytes/s).  There is one table, so a cluster YAML's GPU and the compute model can
never disagree about a card.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

from fakegpu.topology.profiles import PROFILES, GpuProfile, get_profile

_KINDS = ("fp64", "fp32", "tf32", "bf16", "fp16", "fp8")
# Under a power cap the GPU lowers its clock until the board draws no more than the cap. Dynamic
# power goes as f x V^2 and, over the DVFS range, V with f, so power ~ f^3 and the sustained
# clock ~ (cap / TDP)^(1/3): an H100 SXM capped at 500 W of its 700 W runs its math at 0.894 of
# the boost clock (TorchTitan's published H100 runs are at 500 W). Memory bandwidth is not
# scaled: HBM runs on its own clock.
POWER_EXPONENT = 1.0 / 3.0


def clock_factor(tdp_w: Optional[float], power_limit_w: Optional[float]) -> float:
    """Share of the boost clock a GPU sustains under ``power_limit_w`` (1 when uncapped)."""
    if not power_limit_w or not tdp_w or power_limit_w >= tdp_w:
        return 1.0
    return (power_limit_w / tdp_w) ** POWER_EXPONENT


@dataclass(frozen=True)
class GpuCompute:
    name: str                  # catalogue key
    peak_tflops: dict          # math kind -> dense TFLOP/s, or None where the GPU has no such path
    hbm_gbs: float             # device-memory bandwidth, GB/s
    sm_count: int
    boost_ghz: float

    def peak(self, kind: str) -> Optional[float]:
        """Dense FLOP/s for math kind ``kind``, or None when the GPU has no path for it."""
        tflops = self.peak_tflops.get(kind)
        return None if tflops is None else tflops * 1e12

    @property
    def hbm_bytes_per_s(self) -> float:
        return self.hbm_gbs * 1e9

    @classmethod
    def from_profile(cls, profile: GpuProfile) -> "GpuCompute":
        missing = [f for f in ("fp32_tflops", "bf16_tflops", "hbm_gbs", "sm_count", "boost_clock_ghz")
                   if getattr(profile, f) is None]
        if missing:
            raise KeyError(f"fakegpu: GPU profile {profile.name!r} has no {', '.join(missing)} "
                           f"(fakegpu/topology/profiles.py); the compute model needs them")
        factor = clock_factor(profile.tdp_w, profile.power_limit_w)
        peaks = {k: (None if profile.peak_tflops(k) is None else profile.peak_tflops(k) * factor)
                 for k in _KINDS}
        return cls(profile.name, peaks, profile.hbm_gbs, profile.sm_count, profile.boost_clock_ghz * factor)


COMPUTE: dict[str, GpuCompute] = {name: GpuCompute.from_profile(p) for name, p in PROFILES.items()}


def compute_of(gpu: Union[str, GpuProfile, GpuCompute]) -> GpuCompute:
    """The compute figures of a profile name (any spelling the YAML accepts), a profile, or
    figures already in hand."""
    if isinstance(gpu, GpuCompute):
        return gpu
    if isinstance(gpu, GpuProfile):
        return GpuCompute.from_profile(gpu)   # a profile built by hand (a test, a what-if card)
    return COMPUTE[get_profile(gpu).name]
