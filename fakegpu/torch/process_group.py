"""``FakeGpuProcessGroup``: a torch.distributed process group for CPU tensors whose bytes go
through fakegpu's ``libnccl.so.2`` shim (via :mod:`fakegpu.nccl`) to the coordinator.

So a CPU job takes the very same shim + coordinator path, and gets the same exact results,
timing model and report, as a GPU job that loads the shim in place of NCCL.

Design notes
- torch's C++ ``Backend`` cannot be subclassed from Python; a Python ``dist.ProcessGroup``
  subclass can, and torch then uses it as the group itself.  C++ callers (DDP's reducer,
  functional collectives) reach the methods the pybind trampoline forwards; Python callers
  (``dist.*``) reach any method by name.
- Every operation is checked in the calling thread (bad arguments raise at once) and then
  runs on the group's stream, a background thread that runs the group's operations in issue
  order (see :mod:`fakegpu.torch.work`): ``async_op=True`` returns at once, and every wait
  honours the group's timeout.  Point-to-point calls are queued and issued together, as one
  NCCL group, when a result is first needed or any other operation comes: ranks that post
  ``isend`` before ``irecv`` (``batch_isend_irecv`` on a Python group issues them one by
  one) would otherwise block each other.
- NCCL wants contiguous buffers; non-contiguous tensors are copied to a contiguous buffer
  and, for outputs, copied back.
- The communicator is created once the group knows its name and description (torch sets
  both right after construction), so the report can label traffic by group ("default_pg",
  "mesh_dp", "mesh_tp", ...).  A group used before that creates it on first use.
"""
from __future__ import annotations

import functools
import os
import sys
import threading
from contextlib import nullcontext
from datetime import timedelta
from typing import Iterable, Optional, Sequence

import torch
import torch.distributed as dist

from fakegpu.nccl import SPLIT_NOCOLOR, Comm, Nccl, NcclError, RedOp

from . import now
from ._types import Reduction, buffer_of, reduction_of
from .group_base import GroupBase, reduce_op_of
from .work import FakeGpuWork, Op, Stream, Task, backend_error, call_error

BACKEND_NAME = "fakegpu"
_UID_KEY = "fakegpu/unique_id"

_library_lock = threading.Lock()
_library: Optional[Nccl] = None
# How many communicators this process created per group name: torchrun's agent store outlives
# destroy_process_group(), so a re-created group with the same name needs a fresh store key.
_generations: dict[str, int] = {}


def library() -> Nccl:
    """The shim, loaded once per process (``FAKEGPU_NCCL_LIBRARY`` overrides where from)."""
    global _library
    with _library_lock:
        if _library is None:
            _library = Nccl()
        return _library


# torch's default for process groups that were given no timeout.
_DEFAULT_TIMEOUT = timedelta(minutes=30)
# The kind (and the Work's name) of a recv without a source rank (recv_anysource).
_RECV_ANY = "recv from any source"


def _join_notification_code():
    try:
        from torch.distributed.algorithms.join import Join
    except ImportError:
        return None
    return Join.notify_join_context.__code__


def _for_ddp_join() -> bool:
    """Whether this all-reduce is the one ``Join.notify_join_context`` schedules: DDP's C++
    reducer reads its C++ ``result()``, which only torch's future-wrapping Work has (see
    :mod:`fakegpu.torch.work`).  A few frames up: all_reduce and torch's logging wrappers."""
    global _JOIN_CODE
    if _JOIN_CODE is False:
        _JOIN_CODE = _join_notification_code()
    frame = sys._getframe(2)
    for _ in range(6):
        if frame is None:
            return False
        if frame.f_code is _JOIN_CODE:
            return True
        frame = frame.f_back
    return False


_JOIN_CODE = False


def tries_now(run_now):
    """The operation first tries ``run_now(group, ...)`` (:mod:`fakegpu.torch.now`: a blocking
    call run at once on the caller's thread), and takes the decorated, queued path when that
    answers None.  Both halves stay reachable (``.now``, ``.queued``) for wrappers that must
    treat them differently (fakegpu.fake_cuda.distributed)."""
    def decorate(queued):
        @functools.wraps(queued)
        def operation(self, *args, **kwargs):
            work = run_now(self, *args, **kwargs)
            return work if work is not None else queued(self, *args, **kwargs)

        operation.now = run_now
        operation.queued = queued
        return operation
    return decorate


def _reduction_order_is_gloo() -> bool:
    """Whether this process's communicators reduce in gloo's order. The torch backend defaults
    the process to ``FAKEGPU_REDUCTION_ORDER=gloo`` (set in the environment, where the shim reads
    it as each communicator is created), so that a fake-CUDA "nccl" job sums floats exactly as a
    CPU gloo run of torch 2.13 does (docs/torch.md, "Numerics"); ``rank`` keeps rank order."""
    value = os.environ.get("FAKEGPU_REDUCTION_ORDER", "").strip()
    if not value:
        os.environ["FAKEGPU_REDUCTION_ORDER"] = value = "gloo"
    return value.lower() == "gloo"


class _Contiguous:
    """A contiguous stand-in for a tensor; ``commit()`` copies results back if it was a copy."""

    def __init__(self, tensor: torch.Tensor):
        if tensor.device.type != "cpu":
            raise ValueError(f"fakegpu's torch backend works on CPU tensors, got one on {tensor.device}")
        self.tensor = tensor
        self.buffer = tensor if tensor.is_contiguous() else tensor.contiguous()
        if self.buffer.is_complex():
            self.buffer = torch.view_as_real(self.buffer)

    def commit(self) -> None:
        if self.buffer.data_ptr() != self.tensor.data_ptr():
            source = torch.view_as_complex(self.buffer) if self.tensor.is_complex() else self.buffer
            self.tensor.copy_(source)


def _flat_cat(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors]) if tensors else torch.empty(0)


class FakeGpuProcessGroup(GroupBase):
    """A process group whose collectives run through the fakegpu NCCL shim."""

    BACKEND_NAME = BACKEND_NAME
    UNNAMED_COMM = "fakegpu_group"

    def __init__(self, store, rank: int, size: int, timeout: Optional[timedelta] = None, *,
                 comm: Optional[Comm] = None, group_name: str = "", group_desc: str = ""):
        super().__init__(rank, size, group_name=group_name, group_desc=group_desc)
        self._store = store
        self._timeout = timeout
        self._comm = comm
        self._lock = threading.RLock()
        self._pending_p2p: list[tuple[str, _Contiguous, int, Op]] = []
        self._stream_: Optional[Stream] = None
        self._closed = False
        # Before any communicator of this group exists: the shim reads the order at creation.
        self._gloo_order = _reduction_order_is_gloo()

    # -- identity (the rest is GroupBase's) ---------------------------------------------------
    def _identity_changed(self) -> None:
        self._maybe_connect_early()

    def __repr__(self) -> str:
        return (f"<FakeGpuProcessGroup {self.comm_name!r} rank {self.rank()}/{self.size()}"
                f"{'' if self._comm else ' (not connected)'}>")

    # -- communicator ----------------------------------------------------------------------------
    def _maybe_connect_early(self) -> None:
        if (self._comm is None and self._group_name and self._group_desc
                and os.environ.get("FAKEGPU_TORCH_EAGER_INIT", "1") != "0"):
            self._connect()

    def _connect(self) -> Comm:
        with self._lock:
            if self._comm is not None:
                return self._comm
            if self._closed:
                raise RuntimeError(f"fakegpu: process group {self.comm_name!r} was shut down")
            nccl = library()
            generation = _generations.get(self._group_name, 0)
            _generations[self._group_name] = generation + 1
            # The agent's store also outlives an elastic restart, where the per-process
            # generation starts again at 0: the restart count keeps attempts apart.
            attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
            key = f"{_UID_KEY}/attempt{attempt}/{generation}"
            try:
                # Rank 0 makes the id; the group's store (already scoped to this group by
                # torch) hands it to the others, as ProcessGroupNCCL does.
                if self.rank() == 0:
                    uid = nccl.get_unique_id()
                    self._store.set(key, uid)
                else:
                    uid = bytes(self._store.get(key))
                self._comm = nccl.comm_init_rank(self.size(), uid, self.rank(), name=self.comm_name)
            except NcclError as exc:
                raise call_error("communicator init", self.comm_name, exc) from exc
            return self._comm

    @property
    def comm(self) -> Comm:
        return self._comm if self._comm is not None else self._connect()

    @property
    def timeout(self) -> timedelta:
        return self._timeout or _DEFAULT_TIMEOUT

    @property
    def _stream(self) -> Stream:
        # Made on first use, once torch has named the group (its name labels errors).
        with self._lock:
            if self._stream_ is None:
                self._stream_ = Stream(self.comm_name, self.timeout.total_seconds())
            return self._stream_

    def _run(self, what: str, body, outputs, *, grouped: bool = False, after=None,
             future_work: bool = False) -> dist.Work:
        """Submit ``body(comm)`` (inside an NCCL group if ``grouped``), then ``after()``, to
        the group's stream, behind any queued p2p; the Work of ``outputs``."""
        with self._lock:
            self._flush_p2p()
            comm = self.comm
            op = Op(what, self._stream, list(outputs))
            work = op.future_work() if future_work else op.work()

            def run():
                try:
                    with library().group() if grouped else nullcontext():
                        body(comm)
                except NcclError as exc:
                    raise call_error(what, self.comm_name, exc) from exc
                if after is not None:
                    after()

            self._stream.submit(Task(what, run, [op]))
        return work

    @staticmethod
    def _commit_all(items):
        def commit():
            for item in items:
                item.commit()
        return commit

    def _reduce_op(self, comm: Comm, reduction: Reduction, dtype) -> tuple[int, Optional[int]]:
        """(op code, op to destroy afterwards) for ``reduction``."""
        if reduction.premul_factor is None:
            return int(reduction.op), None
        op = comm.create_premul_sum(reduction.premul_factor, dtype)
        return op, op

    # -- all-reduce ---------------------------------------------------------------------------
    def _all_reduce_into(self, comm: Comm, tensors: Iterable[_Contiguous], reduce_op) -> None:
        for item in tensors:
            buf = buffer_of(item.buffer, reducing=True)
            op, temp = self._reduce_op(comm, reduction_of(reduce_op, item.tensor.dtype), buf.dtype)
            try:
                comm.all_reduce(item.buffer, item.buffer, buf.count, buf.dtype, op)
            finally:
                if temp is not None:
                    comm.destroy_op(temp)

    @tries_now(now.allreduce)
    def allreduce(self, tensors, opts=None):
        reduce_op = reduce_op_of(opts)
        if any(t.is_sparse for t in tensors):
            return self._sparse_allreduce(tensors, reduce_op)
        items = [_Contiguous(t) for t in tensors]
        return self._run("allreduce", lambda comm: self._all_reduce_into(comm, items, reduce_op),
                         tensors, grouped=len(items) > 1, after=self._commit_all(items),
                         future_work=_for_ddp_join())

    def allreduce_coalesced(self, tensors, opts=None):
        reduce_op = reduce_op_of(opts)
        if self._gloo_order and len(tensors) > 1 and len({t.dtype for t in tensors}) == 1:
            # gloo all-reduces the flattened concatenation as one buffer (its chunks span the
            # tensors); the coalescing manager's all_reduces arrive here too.
            flat = _Contiguous(_flat_cat(tensors))

            def scatter_back():
                offset = 0
                for t in tensors:
                    t.copy_(flat.tensor[offset:offset + t.numel()].view(t.shape))
                    offset += t.numel()

            return self._run("allreduce_coalesced", lambda comm: self._all_reduce_into(comm, [flat], reduce_op),
                             tensors, after=scatter_back)
        items = [_Contiguous(t) for t in tensors]
        return self._run("allreduce_coalesced",
                         lambda comm: self._all_reduce_into(comm, items, reduce_op), tensors,
                         grouped=True, after=self._commit_all(items))

    # -- broadcast / reduce -------------------------------------------------------------------
    @tries_now(now.broadcast)
    def broadcast(self, tensors, opts=None):
        root = opts.rootRank if opts is not None else 0
        root_tensor = opts.rootTensor if opts is not None else 0
        item = _Contiguous(tensors[root_tensor])

        def body(comm):
            buf = buffer_of(item.buffer, reducing=False)
            comm.broadcast(item.buffer, item.buffer, buf.count, buf.dtype, root)

        return self._run("broadcast", body, tensors, after=item.commit)

    def reduce(self, tensors, opts=None):
        root = opts.rootRank if opts is not None else 0
        reduce_op = reduce_op_of(opts)
        item = _Contiguous(tensors[opts.rootTensor if opts is not None else 0])

        def body(comm):
            buf = buffer_of(item.buffer, reducing=True)
            op, temp = self._reduce_op(comm, reduction_of(reduce_op, item.tensor.dtype), buf.dtype)
            try:
                comm.reduce(item.buffer, item.buffer, buf.count, buf.dtype, op, root)
            finally:
                if temp is not None:
                    comm.destroy_op(temp)

        return self._run("reduce", body, tensors,
                         after=item.commit if self.rank() == root else None)

    # -- all-gather -----------------------------------------------------------------------------
    def _gather_blocks(self, comm: Comm, output: torch.Tensor, input_: _Contiguous) -> None:
        """All-gather ``input_`` into the flat contiguous ``output`` (size * input elements)."""
        buf = buffer_of(input_.buffer, reducing=False)
        comm.all_gather(input_.buffer, output, buf.count, buf.dtype)

    def _allgather_list(self, comm: Comm, outputs: list[torch.Tensor], input_: _Contiguous,
                        staging: list[torch.Tensor]) -> None:
        sizes = {t.numel() for t in outputs} | {input_.tensor.numel()}
        if len(sizes) == 1 and all(t.dtype == input_.tensor.dtype for t in outputs):
            flat = torch.empty(self.size() * input_.tensor.numel(), dtype=input_.tensor.dtype)
            view = torch.view_as_real(flat) if flat.is_complex() else flat
            self._gather_blocks(comm, view, input_)
            staging.append(flat)
            return
        # Uneven blocks: one broadcast per rank, all in one NCCL group.
        for peer, out in enumerate(outputs):
            block = _Contiguous(out)
            source = input_.buffer if peer == self.rank() else block.buffer
            buf = buffer_of(block.buffer, reducing=False)
            comm.broadcast(source, block.buffer, buf.count, buf.dtype, peer)
            staging.append(block)

    @staticmethod
    def _scatter_staging(outputs: list[torch.Tensor], staged) -> None:
        if isinstance(staged, _Contiguous):
            staged.commit()
            return
        offset = 0
        for out in outputs:
            n = out.numel()
            out.copy_(staged[offset:offset + n].view(out.shape))
            offset += n

    def allgather(self, output_tensors, input_tensors, opts=None):
        self._check_lists("allgather", output_tensors, input_tensors)
        inputs = [_Contiguous(t) for t in input_tensors]
        staged: list[list] = [[] for _ in inputs]

        def body(comm):
            for outs, inp, stage in zip(output_tensors, inputs, staged):
                self._allgather_list(comm, outs, inp, stage)

        def after():
            for outs, stage in zip(output_tensors, staged):
                if len(stage) == 1 and not isinstance(stage[0], _Contiguous):
                    self._scatter_staging(outs, stage[0])
                else:
                    for block in stage:
                        block.commit()

        return self._run("allgather", body, [t for outs in output_tensors for t in outs],
                         grouped=len(inputs) > 1 or self._uneven(output_tensors), after=after)

    @staticmethod
    def _uneven(output_lists) -> bool:
        return any(len({t.numel() for t in outs}) > 1 for outs in output_lists)

    def _allgather_pairs(self, what: str, pairs: list[tuple[torch.Tensor, torch.Tensor]]):
        items = [(_Contiguous(output), _Contiguous(input_)) for output, input_ in pairs]

        def body(comm):
            for out, inp in items:
                self._gather_blocks(comm, out.buffer, inp)

        return self._run(what, body, [out for out, _ in pairs], grouped=len(items) > 1,
                         after=self._commit_all([out for out, _ in items]))

    # Blocking single-tensor calls first try the caller's thread (GroupBase routes the rest).
    _allgather_base = tries_now(now.allgather_base)(GroupBase._allgather_base)
    all_gather_single = tries_now(now.allgather_base)(GroupBase.all_gather_single)

    # -- reduce-scatter ---------------------------------------------------------------------------
    def _reduce_scatter_pairs(self, what: str, pairs, reduce_op):
        items = [(_Contiguous(output), _Contiguous(input_)) for output, input_ in pairs]

        def body(comm):
            for out, inp in items:
                buf = buffer_of(out.buffer, reducing=True)
                op, temp = self._reduce_op(comm, reduction_of(reduce_op, out.tensor.dtype), buf.dtype)
                try:
                    comm.reduce_scatter(inp.buffer, out.buffer, buf.count, buf.dtype, op)
                finally:
                    if temp is not None:
                        comm.destroy_op(temp)

        return self._run(what, body, [out for out, _ in pairs], grouped=len(items) > 1,
                         after=self._commit_all([out for out, _ in items]))

    def _reduce_scatter_per_block(self, output_tensors, input_lists, reduce_op):
        """gloo's list-form reduce_scatter: one all-reduce of each of the world input tensors
        (chunked over its n elements, not over the whole n·world), keeping the rank's own."""
        rank = self.rank()
        blocks = [[_Contiguous(b.to(out.dtype).clone()) for b in lst] for out, lst in zip(output_tensors, input_lists)]

        def after():
            for out, lst in zip(output_tensors, blocks):
                out.copy_(lst[rank].buffer.view(out.shape) if not out.is_complex() else
                          torch.view_as_complex(lst[rank].buffer).view(out.shape))

        return self._run("reduce_scatter", lambda comm: self._all_reduce_into(comm, [b for lst in blocks for b in lst],
                                                                              reduce_op),
                         output_tensors, grouped=True, after=after)

    def reduce_scatter(self, output_tensors, input_lists, opts=None):
        reduce_op = reduce_op_of(opts)
        self._check_lists("reduce_scatter", input_lists, output_tensors)
        if self._gloo_order:
            return self._reduce_scatter_per_block(output_tensors, input_lists, reduce_op)
        pairs = [(out, _flat_cat(blocks).to(out.dtype)) for out, blocks in zip(output_tensors, input_lists)]
        return self._reduce_scatter_pairs("reduce_scatter", pairs, reduce_op)

    _reduce_scatter_base = tries_now(now.reduce_scatter_base)(GroupBase._reduce_scatter_base)
    reduce_scatter_single = tries_now(now.reduce_scatter_base)(GroupBase.reduce_scatter_single)

    # -- all-to-all --------------------------------------------------------------------------------
    def _exchange(self, comm: Comm, sends: list[torch.Tensor], recvs: list[torch.Tensor]) -> None:
        """Block j of ``sends`` goes to rank j, block j of ``recvs`` comes from rank j
        (contiguous flat views); the caller wraps this in an NCCL group."""
        me = self.rank()
        for peer in range(self.size()):
            send, recv = sends[peer], recvs[peer]
            if peer == me:
                recv.copy_(send)
                continue
            if send.numel():
                buf = buffer_of(send, reducing=False)
                comm.send(send, buf.count, buf.dtype, peer)
            if recv.numel():
                buf = buffer_of(recv, reducing=False)
                comm.recv(recv, buf.count, buf.dtype, peer)

    @staticmethod
    def _split_rows(flat: torch.Tensor, shape, splits: list[int]) -> list[torch.Tensor]:
        row = 1
        for dim in shape[1:]:
            row *= dim
        blocks, offset = [], 0
        for rows in splits:
            blocks.append(flat[offset:offset + rows * row])
            offset += rows * row
        return blocks

    def _all_to_all_single(self, what, output, input_, output_splits, input_splits):
        n = self.size()
        out, inp = _Contiguous(output), _Contiguous(input_)
        # Complex tensors were viewed as real pairs; split sizes count rows of the original.
        out_flat, in_flat = out.buffer.reshape(-1), inp.buffer.reshape(-1)
        if not output_splits and not input_splits:
            if input_.numel() % n or output.numel() != input_.numel():
                raise ValueError(f"fakegpu {what}: even split needs equal input/output sizes "
                                 f"divisible by {n}, got {input_.numel()} and {output.numel()}")

            def body(comm):
                buf = buffer_of(in_flat, reducing=False)
                comm.all_to_all(in_flat, out_flat, buf.count // n, buf.dtype)

            return self._run(what, body, [output], after=out.commit)

        def rows(tensor, splits):
            if splits:
                if len(splits) != n:
                    raise ValueError(f"fakegpu {what}: {len(splits)} split sizes for {n} ranks")
                return list(splits)
            if tensor.shape[0] % n:
                raise ValueError(f"fakegpu {what}: dim 0 ({tensor.shape[0]}) not divisible by {n}")
            return [tensor.shape[0] // n] * n

        scale = 2 if output.is_complex() else 1
        out_shape = [*output.shape, scale] if scale == 2 else list(output.shape)
        in_shape = [*input_.shape, scale] if scale == 2 else list(input_.shape)
        recvs = self._split_rows(out_flat, out_shape, rows(output, output_splits))
        sends = self._split_rows(in_flat, in_shape, rows(input_, input_splits))
        return self._run(what, lambda comm: self._exchange(comm, sends, recvs), [output],
                         grouped=True, after=out.commit)

    def alltoall(self, output_tensors, input_tensors, opts=None):
        self._check_alltoall_lists(output_tensors, input_tensors)
        outs = [_Contiguous(t) for t in output_tensors]
        ins = [_Contiguous(t) for t in input_tensors]
        return self._run("alltoall", lambda comm: self._exchange(
            comm, [i.buffer.reshape(-1) for i in ins], [o.buffer.reshape(-1) for o in outs]),
            output_tensors, grouped=True, after=self._commit_all(outs))

    # -- gather / scatter ---------------------------------------------------------------------------
    def gather(self, output_tensors, input_tensors, opts=None):
        root = opts.rootRank if opts is not None else 0
        inp = _Contiguous(input_tensors[0])
        is_root = self.rank() == root
        if is_root and (len(output_tensors) != 1 or len(output_tensors[0]) != self.size()):
            raise ValueError(f"fakegpu gather: the root needs one list of {self.size()} outputs")
        staging = None
        if is_root:
            staging = torch.empty(self.size() * inp.tensor.numel(), dtype=inp.tensor.dtype)

        def body(comm):
            buf = buffer_of(inp.buffer, reducing=False)
            target = None
            if staging is not None:
                target = torch.view_as_real(staging) if staging.is_complex() else staging
            comm.gather(inp.buffer, target, buf.count, buf.dtype, root)

        return self._run("gather", body, [t for outs in output_tensors for t in outs],
                         after=(lambda: self._scatter_staging(output_tensors[0], staging))
                         if is_root else None)

    def scatter(self, output_tensors, input_tensors, opts=None):
        root = opts.rootRank if opts is not None else 0
        out = _Contiguous(output_tensors[0])
        is_root = self.rank() == root
        staging = None
        if is_root:
            if len(input_tensors) != 1 or len(input_tensors[0]) != self.size():
                raise ValueError(f"fakegpu scatter: the root needs one list of {self.size()} inputs")
            staging = _flat_cat(input_tensors[0]).to(out.tensor.dtype)
            if staging.is_complex():
                staging = torch.view_as_real(staging)

        def body(comm):
            buf = buffer_of(out.buffer, reducing=False)
            comm.scatter(staging, out.buffer, buf.count, buf.dtype, root)

        return self._run("scatter", body, output_tensors, after=out.commit)

    # -- barrier -----------------------------------------------------------------------------------
    def barrier(self, opts=None):
        # As ProcessGroupNCCL: a barrier is a one-element all-reduce.
        token = torch.zeros(1, dtype=torch.float32)
        return self._run("barrier",
                         lambda comm: comm.all_reduce(token, token, 1, "float32", RedOp.sum),
                         [token])

    def monitored_barrier(self, timeout=None, wait_all_ranks=False):
        """gloo's monitored barrier (torch refuses to call it for a backend not named gloo;
        :func:`fakegpu.torch.monitored_barrier` is the public spelling)."""
        from .monitored import monitored_barrier

        monitored_barrier(self, timeout=timeout, wait_all_ranks=wait_all_ranks)

    # -- sparse -------------------------------------------------------------------------------
    def _sparse_allreduce(self, tensors, reduce_op):
        """SUM of sparse COO tensors, as gloo does it: every rank's indices and values are
        all-gathered (padded to the largest nnz) and added up; the result is coalesced."""
        if len(tensors) != 1:
            raise ValueError(f"fakegpu allreduce: one sparse tensor at a time, got {len(tensors)}")
        op_type = getattr(reduce_op, "op", reduce_op)
        if op_type != dist.ReduceOp.RedOpType.SUM:
            raise ValueError(f"fakegpu allreduce: sparse tensors support SUM only, not {op_type.name}")
        tensor = tensors[0]
        local = tensor.coalesce()
        n = self.size()

        def body(comm):
            nnz = torch.tensor([local._nnz()], dtype=torch.int64)
            counts = torch.empty(n, dtype=torch.int64)
            comm.all_gather(nnz, counts, 1, "int64")
            top = int(counts.max())
            indices = torch.zeros(local.sparse_dim(), top, dtype=torch.int64)
            indices[:, :local._nnz()] = local.indices()
            values = torch.zeros((top, *local.values().shape[1:]), dtype=local.dtype)
            values[:local._nnz()] = local.values()
            all_idx = torch.empty((n, *indices.shape), dtype=torch.int64)
            all_val = torch.empty((n, *values.shape), dtype=local.dtype)
            with library().group():
                comm.all_gather(indices, all_idx, indices.numel(), "int64")
                buf = buffer_of(values, reducing=False)
                comm.all_gather(values, all_val, buf.count, buf.dtype)
            total = None
            for r in range(n):
                k = int(counts[r])
                part = torch.sparse_coo_tensor(all_idx[r][:, :k], all_val[r][:k], local.shape)
                total = part if total is None else total + part
            tensor.copy_(total.coalesce())

        return self._run("allreduce (sparse)", body, [tensor])

    # -- point to point ------------------------------------------------------------------------
    def _point_to_point(self, kind: str, tensors, peer: int) -> FakeGpuWork:
        if kind == _RECV_ANY:
            if len(tensors) != 1:
                raise ValueError(f"fakegpu {kind}: expected one tensor, got {len(tensors)}")
            if self.size() < 2:
                raise ValueError(f"fakegpu recv from any source: this {self.size()}-rank group has no "
                                 "other rank to receive from")
        else:
            self._check_peer(kind, tensors, peer)
        # An any-source recv learns its source when it runs (_flush_p2p sets op.source_rank).
        op = Op(kind, self._stream, list(tensors), flush=self._flush_p2p,
                source_rank=peer if kind == "recv" else -1)
        work = op.work()
        with self._lock:
            self._pending_p2p.append((kind, _Contiguous(tensors[0]), peer, op))
        return work

    def recv_anysource(self, tensors, tag=0):
        """``dist.recv``/``irecv`` without ``src``: receives from whichever rank's send to this
        rank reached the coordinator first; ``Work._source_rank()`` tells which, once done."""
        return self._point_to_point(_RECV_ANY, tensors, -1)

    def _probe_timeout_ms(self) -> int:
        """How long an any-source recv waits for a sender: the group's timeout less a margin, so
        that the probe's own error ("no rank sent to rank r within N ms") comes before the
        stream's watchdog and a waiter's generic timeout (and the group stays usable)."""
        seconds = self.timeout.total_seconds()
        return max(1, int((seconds - min(1.0, seconds / 4)) * 1000))

    def _flush_p2p(self) -> None:
        """Submit every queued send/recv as one NCCL group (one task on the stream).

        Any-source recvs in the batch: every other send and recv of the batch is issued first,
        as one NCCL group on a helper thread (its sends may be what the peers wait for, as the
        peers' sends are what this rank waits for); then, one at a time, the coordinator is
        asked which rank has a send to this rank waiting (``Comm.probe_source``) and the recv
        from that rank is issued."""
        with self._lock:
            pending, self._pending_p2p = self._pending_p2p, []
            if not pending:
                return
            comm = self.comm
            probe_timeout_ms = self._probe_timeout_ms()
            join_timeout_s = self.timeout.total_seconds()

            def issue(ops, enqueued: Optional[threading.Event] = None) -> None:
                try:
                    with library().group():
                        try:
                            for kind, item, peer, _ in ops:
                                buf = buffer_of(item.buffer, reducing=False)
                                if kind == "send":
                                    comm.send(item.buffer, buf.count, buf.dtype, peer)
                                else:
                                    comm.recv(item.buffer, buf.count, buf.dtype, peer)
                        finally:
                            if enqueued is not None:
                                enqueued.set()   # the calls hold their match numbers now
                except NcclError as exc:
                    raise call_error("send/recv", self.comm_name, exc) from exc

            def run_any_source() -> None:
                fixed = [entry for entry in pending if entry[0] != _RECV_ANY]
                helper, failure = None, []
                if fixed:
                    enqueued = threading.Event()

                    def issue_fixed():
                        try:
                            issue(fixed, enqueued)
                        except BaseException as exc:  # re-raised by the stream's task below
                            failure.append(exc)
                            enqueued.set()

                    helper = threading.Thread(target=issue_fixed, daemon=True,
                                              name=f"fakegpu-p2p-{self.comm_name}")
                    helper.start()
                    # Before probing: the probe tells the coordinator which recvs this rank
                    # posted, so the group's recvs must have their match numbers first.
                    enqueued.wait()
                try:
                    for kind, item, _, op in pending:
                        if kind != _RECV_ANY or failure:
                            continue
                        try:
                            peer = comm.probe_source(probe_timeout_ms)
                        except NcclError as exc:
                            raise call_error(_RECV_ANY, self.comm_name, exc) from exc
                        op.source_rank = peer
                        issue([("recv", item, peer, op)])
                finally:
                    if helper is not None:
                        helper.join(join_timeout_s)
                        if helper.is_alive():
                            failure.append(backend_error(
                                f"fakegpu: send/recv on process group {self.comm_name!r}: the sends and "
                                f"recvs issued with a recv from any source did not complete within "
                                f"{join_timeout_s * 1000:.0f} ms"))
                if failure:
                    raise failure[0]

            def run():
                if any(kind == _RECV_ANY for kind, *_ in pending):
                    run_any_source()
                else:
                    issue(pending)
                for kind, item, _, _ in pending:
                    if kind != "send":
                        item.commit()

            what = "send/recv" if all(kind != _RECV_ANY for kind, *_ in pending) else "send/recv (any source)"
            self._stream.submit(Task(what, run, [op for *_, op in pending]))

    # -- groups from groups ------------------------------------------------------------------------
    def split_group(self, ranks, timeout=None, opts=None, group_name=None, group_desc=None,
                    device_types=None):
        """ncclCommSplit-based subgroup (called collectively by every rank of this group).

        ``ranks`` are ranks of this group forming the caller's new group; ranks outside it get
        None.  See :func:`fakegpu.torch.split_group` for the ``dist.split_group`` equivalent.
        """
        ranks, name, desc = self._next_split(ranks, group_name, group_desc)
        member = self.rank() in ranks
        new_comm = None

        def body(comm):
            nonlocal new_comm
            new_comm = comm.split(ranks[0] if member else SPLIT_NOCOLOR, self.rank(), name=desc)

        self._run("split_group", body, []).wait()
        if not member or new_comm is None:
            return None
        store = dist.PrefixStore(f"{name}/", self._store)
        return FakeGpuProcessGroup(store, ranks.index(self.rank()), len(ranks), timeout,
                                   comm=new_comm, group_name=name, group_desc=desc)

    # -- life cycle -----------------------------------------------------------------------------
    def shutdown(self) -> None:
        self._release(abort=False)

    def abort(self) -> None:
        self._release(abort=True)

    def _release(self, *, abort: bool) -> None:
        with self._lock:
            self._closed = True
            if not abort:
                self._flush_p2p()
            stream, comm, self._comm = self._stream_, self._comm, None
        idle = True
        if stream is not None:
            # Let what was issued finish (bounded by the group's timeout), then stop the thread.
            idle = abort or stream.drain(self.timeout.total_seconds())
            stream.close()
            idle = idle and stream.broken is None
        if comm is not None and idle:
            # A stream still inside a call (timed out, or aborted) keeps its communicator:
            # destroying it under that call is not safe.
            try:
                comm.abort() if abort else comm.destroy()
            except NcclError:
                pass  # the coordinator may already be gone at interpreter exit


def create_fakegpu_process_group(store, rank: int, world_size: int, timeout=None):
    """The creator registered with ``dist.Backend.register_backend``."""
    return FakeGpuProcessGroup(store, rank, world_size, timeout)
