"""FAKEGPU_REDUCTION_ORDER: the native planned fold against tests/helpers/gloo_order.py's numpy
model (itself held to real gloo bit for bit by tests/test_gloo_order_model.py), and fakegpu's
torch backend (real shim, real coordinator, real rank processes) against the model and against
real gloo, through the coordinator and through the host-local arenas; rank order on request."""
from __future__ import annotations

import importlib.util
import os

import numpy as np
import pytest

from helpers import gloo_order as G

ml_dtypes = pytest.importorskip("ml_dtypes")

needs_torch = pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed")

_CODES = {np.dtype(np.float32): 7, np.dtype(np.float64): 8, np.dtype(np.float16): 6,
          np.dtype(ml_dtypes.bfloat16): 9}
_REDOPS = {"sum": 0, "prod": 1, "max": 2, "min": 3, "avg": 4}


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.dtype(f"u{a.itemsize}"))


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(_bits(a), _bits(b))


# --- the native fold (cffi) ---------------------------------------------------------------------

@pytest.fixture
def native(shim_library, monkeypatch):
    monkeypatch.setenv("FAKEGPU_NCCL_LIBRARY", shim_library)
    from fakegpu import native_numerics
    return native_numerics


@pytest.mark.parametrize("world", [2, 3, 4, 5, 8])
@pytest.mark.parametrize("count", [1, 2, 3, 10, 1001, 300001])
def test_native_chunk_length_is_the_models(native, world, count):
    for elem in (2, 4, 8):
        for plan, model in ((native.PLAN_GLOO_ALLREDUCE, G.plan_allreduce), (native.PLAN_GLOO_REDUCE, G.plan_reduce)):
            begin, end, _ = model(world, count, elem)[0]
            chunk = native.gloo_chunk_elements(plan, world, count, elem)
            assert min(chunk, count) == end - begin, (plan, elem)


def _model_result(xs, op, plan):
    model_plan = (G.plan_allreduce if plan == 1 else G.plan_reduce)(len(xs), xs[0].size, xs[0].itemsize)
    out = G.fold(xs, "sum" if op == "avg" else op, model_plan)
    return G._average([out], len(xs))[0] if op == "avg" else out


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16, ml_dtypes.bfloat16])
@pytest.mark.parametrize("world", [2, 3, 4, 7])
def test_native_planned_fold_equals_the_gloo_model_in_pieces(native, dtype, world):
    """Random inputs, every op, cut into pieces at random offsets (as steps and arena rounds cut
    a call): the pieces together equal the model's fold of the whole buffer, bit for bit."""
    rng = np.random.default_rng([world, np.dtype(dtype).itemsize])
    for count in (1, world - 1, world + 1, 997, 200003):
        if count < 1:
            continue
        xs = [(rng.standard_normal(count) * np.exp2(rng.integers(-6, 7, count))).astype(dtype)
              for _ in range(world)]
        near1 = [(1 + 0.05 * rng.standard_normal(count)).astype(dtype) for _ in range(world)]
        cuts = sorted({0, count, *rng.integers(0, count + 1, 3).tolist()})
        for plan in (native.PLAN_GLOO_ALLREDUCE, native.PLAN_GLOO_REDUCE):
            for op in ("sum", "avg", "prod", "max", "min"):
                inputs = near1 if op == "prod" else xs
                want = _model_result(inputs, op, plan)
                got = np.empty(count, dtype)
                for lo, hi in zip(cuts, cuts[1:]):
                    native.reduce_n_planned(_CODES[np.dtype(dtype)], _REDOPS[op], plan, [x[lo:hi] for x in inputs],
                                            got[lo:hi], None, lo, count)
                assert _same_bits(got, want), (count, plan, op, int(np.sum(_bits(got) != _bits(want))))


def test_native_rank_plan_is_reduce_n(native):
    rng = np.random.default_rng(5)
    xs = [rng.standard_normal(5000).astype(ml_dtypes.bfloat16) for _ in range(4)]
    a, b = np.empty(5000, xs[0].dtype), np.empty(5000, xs[0].dtype)
    native.reduce_n(9, 0, xs, a)
    native.reduce_n_planned(9, 0, native.PLAN_RANK, xs, b, None, 0, 5000)
    assert _same_bits(a, b)
    # and it differs from gloo's order on these inputs (the tests below can tell them apart)
    native.reduce_n_planned(9, 0, native.PLAN_GLOO_ALLREDUCE, xs, b, None, 0, 5000)
    assert not _same_bits(a, b)


def test_half_sum_rounds_after_every_step(native):
    # 3 ranks, one element: gloo folds 2048 (rank 2) + 1 (rank 1) -> 2048, + 1 (rank 0) -> 2048;
    # rank order with one rounding at the end gives 2050.
    xs = [np.array([v], np.float16) for v in (1.0, 1.0, 2048.0)]
    out = np.empty(1, np.float16)
    native.reduce_n_planned(6, 0, native.PLAN_GLOO_ALLREDUCE, xs, out, None, 0, 1)
    assert out[0] == np.float16(2048.0)
    native.reduce_n(6, 0, xs, out)
    assert out[0] == np.float16(2050.0)


def test_bad_plan_or_range_is_refused(native):
    xs = [np.zeros(4, np.float32)] * 2
    out = np.empty(4, np.float32)
    with pytest.raises(native.NativeNumericsError):
        native.reduce_n_planned(7, 0, 3, xs, out, None, 0, 4)
    with pytest.raises(native.NativeNumericsError):
        native.reduce_n_planned(7, 0, 1, xs, out, None, 1, 4)  # elements 1..5 of a 4-element call


# --- through the torch backend --------------------------------------------------------------------

def _cases(world):
    big = 700001  # 2.8 MiB of float32: several gloo segments, staging steps and arena rounds
    cases = []
    for dtype in ("float32", "bfloat16"):
        for n in (1, world - 1, world + 1, 1001, big):
            cases.append(dict(coll="all_reduce", op="sum", dtype=dtype, count=n, seed=n))
        cases.append(dict(coll="all_reduce", op="avg", dtype=dtype, count=1001, seed=11))
        cases.append(dict(coll="all_reduce", op="prod", dtype=dtype, count=1001, seed=12, data="near1"))
        for n in (world, world * 257, world * 200001):
            cases.append(dict(coll="reduce_scatter_tensor", op="sum", dtype=dtype, count=n, seed=n + 3))
        cases.append(dict(coll="reduce_scatter", op="sum", dtype=dtype, count=world * 257, seed=4))
        cases.append(dict(coll="reduce_scatter", op="avg", dtype=dtype, count=world * 200001, seed=13))
        cases.append(dict(coll="reduce", op="sum", dtype=dtype, count=1001, seed=5, root=world - 1))
        cases.append(dict(coll="reduce", op="sum", dtype=dtype, count=big, seed=14, root=1))
    cases.append(dict(coll="reduce", op="avg", dtype="float32", count=1001, seed=15, root=0))
    cases.append(dict(coll="all_reduce", op="avg", dtype="float32", count=big, seed=16))
    cases.append(dict(coll="all_reduce_coalesced", op="sum", dtype="float32", count=1500, sizes=[1000, 1, 499], seed=6))
    cases.append(dict(coll="all_reduce_coalesced", op="sum", dtype="bfloat16", count=1500, sizes=[7, 1493], seed=17))
    cases.append(dict(coll="all_reduce", op="sum", dtype="float32", count=1500, coalescing=[700, 800], seed=18))
    return cases


def _want(case, xs, world):
    """Each rank's result by the gloo model (None where fakegpu's Reduce leaves the non-root
    tensors alone: gloo leaves partial sums there, NCCL's Reduce nothing defined)."""
    want = G.expected(case, xs, world)
    if case["coll"] == "reduce":
        return [w if r == case["root"] else None for r, w in enumerate(want)]
    return want


def _rank_order(case, xs, world):
    """fakegpu's rank-order results (docs/numerics.md): float32 accumulation, one rounding."""
    acc = [x.astype(np.float32) for x in xs]
    total = acc[0].copy()
    for a in acc[1:]:
        total = total + a
    if case["op"] == "avg":
        total = total / np.float32(world)
    out = total.astype(xs[0].dtype)
    if case["coll"] == "reduce_scatter_tensor":
        n = out.size // world
        return [out[r * n:(r + 1) * n] for r in range(world)]
    return [out] * world


def _run_fakegpu(world, cases, coordinator, shim_library, **env):
    from helpers.gloo_probe import run_gloo
    from helpers.shim import REPO_ROOT

    extra = dict(coordinator.client_env, FAKEGPU_NCCL_LIBRARY=shim_library, GLOO_ORDER_PROBE_BACKEND="fakegpu",
                 PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])))
    extra.update(env)
    return run_gloo(world, cases, timeout_s=300, extra_env=extra)


def _check(cases, got, world, want_fn):
    from helpers.gloo_probe import case_inputs

    bad = []
    for case in cases:
        xs = [case_inputs(case, r) for r in range(world)]
        want = want_fn(case, xs, world)
        for rank in range(world):
            g = got[case["id"]][rank]
            assert not isinstance(g, str), f"{case}: rank {rank} raised {g}"
            if want[rank] is not None and not _same_bits(g, want[rank].reshape(-1)):
                bad.append(f"{case} rank {rank}: {int(np.sum(_bits(g) != _bits(want[rank].reshape(-1))))} "
                           f"of {g.size} elements differ")
    assert not bad, "\n".join(bad)


@pytest.mark.torch
@needs_torch
@pytest.mark.parametrize("local", ["1", "0"], ids=["arenas", "coordinator"])
@pytest.mark.parametrize("world", [3, 4])
def test_torch_backend_reduces_in_gloos_order_by_default(world, local, shim_library, start_coordinator):
    """Unset FAKEGPU_REDUCTION_ORDER: every reduction of the fakegpu backend equals the gloo
    model bit for bit, with host-local collectives on (arenas, sliced above 256 KiB) and off
    (the coordinator, the large calls in several 1 MiB staging steps)."""
    cases = _cases(world)
    coordinator = start_coordinator("unix")
    got = _run_fakegpu(world, cases, coordinator, shim_library, FAKEGPU_LOCAL_COLLECTIVES=local,
                       FAKEGPU_STAGING_CHUNK_BYTES="1M")
    _check(cases, got, world, _want)


@pytest.mark.torch
@needs_torch
def test_torch_backend_equals_real_gloo(shim_library, start_coordinator):
    from helpers.gloo_probe import run_gloo

    world = 3
    cases = [dict(coll="all_reduce", op="sum", dtype="bfloat16", count=4099, seed=1),
             dict(coll="all_reduce", op="sum", dtype="float32", count=300001, seed=2),
             dict(coll="reduce_scatter_tensor", op="sum", dtype="float32", count=3 * 1001, seed=3),
             dict(coll="reduce_scatter", op="sum", dtype="bfloat16", count=3 * 1001, seed=4),
             dict(coll="all_reduce_coalesced", op="sum", dtype="float32", count=1500, sizes=[1000, 1, 499], seed=5),
             dict(coll="reduce", op="sum", dtype="float32", count=1001, seed=6, root=2),
             dict(coll="all_reduce", op="avg", dtype="bfloat16", count=1001, seed=7)]
    gloo = run_gloo(world, [dict(c) for c in cases], timeout_s=240)
    fake = _run_fakegpu(world, [dict(c) for c in cases], start_coordinator("unix"), shim_library)
    for i, case in enumerate(cases):
        ranks = [case["root"]] if case["coll"] == "reduce" else range(world)
        for r in ranks:
            assert _same_bits(fake[f"c{i}"][r], gloo[f"c{i}"][r]), (case, r)


@pytest.mark.torch
@needs_torch
@pytest.mark.parametrize("local", ["1", "0"], ids=["arenas", "coordinator"])
def test_rank_order_on_request(local, shim_library, start_coordinator):
    world = 4
    cases = [dict(coll="all_reduce", op="sum", dtype="float32", count=n, seed=n) for n in (3, 1001, 300001)]
    cases += [dict(coll="all_reduce", op="sum", dtype="bfloat16", count=1001, seed=9),
              dict(coll="all_reduce", op="avg", dtype="float32", count=1001, seed=10),
              dict(coll="reduce_scatter_tensor", op="sum", dtype="float32", count=world * 1001, seed=11)]
    got = _run_fakegpu(world, cases, start_coordinator("unix"), shim_library, FAKEGPU_REDUCTION_ORDER="rank",
                       FAKEGPU_LOCAL_COLLECTIVES=local)
    _check(cases, got, world, _rank_order)
    # the orders do differ on this data
    from helpers.gloo_probe import case_inputs
    xs = [case_inputs(cases[1], r) for r in range(world)]
    assert not _same_bits(G.all_reduce(xs)[0], _rank_order(cases[1], xs, world)[0])


# --- the coordinator's matching of the order bits (a Core fed frames, no processes) ---------------

class _Core:
    """A coordinator Core fed GROUP frames; replies decoded per connection."""

    def __init__(self, n):
        from fakegpu import protocol as P
        from fakegpu.coordinator import core as C

        self.P, self.C = P, C
        self.core = C.Core(clock=lambda: 0.0, wall=lambda: 1.7e9, timeout_ms=5000)
        self.inbox = {}
        self.rid = 100
        for c in range(n):
            self.send(c, P.Hello(flags=1, global_rank=c, pid=1000 + c, staging_bytes=1 << 16, hostname="h"))
        rids = [self.send(c, P.CommInit(b"u" * 128, n, c, "world")) for c in range(n)]
        self.handles = [self.reply(c, r).comm_handle for c, r in zip(range(n), rids)]

    def send(self, conn, msg):
        self.rid += 1
        for f in self.P.FrameParser(1 << 40).feed(self.P.encode_frame(msg, self.rid)):
            for kind, c, data in self.core.on_frame(conn, f, "unix", lambda hello, S: (np.zeros(2 * S, np.uint8), True)):
                if kind == self.C.SEND:
                    raw = data if isinstance(data, bytes) else b"".join(bytes(memoryview(p)) for p in data)
                    for g in self.P.FrameParser(1 << 40).feed(raw):
                        self.inbox.setdefault(c, []).append((g.request_id, self.P.decode_body(g.msg_type, g.body)))
        return self.rid

    def reply(self, conn, rid):
        return next(m for r, m in self.inbox.get(conn, []) if r == rid)

    def allreduce(self, order_of_rank, count=4, seq=1):
        P = self.P
        rids = []
        for r, order in enumerate(order_of_rank):
            d = P.OpDesc(comm_handle=self.handles[r], kind=P.KIND_ALLREDUCE, datatype=7, redop=0,
                         flags=6 | (order << P.OP_ORDER_SHIFT), root=-1, total_count=count, step_count=count,
                         in_offset=0, in_len=4 * count, out_offset=0, out_len=4 * count, scalar=b"",
                         match_seq=seq, step_index=0, step_total=1)
            rids.append(self.send(r, P.Group(ops=(d,))))
        return [self.reply(r, rid) for r, rid in enumerate(rids)]


def test_members_that_disagree_on_the_order_fail_with_a_message_naming_it(shim_library, monkeypatch):
    monkeypatch.setenv("FAKEGPU_NCCL_LIBRARY", shim_library)
    h = _Core(3)
    P = h.P
    done = h.allreduce([1, 1, 1], seq=1)  # agreeing members: fine
    assert all(d.results == (0,) for d in done)
    done = h.allreduce([1, 0, 1], seq=2)
    for d in done:
        assert d.results == (P.NCCL_INVALID_USAGE,)
        assert "reduction order (FAKEGPU_REDUCTION_ORDER)" in d.message
        assert "[gloo all-reduce order]" in d.message
    done = h.allreduce([3, 3, 3], seq=3)  # no such order
    assert all(d.results[0] != 0 for d in done)
    assert any("unknown reduction order 3" in d.message for d in done)
