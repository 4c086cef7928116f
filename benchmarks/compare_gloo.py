"""Our allreduce sweep and torch gloo's, in one run, with the ratio at each size.

    python benchmarks/compare_gloo.py [--ranks 4] [-b 1K] [-e 64M] [-f 4] [-n 20] [-w 5]
                                      [--latency-iterations 500] [--no-floor] [--json PATH]

Prints: our table (python -m fakegpu bandwidth), gloo's table (benchmarks/gloo_allreduce.py),
the algbw ratio ours/gloo per size for both placements, the median 4-byte allreduce latency
of both, and the floor (benchmarks/floor.py: copy in + one numpy reduction + copy out at
16 MiB) with how far above it we are.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from fakegpu.cli.bandwidth import format_table, sweep_sizes  # noqa: E402
from fakegpu.env import parse_size  # noqa: E402

import floor as floor_bench  # noqa: E402
import gloo_allreduce  # noqa: E402


def run_ours(ranks: int, extra: list[str]) -> list[dict]:
    with tempfile.TemporaryDirectory(prefix="fgpu-cmp-") as tmp:
        out = Path(tmp) / "ours.json"
        cmd = [sys.executable, "-m", "fakegpu", "bandwidth", "--ranks", str(ranks), "--op",
               "allreduce", "--dtype", "float32", "--json", str(out), *extra]
        done = subprocess.run(cmd, cwd=str(ROOT), capture_output=True, text=True, timeout=1800)
        if done.returncode != 0 or not out.exists():
            raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}):\n"
                               f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
        return json.loads(out.read_text())["rows"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("-b", "--minbytes", default="1K")
    p.add_argument("-e", "--maxbytes", default="64M")
    p.add_argument("-f", "--stepfactor", type=float, default=4.0)
    p.add_argument("-n", "--iterations", type=int, default=20)
    p.add_argument("-w", "--warmup", type=int, default=5)
    p.add_argument("--latency-iterations", type=int, default=500)
    p.add_argument("--no-floor", action="store_true")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)

    sizes = sweep_sizes(parse_size(args.minbytes), parse_size(args.maxbytes), args.stepfactor)
    sweep_flags = ["-b", args.minbytes, "-e", args.maxbytes, "-f", str(args.stepfactor),
                   "-n", str(args.iterations), "-w", str(args.warmup)]
    sweep = gloo_allreduce.gloo_sweep_object(sizes, args.iterations, args.warmup)

    ours = run_ours(args.ranks, sweep_flags)
    print(format_table(sweep, args.ranks, ours, f"fakegpu: allreduce float32, {args.ranks} ranks"))
    print()
    gloo = gloo_allreduce.run_gloo_sweep(args.ranks, sizes, args.iterations, args.warmup)
    print(format_table(sweep, args.ranks, gloo, f"torch gloo: allreduce float32, {args.ranks} ranks"))
    print()

    print("# algbw ratio fakegpu / gloo")
    print(f"# {'size (B)':>10} {'out-of-place':>13} {'in-place':>10}")
    ratios = []
    for mine, theirs in zip(ours, gloo):
        oop = mine["out_of_place"]["algbw"] / max(theirs["out_of_place"]["algbw"], 1e-12)
        inp = mine["in_place"]["algbw"] / max(theirs["in_place"]["algbw"], 1e-12)
        ratios.append({"size": mine["size"], "out_of_place": oop, "in_place": inp})
        print(f"  {mine['size']:>10} {oop:>12.2f}x {inp:>9.2f}x")
    print()

    lat_flags = ["--size", "4", "-n", str(args.latency_iterations), "-w", "50"]
    our_lat = run_ours(args.ranks, lat_flags)[0]
    gloo_lat = gloo_allreduce.run_gloo_sweep(args.ranks, [4], args.latency_iterations, 50)[0]
    print(f"# 4-byte allreduce median latency, {args.ranks} ranks: fakegpu "
          f"{our_lat['out_of_place']['time_us']:.1f} us (in place {our_lat['in_place']['time_us']:.1f}"
          f" us), gloo {gloo_lat['out_of_place']['time_us']:.1f} us "
          f"(in place {gloo_lat['in_place']['time_us']:.1f} us)")

    summary = {"ours": ours, "gloo": gloo, "ratios": ratios,
               "latency_4B_us": {"ours": our_lat, "gloo": gloo_lat}}
    if not args.no_floor:
        nbytes = 16 << 20
        seconds = floor_bench.measure_floor(args.ranks, nbytes)
        parts = floor_bench.measure_components(args.ranks, nbytes)
        at16 = next((r for r in ours if r["size"] == nbytes), None)
        for label, floor_s in (("pipeline", seconds), ("components", parts["floor_s"])):
            line = f"# floor ({label}) at 16 MiB: {floor_s * 1e3:.2f} ms = {nbytes / floor_s / 1e9:.2f} GB/s"
            if at16:
                for placement in ("out_of_place", "in_place"):
                    ours_s = at16[placement]["time_us"] / 1e6
                    line += f"; fakegpu {placement.replace('_', '-')} {ours_s * 1e3:.2f} ms = {ours_s / floor_s:.2f}x"
            print(line)
        summary["floor_16MiB_s"] = seconds
        summary["floor_components_16MiB"] = parts
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
