"""Run by tests/e2e/test_fake_cuda.py in a fresh interpreter with FAKEGPU_FAKE_CUDA=1 and the
autoload hook on PYTHONPATH (what fgpu gives a rank).  Exercises the fake CUDA runtime and
prints one JSON object of observations; the test compares them with hand-computed values."""
import json
import os
import sys
import tempfile

import torch

MiB = 1 << 20
out = {}
cuda = torch.cuda
out["available"] = cuda.is_available()
out["count"] = cuda.device_count()
out["names"] = [cuda.get_device_name(i) for i in range(cuda.device_count())]
out["capability"] = [list(cuda.get_device_capability(i)) for i in range(cuda.device_count())]
props = cuda.get_device_properties(1)
out["props1"] = {"total_memory": props.total_memory, "sms": props.multi_processor_count,
                 "major": props.major}
out["bf16"] = cuda.is_bf16_supported()
cuda.set_device(1)
out["current_after_set"] = cuda.current_device()
with cuda.device(0):
    out["inside_ctx"] = cuda.current_device()
out["after_ctx"] = cuda.current_device()
cuda.set_device(0)
acc = torch.accelerator
out["accelerator"] = str(acc.current_accelerator())
out["acc_available"] = acc.is_available()
out["acc_count"] = acc.device_count()
with acc.device_index(1):
    out["acc_inside"] = acc.current_device_index()
out["device_module_count"] = torch.get_device_module("cuda").device_count()

# Memory, against the caching allocator's rules (hand-computed in the test).
m = {}
small = torch.empty(1000, device="cuda:1")            # 4000 B -> 4096 B block, 2 MiB segment
m["small_alloc"], m["small_reserved"] = cuda.memory_allocated(1), cuda.memory_reserved(1)
m["dev0_untouched"] = cuda.memory_allocated(0)
twice = small * 2                                      # a result on cuda:1 is charged there
m["after_op"] = cuda.memory_allocated(1)
a = torch.empty(3 * MiB, dtype=torch.uint8, device="cuda")   # 3 MiB: new 20 MiB segment
b = torch.empty(3 * MiB, dtype=torch.uint8, device="cuda")   # fits the rest of that segment
m["two_3mib"], m["two_3mib_reserved"] = cuda.memory_allocated(0), cuda.memory_reserved(0)
c = torch.empty(12 * MiB + 1, dtype=torch.uint8, device="cuda")  # 12 MiB + 512 -> 14 MiB segment
m["with_12mib"], m["with_12mib_reserved"] = cuda.memory_allocated(0), cuda.memory_reserved(0)
del a
cuda.empty_cache()
m["after_free_a_empty_cache"] = [cuda.memory_allocated(0), cuda.memory_reserved(0)]
m["segments"] = sorted(s["total_size"] for s in cuda.memory_snapshot() if s["device"] == 0)
del b, c
m["after_free_all"] = [cuda.memory_allocated(0), cuda.memory_reserved(0)]
cuda.empty_cache()
m["after_empty_cache"] = [cuda.memory_allocated(0), cuda.memory_reserved(0)]
m["peak"] = cuda.max_memory_allocated(0)
m["stats_peak"] = cuda.memory_stats(0)["allocated_bytes.all.peak"]
cuda.reset_peak_memory_stats(0)
m["peak_after_reset"] = cuda.max_memory_allocated(0)
free, total = cuda.mem_get_info(1)
m["mem_get_info1"] = [free, total]
m["reserved1"] = cuda.memory_reserved(1)
moved = torch.ones(256, 256).cuda(1)                   # .cuda() charges the target device
m["cuda_call"] = cuda.memory_allocated(1)
out["memory"] = m

# Moves behave as in the CPU port: no copy.
t = torch.arange(4.0)
out["to_cuda_same_storage"] = t.to("cuda").data_ptr() == t.data_ptr() and t.cuda().data_ptr() == t.data_ptr()
lin = torch.nn.Linear(4, 4).to(torch.device("cuda", 1))
out["module_param_device"] = str(lin.weight.device)

# Random numbers equal the CPU port's.
cuda.manual_seed(7)
r1 = torch.randn(5, device="cuda")
d1 = torch.nn.functional.dropout(torch.ones(20, device="cuda"), 0.5)
torch.manual_seed(7)
r2 = torch.randn(5)
d2 = torch.nn.functional.dropout(torch.ones(20), 0.5)
out["rng_equal"] = bool(torch.equal(r1, r2) and torch.equal(d1, d2))
g = torch.Generator(device="cuda").manual_seed(3)
out["generator_equal"] = bool(torch.equal(torch.rand(4, generator=g, device="cuda"),
                                          torch.rand(4, generator=torch.Generator().manual_seed(3))))

# Streams, events, nvtx.
s = cuda.Stream()
with cuda.stream(s):
    z = torch.ones(3, device="cuda") + 1
cuda.current_stream().wait_stream(s)
z.record_stream(cuda.current_stream())
e0, e1 = cuda.Event(enable_timing=True), cuda.Event(enable_timing=True)
e0.record(); e1.record(); e1.synchronize()
cuda.nvtx.range_push("x"); cuda.nvtx.range_pop()
cuda.synchronize()
out["streams_ok"] = s.query() and e1.query() and e0.elapsed_time(e1) >= 0 and s.device == torch.device("cuda", 0)

# Checkpoints: map_location="cuda:1" loads (and charges device 1).
path = os.path.join(tempfile.mkdtemp(), "ck.pt")
torch.save({"w": torch.ones(1024)}, path)
before = cuda.memory_allocated(1)
loaded = torch.load(path, map_location="cuda:1")
out["load_charged"] = cuda.memory_allocated(1) - before

# Autocast on "cuda" casts as on a GPU.
with torch.autocast("cuda", dtype=torch.bfloat16):
    out["autocast_dtype"] = str(lin(torch.ones(2, 4, device="cuda")).dtype)

# GPU-only kernels: fused optimizer, SDPA backends without a CPU kernel.
p = torch.nn.Parameter(torch.ones(8, device="cuda"))
p.grad = torch.full((8,), 0.5, device="cuda")
torch.optim.AdamW([p], lr=0.1, fused=True).step()
ref = torch.nn.Parameter(torch.ones(8))
ref.grad = torch.full((8,), 0.5)
torch.optim.AdamW([ref], lr=0.1, fused=True).step()
out["fused_equal"] = bool(torch.equal(p.detach(), ref.detach()))
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

q = torch.randn(2, 4, 8, 16, device="cuda")
with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
    eff = torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
with sdpa_kernel([SDPBackend.MATH]):
    math = torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
out["sdpa_efficient_equals_math"] = bool(torch.equal(eff, math))

# The CUDA-only attention ops called directly equal the math kernel: the outputs bit for bit,
# the gradients (which the fused kernels take from the output and log-sum-exp) within rounding.
def attention_grads(op):
    leaves = [torch.randn(2, 3, 8, 16, device="cuda", generator=torch.Generator().manual_seed(i))
              .requires_grad_() for i in range(3)]
    result = op(*leaves)
    result.sum().backward()
    return [result.detach()] + [t.grad for t in leaves]


reference = attention_grads(lambda q, k, v: torch.ops.aten._scaled_dot_product_attention_math(
    q, k, v, None, 0.0, True)[0])
efficient = attention_grads(lambda q, k, v: torch.ops.aten._scaled_dot_product_efficient_attention(
    q, k, v, None, True, 0.0, True)[0])
flash = attention_grads(lambda q, k, v: torch.ops.aten._scaled_dot_product_flash_attention(
    q, k, v, 0.0, True)[0])
out["direct_attention_ops_equal_math"] = all(
    torch.equal(got[0], reference[0])
    and all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(got[1:], reference[1:]))
    for got in (efficient, flash))

# Backward functions (run without the torch-function mode) and threads the program starts.
class Scale(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        return grad * torch.tensor([3.0], device="cuda") + torch.ones(3).to("cuda")


leaf = torch.ones(3, device="cuda", requires_grad=True)
Scale.apply(leaf).sum().backward()
out["backward_grad"] = leaf.grad.tolist()
import threading  # noqa: E402

seen = {}


def in_thread():
    keep = torch.empty(1000, device="cuda:1")
    seen["charged"] = cuda.memory_allocated(1) - before_thread
    del keep


before_thread = cuda.memory_allocated(1)
worker = threading.Thread(target=in_thread)
worker.start()
worker.join()
out["thread_charged"] = seen.get("charged")

print(json.dumps(out))
sys.stdout.flush()
