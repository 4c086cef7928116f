"""Context parallelism with SDPA as written for GPUs: torch's ``context_parallel`` shards
query, key and value along the sequence and runs ``scaled_dot_product_attention`` as ring
attention over the cp group (head-tail load balancing, causal).  Each rank also computes the
whole attention and its gradients in float64 on the CPU, shards them the same way, and
records how far its own shard of the output and of the q, k, v gradients is from them.

Cases: bfloat16 (SDPA's flash kernel on a GPU), bfloat16 with grouped keys (GQA), float32
(the memory-efficient kernel).  Usage: context_parallel_sdpa_gpu.py OUT_DIR; writes
OUT_DIR/rank<r>.json: case -> [max |error| / max |expected| of output, dq, dk, dv].
"""
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.experimental import context_parallel

out_dir = sys.argv[1]
torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
dist.init_process_group("nccl")
rank, world = dist.get_rank(), dist.get_world_size()
mesh = init_device_mesh("cuda", (world,))
results = {}
for name, dtype, kv_heads in (("bf16", torch.bfloat16, 4), ("bf16_gqa", torch.bfloat16, 2),
                              ("fp32", torch.float32, 4)):
    torch.manual_seed(0)
    seq = 64 * world            # head-tail halves of 32 rows: the efficient kernel's LSE alignment
    q = torch.randn(2, 4, seq, 16, dtype=dtype, device="cuda")
    k = torch.randn(2, kv_heads, seq, 16, dtype=dtype, device="cuda")
    v = torch.randn_like(k)
    grad = torch.randn_like(q)
    leaves = [t.detach().cpu().double().requires_grad_() for t in (q, k, v)]
    whole = F.scaled_dot_product_attention(*leaves, is_causal=True, enable_gqa=kv_heads != 4)
    whole.backward(grad.cpu().double())
    expected = [whole.detach()] + [t.grad for t in leaves]
    expected = [t.to("cuda", dtype) for t in expected]
    buffers = [q, k, v, grad, *expected]
    with context_parallel(mesh, buffers=buffers, buffer_seq_dims=[2] * len(buffers)):
        qs, ks, vs = (t.detach().clone().requires_grad_() for t in (q, k, v))
        out = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=kv_heads != 4)
        out.backward(grad)
        got = (out, qs.grad, ks.grad, vs.grad)
        results[name] = [float((a.double() - b.double()).abs().max() / b.double().abs().max())
                         for a, b in zip(got, expected)]
with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
    json.dump(results, f)
dist.destroy_process_group()
