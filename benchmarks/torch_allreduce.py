"""all_reduce on torch CPU tensors: backend fakegpu (shim + coordinator) against gloo, one run.

    python benchmarks/torch_allreduce.py                  # 2 ranks, 4 B .. 16 MiB
    python benchmarks/torch_allreduce.py --nproc 4 --max-bytes 64MiB --json out.json
    python benchmarks/torch_allreduce.py --nproc 4 --max-bytes 64MiB --shim-bench build/shim_bench
        (build/shim_bench: cmake --build build --target shim_bench)

It runs the same torchrun sweep twice — ``--backend gloo``, then ``--backend fakegpu`` under
``python -m fakegpu run`` (which starts the coordinator) — and prints one table: mean time
per call on rank 0, algbw / busbw (nccl-tests conventions: busbw = algbw * 2(n-1)/n) and the
fakegpu/gloo time ratio; with ``--shim-bench`` also the same sweep from C through the shim
(benchmarks/shim_bench.py) and the torch/C ratio. The "torch floor" column is the same loop in
one process on a gloo group of one rank: what ``dist.all_reduce`` costs through torch's Python
API and dispatch into a compiled backend that has no peer to wait for, i.e. the least any
backend, compiled or not, can take per call on this machine.  Results are checked: the sum must be exact for the chosen inputs.
Wall-clock figures of a simulator: they measure fakegpu's own overhead, not a network.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def parse_size(text: str) -> int:
    units = {"": 1, "b": 1, "k": 1024, "kib": 1024, "m": 1024**2, "mib": 1024**2, "g": 1024**3, "gib": 1024**3}
    t = text.strip().lower()
    number = t.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = t[len(number):]
    if unit not in units or not number:
        raise argparse.ArgumentTypeError(f"size {text!r}: use a number with an optional K/M/G(iB) suffix")
    return int(float(number) * units[unit])


def sizes(min_bytes: int, max_bytes: int, factor: int) -> list[int]:
    out, size = [], max(4, min_bytes)
    while size <= max_bytes:
        out.append(size)
        size *= factor
    return out


# -- worker (runs on every rank under torchrun) ---------------------------------------------------
def worker(args) -> int:
    import torch
    import torch.distributed as dist

    if args.backend == "fakegpu" and not hasattr(dist.Backend, "FAKEGPU"):
        sys.path.insert(0, str(REPO))
        import fakegpu.torch  # noqa: F401
    torch.set_num_threads(1)
    dist.init_process_group(args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = []
    for nbytes in sizes(args.min_bytes, args.max_bytes, args.factor):
        count = nbytes // 4
        # Small integers in float32: any summation order gives the exact same result.
        t = torch.full((count,), float(rank + 1))
        want = float(world * (world + 1) // 2)
        iters = max(args.min_iters, min(args.iters, int(args.budget_bytes // max(nbytes, 1))))
        for _ in range(args.warmup):
            t.fill_(rank + 1)
            dist.all_reduce(t)
        wrong = int((t != want).sum())
        dist.barrier()
        per_call = []
        started = time.perf_counter()
        for _ in range(iters):
            call = time.perf_counter()
            dist.all_reduce(t)
            per_call.append(time.perf_counter() - call)
        elapsed = (time.perf_counter() - started) / iters
        per_call.sort()
        rows.append({"bytes": nbytes, "count": count, "iters": iters, "time_us": elapsed * 1e6,
                     "median_us": per_call[len(per_call) // 2] * 1e6, "wrong": wrong})
    if rank == 0:
        Path(args.json).write_text(json.dumps({"backend": args.backend, "world": world, "rows": rows}))
    dist.destroy_process_group()
    return 0


# -- driver --------------------------------------------------------------------------------------
def _sweep(args, backend: str, out_json: Path, workdir: Path, nproc: int = 0) -> dict:
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc or args.nproc}",
                str(Path(__file__).resolve()), "--worker", "--backend", backend, "--json", str(out_json),
                "--min-bytes", str(args.min_bytes), "--max-bytes", str(args.max_bytes),
                "--factor", str(args.factor), "--iters", str(args.iters), "--min-iters", str(args.min_iters),
                "--warmup", str(args.warmup), "--budget-bytes", str(args.budget_bytes)]
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    command = torchrun
    if backend == "fakegpu":
        command = [sys.executable, "-m", "fakegpu", "run", "-q", "--report", str(workdir / "report.json"),
                   "--", *torchrun]
    log = workdir / f"{backend}-{nproc or args.nproc}.log"
    with open(log, "w") as sink:
        proc = subprocess.run(command, env=env, stdout=sink, stderr=subprocess.STDOUT, timeout=args.timeout)
    if proc.returncode != 0 or not out_json.is_file():
        sys.stderr.write(open(log).read()[-4000:])
        raise SystemExit(f"torch_allreduce: the {backend} sweep failed (status {proc.returncode}, log {log})")
    return json.loads(out_json.read_text())


def _fmt_size(n: int) -> str:
    for unit, scale in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if n >= scale:
            return f"{n / scale:g} {unit}"
    return f"{n} B"


def shim_sweep(args) -> dict:
    """bytes -> median us of the same all_reduce from C through the shim (no Python in the
    ranks), via benchmarks/shim_bench.py, so the table can put torch-level next to C-level."""
    command = [sys.executable, str(REPO / "benchmarks" / "shim_bench.py"), "--bench", args.shim_bench,
               "--ranks", str(args.nproc), "--min", str(max(4, args.min_bytes)), "--max", str(args.max_bytes),
               "--factor", str(args.factor), "--iters", str(args.iters)]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout,
                          env=dict(os.environ, PYTHONPATH=str(REPO)))
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-2000:] + proc.stderr[-4000:])
        raise SystemExit(f"torch_allreduce: the shim_bench sweep failed (status {proc.returncode})")
    medians = {}
    for line in proc.stdout.splitlines():
        fields = line.split()
        if len(fields) == 3 and not line.startswith("#"):
            medians[int(fields[0])] = float(fields[1])
    return medians


def table(gloo: dict, fake: dict, shim: dict = None, floor: dict = None) -> str:
    n = gloo["world"]
    factor = 2 * (n - 1) / n
    shim = shim or {}
    floors = {r["bytes"]: r.get("median_us", r["time_us"]) for r in (floor or {}).get("rows", [])}
    lines = [f"all_reduce, float32 sum, {n} ranks, torch CPU tensors (rank 0; median per call, "
             "busbw from the mean; torch floor: gloo with one rank, one process)", "",
             "| size | gloo (us) | gloo busbw (GB/s) | fakegpu torch (us) | fakegpu busbw (GB/s) | "
             "fakegpu C shim (us) | torch/C | torch floor (us) | fakegpu/gloo | #wrong |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for g, f in zip(gloo["rows"], fake["rows"]):
        gb = g["bytes"] / (g["time_us"] * 1e-6) / 1e9 * factor
        fb = f["bytes"] / (f["time_us"] * 1e-6) / 1e9 * factor
        gm, fm = g.get("median_us", g["time_us"]), f.get("median_us", f["time_us"])
        c = shim.get(f["bytes"])
        c_cols = f"{c:.1f} | {fm / c:.2f}x" if c else "- | -"
        lowest = floors.get(f["bytes"])
        floor_col = f"{lowest:.1f}" if lowest is not None else "-"
        lines.append(f"| {_fmt_size(g['bytes'])} | {gm:.1f} | {gb:.3f} | {fm:.1f} | {fb:.3f} | {c_cols} | "
                     f"{floor_col} | {fm / gm:.2f}x | {g['wrong'] + f['wrong']} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--min-bytes", type=parse_size, default=4)
    p.add_argument("--max-bytes", type=parse_size, default=16 * 1024**2)
    p.add_argument("--factor", type=int, default=4)
    p.add_argument("--iters", type=int, default=50, help="most timed calls per size")
    p.add_argument("--min-iters", type=int, default=3, help="fewest timed calls per size")
    p.add_argument("--budget-bytes", type=parse_size, default=64 * 1024**2,
                   help="bytes per size to spend timing (caps iterations for big sizes)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--json", help="worker: where rank 0 writes results; driver: combined output")
    p.add_argument("--shim-bench", help="a built native/tests/shim_bench (next to the libnccl.so.2 it "
                   "uses): adds the C-level median of the same sweep, run right after")
    p.add_argument("--backend", default="fakegpu", help=argparse.SUPPRESS)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return worker(args)
    with tempfile.TemporaryDirectory(prefix="fakegpu-torch-allreduce-") as tmp:
        workdir = Path(tmp)
        gloo = _sweep(args, "gloo", workdir / "gloo.json", workdir)
        fake = _sweep(args, "fakegpu", workdir / "fakegpu.json", workdir)
        floor = _sweep(args, "gloo", workdir / "floor.json", workdir, nproc=1)
    shim = shim_sweep(args) if args.shim_bench else {}
    print(table(gloo, fake, shim, floor))
    if args.json:
        Path(args.json).write_text(json.dumps({"gloo": gloo, "fakegpu": fake, "shim_median_us": shim,
                                               "torch_floor": floor}, indent=1))
    wrong = sum(r["wrong"] for r in gloo["rows"] + fake["rows"] + floor["rows"])
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
