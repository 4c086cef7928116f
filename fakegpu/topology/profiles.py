"""Catalogue of GPU profiles a cluster YAML may name.

A profile caps what the cost model lets a GPU move inside its node: over NVLink when
the intra-node fabric is NVLink and every GPU on the path has a switched NVLink port,
otherwise over PCIe. Bandwidths are per direction, in GB/s (1e9 bytes/s), from the
vendors' published data sheets; memory is the marketed capacity in GB.

A profile also carries what the compute model (fakegpu.plan) needs: dense peak TFLOP/s per
dtype (no 2:4 sparsity), device-memory bandwidth, SM count, boost clock and board power, each
entry naming its public source in ``compute_source``.  The sources and how the figures were
checked are in docs/planning.md.
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
    # Compute figures, dense (no 2:4 sparsity), TFLOP/s at the boost clock (1e12 FLOP/s).
    # None means the GPU has no such path (fp8: no FP8 tensor cores before Ada/Hopper).
    fp32_tflops: Optional[float] = None     # FP32 on the CUDA cores (no tensor cores)
    tf32_tflops: Optional[float] = None     # TF32 tensor cores (an FP32 matmul with TF32 allowed)
    bf16_tflops: Optional[float] = None     # BF16 and FP16 tensor cores, FP32 accumulate
    fp8_tflops: Optional[float] = None      # FP8 (E4M3/E5M2) tensor cores, FP32 accumulate
    fp64_tflops: Optional[float] = None     # FP64 (on the tensor cores where the GPU has them)
    hbm_gbs: Optional[float] = None         # device-memory bandwidth, GB/s (HBM, or GDDR on PCIe cards)
    sm_count: Optional[int] = None          # streaming multiprocessors
    boost_clock_ghz: Optional[float] = None  # the clock the peaks above are quoted at
    tdp_w: Optional[float] = None           # board power the peaks are quoted under
    # A power cap below tdp_w (a YAML gpu's `power_limit_w`): the clocks, and with them the
    # tensor-core and CUDA-core peaks, drop (fakegpu.plan.gpu_compute); None: run at tdp_w.
    power_limit_w: Optional[float] = None
    compute_source: str = ""                # where the compute figures come from

    def peak_tflops(self, kind: str) -> Optional[float]:
        """Dense peak TFLOP/s for a math kind: "fp64", "fp32", "tf32", "bf16" (also "fp16"),
        "fp8"; None where the GPU has no such path."""
        kind = "bf16" if kind == "fp16" else kind
        if kind not in ("fp64", "fp32", "tf32", "bf16", "fp8"):
            raise ValueError(f"unknown math kind {kind!r}")
        return getattr(self, f"{kind}_tflops")

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
            "fp32_tflops": self.fp32_tflops,
            "tf32_tflops": self.tf32_tflops,
            "bf16_tflops": self.bf16_tflops,
            "fp8_tflops": self.fp8_tflops,
            "fp64_tflops": self.fp64_tflops,
            "hbm_gbs": self.hbm_gbs,
            "sm_count": self.sm_count,
            "boost_clock_ghz": self.boost_clock_ghz,
            "tdp_w": self.tdp_w,
            "power_limit_w": self.power_limit_w,
            "compute_source": self.compute_source,
        }


def _compute(source: str, *, fp64, fp32, tf32, bf16, fp8, hbm, sms, ghz, tdp) -> dict:
    return dict(fp64_tflops=fp64, fp32_tflops=fp32, tf32_tflops=tf32, bf16_tflops=bf16, fp8_tflops=fp8,
                hbm_gbs=hbm, sm_count=sms, boost_clock_ghz=ghz, tdp_w=tdp, compute_source=source)


# Compute figures per card.  NVIDIA's data sheets print tensor-core figures "with sparsity" (2:4
# structured, marked *), twice the dense rate used here.  FP32 on the CUDA cores is SMs x FP32
# lanes per SM (64 on A100's GA100, 128 on the others) x 2 x boost clock, which checks each row's
# SM count and clock against its FP32 figure (tests/unit/test_plan_compute.py does).
_A100 = "NVIDIA A100 Tensor Core GPU data sheet (SXM4): 19.5 FP32, 19.5 FP64 tensor, 156 TF32, 312 BF16"
_H100 = ("NVIDIA H100 Tensor Core GPU data sheet, H100 SXM: 67 FP32, 67 FP64 tensor, 989* TF32, 1979* BF16, "
         "3958* FP8, 3.35 TB/s; Hopper whitepaper: 132 SMs, 1.98 GHz")
_COMPUTE = {
    "a100": _compute(_A100 + ", 1,555 GB/s (40GB); 108 SMs at 1.41 GHz; no FP8 tensor cores (fp8: None)",
                     fp64=19.5, fp32=19.5, tf32=156.0, bf16=312.0, fp8=None, hbm=1555.0, sms=108, ghz=1.41,
                     tdp=400),
    "a100-80gb": _compute(_A100 + ", 2,039 GB/s (80GB); 108 SMs at 1.41 GHz; no FP8 tensor cores (fp8: None)",
                          fp64=19.5, fp32=19.5, tf32=156.0, bf16=312.0, fp8=None, hbm=2039.0, sms=108,
                          ghz=1.41, tdp=400),
    "h100": _compute(_H100, fp64=67.0, fp32=67.0, tf32=494.5, bf16=989.0, fp8=1979.0, hbm=3350.0, sms=132,
                     ghz=1.98, tdp=700),
    # Meta's Grand Teton H100 (TorchTitan's published runs): the SXM5 part with 96 GB of HBM2e at
    # 2.4 TB/s instead of 80 GB of HBM3 at 3.35 TB/s; TorchTitan's docs/performance.md.
    "h100-96gb": _compute(_H100 + "; memory: 96 GB HBM2e at 2.4 TB/s (TorchTitan docs/performance.md, "
                          "Grand Teton)",
                          fp64=67.0, fp32=67.0, tf32=494.5, bf16=989.0, fp8=1979.0, hbm=2400.0, sms=132,
                          ghz=1.98, tdp=700),
    "h100-pcie": _compute("NVIDIA H100 data sheet, H100 PCIe: 51 FP32, 51 FP64 tensor, 756* TF32, 1513* BF16, "
                          "3026* FP8, 2.0 TB/s; 114 SMs at 1.755 GHz",
                          fp64=51.0, fp32=51.0, tf32=378.0, bf16=756.0, fp8=1513.0, hbm=2000.0, sms=114,
                          ghz=1.755, tdp=350),
    # The export part keeps H100 SXM's SMs, clocks, tensor cores and HBM3; NVLink and FP64 are cut.
    "h800": _compute("NVIDIA H800 SXM5: tensor and FP32 figures and HBM3 as H100 SXM (" + _H100 + "); "
                     "FP64 1 TFLOP/s",
                     fp64=1.0, fp32=67.0, tf32=494.5, bf16=989.0, fp8=1979.0, hbm=3350.0, sms=132, ghz=1.98,
                     tdp=700),
    "h200": _compute("NVIDIA H200 Tensor Core GPU data sheet, H200 SXM: compute as H100 SXM, 4.8 TB/s HBM3e",
                     fp64=67.0, fp32=67.0, tf32=494.5, bf16=989.0, fp8=1979.0, hbm=4800.0, sms=132, ghz=1.98,
                     tdp=700),
    "b200": _compute("NVIDIA HGX B200 data sheet (1,000 W per GPU): 2.2* PF TF32, 4.5* PF BF16, 9* PF FP8, "
                     "37 FP64 tensor, 8 TB/s HBM3e; 148 SMs; FP32 = 148 x 128 x 2 x 1.98 GHz",
                     fp64=37.0, fp32=75.0, tf32=1100.0, bf16=2250.0, fp8=4500.0, hbm=8000.0, sms=148,
                     ghz=1.98, tdp=1000),
    "l40s": _compute("NVIDIA L40S data sheet: 91.6 FP32, 183 TF32, 362.05 BF16, 733 FP8 (dense; sparse x2), "
                     "864 GB/s GDDR6; 142 SMs at 2.52 GHz; FP64 1/64 of FP32",
                     fp64=1.43, fp32=91.6, tf32=183.0, bf16=362.05, fp8=733.0, hbm=864.0, sms=142, ghz=2.52,
                     tdp=350),
    # GeForce cards run FP16/BF16 with FP32 accumulate at half the FP16-accumulate rate; training
    # accumulates in FP32, so these are the FP32-accumulate figures of NVIDIA's whitepapers.
    "rtx4090": _compute("NVIDIA Ada Lovelace architecture whitepaper, RTX 4090: 82.6 FP32, 82.6 TF32, 165.2 "
                        "FP16/BF16 and 330.3 FP8 with FP32 accumulate, 1,008 GB/s GDDR6X; 128 SMs at 2.52 GHz",
                        fp64=1.29, fp32=82.6, tf32=82.6, bf16=165.2, fp8=330.3, hbm=1008.0, sms=128, ghz=2.52,
                        tdp=450),
    "rtx3090ti": _compute("NVIDIA Ampere GA102 whitepaper's rates at the 3090 Ti's 84 SMs and 1.86 GHz: "
                          "40 FP32, "
                          "40 TF32, 80 FP16/BF16 with FP32 accumulate, 1,008 GB/s GDDR6X; no FP8 (fp8: None)",
                          fp64=0.63, fp32=40.0, tf32=40.0, bf16=80.0, fp8=None, hbm=1008.0, sms=84, ghz=1.86,
                          tdp=450),
    "rtx5090": _compute("NVIDIA RTX Blackwell GPU architecture whitepaper, RTX 5090: 104.8 FP32; 3,352 AI TOPS "
                        "(FP4, sparse) = 419 FP16 dense with FP16 accumulate, half that with FP32 accumulate; "
                        "1,792 GB/s GDDR7; 170 SMs at 2.41 GHz",
                        fp64=1.64, fp32=104.8, tf32=104.8, bf16=209.5, fp8=419.0, hbm=1792.0, sms=170, ghz=2.41,
                        tdp=575),
    # Workstation cards run FP32 accumulate at the full rate (the RTX 6000 Ada data sheet prints the
    # same figure for both), so the dense tensor rates follow from NVIDIA's AI TOPS (FP4, sparse).
    "rtx-pro-5000-blackwell": _compute(
        "NVIDIA RTX PRO 5000 Blackwell product page: 65 FP32, 2,064 AI TOPS (FP4, sparse), 1,344 GB/s GDDR7, "
        "110 SMs; tensor rates DERIVED (not printed): 516 FP8 and 258 BF16 dense, TF32 half of BF16 as on "
        "Ada workstation cards; clock = 65 TF / (110 x 128 x 2)",
        fp64=1.02, fp32=65.0, tf32=129.0, bf16=258.0, fp8=516.0, hbm=1344.0, sms=110, ghz=2.31, tdp=300),
}


# PCIe x16 per-direction line rates: Gen4 ~32 GB/s, Gen5 ~64 GB/s.
# NVLink per direction: NVLink3 (A100) 300, NVLink4 (H100/H200) 450, NVLink5 (B200) 900.
_CATALOGUE = [
    GpuProfile("a100", "NVIDIA A100 SXM4 40GB (NVLink3)", 40, 300.0, 32.0, **_COMPUTE["a100"]),
    GpuProfile("a100-80gb", "NVIDIA A100 SXM4 80GB (NVLink3)", 80, 300.0, 32.0, **_COMPUTE["a100-80gb"]),
    GpuProfile("h100", "NVIDIA H100 SXM5 80GB (NVLink4)", 80, 450.0, 64.0, nvls=True, **_COMPUTE["h100"]),
    # The PCIe card's NVLink bridge joins two cards (a node's `nvlink_bridges`); NVIDIA quotes
    # 600 GB/s both ways, and nccl-tests reaches 116 GB/s busbw over it (NVIDIA/nccl-tests issue
    # 194), so the effective per-direction rate is 141 GB/s at NVLink's 0.82 efficiency.
    GpuProfile("h100-96gb", "NVIDIA H100 SXM5 96GB HBM2e (NVLink4)", 96, 450.0, 64.0, nvls=True,
               **_COMPUTE["h100-96gb"]),
    GpuProfile("h100-pcie", "NVIDIA H100 PCIe 80GB", 80, None, 64.0, nvlink_bridge_gbs=141.0,
               **_COMPUTE["h100-pcie"]),
    # The export H800 keeps NVLink4's switch and NVLS but 8 of its 18 links: 400 GB/s both ways.
    GpuProfile("h800", "NVIDIA H800 SXM5 80GB (NVLink4, 200 GB/s per direction)", 80, 200.0, 64.0, nvls=True,
               **_COMPUTE["h800"]),
    GpuProfile("h200", "NVIDIA H200 SXM 141GB (NVLink4)", 141, 450.0, 64.0, nvls=True, **_COMPUTE["h200"]),
    GpuProfile("b200", "NVIDIA B200 192GB (NVLink5)", 192, 900.0, 64.0, nvls=True, **_COMPUTE["b200"]),
    GpuProfile("l40s", "NVIDIA L40S 48GB (PCIe only)", 48, None, 32.0, **_COMPUTE["l40s"]),
    GpuProfile("rtx4090", "NVIDIA GeForce RTX 4090 24GB (PCIe only)", 24, None, 32.0, **_COMPUTE["rtx4090"]),
    # The 3090 Ti's NVLink bridge (112.5 GB/s both ways) joins two cards: `nvlink_bridges`.
    GpuProfile("rtx3090ti", "NVIDIA GeForce RTX 3090 Ti 24GB", 24, None, 32.0, nvlink_bridge_gbs=56.25,
               **_COMPUTE["rtx3090ti"]),
    # PCIe Gen5, but GPU-to-GPU traffic is held by the host: 4x RTX 5090 reach 35 GB/s allreduce
    # busbw, 8x 28 (NVIDIA/nccl issue 1639), i.e. 43.75 GB/s of line rate at PCIe's 0.80.
    GpuProfile("rtx5090", "NVIDIA GeForce RTX 5090 32GB (PCIe Gen5)", 32, None, 64.0, pcie_p2p_gbs=43.75,
               **_COMPUTE["rtx5090"]),
    GpuProfile("rtx-pro-5000-blackwell", "NVIDIA RTX PRO 5000 Blackwell 48GB (PCIe Gen5)", 48, None, 64.0,
               **_COMPUTE["rtx-pro-5000-blackwell"]),
]

PROFILES: dict[str, GpuProfile] = {p.name: p for p in _CATALOGUE}

# Spellings users write that mean a catalogue entry.
_ALIASES = {
    "a100-40gb": "a100",
    "a100-sxm": "a100",
    "a100-80g": "a100-80gb",
    "h100-sxm": "h100",
    "h100-80gb": "h100",
    "h100-hbm2e": "h100-96gb",
    "h100-sxm-96gb": "h100-96gb",
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
