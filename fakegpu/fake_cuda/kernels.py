"""CPU kernels for attention ops torch implements only for CUDA, for programs that call them
directly (``torch.ops.aten._scaled_dot_product_efficient_attention`` / ``_flash_attention`` /
``_cudnn_attention`` and its ``_cudnn_attention_forward`` / ``_backward``, the xformers-style ``_efficient_attention_forward`` / ``_backward``,
the flash kernels ``_flash_attention_forward`` / ``_backward`` in their dense and
variable-length forms, which ``torch.nn.attention.varlen.varlen_attn`` calls, and their
backwards).  They compute torch's math attention, the exact reference the fused
kernels approximate, and its log-sum-exp.  The SDPA-level backwards (flash, efficient,
cuDNN) compute the gradients from the output and log-sum-exp they are given, as the fused
kernels do (ring attention hands them a result merged over key blocks); the others
recompute the math attention under autograd.  Dropout is refused: the
CUDA kernels' Philox masks cannot be reproduced, and the math kernel draws its own.
"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch

from .memory import UnsupportedOnFakeCuda

_library = None


def _no_dropout(name: str, dropout_p: float) -> None:
    if dropout_p:
        raise UnsupportedOnFakeCuda(
            f"fakegpu: aten::{name} with dropout_p={dropout_p} cannot run on fake CUDA devices "
            "(the CUDA kernel's dropout mask cannot be reproduced on the CPU); call "
            "torch.nn.functional.scaled_dot_product_attention, which falls back to the math kernel")


def _autograd_back_on():
    """A kernel runs below autograd (its dispatch keys excluded); the backward kernels
    recompute the math attention under autograd, so they turn those keys back on."""
    keys = torch._C.DispatchKey
    exclude = torch._C._dispatch_tls_local_exclude_set()
    for name in ("AutogradFunctionality", "AutogradOther", "AutogradCPU", "AutogradNestedTensor",
                 "ADInplaceOrView", "AutogradCUDA"):
        key = getattr(keys, name, None)
        if key is not None and exclude.has(key):
            exclude = exclude.remove(key)
    return torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), exclude)


def efficient_forward(query, key, value, attn_bias, compute_log_sumexp, dropout_p=0.0,
                      is_causal=False, *, scale=None):
    _no_dropout("_scaled_dot_product_efficient_attention", dropout_p)
    if attn_bias is None and (not is_causal or query.shape[-2] == key.shape[-2]):
        out, lse = _attend(query, key, value, is_causal, scale, None, None)   # the math kernel's path
    else:   # a bias, or a causal mask from the top left (the kernel's alignment)
        out, lse = _efficient_attend(query, key, value, attn_bias, "top_left" if is_causal else None, scale)
    empty = torch.zeros((), dtype=torch.int64)
    return out, _padded_lse(lse, compute_log_sumexp), empty, empty.clone()


def efficient_backward(grad_out, query, key, value, attn_bias, out, logsumexp, philox_seed,
                       philox_offset, dropout_p, grad_input_mask, is_causal=False, *, scale=None):
    _no_dropout("_scaled_dot_product_efficient_attention_backward", dropout_p)
    bias = attn_bias if attn_bias is not None and attn_bias.numel() else None
    lse = logsumexp[..., :query.shape[-2]]
    grads = _grads_from_lse(grad_out, query, key, value, out, lse, scale,
                            _additive_mask(query, key, bias, "top_left" if is_causal else None))
    # no bias gradient unless asked for (None, as the CUDA kernel returns it)
    bias_grad = _bias_grad(grads[3], bias) if bias is not None and grad_input_mask[3] else None
    return grads[0], grads[1], grads[2], bias_grad


def flash_forward(query, key, value, dropout_p=0.0, is_causal=False, return_debug_mask=False, *,
                  scale=None):
    _no_dropout("_scaled_dot_product_flash_attention", dropout_p)
    out, lse = _attend(query, key, value, is_causal, scale, None, None)
    # As the CUDA kernel returns them: no sequence offsets, the RNG state (Philox seed and
    # offset), an unused scalar, an empty debug mask.
    return (out, lse, None, None, query.shape[2], key.shape[2],
            torch.zeros(2, dtype=torch.uint64), torch.zeros((), dtype=torch.uint64),
            torch.empty(0, dtype=query.dtype))


def flash_backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k,
                   dropout_p, is_causal, philox_seed, philox_offset, *, scale=None):
    _no_dropout("_scaled_dot_product_flash_attention_backward", dropout_p)
    mask = _additive_mask(query, key, None, "bottom_right" if is_causal else None)
    return _grads_from_lse(grad_out, query, key, value, out, logsumexp, scale, mask)[:3]


def _padded_lse(lse, compute_log_sumexp: bool) -> torch.Tensor:
    """The memory-efficient kernel's log-sum-exp rows: padded to a multiple of 32 with +inf
    (as the kernel writes them), none unless asked for."""
    batch, heads, length = lse.shape
    width = -(-length // _LSE_ALIGN) * _LSE_ALIGN if compute_log_sumexp else 0
    padded = torch.full((batch, heads, width), float("inf"), dtype=torch.float32)
    if width:
        padded[..., :length] = lse
    return padded


def _additive_mask(query, key, bias, causal: Optional[str], dtype=torch.float32):
    """The mask in ``dtype`` the scores get (a bias and/or a causal mask aligned ``top_left``
    or ``bottom_right``), None when there is neither."""
    lq, lk = query.shape[-2], key.shape[-2]
    mask = None
    if causal is not None:
        i = torch.arange(lq).unsqueeze(1) + (lk - lq if causal == "bottom_right" else 0)
        keep = torch.arange(lk).unsqueeze(0) <= i
        mask = torch.zeros(lq, lk, dtype=dtype).masked_fill(~keep, float("-inf"))
    if bias is not None:
        mask = bias.to(dtype) if mask is None else bias.to(dtype) + mask
    return mask


def _grads_from_lse(grad_out, query, key, value, out, logsumexp, scale, mask):
    """The gradients of q, k, v (and of the scores, for a bias) as the fused kernels compute
    them: from the forward's output and log-sum-exp as given, on (batch, heads, length, dim)
    tensors whose keys may have fewer heads (GQA).  Given the kernel's own output these are
    the math attention's gradients; given an output and log-sum-exp merged over several key
    blocks (ring attention, which runs the backward block by block against the merged
    result) they are each block's share of the whole attention's gradients, which a
    recomputation of the block alone would not give."""
    groups = query.shape[-3] // key.shape[-3]
    k, v = key.float(), value.float()
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=-3), v.repeat_interleave(groups, dim=-3)
    q, do, o = query.float(), grad_out.float(), out.float()
    factor = scale if scale is not None else query.shape[-1] ** -0.5
    scores = torch.matmul(q, k.transpose(-2, -1)) * factor
    if mask is not None:
        scores = scores + mask
    lse = logsumexp.float().unsqueeze(-1)
    # a row with no key to see has no probability anywhere (its log-sum-exp is +-inf)
    probs = torch.where(torch.isfinite(lse), torch.exp(scores - lse), torch.zeros((), dtype=torch.float32))
    grad_v = torch.matmul(probs.transpose(-2, -1), do)
    grad_probs = torch.matmul(do, v.transpose(-2, -1))
    delta = (do * o).sum(-1, keepdim=True)
    grad_scores = probs * (grad_probs - delta)
    grad_q = torch.matmul(grad_scores, k) * factor
    grad_k = torch.matmul(grad_scores.transpose(-2, -1), q) * factor
    if groups > 1:
        shape = (*key.shape[:-3], key.shape[-3], groups, *key.shape[-2:])
        grad_k = grad_k.reshape(shape).sum(-3)
        grad_v = grad_v.reshape(shape).sum(-3)
    return (grad_q.to(query.dtype), grad_k.to(key.dtype), grad_v.to(value.dtype), grad_scores)


def _bias_grad(grad_scores, bias):
    """A bias's gradient: the scores' gradient summed over the dimensions it broadcast along."""
    grad = grad_scores
    while grad.dim() > bias.dim():
        grad = grad.sum(0)
    for dim, size in enumerate(bias.shape):
        if size == 1 and grad.shape[dim] != 1:
            grad = grad.sum(dim, keepdim=True)
    return grad.to(bias.dtype)


def _unsupported_argument(op: str, what: str) -> None:
    raise UnsupportedOnFakeCuda(
        f"fakegpu: aten::{op} with {what} has no CPU fallback on fake CUDA devices; run the job "
        "on real GPUs (fgpu --mode hybrid) or call it without that argument")


def _attend(query, key, value, is_causal, scale, left, right):
    """Flash attention's semantics on (batch, heads, length, dim) tensors with torch's math
    kernel: the causal mask and the sliding window are aligned to the bottom right (query i
    sees key j when i + Lk - Lq - left <= j <= i + Lk - Lq + right; -1 = unbounded), keys may
    have fewer heads (GQA).  Returns the output and the log-sum-exp per query (float32)."""
    lq, lk = query.shape[-2], key.shape[-2]
    if is_causal:
        right = 0
    mask = None
    if (left is not None and left >= 0) or (right is not None and right >= 0):
        i = torch.arange(lq).unsqueeze(1) + (lk - lq)
        j = torch.arange(lk).unsqueeze(0)
        mask = torch.ones(lq, lk, dtype=torch.bool)
        if right is not None and right >= 0:
            mask &= j <= i + right
        if left is not None and left >= 0:
            mask &= j >= i - left
    gqa = key.shape[-3] != query.shape[-3]
    plain_causal = is_causal and lq == lk and (left is None or left < 0)
    # The math kernel adds a floating mask (a boolean one would be added as 0/1), as
    # scaled_dot_product_attention converts it; plain causal attention takes its own path.
    additive = None if mask is None or plain_causal else \
        torch.zeros(lq, lk, dtype=query.dtype).masked_fill(~mask, float("-inf"))
    out = torch.ops.aten._scaled_dot_product_attention_math(
        query, key, value, additive, 0.0, plain_causal, None, scale=scale, enable_gqa=gqa)[0]
    with torch.no_grad():
        k = key.repeat_interleave(query.shape[-3] // key.shape[-3], dim=-3) if gqa else key
        factor = scale if scale is not None else query.shape[-1] ** -0.5
        scores = torch.matmul(query.float(), k.float().transpose(-2, -1)) * factor
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        lse = torch.logsumexp(scores, dim=-1)
    return out, lse


def _flash(query, key, value, cum_seq_q, cum_seq_k, is_causal, scale, left, right):
    """``_flash_attention_forward``'s output and log-sum-exp: dense (batch, length, heads, dim)
    or variable-length (total, heads, dim) with cumulative sequence offsets."""
    if cum_seq_q is None:
        out, lse = _attend(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                           is_causal, scale, left, right)
        return out.transpose(1, 2), lse
    outs, lses = [], []
    starts_q, starts_k = cum_seq_q.tolist(), cum_seq_k.tolist()
    for n in range(len(starts_q) - 1):
        q = query[starts_q[n]:starts_q[n + 1]].transpose(0, 1).unsqueeze(0)
        k = key[starts_k[n]:starts_k[n + 1]].transpose(0, 1).unsqueeze(0)
        v = value[starts_k[n]:starts_k[n + 1]].transpose(0, 1).unsqueeze(0)
        out, lse = _attend(q, k, v, is_causal, scale, left, right)
        outs.append(out.squeeze(0).transpose(0, 1))
        lses.append(lse.squeeze(0))
    return torch.cat(outs), torch.cat(lses, dim=-1)


def flash_attention_forward(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p,
                            is_causal, return_debug_mask, *, scale=None, window_size_left=None,
                            window_size_right=None, seqused_k=None, alibi_slopes=None,
                            block_table=None, num_splits=None):  # noqa: ARG001
    _no_dropout("_flash_attention_forward", dropout_p)
    for name, value_ in (("seqused_k", seqused_k), ("alibi_slopes", alibi_slopes),
                         ("block_table", block_table)):
        if value_ is not None:
            _unsupported_argument("_flash_attention_forward", name)
    out, lse = _flash(query, key, value, cum_seq_q, cum_seq_k, is_causal, scale,
                      window_size_left, window_size_right)
    return (out, lse, torch.zeros(2, dtype=torch.uint64), torch.empty(0, dtype=query.dtype),
            torch.empty(0, dtype=query.dtype))


def flash_attention_backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k,
                             max_q, max_k, dropout_p, is_causal, rng_state, unused, *, scale=None,
                             window_size_left=None, window_size_right=None):  # noqa: ARG001
    _no_dropout("_flash_attention_backward", dropout_p)
    if cum_seq_q is not None and cum_seq_q.numel() == 0:
        cum_seq_q = cum_seq_k = None   # the dense call passes empty offsets
    with _autograd_back_on(), torch.enable_grad():
        q, k, v = (t.detach().requires_grad_() for t in (query, key, value))
        result, _ = _flash(q, k, v, cum_seq_q, cum_seq_k, is_causal, scale,
                           window_size_left, window_size_right)
        return tuple(torch.autograd.grad(result, (q, k, v), grad_out))


def cudnn_sdpa_forward(query, key, value, attn_bias, compute_log_sumexp, dropout_p=0.0,
                       is_causal=False, return_debug_mask=False, *, scale=None):  # noqa: ARG001
    _no_dropout("_scaled_dot_product_cudnn_attention", dropout_p)
    if attn_bias is not None:
        out, lse = _efficient_attend(query, key, value, attn_bias, "top_left" if is_causal else None, scale)
    else:
        out, lse = _attend(query, key, value, is_causal, scale, None, None)
    # As the CUDA kernel returns them: statistics (batch, heads, length, 1), no sequence
    # offsets, the Philox seed and offset, no debug mask.
    return (out, lse.unsqueeze(-1), None, None, query.shape[2], key.shape[2],
            torch.zeros((), dtype=torch.int64), torch.zeros((), dtype=torch.int64), None)


def cudnn_sdpa_backward(grad_out, query, key, value, out, logsumexp, philox_seed, philox_offset,
                        attn_bias, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, *,
                        scale=None):  # noqa: ARG001
    _no_dropout("_scaled_dot_product_cudnn_attention_backward", dropout_p)
    bias = attn_bias if attn_bias is not None and attn_bias.numel() else None
    causal = ("top_left" if bias is not None else "bottom_right") if is_causal else None
    lse = logsumexp.squeeze(-1) if logsumexp.dim() == query.dim() else logsumexp
    return _grads_from_lse(grad_out, query, key, value, out, lse, scale,
                           _additive_mask(query, key, bias, causal))[:3]


def cudnn_attention_forward(query, key, value, attn_bias, cum_seq_q, cum_seq_k, max_q, max_k,
                            compute_log_sumexp, dropout_p=0.0, is_causal=False,
                            return_debug_mask=False, *, scale=None):  # noqa: ARG001
    """``aten::_cudnn_attention_forward``: the dense (batch, heads, length, dim) form is
    ``_scaled_dot_product_cudnn_attention``'s; with ``cum_seq_q`` / ``cum_seq_k`` the tensors are
    (total, heads, dim), as the flash kernel's variable-length form (and the log-sum-exp
    (heads, total_q))."""
    op = "_cudnn_attention_forward"
    _no_dropout(op, dropout_p)
    if cum_seq_q is None:
        return cudnn_sdpa_forward(query, key, value, attn_bias, compute_log_sumexp, 0.0, is_causal,
                                  return_debug_mask, scale=scale)
    if attn_bias is not None:
        _unsupported_argument(op, "attn_bias with cum_seq_q")
    out, lse = _flash(query, key, value, cum_seq_q, cum_seq_k, is_causal, scale, None, None)
    return (out, lse, cum_seq_q, cum_seq_k, max_q, max_k, torch.zeros((), dtype=torch.int64),
            torch.zeros((), dtype=torch.int64), torch.empty(0, dtype=query.dtype))


def cudnn_attention_backward(grad_out, query, key, value, out, logsumexp, philox_seed, philox_offset,
                             attn_bias, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, *,
                             scale=None):  # noqa: ARG001
    op = "_cudnn_attention_backward"
    _no_dropout(op, dropout_p)
    if cum_seq_q is None or cum_seq_q.numel() == 0:   # the dense call passes empty offsets
        return cudnn_sdpa_backward(grad_out, query, key, value, out, logsumexp, philox_seed,
                                   philox_offset, attn_bias, cum_seq_q, cum_seq_k, max_q, max_k,
                                   0.0, is_causal, scale=scale)
    with _autograd_back_on(), torch.enable_grad():
        q, k, v = (t.detach().requires_grad_() for t in (query, key, value))
        result, _ = _flash(q, k, v, cum_seq_q, cum_seq_k, is_causal, scale, None, None)
        return tuple(torch.autograd.grad(result, (q, k, v), grad_out))


# xformers-style memory-efficient attention (aten::_efficient_attention_forward / _backward):
# (batch, length, heads, dim) tensors, an additive bias, variable lengths through cumulative
# offsets (batch 1), and a causal mask aligned top left (custom_mask_type 1) or bottom right (2).
_EFFICIENT_MASKS = {0: None, 1: "top_left", 2: "bottom_right"}
_LSE_ALIGN = 32  # the kernel's log-sum-exp rows are padded to a multiple of 32 (torch's meta)


def _efficient_attend(query, key, value, bias, mask_kind, scale):
    """Output and float32 log-sum-exp of (batch, heads, length, dim) tensors."""
    additive = _additive_mask(query, key, bias, mask_kind, dtype=query.dtype)
    out = torch.ops.aten._scaled_dot_product_attention_math(
        query, key, value, additive, 0.0, False, None, scale=scale)[0]
    with torch.no_grad():
        factor = scale if scale is not None else query.shape[-1] ** -0.5
        scores = torch.matmul(query.float(), key.float().transpose(-2, -1)) * factor
        if additive is not None:
            scores = scores + additive.float()
        lse = torch.logsumexp(scores, dim=-1)
    return out, lse


def _efficient(query, key, value, bias, cu_seqlens_q, cu_seqlens_k, mask_kind, scale):
    """Per sequence (dense batch, or the pieces of a variable-length batch of 1): outputs in
    (batch, length, heads, dim) and the log-sum-exp rows (sequences, heads, length) each."""
    if cu_seqlens_q is None:
        out, lse = _efficient_attend(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                                     bias, mask_kind, scale)
        return out.transpose(1, 2), [lse[b] for b in range(lse.shape[0])]
    if bias is not None:
        _unsupported_argument("_efficient_attention_forward", "a bias and cu_seqlens together")
    outs, lses = [], []
    starts_q, starts_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for n in range(len(starts_q) - 1):
        q = query[:, starts_q[n]:starts_q[n + 1]].transpose(1, 2)
        k = key[:, starts_k[n]:starts_k[n + 1]].transpose(1, 2)
        v = value[:, starts_k[n]:starts_k[n + 1]].transpose(1, 2)
        out, lse = _efficient_attend(q, k, v, None, mask_kind, scale)
        outs.append(out.transpose(1, 2))
        lses.append(lse[0])
    return torch.cat(outs, dim=1), lses


def _efficient_mask(op: str, custom_mask_type: int):
    if custom_mask_type not in _EFFICIENT_MASKS:
        _unsupported_argument(op, f"custom_mask_type={custom_mask_type}")
    return _EFFICIENT_MASKS[custom_mask_type]


def efficient_attention_forward(query, key, value, bias, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                max_seqlen_k, dropout_p, custom_mask_type, compute_log_sumexp=False, *,
                                scale=None, seqlen_k=None, window_size=None):
    op = "_efficient_attention_forward"
    _no_dropout(op, dropout_p)
    if seqlen_k is not None:
        _unsupported_argument(op, "seqlen_k")
    if window_size is not None and window_size > 0:
        _unsupported_argument(op, f"window_size={window_size}")
    mask_kind = _efficient_mask(op, custom_mask_type)
    out, lses = _efficient(query, key, value, bias, cu_seqlens_q, cu_seqlens_k, mask_kind, scale)
    rows_q = max_seqlen_q if cu_seqlens_q is not None and max_seqlen_q is not None else query.shape[1]
    rows_k = max_seqlen_k if max_seqlen_k is not None else key.shape[1]
    width = -(-rows_q // _LSE_ALIGN) * _LSE_ALIGN if compute_log_sumexp else 0
    # Rows past a sequence's end hold +inf, as the kernel writes them.
    logsumexp = torch.full((len(lses), query.shape[2], width), float("inf"), dtype=torch.float32)
    if width:
        for n, lse in enumerate(lses):
            logsumexp[n, :, :lse.shape[-1]] = lse
    empty = torch.zeros((), dtype=torch.int64)
    return out, logsumexp, empty, empty.clone(), rows_q, rows_k


def efficient_attention_backward(grad_out, query, key, value, bias, out, cu_seqlens_q, cu_seqlens_k,
                                 max_seqlen_q, max_seqlen_k, logsumexp, dropout_p, philox_seed,
                                 philox_offset, custom_mask_type, bias_requires_grad, *, scale=None,
                                 num_splits_key=None, window_size=None,
                                 shared_storage_dqdkdv=False):  # noqa: ARG001
    op = "_efficient_attention_backward"
    _no_dropout(op, dropout_p)
    if window_size is not None and window_size > 0:
        _unsupported_argument(op, f"window_size={window_size}")
    mask_kind = _efficient_mask(op, custom_mask_type)
    with _autograd_back_on(), torch.enable_grad():
        q, k, v = (t.detach().requires_grad_() for t in (query, key, value))
        inputs = [q, k, v]
        b = None
        if bias is not None:
            b = bias.detach().requires_grad_(bool(bias_requires_grad))
            if bias_requires_grad:
                inputs.append(b)
        result, _ = _efficient(q, k, v, b, cu_seqlens_q, cu_seqlens_k, mask_kind, scale)
        grads = torch.autograd.grad(result, inputs, grad_out)
    grad_bias = grads[3] if len(grads) > 3 else torch.empty((), dtype=query.dtype)
    return grads[0], grads[1], grads[2], grad_bias


def register() -> None:
    """Register the kernels for the CPU dispatch key (once per process)."""
    global _library
    if _library is not None:
        return
    library = torch.library.Library("aten", "IMPL")
    for name, kernel in (("_scaled_dot_product_efficient_attention", efficient_forward),
                         ("_scaled_dot_product_efficient_attention_backward", efficient_backward),
                         ("_scaled_dot_product_flash_attention", flash_forward),
                         ("_scaled_dot_product_flash_attention_backward", flash_backward),
                         ("_flash_attention_forward", flash_attention_forward),
                         ("_flash_attention_backward", flash_attention_backward),
                         ("_scaled_dot_product_cudnn_attention", cudnn_sdpa_forward),
                         ("_scaled_dot_product_cudnn_attention_backward", cudnn_sdpa_backward),
                         ("_cudnn_attention_forward", cudnn_attention_forward),
                         ("_cudnn_attention_backward", cudnn_attention_backward),
                         ("_efficient_attention_forward", efficient_attention_forward),
                         ("_efficient_attention_backward", efficient_attention_backward)):
        library.impl(name, kernel, "CPU")
    _library = library


def patch_flex_attention() -> None:
    """``flex_attention`` with gradients: torch has no CPU backward (its eager entry point
    refuses CPU inputs that require grad, and inductor's CPU flex kernel is inference-only).
    On fake devices it runs torch's unfused reference implementation, forward and backward,
    also when the program wraps it in ``torch.compile`` (the fused GPU kernel computes the
    same attention, rounded differently).  Patched on the module before the program imports
    it, so ``from torch.nn.attention.flex_attention import flex_attention`` gets this one."""
    import functools

    try:
        import torch.nn.attention.flex_attention as flex
    except ImportError:  # a torch without FlexAttention
        return
    original_validate = flex._validate_device

    @functools.wraps(original_validate)
    def _validate_device(query, key, value):
        if query.device.type == "cpu":
            return  # fake-device tensors: the reference implementation runs them, grads too
        original_validate(query, key, value)

    flex._validate_device = _validate_device

    original = flex.flex_attention
    # Never inside the program's torch.compile: dynamo compiles a caller of this function up
    # to the call and runs the call itself eagerly.
    eager = torch._dynamo.disable(original)

    @functools.wraps(original)
    def flex_attention(*args, **kwargs):
        from . import graphs

        capture = graphs.capturing()
        if capture is not None:
            # Inside a CUDA graph capture: one step of the graph (flex's own compile refuses
            # to run under the capture's dispatch mode).
            return capture.opaque(run, args, kwargs)
        return run(*args, **kwargs)

    def run(*args, **kwargs):
        from .memory import _first_device

        with _without_tracking_mode() as tracking:
            result = eager(*args, **kwargs)
        if tracking is not None:
            device = _first_device(args, tracking.memory._blocks)
            if device is not None:
                leaves = torch.utils._pytree.tree_leaves(result)
                leaves += [getattr(leaf, "lse", None) for leaf in leaves]  # AuxOutput
                tracking.memory.charge_tensor(
                    [t for t in leaves if isinstance(t, torch.Tensor)], device)
        return result

    # torch.compile would compile the function __wrapped__ names instead of this one.
    del flex_attention.__wrapped__
    flex.flex_attention = flex_attention


@contextlib.contextmanager
def _without_tracking_mode():
    """flex traces its score/mask functions with its own (eager-backend) torch.compile, which
    refuses to run under a user dispatch mode other than torch's own, and whose guards on the
    torch-function mode stack would fail (recompiling on every call) as fakegpu's device
    rewrite mode moves in that stack.  Both fakegpu modes step out of their stacks for the
    call, and so do the dispatch modes above the tracking mode (selective activation
    checkpointing's): taking the tracking mode from beneath them and putting them back made
    the tensors' dispatch keys that dynamo's guards record differ from the ones it then
    checks, so every call under checkpointing recompiled (4.9x slower TorchTitan steps).
    Checkpointing then neither saves nor replays flex's outputs: its recomputation in backward
    recomputes the call, with the same bits (the reference implementation is deterministic).
    The caller charges the outputs.  Yields the tracking mode, or None if not active."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack, _pop_mode, _push_mode

    from .memory import TrackingMode
    from .runtime import DeviceRewriteMode

    from .graphs import _CaptureMode

    with _out_of_stack(_get_current_dispatch_mode_stack(), _CaptureMode, _pop_mode, _push_mode), \
            _out_of_stack(_get_current_dispatch_mode_stack(), TrackingMode,
                          _pop_mode, _push_mode, keep_above=False) as tracking, \
            _out_of_stack(torch.overrides._get_current_function_mode_stack(), DeviceRewriteMode,
                          torch._C._pop_torch_function_stack,
                          torch._C._push_on_torch_function_stack):
        yield tracking


@contextlib.contextmanager
def _out_of_stack(modes: list, kind: type, pop, push, keep_above: bool = True):
    """Take the first mode of ``kind`` out of a mode stack (``modes``, bottom first) while the
    block runs, and the modes above it unless ``keep_above``; yields it, or None when the stack
    has none."""
    position = next((i for i, mode in enumerate(modes) if isinstance(mode, kind)), None)
    if position is None:
        yield None
        return
    above = modes[position + 1:] if keep_above else []
    for _ in modes[position:]:
        pop()
    for mode in above:
        push(mode)
    try:
        yield modes[position]
    finally:
        for _ in above:
            pop()
        for mode in modes[position:]:
            push(mode)
