"""``FakeWorldProcessGroup``: a torch.distributed process group for a fake world.

``world_size`` is the logical world (NGPU), ``rank`` the logical rank this process plays.
Every collective among fake ranks completes at once, locally, with the SPMD-symmetric
meaning of fakegpu.fake.semantics (every member holds what this rank holds); every
operation is accounted for the whole logical world (fakegpu.fake.runtime).  In
``real_pp_fake_spmd`` mode a communicator whose members are *all* played by physical
processes (the pipeline's send/recv group) runs for real over a gloo group among those
processes; everything else stays local.

Registered as backend ``"fakegpu_fake"`` (``register()``); use :func:`init_process_group`
(or ``dist.init_process_group("fakegpu_fake", rank=..., world_size=NGPU, store=...)``).
The store never waits for absent ranks: nothing is read from it in pure fake mode.
"""
from __future__ import annotations

import atexit
import os
import weakref
from datetime import timedelta
from typing import Optional, Sequence

import ml_dtypes
import numpy as np
import torch
import torch.distributed as dist

from fakegpu.torch._types import reduction_of
from fakegpu.torch.group_base import GroupBase, reduce_op_of
from fakegpu.torch.work import finished_work

from . import contract as _contract
from . import runtime, semantics

BACKEND_NAME = "fakegpu_fake"
_OPS = dist.ReduceOp.RedOpType

_NP_VIEW = {
    torch.bfloat16: (torch.int16, ml_dtypes.bfloat16),
    torch.bool: (torch.uint8, np.uint8),
}
for _name, _np in (("float8_e4m3fn", ml_dtypes.float8_e4m3fn), ("float8_e5m2", ml_dtypes.float8_e5m2)):
    if hasattr(torch, _name):
        _NP_VIEW[getattr(torch, _name)] = (torch.uint8, _np)


def as_numpy(tensor: torch.Tensor) -> np.ndarray:
    """A flat numpy view sharing memory with a contiguous CPU tensor (complex as real pairs)."""
    t = tensor.detach()
    t = torch.view_as_real(t) if t.is_complex() else t
    t = t.reshape(-1)
    via = _NP_VIEW.get(t.dtype)
    if via is not None:
        return t.view(via[0]).numpy().view(via[1])
    return t.numpy()


def _dtype_name(array: np.ndarray) -> str:
    dt = semantics.dtype_of(array)
    return dt.name if dt is not None else str(array.dtype)


def plain(tensor: torch.Tensor) -> torch.Tensor:
    """The plain tensor holding a tensor subclass's data.

    torch.distributed's Python API hands Python process groups the caller's tensor as is,
    which may be an AsyncCollectiveTensor (functional collectives' lazy result, a wrapper
    with no storage of its own): waiting on it yields the tensor that owns the data."""
    if type(tensor) is torch.Tensor or type(tensor) is torch.nn.Parameter:
        return tensor
    wait = getattr(tensor, "trigger_wait", None)
    if callable(wait):
        return plain(wait())
    raise TypeError(f"fakegpu_fake: cannot take the data of a {type(tensor).__name__} directly; "
                    f"pass its local tensor")


# Callables told of every collective a fake-world group runs: (kind, members, element size,
# count, communicator name, tensors). fgpu plan records a script's collectives through it.
COLLECTIVE_OBSERVERS: list = []


class _Buf:
    """A contiguous plain stand-in for a tensor; ``set()`` writes a result back into it."""

    def __init__(self, tensor: torch.Tensor):
        tensor = plain(tensor)
        if tensor.device.type != "cpu":
            raise ValueError(f"fakegpu_fake works on CPU tensors, got one on {tensor.device}")
        self.tensor = tensor
        self.buffer = tensor if tensor.is_contiguous() else tensor.contiguous()
        self.np = as_numpy(self.buffer)

    def set(self, values: np.ndarray) -> None:
        np.copyto(self.np, np.asarray(values).reshape(-1)[: self.np.size].astype(self.np.dtype, copy=False))
        if self.buffer.data_ptr() != self.tensor.data_ptr():
            with torch.no_grad():
                self.tensor.copy_(self.buffer)


_BITWISE = (_OPS.BAND, _OPS.BOR, _OPS.BXOR)


def _reduction(reduce_op, tensor: torch.Tensor) -> tuple[str, Optional[float]]:
    """The fake reduction of ``reduce_op`` on ``tensor``: the real backend's translation
    (fakegpu.torch._types.reduction_of, so both refuse the same ops), named for
    fakegpu.fake.semantics; ("premulsum", factor) for PreMulSum."""
    op = getattr(reduce_op, "op", reduce_op)
    if op in _BITWISE and not tensor.is_floating_point() and not tensor.is_complex():
        # NCCL has none, but with identical operands they are known: x & x = x | x = x, and
        # x ^ x ^ ... is x for an odd count, 0 for an even one.
        return ("bxor" if op == _OPS.BXOR else "max"), None
    reduction = reduction_of(reduce_op, tensor.dtype)
    if reduction.premul_factor is not None:
        return "premulsum", reduction.premul_factor
    return reduction.op.name, None


class FakeWorldProcessGroup(GroupBase):
    """One communicator of a fake world, as seen by the rank this process plays."""

    BACKEND_NAME = BACKEND_NAME
    UNNAMED_COMM = "fakegpu_fake_group"

    def __init__(self, store, rank: int, size: int, timeout: Optional[timedelta] = None, *,
                 global_ranks: Optional[Sequence[int]] = None, group_name: str = "",
                 group_desc: str = "", world: Optional[runtime.FakeWorld] = None):
        super().__init__(rank, size, group_name=group_name, group_desc=group_desc)
        self._store = store
        self._timeout = timeout or timedelta(minutes=5)
        self._members: Optional[tuple[int, ...]] = tuple(int(g) for g in global_ranks) if global_ranks else None
        self._world = world or runtime.get_or_create()
        self._real = None          # gloo group among physical members, made on first use
        self._real_checked = False
        if self._members is not None and len(self._members) != size:
            raise ValueError(f"fakegpu_fake: {len(self._members)} global ranks for a group of size {size}")

    # -- identity (the rest is GroupBase's) ---------------------------------------------------
    @property
    def members(self) -> tuple[int, ...]:
        """Global logical rank of each member (index = rank in this group)."""
        if self._members is None:
            # A creator without the extended API does not learn the ranks; torch records
            # them once the group is registered.
            mapping = dist.distributed_c10d._world.pg_group_ranks.get(self)
            if mapping:
                ordered = sorted(mapping.items(), key=lambda kv: kv[1])
                self._members = tuple(g for g, _ in ordered)
            elif self.size() == self._world.contract.world_size:
                self._members = tuple(range(self.size()))
            else:
                raise RuntimeError(f"fakegpu_fake: cannot tell which global ranks form group "
                                   f"{self.comm_name!r}; register the backend with register()")
        return self._members

    def __repr__(self) -> str:
        return f"<FakeWorldProcessGroup {self.comm_name!r} rank {self.rank()}/{self.size()}>"

    # -- real sub-worlds (hybrid mode) ------------------------------------------------------------
    def _real_group(self):
        """The real group among this group's members if all are physical, else None."""
        if not self._real_checked:
            self._real_checked = True
            lc = self._world.contract
            members = self.members
            if len(members) > 1 and lc.physical_world_size > 1 and all(lc.is_physical(m) for m in members):
                store = self._world.store
                if store is None:
                    raise RuntimeError("fakegpu_fake: a communicator of physical ranks needs the store "
                                       "the processes share; initialise with fakegpu.fake.init_process_group()")
                generation = _real_generations.get(members, 0)
                _real_generations[members] = generation + 1
                prefix = f"fakegpu_real/{'_'.join(map(str, members))}/{generation}/"
                self._real = _real_transport(dist.PrefixStore(prefix, store), self.rank(), self.size(),
                                             self._timeout, self.comm_name)
                _groups_with_real_transport.add(self)
        return self._real

    # -- accounting -------------------------------------------------------------------------------
    def _account(self, kind: str, tensor_np: np.ndarray, count: int, *, redop=None,
                 root: int = -1, peer: int = -1, tensors: Sequence[torch.Tensor] = ()) -> None:
        self._world.comm_op(self.comm_name, self.members, self.rank(), kind, _dtype_name(tensor_np),
                            tensor_np.dtype.itemsize, count, redop=redop, root=root, peer=peer)
        for observe in COLLECTIVE_OBSERVERS:   # fgpu plan's recorder (fakegpu.plan.generic)
            observe(kind, tuple(self.members), int(tensor_np.dtype.itemsize), int(count), self.comm_name,
                    tuple(tensors), group_name=self._group_name)

    def _reduce_local(self, buf: _Buf, reduce_op, values: Optional[np.ndarray] = None) -> np.ndarray:
        redop, scale = _reduction(reduce_op, buf.tensor)
        x = buf.np if values is None else values
        if redop == "bxor":
            return x.copy() if self.size() % 2 else np.zeros_like(x)
        return semantics.reduce_symmetric(x, self.size(), redop, scale)

    # -- all-reduce -------------------------------------------------------------------------------
    def _real_reduction(self, reduce_op, inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor],
                        issue, opts_type) -> None:
        """Run a reduction on the real (gloo) group: AVG and PREMUL_SUM, which gloo lacks,
        become a SUM with the scaling done here, as NCCL would compute them."""
        op = getattr(reduce_op, "op", reduce_op)
        o = opts_type()
        o.reduceOp = dist.ReduceOp.SUM if op in (_OPS.AVG, _OPS.PREMUL_SUM) else reduce_op
        if op == _OPS.PREMUL_SUM:
            factor = reduce_op.factor
            factor = factor.item() if isinstance(factor, torch.Tensor) else float(factor)
            inputs = [t * factor for t in inputs]
        issue(list(inputs), o).wait()
        if op == _OPS.AVG:
            n = self.size()
            for t in outputs:
                if t.is_floating_point() or t.is_complex():
                    t.div_(n)
                else:
                    t.copy_(torch.div(t, n, rounding_mode="trunc"))

    def allreduce(self, tensors, opts=None):
        reduce_op = reduce_op_of(opts)
        real = self._real_group()
        for t in tensors:
            b = _Buf(t)
            redop, _ = _reduction(reduce_op, t)
            self._account("AllReduce", b.np, b.np.size, redop=redop, tensors=(t,))
            if real is None:
                b.set(self._reduce_local(b, reduce_op))
                continue
            result = []

            def issue(inputs, o, buf=b.buffer):
                if inputs[0] is not buf:     # PREMUL_SUM scaled a copy; reduce it, then keep it
                    result.append(inputs[0])
                    return real.allreduce(inputs, o)
                return real.allreduce([buf], o)

            self._real_reduction(reduce_op, [b.buffer], [b.buffer], issue, dist.AllreduceOptions)
            with torch.no_grad():
                if result:
                    b.buffer.copy_(result[0])
                if b.buffer.data_ptr() != b.tensor.data_ptr():
                    b.tensor.copy_(b.buffer)
        return finished_work(tensors)

    def allreduce_coalesced(self, tensors, opts=None):
        for t in tensors:
            self.allreduce([t], opts)
        return finished_work(tensors)

    # -- broadcast / reduce -----------------------------------------------------------------------
    def broadcast(self, tensors, opts=None):
        root = opts.rootRank if opts is not None else 0
        t = tensors[opts.rootTensor if opts is not None else 0]
        b = _Buf(t)
        self._account("Broadcast", b.np, b.np.size, root=root, tensors=(t,))
        real = self._real_group()
        if real is not None:
            o = dist.BroadcastOptions()
            o.rootRank = root
            real.broadcast([b.buffer], o).wait()
            if b.buffer.data_ptr() != b.tensor.data_ptr():
                with torch.no_grad():
                    b.tensor.copy_(b.buffer)
        return finished_work(tensors)   # fake: the root held what we hold

    def reduce(self, tensors, opts=None):
        root = opts.rootRank if opts is not None else 0
        t = tensors[opts.rootTensor if opts is not None else 0]
        b = _Buf(t)
        reduce_op = reduce_op_of(opts)
        redop, _ = _reduction(reduce_op, t)
        self._account("Reduce", b.np, b.np.size, redop=redop, root=root)
        real = self._real_group()
        if real is not None:
            return real.reduce(tensors, opts)
        if self.rank() == root:
            b.set(self._reduce_local(b, reduce_op))
        return finished_work(tensors)

    # -- all-gather -------------------------------------------------------------------------------
    def allgather(self, output_tensors, input_tensors, opts=None):
        self._check_lists("allgather", output_tensors, input_tensors)
        real = self._real_group()
        for outs, inp in zip(output_tensors, input_tensors):
            src = _Buf(inp)
            self._account("AllGather", src.np, src.np.size, tensors=(inp, *outs))
            if real is None:
                for out in outs:
                    if out.numel() != inp.numel():
                        raise ValueError("fakegpu_fake allgather: output and input sizes differ")
                    _Buf(out).set(src.np)
        if real is not None:
            return real.allgather(output_tensors, input_tensors)
        return finished_work([t for outs in output_tensors for t in outs])

    def _allgather_pairs(self, what: str, pairs):
        real = self._real_group()
        outs = []
        for output, input_ in pairs:
            src = _Buf(input_)
            self._account("AllGather", src.np, src.np.size, tensors=(input_, output))
            out = _Buf(output)
            if real is not None:
                real._allgather_base(out.buffer, src.buffer).wait()
                if out.buffer.data_ptr() != out.tensor.data_ptr():
                    with torch.no_grad():
                        out.tensor.copy_(out.buffer)
            else:
                out.set(semantics.all_gather(src.np, self.size()))
            outs.append(output)
        return finished_work(outs)

    # -- reduce-scatter ---------------------------------------------------------------------------
    def _reduce_scatter_pairs(self, what: str, pairs, reduce_op):
        real = self._real_group()
        outs = []
        for output, input_ in pairs:
            out, src = _Buf(output), _Buf(input_)
            redop, _ = _reduction(reduce_op, output)
            self._account("ReduceScatter", out.np, out.np.size, redop=redop, tensors=(input_, output))
            if real is not None:
                self._real_reduction(reduce_op, [src.buffer], [out.buffer],
                                     lambda ins, o: real._reduce_scatter_base(out.buffer, ins[0], o),
                                     dist.ReduceScatterOptions)
                if out.buffer.data_ptr() != out.tensor.data_ptr():
                    with torch.no_grad():
                        out.tensor.copy_(out.buffer)
            else:
                c = out.np.size
                share = src.np[self.rank() * c:(self.rank() + 1) * c]
                out.set(self._reduce_local(out, reduce_op, values=share))
            outs.append(output)
        return finished_work(outs)

    def reduce_scatter(self, output_tensors, input_lists, opts=None):
        self._check_lists("reduce_scatter", input_lists, output_tensors)
        inputs = [torch.cat([b.reshape(-1) for b in blocks]).to(out.dtype)
                  for out, blocks in zip(output_tensors, input_lists)]
        return self._reduce_scatter_as("reduce_scatter", output_tensors, inputs, opts)

    # -- all-to-all -------------------------------------------------------------------------------
    def _all_to_all_single(self, what: str, output, input_, output_splits, input_splits):
        n = self.size()
        out, src = _Buf(output), _Buf(input_)
        per_rank = src.np.size // n if src.np.size % n == 0 else max(src.np.size // n, 1)
        self._account("AlltoAll", src.np, per_rank, tensors=(input_, output))
        real = self._real_group()
        if real is not None:
            return real.alltoall_base(output, input_, list(output_splits), list(input_splits))
        if not output_splits and not input_splits:
            out.set(semantics.all_to_all(src.np, n, self.rank()))
        else:
            rows = input_.shape[0] if input_.dim() else 1
            row = src.np.size // rows if rows else 1
            ins = list(input_splits) or [input_.shape[0] // n] * n
            outs = list(output_splits) or [output.shape[0] // n] * n
            out.set(semantics.all_to_all(src.np, n, self.rank(), ins, outs, row=row))
        return finished_work([output])

    def alltoall(self, output_tensors, input_tensors, opts=None):
        self._check_alltoall_lists(output_tensors, input_tensors)
        mine = _Buf(input_tensors[self.rank()])
        self._account("AlltoAll", mine.np, mine.np.size)
        real = self._real_group()
        if real is not None:
            return real.alltoall(output_tensors, input_tensors)
        for out in output_tensors:   # rank j sends us its block r, which equals ours
            ob = _Buf(out)
            values = np.zeros(ob.np.size, dtype=ob.np.dtype)
            k = min(values.size, mine.np.size)
            values[:k] = mine.np[:k]
            ob.set(values)
        return finished_work(output_tensors)

    # -- gather / scatter -------------------------------------------------------------------------
    def gather(self, output_tensors, input_tensors, opts=None):
        root = opts.rootRank if opts is not None else 0
        src = _Buf(input_tensors[0])
        self._account("Gather", src.np, src.np.size, root=root)
        real = self._real_group()
        if real is not None:
            return real.gather(output_tensors, input_tensors, opts)
        if self.rank() == root:
            for out in output_tensors[0]:
                _Buf(out).set(src.np)
        return finished_work([t for outs in output_tensors for t in outs])

    def scatter(self, output_tensors, input_tensors, opts=None):
        root = opts.rootRank if opts is not None else 0
        out = _Buf(output_tensors[0])
        self._account("Scatter", out.np, out.np.size, root=root)
        real = self._real_group()
        if real is not None:
            return real.scatter(output_tensors, input_tensors, opts)
        if self.rank() == root and input_tensors and input_tensors[0]:
            out.set(_Buf(input_tensors[0][self.rank()]).np)
        else:
            out.set(np.zeros(out.np.size, dtype=out.np.dtype))
        return finished_work(output_tensors)

    # -- barrier ----------------------------------------------------------------------------------
    def barrier(self, opts=None):
        # ProcessGroupNCCL's barrier is a one-element all-reduce; account it the same way.
        token = torch.zeros(1)
        return self.allreduce([token])

    def monitored_barrier(self, timeout=None, wait_all_ranks=False):  # noqa: ARG002
        self.barrier()

    # -- point to point ---------------------------------------------------------------------------
    def _point_to_point(self, kind: str, tensors, peer: int):
        self._check_peer(kind, tensors, peer)
        b = _Buf(tensors[0])
        sending = kind == "send"
        me = self.rank()
        self._account("SendRecv", b.np, b.np.size, root=me if sending else peer, peer=peer if sending else me,
                      tensors=(tensors[0],))
        real = self._real_group()
        if sending:
            if real is not None:
                return real.send([b.buffer], peer, 0)
            _exchange.send(self._exchange_key, me, self.size(), peer, b.np)
            return finished_work(list(tensors))
        if real is not None:
            if b.buffer.data_ptr() != b.tensor.data_ptr():
                real.recv([b.buffer], peer, 0).wait()
                with torch.no_grad():
                    b.tensor.copy_(b.buffer)
                return finished_work(list(tensors))
            return real.recv([b.buffer], peer, 0)
        data, _ = _exchange.recv(self._exchange_key, me, self.size(), peer, b.np.size, b.np.dtype)
        b.set(data)
        return finished_work(list(tensors))

    def recv_anysource(self, tensors, tag=0):
        raise RuntimeError("fakegpu_fake: recv from any source is not supported (NCCL has no "
                           "wildcard receive); pass src=")

    @property
    def _exchange_key(self):
        return (self.members, self.comm_name)

    # -- groups from groups -----------------------------------------------------------------------
    def split_group(self, ranks, timeout=None, opts=None, group_name=None, group_desc=None,
                    device_types=None):
        """The caller's subgroup made of ``ranks`` (ranks of this group), None if not a member.

        Local: in a fake world nobody else takes part in the split."""
        ranks, name, desc = self._next_split(ranks, group_name, group_desc)
        if self.rank() not in ranks:
            return None
        members = [self.members[r] for r in ranks]
        return FakeWorldProcessGroup(self._store, ranks.index(self.rank()), len(ranks), timeout,
                                     global_ranks=members, group_name=name, group_desc=desc,
                                     world=self._world)

    # -- life cycle -------------------------------------------------------------------------------
    def shutdown(self) -> None:
        # Shut the real gloo group down now, while the interpreter is whole: left to the
        # garbage collector at exit, its worker threads can be destroyed still joinable
        # and the process aborts ("terminate called without an active exception").
        self._shut_real_transport()
        if self._is_default():
            self._world.finish()

    def abort(self) -> None:
        self.shutdown()

    def _shut_real_transport(self) -> None:
        real, self._real = self._real, None
        if real is not None:
            real.shutdown()

    def _is_default(self) -> bool:
        return self.size() == self._world.contract.world_size and self.members == tuple(range(self.size()))


def _real_transport(store, rank: int, size: int, timeout, name: str):
    """The process group that carries a communicator of physical ranks for real: gloo,
    torch's own CPU backend (no coordinator runs in the fake modes)."""
    return dist.ProcessGroupGloo(store, rank, size, timeout)


_exchange = semantics.PeerExchange()
_groups_with_real_transport: "weakref.WeakSet[FakeWorldProcessGroup]" = weakref.WeakSet()


@atexit.register
def _shut_real_transports_at_exit() -> None:
    """A script that never calls destroy_process_group still gets its gloo groups shut
    down before interpreter teardown (see FakeWorldProcessGroup.shutdown)."""
    for group in list(_groups_with_real_transport):
        group._shut_real_transport()
_real_generations: dict[tuple[int, ...], int] = {}


def _create(common_opts, backend_opts=None):
    """Backend creator (extended API: learns the group's global ranks)."""
    world = runtime.get_or_create()
    ranks = list(common_opts.global_ranks_in_group or [])
    size = common_opts.group_size
    if not ranks:   # the default group
        if size != world.contract.world_size:
            raise _contract.LaunchContractError(
                f"init_process_group(world_size={size}) but NGPU={world.contract.world_size}: a fake "
                f"world's process group spans the logical world; pass world_size=NGPU")
        if common_opts.group_rank != world.contract.logical_rank:
            raise _contract.LaunchContractError(
                f"init_process_group(rank={common_opts.group_rank}) but the launch contract makes this "
                f"process logical rank {world.contract.logical_rank}; pass rank={world.contract.logical_rank}")
        if world.store is None:
            world.store = common_opts.store
        ranks = list(range(size))
    return FakeWorldProcessGroup(common_opts.store, common_opts.group_rank, size, common_opts.timeout,
                                 global_ranks=ranks, group_name=str(common_opts.group_id or ""),
                                 world=world)


def register() -> str:
    """Register the ``fakegpu_fake`` backend with torch.distributed (idempotent)."""
    if BACKEND_NAME.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND_NAME, _create, extended_api=True, devices=["cpu"])
        from fakegpu.torch.dynamo_skip import skip_fakegpu

        skip_fakegpu()
    return BACKEND_NAME


def _physical_store(env, lc: _contract.LaunchContract, timeout: timedelta):
    """The store the physical processes share, at MASTER_ADDR:MASTER_PORT.

    Under torchrun (``TORCHELASTIC_USE_AGENT_STORE=True``) the agent already serves a TCPStore
    there, so every process is a client, as torch's own ``env://`` rendezvous does; a second
    server on rank 0 would fail to bind (torch then logs an error and carries on).  Keys are
    kept apart per restart attempt, so a restarted job never reads a failed attempt's keys."""
    host, port = env.get("MASTER_ADDR", "127.0.0.1"), int(env.get("MASTER_PORT", "29500"))
    if env.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        store = dist.TCPStore(host, port, lc.physical_world_size, False, timeout=timeout)
        return dist.PrefixStore(f"fakegpu/attempt_{env.get('TORCHELASTIC_RESTART_COUNT', '0')}/", store)
    return dist.TCPStore(host, port, lc.physical_world_size, lc.physical_rank == 0, timeout=timeout)


def init_process_group(*, pp_degree: Optional[int] = None, env=None, timeout: Optional[timedelta] = None,
                       **world_kw) -> runtime.FakeWorld:
    """Read the launch contract, start the fake world and ``dist.init_process_group`` on it.

    Pure fake: a local HashStore (no rank ever waits on it).  Several physical processes:
    a TCPStore among them at MASTER_ADDR:MASTER_PORT (torchrun sets both), used only by the
    communicators whose members are all physical and to hand events to the lead process.
    """
    lc = _contract.resolve(env, pp_degree=pp_degree)
    register()
    world = runtime.get_or_create(lc, **world_kw)
    env = os.environ if env is None else env
    timeout = timeout or timedelta(seconds=float(env.get("FAKEGPU_FAKE_TIMEOUT", "300")))
    if lc.physical_world_size > 1:
        store = _physical_store(env, lc, timeout)
    else:
        store = dist.HashStore()
    world.store = store
    world.accountant   # load the cluster topology now: a config too small for NGPU fails here, not mid-step
    dist.init_process_group(BACKEND_NAME, store=store, rank=lc.logical_rank, world_size=lc.world_size,
                            timeout=timeout)
    return world
