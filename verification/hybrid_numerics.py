"""What run_hybrid_ddp_numerics.py, run_hybrid_fsdp_numerics.py and run_hybrid_fsdp2_numerics.py
share: they name cases of verification/gpu/workloads.py and hand them to verification/gpu/run_all.py,
which runs each as `fgpu --mode hybrid -- torchrun ... workloads.py CASE` and compares every
rank's final parameters with a single-process reference.

On a host where torch sees a CUDA device that is real CUDA compute with simulated communication
(backend nccl through fakegpu's libnccl.so.2), all ranks sharing the GPU. Where it sees none, the
same cases run in their CPU form — CPU tensors, backend "fakegpu", simulate mode — and the script
says so: the numerics of the parallel algorithm and of fakegpu's collectives are checked, CUDA's
are not. --cpu asks for the CPU form on a GPU host too.
"""
from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
RUN_ALL = HERE / "gpu" / "run_all.py"


def add_common_options(p: argparse.ArgumentParser, default_world_size: int = 2) -> None:
    p.add_argument("--world-size", type=int, default=default_world_size,
                   help=f"ranks, all on this host's one GPU (default {default_world_size})")
    p.add_argument("--out", help="results folder (default: a new temporary folder)")
    p.add_argument("--cpu", action="store_true", help="the CPU form even when a GPU is visible")
    p.add_argument("--case-timeout", type=float, default=300.0, help="seconds per case (default 300)")


def cuda_visible() -> bool:
    if importlib.util.find_spec("torch") is None:
        raise SystemExit("these checks need PyTorch (pip install torch)")
    import torch

    return bool(torch.cuda.is_available() and torch.cuda.device_count() > 0)


def run(label: str, cases: list[str], args: argparse.Namespace) -> int:
    if args.world_size < 2:
        raise SystemExit("--world-size must be at least 2")
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="fgpu-numerics-"))
    gpu = cuda_visible() and not args.cpu
    if gpu:
        print(f"{label}: CUDA device found: hybrid mode, {args.world_size} ranks computing on the GPU, "
              "communication simulated by fakegpu", flush=True)
    else:
        why = "--cpu given" if args.cpu else "no CUDA device visible to torch"
        print(f"{label}: {why}: running the CPU form (CPU tensors, backend fakegpu, simulate mode); "
              "on a CUDA host the same cases run on the GPU in hybrid mode", flush=True)
    cmd = [sys.executable, str(RUN_ALL), "--out", str(out), "--cases", ",".join(cases),
           "--nproc", str(args.world_size), "--case-timeout", str(args.case_timeout)]
    if not gpu:
        cmd.append("--dry-run")
    status = subprocess.run(cmd).returncode
    print(f"{label}: {'OK' if status == 0 else 'FAILED'} ({'GPU' if gpu else 'CPU form'}); "
          f"per-rank results and reports under {out}")
    return status
