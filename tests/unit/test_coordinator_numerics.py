"""Reduction numerics (fakegpu/coordinator/collectives/numerics.py) against an element-wise
reference and hand-computed cases: block boundaries, wrapping, truncation, saturation,
rounding once, special values."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from fakegpu import protocol as P
from fakegpu.coordinator.collectives import numerics as N
from helpers.numpy_reduce import reference_reduce

SUM, PROD, MAX, MIN, AVG, PREMUL = range(6)


def run(dt, redop, inputs, scalars=None, n_outputs=2):
    outs = [np.full(len(inputs[0]), 7, dt.np) for _ in range(n_outputs)]
    with np.errstate(all="ignore"):  # inf - inf is meant to give NaN here
        N.reduce_into(dt, redop, inputs, outs, scalars)
    for o in outs[1:]:
        assert o.tobytes() == outs[0].tobytes()
    return outs[0]


@pytest.mark.parametrize("code", sorted(N.DTYPES))
@pytest.mark.parametrize("redop", range(6))
def test_across_block_boundaries(code, redop):
    # The shim folds 2048-element blocks: several of them, and a ragged last one.
    dt = N.DTYPES[code]
    rng = np.random.default_rng(code * 10 + redop)
    count = 2 * 2048 + 203
    if dt.is_float:
        xs = [(rng.standard_normal(count) * 3).astype(dt.np) for _ in range(3)]
        sc = [np.array([v], dt.np).tobytes() for v in (0.5, -1.25, 2.0)]
    else:
        info = np.iinfo(dt.np)
        xs = [rng.integers(info.min, info.max, count, dtype=dt.np, endpoint=True) for _ in range(3)]
        sc = [np.array([v], dt.np).tobytes() for v in (3, 1, 7)]
    got = run(dt, redop, xs, sc if redop == PREMUL else None)
    want = reference_reduce(dt, redop, xs, sc if redop == PREMUL else None)
    assert got.tobytes() == want.tobytes()


def test_integer_sum_and_prod_wrap():
    dt = N.DTYPES[0]  # int8
    xs = [np.array([100, -128, 127], np.int8), np.array([100, -1, 1], np.int8)]
    assert run(dt, SUM, xs).tolist() == [-56, 127, -128]
    assert run(dt, PROD, xs).tolist() == [16, -128, 127]
    u64 = N.DTYPES[5]
    big = np.array([2**64 - 1], np.uint64)
    assert run(u64, SUM, [big, np.array([2], np.uint64)]).tolist() == [1]


def test_integer_avg_truncates_toward_zero_after_wrapping():
    dt = N.DTYPES[2]  # int32
    xs = [np.array([-7, 7, -1, 2**31 - 1], np.int32), np.array([0, 0, 0, 2], np.int32)]
    # (-7)/2 = -3, 7/2 = 3, -1/2 = 0, and 2**31-1+2 wraps to -2**31+1 -> / 2 = -1073741823
    assert run(dt, AVG, xs).tolist() == [-3, 3, 0, -1073741823]
    u8 = N.DTYPES[1]
    assert run(u8, AVG, [np.array([255], np.uint8), np.array([3], np.uint8), np.array([1], np.uint8)]).tolist() == [1]


def test_float16_rounds_once_in_float32():
    dt = N.DTYPES[6]
    # 2048 + 1 + 1 in float16 steps would stay 2048 (1 is below half an ulp); in float32 it is 2050.
    xs = [np.array([2048], np.float16), np.array([1], np.float16), np.array([1], np.float16)]
    assert run(dt, SUM, xs).tolist() == [2050.0]


def test_bfloat16_avg_divides_in_accumulator():
    dt = N.DTYPES[9]
    xs = [np.array([1.0], ml_dtypes.bfloat16), np.array([2.0], ml_dtypes.bfloat16),
          np.array([4.0], ml_dtypes.bfloat16)]
    want = np.array([np.float32(7.0) / np.float32(3.0)], np.float32).astype(ml_dtypes.bfloat16)
    assert run(dt, AVG, xs).tobytes() == want.tobytes()


def test_float8_saturates_and_keeps_nan():
    e4 = N.DTYPES[10]
    xs = [np.array([448, 1, np.nan], ml_dtypes.float8_e4m3fn), np.array([448, 1, 0], ml_dtypes.float8_e4m3fn)]
    got = run(e4, SUM, xs).astype(np.float32)
    assert got[0] == 448 and got[1] == 2 and np.isnan(got[2])
    e5 = N.DTYPES[11]
    got = run(e5, PROD, [np.array([57344], ml_dtypes.float8_e5m2), np.array([4], ml_dtypes.float8_e5m2)])
    assert got.astype(np.float32).tolist() == [57344.0]


def test_float_specials_propagate():
    dt = N.DTYPES[7]
    xs = [np.array([np.inf, 1, np.nan, -0.0], np.float32), np.array([-np.inf, np.inf, 1, -0.0], np.float32)]
    got = run(dt, SUM, xs)
    assert np.isnan(got[0]) and got[1] == np.inf and np.isnan(got[2]) and np.signbit(got[3])
    assert np.isnan(run(dt, MAX, xs)[2])


def test_premulsum_uses_each_ranks_scalar():
    dt = N.DTYPES[8]
    xs = [np.array([1.0, 2.0]), np.array([10.0, 20.0])]
    sc = [np.array([0.5]).tobytes(), np.array([-1.0]).tobytes()]
    assert run(dt, PREMUL, xs, sc).tolist() == [-9.5, -19.0]
    i32 = N.DTYPES[2]
    sc = [np.array([2**30], np.int32).tobytes(), np.array([3], np.int32).tobytes()]
    got = run(i32, PREMUL, [np.array([4], np.int32), np.array([5], np.int32)], sc)
    assert got.tolist() == [15]  # 4 * 2**30 wraps to 0


def test_single_rank_and_empty():
    dt = N.DTYPES[7]
    assert run(dt, SUM, [np.array([1.5, 2.5], np.float32)]).tolist() == [1.5, 2.5]
    out = np.zeros(0, np.float32)
    N.reduce_into(dt, SUM, [out, out], [out])


def test_dtype_table_matches_nccl_enum():
    assert [N.DTYPES[c].name for c in range(12)] == [
        "int8", "uint8", "int32", "uint32", "int64", "uint64", "float16", "float32", "float64",
        "bfloat16", "float8e4m3", "float8e5m2"]
    assert all(N.DTYPES[c].size == s for c, s in zip(range(12), [1, 1, 4, 4, 8, 8, 2, 4, 8, 2, 1, 1]))
    assert P.REDOP_NAMES[PREMUL] == "premulsum"


@pytest.mark.parametrize("n", [127, 128, 129])
def test_int8_average_over_as_many_ranks_as_the_type_holds_truncates_like_c(n):
    # 128 is not an int8 divisor; C still gives -128 / 128 = -1 and 127 / 128 = 0.
    dt = N.DTYPE_BY_NAME["int8"]
    xs = [np.array([-128, 127, -1], np.int8)] + [np.zeros(3, np.int8)] * (n - 1)
    got = run(dt, P.REDOP_AVG, xs)
    assert got.tolist() == [int(-128 / n), int(127 / n), 0]
    assert got.tolist() == reference_reduce(dt, P.REDOP_AVG, xs).tolist()
