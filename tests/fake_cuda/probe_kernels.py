"""Run by tests/test_fake_cuda_kernels.py in a fresh interpreter set up as fgpu sets up a rank
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
