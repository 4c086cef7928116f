"""REFERENCE, not fakegpu: TorchTitan's trainer on the CPU with gloo, for comparison.

TorchTitan 0.3.0 has no CPU training path (on a CPU torch it asks for CUDA devices and
NCCL).  This launcher is the smallest hand port that runs it on the CPU, unmodified
otherwise, as a torchrun worker without fakegpu:

    torchrun --standalone --nproc-per-node 4 verification/titan/cpu_port.py \\
        --module llama3 --config llama3_debugmodel ...   (the same options as the GPU run)

What the port changes, before TorchTitan is imported:

1. the device type TorchTitan detects is "cpu" (``torch._utils._get_available_device_type``),
   so its device is ``cpu``, its meshes are CPU meshes and its default backend is gloo;
2. ``torch.cpu`` answers the memory-monitor calls TorchTitan makes on its device module
   (names, a nominal 1 GiB capacity, zero peak statistics): memory is not compared; and
   ``torch.cpu.current_device()`` is the index 0 rather than the string "cpu" (TorchTitan
   passes it to ``barrier(device_ids=[...])``, which takes integers);
3. ``flex_attention`` with gradients runs torch's unfused reference implementation (torch
   has no CPU backward for it) -- ``fakegpu.fake_cuda.kernels.patch_flex_attention``, the
   same patch fake CUDA devices use, so both sides run the same attention code;
4. ``torch.distributed.set_timeout`` and pipeline ``step(arg_mbs=)``, which torch 2.13 lacks
   (``fakegpu.fake_cuda.torch_compat``, shared with fake CUDA for the same reason);
5. ``ReduceOp.PREMUL_SUM(f)`` (FSDP2's reduce-scatter with TorchTitan's gradient divide
   factor), which NCCL has and gloo refuses: each rank multiplies its input by ``f`` and the
   products are summed -- NCCL's definition of the op.

Numerics otherwise are torch's CPU kernels and gloo's reductions, which is what the fake-CUDA
run must reproduce.
"""
from __future__ import annotations

import os
import runpy
import sys
from collections import namedtuple


def _port_to_cpu() -> None:
    import torch
    import torch._utils

    if os.environ.get("FAKEGPU_FAKE_CUDA", "0") not in ("", "0"):
        sys.exit("cpu_port.py is the CPU reference: run it with plain torchrun, not under fgpu")

    torch._utils._get_available_device_type = lambda: "cpu"

    properties = namedtuple("CpuProperties", "name total_memory")("cpu", 1 << 30)
    zeros = {"active_bytes.all.peak": 0, "reserved_bytes.all.peak": 0,
             "num_alloc_retries": 0, "num_ooms": 0}
    torch.cpu.current_device = lambda: 0
    for name, value in {
        "get_device_name": lambda device=None: "cpu",
        "get_device_properties": lambda device=None: properties,
        "reset_peak_memory_stats": lambda device=None: None,
        "empty_cache": lambda: None,
        "memory_stats": lambda device=None: dict(zeros),
    }.items():
        if not hasattr(torch.cpu, name):
            setattr(torch.cpu, name, value)

    _premul_sum_on_gloo()

    from fakegpu.fake_cuda import kernels, torch_compat

    kernels.patch_flex_attention()
    torch_compat.install()


def _premul_sum_on_gloo() -> None:
    import functools

    import torch
    import torch.distributed as dist

    def premul(op, tensor):
        """(SUM, tensor * factor) for PREMUL_SUM(factor), else (op, tensor)."""
        if getattr(op, "op", None) != dist.ReduceOp.RedOpType.PREMUL_SUM:
            return op, tensor
        factor = op.factor
        return dist.ReduceOp.SUM, tensor * (factor.item() if isinstance(factor, torch.Tensor)
                                            else factor)

    original_rs = dist.reduce_scatter_single

    @functools.wraps(original_rs)
    def reduce_scatter_single(output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):
        op, input = premul(op, input)
        return original_rs(output, input, op=op, group=group, async_op=async_op)

    original_ar = dist.all_reduce

    @functools.wraps(original_ar)
    def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        new_op, scaled = premul(op, tensor)
        if scaled is not tensor:
            tensor.copy_(scaled)
        return original_ar(tensor, op=new_op, group=group, async_op=async_op)

    dist.reduce_scatter_single = reduce_scatter_single
    dist.all_reduce = all_reduce


def main() -> None:
    _port_to_cpu()
    sys.argv = ["torchtitan.train", *sys.argv[1:]]
    runpy.run_module("torchtitan.train", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
