"""Side-by-side counts of PyTorch's generic distributed tests under gloo and under fakegpu.

    python verification/torch_suites/run.py [--world-sizes 2,4,8] [-k PATTERN ...] \\
        [--workdir DIR] [--json OUT]
    python verification/torch_suites/run.py --suites file \\
        --test-file ~/pytorch/test/distributed/tensor/test_redistribute.py

For every world size (and ``--suites ddp_rpc``: DDP under RPC, at its own world sizes;
``--suites file``: the test classes of PyTorch source files, at theirs) it
runs distributed_suite.py twice, with gloo groups and with fakegpu
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
              timeout_s: float, tests_file: str | None = None,
              suite: str = "distributed", test_files: list[str] = ()) -> dict[str, str]:
    label = run_label(suite, world_size, test_files)
    out = workdir / f"{backend}-{label}.json"
    log = workdir / f"{backend}-{label}.log"
    env = _base_env()
    env["PYTHONPATH"] = _pythonpath(str(REPO))
    env["OMP_NUM_THREADS"] = "1"
    coordinator = None
    if backend == "fakegpu":
        coordinator = Coordinator(workdir, workdir / f"report-{label}.json")
        env["FAKEGPU_COORDINATOR_ADDR"] = str(coordinator.socket)
        env["FAKEGPU_COORDINATOR_TRANSPORT"] = "unix"
        env["FAKEGPU_DIST_MODE"] = "simulate"
    argv = [sys.executable, str(SUITE), "--backend", backend, "--suite", suite,
            "--world-size", str(world_size), "--json", str(out)]
    for pattern in patterns:
        argv += ["-k", pattern]
    if tests_file:
        argv += ["--tests", str(Path(tests_file).resolve())]
    for path in test_files:
        argv += ["--test-file", str(Path(path).expanduser().resolve())]
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


def run_label(suite: str, world_size: int, test_files=()) -> str:
    """The key of one suite run: the world size for the generic suite (it runs at several),
    the suite's name for ddp_rpc, the files' names for test files (their classes fix their
    own world sizes)."""
    if suite == "file":
        return "+".join(Path(p).stem for p in test_files)
    return str(world_size) if suite == "distributed" else suite


def table(results: dict[str, dict[str, dict[str, str]]]) -> tuple[str, dict[str, list[str]]]:
    kinds = ("passed", "failed", "error", "skipped")
    lines = ["| run (world size or suite) | backend | " + " | ".join(kinds) + " | total |",
             "|---|---|" + "---:|" * (len(kinds) + 1)]
    regressions = {}
    for label, by_backend in results.items():
        for backend in BACKENDS:
            if backend not in by_backend:
                continue
            counts = collections.Counter(by_backend[backend].values())
            lines.append(f"| {label} | {backend} | "
                         + " | ".join(str(counts.get(k, 0)) for k in kinds)
                         + f" | {sum(counts.values())} |")
        if len(by_backend) < 2:
            continue  # one backend run alone: nothing to compare
        gloo, fake = by_backend["gloo"], by_backend["fakegpu"]
        regressions[label] = sorted(t for t, o in gloo.items()
                                    if o == "passed" and fake.get(t) != "passed")
    return "\n".join(lines), regressions


BACKENDS = ("gloo", "fakegpu")
SUITES = ("distributed", "ddp_rpc", "file")  # distributed_suite.py --suite


def _choices(parser: argparse.ArgumentParser, flag: str, text: str, allowed: tuple[str, ...]) -> list[str]:
    """A comma-separated subset of ``allowed``, else the parser's error naming the flag."""
    chosen = [x for x in text.split(",") if x]
    if not chosen or set(chosen) - set(allowed):
        parser.error(f"{flag}: expected {' and/or '.join(allowed)}, got {text!r}")
    return chosen


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", default="2,4,8", help="of the distributed suite")
    parser.add_argument("--suites", default="distributed",
                        help="distributed, ddp_rpc (DDP under RPC, its own world sizes) and/or file "
                             "(the test classes of --test-file)")
    parser.add_argument("--test-file", action="append", default=[], metavar="PATH",
                        help="a test file of a PyTorch source checkout for --suites file, e.g. "
                             "test/distributed/tensor/test_redistribute.py (repeatable)")
    parser.add_argument("-k", dest="patterns", action="append", default=[])
    parser.add_argument("--tests", metavar="FILE", help="exactly the tests named in FILE, one per line")
    parser.add_argument("--backends", default="gloo,fakegpu",
                        help="which to run (e.g. fakegpu alone, then gloo on what did not pass)")
    parser.add_argument("--workdir", help="keep logs, results and reports here")
    parser.add_argument("--json", help="write every test's outcome per world size and backend")
    parser.add_argument("--timeout", type=float, default=6 * 3600, help="seconds per suite run")
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.world_sizes.split(",") if s]
    backends = _choices(parser, "--backends", args.backends, BACKENDS)
    suites = _choices(parser, "--suites", args.suites, SUITES)
    if ("file" in suites) != bool(args.test_file):
        parser.error("--suites file needs --test-file PATH, and --test-file needs --suites file")
    for path in args.test_file:
        if not Path(path).expanduser().is_file():
            parser.error(f"--test-file: no such file: {path}")
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="fakegpu-torch-suites-"))
    workdir.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict[str, dict[str, str]]] = {}
    runs = [(suite, size) for suite in suites
            for size in (sizes if suite == "distributed" else [2])]  # ddp_rpc, file: unused
    for suite, world_size in runs:
        files = args.test_file if suite == "file" else []
        for backend in backends:
            results.setdefault(run_label(suite, world_size, files), {})[backend] = run_suite(
                backend, world_size, args.patterns, workdir, args.timeout, args.tests, suite, files)
    text, regressions = table(results)
    print(text)
    for label, names in regressions.items():
        if names:
            print(f"\npass under gloo, not under fakegpu, {label}: "
                  + ", ".join(names))
    print(f"\nlogs: {workdir}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1, sort_keys=True))
    return 1 if any(regressions.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
