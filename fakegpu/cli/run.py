"""`fgpu [options] [--] COMMAND ...` (also `python -m fakegpu run ...`).

Runs COMMAND with the fakegpu shim preloaded and a coordinator behind it, then prints where
the reports are. `fgpu doctor ...`, `fgpu demo ...` and `fgpu model ...` are forwarded to fakegpu/cli/doctor.py,
fakegpu/cli/demo.py and fakegpu/cli/model.py; to run a program that is itself called `doctor`,
`demo` or `model`, write `fgpu -- doctor`.
"""
from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

from fakegpu import launcher
from fakegpu._deps import MissingPackage

EPILOG = """\
examples:
  fgpu -- python train.py
  fgpu --cluster-config cluster_configs/h100-2node-8gpu-ib-8x400g.yaml -- torchrun --nproc-per-node 4 train.py
  fgpu --listen 0.0.0.0:29591 --token-file ~/.fakegpu-token -- torchrun --nnodes 2 ...
  fgpu doctor            check the shim, the environment and the coordinator
  fgpu model CLUSTER.yaml --op allreduce -b 8 -e 8G -f 2   the cost model's nccl-tests table
  fgpu plan --cluster-config CLUSTER.yaml -- torchrun --nnodes 16 --nproc-per-node 8 -m torchtitan.train ...
                         predicted step time, tokens/s per GPU, MFU and memory (docs/planning.md)
  fgpu demo              train a small FSDP2 x TP model on 4 CPU ranks over a 2-node topology

The command's exit status is fgpu's exit status (128+N when it died of signal N).
See docs/usage.md for every option and environment variable."""


def build_parser(prog: str = "fgpu") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog, usage=f"{prog} [options] [--] COMMAND [ARGS...]",
        description="Run COMMAND under fakegpu: NCCL calls go to a simulating coordinator.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    launcher.add_launch_options(parser)
    parser.add_argument("--list-cluster-configs", action="store_true",
                        help="list the cluster configs fakegpu ships (usable by bare name) and exit")
    parser.add_argument("command", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    return parser


def main(argv: Optional[Sequence[str]] = None, prog: str = "fgpu") -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "doctor":
        from fakegpu.cli import doctor

        return doctor.main(argv[1:], prog=f"{prog} doctor")
    if argv and argv[0] == "model":
        from fakegpu.cli import model

        return model.main(argv[1:], prog=f"{prog} model")
    if argv and argv[0] == "plan":
        from fakegpu.cli import plan

        return plan.main(argv[1:], prog=f"{prog} plan")
    if argv and argv[0] == "demo":
        from fakegpu.cli import demo

        return demo.main(argv[1:])
    parser = build_parser(prog)
    ns = parser.parse_args(argv)
    if ns.list_cluster_configs:
        return list_cluster_configs()
    command = list(ns.command)
    explicit = bool(command) and command[0] == "--"
    if explicit:
        command = command[1:]
    elif command and command[0].startswith("-"):
        # argparse hands an unknown option to the command; say so instead of running "-x".
        parser.error(f"unknown option {command[0]!r} (put the command after `--` if it starts with '-')")
    if not command:
        parser.error("no command given")
    try:
        cfg = launcher.config_from_args(ns)
        warn_about_cluster_config(cfg.cluster_config, prog)
        return launcher.launch(cfg, command)
    except launcher.LaunchError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return exc.exit_status
    except MissingPackage as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2


def list_cluster_configs() -> int:
    """One line per shipped config: the name to pass, its cluster name, ranks and nodes, and where it is."""
    from fakegpu.topology import load_cluster_config
    from fakegpu.topology.bundled import bundled_cluster_config, bundled_names

    names = bundled_names()
    if not names:
        print("no bundled cluster configs found", file=sys.stderr)
        return 1
    for name in names:
        path = bundled_cluster_config(name)
        try:
            topo = load_cluster_config(str(path))
            what = f"{topo.world_size:>4} ranks on {len(topo.nodes)} node(s)"
        except Exception as exc:  # listed anyway: the user should see a broken file too
            what = f"unreadable: {exc}"
        print(f"{name:44} {what}  {path}")
    return 0


def warn_about_cluster_config(path, prog: str) -> None:
    """Print the YAML's plausibility warnings (a units slip, typically) before the job starts;
    the coordinator also keeps them in the report's notes. Errors are left to the coordinator,
    which reports them with the file's line numbers."""
    if path is None:
        return
    try:
        from fakegpu.topology import load_cluster_config

        topo = load_cluster_config(str(path))
    except Exception:
        return
    for warning in topo.warnings:
        print(f"{prog}: warning: {warning}", file=sys.stderr, flush=True)


def console_main() -> None:
    """Entry point of the `fgpu` console script."""
    try:
        status = main()
    except MissingPackage as exc:  # from `fgpu doctor`, `model`, `demo`, --list-cluster-configs
        print(f"fgpu: error: {exc}", file=sys.stderr)
        status = 2
    sys.exit(status)


if __name__ == "__main__":
    console_main()
