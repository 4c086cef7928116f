"""Before / after: benchmarks/compare_gloo.py in two checkouts, interleaved, with one table.

    python benchmarks/compare_trees.py BEFORE_DIR AFTER_DIR [--rounds 4] [--paths arena,coord]
                                       [--workdir DIR] [-- compare_gloo arguments ...]

Each checkout needs its own built shim (BEFORE_DIR/build/libnccl.so.2, e.g. a `git worktree`
of the old commit built with cmake). Each round runs compare_gloo.py once per path and tree,
alternating the trees (before, after, before, after, ...), so a slow spell of the machine hits
both. ``arena`` is the default host-local path, ``coord`` the coordinator path
(FAKEGPU_LOCAL_COLLECTIVES=0). The table gives, per path and size, the median over the rounds of
the faster of in-place and out-of-place (the 4 B row: compare_gloo's latency median), and the
per-round rows follow it: with more ranks than cores a run can fall into a slow mode as a whole,
and the rows show which rounds did.

Defaults: --ranks 4 -b 4K -e 64M -f 4 -n 20 -w 5 (pass others after ``--``).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

DEFAULT_ARGS = ["--ranks", "4", "-b", "4K", "-e", "64M", "-f", "4", "-n", "20", "-w", "5"]
PATH_ENV = {"arena": {}, "coord": {"FAKEGPU_LOCAL_COLLECTIVES": "0"}}


def run_once(tree: Path, path: str, args: list[str], out: Path) -> dict:
    library = tree / "build" / "libnccl.so.2"
    if not library.exists():
        raise SystemExit(f"{library} does not exist: build that checkout first (cmake -S {tree} -B {tree}/build)")
    env = {**os.environ, **PATH_ENV[path], "PYTHONPATH": str(tree), "FAKEGPU_NCCL_LIBRARY": str(library)}
    cmd = [sys.executable, str(tree / "benchmarks" / "compare_gloo.py"), *args, "--json", str(out)]
    done = subprocess.run(cmd, cwd=str(tree), env=env, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0 or not out.exists():
        raise SystemExit(f"{' '.join(cmd)} failed ({done.returncode}) in {tree}:\n{done.stderr[-3000:]}")
    return json.loads(out.read_text())


def times(result: dict) -> dict[int, float]:
    """size -> microseconds (the faster placement); size 4 is the latency median."""
    best = lambda r: min(r["out_of_place"]["time_us"], r["in_place"]["time_us"])  # noqa: E731
    out = {r["size"]: best(r) for r in result["ours"]}
    out[4] = best(result["latency_4B_us"]["ours"])
    return out


def table(runs: dict[tuple[str, str], list[dict[int, float]]], paths: list[str]) -> str:
    lines = ["| path | size (B) | before | after | after / before |", "|---|---:|---:|---:|---:|"]
    for path in paths:
        before, after = runs[(path, "before")], runs[(path, "after")]
        for size in sorted(before[0]):
            b = statistics.median(r[size] for r in before)
            a = statistics.median(r[size] for r in after)
            lines.append(f"| {path} | {size} | {b:.1f} us | {a:.1f} us | {a / b:.2f} |")
    lines.append("")
    for (path, which), rounds in runs.items():
        for i, r in enumerate(rounds, 1):
            lines.append(f"{path} {which} round {i}: " + " ".join(f"{r[s]:.0f}" for s in sorted(r)))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("before", type=Path)
    p.add_argument("after", type=Path)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--paths", default="arena,coord", help="comma list of arena, coord")
    p.add_argument("--workdir", type=Path, default=None, help="keep each run's JSON here")
    a = p.parse_args(argv)
    paths = [x for x in a.paths.split(",") if x]
    unknown = [x for x in paths if x not in PATH_ENV]
    if unknown or a.rounds < 1:
        p.error(f"--paths takes {', '.join(PATH_ENV)} (got {a.paths!r}); --rounds at least 1")
    args = extra or DEFAULT_ARGS
    workdir = a.workdir or Path(tempfile.mkdtemp(prefix="fgpu-trees-"))
    workdir.mkdir(parents=True, exist_ok=True)
    runs: dict[tuple[str, str], list[dict[int, float]]] = {(path, w): [] for path in paths for w in ("before", "after")}
    for i in range(1, a.rounds + 1):
        for path in paths:
            for which, tree in (("before", a.before), ("after", a.after)):
                result = run_once(tree.resolve(), path, args, workdir / f"{which}_{path}_r{i}.json")
                runs[(path, which)].append(times(result))
                print(f"# round {i} {path} {which} done", file=sys.stderr, flush=True)
    print(table(runs, paths))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
