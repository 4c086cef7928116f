"""``python -m fakegpu fake COMMAND``: the fake-world tools in one place.

  contract      print the launch contract the environment describes (or its error)
  build-report  events -> whole-world cluster report (fakegpu.fake.build_report)
  memory        compare/show memory captures (fakegpu.fake.memory)
  example       the pipelined FSDP x TP example (fakegpu.fake.example)
"""
from __future__ import annotations

import json
import sys
from typing import Optional


def _contract(argv: list[str]) -> int:
    import argparse

    from .contract import LaunchContractError, resolve

    parser = argparse.ArgumentParser(prog="python -m fakegpu fake contract",
                                     description="Resolve the fake-world launch contract from the environment.")
    parser.add_argument("--pp-degree", type=int, help="pipeline degree (default FAKEGPU_PP_DEGREE or 1)")
    args = parser.parse_args(argv)
    try:
        lc = resolve(pp_degree=args.pp_degree)
    except LaunchContractError as exc:
        print(f"launch contract error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps({**lc.to_dict(), "spmd_size": lc.spmd_size,
                      "accounting_slice": list(lc.slice_of(lc.logical_rank))}, indent=2))
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name == "contract":
        return _contract(rest)
    if name == "build-report":
        from .build_report import main as run
    elif name == "memory":
        from .memory import main as run
    elif name == "example":
        from .example import main as run
    else:
        print(f"fakegpu fake: unknown command {name!r}\n\n{__doc__.strip()}", file=sys.stderr)
        return 2
    return int(run(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
