"""tests/helpers/gloo_order.py, the model of the order in which torch's CPU gloo reduces
floats, held to real gloo ranks bit for bit (and its chunk plans to step-by-step replays of
gloo's two rings)."""
from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from helpers import gloo_order as G

ml_dtypes = pytest.importorskip("ml_dtypes")

needs_torch = pytest.mark.skipif(importlib.util.find_spec("torch") is None,
                                 reason="torch is not installed")


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.dtype(f"u{a.itemsize}"))


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and np.array_equal(_bits(a), _bits(b))


def _wide(rng, n, dtype):
    """Magnitudes spread over 2^-6..2^6, so almost every association rounds differently."""
    return (rng.standard_normal(n) * np.exp2(rng.integers(-6, 7, n))).astype(dtype)


def test_plan_of_a_small_buffer_is_one_chunk_per_rank_from_the_rank_before():
    # 4 ranks, 10 float32: 8 segments of 2 elements (ceil(40 / 8) = 5 bytes, rounded up to
    # whole elements), 2 per rank, so 4-element chunks and a 2-element third one.
    assert G.plan_allreduce(4, 10, 4) == [(0, 4, [3, 2, 1, 0]), (4, 8, [0, 3, 2, 1]),
                                          (8, 10, [1, 0, 3, 2])]
    # fewer elements than ranks: only the first chunks hold anything
    assert G.plan_allreduce(8, 1, 4) == [(0, 1, [7, 6, 5, 4, 3, 2, 1, 0])]
    assert G.plan_allreduce(2, 5, 2) == [(0, 4, [1, 0]), (4, 5, [0, 1])]


def test_large_buffers_are_cut_by_the_one_mib_segment_limit():
    # 4 ranks: up to 8 MiB there are 8 segments; past it ceil(bytes / 1 MiB) rounded up to
    # a multiple of 4, spread evenly by all-reduce and kept at 1 MiB by reduce.
    w, t = 4, 2 * 4 * 262144  # float32 elements in 8 MiB
    assert G.allreduce_geometry(w, t, 4) == (8, 1 << 20)
    assert G.allreduce_geometry(w, t + 1, 4) == (12, 699052)  # ceil(8 MiB + 4 / 12), whole elements
    assert G.reduce_geometry(w, t + 1, 4) == (12, 1 << 20)
    # so reduce's chunks are 3 MiB and its last rank's chunk is empty
    assert [(b, e) for b, e, _ in G.plan_reduce(w, t + 1, 4)] == [
        (0, 3 * 262144), (3 * 262144, 6 * 262144), (6 * 262144, t + 1)]


@pytest.mark.parametrize("world", [2, 3, 4, 5, 8])
@pytest.mark.parametrize("count", [1, 3, 7, 64, 1001])
@pytest.mark.parametrize("dtype", [np.float32, np.float16, ml_dtypes.bfloat16])
def test_plans_equal_a_message_by_message_replay_of_gloos_rings(world, count, dtype):
    rng = np.random.default_rng([world, count])
    xs = [_wide(rng, count, dtype) for _ in range(world)]
    assert _same_bits(G.all_reduce(xs)[0], G.simulate_allreduce(xs)[0])
    root = count % world
    assert _same_bits(G.simulate_reduce(xs, "sum", root)[root],
                      G.fold(xs, "sum", G.plan_reduce(world, count, xs[0].itemsize)))


def test_half_types_round_after_every_addition():
    # 2048 + 1 + 1 in float16: float32 accumulation would give 2050, gloo gives 2048 twice
    # rounded (2049 is a tie between 2048 and 2050, to even: 2048)
    xs = [np.array([v], np.float16) for v in (1.0, 1.0, 2048.0)]
    # 3 ranks, one element: chunk 0 starts at rank 2, then rank 1, then rank 0
    assert G.plan_allreduce(3, 1, 2) == [(0, 1, [2, 1, 0])]
    assert G.all_reduce(xs)[0][0] == np.float16(2048.0)


def _cases(world):
    cases = []
    for dtype in ("float32", "bfloat16"):
        for n in (1, world + 1, 1000, 4099):
            cases.append(dict(coll="all_reduce", op="sum", dtype=dtype, count=n, seed=n))
        cases.append(dict(coll="all_reduce", op="prod", dtype=dtype, count=500, seed=2, data="near1"))
        cases.append(dict(coll="reduce_scatter_tensor", op="sum", dtype=dtype, count=world * 257, seed=3))
        cases.append(dict(coll="reduce_scatter", op="sum", dtype=dtype, count=world * 257, seed=4))
        cases.append(dict(coll="reduce", op="sum", dtype=dtype, count=1001, seed=5, root=world - 1))
    cases.append(dict(coll="all_reduce_coalesced", op="sum", dtype="float32", count=1500,
                      sizes=[1000, 1, 499], seed=6))
    cases.append(dict(coll="all_reduce", op="avg", dtype="float32", count=1000, seed=7))
    cases.append(dict(coll="reduce", op="avg", dtype="float32", count=1000, seed=8, root=1))
    cases.append(dict(coll="all_reduce", op="max", dtype="float32", count=1000, seed=9, data="nan"))
    # a subgroup in an order of its own: the chains run over group ranks
    cases.append(dict(coll="all_reduce", op="sum", dtype="float32", count=1000, seed=10,
                      group=[world - 1, 0, 1], sort_ranks=False))
    return cases


def _model(case, xs, world):
    """What gloo_order says each (group) rank gets; xs in group-rank order."""
    return G.expected(case, xs, world)


@pytest.mark.torch
@needs_torch
@pytest.mark.parametrize("world", [3, 4])
def test_model_equals_real_gloo_bit_for_bit(world):
    from helpers.gloo_probe import case_inputs, run_gloo

    cases = _cases(world)
    got = run_gloo(world, cases, timeout_s=240)
    for case in cases:
        n = len(case.get("group") or range(world))
        xs = [case_inputs(case, r) for r in range(n)]
        want = _model(case, xs, n)
        for rank in range(n):
            g = got[case["id"]][rank]
            assert not isinstance(g, str), f"{case}: gloo raised {g}"
            assert _same_bits(g, want[rank]), f"{case}, rank {rank}: {np.sum(_bits(g) != _bits(want[rank]))} elements differ"
        if case["count"] >= 1000 and case["coll"] == "all_reduce" and case["op"] in ("sum", "prod"):
            # the data does tell the orders apart: rank order would not match
            in_rank_order = G.fold(xs, case["op"], [(0, xs[0].size, list(range(n)))])
            assert not _same_bits(got[case["id"]][0], in_rank_order)
