"""Side-by-side counts of PyTorch's generic distributed tests under gloo and under fakegpu.

    python verification/torch_suites/run.py [--world-sizes 2,4,8] [-k PATTERN ...] \\
        [--workdir DIR] [--json OUT]

For every world size it runs distributed_suite.py twice, with gloo groups and with fakegpu
groups (against a coordinator it starts), and prints one table: passed / failed / errors /
skipped per backend, and the tests that pass under gloo but not under fakegpu.  The full
suite takes hours on a small machine (every test spawns its ranks); ``-k`` picks a subset.
It exits non-zero when a test passes under gloo and not under fakegpu.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(REPO / "verification"))
from run_case import Coordinator, _base_env, _pythonpath  # noqa: E402

SUITE = HERE / "distributed_suite.py"


def run_suite(backend: str, world_size: int, patterns: list[str], workdir: Path,
              timeout_s: float) -> dict[str, str]:
    out = workdir / f"{backend}-{world_size}.json"
    log = workdir / f"{backend}-{world_size}.log"
    env = _base_env()
    env["PYTHONPATH"] = _pythonpath(str(REPO))
    env["OMP_NUM_THREADS"] = "1"
    coordinator = None
    if backend == "fakegpu":
        coordinator = Coordinator(workdir, workdir / f"report-{world_size}.json")
        env["FAKEGPU_COORDINATOR_ADDR"] = str(coordinator.socket)
        env["FAKEGPU_COORDINATOR_TRANSPORT"] = "unix"
        env["FAKEGPU_DIST_MODE"] = "simulate"
    argv = [sys.executable, str(SUITE), "--backend", backend, "--world-size", str(world_size),
            "--json", str(out)]
    for pattern in patterns:
        argv += ["-k", pattern]
    try:
        with open(log, "w") as sink:
            subprocess.run(argv, env=env, stdout=sink, stderr=subprocess.STDOUT, cwd=workdir,
                           timeout=timeout_s, start_new_session=True)
    except subprocess.TimeoutExpired:
        pass  # what finished is in the json, if anything
    finally:
        if coordinator is not None:
            coordinator.stop()
    return json.loads(out.read_text()) if out.is_file() else {}


def table(results: dict[int, dict[str, dict[str, str]]]) -> tuple[str, dict[int, list[str]]]:
    kinds = ("passed", "failed", "error", "skipped")
    lines = ["| world size | backend | " + " | ".join(kinds) + " | total |",
             "|---:|---|" + "---:|" * (len(kinds) + 1)]
    regressions = {}
    for world_size, by_backend in sorted(results.items()):
        for backend in ("gloo", "fakegpu"):
            counts = collections.Counter(by_backend.get(backend, {}).values())
            lines.append(f"| {world_size} | {backend} | "
                         + " | ".join(str(counts.get(k, 0)) for k in kinds)
                         + f" | {sum(counts.values())} |")
        gloo, fake = by_backend.get("gloo", {}), by_backend.get("fakegpu", {})
        regressions[world_size] = sorted(t for t, o in gloo.items()
                                         if o == "passed" and fake.get(t) != "passed")
    return "\n".join(lines), regressions


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", default="2,4,8")
    parser.add_argument("-k", dest="patterns", action="append", default=[])
    parser.add_argument("--workdir", help="keep logs, results and reports here")
    parser.add_argument("--json", help="write every test's outcome per world size and backend")
    parser.add_argument("--timeout", type=float, default=6 * 3600, help="seconds per suite run")
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.world_sizes.split(",") if s]
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="fakegpu-torch-suites-"))
    workdir.mkdir(parents=True, exist_ok=True)
    results: dict[int, dict[str, dict[str, str]]] = {}
    for world_size in sizes:
        for backend in ("gloo", "fakegpu"):
            results.setdefault(world_size, {})[backend] = run_suite(
                backend, world_size, args.patterns, workdir, args.timeout)
    text, regressions = table(results)
    print(text)
    for world_size, names in regressions.items():
        if names:
            print(f"\npass under gloo, not under fakegpu, world size {world_size}: "
                  + ", ".join(names))
    print(f"\nlogs: {workdir}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1, sort_keys=True))
    return 1 if any(regressions.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
