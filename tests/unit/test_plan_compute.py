"""fakegpu/plan: the compute model per op, against hand-computed figures and torch's own
FLOP counter."""
from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from fakegpu.plan import compute  # noqa: E402
from fakegpu.plan.capture import estimate_compute  # noqa: E402
from fakegpu.plan.gpu_compute import COMPUTE, MISSING, compute_of  # noqa: E402
from fakegpu.topology.profiles import PROFILES  # noqa: E402

H100 = compute_of("h100")
aten = torch.ops.aten


def test_every_catalogue_profile_has_compute_figures_or_says_why_not():
    assert set(COMPUTE) | set(MISSING) == set(PROFILES) and not set(COMPUTE) & set(MISSING)
    for gpu in COMPUTE.values():
        assert gpu.peak("bf16") > gpu.peak("tf32") >= gpu.peak("fp32") > 0 and gpu.hbm_gbs > 0
    with pytest.raises(KeyError, match="rtx-pro-5000-blackwell.*sparse"):
        compute_of("rtx-pro-5000-blackwell")


def _mm_cost(m, k, n, dtype=torch.bfloat16, gpu=H100, allow_tf32=True):
    a, b = torch.empty(m, k, dtype=dtype, device="meta"), torch.empty(k, n, dtype=dtype, device="meta")
    return compute.op_cost(aten.mm.default, (a, b), {}, torch.empty(m, n, dtype=dtype, device="meta"),
                           gpu, allow_tf32)


def test_a_large_bf16_gemm_runs_at_base_efficiency_of_the_dense_peak():
    cost = _mm_cost(8192, 8192, 8192)
    flops = 2 * 8192 ** 3
    assert cost.flops == flops and cost.bound == "compute"
    # 64 x 64 = 4096 full tiles over 132 SMs: 32 waves, the last 4096 - 31 * 132 = 4 tiles
    wave_fill = 4096 / (32 * 132)
    expected = flops / (989e12 * compute.BASE_EFFICIENCY * wave_fill) + compute.LAUNCH_S
    assert cost.seconds == pytest.approx(expected, rel=1e-12)
    assert cost.seconds == pytest.approx(1.5326e-3, rel=1e-4)   # 1.10e12 FLOP in about 1.53 ms


def test_one_tile_more_than_a_wave_costs_a_whole_wave():
    # 12 x 11 = 132 tiles fill the SMs once; 7 x 19 = 133 tiles take two waves, so nearly twice
    # the time per FLOP (both shapes compute-bound: about 700 FLOP per byte moved)
    full, over = _mm_cost(128 * 12, 8192, 128 * 11), _mm_cost(128 * 7, 8192, 128 * 19)
    assert full.bound == over.bound == "compute"
    per_flop_full = (full.seconds - compute.LAUNCH_S) / full.flops
    per_flop_over = (over.seconds - compute.LAUNCH_S) / over.flops
    assert per_flop_over / per_flop_full == pytest.approx(2 * 132 / 133, rel=1e-12)
    # a partial tile computes a whole one: 100 rows in a 128-row tile
    assert compute.matmul_efficiency(100, 128, 1, 1) == pytest.approx(compute.BASE_EFFICIENCY * 100 / 128)


def test_fp32_matmul_uses_tf32_only_when_allowed():
    tf32, fp32 = _mm_cost(4096, 4096, 4096, torch.float32), _mm_cost(4096, 4096, 4096, torch.float32,
                                                                       allow_tf32=False)
    ratio = (fp32.seconds - compute.LAUNCH_S) / (tf32.seconds - compute.LAUNCH_S)
    assert ratio == pytest.approx(494 / 67, rel=1e-12)


def test_an_elementwise_op_is_bound_by_hbm_bandwidth():
    x = torch.empty(1 << 26, dtype=torch.bfloat16, device="meta")     # 128 MiB
    cost = compute.op_cost(aten.add.Tensor, (x, x), {}, torch.empty_like(x), H100)
    # reads x (once: the same tensor twice) and writes the output
    assert cost.flops == 0 and cost.bound == "memory" and cost.bytes == 2 * x.numel() * 2
    assert cost.seconds == pytest.approx(cost.bytes / 3350e9 + compute.LAUNCH_S, rel=1e-12)


def test_attention_forward_flops_are_torchs_formula():
    b, h, s, d = 2, 16, 4096, 128
    q = torch.empty(b, h, s, d, dtype=torch.bfloat16, device="meta")
    out = torch.empty_like(q)
    cost = compute.op_cost(aten._scaled_dot_product_flash_attention.default, (q, q, q), {},
                           (out, torch.empty(b, h, s, device="meta")), H100)
    assert cost.flops == 4 * b * h * s * s * d        # QK^T and PV, 2 FLOPs per multiply-add
    assert cost.bound == "compute"
    assert cost.seconds == pytest.approx(cost.flops / (989e12 * compute.BASE_EFFICIENCY) + compute.LAUNCH_S)


def test_a_views_only_op_costs_nothing():
    x = torch.empty(8, 8, device="meta")
    assert compute.op_cost(aten.view.default, (x, [64]), {}, x.view(64), H100, views=True).seconds == 0


def test_a_training_step_counts_the_flops_torchs_counter_counts():
    from torch.utils.flop_counter import FlopCounterMode

    def step(model, x):
        model(x).sum().backward()

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 32))
    x = torch.randn(48, 64)
    with FlopCounterMode(display=False) as counter:
        step(model, x)
    model.zero_grad()
    costs = estimate_compute(step, model, x, gpu=H100)
    assert sum(c.flops for c in costs) == counter.get_total_flops() > 0
    # forward 2 matmuls, backward 2 weight grads and 1 input grad (the first layer's input needs none)
    assert sum(c.name in compute._MATMULS for c in costs) == 5
    assert all(c.seconds >= compute.LAUNCH_S for c in costs if c.bound != "none")
    assert compute.total_seconds(costs) > 5 * compute.LAUNCH_S
    assert not math.isnan(compute.total_seconds(costs))
