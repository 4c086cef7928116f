"""``nn.DataParallel`` over the fake devices of one process.

``if torch.cuda.device_count() > 1: model = nn.DataParallel(model)`` is how many single-process
GPU scripts use several GPUs (pytorch/examples' ImageNet trainer without --multiprocessing-
distributed, most older repositories).  With N fake devices torch takes that path, and its
pieces refuse CPU tensors: the module check in ``DataParallel.forward`` (parameters must be on
``cuda:<device_ids[0]>``), the ``Broadcast`` and ``Gather`` autograd functions, and the
``torch.cuda.comm`` primitives they call (C++, CUDA only).

On fake devices DataParallel keeps its semantics, which differ from running the module on the
whole batch: the input is split into one chunk per device (``Tensor.chunk`` along ``dim``, as
``comm.scatter`` splits), each chunk runs on its own replica in its own thread, the outputs are
concatenated on the output device, and the replicas' gradients are summed into the module's
parameters in device order (``ReduceAddCoalesced``).  Replica 0 shares the module's parameters
and buffers, the others get copies, so batch norm normalises each chunk with its own statistics
and only replica 0's running statistics survive the step, as on GPUs.  Each copy is charged to
its own fake device.  tests/e2e/test_fake_cuda_data_parallel.py compares with that computation
done by hand.
"""
from __future__ import annotations

import functools
from itertools import chain

import torch

from . import runtime as rt
from .memory import placing_on

_installed = False


def _on_fake_devices(tensors) -> bool:
    return all(t.device.type == "cpu" for t in tensors)


def _device_list(devices) -> list[int]:
    from torch._utils import _get_device_index

    return [_get_device_index(d, True) for d in devices]


def _copy_to(tensor: torch.Tensor, device: int) -> torch.Tensor:
    """What a copy to another GPU makes: new memory, charged to that fake device."""
    with placing_on(device):
        out = tensor.clone(memory_format=torch.preserve_format)
    rt.state().memory.charge_tensor(out, device)
    return out


# --- torch.cuda.comm on fake devices -------------------------------------------------------
# The source device keeps the tensors themselves (comm's C++ does the same for the device the
# tensors are on); every other device gets a copy.

def broadcast_coalesced(tensors, devices, buffer_size=10485760):  # noqa: ARG001
    devices = _device_list(devices)
    return [list(tensors) if i == 0 else [_copy_to(t, d) for t in tensors] for i, d in enumerate(devices)]


def broadcast(tensor, devices=None, *, out=None):
    if out is not None:
        for o in out:
            o.copy_(tensor)
        return tuple(out)
    return tuple(group[0] for group in broadcast_coalesced([tensor], devices))


def reduce_add(inputs, destination=None):  # noqa: ARG001
    """The sum in device order, the first device's tensor first (comm.reduce_add's order)."""
    result = inputs[0].clone()
    for other in inputs[1:]:
        result.add_(other)
    return result


def reduce_add_coalesced(inputs, destination=None, buffer_size=10485760):  # noqa: ARG001
    return [reduce_add(list(column)) for column in zip(*inputs)]


def scatter(tensor, devices=None, chunk_sizes=None, dim=0, streams=None, *, out=None):  # noqa: ARG001
    if out is not None:
        chunks = tensor.split([o.size(dim) for o in out], dim)
        for o, c in zip(out, chunks):
            o.copy_(c)
        return tuple(out)
    devices = _device_list(devices)
    chunks = tensor.split(list(chunk_sizes), dim) if chunk_sizes else tensor.chunk(len(devices), dim)
    return tuple(_copy_to(c, d) for c, d in zip(chunks, devices))


def gather(tensors, dim=0, destination=None, *, out=None):
    if out is not None:
        return torch.cat(tensors, dim, out=out)
    target = 0 if destination in (None, -1, "cpu") else _device_list([destination])[0]
    with placing_on(target):
        result = torch.cat(tensors, dim)
    rt.state().memory.charge_tensor(result, target)
    return result


_COMM = {"broadcast": broadcast, "broadcast_coalesced": broadcast_coalesced, "reduce_add": reduce_add,
         "reduce_add_coalesced": reduce_add_coalesced, "scatter": scatter, "gather": gather}


def _patch_comm() -> None:
    from torch.nn.parallel import comm

    for name, fake in _COMM.items():
        original = getattr(comm, name)

        @functools.wraps(original)
        def dispatch(*args, _fake=fake, _original=original, **kwargs):
            first = args[0] if args else next(iter(kwargs.values()))
            tensors = [first] if isinstance(first, torch.Tensor) else list(chain.from_iterable(
                [x] if isinstance(x, torch.Tensor) else x for x in first))
            return _fake(*args, **kwargs) if _on_fake_devices(tensors) else _original(*args, **kwargs)

        setattr(comm, name, dispatch)


# --- the autograd functions that refuse CPU tensors -----------------------------------------

def _patch_functions() -> None:
    from torch.nn.parallel import _functions as F

    broadcast_forward, gather_forward = F.Broadcast.forward, F.Gather.forward

    def broadcast_on_fake(ctx, target_gpus, *inputs):
        if not _on_fake_devices(inputs):
            return broadcast_forward(ctx, target_gpus, *inputs)
        ctx.target_gpus = _device_list(target_gpus)
        if not inputs:
            return ()
        ctx.num_inputs = len(inputs)
        ctx.input_device = ctx.target_gpus[0]
        per_device = broadcast_coalesced(inputs, ctx.target_gpus)
        frozen = [copies[i] for i, wanted in enumerate(ctx.needs_input_grad[1:]) if not wanted
                  for copies in per_device]
        ctx.mark_non_differentiable(*frozen)
        return tuple(chain.from_iterable(per_device))

    def gather_on_fake(ctx, target_device, dim, *inputs):
        if not _on_fake_devices(inputs):
            return gather_forward(ctx, target_device, dim, *inputs)
        ctx.target_device = "cpu" if target_device == "cpu" else _device_list([target_device])[0]
        ctx.dim = dim
        # the devices the inputs came from: the order of the replicas
        ctx.input_gpus = tuple(range(len(inputs)))
        ctx.unsqueezed_scalar = all(t.dim() == 0 for t in inputs) and dim == 0
        if ctx.unsqueezed_scalar:
            inputs = tuple(t.view(1) for t in inputs)
        ctx.input_sizes = tuple(i.size(dim) for i in inputs)
        return gather(inputs, dim, ctx.target_device)

    def scatter_on_fake(ctx, target_gpus, chunk_sizes, dim, input):
        # torch's copies CPU input to the GPUs on background streams (and builds a
        # torch.device from each index, which needs a real accelerator); the fake devices'
        # copies are made on the calling thread, with nothing to synchronise.
        if input.device.type != "cpu":
            return scatter_forward(ctx, target_gpus, chunk_sizes, dim, input)
        ctx.dim = dim
        ctx.input_device = -1
        return scatter(input, target_gpus, chunk_sizes, dim)

    scatter_forward = F.Scatter.forward
    F.Broadcast.forward = staticmethod(broadcast_on_fake)
    F.Gather.forward = staticmethod(gather_on_fake)
    F.Scatter.forward = staticmethod(scatter_on_fake)


def _patch_data_parallel() -> None:
    """The module check compares with ``src_device_obj``: on fake devices the module's tensors
    are the CPU's, which is what the check then finds."""
    from torch.nn.parallel import DataParallel

    original = DataParallel.__init__

    @functools.wraps(original)
    def __init__(self, module, *args, **kwargs):
        original(self, module, *args, **kwargs)
        if self.device_ids and getattr(self, "src_device_obj", None) is not None \
                and self.src_device_obj.type == "cuda":
            self.src_device_obj = torch.device("cpu")

    DataParallel.__init__ = __init__


def install() -> None:
    global _installed
    if _installed:
        return
    _patch_comm()
    _patch_functions()
    _patch_data_parallel()
    _installed = True
