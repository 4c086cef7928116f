"""The tests' numpy oracle for fakegpu's reductions (the code the coordinator used before it
called the shim's reduce_n): numpy folds in rank order with NCCL's rules, and a slow element-wise
model (reference_reduce). The product is fakegpu/native_numerics.py; these check it."""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from fakegpu import protocol as P
from fakegpu.coordinator.collectives.numerics import DTYPES, DType, decode_scalar, run_in_parallel

BLOCK_BYTES = 256 * 1024


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


def numpy_reduce_into(dt: DType, redop: int, inputs: Sequence[np.ndarray], outputs: Sequence[np.ndarray],
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
