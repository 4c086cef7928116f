"""What rank workers run.  Each scenario is ``fn(ctx, **params) -> picklable result``.

Scenarios only drive the library and report what came back; the test process computes the
expected values (tests/helpers/data.py), except for the huge payloads, which are checked here
so that 64 MiB buffers never travel through pickles.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Optional

import numpy as np

from fakegpu.nccl import Comm, DataType, Nccl, NcclError, RedOp, SPLIT_NOCOLOR

from . import data

SCENARIOS: dict[str, Callable[..., Any]] = {}


def scenario(fn: Callable[..., Any]) -> Callable[..., Any]:
    SCENARIOS[fn.__name__] = fn
    return fn


class RankContext:
    """What a scenario can use: the library, this rank's world communicator, a way to agree
    on further unique ids (rank 0 of the world creates them and publishes them in a file)."""

    def __init__(self, nccl: Nccl, comm: Comm, rank: int, nranks: int, exchange: Callable):
        self.nccl = nccl
        self.comm = comm
        self.rank = rank
        self.nranks = nranks
        self._exchange = exchange

    def shared_unique_id(self, tag: str) -> bytes:
        return self._exchange(tag)

    def barrier(self) -> None:
        token = np.zeros(1, dtype=np.int32)
        self.comm.all_reduce(token, token, 1, DataType.int32, RedOp.sum)


def _error_info(exc: NcclError) -> dict:
    return {"result": exc.result, "name": exc.name, "message": str(exc)}


# --------------------------------------------------------------------------------------------
# The collective matrix
# --------------------------------------------------------------------------------------------

def _make_op(comm: Comm, dtype: DataType, reduction: str) -> tuple[int, Optional[np.ndarray]]:
    code = data.reduction_op_code(reduction)
    if code is not None:
        return code, None
    scalar = data.premul_scalar(dtype)
    if reduction == "premul_host":
        return comm.create_premul_sum(scalar, dtype), None
    storage = np.array([data.PREMUL_DEVICE_INITIAL], dtype=dtype.numpy_dtype)
    op = comm.create_premul_sum(storage, dtype, device_scalar=True)
    storage[0] = scalar  # must be what the collective uses: device scalars are read late
    return op, storage


def run_collective(comm: Comm, rank: int, nranks: int, *, kind: str, dtype: int, count: int,
                   reduction: str = "sum", root: int = 0, inplace: bool = False,
                   seed: int = 0) -> dict:
    """Run one call; return the output buffer (and the send buffer, to check it was not touched)."""
    dtype = DataType(dtype)
    n = nranks
    send_count = {"all_reduce": count, "broadcast": count, "bcast": count, "reduce": count,
                  "all_gather": count,
                  "reduce_scatter": n * count, "all_to_all": n * count, "gather": count,
                  "scatter": n * count, "send_recv": count}[kind]
    recv_count = {"all_reduce": count, "broadcast": count, "bcast": count, "reduce": count,
                  "all_gather": n * count, "reduce_scatter": count, "all_to_all": n * count,
                  "gather": n * count, "scatter": count, "send_recv": count}[kind]
    send = data.make_input(seed, rank, dtype, send_count, reduction)
    send_before = send.copy()
    recv = data.sentinel(dtype, recv_count)
    op, keep = (None, None)
    if kind in ("all_reduce", "reduce", "reduce_scatter"):
        op, keep = _make_op(comm, dtype, reduction)

    if inplace:
        # NCCL's in-place layouts: the caller's own block inside the bigger buffer.
        if kind in ("all_reduce", "broadcast", "reduce"):
            recv = send
        elif kind == "all_gather":
            recv[rank * count:(rank + 1) * count] = send
            send = recv[rank * count:(rank + 1) * count]
        elif kind == "reduce_scatter":
            recv = send[rank * count:(rank + 1) * count]
        elif kind == "gather":
            if rank == root:
                recv[rank * count:(rank + 1) * count] = send
                send = recv[rank * count:(rank + 1) * count]
        elif kind == "scatter":
            if rank == root:
                recv = send[rank * count:(rank + 1) * count]
        else:
            raise ValueError(f"{kind} has no in-place form")

    try:
        if kind == "all_reduce":
            comm.all_reduce(send, recv, count, dtype, op)
        elif kind == "broadcast":
            comm.broadcast(send, recv, count, dtype, root)
        elif kind == "bcast":
            # ncclBcast works in place: the root's buffer holds its input, the others' a fill
            buf = send if rank == root else recv
            comm.bcast(buf, count, dtype, root)
            recv = buf
        elif kind == "reduce":
            comm.reduce(send, recv, count, dtype, op, root)
        elif kind == "all_gather":
            comm.all_gather(send, recv, count, dtype)
        elif kind == "reduce_scatter":
            comm.reduce_scatter(send, recv, count, dtype, op)
        elif kind == "all_to_all":
            comm.all_to_all(send, recv, count, dtype)
        elif kind == "gather":
            comm.gather(send, recv, count, dtype, root)
        elif kind == "scatter":
            comm.scatter(send, recv, count, dtype, root)
        elif kind == "send_recv":
            # A ring: everyone sends to the next rank and receives from the previous one.
            with comm.nccl.group():
                comm.send(send, count, dtype, (rank + 1) % n)
                comm.recv(recv, count, dtype, (rank - 1) % n)
        else:
            raise ValueError(f"unknown collective {kind!r}")
    finally:
        if op is not None and op >= 5:
            comm.destroy_op(op)
    result = {"out": np.array(recv, copy=True)}
    if not inplace:
        result["send_unchanged"] = data.same_bits(send, send_before)
    return result


@scenario
def collective(ctx: RankContext, **params: Any) -> dict:
    return run_collective(ctx.comm, ctx.rank, ctx.nranks, **params)


def expected_collective(nranks: int, rank: int, *, kind: str, dtype: int, count: int,
                        reduction: str = "sum", root: int = 0, inplace: bool = False,
                        seed: int = 0) -> np.ndarray:
    """What rank ``rank`` must hold after :func:`run_collective` with the same parameters."""
    dtype = DataType(dtype)
    n = nranks
    per_rank = {"reduce_scatter": n * count, "all_to_all": n * count, "scatter": n * count}
    send_count = per_rank.get(kind, count)
    inputs = [data.make_input(seed, r, dtype, send_count, reduction) for r in range(n)]
    if kind == "all_reduce":
        return data.reduce_arrays(inputs, dtype, reduction)
    if kind in ("broadcast", "bcast"):
        return inputs[root]
    if kind == "reduce":
        if rank == root:
            return data.reduce_arrays(inputs, dtype, reduction)
        return inputs[rank] if inplace else data.sentinel(dtype, count)
    if kind == "all_gather":
        return np.concatenate(inputs)
    if kind == "reduce_scatter":
        return data.reduce_arrays(inputs, dtype, reduction)[rank * count:(rank + 1) * count]
    if kind == "all_to_all":
        return np.concatenate([inputs[j][rank * count:(rank + 1) * count] for j in range(n)])
    if kind == "gather":
        if rank == root:
            return np.concatenate(inputs)
        return data.sentinel(dtype, n * count)
    if kind == "scatter":
        return inputs[root][rank * count:(rank + 1) * count]
    if kind == "send_recv":
        return inputs[(rank - 1) % n]
    raise ValueError(kind)


# --------------------------------------------------------------------------------------------
# Groups, splits, point-to-point patterns
# --------------------------------------------------------------------------------------------

GROUP_KINDS = ("all_reduce", "broadcast", "all_gather", "reduce_scatter", "all_to_all")


def group_plan(n_calls: int, nranks: int) -> list[dict]:
    """The calls of one big group: varied kinds, datatypes and sizes, all known in advance."""
    plan = []
    dtypes = list(DataType)
    for i in range(n_calls):
        kind = GROUP_KINDS[i % len(GROUP_KINDS)]
        plan.append({"kind": kind, "dtype": int(dtypes[i % len(dtypes)]), "count": 1 + (i * 7) % 61,
                     "reduction": "sum", "root": i % nranks, "seed": 1000 + i})
    return plan


@scenario
def big_group(ctx: RankContext, n_calls: int = 120, nested: bool = True,
              span_split: bool = True) -> dict:
    """``n_calls`` collectives issued inside one (nested) group, optionally spread over the
    world communicator and a split of it; outputs are checked by the test."""
    plan = group_plan(n_calls, ctx.nranks)
    sub = ctx.comm.split(0, ctx.rank) if span_split else None  # a same-size second communicator
    outputs: list[np.ndarray] = []
    inputs: list[np.ndarray] = []  # kept alive until the group ends
    ctx.nccl.group_start()
    try:
        if nested:
            ctx.nccl.group_start()
        for i, call in enumerate(plan):
            comm = sub if (sub is not None and i % 2) else ctx.comm
            dtype = DataType(call["dtype"])
            n, count, rank = ctx.nranks, call["count"], ctx.rank
            kind = call["kind"]
            send_count = n * count if kind in ("reduce_scatter", "all_to_all") else count
            recv_count = n * count if kind in ("all_gather", "all_to_all") else count
            send = data.make_input(call["seed"], rank, dtype, send_count, "sum")
            recv = data.sentinel(dtype, recv_count)
            outputs.append(recv)
            inputs.append(send)
            if kind == "all_reduce":
                comm.all_reduce(send, recv, count, dtype, RedOp.sum)
            elif kind == "broadcast":
                comm.broadcast(send, recv, count, dtype, call["root"])
            elif kind == "all_gather":
                comm.all_gather(send, recv, count, dtype)
            elif kind == "reduce_scatter":
                comm.reduce_scatter(send, recv, count, dtype, RedOp.sum)
            elif kind == "all_to_all":
                comm.all_to_all(send, recv, count, dtype)
        if nested:
            ctx.nccl.group_end()
            # Nothing may have run yet: the outer group is still open.
            untouched = all(data.same_bits(b, data.sentinel(DataType.from_numpy(b.dtype), b.size))
                            for b in outputs)
        else:
            untouched = True
    finally:
        ctx.nccl.group_end()
    if sub is not None:
        sub.destroy()
    return {"outs": outputs, "deferred": untouched}


@scenario
def split(ctx: RankContext, nocolor_rank: Optional[int] = None) -> dict:
    """Colour = rank parity, key = -rank (so ranks come out reversed); one rank may opt out."""
    color = ctx.rank % 2
    if nocolor_rank is not None and ctx.rank == nocolor_rank:
        color = SPLIT_NOCOLOR
    sub = ctx.comm.split(color, -ctx.rank, name=f"parity-{color}")
    if sub is None:
        return {"none": True}
    value = np.array([ctx.rank + 1, 10 * (ctx.rank + 1)], dtype=np.int64)
    total = np.zeros(2, dtype=np.int64)
    sub.all_reduce(value, total, 2, DataType.int64, RedOp.sum)
    gathered = np.zeros(sub.size, dtype=np.int32)
    sub.all_gather(np.array([ctx.rank], dtype=np.int32), gathered, 1, DataType.int32)
    info = {"none": False, "rank": sub.rank, "size": sub.size, "sum": total,
            "members": gathered}
    sub.destroy()
    return info


@scenario
def pair_sendrecv(ctx: RankContext, count: int = 1000, rounds: int = 3) -> dict:
    """Ranks 0 and 1 exchange ``rounds`` times while the others stay out of it entirely."""
    got = []
    if ctx.rank in (0, 1):
        peer = 1 - ctx.rank
        for i in range(rounds):
            mine = data.make_input(500 + i, ctx.rank, DataType.float32, count)
            theirs = np.zeros(count, dtype=np.float32)
            with ctx.nccl.group():
                ctx.comm.send(mine, count, DataType.float32, peer)
                ctx.comm.recv(theirs, count, DataType.float32, peer)
            got.append(theirs)
    ctx.barrier()  # the communicator still works for everyone afterwards
    return {"got": got}


def uneven_counts(nranks: int, sender: int, receiver: int) -> int:
    """How many elements ``sender`` sends ``receiver`` in the uneven all-to-all (zeros included)."""
    return (3 * sender + 5 * receiver + 1) % 4 * 37 % 97 if (sender + receiver) % 3 else 0


@scenario
def uneven_alltoall(ctx: RankContext, dtype: int = int(DataType.float32)) -> dict:
    """An all-to-all-v from grouped Send/Recv (self included, some counts zero)."""
    dtype = DataType(dtype)
    n, rank = ctx.nranks, ctx.rank
    sends = [data.make_input(700 + j, rank, dtype, uneven_counts(n, rank, j)) for j in range(n)]
    recvs = [data.sentinel(dtype, uneven_counts(n, j, rank)) for j in range(n)]
    with ctx.nccl.group():
        for j in range(n):
            ctx.comm.send(sends[j], sends[j].size, dtype, j)
            ctx.comm.recv(recvs[j], recvs[j].size, dtype, j)
    return {"recvs": recvs}


# --------------------------------------------------------------------------------------------
# Large payloads (checked in the worker)
# --------------------------------------------------------------------------------------------

def _large_input(rank: int, count: int) -> np.ndarray:
    # Small integers in float32: every sum is exact, so the reference is cheap and unambiguous.
    values = np.arange(count, dtype=np.int64)
    return ((values * (rank + 3) + rank) % 251).astype(np.float32)


@scenario
def large_allreduce(ctx: RankContext, nbytes: int = 64 << 20, inplace: bool = False) -> dict:
    count = nbytes // 4
    send = _large_input(ctx.rank, count)
    recv = send if inplace else np.empty(count, dtype=np.float32)
    start = time.perf_counter()
    ctx.comm.all_reduce(send, recv, count, DataType.float32, RedOp.sum)
    elapsed = time.perf_counter() - start
    expected = np.zeros(count, dtype=np.float32)
    for r in range(ctx.nranks):
        expected += _large_input(r, count)
    wrong = int(np.count_nonzero(recv != expected))
    return {"wrong": wrong, "seconds": elapsed}


@scenario
def large_mixed_group(ctx: RankContext, nbytes: int = 64 << 20) -> dict:
    """A group mixing a big all-gather, a big send/recv ring and a small allreduce: more than
    the staging regions hold, so it goes out in several partial GROUP frames."""
    n, rank = ctx.nranks, ctx.rank
    per_rank = nbytes // 4 // n
    gather_in = _large_input(rank, per_rank)
    gather_out = np.empty(n * per_rank, dtype=np.float32)
    ring_in = _large_input(rank + 7, per_rank)
    ring_out = np.empty(per_rank, dtype=np.float32)
    small_in = np.array([rank + 1], dtype=np.int32)
    small_out = np.zeros(1, dtype=np.int32)
    with ctx.nccl.group():
        ctx.comm.all_gather(gather_in, gather_out, per_rank, DataType.float32)
        ctx.comm.send(ring_in, per_rank, DataType.float32, (rank + 1) % n)
        ctx.comm.recv(ring_out, per_rank, DataType.float32, (rank - 1) % n)
        ctx.comm.all_reduce(small_in, small_out, 1, DataType.int32, RedOp.sum)
    wrong = int(np.count_nonzero(gather_out != np.concatenate(
        [_large_input(r, per_rank) for r in range(n)])))
    wrong += int(np.count_nonzero(ring_out != _large_input((rank - 1) % n + 7, per_rank)))
    wrong += int(small_out[0] != n * (n + 1) // 2)
    return {"wrong": wrong}


# --------------------------------------------------------------------------------------------
# Errors: a bad call fails alone and the communicator keeps working
# --------------------------------------------------------------------------------------------

def _attempt(fn: Callable[[], Any]) -> Optional[dict]:
    try:
        fn()
    except NcclError as exc:
        return _error_info(exc)
    return None


def _check_alive(ctx: RankContext) -> bool:
    value = np.array([ctx.rank + 1], dtype=np.int64)
    out = np.zeros(1, dtype=np.int64)
    ctx.comm.all_reduce(value, out, 1, DataType.int64, RedOp.sum)
    return int(out[0]) == ctx.nranks * (ctx.nranks + 1) // 2


@scenario
def argument_errors(ctx: RankContext) -> dict:
    """Each entry: the error of one bad call (made by every rank), then whether an allreduce
    right after it still gives the right answer."""
    comm, n, rank = ctx.comm, ctx.nranks, ctx.rank
    buf = np.zeros(8, dtype=np.float32)
    out = np.zeros(8 * n, dtype=np.float32)
    cases: dict[str, Callable[[], Any]] = {
        "bad_datatype": lambda: comm.all_reduce(buf, buf, 8, 12, RedOp.sum),
        "bad_redop": lambda: comm.all_reduce(buf, buf, 8, DataType.float32, 99),
        "root_out_of_range": lambda: comm.broadcast(buf, buf, 8, DataType.float32, n),
        "negative_root": lambda: comm.reduce(buf, buf, 8, DataType.float32, RedOp.sum, -1),
        "peer_out_of_range": lambda: comm.send(buf, 8, DataType.float32, n + 3),
        "null_buffer": lambda: comm.all_gather(0, out, 8, DataType.float32),
        "destroyed_premul": lambda: _use_destroyed_premul(comm, buf),
        "count_mismatch": lambda: comm.all_reduce(buf, buf, 4 + (rank % 2), DataType.float32,
                                                  RedOp.sum),
        "dtype_mismatch": lambda: comm.all_reduce(
            buf, buf, 2, DataType.float32 if rank % 2 else DataType.int32, RedOp.sum),
    }
    results = {}
    for name, call in cases.items():
        results[name] = {"error": _attempt(call), "alive": _check_alive(ctx),
                         "last_error": ctx.nccl.last_error(comm)}
    return results


def _use_destroyed_premul(comm: Comm, buf: np.ndarray) -> None:
    op = comm.create_premul_sum(2.0, DataType.float32)
    comm.destroy_op(op)
    comm.all_reduce(buf, buf, 8, DataType.float32, op)


# --------------------------------------------------------------------------------------------
# Communicator life cycle variants
# --------------------------------------------------------------------------------------------

@scenario
def nonblocking_init(ctx: RankContext) -> dict:
    """CommInitRankConfig with blocking=0: InProgress until every rank has joined."""
    uid = ctx.shared_unique_id("nonblocking")
    comm = ctx.nccl.comm_init_rank(ctx.nranks, uid, ctx.rank, name="nonblocking", blocking=False)
    first_state = comm.get_async_error()
    comm.wait_ready(timeout_s=60)
    out = np.zeros(1, dtype=np.int32)
    comm.all_reduce(np.array([ctx.rank], dtype=np.int32), out, 1, DataType.int32, RedOp.sum)
    info = {"first_state": first_state, "rank": comm.rank, "size": comm.size, "sum": int(out[0])}
    comm.finalize()
    comm.destroy()
    return info


@scenario
def comm_info(ctx: RankContext) -> dict:
    return {"rank": ctx.comm.rank, "size": ctx.comm.size, "device": ctx.comm.device,
            "version": ctx.nccl.version()}


@scenario
def init_all_in_one_process(ctx: RankContext, ndev: int = 3) -> dict:
    """ncclCommInitAll: one process holds every rank; a group drives them all at once."""
    comms = ctx.nccl.comm_init_all(ndev)
    ranks = [c.rank for c in comms]
    sizes = [c.size for c in comms]
    sends = [np.full(5, i + 1, dtype=np.float64) for i in range(ndev)]
    recvs = [np.zeros(5, dtype=np.float64) for _ in range(ndev)]
    with ctx.nccl.group():
        for c, s, r in zip(comms, sends, recvs):
            c.all_reduce(s, r, 5, DataType.float64, RedOp.sum)
    for c in comms:
        c.destroy()
    return {"ranks": ranks, "sizes": sizes, "outs": recvs}


@scenario
def staging_info(ctx: RankContext) -> dict:
    """Whether this process maps a shared-memory staging segment (the shim creates it with
    shm_open and unlinks the name, so it shows in /proc/self/maps as /dev/shm/... (deleted))."""
    with open("/proc/self/maps") as maps:
        segments = sorted({line.split()[-2] if line.rstrip().endswith("(deleted)")
                           else line.split()[-1]
                           for line in maps if "/dev/shm/" in line})
    return {"shm_segments": segments}


@scenario
def mem_alloc_buffers(ctx: RankContext, count: int = 1000) -> dict:
    """Buffers from ncclMemAlloc work like any host buffer, and MemFree releases them."""
    import ctypes

    nbytes = count * 8
    send_ptr, recv_ptr = ctx.nccl.mem_alloc(nbytes), ctx.nccl.mem_alloc(nbytes)
    try:
        send = np.ctypeslib.as_array((ctypes.c_double * count).from_address(send_ptr))
        recv = np.ctypeslib.as_array((ctypes.c_double * count).from_address(recv_ptr))
        send[:] = np.arange(count) * (ctx.rank + 1)
        ctx.comm.all_reduce(send_ptr, recv_ptr, count, DataType.float64, RedOp.sum)
        result = recv.copy()
    finally:
        ctx.nccl.mem_free(send_ptr)
        ctx.nccl.mem_free(recv_ptr)
    return {"out": result}


def per_rank_scalar(dtype: DataType, rank: int) -> float:
    """A different PreMulSum scalar on every rank (NCCL scalars are local to each rank)."""
    return (rank + 1) * 0.5 if dtype.is_float else rank + 2


@scenario
def premul_per_rank(ctx: RankContext, dtype: int, count: int = 53, device: bool = False,
                    kind: str = "all_reduce") -> dict:
    dtype = DataType(dtype)
    n, rank = ctx.nranks, ctx.rank
    send = data.make_input(900, rank, dtype, count * (n if kind == "reduce_scatter" else 1))
    recv = data.sentinel(dtype, count)
    op = ctx.comm.create_premul_sum(per_rank_scalar(dtype, rank), dtype, device_scalar=device)
    try:
        if kind == "all_reduce":
            ctx.comm.all_reduce(send, recv, count, dtype, op)
        elif kind == "reduce_scatter":
            ctx.comm.reduce_scatter(send, recv, count, dtype, op)
        else:
            ctx.comm.reduce(send, recv, count, dtype, op, n - 1)
    finally:
        ctx.comm.destroy_op(op)
    return {"out": recv}


@scenario
def peer_aborts(ctx: RankContext, victim: int = 1) -> dict:
    """On a fresh communicator, ``victim`` calls ncclCommAbort while the others start an
    allreduce: they must get an error (naming the problem) instead of waiting forever."""
    uid = ctx.shared_unique_id(f"abort-{victim}")
    comm = ctx.nccl.comm_init_rank(ctx.nranks, uid, ctx.rank)
    if ctx.rank == victim:
        comm.abort()
        return {"aborted": True}
    buf = np.ones(16, dtype=np.float32)
    start = time.monotonic()
    try:
        comm.all_reduce(buf, buf, 16, DataType.float32, RedOp.sum)
        error = None
    except NcclError as exc:
        error = _error_info(exc)
    elapsed = time.monotonic() - start
    comm.destroy()
    return {"aborted": False, "error": error, "seconds": elapsed}


@scenario
def rank_dies(ctx: RankContext, victim: int = 1) -> dict:
    """``victim`` exits abruptly; the others' next collective must fail (not hang)."""
    import os

    if ctx.rank == victim:
        os._exit(7)
    buf = np.ones(4, dtype=np.float32)
    start = time.monotonic()
    try:
        ctx.comm.all_reduce(buf, buf, 4, DataType.float32, RedOp.sum)
        error = None
    except NcclError as exc:
        error = _error_info(exc)
    return {"error": error, "seconds": time.monotonic() - start}


# --------------------------------------------------------------------------------------------
# Host-local collectives (arenas)
# --------------------------------------------------------------------------------------------

@scenario
def grouped_on_some_ranks(ctx: RankContext, count: int = 1000) -> dict:
    """The same two allreduces (world communicator, then a duplicate of it), issued one by one
    on even ranks and as one group on odd ranks: legal NCCL, and the arenas must hand both
    calls to the coordinator instead of waiting for ranks that never come."""
    dup = ctx.comm.split(0, ctx.rank)
    a = np.full(count, ctx.rank + 1, dtype=np.float32)
    b = np.full(count, 10 * (ctx.rank + 1), dtype=np.float64)
    if ctx.rank % 2 == 0:
        ctx.comm.all_reduce(a, a, count, DataType.float32, RedOp.sum)
        dup.all_reduce(b, b, count, DataType.float64, RedOp.sum)
    else:
        with ctx.nccl.group():
            ctx.comm.all_reduce(a, a, count, DataType.float32, RedOp.sum)
            dup.all_reduce(b, b, count, DataType.float64, RedOp.sum)
    # And after that, calls one by one on every rank still work.
    c = np.arange(count, dtype=np.int32) * (ctx.rank + 1)
    ctx.comm.all_reduce(c, c, count, DataType.int32, RedOp.sum)
    dup.destroy()
    return {"a": a, "b": b, "c": c}


@scenario
def missing_rank(ctx: RankContext, absent: int = 1, hold_s: float = 5.0) -> dict:
    """Every rank but ``absent`` starts an allreduce on a fresh communicator; ``absent`` stays
    away for ``hold_s`` seconds: the others get ncclTimeout, with the coordinator's message."""
    uid = ctx.shared_unique_id(f"missing-{absent}")
    comm = ctx.nccl.comm_init_rank(ctx.nranks, uid, ctx.rank)
    error = None
    start = time.monotonic()
    if ctx.rank != absent:
        buf = np.ones(8, dtype=np.float32)
        try:
            comm.all_reduce(buf, buf, 8, DataType.float32, RedOp.sum)
        except NcclError as exc:
            error = _error_info(exc)
    else:
        time.sleep(hold_s)
    elapsed = time.monotonic() - start
    comm.abort()
    return {"error": error, "seconds": elapsed}


@scenario
def barrier_timeline(ctx: RankContext, rounds: int = 2, jitter_s: float = 0.02) -> dict:
    """A program whose modeled timeline must not depend on arrival order: pairs {0, 1}, {2, 3}
    each allreduce on their own communicator (the first pair a much larger payload), then a world
    barrier, a world allreduce and a grouped exchange with the partner rank. Every rank sleeps a
    random moment before each call, so the order in which calls reach the coordinator (and in
    which arenas report theirs) differs from run to run."""
    import random

    rng = random.Random()   # seeded from the OS: a different interleaving every run
    pair = ctx.comm.split(ctx.rank // 2, ctx.rank, name=f"pair-{ctx.rank // 2}")
    partner = ctx.rank ^ 1
    for _ in range(rounds):
        count = 1 << 20 if ctx.rank < 2 else 1 << 10
        buf = np.ones(count, dtype=np.float32)
        time.sleep(rng.random() * jitter_s)
        pair.all_reduce(buf, buf, count, DataType.float32, RedOp.sum)
        time.sleep(rng.random() * jitter_s)
        ctx.barrier()
        world = np.ones(1 << 16, dtype=np.float32)
        time.sleep(rng.random() * jitter_s)
        ctx.comm.all_reduce(world, world, world.size, DataType.float32, RedOp.sum)
        mine = np.full(4096, ctx.rank, dtype=np.float32)
        theirs = np.zeros(4096, dtype=np.float32)
        time.sleep(rng.random() * jitter_s)
        with ctx.nccl.group():
            ctx.comm.send(mine, mine.size, DataType.float32, partner)
            ctx.comm.recv(theirs, theirs.size, DataType.float32, partner)
    pair.destroy()
    return {"partner_value": float(theirs[0])}
