"""SPMD-symmetric local completion vs numpy references, for every collective and dtype class."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from fakegpu.coordinator.collectives.numerics import DTYPE_BY_NAME
from helpers.numpy_reduce import reference_reduce
from fakegpu.fake import semantics as S

ALL_DTYPES = sorted(DTYPE_BY_NAME)
REDOPS = ["sum", "prod", "max", "min", "avg", "premulsum"]


def _sample(dt, count=24, seed=0):
    rng = np.random.default_rng(seed)
    if dt.is_float:
        return (rng.standard_normal(count) * 3).astype(dt.np)
    info = np.iinfo(dt.np)
    return rng.integers(info.min, info.max, size=count, endpoint=True, dtype=dt.np)


def _scale_bytes(dt, scale):
    return np.array([scale]).astype(dt.np).tobytes().ljust(8, b"\0")


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")   # float16 prod -> inf
@pytest.mark.parametrize("name", ALL_DTYPES)
@pytest.mark.parametrize("redop", REDOPS)
@pytest.mark.parametrize("n", [1, 3, 8])
def test_exact_reduction_matches_rank_ordered_reference(name, redop, n):
    """n copies folded like the coordinator: exactly the real data path's result."""
    dt = DTYPE_BY_NAME[name]
    x = _sample(dt)
    scale = 0.5 if dt.is_float else 3
    got = S.reduce_symmetric(x, n, redop, scale if redop == "premulsum" else None)
    scalars = [_scale_bytes(dt, scale)] * n if redop == "premulsum" else None
    want = reference_reduce(dt, S.REDOPS[redop], [x] * n, scalars)
    assert got.dtype == dt.np
    np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))


@pytest.mark.parametrize("name", ["float16", "float32", "float64", "bfloat16", "float8e4m3", "float8e5m2"])
def test_closed_form_floats_round_once_in_accumulator(name):
    dt = DTYPE_BY_NAME[name]
    x = np.array([0.5, -1.25, 2.0, 3.0, -0.375], dtype=dt.np)
    n = 4    # powers of two: n*x is exact, so folded and closed forms agree
    acc = x.astype(dt.acc)
    cases = {"sum": acc * 4, "avg": acc, "max": acc, "min": acc, "prod": acc ** 4,
             "premulsum": acc * dt.acc.type(0.5) * 4}
    for redop, ref in cases.items():
        if dt.saturate is not None:
            ref = np.clip(ref, -dt.saturate, dt.saturate)
        got = S.reduce_symmetric(x, n, redop, 0.5 if redop == "premulsum" else None, exact_limit=0)
        np.testing.assert_array_equal(got.astype(np.float64), ref.astype(dt.np).astype(np.float64), err_msg=redop)
        folded = S.reduce_symmetric(x, n, redop, 0.5 if redop == "premulsum" else None)
        np.testing.assert_array_equal(got.astype(np.float64), folded.astype(np.float64), err_msg=redop)


@pytest.mark.parametrize("name", ["int8", "uint8", "int32", "uint32", "int64", "uint64"])
@pytest.mark.parametrize("n", [3, 7, 128, 255, 256, 1000])
def test_closed_form_integers_wrap_and_truncate(name, n):
    # 128 and 256 do not fit int8 / uint8: the closed form once gave 0 for an int8 average over
    # 128 ranks of -1 (NCCL: -128 / 128 = -1) and raised OverflowError on numpy 2.
    dt = DTYPE_BY_NAME[name]
    x = _sample(dt, 16, seed=n)
    bits = dt.size * 8
    signed = np.iinfo(dt.np).min < 0

    def wrap(v):
        v &= (1 << bits) - 1
        return v - (1 << bits) if signed and v >= 1 << (bits - 1) else v

    for redop in ("sum", "avg", "prod", "premulsum", "max", "min"):
        got = S.reduce_symmetric(x, n, redop, 3 if redop == "premulsum" else None, exact_limit=0)
        want = []
        for v in map(int, x):
            if redop == "sum":
                r = wrap(v * n)
            elif redop == "avg":
                s = wrap(v * n)
                r = abs(s) // n * (1 if s >= 0 else -1)
            elif redop == "prod":
                r = wrap(v ** n)
            elif redop == "premulsum":
                r = wrap(wrap(v * 3) * n)
            else:
                r = v
            want.append(r)
        np.testing.assert_array_equal(got, np.array(want, dtype=dt.np), err_msg=redop)
        exact = S.reduce_symmetric(x, n, redop, 3 if redop == "premulsum" else None)
        np.testing.assert_array_equal(got, exact, err_msg=redop)


def test_bfloat16_sum_accumulates_in_float32_and_rounds_once():
    x = np.full(4, 1.0 + 2 ** -7, dtype=ml_dtypes.bfloat16)   # 1.0078125, exact in bf16
    got = S.all_reduce(x, 3, "sum")
    want = (x.astype(np.float32) * 3).astype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(got, want)
    # folding in bf16 itself would round twice and can differ; the float32 accumulator must win
    assert got.dtype == ml_dtypes.bfloat16


def test_broadcast_reduce_and_rooted_ops():
    x = np.arange(6, dtype=np.float32)
    np.testing.assert_array_equal(S.broadcast(x), x)
    np.testing.assert_array_equal(S.reduce(x, 4, root=0, rank=0), x * 4)
    assert S.reduce(x, 4, root=1, rank=0) is None
    np.testing.assert_array_equal(S.gather(x, 3, root=0, rank=0), np.concatenate([x] * 3))
    assert S.gather(x, 3, root=1, rank=0) is None
    blocks = np.arange(12, dtype=np.int32)
    np.testing.assert_array_equal(S.scatter(blocks, 3, 0, 0, 4, np.int32), blocks[:4])
    np.testing.assert_array_equal(S.scatter(blocks, 3, 2, 2, 4, np.int32), blocks[8:])
    np.testing.assert_array_equal(S.scatter(None, 3, 0, 1, 4, np.int32), np.zeros(4, np.int32))


@pytest.mark.parametrize("dtype", [np.float32, np.int64, ml_dtypes.bfloat16, np.uint8])
def test_all_gather_reduce_scatter_all_to_all(dtype):
    n, c = 4, 5
    x = np.arange(c).astype(dtype)
    np.testing.assert_array_equal(S.all_gather(x, n), np.tile(x, n))
    inp = np.arange(n * c).astype(dtype)
    for r in range(n):
        share = inp[r * c:(r + 1) * c]
        got = S.reduce_scatter(inp, n, r, "max")
        np.testing.assert_array_equal(got, share)
        np.testing.assert_array_equal(S.all_to_all(inp, n, r), np.tile(share, n))
    if np.issubdtype(np.dtype(dtype), np.floating) or dtype is ml_dtypes.bfloat16:
        np.testing.assert_array_equal(S.reduce_scatter(inp, n, 1, "sum").astype(np.float64),
                                      (inp[c:2 * c].astype(np.float32) * n).astype(dtype).astype(np.float64))


def test_all_to_all_uneven_splits_fill_from_own_block():
    inp = np.arange(10, dtype=np.float32)            # rows of 2: splits 1, 2, 2 rows
    out = S.all_to_all(inp, 3, 1, in_splits=[1, 2, 2], out_splits=[1, 2, 3], row=2)
    mine = inp[2:6]
    np.testing.assert_array_equal(out, np.concatenate([mine[:2], mine, np.concatenate([mine, [0, 0]])]))


def test_errors_name_the_problem():
    with pytest.raises(ValueError, match="not divisible by 3"):
        S.reduce_scatter(np.zeros(4), 3, 0)
    with pytest.raises(ValueError, match="premulsum needs its scale"):
        S.reduce_symmetric(np.zeros(4, np.float32), 2, "premulsum")
    with pytest.raises(ValueError, match="unknown reduction 'xor'"):
        S.reduce_symmetric(np.zeros(4, np.float32), 2, "xor")
    with pytest.raises(ValueError, match="group size must be at least 1"):
        S.reduce_symmetric(np.zeros(4, np.float32), 0)


def test_int16_has_no_nccl_type_but_still_reduces():
    x = np.array([30000, -2, 7], dtype=np.int16)
    np.testing.assert_array_equal(S.all_reduce(x, 3, "sum"), (x.astype(np.int64) * 3).astype(np.int16))


@pytest.mark.parametrize("dtype", [np.bool_, np.int16])
def test_dtypes_without_an_nccl_type_move_through_the_native_results(dtype):
    # torch's bool and int16 tensors: NCCL has no type for them, the data-moving kinds still
    # run in fake_results.cc (by element size), and send/recv match on the dtype
    x = (np.arange(8) % 3).astype(dtype)
    np.testing.assert_array_equal(S.all_gather(x, 3), np.tile(x, 3))
    np.testing.assert_array_equal(S.all_to_all(x, 4, 1), np.tile(x[2:4], 4))
    np.testing.assert_array_equal(S.broadcast(x), x)
    np.testing.assert_array_equal(S.scatter(x, 4, 2, 2, 2, dtype), x[4:6])
    ex = S.PeerExchange()
    ex.send("g", 0, 2, 1, x)
    assert not ex.recv("g", 0, 2, 1, 8, np.uint8)[1]      # same bytes, another dtype
    data, matched = ex.recv("g", 0, 2, 1, 8, dtype)
    assert matched and data.dtype == dtype
    np.testing.assert_array_equal(data, x)


def test_a_bad_rank_is_an_error_from_the_native_results():
    with pytest.raises(S.FakeResultsError, match="bad arguments"):
        S.all_to_all(np.zeros(8, np.float32), 4, 7)


class TestPeerExchange:
    def test_ring_receive_gets_own_send_to_the_mirror_peer(self):
        ex = S.PeerExchange()
        # rank 0 of 8 sends to 1 and receives from 7 (a ring): what 7 sent to 0 mirrors 0 -> 1
        ex.send("g", 0, 8, 1, np.arange(3.0))
        data, matched = ex.recv("g", 0, 8, 7, 3, np.float64)
        assert matched and list(data) == [0, 1, 2]

    def test_pipeline_stage_zero_gradients_are_zeros(self):
        ex = S.PeerExchange()
        ex.send("pp", 0, 4, 1, np.ones(5, np.float32))        # activations forward
        data, matched = ex.recv("pp", 0, 4, 1, 5, np.float32)  # gradients back from stage 1
        assert not matched and not data.any()

    def test_matching_needs_same_count_dtype_and_group(self):
        ex = S.PeerExchange()
        ex.send("a", 1, 4, 2, np.ones(4, np.float32))
        assert not ex.recv("b", 1, 4, 0, 4, np.float32)[1]
        assert not ex.recv("a", 1, 4, 0, 5, np.float32)[1]
        assert not ex.recv("a", 1, 4, 0, 4, np.float64)[1]
        assert ex.recv("a", 1, 4, 0, 4, np.float32)[1]
        assert not ex.recv("a", 1, 4, 0, 4, np.float32)[1]   # taken once

    def test_payload_is_copied_and_queue_bounded(self):
        ex = S.PeerExchange(max_pending=2)
        buf = np.zeros(2)
        ex.send("g", 0, 2, 1, buf)
        buf[:] = 9
        assert list(ex.recv("g", 0, 2, 1, 2, np.float64)[0]) == [0, 0]
        for v in range(3):
            ex.send("g", 0, 2, 1, np.full(2, v, np.float64))
        assert list(ex.recv("g", 0, 2, 1, 2, np.float64)[0]) == [1, 1]   # the oldest was dropped
