"""Does DDP overlap gradient all-reduces with backward on the fakegpu backend?

    python benchmarks/ddp_overlap.py [--nproc 2] [--steps 10] [--width 1024] [--layers 8]

Under ``python -m fakegpu run -- torchrun`` every rank times, per training step (median):
``compute``: forward + backward inside ``no_sync()`` (no communication); ``comm``: the same
gradients all-reduced bucket by bucket (what a program that reduces after backward adds);
``ddp``: an ordinary DDP step, whose bucket all-reduces run asynchronously while backward
goes on.  Overlap shows as ``ddp`` < ``compute + comm``; the script prints how much of the
communication was hidden.  Wall-clock on a CPU simulator: the coordinator's reduction
competes with backward for the same cores, so expect partial overlap on a small machine.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def worker(args) -> int:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    dist.init_process_group("fakegpu")
    rank = dist.get_rank()
    torch.manual_seed(0)
    layers = []
    for _ in range(args.layers):
        layers += [torch.nn.Linear(args.width, args.width), torch.nn.ReLU()]
    model = DDP(torch.nn.Sequential(*layers), bucket_cap_mb=args.bucket_mb)
    x = torch.randn(args.batch, args.width)

    def step():
        model(x).sum().backward()

    def timed(fn):
        times = []
        for i in range(args.steps + 2):
            dist.barrier()
            start = time.perf_counter()
            fn()
            if i >= 2:  # warm-up steps (bucket rebuild) not counted
                times.append(time.perf_counter() - start)
        return statistics.median(times)

    def compute():
        with model.no_sync():
            step()

    def comm():
        grads = [p.grad for p in model.parameters()]
        cap = args.bucket_mb * 2**20
        bucket, size = [], 0
        for g in reversed(grads):  # DDP's order: last layers first
            bucket.append(g)
            size += g.numel() * g.element_size()
            if size >= cap:
                dist.all_reduce_coalesced(bucket)
                bucket, size = [], 0
        if bucket:
            dist.all_reduce_coalesced(bucket)

    t_compute = timed(compute)  # also leaves gradients for comm() to reduce
    t_sync = timed(comm)
    t_ddp = timed(step)
    if rank == 0:
        Path(args.json).write_text(json.dumps(
            {"compute_s": t_compute, "comm_s": t_sync, "ddp_s": t_ddp,
             "params_mib": sum(p.numel() for p in model.parameters()) * 4 / 2**20}))
    dist.destroy_process_group()
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--bucket-mb", type=int, default=4)
    p.add_argument("--json", help=argparse.SUPPRESS)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return worker(args)
    out = Path(os.environ.get("TMPDIR", "/tmp")) / f"fakegpu-ddp-overlap-{os.getpid()}.json"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                f"--nproc-per-node={args.nproc}", str(Path(__file__).resolve()), "--worker",
                "--json", str(out), "--steps", str(args.steps), "--width", str(args.width),
                "--layers", str(args.layers), "--batch", str(args.batch),
                "--bucket-mb", str(args.bucket_mb)]
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    subprocess.run([sys.executable, "-m", "fakegpu", "run", "-q", "--", *torchrun], env=env,
                   check=True)
    r = json.loads(out.read_text())
    out.unlink()
    hidden = (r["compute_s"] + r["comm_s"] - r["ddp_s"]) / r["comm_s"] if r["comm_s"] > 0 else 0.0
    print(f"DDP, {args.nproc} ranks, {args.layers} x Linear({args.width}), {r['params_mib']:.0f} MiB "
          f"of gradients, {args.bucket_mb} MiB buckets (median step, rank 0)\n\n"
          "| compute only (ms) | all-reduce after backward (ms) | sum (ms) | DDP step (ms) | "
          "communication hidden |\n|---:|---:|---:|---:|---:|\n"
          f"| {r['compute_s'] * 1e3:.1f} | {r['comm_s'] * 1e3:.1f} | "
          f"{(r['compute_s'] + r['comm_s']) * 1e3:.1f} | {r['ddp_s'] * 1e3:.1f} | {hidden:.0%} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
