"""``nn.SyncBatchNorm`` on fake CUDA devices.

A GPU program that calls ``nn.SyncBatchNorm.convert_sync_batchnorm(model)`` (torchvision's
reference trainers with ``--sync-bn``, most detection and segmentation code) cannot be ported
to the CPU as it is: torch refuses CPU inputs in ``SyncBatchNorm.forward``, and the six
kernels its autograd function calls (``batch_norm_stats``, ``batch_norm_gather_stats[_with_counts]``,
``batch_norm_elemt``, ``batch_norm_backward_reduce``, ``batch_norm_backward_elemt``) exist
only for CUDA.  On fake devices this module provides both:

- CPU kernels for the six ops that compute what the CUDA kernels compute (aten's
  Normalization.cu): statistics in the accumulation type (float for half, bfloat16 and float
  inputs, double for double), the biased variance, ``invstd = 1 / sqrt(var + eps)``, the
  per-rank statistics merged rank by rank in the CUDA kernel's order (Chan's parallel
  variance), the running statistics updated with the unbiased variance;
- ``SyncBatchNorm.forward`` for inputs on fake devices: the same decisions as torch's own
  (training vs running statistics, the momentum or cumulative average, when to synchronise)
  without the device-type refusal; synchronised batches go through torch's own autograd
  function, whose ``all_gather_into_tensor`` / ``all_reduce`` reach the fakegpu backend, so the
  report shows the statistics' traffic as a GPU run's would.

The result equals ``BatchNorm`` over the whole global batch within float rounding (the sums
are taken per rank and then merged, not in one pass): tests/e2e/test_fake_cuda_sync_batchnorm.py.
"""
from __future__ import annotations

import functools

import torch

_library = None


def _acc(dtype: torch.dtype) -> torch.dtype:
    """CUDA's accumulation type for a normalisation: double stays double, the rest is float."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _reduced_dims(x: torch.Tensor) -> list:
    return [d for d in range(x.dim()) if d != 1]


def _per_channel(v: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A (C,) vector shaped to broadcast over an (N, C, ...) input."""
    return v.reshape([1, -1] + [1] * (like.dim() - 2))


def batch_norm_stats(input, eps):
    acc = _acc(input.dtype)
    x = input.to(acc)
    dims = _reduced_dims(x)
    mean = x.mean(dims)
    var = (x - _per_channel(mean, x)).square().mean(dims)  # biased, as the CUDA kernel's
    return mean, torch.rsqrt(var + eps)


def _gather(mean, invstd, running_mean, running_var, momentum, eps, counts):
    """The CUDA kernel's merge: rank j's (count, mean, variance) folded into the running
    (n, avg, M2) in rank order, then invstd of the biased variance."""
    acc = mean.dtype
    channels = mean.shape[-1]
    n = torch.zeros((), dtype=acc)
    avg = torch.zeros(channels, dtype=acc)
    m2 = torch.zeros(channels, dtype=acc)
    counts = counts.to(acc).reshape(-1)
    for j in range(mean.shape[0]):
        count = counts[j]
        m = mean[j]
        std = 1.0 / invstd[j]
        v = (std * std - eps) * count
        factor = 1.0 / (n + count)
        m2 = m2 + v + (avg - m) * (avg - m) * n * count * factor
        avg = n * factor * avg + count * factor * m
        n = n + count
    out_invstd = 1.0 / torch.sqrt(m2 / n + eps)
    if running_mean is not None:
        running_mean.copy_((1 - momentum) * running_mean + momentum * avg)
    if running_var is not None:
        running_var.copy_((1 - momentum) * running_var + momentum * (m2 / (n - 1)))
    return avg, out_invstd


def batch_norm_gather_stats_with_counts(input, mean, invstd, running_mean, running_var, momentum,
                                        eps, counts):
    return _gather(mean, invstd, running_mean, running_var, momentum, eps, counts)


def batch_norm_gather_stats(input, mean, invstd, running_mean, running_var, momentum, eps, count):
    counts = torch.full((mean.shape[0],), float(count), dtype=mean.dtype)
    return _gather(mean, invstd, running_mean, running_var, momentum, eps, counts)


def batch_norm_elemt(input, weight, bias, mean, invstd, eps):
    acc = mean.dtype
    x = input.to(acc)
    out = (x - _per_channel(mean, x)) * _per_channel(invstd, x)
    if weight is not None:
        out = out * _per_channel(weight.to(acc), x)
    if bias is not None:
        out = out + _per_channel(bias.to(acc), x)
    return out.to(input.dtype)


def batch_norm_backward_reduce(grad_out, input, mean, invstd, weight, input_g, weight_g, bias_g):
    acc = mean.dtype
    x, dy = input.to(acc), grad_out.to(acc)
    dims = _reduced_dims(x)
    sum_dy = dy.sum(dims)
    sum_dy_xmu = (dy * (x - _per_channel(mean, x))).sum(dims)
    # The CUDA kernel leaves the outputs that were not asked for undefined; a Python kernel
    # returns tensors, and torch's SyncBatchNorm backward drops the ones it did not ask for.
    wdtype = weight.dtype if weight is not None else acc
    return sum_dy, sum_dy_xmu, (sum_dy_xmu * invstd).to(wdtype), sum_dy.to(wdtype)


def batch_norm_backward_elemt(grad_out, input, mean, invstd, weight, sum_dy, sum_dy_xmu, count):
    acc = mean.dtype
    x, dy = input.to(acc), grad_out.to(acc)
    norm = 1.0 / count.to(acc).sum()
    mean_dy = _per_channel(sum_dy * norm, x)
    factor_1 = _per_channel(invstd * invstd * sum_dy_xmu * norm, x)
    factor_2 = invstd if weight is None else weight.to(acc) * invstd
    grad = (dy - mean_dy - (x - _per_channel(mean, x)) * factor_1) * _per_channel(factor_2, x)
    return grad.to(input.dtype)


KERNELS = (("batch_norm_stats", batch_norm_stats),
           ("batch_norm_gather_stats", batch_norm_gather_stats),
           ("batch_norm_gather_stats_with_counts", batch_norm_gather_stats_with_counts),
           ("batch_norm_elemt", batch_norm_elemt),
           ("batch_norm_backward_reduce", batch_norm_backward_reduce),
           ("batch_norm_backward_elemt", batch_norm_backward_elemt))


def register() -> None:
    """The six kernels for the CPU dispatch key, and the forward, once per process."""
    global _library
    if _library is not None:
        return
    library = torch.library.Library("aten", "IMPL")
    for name, kernel in KERNELS:
        library.impl(name, kernel, "CPU")
    _library = library
    _patch_forward()
    _patch_ddp_check()


def _patch_forward() -> None:
    module = torch.nn.SyncBatchNorm
    original = module.forward

    @functools.wraps(original)
    def forward(self, input):
        if input.device.type != "cpu":
            return original(self, input)
        return _forward_on_fake_device(self, input, original)

    module.forward = forward


def _patch_ddp_check() -> None:
    """DDP refuses SyncBatchNorm in a module whose parameters are on the CPU: on fake devices
    they all are.  The check is all that method does (torch 2.4 to 2.13)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    original = getattr(DDP, "_passing_sync_batchnorm_handle", None)
    if original is None:
        return

    @functools.wraps(original)
    def _passing_sync_batchnorm_handle(self, module):
        if self.device_type != "cpu":
            original(self, module)

    DDP._passing_sync_batchnorm_handle = _passing_sync_batchnorm_handle


def _forward_on_fake_device(bn, input, original):
    """torch's SyncBatchNorm.forward, less the refusal of CPU inputs (they are the fake
    devices' tensors): batches that need no synchronisation take torch's own path."""
    import torch.distributed as dist
    from torch.nn.modules._functions import SyncBatchNorm as sync_batch_norm

    if not (bn.training and dist.is_available() and dist.is_initialized()):
        return original(bn, input)  # running statistics: F.batch_norm, no check
    group = bn.process_group or dist.group.WORLD
    world = dist.get_world_size(group)
    if world == 1:
        return original(bn, input)  # one rank: F.batch_norm as well
    bn._check_input_dim(input)
    bn._check_non_zero_input_channels(input)
    factor = 0.0 if bn.momentum is None else bn.momentum
    if bn.track_running_stats:
        bn.num_batches_tracked.add_(1)
        if bn.momentum is None:  # cumulative moving average
            factor = 1.0 / bn.num_batches_tracked.item()
    running_mean = bn.running_mean if bn.track_running_stats else None
    running_var = bn.running_var if bn.track_running_stats else None
    return sync_batch_norm.apply(input, bn.weight, bn.bias, running_mean, running_var, bn.eps,
                                 factor, group, world)
