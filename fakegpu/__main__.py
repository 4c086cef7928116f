"""`python -m fakegpu SUBCOMMAND ...` — each subcommand lives in fakegpu/cli/<name>.py.

Every such module exposes ``main(argv: list[str]) -> int``. `python -m fakegpu [fgpu options]
-- COMMAND` (options first) is `fgpu`, so the two launch styles take the same command lines.
"""
from __future__ import annotations

import importlib
import sys

SUBCOMMANDS = {
    "coordinator": ("fakegpu.cli.coordinator", "run or talk to a coordinator"),
    "bandwidth": ("fakegpu.cli.bandwidth", "measure collective bandwidth through the shim"),
    "report": ("fakegpu.cli.report", "check or show a cluster report"),
    "run": ("fakegpu.cli.run", "launch a command under fakegpu (same as `fgpu`)"),
    "doctor": ("fakegpu.cli.doctor", "show the environment fgpu would set and check the shim"),
    "model": ("fakegpu.cli.model", "the cost model's nccl-tests table for a cluster YAML (nothing runs)"),
    "plan": ("fakegpu.cli.plan", "predicted step time, tokens/s, MFU and memory of a job on a cluster YAML"),
    "demo": ("fakegpu.cli.demo", "train a small model on 4 CPU ranks over a 2-node topology"),
    "fake": ("fakegpu.fake.cli", "fake worlds: launch contract, event -> report, memory compare, example"),
}


def _usage() -> str:
    lines = ["usage: python -m fakegpu SUBCOMMAND [options]",
             "       python -m fakegpu [fgpu options] -- COMMAND [ARGS...]   (the same as fgpu)", "",
             "subcommands:"]
    for name, (_, help_text) in SUBCOMMANDS.items():
        lines.append(f"  {name:<12} {help_text}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name.startswith("-"):   # fgpu's own options (--mode, --cluster-config, ..., --): launch
        name, rest = "run", argv
    if name not in SUBCOMMANDS:
        print(f"fakegpu: unknown subcommand {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    from fakegpu import _deps

    prog = "fgpu" if name == "run" else f"fakegpu {name}"
    try:
        module = importlib.import_module(SUBCOMMANDS[name][0])
        return int(module.main(rest) or 0)
    except _deps.MissingPackage as exc:  # one line: what needs which package, and how to install it
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as exc:  # a top-level import of one of fakegpu's packages
        if exc.name not in _deps.PACKAGES:
            raise
        print(f"{prog}: error: {_deps.message(prog, [exc.name])}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
