"""The floor for a host-memory allreduce on this machine, measured two ways.

    python benchmarks/floor.py [--ranks 4] [--size 16MiB] [-n 10]

* pipeline: each of N rank processes copies its buffer into a shared-memory segment once, one
  numpy reduction (one process) sums the N buffers into an output region, and each rank copies
  the result out once, with multiprocessing barriers between the phases;
* components: the same work's parts timed alone in one process and added up: one 16 MiB copy
  in, one copy out, and one numpy reduction of the N buffers (what a single rank would wait for
  if the other ranks' copies overlapped perfectly).

Either is the yardstick for our allreduce (algbw = size / time); the components figure is the
stricter one.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import time
from multiprocessing import shared_memory
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fakegpu.env import parse_size  # noqa: E402


def _rank(rank: int, n: int, count: int, iterations: int, shm_name: str, barrier, times) -> None:
    shm = shared_memory.SharedMemory(name=shm_name)
    try:
        region = np.ndarray(((n + 1) * count,), dtype=np.float32, buffer=shm.buf)
        inputs = region[:n * count].reshape(n, count)
        output = region[n * count:]
        mine = np.full(count, rank + 1, dtype=np.float32)
        result = np.empty(count, dtype=np.float32)
        for _ in range(iterations):
            barrier.wait()
            start = time.perf_counter()
            inputs[rank] = mine                      # copy in
            barrier.wait()
            if rank == 0:
                np.sum(inputs, axis=0, out=output)   # one reduction of the n buffers
            barrier.wait()
            result[:] = output                       # copy out
            barrier.wait()
            if rank == 0:
                times.append(time.perf_counter() - start)
        assert result[0] == n * (n + 1) / 2
    finally:
        del region, inputs, output
        shm.close()


def measure_floor(n: int = 4, nbytes: int = 16 << 20, iterations: int = 10) -> float:
    """Median seconds for one copy in + reduction + copy out of ``nbytes`` per rank."""
    count = nbytes // 4
    ctx = mp.get_context("spawn")
    shm = shared_memory.SharedMemory(create=True, size=(n + 1) * nbytes)
    try:
        with ctx.Manager() as manager:
            times = manager.list()
            barrier = ctx.Barrier(n)
            procs = [ctx.Process(target=_rank, args=(r, n, count, iterations, shm.name, barrier,
                                                      times)) for r in range(n)]
            for p in procs:
                p.start()
            for p in procs:
                p.join(300)
                if p.exitcode != 0:
                    raise RuntimeError(f"floor rank exited with {p.exitcode}")
            return statistics.median(list(times))
    finally:
        shm.close()
        shm.unlink()


def measure_components(n: int = 4, nbytes: int = 16 << 20, iterations: int = 10) -> dict:
    """Median seconds of one ``nbytes`` copy and of one numpy reduction of ``n`` such buffers,
    and the floor ``2 * copy + reduce``."""
    count = nbytes // 4
    inputs = np.stack([np.full(count, r + 1, dtype=np.float32) for r in range(n)])
    out = np.empty(count, dtype=np.float32)
    user = np.ones(count, dtype=np.float32)

    def median_of(fn) -> float:
        fn()  # first touch of the pages is not part of the floor
        times = []
        for _ in range(iterations):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    copy_s = median_of(lambda: np.copyto(inputs[0], user))
    reduce_s = median_of(lambda: np.sum(inputs, axis=0, out=out))
    return {"copy_s": copy_s, "reduce_s": reduce_s, "floor_s": 2 * copy_s + reduce_s}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--size", default="16MiB")
    p.add_argument("-n", "--iterations", type=int, default=10)
    args = p.parse_args(argv)
    nbytes = parse_size(args.size)
    seconds = measure_floor(args.ranks, nbytes, args.iterations)
    print(f"floor (pipeline): {args.ranks} ranks, {nbytes} B each: copy in + one numpy reduction + copy out "
          f"= {seconds * 1e3:.2f} ms median, {nbytes / seconds / 1e9:.2f} GB/s")
    parts = measure_components(args.ranks, nbytes, args.iterations)
    print(f"floor (components): copy {parts['copy_s'] * 1e3:.2f} ms x 2 + reduction "
          f"{parts['reduce_s'] * 1e3:.2f} ms = {parts['floor_s'] * 1e3:.2f} ms, "
          f"{nbytes / parts['floor_s'] / 1e9:.2f} GB/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
