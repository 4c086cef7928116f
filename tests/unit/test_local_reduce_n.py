"""The shim's n-way reduction for host-local collectives (native/src/numerics/reduce_n.cc), through
its test hook fakegpu_reduce_n, against the coordinator's reduce_into
(fakegpu/coordinator/collectives/numerics.py): every datatype x redop, n in {1,2,3,4,8}, counts
around the 2048-element block, special values, wrapping, saturation. Results are compared
byte for byte; the only NaN-aware comparison is the one case where numpy itself is not
deterministic (two different NaN payloads meeting in an addition)."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from cffi import FFI

from fakegpu.coordinator.collectives import numerics as N
from helpers import numpy_reduce

SUM, PROD, MAX, MIN, AVG, PREMUL = range(6)
COUNTS = (0, 1, 3, 2047, 2048, 2049, 10000)
RANKS = (1, 2, 3, 4, 5, 6, 7, 8)  # 5..8: every shape of the later passes
GUARD = 16  # elements after the output that must stay untouched

# The NaN x86 arithmetic produces (inf - inf, 0 * inf): negative, quiet, no payload. Random
# inputs use only this NaN, so every NaN in a fold is the same bits and results compare exactly.
DEFAULT_NAN_BITS = {np.dtype(np.float16): 0xFE00, np.dtype(np.float32): 0xFFC00000,
                    np.dtype(np.float64): 0xFFF8000000000000, np.dtype(ml_dtypes.bfloat16): 0xFFC0,
                    np.dtype(ml_dtypes.float8_e4m3fn): 0xFF, np.dtype(ml_dtypes.float8_e5m2): 0xFE}
UINT_OF_SIZE = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


@pytest.fixture(scope="module")
def reduce_n(shim_library):
    """reduce_n(dt, redop, inputs, scalars) -> the shim's result (a new array of dt.np)."""
    ffi = FFI()
    ffi.cdef("int fakegpu_reduce_n(int datatype, int redop, const void* const* inputs, int n,"
             " void* out, uint64_t count, const uint8_t* scalars);")
    lib = ffi.dlopen(shim_library)

    def call(dt, redop, inputs, scalars=None, datatype=None):
        count = len(inputs[0])
        out = np.full((count + GUARD) * dt.size, 0x5A, np.uint8)
        keep = [ffi.from_buffer(np.ascontiguousarray(x)) for x in inputs]
        ptrs = ffi.new("const void*[]", [ffi.cast("const void*", k) for k in keep])
        raw = ffi.from_buffer(b"".join(scalars)) if scalars is not None else ffi.NULL
        rc = lib.fakegpu_reduce_n(dt.code if datatype is None else datatype, redop, ptrs,
                                       len(inputs), ffi.from_buffer(out), count, raw)
        assert rc == 0, f"fakegpu_reduce_n refused {dt.name} redop {redop}"
        assert (out[count * dt.size:] == 0x5A).all(), "wrote past the end of the output"
        return out[:count * dt.size].view(dt.np)

    call.lib = lib
    call.ffi = ffi
    return call


def coordinator_result(dt, redop, inputs, scalars=None):
    out = np.full(len(inputs[0]), 7, dt.np)
    with np.errstate(all="ignore"):  # inf - inf, overflow: meant to happen here
        numpy_reduce.numpy_reduce_into(dt, redop, inputs, [out], scalars if redop == PREMUL else None)
    return out


def assert_same_bits(got, want, what):
    if got.tobytes() != want.tobytes():
        u = UINT_OF_SIZE[got.dtype.itemsize]
        bad = np.nonzero(got.view(u) != want.view(u))[0]
        i = int(bad[0])
        pytest.fail(f"{what}: {len(bad)} elements differ, first at {i}: "
                    f"got {got[i]!r} ({int(got.view(u)[i]):#x}) want {want[i]!r} ({int(want.view(u)[i]):#x})")


def random_inputs(dt, n, count, rng):
    """n arrays of count elements covering the type: for floats, random bit patterns (every
    exponent: subnormals, huge values, +-inf, +-0) mixed with moderate values (so sums round
    and cancel), NaNs set to DEFAULT_NAN_BITS; for integers, the whole range (sums wrap)."""
    if not dt.is_float:
        info = np.iinfo(dt.np)
        return [rng.integers(info.min, info.max, count, dtype=dt.np, endpoint=True) for _ in range(n)]
    u = UINT_OF_SIZE[dt.size]
    xs = []
    for _ in range(n):
        bits = rng.integers(0, np.iinfo(u).max, count, dtype=u, endpoint=True)
        x = bits.view(dt.np).copy()
        moderate = rng.random(count) < 0.6
        scale = float(ml_dtypes.finfo(dt.np).max) / 8 if dt.size == 1 else 1000.0
        x[moderate] = (rng.standard_normal(int(moderate.sum())) * scale).astype(dt.np)
        with np.errstate(invalid="ignore"):
            nan = np.isnan(x.astype(np.float64))
        x.view(u)[nan] = DEFAULT_NAN_BITS[dt.np]
        xs.append(x)
    return xs


def premul_scalars(dt, n, rng):
    """A different PreMulSum scalar per rank, as 8-byte left-aligned values of the type."""
    if dt.is_float:
        values = np.array([0.5, -1.25, 3.0, 0.1, -7.5, 1.0, 0.3, -0.0625], np.float64)[:n]
        values = values.astype(dt.np)
    else:
        info = np.iinfo(dt.np)
        values = rng.integers(info.min, info.max, n, dtype=dt.np, endpoint=True)
        values[0] = 3
    return [values[r:r + 1].tobytes().ljust(8, b"\0") for r in range(n)]


@pytest.mark.parametrize("redop", range(6), ids=["sum", "prod", "max", "min", "avg", "premulsum"])
@pytest.mark.parametrize("code", sorted(N.DTYPES), ids=[N.DTYPES[c].name for c in sorted(N.DTYPES)])
def test_matches_the_coordinator_bit_for_bit(reduce_n, code, redop):
    dt = N.DTYPES[code]
    rng = np.random.default_rng(1000 * code + redop)
    for n in RANKS:
        scalars = premul_scalars(dt, n, rng) if redop == PREMUL else None
        for count in COUNTS:
            xs = random_inputs(dt, n, count, rng)
            assert_same_bits(reduce_n(dt, redop, xs, scalars), coordinator_result(dt, redop, xs, scalars),
                             f"{dt.name} redop {redop} n={n} count={count}")


@pytest.mark.parametrize("code", sorted(N.DTYPES), ids=[N.DTYPES[c].name for c in sorted(N.DTYPES)])
def test_large_payloads_take_the_coordinators_blocked_path(reduce_n, code):
    # Above 256 KiB reduce_into works block by block (and in threads): still the same bits.
    dt = N.DTYPES[code]
    rng = np.random.default_rng(code)
    count = (300 * 1024) // dt.size + 5
    xs = random_inputs(dt, 4, count, rng)
    for redop in (SUM, MAX, AVG, PREMUL):
        sc = premul_scalars(dt, 4, rng)
        assert_same_bits(reduce_n(dt, redop, xs, sc), coordinator_result(dt, redop, xs, sc),
                         f"{dt.name} redop {redop} count={count}")


def test_integer_wraparound_and_truncating_average(reduce_n):
    i8, u8, i32, i64, u64 = (N.DTYPES[c] for c in (0, 1, 2, 4, 5))
    xs = [np.array([100, -128, 127, -7, 7], np.int8), np.array([100, -1, 1, 0, 0], np.int8)]
    assert reduce_n(i8, SUM, xs).tolist() == [-56, 127, -128, -7, 7]
    assert reduce_n(i8, PROD, xs).tolist() == [16, -128, 127, 0, 0]
    assert reduce_n(i8, AVG, xs).tolist() == [-28, 63, -64, -3, 3]  # -56/2, 127/2, -128/2, -7/2, 7/2
    assert reduce_n(u64, SUM, [np.array([2**64 - 1], np.uint64), np.array([2], np.uint64)]).tolist() == [1]
    big = np.array([2**63 - 1, -2**63], np.int64)
    assert reduce_n(i64, SUM, [big, big, big]).tolist() == [2**63 - 3, -2**63]
    assert reduce_n(i32, AVG, [np.array([-7, 2**31 - 1], np.int32), np.array([0, 2], np.int32)]).tolist() \
        == [-3, -1073741823]
    sc = [np.array([v], np.int8).tobytes().ljust(8, b"\0") for v in (3, -2)]
    # 50*3 = 150 wraps to -106, 20*-2 = -40: -146 wraps to 110
    assert reduce_n(i8, PREMUL, [np.array([50], np.int8), np.array([20], np.int8)], sc).tolist() == [110]
    assert reduce_n(u8, AVG, [np.array([255], np.uint8), np.array([3], np.uint8), np.array([1], np.uint8)]).tolist() == [1]


@pytest.mark.parametrize("n", [127, 128, 129, 256, 300])
def test_integer_average_over_more_ranks_than_the_type_can_count(reduce_n, n):
    # C's truncation toward zero: once |x| < n for every value the average is 0; int8 with
    # n == 128 (not representable as an int8 divisor) still gives -128 / 128 = -1.
    for code in (0, 1):
        dt = N.DTYPES[code]
        xs = [np.array([-128 if code == 0 else 200, 1, 5], dt.np)] + [np.zeros(3, dt.np)] * (n - 1)
        assert_same_bits(reduce_n(dt, AVG, xs), coordinator_result(dt, AVG, xs), f"{dt.name} avg n={n}")
    # -128 / 127 and -128 / 128 truncate to -1; from 129 on every average is 0.
    want = [-1] if n in (127, 128) else [0]
    assert reduce_n(N.DTYPES[0], AVG, [np.array([-128], np.int8)] + [np.zeros(1, np.int8)] * (n - 1)).tolist() == want


def test_float8_saturates_and_half_types_overflow_to_infinity(reduce_n):
    e4m3, e5m2, f16, bf16 = (N.DTYPES[c] for c in (10, 11, 6, 9))
    x = np.array([300, -300, np.inf, -np.inf, np.nan], np.float32)
    got = reduce_n(e4m3, SUM, [x.astype(e4m3.np)] * 2).astype(np.float32)
    # 300 is 288 in e4m3fn: 576 clips to 448; e4m3fn has no infinity, so +-inf inputs are NaN
    assert got[:2].tolist() == [448, -448] and np.isnan(got[2:]).all()
    got = reduce_n(e5m2, SUM, [x.astype(e5m2.np)] * 2).astype(np.float32)
    # 300 is 320 in e5m2 (640 fits); inf + inf clips to the largest finite value
    assert got[:4].tolist() == [640, -640, 57344, -57344] and np.isnan(got[4])
    y = np.array([40000, -60000], np.float32)
    assert reduce_n(f16, SUM, [y.astype(np.float16)] * 2).astype(np.float32).tolist() == [np.inf, -np.inf]
    z = np.array([3e38], np.float32)
    assert reduce_n(bf16, SUM, [z.astype(bf16.np)] * 2).astype(np.float32).tolist() == [np.inf]
    for dt in (e4m3, e5m2, f16, bf16):
        assert_same_bits(reduce_n(dt, SUM, [x.astype(dt.np)] * 3), coordinator_result(dt, SUM, [x.astype(dt.np)] * 3),
                         dt.name)


def test_narrow_floats_are_rounded_once(reduce_n):
    # float16: 2048 + 1 + 1 is 2050 in float32 and in float16; a float16 chain gives 2048.
    f16 = N.DTYPES[6]
    xs = [np.array([2048], np.float16), np.array([1], np.float16), np.array([1], np.float16)]
    assert reduce_n(f16, SUM, xs).tolist() == [2050]
    assert reduce_n(f16, AVG, xs).tolist() == [np.float16(2050 / 3)]


@pytest.mark.parametrize("code", [6, 7, 8, 9, 10, 11])
def test_signed_zeros_like_numpy(reduce_n, code):
    # np.maximum / np.minimum take the later operand between +0 and -0; sums follow IEEE.
    dt = N.DTYPES[code]
    a = np.array([0.0, -0.0, 0.0, -0.0], np.float32).astype(dt.np)
    b = np.array([-0.0, 0.0, 0.0, -0.0], np.float32).astype(dt.np)
    for redop in (SUM, PROD, MAX, MIN, AVG):
        for xs in ([a, b], [b, a], [a, b, a]):
            assert_same_bits(reduce_n(dt, redop, xs), coordinator_result(dt, redop, xs), f"{dt.name} {redop}")


@pytest.mark.parametrize("code", [6, 7, 8, 9, 10, 11])
def test_nan_payloads_pass_through_like_numpy(reduce_n, code):
    # One NaN per element (quiet or signalling, either sign, with payload bits): the result's
    # NaN is exactly numpy's / ml_dtypes' (float16 keeps payloads, bfloat16 and float8 do not;
    # Max/Min pass the NaN through untouched, arithmetic quiets it).
    dt = N.DTYPES[code]
    u = UINT_OF_SIZE[dt.size]
    nans = {6: [0x7C01, 0xFC01, 0x7E00, 0x7D23, 0xFE55], 7: [0x7F800001, 0xFFC00000, 0x7FC12345, 0xFFA00000],
            8: [0x7FF0000000000001, 0xFFF8000000000000, 0x7FF8123456789ABC], 9: [0x7F81, 0xFFC0, 0x7FD0, 0xFF81],
            10: [0x7F, 0xFF], 11: [0x7D, 0x7E, 0x7F, 0xFD, 0xFE, 0xFF]}[code]
    k = len(nans)
    base = np.array([1.5] * k, np.float32).astype(dt.np)
    nan_col = np.array(nans, u).view(dt.np)
    sc = [np.array([v], dt.np).tobytes().ljust(8, b"\0") for v in (2.0, -0.5, 1.0)]
    for redop in range(6):
        for xs in ([nan_col], [nan_col, base], [base, nan_col], [base, base, nan_col]):
            scalars = sc[:len(xs)] if redop == PREMUL else None
            assert_same_bits(reduce_n(dt, redop, xs, scalars), coordinator_result(dt, redop, xs, scalars),
                             f"{dt.name} redop {redop} NaN at rank {[len(x) for x in xs]}")


@pytest.mark.parametrize("code", [7, 8])
def test_max_min_keep_the_first_nan(reduce_n, code):
    # With two different NaNs, np.maximum / np.minimum keep the one folded first.
    dt = N.DTYPES[code]
    u = UINT_OF_SIZE[dt.size]
    one = np.array([0x7FC00001 if code == 7 else 0x7FF8000000000001] * 20, u).view(dt.np)
    two = np.array([0xFFC00002 if code == 7 else 0xFFF8000000000002] * 20, u).view(dt.np)
    for redop in (MAX, MIN):
        for xs in ([one, two], [two, one], [np.ones(20, dt.np), two, one]):
            assert_same_bits(reduce_n(dt, redop, xs), coordinator_result(dt, redop, xs), f"{dt.name} {redop}")


def test_mixed_nan_payloads_give_nan_where_numpy_is_not_deterministic(reduce_n):
    # np.add of two different NaNs returns the first operand's in its SIMD body and the second's
    # in its scalar tail, so only "NaN" can be asserted where different payloads meet.
    rng = np.random.default_rng(7)
    payloads = {6: [0x7E00, 0xFE00, 0x7E01, 0xFD00], 7: [0x7FC00000, 0xFFC00000, 0x7FC00001, 0xFFA00000],
                8: [0x7FF8000000000000, 0xFFF8000000000000, 0x7FF8000000000001],
                9: [0x7FC0, 0xFFC0, 0x7FC1, 0xFF81]}
    for code, pats in payloads.items():
        dt = N.DTYPES[code]
        u = UINT_OF_SIZE[dt.size]
        xs = random_inputs(dt, 4, 999, rng)
        for x in xs:
            lanes = np.nonzero(rng.random(999) < 0.3)[0]
            x.view(u)[lanes] = np.array(pats, u)[rng.integers(0, len(pats), len(lanes))]
        for redop in (SUM, AVG, PROD, MAX, MIN):
            got = reduce_n(dt, redop, xs)
            want = coordinator_result(dt, redop, xs)
            with np.errstate(invalid="ignore"):
                got_nan, want_nan = np.isnan(got.astype(np.float64)), np.isnan(want.astype(np.float64))
            assert (got_nan == want_nan).all(), f"{dt.name} redop {redop}: NaN lanes differ"
            assert got[~want_nan].tobytes() == want[~want_nan].tobytes(), f"{dt.name} redop {redop}"
            if redop in (MAX, MIN):  # no arithmetic on NaNs: the first NaN wins, exactly
                assert_same_bits(got, want, f"{dt.name} redop {redop}")


def test_unaligned_inputs_and_one_buffer_passed_for_every_rank(reduce_n):
    dt = N.DTYPES[8]  # float64, inputs starting 8 bytes into their buffers
    rng = np.random.default_rng(3)
    xs = [rng.standard_normal(5001)[1:] for _ in range(3)]
    assert_same_bits(reduce_n(dt, SUM, xs), coordinator_result(dt, SUM, xs), "offset inputs")
    x = rng.standard_normal(4099).astype(np.float32)
    f32 = N.DTYPES[7]
    assert_same_bits(reduce_n(f32, PROD, [x] * 5), coordinator_result(f32, PROD, [x] * 5), "same buffer")


def test_refuses_unknown_arguments(reduce_n):
    lib, ffi = reduce_n.lib, reduce_n.ffi
    x = np.zeros(4, np.float32)
    buf = ffi.from_buffer(x)
    ptrs = ffi.new("const void*[]", [ffi.cast("const void*", buf)])
    out = ffi.from_buffer(np.zeros(4, np.float32))
    sc = ffi.new("uint8_t[8]")
    assert lib.fakegpu_reduce_n(7, SUM, ptrs, 1, out, 4, ffi.NULL) == 0
    assert lib.fakegpu_reduce_n(12, SUM, ptrs, 1, out, 4, ffi.NULL) == -1
    assert lib.fakegpu_reduce_n(-1, SUM, ptrs, 1, out, 4, ffi.NULL) == -1
    assert lib.fakegpu_reduce_n(7, 6, ptrs, 1, out, 4, ffi.NULL) == -1
    assert lib.fakegpu_reduce_n(7, -1, ptrs, 1, out, 4, ffi.NULL) == -1
    assert lib.fakegpu_reduce_n(7, SUM, ptrs, 0, out, 4, ffi.NULL) == -1
    assert lib.fakegpu_reduce_n(7, PREMUL, ptrs, 1, out, 4, ffi.NULL) == -1  # no scalars
    assert lib.fakegpu_reduce_n(7, PREMUL, ptrs, 1, out, 4, sc) == 0
    assert lib.fakegpu_reduce_n(7, SUM, ffi.NULL, 3, ffi.NULL, 0, ffi.NULL) == 0  # nothing to do


@pytest.mark.parametrize("code", [2, 7, 9])
def test_premulsum_over_many_ranks(reduce_n, code):
    # More ranks than reduce_n keeps scalars for on the stack (64).
    dt = N.DTYPES[code]
    rng = np.random.default_rng(code)
    n = 70
    xs = random_inputs(dt, n, 257, rng)
    if dt.is_float:
        values = (rng.standard_normal(n) * 2).astype(dt.np)
        sc = [values[r:r + 1].tobytes().ljust(8, b"\0") for r in range(n)]
    else:
        sc = premul_scalars(dt, n, rng)
    assert_same_bits(reduce_n(dt, PREMUL, xs, sc), coordinator_result(dt, PREMUL, xs, sc), f"{dt.name} n={n}")


def test_float16_rounding_of_a_million_random_sums_matches_numpy(reduce_n):
    # Sums of two float16 values cover normal, subnormal, overflowing and exactly-halfway float32
    # results; numpy's float32 -> float16 cast is the reference for the final rounding.
    f16 = N.DTYPES[6]
    rng = np.random.default_rng(7)
    bits = rng.integers(0, 1 << 16, size=(2, 1 << 20), dtype=np.uint32).astype(np.uint16)
    a, b = bits[0].view(np.float16), bits[1].view(np.float16)
    with np.errstate(all="ignore"):
        want = (a.astype(np.float32) + b.astype(np.float32)).astype(np.float16)
    got = reduce_n(f16, SUM, [a, b])
    nan = np.isnan(want)
    assert (np.isnan(got) == nan).all()
    assert_same_bits(got[~nan], want[~nan], "float16 sums")
