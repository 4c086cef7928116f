"""The usage doc's direct checks, on the test suite's machinery (tests/helpers): a real
coordinator process, real rank processes driving the shim's C API through fakegpu.nccl, and
results compared bit for bit with what tests/helpers/scenarios.py computes independently.

verification/test_coordinator_smoke.py, test_allreduce_correctness.py,
test_allgather_correctness.py and test_group_semantics.py are thin entry points over this.
The shim: FAKEGPU_NCCL_LIBRARY, else the installed or ./build one (fakegpu.nccl_library_path()).
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Iterable, Optional

REPO = Path(__file__).resolve().parents[1]
for entry in (str(REPO / "tests"), str(REPO)):
    if entry not in sys.path:
        sys.path.insert(0, entry)

from fakegpu.nccl import DataType  # noqa: E402

from helpers import data  # noqa: E402
from helpers.coordinator import CoordinatorProcess  # noqa: E402
from helpers.ranks import RankRunFailed, run_ranks  # noqa: E402
from helpers.scenarios import expected_collective, group_plan  # noqa: E402
from helpers.shim import locate_shim  # noqa: E402

REDUCTIONS = ("sum", "prod", "max", "min", "avg")


class CheckFailed(Exception):
    pass


def parser(description: str, default_ranks: str = "2,4") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--ranks", default=default_ranks,
                   help=f"comma-separated world sizes to check (default {default_ranks})")
    p.add_argument("--transport", choices=("unix", "tcp", "both"), default="unix",
                   help="how the ranks reach the coordinator (default unix)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per run of the ranks")
    return p


def shim() -> str:
    library = locate_shim()
    if library is None:
        raise SystemExit("no libnccl.so.2 shim found: build it (cmake -S . -B build && cmake --build build) "
                         "or set FAKEGPU_NCCL_LIBRARY")
    return library


def world_sizes(text: str) -> list[int]:
    try:
        sizes = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"--ranks {text!r}: give comma-separated integers, e.g. 2,4") from None
    if not sizes or min(sizes) < 1:
        raise SystemExit(f"--ranks {text!r}: every world size must be at least 1")
    return sizes


def transports(choice: str) -> list[str]:
    return ["unix", "tcp"] if choice == "both" else [choice]


def collective_cases(kind: str, dtypes: Iterable[DataType], counts: Iterable[int],
                     reductions: Iterable[str] = ("sum",), inplace: Iterable[bool] = (False, True)) -> list[dict]:
    cases = []
    seed = 0
    for dtype in dtypes:
        for count in counts:
            for reduction in reductions:
                for in_place in inplace:
                    seed += 1
                    cases.append({"kind": kind, "dtype": int(dtype), "count": count,
                                  "reduction": reduction, "inplace": in_place, "seed": seed})
    return cases


def check_collectives(label: str, cases: list[dict], args) -> int:
    """Run every case (one scenario each) on every world size and transport; compare each
    rank's output with the independently computed one. Returns the process exit status."""
    library = shim()
    failures = 0
    for transport in transports(args.transport):
        for n in world_sizes(args.ranks):
            started = time.monotonic()
            try:
                with CoordinatorProcess(transport) as coord:
                    run = run_ranks(n, [("collective", c) for c in cases], coord, library=library,
                                    timeout_s=args.timeout)
            except RankRunFailed as exc:
                print(f"{label}: {n} ranks over {transport}: FAILED\n{exc}")
                failures += 1
                continue
            bad = []
            for index, case in enumerate(cases):
                for rank in range(n):
                    status, value = run.outcomes[rank][index]
                    if status != "ok":
                        bad.append(f"{case} rank {rank}: {value.splitlines()[0]}")
                        continue
                    want = expected_collective(n, rank, **case)
                    if not data.same_bits(value["out"], want):
                        bad.append(f"{case} rank {rank}: {data.describe_mismatch(value['out'], want)}")
            seconds = time.monotonic() - started
            if bad:
                failures += 1
                print(f"{label}: {n} ranks over {transport}: {len(bad)} wrong result(s), first: {bad[0]}")
            else:
                print(f"{label}: {n} ranks over {transport}: {len(cases)} calls, every rank's result "
                      f"bit-identical to the expected one [{seconds:.1f} s]")
    print(f"{label}: {'FAILED' if failures else 'OK'}")
    return 1 if failures else 0


def run_scenarios(n: int, scenarios, transport: str, timeout_s: float, *, extra_env: Optional[dict] = None,
                  op_timeout_ms: int = 30000):
    with CoordinatorProcess(transport, extra_env=extra_env) as coord:
        return run_ranks(n, scenarios, coord, library=shim(), timeout_s=timeout_s, op_timeout_ms=op_timeout_ms)


def main_of(check: Callable[[argparse.Namespace], int], p: argparse.ArgumentParser) -> Callable[[], int]:
    def main(argv: Optional[list] = None) -> int:
        args = p.parse_args(argv)
        try:
            return check(args)
        except CheckFailed as exc:
            print(f"FAILED: {exc}")
            return 1
    return main


def coordinator_cli(*args: str, env: Optional[dict] = None, timeout_s: float = 60.0) -> subprocess.CompletedProcess:
    import os

    full_env = dict(os.environ)
    full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), full_env.get("PYTHONPATH")]))
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-m", "fakegpu", "coordinator", *args], env=full_env,
                          capture_output=True, text=True, timeout=timeout_s, cwd=str(REPO))


__all__ = ["DataType", "REDUCTIONS", "CheckFailed", "parser", "shim", "world_sizes", "transports",
           "collective_cases", "check_collectives", "run_scenarios", "main_of", "coordinator_cli",
           "group_plan", "expected_collective", "data", "CoordinatorProcess", "run_ranks", "RankRunFailed"]
