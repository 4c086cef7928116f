"""fakegpu/plan: the compute model per op, against hand-computed figures, the data sheets'
arithmetic and torch's own FLOP counter.  No processes; meta and fake tensors only."""
from __future__ import annotations

import dataclasses
import math

import pytest

torch = pytest.importorskip("torch")

from fakegpu.plan import compute  # noqa: E402
from fakegpu.plan.capture import OpRecorder, estimate_compute  # noqa: E402
from fakegpu.plan.compute import LAUNCH_S  # noqa: E402
from fakegpu.plan.gpu_compute import compute_of  # noqa: E402
from fakegpu.topology.profiles import PROFILES, GpuProfile  # noqa: E402

aten = torch.ops.aten
H100 = compute_of("h100")
_FP32_LANES_PER_SM = {"a100": 64, "a100-80gb": 64}      # GA100; every other catalogue GPU has 128


# -- the GPU figures ------------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(PROFILES))
def test_every_catalogue_profile_has_compute_figures_with_a_source(name):
    p = PROFILES[name]
    for f in ("fp64_tflops", "fp32_tflops", "tf32_tflops", "bf16_tflops", "hbm_gbs", "sm_count",
              "boost_clock_ghz", "tdp_w"):
        assert getattr(p, f) is not None and getattr(p, f) > 0, f
    assert p.bf16_tflops > p.tf32_tflops >= p.fp32_tflops > 0
    assert p.compute_source.startswith("NVIDIA")
    if p.fp8_tflops is None:                                   # an explicit None says why
        assert "no FP8" in p.compute_source
    else:
        assert p.fp8_tflops == pytest.approx(2 * p.bf16_tflops, rel=0.02)   # L40S sheet: 733 vs 362.05
    # the FP32 figure is SMs x lanes x 2 FLOP (an FMA) x boost clock: checks SMs and clock too
    lanes = _FP32_LANES_PER_SM.get(name, 128)
    assert p.sm_count * lanes * 2 * p.boost_clock_ghz / 1e3 == pytest.approx(p.fp32_tflops, rel=0.015)
    assert compute_of(name).peak("fp16") == compute_of(name).peak("bf16") == p.bf16_tflops * 1e12


def test_profile_dicts_carry_the_compute_figures_and_round_trip():
    for p in PROFILES.values():
        d = p.to_dict()
        assert set(d) == {f.name for f in dataclasses.fields(GpuProfile)}
        assert GpuProfile(**d) == p


def test_sm_counts_agree_with_what_the_fake_cuda_devices_report():
    from fakegpu.fake_cuda.devices import _CUDA_FACTS        # read only: SMs the fake devices print
    for name, facts in _CUDA_FACTS.items():
        assert PROFILES[name].sm_count == facts[2], name


def test_published_headline_figures():
    h100, h200, a100, b200 = (PROFILES[n] for n in ("h100", "h200", "a100", "b200"))
    assert (h100.bf16_tflops, h100.fp8_tflops, h100.fp32_tflops, h100.hbm_gbs) == (989, 1979, 67, 3350)
    assert h200.bf16_tflops == h100.bf16_tflops and h200.hbm_gbs == 4800
    assert (a100.bf16_tflops, a100.tf32_tflops, a100.hbm_gbs, a100.fp8_tflops) == (312, 156, 1555, None)
    assert PROFILES["a100-80gb"].hbm_gbs == 2039
    assert (b200.bf16_tflops, b200.hbm_gbs, b200.sm_count) == (2250, 8000, 148)
    assert compute_of("H100-SXM") is compute_of("h100")        # the YAML's spellings


# -- matmuls ----------------------------------------------------------------------------------------

def _mm(m, k, n, dtype=torch.bfloat16, gpu=H100, allow_tf32=None):
    a, b = torch.empty(m, k, dtype=dtype, device="meta"), torch.empty(k, n, dtype=dtype, device="meta")
    return compute.op_cost(aten.mm.default, (a, b), {}, torch.mm(a, b), gpu, allow_tf32)


def test_a_large_bf16_gemm_on_h100_matches_the_hand_figure():
    cost = _mm(8192, 8192, 8192)
    flops = 2 * 8192 ** 3
    assert cost.flops == flops and cost.kind == "matmul" and cost.bound == "compute"
    assert cost.peak_kind == "bf16"
    # 64 x 64 = 4096 tiles of 128 x 128 over 132 SMs: 32 waves, the last holding 4096 - 31 x 132 = 4
    assert cost.efficiency == pytest.approx(0.75 * 4096 / (32 * 132), rel=1e-12)
    expected = flops / (989e12 * 0.75 * 4096 / (32 * 132)) + 4e-6
    assert cost.seconds == pytest.approx(expected, rel=1e-12)
    assert cost.seconds == pytest.approx(1.5326e-3, rel=1e-4)           # 1.10e12 FLOP in 1.53 ms
    assert cost.memory_seconds == pytest.approx(3 * 8192 ** 2 * 2 / (3350e9 * compute.HBM_EFFICIENCY), rel=1e-12)


def test_one_tile_more_than_a_wave_costs_a_whole_wave():
    # 12 x 11 = 132 tiles fill the 132 SMs once; 7 x 19 = 133 tiles take two waves: nearly twice
    # the time per FLOP, both compute-bound
    full, over = _mm(128 * 12, 8192, 128 * 11), _mm(128 * 7, 8192, 128 * 19)
    assert full.bound == over.bound == "compute"
    assert full.efficiency == pytest.approx(0.75)
    assert over.efficiency == pytest.approx(0.75 * 133 / 264)
    per_flop_full = (full.seconds - LAUNCH_S) / full.flops
    per_flop_over = (over.seconds - LAUNCH_S) / over.flops
    assert per_flop_over / per_flop_full == pytest.approx(264 / 133, rel=1e-12)
    # one row more than 132 x 128 adds 0.06 % of the FLOPs and a second wave of row tiles
    a, b = _mm(132 * 128, 4096, 128), _mm(132 * 128 + 1, 4096, 128)
    assert b.flops / a.flops == pytest.approx(1 + 1 / (132 * 128))
    assert b.efficiency == pytest.approx(0.75 * (132 * 128 + 1) / (133 * 128) * 133 / 264)
    # a partial tile computes a whole one: 100 rows in a 128-row tile
    assert compute.matmul_efficiency(100, 128, 1, 1) == pytest.approx(0.75 * 100 / 128)


def test_fp32_matmuls_use_tf32_only_when_allowed():
    tf32, fp32 = _mm(4096, 4096, 4096, torch.float32, allow_tf32=True), _mm(4096, 4096, 4096, torch.float32,
                                                                              allow_tf32=False)
    assert (tf32.peak_kind, fp32.peak_kind) == ("tf32", "fp32")
    ratio = (fp32.seconds - LAUNCH_S) / (tf32.seconds - LAUNCH_S)
    assert ratio == pytest.approx(494.5 / 67, rel=1e-12)
    # by default the flag torch.backends.cuda.matmul.allow_tf32 had when the op ran
    before = torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = False
        assert _mm(64, 64, 64, torch.float32).peak_kind == "fp32"
        torch.backends.cuda.matmul.allow_tf32 = True
        assert _mm(64, 64, 64, torch.float32).peak_kind == "tf32"
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before


def test_fp8_on_a_gpu_without_fp8_tensor_cores_is_costed_at_bf16_and_says_so():
    record = dataclasses.replace(compute.describe_op(aten.mm.default, *_mm_args(8192)), math="fp8")
    h100, a100 = compute.model_op(record, "h100"), compute.model_op(record, "a100")
    assert h100.peak_kind == "fp8" and not h100.note
    assert a100.peak_kind == "bf16" and "no fp8" in a100.note
    assert (h100.compute_seconds * 1979e12 * h100.efficiency) == pytest.approx(record.flops)


def _mm_args(n):
    a = torch.empty(n, n, dtype=torch.bfloat16, device="meta")
    return (a, a), {}, torch.mm(a, a)


# -- memory-bound ops, views ------------------------------------------------------------------------

def test_an_elementwise_op_is_bound_by_hbm_bandwidth():
    n = 1 << 26                                               # 128 MiB of bf16
    x, y = (torch.empty(n, dtype=torch.bfloat16, device="meta") for _ in range(2))
    cost = compute.op_cost(aten.add.Tensor, (x, y), {}, x + y, H100)
    assert cost.flops == 0 and cost.kind == "memory" and cost.bound == "memory"
    assert cost.bytes == 3 * n * 2                            # reads x and y, writes the sum
    assert cost.seconds == pytest.approx(3 * n * 2 / (3350e9 * compute.HBM_EFFICIENCY) + 4e-6, rel=1e-12)
    assert compute.op_cost(aten.add.Tensor, (x, x), {}, x + x, H100).bytes == 2 * n * 2   # x read once
    assert compute.op_cost(aten.add_.Tensor, (x, y), {}, x, H100).bytes == 3 * n * 2      # read, write x
    assert compute.op_cost(aten.add.Tensor, (x, y), {}, x + y, "h200").seconds == \
        pytest.approx(3 * n * 2 / (4800e9 * compute.HBM_EFFICIENCY) + 4e-6, rel=1e-12)


def test_views_allocations_and_metadata_cost_nothing():
    x = torch.empty(8, 8, device="meta")
    for func, args, out in ((aten.view.default, (x, [64]), x.view(64)), (aten.t.default, (x,), x.t()),
                            (aten.empty.memory_format, ([8, 8],), x),
                            (aten._unsafe_view.default, (x, [64]), x.view(64))):
        cost = compute.op_cost(func, args, {}, out, H100)
        assert cost.seconds == 0 and cost.bound == "none" and cost.kind in ("view", "no_kernel")


# -- attention --------------------------------------------------------------------------------------

def test_attention_forward_flops_are_torchs_formula_and_time_is_block_and_wave_quantized():
    b, h, s, d = 2, 16, 4096, 128
    q = torch.empty(b, h, s, d, dtype=torch.bfloat16, device="meta")
    for causal in (False, True):
        func = aten._scaled_dot_product_flash_attention.default
        out = func(q, q, q, is_causal=causal)
        cost = compute.op_cost(func, (q, q, q), {"is_causal": causal}, out, H100)
        assert cost.flops == 4 * b * h * s * s * d            # QK^T and PV, 2 FLOPs per multiply-add
        assert cost.kind == "attention" and cost.bound == "compute" and cost.peak_kind == "bf16"
        # 2 x 16 x (4096 / 128) = 1024 query blocks over 132 SMs: 8 waves
        efficiency = 0.37 * 1024 / (8 * 132)
        work = (33 / 64) if causal else 1.0                    # causal: 32 x 33 / 2 of 32 x 32 blocks
        assert cost.efficiency == pytest.approx(efficiency, rel=1e-12)
        assert cost.seconds == pytest.approx(cost.flops * work / (989e12 * efficiency) + 4e-6, rel=1e-12)


def test_sdpa_on_fake_cpu_tensors_is_modeled_as_the_gpus_flash_attention():
    import torch.nn.functional as F
    from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

    shape = (2, 8, 1024, 64)

    def attend():
        q = torch.randn(*shape, dtype=torch.bfloat16, requires_grad=True)
        F.scaled_dot_product_attention(q, q, q, is_causal=True).sum().backward()

    est = estimate_compute(attend, profile="h100")
    attention = [r for r in est.records if r.kind == "attention"]
    assert [r.attention for r in attention] == [(16, 1024, 1024, True, False), (16, 1024, 1024, True, True)]
    assert attention[0].flops == sdpa_flop_count(shape, shape, shape) == 4 * 16 * 1024 ** 2 * 64
    assert attention[1].flops == sdpa_backward_flop_count(shape, shape, shape, shape) \
        == 10 * 16 * 1024 ** 2 * 64
    backward = est.costs[est.records.index(attention[1])]
    # backward blocks run over keys: 16 x 8 = 128 blocks, one wave of 132; causal: 9 / 16 of the blocks
    assert backward.efficiency == pytest.approx(0.30 * 128 / 132)
    assert backward.seconds == pytest.approx(attention[1].flops * 9 / 16 / (989e12 * backward.efficiency)
                                             + 4e-6, rel=1e-12)


# -- a captured region ------------------------------------------------------------------------------

def _step(model, x):
    model(x).sum().backward()


def test_a_training_step_counts_the_flops_torchs_counter_counts():
    from torch.utils.flop_counter import FlopCounterMode

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 32),
                                torch.nn.ReLU(), torch.nn.Linear(32, 16))
    x = torch.randn(48, 64)
    with FlopCounterMode(display=False) as counter:              # real tensors, torch's own count
        _step(model, x)
    model.zero_grad()
    est = estimate_compute(_step, model, x, profile="h100")
    # 2 x (64 x 256 + 256 x 32 + 32 x 16) x 48 forward, twice that backward less the first input grad
    assert est.flops == counter.get_total_flops() == 2 * 48 * (3 * (64 * 256 + 256 * 32 + 32 * 16) - 64 * 256)
    matmuls = [r for r in est.records if r.kind == "matmul"]
    assert len(matmuls) == 3 + 3 + 2                             # forward, weight grads, input grads
    assert {r.matmul for r in matmuls if r.name == "addmm"} == {(1, 48, 256, 64), (1, 48, 32, 256),
                                                                 (1, 48, 16, 32)}
    assert est.seconds == pytest.approx(sum(c.seconds for c in est.costs))
    assert all(c.seconds >= LAUNCH_S for c in est.costs if c.bound != "none")
    assert est.kernels == sum(1 for r in est.records if r.kind not in ("view", "no_kernel", "communication"))
    assert all(p.grad is None for p in model.parameters())      # the real model is untouched
    assert all(type(p) is torch.nn.Parameter for p in model.parameters())
    # the same capture on another GPU: same FLOPs and bytes, more time on an A100
    a100 = est.on("a100")
    assert (a100.flops, a100.bytes) == (est.flops, est.bytes) and a100.seconds > est.seconds
    assert sum(row["count"] for row in est.by_op().values()) == len(est.records)


def test_a_full_size_layer_needs_no_memory():
    def layer():
        linear = torch.nn.Linear(8192, 28672, dtype=torch.bfloat16)     # 470 MB of weights if real
        x = torch.randn(16384, 8192, dtype=torch.bfloat16)
        linear(x).sum().backward()

    est = estimate_compute(layer, profile="h100")
    assert est.flops == 2 * (2 * 16384 * 8192 * 28672)               # forward and the weight gradient
    assert est.bytes > 1e9
    assert 2 * 16384 * 8192 * 28672 * 2 / 989e12 < est.seconds < 0.1


def test_a_wrapper_subclass_is_recorded_as_the_ops_on_its_inner_tensors():
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.two_tensor import TwoTensor

    with FakeTensorMode():
        a, b = torch.randn(256, 128), torch.randn(128, 64)
        with OpRecorder() as recorder:
            torch.mm(TwoTensor(a, a), TwoTensor(b, b))
    mms = [r for r in recorder.records if r.name == "mm"]
    assert len(mms) == 2 and all(r.input_shapes == ((256, 128), (128, 64)) for r in mms)
    assert not any(math.isnan(r.flops) for r in recorder.records)


def test_a_full_size_llama3_8b_layer_counts_6NT_plus_attention():
    import torch.nn.functional as F

    dim, ffn, heads, kv_heads, head_dim, seq = 4096, 14336, 32, 8, 128, 8192

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            linear = lambda i, o: torch.nn.Linear(i, o, bias=False)       # noqa: E731
            self.wq, self.wk, self.wv = linear(dim, dim), linear(dim, kv_heads * head_dim), \
                linear(dim, kv_heads * head_dim)
            self.wo, self.w1, self.w2, self.w3 = linear(dim, dim), linear(dim, ffn), linear(ffn, dim), \
                linear(dim, ffn)
            self.n1, self.n2 = torch.nn.RMSNorm(dim), torch.nn.RMSNorm(dim)

        def forward(self, x):
            h = self.n1(x)
            q, k, v = (w(h).view(1, seq, -1, head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            x = x + self.wo(a.transpose(1, 2).reshape(1, seq, dim))
            h = self.n2(x)
            return x + self.w2(F.silu(self.w1(h)) * self.w3(h))

    def step():
        torch.set_default_dtype(torch.bfloat16)        # module.to(dtype) cannot swap fake parameters
        try:
            layer = Layer()
        finally:
            torch.set_default_dtype(torch.float32)
        layer(torch.randn(1, seq, dim, dtype=torch.bfloat16, requires_grad=True)).sum().backward()

    est = estimate_compute(step, profile="h100")
    params = 2 * dim * dim + 2 * dim * kv_heads * head_dim + 3 * dim * ffn
    # 6 N T for the linears (forward, input and weight grads); attention 4 b h s^2 d forward and
    # 2.5 times that backward, torch's count (which ignores the causal mask)
    assert est.flops == 6 * params * seq + 14 * heads * seq ** 2 * head_dim
    assert sum(r.kind == "matmul" for r in est.records) == 21
    assert [r.attention for r in est.records if r.kind == "attention"] == \
        [(heads, seq, seq, True, False), (heads, seq, seq, True, True)]
    assert 0.4 < est.flops / est.seconds / 989e12 < 0.75      # below the 0.75 matmul base: attention, memory


# -- mixture-of-experts grouped matmuls ------------------------------------------------------------

def _grouped(a_shape, b_shape, groups):
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        a = torch.empty(a_shape, dtype=torch.bfloat16)
        b = torch.empty(b_shape, dtype=torch.bfloat16)
        offs = torch.empty(groups, dtype=torch.int32)
        out = aten._grouped_mm.default(a, b, offs)
        return compute.describe_op(aten._grouped_mm.default, (a, b, offs), {}, out), tuple(out.shape)


def test_a_grouped_matmul_counts_2K_per_output_element_of_its_group():
    # the experts' forward: 65,536 routed rows, 128 experts of 2048 -> 768
    record, shape = _grouped((65536, 2048), (128, 2048, 768), 128)
    assert shape == (65536, 768) and record.kind == "matmul" and record.math == "bf16"
    assert record.flops == 2 * 65536 * 2048 * 768
    assert record.matmul == (128, 512, 768, 2048)        # each expert gets 65,536 / 128 rows
    # the weight gradient, grouped along K: (2048 x 65,536) x (65,536 x 768) -> 128 x 2048 x 768
    record, shape = _grouped((2048, 65536), (65536, 768), 128)
    assert shape == (128, 2048, 768)
    assert record.flops == 2 * 65536 * 2048 * 768          # each group sums over its 512 rows
    assert record.matmul == (128, 2048, 768, 512)


def test_a_grouped_matmul_is_costed_as_its_groups_matmuls():
    record, _ = _grouped((65536, 2048), (128, 2048, 768), 128)
    cost = compute.model_op(record, H100)
    # 128 groups x 4 x 6 tiles of 128 x 128 = 3,072 tiles over 132 SMs: 24 waves, the last 36
    assert cost.efficiency == pytest.approx(0.75 * 3072 / (24 * 132), rel=1e-12)
    assert cost.compute_seconds == pytest.approx(record.flops / (989e12 * cost.efficiency), rel=1e-12)
    # it reads every expert's weights once: 403 MB of weights, 268 MB in, 101 MB out, about as
    # long on HBM as on the tensor cores (and the 128 int32 offsets)
    nbytes = (65536 * 2048 + 128 * 2048 * 768 + 65536 * 768) * 2 + 128 * 4
    assert record.bytes == nbytes
    assert cost.seconds == pytest.approx(max(cost.compute_seconds, cost.memory_seconds) + LAUNCH_S, rel=1e-12)


def test_float8_leaves_the_experts_grouped_matmuls_in_bf16():
    from fakegpu.plan.options import float8_matmuls

    record, _ = _grouped((65536, 2048), (128, 2048, 768), 128)
    assert float8_matmuls([record]) == [record]
