"""Run by tests/e2e/test_fake_cuda_kernels.py in a fresh interpreter set up as fgpu sets up a rank
(FAKEGPU_FAKE_CUDA=1, the autoload hook on PYTHONPATH).  Calls the attention kernels torch
has only for CUDA, as unmodified programs do, and the CPU computation they must equal; prints
one JSON object of comparisons (max absolute differences, 0.0 = bit for bit)."""
import json

import torch
import torch.nn.functional as F
from torch.nn.attention.varlen import varlen_attn

math = torch.ops.aten._scaled_dot_product_attention_math
out = {}


def diff(a, b):
    return float((a - b).abs().max())


def leaves(*tensors):
    return [t.detach().clone().requires_grad_() for t in tensors]


torch.manual_seed(0)
# varlen_attn (the public API over aten::_flash_attention_forward/_backward): causal, GQA,
# two packed sequences of different lengths.
q = torch.randn(24, 4, 8, device="cuda", requires_grad=True)
k = torch.randn(24, 2, 8, device="cuda", requires_grad=True)
v = torch.randn(24, 2, 8, device="cuda", requires_grad=True)
cu = torch.tensor([0, 10, 24], dtype=torch.int32, device="cuda")
got = varlen_attn(q, k, v, cu, cu, 14, 14, window_size=(-1, 0), enable_gqa=True)
got.backward(torch.ones_like(got))
qr, kr, vr = leaves(q, k, v)
parts = [math(qr[a:b].transpose(0, 1), kr[a:b].transpose(0, 1), vr[a:b].transpose(0, 1), None,
              0.0, True, None, enable_gqa=True)[0].transpose(0, 1) for a, b in ((0, 10), (10, 24))]
ref = torch.cat(parts)
ref.backward(torch.ones_like(ref))
out["varlen_causal_gqa"] = [diff(got, ref), diff(q.grad, qr.grad), diff(k.grad, kr.grad),
                            diff(v.grad, vr.grad)]

# Dense aten::_flash_attention_forward with a sliding window (query i sees keys i-3 .. i),
# against the math kernel with the same band as an additive mask.
qd, kd, vd = (torch.randn(2, 12, 4, 8, device="cuda") for _ in range(3))
res = torch.ops.aten._flash_attention_forward(qd, kd, vd, None, None, 12, 12, 0.0, False, False,
                                              window_size_left=3, window_size_right=0)
i, j = torch.arange(12).unsqueeze(1), torch.arange(12).unsqueeze(0)
band = torch.zeros(12, 12).masked_fill(~((j <= i) & (j >= i - 3)), float("-inf"))
ref = math(qd.transpose(1, 2), kd.transpose(1, 2), vd.transpose(1, 2), band, 0.0, False, None)[0]
scores = (qd.transpose(1, 2) @ kd.transpose(1, 2).transpose(-2, -1)) * 8 ** -0.5 + band
out["dense_window"] = [diff(res[0], ref.transpose(1, 2)), diff(res[1], torch.logsumexp(scores, -1))]
out["dense_window_lse_shape"] = list(res[1].shape)

# cuDNN SDPA called directly, forward and backward, against the math kernel.
qc, kc, vc = (torch.randn(2, 4, 16, 8, device="cuda") for _ in range(3))
fwd = torch.ops.aten._scaled_dot_product_cudnn_attention(qc, kc, vc, None, True, 0.0, True, False)
ref = math(qc, kc, vc, None, 0.0, True, None)[0]
grad = torch.randn_like(ref)
bwd = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
    grad, qc, kc, vc, fwd[0], fwd[1], fwd[6], fwd[7], torch.empty(0), fwd[2], fwd[3], 16, 16, 0.0, True)
qr, kr, vr = leaves(qc, kc, vc)
math(qr, kr, vr, None, 0.0, True, None)[0].backward(grad)
out["cudnn_sdpa"] = [diff(fwd[0], ref), diff(bwd[0], qr.grad), diff(bwd[1], kr.grad), diff(bwd[2], vr.grad)]

# SDPA's flash kernel called directly, as ring attention calls it: over two blocks of keys,
# each block's output and log-sum-exp merged into the whole attention's, and each block's
# backward taken against the merged output and log-sum-exp; the q gradients summed and the
# k, v gradients put side by side must be the whole attention's.  Also the memory-efficient
# kernel's log-sum-exp.
flash = torch.ops.aten._scaled_dot_product_flash_attention
qb, kb, vb = (torch.randn(1, 2, 8, 8, device="cuda") for _ in range(3))
gb = torch.randn_like(qb)
blocks = [flash(qb, kb[:, :, a:b], vb[:, :, a:b]) for a, b in ((0, 5), (5, 8))]
lse = torch.logaddexp(blocks[0][1], blocks[1][1])
merged = sum(torch.exp(blk[1] - lse).unsqueeze(-1) * blk[0] for blk in blocks)
grads = [torch.ops.aten._scaled_dot_product_flash_attention_backward(
    gb, qb, kb[:, :, a:b], vb[:, :, a:b], merged, lse, None, None, 8, b - a, 0.0, False, blk[6], blk[7])
    for (a, b), blk in zip(((0, 5), (5, 8)), blocks)]
qbl, kbl, vbl = leaves(qb, kb, vb)
whole = math(qbl, kbl, vbl, None, 0.0, False, None)[0]
whole.backward(gb)
scores = (qb @ kb.transpose(-2, -1)) * 8 ** -0.5
out["flash_blocks_merged"] = [diff(merged, whole), diff(lse, torch.logsumexp(scores, -1)),
                              diff(grads[0][0] + grads[1][0], qbl.grad),
                              diff(torch.cat([grads[0][1], grads[1][1]], dim=2), kbl.grad),
                              diff(torch.cat([grads[0][2], grads[1][2]], dim=2), vbl.grad)]
res = torch.ops.aten._scaled_dot_product_efficient_attention(qb, kb, vb, None, True, 0.0, True)
causal8 = torch.zeros(8, 8).masked_fill(torch.ones(8, 8, dtype=torch.bool).triu(1), float("-inf"))
out["sdpa_efficient_lse"] = [diff(res[1][..., :8], torch.logsumexp(scores + causal8, -1)),
                             list(res[1].shape), bool(torch.isinf(res[1][..., 8:]).all())]

# aten::_cudnn_attention_forward / _backward (what varlen_attn calls on cuDNN GPUs): dense, as
# _scaled_dot_product_cudnn_attention; and packed (total, heads, dim) sequences with
# cum_seq_q/k, against the math kernel per sequence.
fwd = torch.ops.aten._cudnn_attention_forward(qc, kc, vc, None, None, None, 16, 16, True, 0.0, True, False)
bwd = torch.ops.aten._cudnn_attention_backward(
    grad, qc, kc, vc, fwd[0], fwd[1], fwd[6], fwd[7], torch.empty(0), torch.empty(0), torch.empty(0),
    16, 16, 0.0, True)
out["cudnn_attention_dense"] = [diff(fwd[0], ref), diff(bwd[0], qr.grad), diff(bwd[1], kr.grad),
                                diff(bwd[2], vr.grad)]
qp, kp, vp = (torch.randn(24, 4, 8, device="cuda") for _ in range(3))
fwd = torch.ops.aten._cudnn_attention_forward(qp, kp, vp, None, cu, cu, 14, 14, True, 0.0, True, False)
gp = torch.randn_like(qp)
bwd = torch.ops.aten._cudnn_attention_backward(gp, qp, kp, vp, fwd[0], fwd[1], fwd[6], fwd[7],
                                               torch.empty(0), cu, cu, 14, 14, 0.0, True)
qr, kr, vr = leaves(qp, kp, vp)
parts = [math(qr[a:b].transpose(0, 1), kr[a:b].transpose(0, 1), vr[a:b].transpose(0, 1), None,
              0.0, True, None)[0].transpose(0, 1) for a, b in ((0, 10), (10, 24))]
ref = torch.cat(parts)
ref.backward(gp)
out["cudnn_attention_packed"] = [diff(fwd[0], ref), diff(bwd[0], qr.grad), diff(bwd[1], kr.grad),
                                 diff(bwd[2], vr.grad)]
out["cudnn_attention_packed_lse_shape"] = list(fwd[1].shape)

# xformers-style aten::_efficient_attention_forward / _backward, (batch, length, heads, dim):
# a bias with a causal mask from the top left, and a causal mask from the bottom right on
# variable-length sequences; against the math kernel on the same masks.
qe, ke, ve = (torch.randn(2, 10, 3, 8, device="cuda") for _ in range(3))
bias = torch.randn(2, 3, 10, 10, device="cuda")
res = torch.ops.aten._efficient_attention_forward(qe, ke, ve, bias, None, None, None, None, 0.0, 1, True)
i, j = torch.arange(10).unsqueeze(1), torch.arange(10).unsqueeze(0)
causal = torch.zeros(10, 10).masked_fill(j > i, float("-inf"))
qr, kr, vr, br = leaves(qe.transpose(1, 2), ke.transpose(1, 2), ve.transpose(1, 2), bias)
ref = math(qr, kr, vr, br + causal, 0.0, False, None)[0]
scores = (qe.transpose(1, 2) @ ke.transpose(1, 2).transpose(-2, -1)) * 8 ** -0.5 + bias + causal
grad = torch.randn_like(ref)
ref.backward(grad)
bwd = torch.ops.aten._efficient_attention_backward(
    grad.transpose(1, 2), qe, ke, ve, bias, res[0], None, None, 10, 10, res[1], 0.0, res[2], res[3], 1, True)
out["efficient_bias_causal"] = [diff(res[0], ref.transpose(1, 2)), diff(res[1][:, :, :10], torch.logsumexp(scores, -1)),
                                diff(bwd[0], qr.grad.transpose(1, 2)), diff(bwd[1], kr.grad.transpose(1, 2)),
                                diff(bwd[2], vr.grad.transpose(1, 2)), diff(bwd[3], br.grad)]
out["efficient_lse"] = [list(res[1].shape), bool(torch.isinf(res[1][:, :, 10:]).all()), res[4], res[5]]
qv, kv, vv = torch.randn(1, 9, 2, 8, device="cuda"), torch.randn(1, 12, 2, 8, device="cuda"), \
    torch.randn(1, 12, 2, 8, device="cuda")
cq = torch.tensor([0, 4, 9], dtype=torch.int32, device="cuda")
ck = torch.tensor([0, 6, 12], dtype=torch.int32, device="cuda")
res = torch.ops.aten._efficient_attention_forward(qv, kv, vv, None, cq, ck, 5, 6, 0.0, 2, True)
parts = []
for (a, b), (c, d) in (((0, 4), (0, 6)), ((4, 9), (6, 12))):
    lq, lk = b - a, d - c
    keep = torch.arange(lk).unsqueeze(0) <= torch.arange(lq).unsqueeze(1) + (lk - lq)
    mask = torch.zeros(lq, lk).masked_fill(~keep, float("-inf"))
    parts.append(math(qv[:, a:b].transpose(1, 2), kv[:, c:d].transpose(1, 2), vv[:, c:d].transpose(1, 2),
                      mask, 0.0, False, None)[0].transpose(1, 2))
out["efficient_varlen_bottom_right"] = [diff(res[0], torch.cat(parts, dim=1)), list(res[1].shape)]
try:
    torch.ops.aten._efficient_attention_forward(qe, ke, ve, None, None, None, None, None, 0.0, 0, False,
                                                window_size=4)
    out["efficient_window_refusal"] = None
except Exception as exc:  # noqa: BLE001
    out["efficient_window_refusal"] = str(exc)

# sdpa_kernel contexts that enable only backends without CPU kernels still run (math), and
# the flash context uses torch's CPU flash kernel; both within float rounding of math.
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

qs = torch.randn(2, 4, 16, 8, device="cuda")
ref = math(qs, qs, qs, None, 0.0, True, None)[0]
for backend in (SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION):
    with sdpa_kernel([backend]):
        out[f"sdpa_{backend.name}"] = diff(F.scaled_dot_product_attention(qs, qs, qs, is_causal=True), ref)

# Dropout cannot be reproduced: one clear refusal.
try:
    torch.ops.aten._flash_attention_forward(qd, kd, vd, None, None, 12, 12, 0.1, False, False)
    out["dropout_refusal"] = None
except Exception as exc:  # noqa: BLE001
    out["dropout_refusal"] = str(exc)

# Device indices as accelerator indices: Module.to(k), device=k.
lin = torch.nn.Linear(4, 4).to(1)
z = torch.zeros(3, device=1)
out["int_devices"] = [str(lin.weight.device), str(z.device), torch.cuda.memory_allocated(1) > 0]
print(json.dumps(out))
