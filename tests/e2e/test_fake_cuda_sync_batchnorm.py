"""nn.SyncBatchNorm on fake CUDA devices (fakegpu/fake_cuda/sync_batchnorm.py).

The kernels against BatchNorm's own statistics, in this process; an unmodified GPU-style DDP
trainer with --sync-bn (verification/fake_cuda/syncbn_gpu.py) under `fgpu -- torchrun` against
BatchNorm over the whole global batch in one process, which is what synchronised batch norm
computes (within float rounding: per-rank sums are merged, not taken in one pass).
"""
from __future__ import annotations

import importlib.util
import json
import sys

import pytest

from helpers.shim import REPO_ROOT

HAS_TORCH = importlib.util.find_spec("torch") is not None
pytestmark = [pytest.mark.torch, pytest.mark.skipif(not HAS_TORCH, reason="torch is not installed")]
PROGRAM = REPO_ROOT / "verification" / "fake_cuda" / "syncbn_gpu.py"


@pytest.fixture()
def kernels():
    from fakegpu.fake_cuda import sync_batchnorm

    return sync_batchnorm


@pytest.mark.parametrize("dtype", ["float32", "float64", "bfloat16"])
def test_stats_merged_across_unequal_ranks_equal_the_whole_batchs(kernels, dtype):
    import torch

    dtype = getattr(torch, dtype)
    g = torch.Generator().manual_seed(3)
    parts = [torch.randn(n, 5, 3, 2, generator=g).mul(3).add(1).to(dtype) for n in (1, 4, 7)]
    eps, momentum = 1e-5, 0.1
    stats = [kernels.batch_norm_stats(p, eps) for p in parts]
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    assert all(m.dtype == acc and s.dtype == acc for m, s in stats)
    mean_all = torch.stack([m for m, _ in stats])
    invstd_all = torch.stack([s for _, s in stats])
    counts = torch.tensor([p.numel() // p.shape[1] for p in parts], dtype=acc)
    running_mean, running_var = torch.zeros(5, dtype=acc), torch.ones(5, dtype=acc)
    mean, invstd = kernels.batch_norm_gather_stats_with_counts(
        parts[0], mean_all, invstd_all, running_mean, running_var, momentum, eps, counts)

    whole = torch.cat(parts).to(torch.float64)
    var, mu = torch.var_mean(whole, dim=[0, 2, 3], unbiased=False)
    tol = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=2e-5, atol=1e-6)
    torch.testing.assert_close(mean.double(), mu, **tol)
    torch.testing.assert_close(invstd.double(), torch.rsqrt(var + eps), **tol)
    n = whole.numel() // 5
    torch.testing.assert_close(running_mean.double(), momentum * mu, **tol)
    torch.testing.assert_close(running_var.double(), (1 - momentum) + momentum * var * n / (n - 1), **tol)


def test_forward_and_backward_kernels_equal_batch_norm_on_one_rank(kernels):
    """With one rank, sync batch norm's four kernels are batch norm's forward and backward."""
    import torch
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(5)
    x = torch.randn(6, 4, 5, generator=g, dtype=torch.float64).requires_grad_()
    w = torch.randn(4, generator=g, dtype=torch.float64).requires_grad_()
    b = torch.randn(4, generator=g, dtype=torch.float64).requires_grad_()
    dy = torch.randn(6, 4, 5, generator=g, dtype=torch.float64)
    eps = 1e-3
    expected = F.batch_norm(x, None, None, w, b, training=True, eps=eps)
    expected.backward(dy)

    xd = x.detach()
    mean, invstd = kernels.batch_norm_stats(xd, eps)
    out = kernels.batch_norm_elemt(xd, w.detach(), b.detach(), mean, invstd, eps)
    torch.testing.assert_close(out, expected.detach(), rtol=1e-12, atol=1e-12)
    sum_dy, sum_dy_xmu, grad_w, grad_b = kernels.batch_norm_backward_reduce(
        dy, xd, mean, invstd, w.detach(), True, True, True)
    grad_x = kernels.batch_norm_backward_elemt(dy, xd, mean, invstd, w.detach(), sum_dy, sum_dy_xmu,
                                               torch.tensor([30], dtype=torch.int32))
    torch.testing.assert_close(grad_x, x.grad, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grad_w, w.grad, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grad_b, b.grad, rtol=1e-10, atol=1e-12)


def test_half_inputs_keep_their_dtype_and_stats_are_float(kernels):
    import torch

    x = torch.randn(8, 3, 4).to(torch.float16)
    mean, invstd = kernels.batch_norm_stats(x, 1e-5)
    assert mean.dtype == invstd.dtype == torch.float32
    out = kernels.batch_norm_elemt(x, None, None, mean, invstd, 1e-5)
    assert out.dtype == torch.float16 and out.shape == x.shape
    # the normalised output has mean 0 and variance 1 per channel, to half precision
    torch.testing.assert_close(out.float().mean(dim=[0, 2]), torch.zeros(3), atol=2e-3, rtol=0)


def _reference(world: int, steps: int) -> dict:
    """The trainer's model with plain BatchNorm, in one process, on each step's global batch."""
    import torch

    sys.path.insert(0, str(PROGRAM.parent))
    try:
        import syncbn_gpu
    finally:
        sys.path.pop(0)
    torch.manual_seed(0)
    model = syncbn_gpu.make_model().double()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for step in range(steps):
        x, y = syncbn_gpu.global_batch(step, world)
        # the global loss is the mean of the ranks' local mean losses (DDP averages gradients)
        loss = torch.nn.functional.mse_loss(model(x.double()), y.double())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    model.eval()
    with torch.no_grad():
        evaluated = model(syncbn_gpu.global_batch(steps, world)[0].double())
    return {"losses": losses, "state": model.state_dict(), "eval": evaluated}


@pytest.mark.parametrize("world,channels_last", [(2, False), (3, True)], ids=["2-ranks", "3-ranks-channels-last"])
def test_unmodified_sync_bn_trainer_equals_batch_norm_over_the_global_batch(tmp_path, shim_library,
                                                                            world, channels_last):
    import torch

    from helpers.torchrun import fgpu_env, run_fgpu_torchrun

    out = tmp_path / "out"
    out.mkdir()
    steps = 4
    report = tmp_path / "report.json"
    run_fgpu_torchrun(tmp_path, fgpu_env(shim_library, FAKEGPU_COORDINATOR_TIMEOUT_MS="60000"),
                      ["-q", "--device-count", str(world), "--report", str(report)],
                      ["--standalone", "--nproc-per-node", str(world), str(PROGRAM), str(out), str(steps),
                       "1" if channels_last else "0"])
    ranks = [torch.load(out / f"rank{r}.pt") for r in range(world)]
    expected = _reference(world, steps)

    for rank, got in enumerate(ranks):
        assert got["world"] == world
        # every rank holds the same model: DDP averaged the gradients, the statistics were global
        for name, value in got["state"].items():
            want = expected["state"][name]
            if value.is_floating_point():
                torch.testing.assert_close(value.double(), want, rtol=2e-4, atol=2e-5, msg=f"rank {rank} {name}")
            else:
                assert torch.equal(value, want), (rank, name)
        torch.testing.assert_close(got["eval"].double(), expected["eval"], rtol=2e-4, atol=2e-5)
        assert torch.equal(got["state"]["1.running_mean"], ranks[0]["state"]["1.running_mean"])
    # the ranks' mean local loss is the global batch's loss
    mean_local = [sum(r["losses"][s] for r in ranks) / world for s in range(steps)]
    assert mean_local == pytest.approx(expected["losses"], rel=2e-4)
    # the statistics travelled as a GPU run's do: per step and SyncBatchNorm layer (3), one
    # all_gather of (mean, invstd, count) and one all_reduce of the backward's two sums
    collectives = json.loads(report.read_text())["collectives"]
    layers = 3
    assert collectives["AllGather"]["datatypes"]["float32"] == steps * layers
    # ... beside DDP's gradient bucket(s), also float32 all_reduces
    assert collectives["AllReduce"]["datatypes"]["float32"] >= steps * (layers + 1)
