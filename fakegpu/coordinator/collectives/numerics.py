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

Everything works block by block (``BLOCK_BYTES`` of output at a time) so the output
block stays in cache while every input is folded into it, and the float32 temporaries
of the narrow types stay bounded whatever the payload.
"""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Optional, Sequence

import ml_dtypes
import numpy as np

from fakegpu import protocol as P

BLOCK_BYTES = 256 * 1024


@dataclass(frozen=True)
class DType:
    code: int
    name: str
    np: np.dtype
    size: int
    is_float: bool
    acc: np.dtype           # accumulator type
    saturate: Optional[float] = None  # largest finite value for float8 outputs

    @property
    def narrow(self) -> bool:
        """True when the accumulator differs from the storage type."""
        return self.acc != self.np


def _dt(code, npt, acc, saturate=None) -> DType:
    """The numpy side of datatype `code`; its name, size and kind come from spec/wire.py."""
    npt = np.dtype(npt)
    if npt.itemsize != P.DATATYPE_SIZES[code]:
        raise AssertionError(f"datatype {code}: numpy {npt} is not {P.DATATYPE_SIZES[code]} bytes")
    return DType(code, P.DATATYPE_NAMES[code], npt, npt.itemsize, P.DATATYPE_IS_FLOAT[code], np.dtype(acc), saturate)


_NUMPY_TYPES = {  # code: (storage type, accumulator type)
    0: (np.int8, np.int8), 1: (np.uint8, np.uint8), 2: (np.int32, np.int32), 3: (np.uint32, np.uint32),
    4: (np.int64, np.int64), 5: (np.uint64, np.uint64), 6: (np.float16, np.float32),
    7: (np.float32, np.float32), 8: (np.float64, np.float64), 9: (ml_dtypes.bfloat16, np.float32),
    10: (ml_dtypes.float8_e4m3fn, np.float32), 11: (ml_dtypes.float8_e5m2, np.float32),
}
# float8 results saturate at the largest finite value (NCCL's conversion with saturation).
_SATURATE = {10: float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max),
             11: float(ml_dtypes.finfo(ml_dtypes.float8_e5m2).max)}
DTYPES: dict[int, DType] = {code: _dt(code, *_NUMPY_TYPES[code], _SATURATE.get(code)) for code in P.DATATYPE_NAMES}
DTYPE_BY_NAME = {d.name: d for d in DTYPES.values()}
ELEM_SIZE = {code: d.size for code, d in DTYPES.items()}


def decode_scalar(dt: DType, raw: bytes):
    """The PreMulSum scalar (a value of the op's datatype, left-aligned in 8 bytes),
    as a numpy scalar of the accumulator type (floats) or of the type itself (ints)."""
    value = np.frombuffer(bytes(raw[:dt.size]), dtype=dt.np)[0]
    return dt.acc.type(value) if dt.is_float else value


_BINARY = {P.REDOP_SUM: np.add, P.REDOP_PROD: np.multiply, P.REDOP_MAX: np.maximum,
           P.REDOP_MIN: np.minimum, P.REDOP_AVG: np.add, P.REDOP_PREMULSUM: np.add}


def int_truncating_divide(out: np.ndarray, n: int) -> None:
    """out = trunc(out / n) in place, with C semantics, for a positive n."""
    info = np.iinfo(out.dtype)
    if n > -int(info.min) if info.min else n > info.max:  # |x| < n for every representable x
        out[...] = 0
        return
    if n == -int(info.min):  # n = 2^(bits-1) is not representable: only the minimum gives -1
        out[...] = np.where(out == info.min, out.dtype.type(-1), out.dtype.type(0))
        return
    if info.min == 0:
        np.floor_divide(out, out.dtype.type(n), out=out)
        return
    divisor = out.dtype.type(n)
    rem = np.fmod(out, divisor)          # sign of the dividend, like C
    np.subtract(out, rem, out=out)       # now an exact multiple of n; cannot overflow
    np.floor_divide(out, divisor, out=out)


def reduce_into(dt: DType, redop: int, inputs: Sequence[np.ndarray], outputs: Sequence[np.ndarray],
                scalars: Optional[Sequence[bytes]] = None) -> None:
    """Reduce ``inputs`` (one typed array per rank, rank order) into ``outputs[0]`` and copy
    the result into every other output. All arrays have the same length and dtype ``dt.np``;
    outputs must not overlap inputs."""
    n = len(inputs)
    count = len(outputs[0])
    if count == 0:
        return
    func = _BINARY[redop]
    premul = redop == P.REDOP_PREMULSUM
    if not dt.narrow and not premul and count * dt.size <= BLOCK_BYTES:
        # Small payloads (the latency path): one pass, no block slicing.
        first = outputs[0]
        if n == 1:
            np.copyto(first, inputs[0])
        else:
            func(inputs[0], inputs[1], out=first)
            for i in range(2, n):
                func(first, inputs[i], out=first)
        if redop == P.REDOP_AVG:
            if dt.is_float:
                np.divide(first, dt.np.type(n), out=first)
            else:
                int_truncating_divide(first, n)
        for r in outputs[1:]:
            np.copyto(r, first)
        return
    svals = [decode_scalar(dt, s) for s in scalars] if premul else None
    run_in_parallel(count, dt.size * (n + len(outputs)),
                    lambda lo, hi: _reduce_range(dt, redop, func, svals, inputs, outputs, lo, hi))


def _reduce_range(dt: DType, redop: int, func, svals, inputs, outputs, lo: int, hi: int) -> None:
    """reduce_into for elements [lo, hi), block by block."""
    n = len(inputs)
    premul = svals is not None
    block = max(1, BLOCK_BYTES // dt.size)
    first = outputs[0]
    rest = outputs[1:]
    m = min(block, hi - lo)
    if not dt.narrow:
        tmp = np.empty(m, dtype=dt.np) if premul else None
        for b in range(lo, hi, block):
            e = min(b + block, hi)
            o = first[b:e]
            if premul:
                np.multiply(inputs[0][b:e], svals[0], out=o)
                t = tmp[:e - b]
                for i in range(1, n):
                    np.multiply(inputs[i][b:e], svals[i], out=t)
                    np.add(o, t, out=o)
            elif n == 1:
                np.copyto(o, inputs[0][b:e])
            else:
                func(inputs[0][b:e], inputs[1][b:e], out=o)
                for i in range(2, n):
                    func(o, inputs[i][b:e], out=o)
            if redop == P.REDOP_AVG:
                if dt.is_float:
                    np.divide(o, dt.np.type(n), out=o)
                else:
                    int_truncating_divide(o, n)
            for r in rest:
                np.copyto(r[b:e], o)
        return
    # Narrow floating types: fold into a float32 block, round once.
    acc_buf = np.empty(m, dtype=dt.acc)
    tmp_buf = np.empty(m, dtype=dt.acc)
    bits_buf = np.empty((2, m), dtype=np.uint32).T if dt.code == 6 else None
    for b in range(lo, hi, block):
        e = min(b + block, hi)
        acc = acc_buf[:e - b]
        tmp = tmp_buf[:e - b]
        widen(dt, inputs[0][b:e], acc)
        if premul:
            np.multiply(acc, svals[0], out=acc)
        for i in range(1, n):
            widen(dt, inputs[i][b:e], tmp)
            if premul:
                np.multiply(tmp, svals[i], out=tmp)
            func(acc, tmp, out=acc)
        if redop == P.REDOP_AVG:
            np.divide(acc, dt.acc.type(n), out=acc)
        if dt.saturate is not None:
            np.clip(acc, -dt.saturate, dt.saturate, out=acc)
        o = first[b:e]
        narrow(dt, acc, o, bits_buf[:e - b] if bits_buf is not None else None)
        for r in rest:
            np.copyto(r[b:e], o)


def widen(dt: DType, src: np.ndarray, dst: np.ndarray) -> None:
    """dst (float32) = src (a narrow float type), exactly. float8 and float16 go through a
    table of every bit pattern (faster than ml_dtypes' and numpy's casts)."""
    table = _WIDEN_TABLES.get(dt.code)
    if table is not None:
        np.take(table, src.view(_INDEX[dt.code]), out=dst)
    else:
        np.copyto(dst, src, casting="unsafe")


_WIDEN_TABLES = {code: np.arange(256, dtype=np.uint8).view(DTYPES[code].np).astype(np.float32)
                 for code in (10, 11)}
# float16 has 65536 bit patterns: a 256 KiB table (stays in L2) beats numpy's conversion.
_WIDEN_TABLES[6] = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)
_INDEX = {10: np.uint8, 11: np.uint8, 6: np.uint16}


def narrow(dt: DType, acc: np.ndarray, out: np.ndarray, scratch: Optional[np.ndarray]) -> None:
    """out (dt) = acc (float32), rounded to nearest even like numpy's cast. float16 uses
    integer arithmetic on the bits (scratch: two uint32 columns of len(acc)), about twice
    as fast as numpy's conversion here; NaN lanes go through numpy to keep its payloads."""
    if dt.code != 6:
        np.copyto(out, acc, casting="unsafe")
        return
    u = acc.view(np.uint32)
    mag = scratch[:, 0]
    res = scratch[:, 1]
    np.bitwise_and(u, np.uint32(0x7FFFFFFF), out=mag)
    # Normal results: rebias the exponent, round to nearest even on bit 13, drop 13 bits.
    np.right_shift(mag, 13, out=res)
    np.bitwise_and(res, np.uint32(1), out=res)
    np.add(res, mag, out=res)
    np.add(res, np.uint32(((15 - 127) << 23) + 0xFFF & 0xFFFFFFFF), out=res)
    np.right_shift(res, 13, out=res)
    small = mag < np.uint32(113 << 23)  # below float16's smallest normal: subnormal or zero
    if small.any():
        magic = np.uint32(((127 - 15) + (23 - 10) + 1) << 23)
        # Adding 0.5 (in float16 subnormal units) lets the FPU round to nearest even.
        res[small] = (mag[small].view(np.float32) + magic.view(np.float32)).view(np.uint32) - magic
    big = mag >= np.uint32((127 + 16) << 23)  # overflows to infinity, or inf/NaN
    any_big = big.any()
    if any_big:
        res[big] = 0x7C00
    np.right_shift(u, 16, out=mag)
    np.bitwise_and(mag, np.uint32(0x8000), out=mag)
    np.bitwise_or(res, mag, out=res)
    np.copyto(out.view(np.uint16), res, casting="unsafe")
    if any_big:
        nan = np.isnan(acc)
        if nan.any():
            out[nan] = acc[nan].astype(np.float16)


# -- parallel execution of large copies and reductions -------------------------------------
# The ranks are blocked waiting while the coordinator reduces, so their cores are idle:
# numpy releases the GIL in ufuncs and copies, and splitting a large payload over a few
# threads cuts the coordinator's part of a big collective roughly by the core count.

PARALLEL_MIN_BYTES = 4 << 20   # bytes touched below which one thread is faster


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


def reference_reduce(dt: DType, redop: int, inputs: Sequence[np.ndarray],
                     scalars: Optional[Sequence[bytes]] = None) -> np.ndarray:
    """A slow, obviously-correct model of ``reduce_into`` for tests (element-wise Python
    over the accumulator type)."""
    n = len(inputs)
    if dt.is_float:
        xs = [np.asarray(x).astype(dt.acc) for x in inputs]
        if redop == P.REDOP_PREMULSUM:
            xs = [x * decode_scalar(dt, s) for x, s in zip(xs, scalars)]
        acc = xs[0].copy()
        for x in xs[1:]:
            acc = {P.REDOP_PROD: np.multiply, P.REDOP_MAX: np.maximum,
                   P.REDOP_MIN: np.minimum}.get(redop, np.add)(acc, x).astype(dt.acc)
        if redop == P.REDOP_AVG:
            acc = (acc / dt.acc.type(n)).astype(dt.acc)
        if dt.saturate is not None:
            acc = np.clip(acc, -dt.saturate, dt.saturate)
        return acc.astype(dt.np)
    bits = dt.size * 8
    signed = np.iinfo(dt.np).min < 0
    def wrap(v: int) -> int:
        v &= (1 << bits) - 1
        return v - (1 << bits) if signed and v >= 1 << (bits - 1) else v
    cols = [[int(v) for v in x] for x in inputs]
    out = []
    for j in range(len(cols[0])):
        vals = [c[j] for c in cols]
        if redop == P.REDOP_PREMULSUM:
            vals = [wrap(v * int(decode_scalar(dt, s))) for v, s in zip(vals, scalars)]
        if redop in (P.REDOP_SUM, P.REDOP_AVG, P.REDOP_PREMULSUM):
            r = wrap(sum(vals))
        elif redop == P.REDOP_PROD:
            r = 1
            for v in vals:
                r = wrap(r * v)
        elif redop == P.REDOP_MAX:
            r = max(vals)
        else:
            r = min(vals)
        if redop == P.REDOP_AVG:
            r = int(r / n) if abs(r) < 2 ** 52 else (abs(r) // n) * (1 if r >= 0 else -1)
        out.append(r)
    return np.array(out, dtype=dt.np)
