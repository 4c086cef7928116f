"""Context parallelism's ring attention for ``scaled_dot_product_attention`` on fake devices.

torch's context parallelism (``torch.distributed.tensor.experimental.context_parallel``, and
TorchTitan's SDPA models under ``--parallelism.context_parallel_degree``) hands
``scaled_dot_product_attention`` query, key and value as DTensors sharded along the sequence
and installs DTensor handlers for the fused GPU kernels (``aten::_scaled_dot_product_flash_attention``,
``_efficient_attention``, ``_cudnn_attention`` and their backwards) that run them as ring
attention over the cp group.  On a GPU, SDPA picks one of those kernels.  On fake devices
(CPU tensors) it would pick torch's CPU flash kernel, which has no such handler, and DTensor
refuses it.  :func:`ring_sdpa` makes the choice a GPU makes instead, so the program runs the
ring as it would on the cluster: the same collectives on the cp group, the same kernel calls
per key block (fakegpu.fake_cuda.kernels computes them on the CPU; under fake tensors their
meta functions give the shapes).
"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch

aten = torch.ops.aten
_HALF = (torch.float16, torch.bfloat16)
_FLASH_MAX_HEAD_DIM = 256
# torch.nn.attention.SDPBackend's values, as torch._C._get_sdp_priority_order() lists them
_MATH, _FLASH, _EFFICIENT, _CUDNN = 0, 1, 2, 3


def _dtensor_class():
    try:
        from torch.distributed.tensor import DTensor
    except (ImportError, RuntimeError):   # a torch without distributed
        return None
    return DTensor


def ring_attention_active() -> bool:
    """Whether torch's context-parallel handlers for the fused attention kernels are installed
    (``context_parallel()`` entered, or ``_enable_context_parallel_dispatcher()`` called)."""
    dtensor = _dtensor_class()
    if dtensor is None:
        return False
    handlers = getattr(dtensor._op_dispatcher, "_custom_op_handlers", {})
    return aten._scaled_dot_product_flash_attention.default in handlers


def _arguments(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
               enable_gqa=False):
    return query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa


def ring_sdpa(args: tuple, kwargs: dict) -> Optional[torch.Tensor]:
    """``scaled_dot_product_attention(*args, **kwargs)`` through the fused kernel a GPU would
    pick, when its inputs are DTensors and the ring-attention handlers are installed; None
    otherwise (the caller runs SDPA as usual).

    The pick is SDPA's on a GPU: the first enabled backend in torch's priority order
    (``sdpa_kernel(..., set_priority=True)`` sets it) whose constraints the inputs meet:
    flash for half precision without a mask (head dim up to 256, grouped keys allowed),
    memory-efficient attention for any floating dtype (a mask as its bias, which torch's
    ring refuses, as it does on a GPU), cuDNN for half precision.  Where math comes first
    SDPA runs as usual and torch reports that the ring cannot take it."""
    dtensor = _dtensor_class()
    if dtensor is None or not args or not isinstance(args[0], dtensor) or not ring_attention_active():
        return None
    query, key, value, attn_mask, dropout_p, is_causal, scale, _ = _arguments(*args, **kwargs)
    needs_lse = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
    half = query.dtype in _HALF
    same_heads = query.shape[-3] == key.shape[-3]
    enabled = {_FLASH: torch.backends.cuda.flash_sdp_enabled(),
               _EFFICIENT: torch.backends.cuda.mem_efficient_sdp_enabled(),
               _CUDNN: torch.backends.cuda.cudnn_sdp_enabled(),
               _MATH: torch.backends.cuda.math_sdp_enabled()}
    for backend in torch._C._get_sdp_priority_order():
        if not enabled.get(backend, False):
            continue
        if backend == _FLASH and half and attn_mask is None and query.shape[-1] <= _FLASH_MAX_HEAD_DIM:
            return aten._scaled_dot_product_flash_attention(query, key, value, dropout_p, is_causal,
                                                            False, scale=scale)[0]
        if backend == _EFFICIENT and same_heads:
            return aten._scaled_dot_product_efficient_attention(query, key, value, attn_mask, needs_lse,
                                                                dropout_p, is_causal, scale=scale)[0]
        if backend == _CUDNN and half and same_heads:
            return aten._scaled_dot_product_cudnn_attention(query, key, value, attn_mask, needs_lse,
                                                            dropout_p, is_causal, False, scale=scale)[0]
        if backend == _MATH:
            return None
    return None


@contextlib.contextmanager
def ring_sdpa_patched():
    """``torch.nn.functional.scaled_dot_product_attention`` routed through :func:`ring_sdpa`
    for the duration (the planner's capture, which runs without the fake-CUDA runtime; the
    runtime routes it for good, fakegpu.fake_cuda.runtime.patch_sdpa)."""
    functional = torch.nn.functional
    original = functional.scaled_dot_product_attention

    def scaled_dot_product_attention(*args, **kwargs):
        routed = ring_sdpa(args, kwargs)
        return original(*args, **kwargs) if routed is None else routed

    functional.scaled_dot_product_attention = scaled_dot_product_attention
    try:
        yield
    finally:
        functional.scaled_dot_product_attention = original
