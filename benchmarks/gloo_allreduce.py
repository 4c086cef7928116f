"""The allreduce sweep of `python -m fakegpu bandwidth`, run with torch's gloo backend.

    python benchmarks/gloo_allreduce.py --ranks 4 -b 1K -e 64M -f 4 [-n 20] [-w 5] [--json PATH]

Ranks are processes started with torch.multiprocessing (spawn) on this host, meeting through a
TCP store on a free loopback port.  torch's all_reduce works in place; the out-of-place column
times ``recv.copy_(send)`` followed by the in-place all_reduce, which is what an out-of-place
caller pays.  Times are the median of per-call times, then the maximum over ranks, exactly as
in our own command, and the table has the same layout.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fakegpu.cli.bandwidth import OPS, Sweep, format_table, sweep_sizes  # noqa: E402
from fakegpu.env import parse_size  # noqa: E402
from fakegpu.nccl import DataType  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world: int, port: int, sizes: list[int], iterations: int,
               warmup: int, out_path: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # one core per rank at most, like our rank processes
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=__import__("datetime").timedelta(seconds=300))
    rows = []
    try:
        for nbytes in sizes:
            count = nbytes // 4
            send = torch.full((count,), float(rank + 1), dtype=torch.float32)
            recv = torch.empty_like(send)
            row = {"size": count * 4, "count": count}
            for placement in ("out_of_place", "in_place"):
                dist.barrier()
                times = []
                for i in range(warmup + iterations):
                    if placement == "in_place":
                        recv.fill_(float(rank + 1))
                        start = time.perf_counter()
                        dist.all_reduce(recv)
                    else:
                        start = time.perf_counter()
                        recv.copy_(send)
                        dist.all_reduce(recv)
                    if i >= warmup:
                        times.append(time.perf_counter() - start)
                # the slowest rank bounds the collective
                agreed = torch.tensor([statistics.median(times)], dtype=torch.float64)
                dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
                seconds = float(agreed[0])
                expected = world * (world + 1) / 2
                wrong = int((recv != expected).sum())
                wrong_t = torch.tensor([wrong], dtype=torch.int64)
                dist.all_reduce(wrong_t)
                algbw = count * 4 / seconds / 1e9
                row[placement] = {"time_us": seconds * 1e6, "algbw": algbw,
                                  "busbw": algbw * 2 * (world - 1) / world,
                                  "wrong": int(wrong_t[0])}
            rows.append(row)
    finally:
        dist.destroy_process_group()
    if rank == 0:
        Path(out_path).write_text(json.dumps(rows))


def run_gloo_sweep(world: int, sizes: list[int], iterations: int, warmup: int) -> list[dict]:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="fgpu-gloo-") as tmp:
        out_path = os.path.join(tmp, "rows.json")
        mp.spawn(_rank_main, args=(world, _free_port(), sizes, iterations, warmup, out_path),
                 nprocs=world, join=True)
        return json.loads(Path(out_path).read_text())


def gloo_sweep_object(sizes: list[int], iterations: int, warmup: int) -> Sweep:
    return Sweep(OPS["allreduce"], DataType.float32, 0, -1, sizes, iterations, warmup, True)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("-b", "--minbytes", default="1K")
    p.add_argument("-e", "--maxbytes", default="64M")
    p.add_argument("-f", "--stepfactor", type=float, default=4.0)
    p.add_argument("-n", "--iterations", type=int, default=20)
    p.add_argument("-w", "--warmup", type=int, default=5)
    p.add_argument("--json", default=None)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    sizes = sweep_sizes(parse_size(args.minbytes), parse_size(args.maxbytes), args.stepfactor)
    rows = run_gloo_sweep(args.ranks, sizes, args.iterations, args.warmup)
    sweep = gloo_sweep_object(sizes, args.iterations, args.warmup)
    header = (f"torch gloo: allreduce, float32, {args.ranks} ranks (mp spawn, TCP loopback), "
              f"median of {args.iterations} calls after {args.warmup} warmup")
    print(format_table(sweep, args.ranks, rows, header))
    if args.json:
        Path(args.json).write_text(json.dumps({"backend": "gloo", "world_size": args.ranks,
                                               "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
