"""FlexAttention on fake CUDA devices.

torch's FlexAttention has no CPU backward (``flex_attention`` refuses CPU inputs that need
gradients, compiled or not), and fake-CUDA tensors are CPU tensors, so a program built on it
(TorchTitan's llama3 models) cannot train under fake devices.  When that refusal would
happen, the attention is computed densely instead: the block mask's ``mask_mod`` is
evaluated into a boolean mask (``create_mask``) and torch's own
``scaled_dot_product_attention`` runs with it, under ordinary autograd.  The result is the
attention FlexAttention defines; the memory is the CPU kernel's, not a fused GPU kernel's.

Installed before the program imports ``flex_attention`` (the torch autoload hook runs at the
end of ``import torch``), so ``torch.compile(flex_attention)`` wrappers made at import time
wrap this function; it is excluded from dynamo, which therefore runs it eagerly.
"""
from __future__ import annotations

import functools

import torch

_installed = False


def _needs_grad(*tensors) -> bool:
    # flex_attention refuses CPU inputs that require grad even under no_grad
    return any(t.requires_grad for t in tensors)


def _dense_flex(original, query, key, value, score_mod=None, block_mask=None, scale=None,
                enable_gqa=False, return_lse=False, kernel_options=None, *, return_aux=None):
    from torch.nn.attention.flex_attention import AuxOutput, create_mask

    if query.device.type != "cpu" or not _needs_grad(query, key, value):
        return original(query, key, value, score_mod, block_mask, scale, enable_gqa, return_lse,
                        kernel_options, return_aux=return_aux)
    if score_mod is not None:
        raise NotImplementedError(
            "fakegpu: FlexAttention with a score_mod cannot run backward on fake CUDA devices "
            "(torch has no CPU backward for it); only block masks are evaluated densely")
    mask = None
    if block_mask is not None:
        b, h, q_len, kv_len = block_mask.shape
        mask = create_mask(block_mask.mask_mod, b, h, q_len, kv_len, device="cpu")
        mask = mask[..., : query.shape[-2], : key.shape[-2]]
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, scale=scale, enable_gqa=enable_gqa)
    want_lse = return_lse or (return_aux is not None and return_aux.lse)
    lse = None
    if want_lse:
        k = key
        if enable_gqa and key.shape[-3] != query.shape[-3]:
            k = key.repeat_interleave(query.shape[-3] // key.shape[-3], dim=-3)
        s = scale if scale is not None else query.shape[-1] ** -0.5
        scores = (query @ k.transpose(-2, -1)) * s
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        lse = torch.logsumexp(scores.float(), dim=-1)
    if return_aux is not None:
        return out, AuxOutput(lse=lse)
    if return_lse:
        return out, lse
    return out


def install() -> None:
    """Replace ``torch.nn.attention.flex_attention.flex_attention`` (idempotent)."""
    global _installed
    if _installed:
        return
    _installed = True
    import torch.nn.attention.flex_attention as flex

    original = flex.flex_attention

    @functools.wraps(original)
    def flex_attention(*args, **kwargs):
        return _dense_flex(original, *args, **kwargs)

    flex.flex_attention = torch._dynamo.disable(flex_attention, recursive=True)
