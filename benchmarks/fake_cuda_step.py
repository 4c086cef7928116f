"""Training-step time under fake CUDA devices against the hand-ported CPU program.

    python benchmarks/fake_cuda_step.py                 # 2 ranks, DDP MLP, 40 timed steps
    python benchmarks/fake_cuda_step.py --nproc 4 --width 1024 --json out.json

Both runs go through ``python -m fakegpu run -- torchrun`` with the same coordinator path:

- ``gpu``: the program as written for GPUs ("cuda", ``init_process_group("nccl")``,
  ``DDP(device_ids=[local_rank])``) on fake CUDA devices;
- ``port``: the same program ported by hand to the CPU on the ``fakegpu`` backend, with fake
  CUDA devices off (``FAKEGPU_FAKE_CUDA=0``).

It prints the median step time of rank 0 for each and their ratio (issue 16's target: at most
1.3), and checks that both runs computed the same losses.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def worker(args) -> int:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    local_rank = int(os.environ["LOCAL_RANK"])
    if args.variant == "gpu":
        torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl")
        device = torch.device("cuda", local_rank)
    else:
        dist.init_process_group("fakegpu")
        device = torch.device("cpu")
    torch.manual_seed(0)
    layers = []
    for _ in range(args.depth):
        layers += [torch.nn.Linear(args.width, args.width), torch.nn.GELU()]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(args.width, 10)).to(device)
    ddp = DDP(model, device_ids=[local_rank]) if args.variant == "gpu" else DDP(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    torch.manual_seed(1 + dist.get_rank())
    times, losses = [], []
    profiler = None
    if args.profile and dist.get_rank() == 0:
        import cProfile

        profiler = cProfile.Profile()
    for step in range(args.warmup + args.steps):
        if profiler is not None and step == args.warmup:
            profiler.enable()
        x = torch.randn(args.batch, args.width, device=device)
        y = torch.randint(0, 10, (args.batch,), device=device)
        start = time.perf_counter()
        loss = torch.nn.functional.cross_entropy(ddp(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if args.variant == "gpu":
            torch.cuda.synchronize()
        losses.append(loss.item())
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
    if profiler is not None:
        profiler.disable()
        profiler.dump_stats(f"{args.profile}.{args.variant}.pstats")
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps({"times": times, "losses": losses}))
    dist.destroy_process_group()
    return 0


def run_variant(args, variant: str, workdir: Path) -> dict:
    out = workdir / f"{variant}.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("FAKEGPU_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    if os.environ.get("FAKEGPU_NCCL_LIBRARY"):
        env["FAKEGPU_NCCL_LIBRARY"] = os.environ["FAKEGPU_NCCL_LIBRARY"]
    env["FAKEGPU_FAKE_CUDA"] = "1" if variant == "gpu" else "0"
    env["FAKEGPU_FAKE_CUDA_MEMORY"] = {"native": "1", "python": "python", "off": "0"}[args.memory]
    env["OMP_NUM_THREADS"] = str(args.threads)
    command = [sys.executable, "-m", "fakegpu", "run", "-q", "--device-count", str(args.nproc),
               "--report", str(workdir / f"{variant}-report.json"), "--",
               sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", str(args.nproc), __file__, "--worker", "--variant", variant,
               "--out", str(out), "--width", str(args.width), "--depth", str(args.depth),
               "--batch", str(args.batch), "--steps", str(args.steps), "--warmup", str(args.warmup)]
    if args.profile:
        command += ["--profile", str(Path(args.profile).resolve())]
    done = subprocess.run(command, env=env, cwd=workdir, capture_output=True, text=True,
                          timeout=args.timeout, stdin=subprocess.DEVNULL)
    if done.returncode != 0:
        raise SystemExit(f"{variant} run failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(out.read_text())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--variant", choices=["gpu", "port"], default="gpu", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS per rank")
    parser.add_argument("--repeats", type=int, default=1, help="alternate gpu/port runs this many times")
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument("--memory", choices=["native", "python", "off"], default="native",
                        help="the fake-CUDA variant's memory accounting: the C++ storage tracker "
                             "(default), the Python dispatch mode, or none (FAKEGPU_FAKE_CUDA_MEMORY)")
    parser.add_argument("--profile", help="cProfile rank 0's timed steps into PROFILE.<variant>.pstats "
                        "(the figures then include the profiler's own cost)")
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args)
    medians: dict[str, list[float]] = {"gpu": [], "port": []}
    losses = {}
    with tempfile.TemporaryDirectory(prefix="fakegpu-bench-") as tmp:
        for _ in range(args.repeats):
            for variant in ("port", "gpu"):
                result = run_variant(args, variant, Path(tmp))
                medians[variant].append(statistics.median(result["times"]))
                losses[variant] = result["losses"]
    if losses["gpu"] != losses["port"]:
        print("warning: the two runs computed different losses", file=sys.stderr)
    gpu, port = statistics.median(medians["gpu"]), statistics.median(medians["port"])
    summary = {"nproc": args.nproc, "width": args.width, "depth": args.depth, "batch": args.batch,
               "steps": args.steps, "port_step_ms": port * 1e3, "fake_cuda_step_ms": gpu * 1e3,
               "ratio": gpu / port, "losses_equal": losses["gpu"] == losses["port"]}
    print(f"DDP MLP {args.depth}x{args.width}, batch {args.batch}, {args.nproc} ranks, "
          f"median of {args.steps} steps on rank 0")
    print(f"  hand-ported CPU program, fakegpu backend : {port * 1e3:8.2f} ms/step")
    print(f"  unmodified GPU program, fake CUDA        : {gpu * 1e3:8.2f} ms/step")
    print(f"  ratio                                    : {gpu / port:8.3f}   losses equal: "
          f"{summary['losses_equal']}")
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
