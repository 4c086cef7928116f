"""Synchronous collectives run at once on the caller's thread.

A blocking ``dist.all_reduce(t)`` (``opts.asyncOp`` false) of one contiguous tensor on a group
whose stream is idle needs none of the queued path's machinery: no :class:`~.work.Op`, no
:class:`~.work.Task`, no hand-over to the stream's thread and back, no C++-waitable Work made
for a wait that follows at once.  For small messages that machinery costs several times the
call itself (measured in benchmarks/torch_allreduce.py, docs/torch.md "Speed").  So each
function here either runs the call through :meth:`~.work.Stream.run_now` — the same thing a
waiter does when it runs the stream's next task itself, under the same rules (nothing queued
or running, no pending point-to-point batch, the group's timeout not shorter than the
coordinator's) — and returns a finished Work, or returns None, and the operation takes the
queued path, which handles every other case (asynchronous calls, lists, non-contiguous or
complex or bool tensors, PreMulSum, groups not connected yet).

Errors are the queued path's: the same checks and the same messages; a failing call raises
from the operation itself, where torch's blocking call would raise it from ``wait()`` a line
later.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch

from fakegpu.nccl import Comm, NcclError

from ._types import builtin_op_of, native_dtype_of
from .work import call_error, finished_work

if TYPE_CHECKING:
    from .process_group import FakeGpuProcessGroup

_STRIDED = torch.strided


def _blocking(opts) -> bool:
    # A torch without ``asyncOp`` in its options (before 2.7) never says a call blocks.
    return opts is not None and not getattr(opts, "asyncOp", True)


def _plain(tensor: torch.Tensor) -> bool:
    return tensor.layout is _STRIDED and tensor.is_contiguous()


def _run(group: "FakeGpuProcessGroup", what: str, outputs: list, method: Callable, *args):
    """``method(comm, *args)`` now, and a finished Work of ``outputs``; None if it must be
    queued.  Buffers go as raw addresses: the tensors were checked to be contiguous."""
    comm = group._comm
    if comm is None or group._pending_p2p:
        return None
    try:
        if not group._stream.run_now(what, method, comm, *args):
            return None
    except NcclError as exc:
        raise call_error(what, group.comm_name, exc) from exc
    return finished_work(outputs)


def allreduce(group, tensors, opts=None):
    if not _blocking(opts) or len(tensors) != 1:
        return None
    tensor = tensors[0]
    dtype = native_dtype_of(tensor)
    op = builtin_op_of(opts.reduceOp)
    if dtype is None or op is None or not _plain(tensor):
        return None
    ptr = tensor.data_ptr()
    return _run(group, "allreduce", tensors, Comm.all_reduce, ptr, ptr, tensor.numel(), dtype, op)


def broadcast(group, tensors, opts=None):
    if not _blocking(opts):
        return None
    tensor = tensors[opts.rootTensor]
    dtype = native_dtype_of(tensor)
    if dtype is None or not _plain(tensor):
        return None
    ptr = tensor.data_ptr()
    return _run(group, "broadcast", tensors, Comm.broadcast, ptr, ptr, tensor.numel(), dtype,
                opts.rootRank)


def _same_kind(output: torch.Tensor, input_: torch.Tensor):
    dtype = native_dtype_of(input_)
    if dtype is None or output.dtype != input_.dtype or not (_plain(output) and _plain(input_)):
        return None
    return dtype


def allgather_base(group, output, input_, opts=None):
    if not _blocking(opts) or output.numel() != input_.numel() * group.size():
        return None  # the queued path raises the size error
    dtype = _same_kind(output, input_)
    if dtype is None:
        return None
    return _run(group, "_allgather_base", [output], Comm.all_gather, input_.data_ptr(),
                output.data_ptr(), input_.numel(), dtype)


def reduce_scatter_base(group, output, input_, opts=None):
    if not _blocking(opts) or input_.numel() != output.numel() * group.size():
        return None
    dtype = _same_kind(output, input_)
    op = builtin_op_of(opts.reduceOp)
    if dtype is None or op is None:
        return None
    return _run(group, "_reduce_scatter_base", [output], Comm.reduce_scatter, input_.data_ptr(),
                output.data_ptr(), output.numel(), dtype, op)
