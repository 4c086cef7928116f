"""fakegpu.plan.options: torch.compile's fusion of memory-bound chains and Float8 matmuls, on
hand-built records."""
from __future__ import annotations

import dataclasses

import pytest

from fakegpu.plan.compute import FP8_EFFICIENCY_SCALE, LAUNCH_S, OpRecord, model_op
from fakegpu.plan.gpu_compute import compute_of
from fakegpu.plan.options import (CAST_BYTES_COMPILED, CAST_BYTES_EAGER, float8_matmuls,
                                  fuse_memory_chains)

MB = 1_000_000


def fused_bytes(boundary: int) -> int:
    """What a fused kernel is charged: the bytes crossing its boundary, at the share of the
    eager bandwidth a compiled kernel reaches (FUSED_BANDWIDTH_SHARE)."""
    from fakegpu.plan.options import FUSED_BANDWIDTH_SHARE

    return int(boundary / FUSED_BANDWIDTH_SHARE)


def mem(name, reads=(), writes=(), phase="forward", step=0):
    """A memory-bound record reading / writing 1 MB buffers named by key."""
    reads = tuple((k, MB) for k in reads)
    writes = tuple((k, MB) for k in writes)
    return OpRecord(f"aten.{name}.default", name, "memory", (), (), (), (), 0,
                    sum(n for _, n in reads) + sum(n for _, n in writes),
                    reads=reads, writes=writes, phase=phase, step=step)


def view(name, reads=(), writes=(), phase="forward"):
    return OpRecord(f"aten.{name}.default", name, "view", (), (), (), (), 0, 0,
                    reads=tuple((k, MB) for k in reads), writes=tuple((k, 0) for k in writes), phase=phase)


def matmul(m, n, k, name="mm", reads=(), writes=(), phase="forward", math="bf16", bias=False):
    shapes = ((m, k), (k, n))
    if bias:
        shapes = ((n,),) + shapes
    nbytes = 2 * (m * k + k * n + m * n) + (2 * n if bias else 0)
    return OpRecord(f"aten.{name}.default", name, "matmul", shapes, ("torch.bfloat16",) * len(shapes),
                    ((m, n),), ("torch.bfloat16",), 2 * m * n * k, nbytes, math, False,
                    matmul=(1, m, n, k), reads=tuple((key, MB) for key in reads),
                    writes=tuple((key, MB) for key in writes), phase=phase)


# fuse_memory_chains --------------------------------------------------------------------------

def test_chain_of_three_fuses_into_one_moving_only_its_boundary():
    records = [mem("add", ["x"], ["a"]), mem("mul", ["a"], ["b"]), mem("silu", ["b"], ["c"]),
               matmul(64, 64, 64, reads=["c", "w"], writes=["y"])]
    assert sum(r.bytes for r in records[:3]) == 6 * MB          # eager: 3 reads + 3 writes
    out = fuse_memory_chains(records)
    assert len(out) == 2
    fused, mm = out
    assert fused.bytes == fused_bytes(2 * MB)                                # x in, c out
    assert fused.kind == "memory" and fused.phase == "forward"
    assert fused.op == "fused(3)" and fused.name == "fused_add"
    assert dict(fused.reads) == {"x": MB}
    assert set(dict(fused.writes)) == {"a", "b", "c"}
    assert mm is records[3]


def test_intermediate_read_later_is_counted():
    # a is a saved activation: the backward reads it after the matmul
    records = [mem("add", ["x"], ["a"]), mem("mul", ["a"], ["b"]), mem("silu", ["b"], ["c"]),
               matmul(64, 64, 64, reads=["c", "w"], writes=["y"]),
               mem("mul_backward", ["a", "gy"], ["ga"], phase="backward")]
    fused = fuse_memory_chains(records)[0]
    assert fused.bytes == fused_bytes(3 * MB)                                # x in, a and c out


def test_chain_output_read_nowhere_later_is_not_counted():
    records = [mem("add", ["x"], ["a"]), mem("mul", ["a"], ["b"])]
    (fused,) = fuse_memory_chains(records)
    assert fused.bytes == fused_bytes(MB)                                    # only x; b dies in registers


def test_matmul_breaks_a_chain():
    records = [mem("add", ["x"], ["a"]), mem("mul", ["a"], ["b"]),
               matmul(64, 64, 64, reads=["b", "w"], writes=["y"]),
               mem("gelu", ["y"], ["z"]), mem("mul", ["z"], ["o"]),
               matmul(64, 64, 64, reads=["o", "w2"], writes=["y2"])]
    out = fuse_memory_chains(records)
    assert [r.op for r in out] == ["fused(2)", "aten.mm.default", "fused(2)", "aten.mm.default"]
    assert out[0].bytes == fused_bytes(2 * MB) and out[2].bytes == fused_bytes(2 * MB)
    assert out[1] is records[2] and out[3] is records[5]


def test_foreach_and_optimizer_ops_are_not_fused():
    foreach = [mem("_foreach_mul_", ["g"], ["g"], phase="backward"),
               mem("_foreach_add_", ["g"], ["g"], phase="backward")]
    assert fuse_memory_chains(foreach) == foreach
    optimizer = [mem("mul", ["m"], ["m2"], phase="optimizer"), mem("add", ["m2", "p"], ["p2"], phase="optimizer")]
    assert fuse_memory_chains(optimizer) == optimizer
    # a _foreach op between two memory ops splits them into single (unfused) records
    mixed = [mem("add", ["x"], ["a"]), mem("_foreach_add_", ["a"], ["a"]), mem("mul", ["a"], ["b"])]
    assert fuse_memory_chains(mixed) == mixed


def test_single_memory_op_is_left_unchanged():
    records = [matmul(64, 64, 64, reads=["x", "w"], writes=["y"]), mem("relu", ["y"], ["z"]),
               matmul(64, 64, 64, reads=["z", "w2"], writes=["o"])]
    out = fuse_memory_chains(records)
    assert out == records
    assert out[1] is records[1]


def test_phases_do_not_fuse_across():
    records = [mem("add", ["x"], ["a"]), mem("mul", ["a", "g"], ["ga"], phase="backward")]
    assert fuse_memory_chains(records) == records


def test_views_inside_a_chain_are_kept_after_the_fused_kernel():
    v = view("view", ["a"], ["a_view"])
    records = [mem("add", ["x"], ["a"]), v, mem("mul", ["a"], ["b"]),
               matmul(64, 64, 64, reads=["b", "w"], writes=["y"])]
    out = fuse_memory_chains(records)
    assert [r.op for r in out] == ["fused(2)", "aten.view.default", "aten.mm.default"]
    assert out[0].bytes == fused_bytes(2 * MB) and out[1] is v


# float8_matmuls ------------------------------------------------------------------------------

@pytest.mark.parametrize("compiled,factor", [(True, CAST_BYTES_COMPILED), (False, CAST_BYTES_EAGER)])
def test_float8_mm_becomes_cast_plus_fp8_matmul(compiled, factor):
    assert (CAST_BYTES_COMPILED, CAST_BYTES_EAGER) == (1.5, 2.5)
    m, n, k = 4096, 1024, 2048
    record = matmul(m, n, k, reads=["x", "w"], writes=["y"])
    out = float8_matmuls([record], compiled=compiled)
    assert len(out) == 2
    cast, mm = out
    operand_bytes = 2 * (m * k + k * n)                         # the two bf16 operands
    assert cast.name == "float8_cast" and cast.kind == "memory"
    assert cast.flops == 0 and cast.math is None and cast.matmul is None
    assert cast.bytes == int(factor * operand_bytes)
    assert cast.writes == ()
    assert mm.name == "mm_fp8" and mm.math == "fp8" and mm.kind == "matmul"
    assert mm.flops == record.flops and mm.matmul == record.matmul


def test_float8_addmm_casts_its_matrix_operands_not_the_bias():
    m, n, k = 512, 256, 128
    record = matmul(m, n, k, name="addmm", bias=True)
    cast, mm = float8_matmuls([record])
    assert cast.bytes == int(1.5 * 2 * (m * k + k * n))
    assert mm.name == "addmm_fp8"


def test_float8_leaves_excluded_dims_and_non_bf16_alone():
    vocab = 128256
    output = matmul(8192, vocab, 4096)
    fp32 = matmul(64, 64, 64, math="fp32")
    memory = mem("add", ["x"], ["y"])
    records = [output, fp32, memory]
    assert float8_matmuls(records, excluded_dims=[vocab]) == records
    # without the exclusion the output projection is converted too
    assert [r.name for r in float8_matmuls([output])] == ["float8_cast", "mm_fp8"]


def test_fp8_matmul_faster_by_peak_ratio_on_h100():
    gpu = compute_of("h100")
    ratio = gpu.peak("fp8") * FP8_EFFICIENCY_SCALE / gpu.peak("bf16")
    record = matmul(8192, 8192, 8192)
    _cast, fp8 = float8_matmuls([record])
    bf16_cost, fp8_cost = model_op(record, "h100"), model_op(fp8, "h100")
    assert bf16_cost.bound == fp8_cost.bound == "compute"
    assert fp8_cost.peak_kind == "fp8" and bf16_cost.peak_kind == "bf16"
    assert bf16_cost.compute_seconds / fp8_cost.compute_seconds == pytest.approx(ratio, rel=1e-12)
    assert (bf16_cost.seconds - LAUNCH_S) / (fp8_cost.seconds - LAUNCH_S) == pytest.approx(ratio, rel=1e-12)
    assert fp8_cost.seconds < bf16_cost.seconds


# async_tensor_parallel -----------------------------------------------------------------------

def _collective(kind, count, reads, writes, group="tp", ranks=(0, 1, 2, 3)):
    from fakegpu.plan.collectives import Collective

    return OpRecord(f"c10d.{kind}", kind, "communication", (), (), (), (), 0, count * 2,
                    reads=tuple((k, MB) for k in reads), writes=tuple((k, MB) for k in writes),
                    collective=Collective(kind, count, 2, ranks, group), phase="forward")


def _timed(records):
    from fakegpu.plan.step import step_times
    from fakegpu.topology.model import default_topology

    return step_times(records, "h100", default_topology(4))


def test_async_tp_overlaps_an_all_gather_with_the_matmul_it_feeds():
    from fakegpu.plan.options import async_tensor_parallel
    from fakegpu.plan.step import CollectiveTimer
    from fakegpu.plan.timeline import OVERLAP_SLOWDOWN
    from fakegpu.topology.model import default_topology

    count = 1 << 22
    records = [_collective("AllGather", count, ["shard"], ["full"]),
               matmul(8192, 8192, 8192, reads=["full", "w"], writes=["y"]),
               mem("gelu", ["y"], ["z"])]
    out = async_tensor_parallel(records, {"tp"})
    head, rest, mm, after = out
    assert (head.collective.count, rest.collective.count) == (count // 4, count - count // 4)
    synthetic = dict(rest.writes)
    assert set(synthetic) <= set(dict(after.reads)) and mm is records[1]
    timer = CollectiveTimer(default_topology(4))
    ag_head = timer.seconds("AllGather", count // 4, 2, (0, 1, 2, 3))
    ag_rest = timer.seconds("AllGather", count - count // 4, 2, (0, 1, 2, 3))
    mm_s = model_op(records[1], "h100").seconds
    gelu_s = model_op(records[2], "h100").seconds
    # the matmul starts after the first chunk, the rest of the gather runs beside it (slowing it)
    overlapped = mm_s + OVERLAP_SLOWDOWN * min(mm_s, ag_rest)
    expected = ag_head + max(overlapped, ag_rest) + gelu_s
    assert _timed(out).step_seconds == pytest.approx(expected, rel=1e-9)
    eager = _timed(records).step_seconds
    assert eager == pytest.approx(timer.seconds("AllGather", count, 2, (0, 1, 2, 3)) + mm_s + gelu_s, rel=1e-9)
    assert _timed(out).step_seconds < eager


def test_async_tp_starts_a_reduce_scatter_after_the_first_chunk_of_its_matmul():
    from fakegpu.plan.options import async_tensor_parallel

    records = [matmul(8192, 8192, 8192, reads=["x", "w"], writes=["partial"]),
               _collective("ReduceScatter", 1 << 22, ["partial"], ["out"]),
               mem("add", ["out"], ["h"])]
    out = async_tensor_parallel(records, {"tp"})
    first, rs, rest, after = out         # the rest of the matmul runs after the reduce-scatter is issued
    assert rs is records[1]
    assert first.flops == records[0].flops // 4 and first.flops + rest.flops == records[0].flops
    assert first.matmul == (1, 2048, 8192, 8192) and rest.matmul == (1, 6144, 8192, 8192)
    assert set(dict(rest.writes)) <= set(dict(after.reads))     # the reader waits for the whole matmul
    assert dict(first.writes) == dict(records[0].writes)       # the reduce-scatter waits for the first chunk
    assert _timed(out).step_seconds < _timed(records).step_seconds


def test_async_tp_leaves_other_groups_and_unpaired_collectives_alone():
    from fakegpu.plan.options import async_tensor_parallel

    records = [_collective("AllGather", 1 << 20, ["shard"], ["full"], group="fsdp"),
               matmul(4096, 4096, 4096, reads=["full", "w"], writes=["y"]),
               _collective("AllReduce", 1 << 20, ["y"], ["y"])]
    assert async_tensor_parallel(records, {"tp"}) == records
    tp_only = [dataclasses_replace_group(r, "tp") if r.collective else r for r in records]
    out = async_tensor_parallel(tp_only, {"tp"})
    assert len(out) == 4            # the all-gather pairs with the matmul; the all-reduce does not


def dataclasses_replace_group(record, group):
    import dataclasses

    return dataclasses.replace(record, collective=dataclasses.replace(record.collective, group=group))


# compiled_activation_savings -------------------------------------------------------------------

def test_compile_savings_count_pointwise_intermediates_read_only_by_memory_bound_backward_ops():
    import dataclasses

    from fakegpu.plan.options import compiled_activation_savings

    records = [mem("mul", reads=["x"], writes=["h"]),                  # fused forward intermediate
               matmul(8, 8, 8, reads=["h", "w"], writes=["y"]),
               mem("silu", reads=["y"], writes=["s"]),
               mem("mul", reads=["s"], writes=["o"], phase="backward"),  # s: read by pointwise only
               mem("mul", reads=["h"], writes=["g"], phase="backward")]
    # h and s: written by pointwise forward ops, read in the backward by pointwise ops only
    assert compiled_activation_savings(records) == 2 * MB
    # a checkpoint's recomputation reading h (its saved input) keeps it
    recomputing = dataclasses.replace(mem("mul", reads=["h"], writes=["r"], phase="backward"), recomputed=True)
    assert compiled_activation_savings(records + [recomputing]) == MB


def test_the_recorder_marks_what_activation_checkpointing_recomputes():
    import torch
    from torch.utils.checkpoint import checkpoint

    from fakegpu.plan.capture import OpRecorder

    w = torch.randn(16, 16, requires_grad=True)
    x = torch.randn(4, 16, requires_grad=True)
    with OpRecorder() as recorder:
        with recorder.marking_recomputation():
            with recorder.phase("forward"):
                out = checkpoint(lambda t: torch.relu(t @ w).sin(), x, use_reentrant=False)
            with recorder.phase("backward"):
                out.sum().backward()
    assert [r.name for r in recorder.records if r.phase == "forward"] == ["mm", "relu", "sin"]
    assert not any(r.recomputed for r in recorder.records if r.phase == "forward")
    # the backward reran the forward's ops up to the last tensor it saves (torch stops early)
    assert [r.name for r in recorder.records if r.recomputed and r.kind != "view"] == ["mm", "relu"]
    assert any(r.phase == "backward" and not r.recomputed for r in recorder.records)
    import torch.utils.checkpoint as torch_checkpoint
    assert torch_checkpoint._recomputation_hook.__name__ == "_recomputation_hook"   # restored


# float8_tensor_parallel_gathers ---------------------------------------------------------------

def test_a_tp_gather_feeding_float8_linears_moves_float8_and_casts_its_shard_once():
    from fakegpu.plan.options import float8_tensor_parallel_gathers

    count = 1 << 20                        # the shard: 1 Mi bf16 elements, gathered on 4 ranks
    full = 4 * count * 2                   # the gathered buffer's bf16 bytes
    records = [_collective("AllGather", count, ["shard"], ["full"]),
               mem("cat", ["full"], ["ordered"]),
               matmul(4096, 1024, 1024, reads=["ordered", "wq"], writes=["q"]),
               matmul(4096, 1024, 1024, reads=["ordered", "wk"], writes=["k"])]
    # the linears read the gathered buffer at its bf16 size
    for i, weight in ((2, "wq"), (3, "wk")):
        records[i] = dataclasses.replace(records[i], reads=(("ordered", full), (weight, 1024 * 1024 * 2)))
    out = float8_tensor_parallel_gathers(records, {"tp"})
    cast, gather, cat = out[:3]
    assert cast.name == "float8_cast" and cast.collective is None
    assert cast.bytes == int(count * 2 * CAST_BYTES_COMPILED)          # on the shard, once
    assert gather.collective.elem_size == 1 and gather.collective.count == count
    assert cat.bytes == records[1].bytes // 2                          # the reorder moves float8
    fp8 = float8_matmuls(out)
    casts = [r for r in fp8 if r.name == "float8_cast"]
    # each linear casts only its weight (1024 x 1024 bf16): the gathered input arrived in float8
    assert [c.bytes for c in casts] == [int(count * 2 * CAST_BYTES_COMPILED)] + \
        [int(1024 * 1024 * 2 * CAST_BYTES_COMPILED)] * 2
    # without the option each linear casts the whole gathered input too
    plain = [r.bytes for r in float8_matmuls(records) if r.name == "float8_cast"]
    assert plain == [int((4096 * 1024 + 1024 * 1024) * 2 * CAST_BYTES_COMPILED)] * 2


def test_float8_gathers_leave_other_groups_and_bf16_consumers_alone():
    from fakegpu.plan.options import float8_tensor_parallel_gathers

    fsdp = [_collective("AllGather", 1 << 20, ["shard"], ["full"], group="fsdp"),
            matmul(4096, 1024, 1024, reads=["full", "w"], writes=["y"])]
    assert float8_tensor_parallel_gathers(fsdp, {"tp"}) == fsdp
    # the vocabulary projection stays bf16, so its gathered input does too
    vocab = [_collective("AllGather", 1 << 20, ["shard"], ["full"]),
             matmul(4096, 128256, 1024, reads=["full", "w"], writes=["logits"])]
    assert float8_tensor_parallel_gathers(vocab, {"tp"}, excluded_dims=(128256,)) == vocab


def test_two_groups_gathering_at_once_through_one_gpus_port_share_it():
    from fakegpu.plan.step import CollectiveTimer
    from fakegpu.topology.model import default_topology

    count = 1 << 24
    both = [_collective("AllGather", count, ["a"], ["fa"], ranks=(0, 1, 2, 3), group="fsdp"),
            _collective("AllGather", count, ["b"], ["fb"], ranks=(0, 1), group="cp")]
    st = _timed(both)
    timer = CollectiveTimer(default_topology(4))
    fsdp_s, fsdp_links = timer.timed("AllGather", count, 2, (0, 1, 2, 3))
    cp_s, cp_links = timer.timed("AllGather", count, 2, (0, 1))
    assert dict(fsdp_links).keys() & dict(cp_links).keys()          # rank 0's NVLink port, both ways
    # the second starts with the first's bytes queued on the port: slowed by the shorter of
    # its own time on the port and what is queued there
    slowed = min(max(dict(cp_links).values()), max(dict(fsdp_links).values()))
    assert st.contention == {"cp": pytest.approx(slowed)}
    assert st.step_seconds == pytest.approx(max(fsdp_s, cp_s + slowed))
    # one after the other on one group's stream: no contention, the stream orders them
    alone = _timed([_collective("AllGather", count, ["a"], ["fa"], ranks=(0, 1, 2, 3), group="fsdp"),
                    _collective("AllGather", count, ["b"], ["fb"], ranks=(0, 1, 2, 3), group="fsdp")])
    assert alone.contention == {} and alone.step_seconds == pytest.approx(2 * fsdp_s)
