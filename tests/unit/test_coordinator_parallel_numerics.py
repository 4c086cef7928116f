"""The coordinator's large-payload paths: reductions split over threads and float8 widened
through lookup tables must give bit-identical results to the one-thread reference."""
from __future__ import annotations

import numpy as np
import pytest

from fakegpu import native_numerics, protocol as P
from fakegpu.coordinator.collectives import numerics as N
from helpers import numpy_reduce


@pytest.mark.parametrize("code", [10, 11])
def test_float8_table_is_exact_for_every_bit_pattern(code):
    dt = N.DTYPES[code]
    raw = np.arange(256, dtype=np.uint8).view(dt.np)
    out = np.empty(256, dtype=np.float32)
    numpy_reduce.widen(dt, raw, out)
    want = raw.astype(np.float32)
    assert np.array_equal(out.view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("code", [2, 6, 7, 8, 9, 10])
@pytest.mark.parametrize("redop", [P.REDOP_SUM, P.REDOP_MAX, P.REDOP_AVG, P.REDOP_PREMULSUM])
def test_threaded_reduction_matches_single_thread(monkeypatch, code, redop):
    dt = N.DTYPES[code]
    n, count = 3, 300_001  # odd length: the last piece is short
    rng = np.random.default_rng(code * 10 + redop)
    ins = [rng.integers(-50, 50, count).astype(dt.np) for _ in range(n)]
    scalars = [np.array([r + 1], dtype=dt.np).tobytes().ljust(8, b"\0") for r in range(n)]
    monkeypatch.setattr(N, "PARALLEL_MIN_BYTES", 1 << 16)
    monkeypatch.setattr(N, "_MAX_WORKERS", 4)
    threaded = [np.zeros(count, dtype=dt.np) for _ in range(n)]
    N.reduce_into(dt, redop, ins, threaded, scalars)
    monkeypatch.setattr(N, "_MAX_WORKERS", 1)
    single = [np.zeros(count, dtype=dt.np) for _ in range(n)]
    N.reduce_into(dt, redop, ins, single, scalars)
    # Every output, whole: the other outputs are copied block by block (COPY_BLOCK_BYTES), and
    # 300,001 elements end in a short block.
    want = numpy_reduce.reference_reduce(dt, redop, ins, scalars)
    for i, out in enumerate(threaded + single):
        assert np.array_equal(out.view(np.uint8), want.view(np.uint8)), f"output {i % n} ({'threaded' if i < n else 'single'})"


def test_worker_error_propagates(monkeypatch):
    monkeypatch.setattr(N, "_MAX_WORKERS", 3)
    monkeypatch.setattr(N, "PARALLEL_MIN_BYTES", 1)
    seen = []

    def work(lo, hi):
        seen.append((lo, hi))
        if lo > 0:
            raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        N.run_in_parallel(3 * 4096, 1, work)
    assert sorted(seen) == [(0, 4096), (4096, 8192), (8192, 12288)]


def test_bad_thread_count_is_named(monkeypatch):
    monkeypatch.setenv("FAKEGPU_REDUCE_THREADS", "many")
    with pytest.raises(ValueError, match="FAKEGPU_REDUCE_THREADS"):
        N._worker_count()


def test_threaded_broadcast_and_allgather_copy_every_byte(monkeypatch):
    from fakegpu.coordinator.collectives import allgather, broadcast
    monkeypatch.setattr(N, "PARALLEL_MIN_BYTES", 1 << 12)
    monkeypatch.setattr(N, "_MAX_WORKERS", 3)
    dt = N.DTYPES[7]
    n, count = 3, 100_003
    rng = np.random.default_rng(7)
    ins = [rng.integers(0, 255, count * 4, dtype=np.uint8) for _ in range(n)]
    outs = [np.zeros(count * 4, dtype=np.uint8) for _ in range(n)]
    broadcast.execute(dt, 0, count, 1, ins, outs, None)
    for o in outs:
        assert np.array_equal(o, ins[1])
    outs = [np.zeros(n * count * 4, dtype=np.uint8) for _ in range(n)]
    allgather.execute(dt, 0, count, -1, ins, outs, None)
    for o in outs:
        assert np.array_equal(o, np.concatenate(ins))


def test_float16_table_is_exact_for_every_bit_pattern():
    dt = N.DTYPES[6]
    raw = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16)
    out = np.empty(65536, dtype=np.float32)
    numpy_reduce.widen(dt, raw, out)
    assert np.array_equal(out.view(np.uint32), raw.astype(np.float32).view(np.uint32))


def test_float16_rounding_matches_numpy_bit_for_bit():
    rng = np.random.default_rng(16)
    patterns = [rng.integers(0, 2 ** 32, 1 << 18, dtype=np.uint64).astype(np.uint32)]
    # every float16 value, and the midpoints and neighbours around each (ties to even)
    h = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)
    hb = h[np.isfinite(h)].view(np.uint32)
    for delta in (0, 1, 0xFFF, 0x1000, 0x1001, 0x2000 - 1, 0x2000):
        patterns += [hb + np.uint32(delta), hb - np.uint32(delta)]
    specials = np.array([0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00001, 0x7F800001, 0x477FEFFF,
                         0x477FF000, 0x477FE000, 0x38800000, 0x387FFFFF, 0x33000000, 0x33000001,
                         0x32FFFFFF, 0x00000001, 0x80000000], dtype=np.uint32)
    bits = np.concatenate(patterns + [specials])
    x = bits.view(np.float32)
    out = np.empty(len(x), dtype=np.float16)
    numpy_reduce.narrow(N.DTYPES[6], x, out, np.empty((2, len(x)), dtype=np.uint32).T)
    with np.errstate(all="ignore"):
        want = x.astype(np.float16)
    assert np.array_equal(out.view(np.uint16), want.view(np.uint16))


@pytest.mark.parametrize("plan", [native_numerics.PLAN_GLOO_ALLREDUCE, native_numerics.PLAN_GLOO_REDUCE])
def test_blocked_gloo_plan_matches_one_native_call(monkeypatch, plan):
    """reduce_into cuts a large reduction into blocks (and threads); each block of a gloo plan
    must be folded as elements [first + b, ...) of the whole reduction, as one call folds it."""
    dt = N.DTYPES[7]
    n, count = 4, 300_001
    rng = np.random.default_rng(plan)
    ins = [rng.standard_normal(count).astype(np.float32) for _ in range(n)]
    monkeypatch.setattr(N, "PARALLEL_MIN_BYTES", 1 << 16)
    monkeypatch.setattr(N, "_MAX_WORKERS", 3)
    outs = [np.zeros(count, dtype=np.float32) for _ in range(n)]
    N.reduce_into(dt, P.REDOP_SUM, ins, outs, plan=plan, first=0, plan_count=count)
    want = np.zeros(count, dtype=np.float32)
    native_numerics.reduce_n_planned(dt.code, P.REDOP_SUM, plan, ins, want, None, 0, count)
    for out in outs:
        assert np.array_equal(out.view(np.uint32), want.view(np.uint32))
