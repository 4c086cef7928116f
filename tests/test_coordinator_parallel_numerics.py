"""The coordinator's large-payload paths: reductions split over threads and float8 widened
through lookup tables must give bit-identical results to the one-thread reference."""
from __future__ import annotations

import numpy as np
import pytest

from fakegpu import protocol as P
from fakegpu.coordinator.collectives import numerics as N


@pytest.mark.parametrize("code", [10, 11])
def test_float8_table_is_exact_for_every_bit_pattern(code):
    dt = N.DTYPES[code]
    raw = np.arange(256, dtype=np.uint8).view(dt.np)
    out = np.empty(256, dtype=np.float32)
    N.widen(dt, raw, out)
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
    for a, b in zip(threaded, single):
        assert np.array_equal(a.view(np.uint8), b.view(np.uint8))
    head = N.reference_reduce(dt, redop, [x[:2000] for x in ins], scalars)
    assert np.array_equal(threaded[0][:2000].view(np.uint8), head.view(np.uint8))


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
