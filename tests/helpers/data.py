"""Deterministic test inputs and numpy reference results for the collectives tests.

Workers and the test process both call :func:`make_input`, so a worker only has to send back
what it received, and the test recomputes every rank's input to build the expected answer.

Reference numerics (what NCCL defines and docs/numerics.md documents):
* floating types narrower than float64 accumulate in float32, combining ranks in rank order,
  and round to the datatype once at the end; float64 works in float64;
* integer Sum/Prod wrap around in the datatype; integer Avg is the wrapped sum divided by the
  number of ranks, truncated toward zero;
* PreMulSum multiplies each rank's value by the scalar (both widened like the accumulator),
  then sums;
* float8 results saturate to the largest finite value (NCCL converts with SATFINITE).
"""
from __future__ import annotations

import zlib
from typing import Optional, Sequence

import numpy as np

from fakegpu.nccl import DataType, RedOp

ALL_DTYPES = tuple(DataType)
INT_DTYPES = tuple(d for d in DataType if not d.is_float)
FLOAT_DTYPES = tuple(d for d in DataType if d.is_float)

# Every reduction NCCL accepts for every datatype (fp8 included since NCCL 2.24).
REDUCTIONS = ("sum", "prod", "max", "min", "avg", "premul_host", "premul_device")

PREMUL_SCALAR_FLOAT = 0.75   # exactly representable in every float type
PREMUL_SCALAR_INT = 3
# A device-resident scalar is read when the collective runs: workers create the op with this
# value and overwrite the storage afterwards with the real scalar above.
PREMUL_DEVICE_INITIAL = 2


def accumulator_dtype(dtype: DataType) -> np.dtype:
    if dtype is DataType.float64:
        return np.dtype(np.float64)
    if dtype.is_float:
        return np.dtype(np.float32)
    return dtype.numpy_dtype


def premul_scalar(dtype: DataType) -> float:
    return PREMUL_SCALAR_FLOAT if dtype.is_float else PREMUL_SCALAR_INT


def _rng(*key: object) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(repr(key).encode()))


def make_input(seed: int, rank: int, dtype: DataType, count: int, reduction: str = "sum") -> np.ndarray:
    """``count`` values of ``dtype`` for ``rank``, shaped to exercise ``reduction``.

    Integer inputs span the whole type so sums and products wrap; float products stay near 1
    so that even fp8 does not overflow on 8 ranks.
    """
    dtype = DataType(dtype)
    rng = _rng(seed, rank, int(dtype), count, reduction)
    np_dtype = dtype.numpy_dtype
    if not dtype.is_float:
        info = np.iinfo(np_dtype)
        return rng.integers(info.min, info.max, size=count, dtype=np_dtype, endpoint=True)
    if reduction == "prod":
        magnitude = rng.uniform(0.5, 2.0, size=count)
        values = magnitude * rng.choice([-1.0, 1.0], size=count)
    else:
        values = rng.uniform(-4.0, 4.0, size=count)
    if dtype is DataType.float64:
        return values.astype(np.float64)
    return values.astype(np.float32).astype(np_dtype)


def sentinel(dtype: DataType, count: int) -> np.ndarray:
    """A recognisable fill for output buffers, to see what a call did (not) write."""
    raw = np.full(count * DataType(dtype).itemsize, 0x5A, dtype=np.uint8)
    return raw.view(DataType(dtype).numpy_dtype)


def reduce_arrays(arrays: Sequence[np.ndarray], dtype: DataType, reduction: str,
                  scalar: Optional[float | Sequence[float]] = None) -> np.ndarray:
    """NCCL's reduction of the ranks' arrays (index = rank) under our documented numerics."""
    dtype = DataType(dtype)
    n = len(arrays)
    acc_dtype = accumulator_dtype(dtype)
    widened = [np.asarray(a).astype(acc_dtype) for a in arrays]
    if reduction.startswith("premul"):
        # one scalar for every rank, or a sequence: rank i's own scalar
        factors = scalar if isinstance(scalar, (list, tuple)) else [
            scalar if scalar is not None else premul_scalar(dtype)] * n
        values = np.array(factors, dtype=dtype.numpy_dtype).astype(acc_dtype)
        widened = [a * values[i] for i, a in enumerate(widened)]
        reduction = "sum"
    with np.errstate(over="ignore", invalid="ignore"):
        if reduction in ("sum", "avg"):
            acc = widened[0].copy()
            for a in widened[1:]:
                acc = acc + a
        elif reduction == "prod":
            acc = widened[0].copy()
            for a in widened[1:]:
                acc = acc * a
        elif reduction == "max":
            acc = widened[0].copy()
            for a in widened[1:]:
                acc = np.maximum(acc, a)
        elif reduction == "min":
            acc = widened[0].copy()
            for a in widened[1:]:
                acc = np.minimum(acc, a)
        else:
            raise ValueError(f"unknown reduction {reduction!r}")
        if reduction == "avg":
            if dtype.is_float:
                acc = acc / acc.dtype.type(n)
            else:
                acc = _truncating_divide(acc, n)
        if dtype in (DataType.float8e4m3, DataType.float8e5m2):
            largest = float(_ml_dtypes_finfo(dtype.numpy_dtype).max)
            acc = np.clip(acc, -largest, largest)
        return acc.astype(dtype.numpy_dtype)


def _ml_dtypes_finfo(np_dtype: np.dtype):
    import ml_dtypes

    return ml_dtypes.finfo(np_dtype)


def _truncating_divide(values: np.ndarray, divisor: int) -> np.ndarray:
    """Integer division rounding toward zero (C semantics), exact for every 64-bit value."""
    as_int = [int(v) for v in values.tolist()]
    quotients = [abs(v) // divisor * (1 if v >= 0 else -1) for v in as_int]
    return np.array(quotients, dtype=object).astype(values.dtype)


def reduction_op_code(reduction: str) -> Optional[int]:
    """The RedOp for a built-in reduction; None for the PreMulSum variants (created at run time)."""
    if reduction.startswith("premul"):
        return None
    return int(RedOp[reduction])


def same_bits(actual: np.ndarray, expected: np.ndarray) -> bool:
    """Exact equality of the bytes (NaN-safe, distinguishes -0.0)."""
    a = np.ascontiguousarray(actual)
    e = np.ascontiguousarray(expected)
    return a.shape == e.shape and a.tobytes() == e.tobytes()


def describe_mismatch(actual: np.ndarray, expected: np.ndarray, limit: int = 5) -> str:
    a = np.ascontiguousarray(actual).reshape(-1)
    e = np.ascontiguousarray(expected).reshape(-1)
    if a.shape != e.shape:
        return f"shape {a.shape} != expected {e.shape}"
    width = a.dtype.itemsize
    a_raw = a.view(np.dtype(f"u{width}")) if width in (1, 2, 4, 8) else a
    e_raw = e.view(np.dtype(f"u{width}")) if width in (1, 2, 4, 8) else e
    bad = np.nonzero(a_raw != e_raw)[0]
    shown = ", ".join(f"[{i}] got {a[i]!r} want {e[i]!r}" for i in bad[:limit])
    return f"{len(bad)} of {len(a)} elements differ: {shown}"
