"""Paths programs written for newer torch / GPU-only features take (TorchTitan's among them),
in a rank-like interpreter with fake CUDA devices; prints one JSON line of findings.

- flex_attention with gradients on cuda tensors, called directly, through torch.compile and
  under selective activation checkpointing;
- CUDA graph APIs (torch.cuda.CUDAGraph stays a class; nothing is capturing outside a capture);
- torch.distributed.set_timeout and pipeline step(arg_mbs=...) against step(whole batch).
"""
import json
import os
import tempfile
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

out = {}

# -- flex_attention: forward and backward against the math attention on the same numbers
torch.manual_seed(0)
shape = (2, 4, 128, 16)
q, k, v = (torch.randn(shape, device="cuda", requires_grad=True) for _ in range(3))
mask = create_block_mask(lambda b, h, qi, kvi: qi >= kvi, None, None, 128, 128, device="cuda")
before = torch.cuda.memory_allocated()
attn = flex_attention(q, k, v, block_mask=mask)
out["flex_output_charged"] = torch.cuda.memory_allocated() - before >= attn.numel() * 4
attn.sum().backward()
grads = [t.grad.clone() for t in (q, k, v)]
ref_q, ref_k, ref_v = (t.detach().clone().requires_grad_() for t in (q, k, v))
ref = F.scaled_dot_product_attention(ref_q, ref_k, ref_v, is_causal=True)
ref.sum().backward()
out["flex_forward_close"] = bool(torch.allclose(attn, ref, atol=1e-5, rtol=1e-5))
out["flex_grads_close"] = all(bool(torch.allclose(g, r.grad, atol=1e-4, rtol=1e-4))
                              for g, r in zip(grads, (ref_q, ref_k, ref_v)))
for t in (q, k, v):
    t.grad = None
compiled = torch.compile(flex_attention)
again = compiled(q, k, v, block_mask=mask)
again.sum().backward()
out["compiled_flex_equals_eager"] = bool(torch.equal(again, attn)) and all(
    bool(torch.equal(t.grad, g)) for t, g in zip((q, k, v), grads))

# flex under selective activation checkpointing (its caching dispatch mode sits on top of
# fakegpu's tracking mode): same output and gradients as without checkpointing.
import functools  # noqa: E402

from torch.utils.checkpoint import (  # noqa: E402
    CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts)

for t in (q, k, v):
    t.grad = None
policy = lambda ctx, op, *a, **kw: CheckpointPolicy.PREFER_RECOMPUTE  # noqa: E731
sac = checkpoint(lambda a, b, c: flex_attention(a, b, c, block_mask=mask), q, k, v,
                 use_reentrant=False,
                 context_fn=functools.partial(create_selective_checkpoint_contexts, policy))
sac.sum().backward()
out["flex_under_sac_equal"] = bool(torch.equal(sac, attn)) and all(
    bool(torch.equal(t.grad, g)) for t, g in zip((q, k, v), grads))
# ... and flex's own compile is not redone on every call under it (a mode taken off the stack
# beneath checkpointing's made dynamo's guards fail each time: 4.9x slower TorchTitan steps)
from torch._dynamo.utils import counters  # noqa: E402

graphs_before = counters["stats"]["unique_graphs"]
for _ in range(4):
    checkpoint(lambda a, b, c: flex_attention(a, b, c, block_mask=mask), q, k, v, use_reentrant=False,
               context_fn=functools.partial(create_selective_checkpoint_contexts, policy)).sum().backward()
out["flex_under_sac_new_graphs"] = counters["stats"]["unique_graphs"] - graphs_before

# -- CUDA graphs (emulated: tests/e2e/fake_cuda/probe_cuda_graphs.py)
out["cudagraph_is_class"] = isinstance(torch.cuda.CUDAGraph, type)
out["capturing"] = torch.cuda.is_current_stream_capturing()

# -- torch.distributed.set_timeout and step(arg_mbs=...) on a one-rank gloo group
store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
dist.init_process_group("gloo", store=store, rank=0, world_size=1)
dist.set_timeout(timedelta(seconds=77))
out["set_timeout_ok"] = True

from torch.distributed.pipelining import PipelineStage, ScheduleGPipe  # noqa: E402


def pipeline_run(split: bool):
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    x, y = torch.randn(4, 8), torch.randn(4, 1)
    stage = PipelineStage(model, 0, 1, torch.device("cpu"))
    schedule = ScheduleGPipe(stage, n_microbatches=2, loss_fn=F.mse_loss)
    losses = []
    if split:
        schedule.step(arg_mbs=[(x[:2],), (x[2:],)], kwarg_mbs=[{}, {}],
                      target_mbs=[y[:2], y[2:]], losses=losses)
    else:
        schedule.step(x, target=y, losses=losses)
    return [float(l) for l in losses], [p.grad.clone() for p in model.parameters()]


whole_losses, whole_grads = pipeline_run(split=False)
mb_losses, mb_grads = pipeline_run(split=True)
out["step_arg_mbs_equal"] = whole_losses == mb_losses and all(
    bool(torch.equal(a, b)) for a, b in zip(whole_grads, mb_grads))
out["step_losses"] = mb_losses
dist.destroy_process_group()
print(json.dumps(out))
