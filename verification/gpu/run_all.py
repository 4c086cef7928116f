"""The GPU verification in one command: 4 ranks on ONE GPU, backend nccl, under fakegpu's hybrid mode.

    python verification/gpu/run_all.py --out results/          # on a machine with a GPU (< 8 min)
    python verification/gpu/run_all.py --dry-run --out /tmp/x  # the same cases on CPU (fakegpu backend)

For every case it runs

    python -m fakegpu run --mode hybrid [--report OUT/CASE/fakegpu-report.json] -- \
        torchrun --standalone --nproc-per-node 4 verification/gpu/workloads.py CASE --out OUT/CASE

(`fgpu --mode hybrid -- torchrun ...`): each rank computes on the GPU, ProcessGroupNCCL talks to
fakegpu's libnccl.so.2 and the coordinator computes every collective. Each rank compares its
final parameters with a single-process reference (workloads.py) and writes OUT/CASE/rank<R>.json.
The all_reduce bandwidth sweep on device buffers goes to OUT/bandwidth/bandwidth.json. Everything
is summarised in OUT/summary.json and OUT/summary.md; the exit status is 0 only if every case
passed.

The shim: FAKEGPU_NCCL_LIBRARY, an installed fakegpu, or (when neither exists) built here with
CMake into OUT/shim-build. --dry-run replaces cuda/nccl/hybrid by cpu/fakegpu/simulate, to check
the workloads and the references without a GPU (slow on small machines: use --cases).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
# This checkout's fakegpu before any installed copy: importing workloads imports torch, whose
# backend entry points import whichever fakegpu comes first on sys.path (and its shim).
sys.path[:0] = [str(HERE), str(REPO)]
from workloads import CASES, SUITE  # noqa: E402

DEFAULT_CASE_TIMEOUT_S = 150


def find_or_build_shim(out: Path) -> str:
    env_path = os.environ.get("FAKEGPU_NCCL_LIBRARY")
    if env_path and Path(env_path).is_file():
        return env_path
    sys.path.insert(0, str(REPO))
    try:
        import fakegpu
        path = fakegpu.nccl_library_path()
        if path and Path(path).is_file():
            return str(path)
    except Exception:  # not installed / not built: build it below
        pass
    build = out / "shim-build"
    for step in (["cmake", "-S", str(REPO), "-B", str(build), "-DCMAKE_BUILD_TYPE=RelWithDebInfo"],
                 ["cmake", "--build", str(build), "-j", str(os.cpu_count() or 2), "--target", "nccl"]):
        proc = subprocess.run(step, capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            raise SystemExit(f"building the shim failed: {' '.join(step)}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return str(build / "libnccl.so.2")


def case_command(case: str, args, case_dir: Path) -> list[str]:
    mode = "simulate" if args.dry_run else "hybrid"
    device, backend = ("cpu", "fakegpu") if args.dry_run else ("cuda", "nccl")
    cmd = [sys.executable, "-m", "fakegpu", "run", "--mode", mode, "--quiet",
           "--report", str(case_dir / "fakegpu-report.json"), "--",
           sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.nproc),
           str(HERE / "workloads.py"), case, "--out", str(case_dir), "--device", device, "--backend", backend]
    if case == "bandwidth":
        cmd += ["--max-bytes", str(args.max_bytes)]
    return cmd


def run_case(case: str, args, shim: str) -> dict:
    case_dir = Path(args.out) / case
    if case_dir.exists():
        shutil.rmtree(case_dir)
    case_dir.mkdir(parents=True)
    env = dict(os.environ)
    env["FAKEGPU_NCCL_LIBRARY"] = shim
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    env.setdefault("OMP_NUM_THREADS", "1")
    if args.dry_run:
        # CPU tensors on purpose: no fake CUDA devices (fgpu's simulate-mode default) in the way.
        env.setdefault("FAKEGPU_FAKE_CUDA", "0")
    cmd = case_command(case, args, case_dir)
    t0 = time.monotonic()
    with open(case_dir / "log.txt", "w") as log:
        log.write("$ " + " ".join(cmd) + "\n")
        log.flush()
        try:
            proc = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=args.case_timeout,
                                  cwd=str(case_dir))
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    seconds = time.monotonic() - t0
    ranks = []
    for r in range(args.nproc):
        f = case_dir / f"rank{r}.json"
        ranks.append(json.loads(f.read_text()) if f.exists() else {"rank": r, "ok": False, "missing": True})
    ok = rc == 0 and all(x.get("ok") for x in ranks)
    summary = {"case": case, "ok": ok, "exit": rc, "seconds": round(seconds, 1),
               "max_abs_err": max((x.get("max_abs_err", 0.0) for x in ranks), default=None),
               "err_over_update": max((x.get("err_over_update", 0.0) for x in ranks), default=None)}
    if case == "bandwidth" and (case_dir / "bandwidth.json").exists():
        summary["bandwidth"] = json.loads((case_dir / "bandwidth.json").read_text())["rows"]
    if not ok:
        summary["log_tail"] = (case_dir / "log.txt").read_text()[-3000:]
    return summary


def environment() -> dict:
    """What the results were measured on (torch, CUDA, the GPU), for the closing note."""
    info = {"python": sys.version.split()[0]}
    try:
        import torch
        info.update(torch=torch.__version__, cuda=torch.version.cuda)
        if torch.cuda.is_available():
            info.update(gpu=torch.cuda.get_device_name(0), gpus=torch.cuda.device_count())
    except Exception as exc:  # the summary must still be written
        info["torch_error"] = repr(exc)
    return info


def write_summary(out: Path, results: list, args) -> None:
    if not hasattr(args, "environment"):
        args.environment = environment()
    (out / "summary.json").write_text(json.dumps({"dry_run": args.dry_run, "nproc": args.nproc,
                                                  "environment": args.environment, "results": results}, indent=1))
    lines = [f"# fakegpu GPU verification ({'dry run on CPU' if args.dry_run else 'hybrid mode, backend nccl'}, "
             f"{args.nproc} ranks)", "", f"Environment: {json.dumps(args.environment)}", "", "| case | ok | seconds | max abs err | err / update |", "|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['case']} | {'yes' if r['ok'] else 'NO'} | {r['seconds']} | "
                     f"{r.get('max_abs_err') if r.get('max_abs_err') is not None else ''} | "
                     f"{r.get('err_over_update') if r.get('err_over_update') is not None else ''} |")
    bw = next((r.get("bandwidth") for r in results if r.get("bandwidth")), None)
    if bw:
        lines += ["", "## all_reduce on device buffers", "", "| bytes | time (us) | algbw (GB/s) | busbw (GB/s) | ok |",
                  "|---|---|---|---|---|"]
        for row in bw:
            lines.append(f"| {row['bytes']} | {row['time_us']:.1f} | {row['algbw_GBps']:.3f} | "
                         f"{row['busbw_GBps']:.3f} | {row['check_ok']} |")
    (out / "summary.md").write_text("\n".join(lines) + "\n")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="results directory (created)")
    p.add_argument("--cases", default=",".join(SUITE),
                   help=f"comma-separated cases (default: {', '.join(SUITE)}); any of: {', '.join(CASES)}")
    p.add_argument("--nproc", type=int, default=4, help="ranks, all on one GPU (default 4)")
    p.add_argument("--dry-run", action="store_true", help="CPU, fakegpu backend, simulate mode (no GPU)")
    p.add_argument("--max-bytes", type=int, default=64 << 20, help="largest all_reduce of the sweep")
    p.add_argument("--case-timeout", type=float, default=DEFAULT_CASE_TIMEOUT_S, help="seconds per case")
    p.add_argument("--print-commands", action="store_true", help="print what would run and exit")
    args = p.parse_args(argv)
    cases = [c for c in args.cases.split(",") if c]
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        p.error(f"unknown case(s) {unknown}; choose from {', '.join(CASES)}")
    if args.nproc < 2:
        p.error("--nproc must be at least 2")
    args.case_list = cases
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    out = Path(args.out).resolve()
    args.out = str(out)
    out.mkdir(parents=True, exist_ok=True)
    if args.print_commands:
        for case in args.case_list:
            print(" ".join(case_command(case, args, out / case)))
        return 0
    if not args.dry_run:
        import torch
        if not torch.cuda.is_available():
            raise SystemExit("no CUDA device visible to torch: use --dry-run for the CPU check")
    shim = find_or_build_shim(out)
    results = []
    t0 = time.monotonic()
    for case in args.case_list:
        r = run_case(case, args, shim)
        results.append(r)
        print(f"{case:18s} {'ok' if r['ok'] else 'FAILED'}  {r['seconds']:6.1f}s  "
              f"max_abs_err={r.get('max_abs_err')}", flush=True)
        write_summary(out, results, args)
    print(f"total {time.monotonic() - t0:.0f}s; summary in {out / 'summary.md'}")
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
