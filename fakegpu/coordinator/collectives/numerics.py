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


def _dt(code, name, npt, is_float, acc, saturate=None) -> DType:
    npt = np.dtype(npt)
    return DType(code, name, npt, npt.itemsize, is_float, np.dtype(acc), saturate)


DTYPES: dict[int, DType] = {d.code: d for d in (
    _dt(0, "int8", np.int8, False, np.int8),
    _dt(1, "uint8", np.uint8, False, np.uint8),
    _dt(2, "int32", np.int32, False, np.int32),
    _dt(3, "uint32", np.uint32, False, np.uint32),
    _dt(4, "int64", np.int64, False, np.int64),
    _dt(5, "uint64", np.uint64, False, np.uint64),
    _dt(6, "float16", np.float16, True, np.float32),
    _dt(7, "float32", np.float32, True, np.float32),
    _dt(8, "float64", np.float64, True, np.float64),
    _dt(9, "bfloat16", ml_dtypes.bfloat16, True, np.float32),
    _dt(10, "float8e4m3", ml_dtypes.float8_e4m3fn, True, np.float32,
        float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max)),
    _dt(11, "float8e5m2", ml_dtypes.float8_e5m2, True, np.float32,
        float(ml_dtypes.finfo(ml_dtypes.float8_e5m2).max)),
)}
DTYPE_BY_NAME = {d.name: d for d in DTYPES.values()}
ELEM_SIZE = {code: d.size for code, d in DTYPES.items()}


def decode_scalar(dt: DType, raw: bytes):
    """The PreMulSum scalar (a value of the op's datatype, left-aligned in 8 bytes),
    as a numpy scalar of the accumulator type (floats) or of the type itself (ints)."""
    value = np.frombuffer(bytes(raw[:dt.size]), dtype=dt.np)[0]
    return dt.acc.type(value) if dt.is_float else value


_BINARY = {P.REDOP_SUM: np.add, P.REDOP_PROD: np.multiply, P.REDOP_MAX: np.maximum,
           P.REDOP_MIN: np.minimum, P.REDOP_AVG: np.add, P.REDOP_PREMULSUM: np.add}


def _int_truncating_divide(out: np.ndarray, n: int) -> None:
    """out = trunc(out / n) in place, with C semantics, for a positive n."""
    info = np.iinfo(out.dtype)
    if n > info.max:  # |x| < n for every representable x
        out[...] = 0
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
    if premul:
        svals = [decode_scalar(dt, s) for s in scalars]
    block = max(1, BLOCK_BYTES // dt.size)
    first = outputs[0]
    rest = outputs[1:]
    if not dt.narrow and not premul and count <= block:
        # Small payloads (the latency path): one pass, no block slicing.
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
                _int_truncating_divide(first, n)
        for r in rest:
            np.copyto(r, first)
        return
    if not dt.narrow:
        tmp = np.empty(min(block, count), dtype=dt.np) if premul else None
        for lo in range(0, count, block):
            hi = min(lo + block, count)
            o = first[lo:hi]
            if premul:
                np.multiply(inputs[0][lo:hi], svals[0], out=o)
                t = tmp[:hi - lo]
                for i in range(1, n):
                    np.multiply(inputs[i][lo:hi], svals[i], out=t)
                    np.add(o, t, out=o)
            elif n == 1:
                np.copyto(o, inputs[0][lo:hi])
            else:
                func(inputs[0][lo:hi], inputs[1][lo:hi], out=o)
                for i in range(2, n):
                    func(o, inputs[i][lo:hi], out=o)
            if redop == P.REDOP_AVG:
                if dt.is_float:
                    np.divide(o, dt.np.type(n), out=o)
                else:
                    _int_truncating_divide(o, n)
            for r in rest:
                np.copyto(r[lo:hi], o)
        return
    # Narrow floating types: fold into a float32 block, round once.
    m = min(block, count)
    acc_buf = np.empty(m, dtype=dt.acc)
    tmp_buf = np.empty(m, dtype=dt.acc)
    for lo in range(0, count, block):
        hi = min(lo + block, count)
        acc = acc_buf[:hi - lo]
        tmp = tmp_buf[:hi - lo]
        np.copyto(acc, inputs[0][lo:hi], casting="unsafe")
        if premul:
            np.multiply(acc, svals[0], out=acc)
        for i in range(1, n):
            np.copyto(tmp, inputs[i][lo:hi], casting="unsafe")
            if premul:
                np.multiply(tmp, svals[i], out=tmp)
            func(acc, tmp, out=acc)
        if redop == P.REDOP_AVG:
            np.divide(acc, dt.acc.type(n), out=acc)
        if dt.saturate is not None:
            np.clip(acc, -dt.saturate, dt.saturate, out=acc)
        o = first[lo:hi]
        np.copyto(o, acc, casting="unsafe")
        for r in rest:
            np.copyto(r[lo:hi], o)


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
