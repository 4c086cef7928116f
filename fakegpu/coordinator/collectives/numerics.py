"""Datatypes and reductions with NCCL's semantics, on numpy views (docs/numerics.md).

The rules, in short:
- floating types narrower than float32 (float16, bfloat16, float8 e4m3/e5m2) and float32
  accumulate in float32, float64 in float64, in rank order (((x0 op x1) op x2) ...),
  and are rounded once into the output type;
- integer Sum/Prod wrap modulo 2^bits; integer Avg is the wrapped sum divided by n with
  C's truncation toward zero; PreMulSum multiplies each rank's input by that rank's
  scalar in the type (wrapping) and sums;
- float Avg is the accumulated sum divided by n in the accumulator, rounded once;
- float8 results saturate to the largest finite value, as NCCL's conversions do.

The arithmetic itself is the shim's (native/src/numerics/reduce_n.cc through
fakegpu/native_numerics.py): the coordinator, the host-local arenas and the fake modes share
one implementation; tests/helpers/numpy_reduce.py is the numpy oracle the tests hold it to.
"""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Optional, Sequence

import numpy as np

from fakegpu import native_numerics
from fakegpu import protocol as P
from fakegpu.common.dtypes import DTYPE_BY_NAME, DTYPES, ELEM_SIZE, DType, decode_scalar  # noqa: F401 (re-exported)



PARALLEL_MIN_BYTES = 4 << 20   # bytes touched below which one thread is faster
COPY_BLOCK_BYTES = 256 << 10   # reduced, then copied to the other outputs, a block at a time (fits L2)


def _worker_count() -> int:
    """FAKEGPU_REDUCE_THREADS, else the CPUs this process may use (at most 8)."""
    raw = os.environ.get("FAKEGPU_REDUCE_THREADS", "").strip()
    if raw:
        try:
            return max(1, int(raw))
        except ValueError:
            raise ValueError(f"FAKEGPU_REDUCE_THREADS={raw!r} is not a whole number") from None
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(8, cpus))


_MAX_WORKERS = _worker_count()
_pool: Optional[ThreadPoolExecutor] = None


def _get_pool() -> ThreadPoolExecutor:
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(max_workers=_MAX_WORKERS - 1, thread_name_prefix="fakegpu-reduce")
    return _pool


def run_in_parallel(count: int, bytes_per_element: int, work, align: int = 4096) -> None:
    """Run ``work(lo, hi)`` over [0, count), split into up to one piece per CPU when the
    bytes touched make it worth it. Pieces are multiples of ``align`` elements (so block
    boundaries and cache lines are not shared between threads). Exceptions propagate."""
    pieces = 1
    if _MAX_WORKERS > 1:
        pieces = min(_MAX_WORKERS, (count * bytes_per_element) // PARALLEL_MIN_BYTES + 1,
                     max(1, count // align))
    if pieces <= 1:
        work(0, count)
        return
    step = -(-count // pieces)
    step = -(-step // align) * align
    bounds = [(lo, min(lo + step, count)) for lo in range(0, count, step)]
    pool = _get_pool()
    futures = [pool.submit(work, lo, hi) for lo, hi in bounds[1:]]
    error = None
    try:
        work(*bounds[0])
    except BaseException as exc:  # still wait for the others: they write the same outputs
        error = exc
    for f in futures:
        try:
            f.result()
        except BaseException as exc:
            error = error or exc
    if error is not None:
        raise error


def step_offset(step_index: int, step_total: int, step_count: int, total_count: int) -> int:
    """The element offset of a step in its call: every step but the last holds step_count
    elements (docs/protocol.md "Steps"), the last one the rest."""
    return total_count - step_count if step_index + 1 >= step_total else step_index * step_count


def reduce_into(dt: DType, redop: int, inputs: Sequence[np.ndarray], outputs: Sequence[np.ndarray],
                scalars: Optional[Sequence[bytes]] = None, plan: int = 0, first: int = 0,
                plan_count: int = 0) -> None:
    """Reduce ``inputs`` (one typed array per rank, rank order) into ``outputs[0]`` and copy
    the result into every other output. All arrays have the same length and dtype ``dt.storage``;
    outputs must not overlap inputs. The arithmetic is the shim's (fakegpu/native_numerics.py):
    the same code reduces in the arenas and in fake mode; large payloads are cut into pieces
    reduced by several threads (the native call runs without the GIL).

    ``plan`` (native_numerics.PLAN_*): the reduction order; for a gloo plan the arrays hold
    elements [first, first + len) of a reduction of ``plan_count`` elements, whose chunks the
    plan is cut by (docs/numerics.md "Reduction order")."""
    count = len(outputs[0])
    if count == 0:
        return
    # One 8-byte slot per rank, the value left-aligned (the OpDesc scalar field).
    raw = b"".join(bytes(s).ljust(8, b"\0") for s in scalars) if redop == P.REDOP_PREMULSUM else None
    out0, rest = outputs[0], outputs[1:]
    if plan == native_numerics.PLAN_RANK:
        def fold(ins, out, lo):
            native_numerics.reduce_n(dt.code, redop, ins, out, raw)
    else:
        def fold(ins, out, lo):
            native_numerics.reduce_n_planned(dt.code, redop, plan, ins, out, raw, first + lo, plan_count)
    step = max(1, COPY_BLOCK_BYTES // dt.size)
    if count <= step:
        # One block (the latency path): no slicing.
        fold(inputs, out0, 0)
        for r in rest:
            np.copyto(r, out0)
        return

    def work(lo, hi):
        # The other outputs are copied a block at a time, while the block just reduced is
        # still in cache, and by the thread that reduced it: copying whole outputs afterwards,
        # on one thread, made a 64 MiB all-reduce of 4 ranks 1.2x slower than numpy's blocks.
        if not rest:
            fold([x[lo:hi] for x in inputs], out0[lo:hi], lo)
            return
        for b in range(lo, hi, step):
            e = min(b + step, hi)
            fold([x[b:e] for x in inputs], out0[b:e], b)
            for r in rest:
                np.copyto(r[b:e], out0[b:e])
    if count * dt.size * (len(inputs) + len(outputs)) < PARALLEL_MIN_BYTES:
        work(0, count)
    else:
        run_in_parallel(count, dt.size * (len(inputs) + len(outputs)), work)


