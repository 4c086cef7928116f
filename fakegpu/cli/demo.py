"""`python -m fakegpu demo` (also `fgpu demo`): a real 4-rank torchrun job on CPU.

It trains a small transformer with FSDP2 x tensor parallel (a 2 x 2 DeviceMesh, "dp" x "tp")
for a few steps over the `fakegpu` torch backend, with the bundled two-node topology, and
prints the loss per step, then the report summary and where the reports are.  The rank code
is fakegpu/torch/demo_worker.py; fgpu (fakegpu/launcher.py) starts the coordinator.

Needs torch (CPU build is enough): `pip install torch==2.13.0`.
"""
from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path
from typing import Optional, Sequence

DEFAULT_TOPOLOGY = "dev-2node-2gpu.yaml"
DEFAULT_OUT = "."   # like fgpu: fakegpu-report.json and .md in the directory it runs from


def bundled_topology() -> Optional[Path]:
    """The 2-node x 2-rank cluster config, from an installed package or a source checkout."""
    from fakegpu.topology.bundled import bundled_cluster_config

    return bundled_cluster_config(DEFAULT_TOPOLOGY)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="fakegpu demo",
        description="Train a small transformer with FSDP2 x TP on 4 CPU ranks over a 2-node topology.")
    p.add_argument("--steps", type=int, default=5, help="training steps (default 5)")
    p.add_argument("--cluster-config", metavar="YAML",
                   help=f"cluster topology (default: the bundled {DEFAULT_TOPOLOGY})")
    p.add_argument("--out", default=DEFAULT_OUT, metavar="DIR",
                   help="folder for fakegpu-report.json and fakegpu-report.md (default: the current directory)")
    p.add_argument("-v", "--verbose", action="store_true", help="show the coordinator's log")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.steps < 1:
        print("fakegpu demo: --steps must be at least 1", file=sys.stderr)
        return 2
    if importlib.util.find_spec("torch") is None:
        print("fakegpu demo: needs PyTorch; install the CPU build with `pip install torch==2.13.0`",
              file=sys.stderr)
        return 2
    topology = Path(args.cluster_config) if args.cluster_config else bundled_topology()
    if topology is None or not topology.is_file():
        print(f"fakegpu demo: cluster config {args.cluster_config or DEFAULT_TOPOLOGY} not found; "
              "pass --cluster-config PATH", file=sys.stderr)
        return 2
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    from fakegpu.launcher import DEFAULT_REPORT_NAME

    report = out / DEFAULT_REPORT_NAME

    import os

    from fakegpu.cli import run

    # torchrun warns about thread oversubscription unless this is set; one thread per rank
    # is what it would pick anyway.
    os.environ.setdefault("OMP_NUM_THREADS", "1")

    print(f"fakegpu demo: 4 ranks (torchrun, CPU) on topology {topology}", flush=True)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4",
               "-m", "fakegpu.torch.demo_worker", "--steps", str(args.steps)]
    fgpu_args = ["--cluster-config", str(topology), "--report", str(report)]
    if args.verbose:
        fgpu_args.append("--verbose")
    status = run.main([*fgpu_args, "--", *command], prog="fakegpu demo")
    if status != 0:
        print(f"fakegpu demo: the job failed with status {status}", file=sys.stderr)
    return status


if __name__ == "__main__":
    sys.exit(main())
