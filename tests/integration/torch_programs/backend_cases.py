"""One rank of a fakegpu-vs-gloo torch.distributed case (tests/integration/test_torch_backend_parity.py).

    python backend_cases.py CASE BACKEND OUTDIR      (RANK, WORLD_SIZE, MASTER_* from the test)

Each case writes what it observed to OUTDIR/rank<R>.json; the test compares backends.
"""
from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist


def _init(backend: str, timeout_s: Optional[float] = None) -> tuple[int, int]:
    """``timeout_s`` None: torch's default group timeout (30 min), under which a fakegpu
    waiter runs queued operations itself; a short one keeps them on the stream's thread."""
    if backend == "fakegpu":
        import fakegpu.torch  # noqa: F401
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s) if timeout_s else None)
    return dist.get_rank(), dist.get_world_size()


def ddp_join(backend):
    """Uneven inputs under DDP join with divide_by_initial_world_size=False: the reducer
    keeps the join all-reduce's Work in C++ and waits on it in backward."""
    rank, world = _init(backend)
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with model.join(divide_by_initial_world_size=False):
        for step in range(2 + 2 * rank):
            torch.manual_seed(100 * rank + step)
            loss = model(torch.randn(5, 4)).square().sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
    return {"params": [p.detach().reshape(-1).tolist() for p in model.parameters()]}


def all_gather_coalesced(backend):
    rank, world = _init(backend)
    out = {}
    for count in sorted({1, 2, 3, world}):
        inputs = [torch.arange(i + 1, dtype=torch.float32) + 10 * rank + 100 * i
                  for i in range(count)]
        outputs = [[torch.empty(i + 1) for i in range(count)] for _ in range(world)]
        dist.all_gather_coalesced(outputs, inputs)
        out[str(count)] = [[t.tolist() for t in per_rank] for per_rank in outputs]
    return out


def barrier_timeout(backend, flag_dir):
    rank, world = _init(backend, timeout_s=2.0)
    done = os.path.join(flag_dir, "rank0_done")
    if rank != 0:
        # Not joining the barrier; stay alive until rank 0 has its answer (or 60 s).
        deadline = time.monotonic() + 60
        while not os.path.exists(done) and time.monotonic() < deadline:
            time.sleep(0.05)
        return {"skipped": True}
    start = time.monotonic()
    try:
        dist.barrier()
        error = None
    except Exception as exc:  # noqa: BLE001 - the error is what is compared
        error = f"{type(exc).__name__}: {exc}"
    elapsed = time.monotonic() - start
    open(done, "w").close()
    return {"error": error, "elapsed": elapsed}


def default_device_and_dcp(backend):
    """_get_pg_default_device, then FSDP2 resuming from rank 0's full state dict."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         set_model_state_dict)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    rank, world = _init(backend)
    device = str(dist.distributed_c10d._get_pg_default_device())
    torch.manual_seed(1)
    reference = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Linear(8, 2))
    expected = {k: v.clone() for k, v in reference.state_dict().items()}
    full = {k: v.clone() for k, v in expected.items()}  # DCP may replace the values in place
    torch.manual_seed(50 + rank)  # a different start on every rank
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Linear(8, 2))
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(model, full if rank == 0 else {}, options=options)
    loaded = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    same = all(torch.equal(loaded[k], expected[k]) for k in expected)
    return {"device": device, "loaded_matches_rank0": bool(same)}


def sparse_all_reduce(backend):
    rank, world = _init(backend)
    indices = torch.tensor([[rank, 1, 3 + rank], [0, rank, 2]])
    values = torch.tensor([1.0 + rank, 2.0, 0.5 * (rank + 1)])
    tensor = torch.sparse_coo_tensor(indices, values, (6, 4))
    dist.all_reduce(tensor)
    return {"dense": tensor.to_dense().tolist()}


def monitored(backend):
    import fakegpu.torch as ft

    rank, world = _init(backend)
    ft.monitored_barrier(timeout=timedelta(seconds=30))
    error = None
    if rank != 1:  # rank 1 never arrives at the second one
        try:
            ft.monitored_barrier(timeout=timedelta(seconds=2), wait_all_ranks=True)
        except Exception as exc:  # noqa: BLE001
            error = str(exc)
    dist.barrier()
    return {"error": error}


def monitored_like_gloo(backend):
    """monitored_barrier's outcomes on three ranks, each case on a group of its own: everyone
    arrives; rank 1 never arrives (rank 0 names it, rank 2 hears that rank 0 failed); rank 0
    alone with a zero timeout. ``fakegpu.torch.monitored_barrier`` is torch's own on a gloo
    group, so both backends run the same calls."""
    import re

    import fakegpu.torch as ft

    rank, world = _init(backend)
    phrases = ("failed to pass monitoredBarrier", "successfully reached monitoredBarrier",
               "timed out in monitoredBarrier", r"Ranks? [\d, ]+(?= failed)", r"after \d+ ms")

    def outcome(call):
        try:
            call()
            return None
        except Exception as exc:  # noqa: BLE001
            text = str(exc)
            return sorted({m.group(0) for p in phrases for m in re.finditer(p, text)})

    groups = [dist.new_group(list(range(world))) for _ in range(3)]
    out = {"all": outcome(lambda: ft.monitored_barrier(groups[0], timedelta(seconds=10)))}
    out["rank_1_absent"] = (None if rank == 1 else
                            outcome(lambda: ft.monitored_barrier(groups[1], timedelta(seconds=1))))
    out["zero_timeout"] = (outcome(lambda: ft.monitored_barrier(groups[2], timedelta(seconds=0)))
                           if rank == 0 else None)
    dist.barrier()
    return out


def async_order(backend):
    """async_op=True returns before the peer has even issued the call; several async
    operations complete in issue order; futures carry the results."""
    rank, world = _init(backend, timeout_s=60)
    store = dist.distributed_c10d._get_default_store()
    if rank != 0:
        store.wait(["go"], timedelta(seconds=60))
    first = torch.full((4,), float(rank + 1))
    second = torch.full((1000,), float(rank))
    w1 = dist.all_reduce(first, async_op=True)
    w2 = dist.all_reduce(second, async_op=True)
    early = [w1.is_completed(), w2.is_completed()]
    if rank == 0:
        store.set("go", "1")
    fut = w2.get_future()
    w1.wait()
    value = fut.wait()[0]
    w2.wait()
    return {"completed_before_peer": early, "first": first.tolist(),
            "second_sum": float(value.sum()), "completed_after": [w1.is_completed(),
                                                                  w2.is_completed()]}


def cpp_held_works(backend):
    """Works only torch's C++ side holds (functional collectives: the Python Work is gone
    before wait_tensor), including a failing one, and a C++ future DDP-style."""
    import gc

    import torch.distributed._functional_collectives as funcol

    rank, world = _init(backend)
    group = dist.group.WORLD
    out = funcol.all_reduce(torch.full((3,), float(rank + 1)), "sum", group)
    gc.collect()
    value = funcol.wait_tensor(out).tolist()
    error = None
    try:  # counts differ between ranks: the coordinator fails the call on every rank
        bad = funcol.all_reduce(torch.ones(2 + rank), "sum", group)
        gc.collect()
        funcol.wait_tensor(bad)
    except Exception as exc:  # noqa: BLE001
        error = str(exc)
    after = torch.ones(2)
    dist.all_reduce(after)  # the group is still usable
    return {"value": value, "error": error, "after": after.tolist()}


def init_time(backend):
    """Seconds in init_process_group once every rank is there (a store barrier first, so
    the time is the backend's own, not the ranks' different start-up times)."""
    if backend == "fakegpu":
        import fakegpu.torch  # noqa: F401
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                          rank == 0, timeout=timedelta(seconds=60))
    store.add("arrived", 1)
    while int(store.add("arrived", 0)) < world:
        time.sleep(0.001)
    start = time.perf_counter()
    dist.init_process_group(backend, store=store, rank=rank, world_size=world)
    init = time.perf_counter() - start
    dist.barrier()
    return {"init_s": init, "init_and_barrier_s": time.perf_counter() - start}


def sum_order(backend):
    """A float32 SUM of random data: the result, and how it relates to the sum in rank order
    (((x0 + x1) + x2) + ...) and to the exactly rounded sum."""
    rank, world = _init(backend)
    n = 20000

    def data(r):
        return torch.randn(n, generator=torch.Generator().manual_seed(1000 + r))

    tensor = data(rank)
    dist.all_reduce(tensor)
    in_order = data(0)
    for r in range(1, world):
        in_order = in_order + data(r)
    exact = sum(data(r).double() for r in range(world)).float()
    return {"result": tensor.tolist() if rank == 0 else None,
            "equal_rank_order": float((tensor == in_order).double().mean()),
            "equal_exactly_rounded": float((tensor == exact).double().mean())}


def recv_any_source(backend):
    """Ranks 1..n-1 send to rank 0, which receives without naming a source: dist.recv (two
    float sends per sender), then irecv posted n-1 times before any wait (one int64 send each)."""
    rank, world = _init(backend)
    out = {}
    if rank == 0:
        got = []
        for _ in range(2 * (world - 1)):
            t = torch.empty(3)
            src = dist.recv(t)
            got.append([src, t.tolist()])
        out["recv"] = got
    else:
        for k in range(2):
            dist.send(torch.tensor([float(rank), float(k), 10.0 * rank + k]), dst=0)
    dist.barrier()  # the int64 sends must not meet the float recvs
    if rank == 0:
        bufs = [torch.empty(2, dtype=torch.int64) for _ in range(world - 1)]
        works = [dist.irecv(t) for t in bufs]
        for w in works:
            w.wait()
        out["irecv"] = [[w._source_rank(), t.tolist()] for w, t in zip(works, bufs)]
    else:
        dist.send(torch.tensor([rank, -100 * rank]), dst=0)
    dist.barrier()
    return out


def recv_any_source_exchange(backend):
    """A ring where every rank receives from any source and sends to the next rank: irecv
    posted before the isend, then isend before the irecv (a rank that must send before it can
    receive, as its predecessor does)."""
    rank, world = _init(backend)
    nxt = (rank + 1) % world
    out = {}
    for name, recv_first in (("recv_first", True), ("send_first", False)):
        got = torch.empty(2)
        payload = torch.tensor([float(rank), 1000.0 + rank])
        if recv_first:
            works = [dist.irecv(got), dist.isend(payload, nxt)]
            recv_work = works[0]
        else:
            works = [dist.isend(payload, nxt), dist.irecv(got)]
            recv_work = works[1]
        for w in works:
            w.wait()
        out[name] = [recv_work._source_rank(), got.tolist()]
    return out


def recv_any_source_timeout(backend, flag_dir):
    """Nobody sends: rank 0's recv without a source fails after the group's timeout; then
    every rank runs an all_reduce (is the group still usable?)."""
    rank, world = _init(backend, timeout_s=4.0)
    done = os.path.join(flag_dir, "rank0_done")
    out = {}
    if rank == 0:
        start = time.monotonic()
        try:
            src = dist.recv(torch.empty(2))
            out["error"] = None
            out["src"] = src
        except Exception as exc:  # noqa: BLE001 - the error is what is compared
            out["error"] = f"{type(exc).__name__}: {exc}"
        out["elapsed"] = time.monotonic() - start
        open(done, "w").close()
    else:
        deadline = time.monotonic() + 60
        while not os.path.exists(done) and time.monotonic() < deadline:
            time.sleep(0.05)
    t = torch.ones(1)
    try:
        dist.all_reduce(t)
        out["after"] = t.tolist()
    except Exception as exc:  # noqa: BLE001
        out["after"] = f"{type(exc).__name__}: {exc}"
    return out


_FLAG_DIR_CASES = ("barrier_timeout", "recv_any_source_timeout")


def _blocking_calls(backend, timeout_s):
    rank, world = _init(backend, timeout_s=timeout_s)
    ran_now = []
    if backend == "fakegpu":
        from fakegpu.torch import work

        original = work.Stream.run_now

        def counting(self, what, call, *args):
            ran = original(self, what, call, *args)
            ran_now.append([what, ran])
            return ran

        work.Stream.run_now = counting
    out = {}
    a = torch.arange(6, dtype=torch.float32) * (rank + 1)
    dist.all_reduce(a)
    out["sum"] = a.tolist()
    queued = torch.full((1000,), float(rank))
    w = dist.all_reduce(queued, async_op=True)
    # Issued behind a queued call: it must not overtake it (a different size and dtype, so an
    # overtaking call would pair with the wrong one at the peer).
    c = torch.full((3,), float(rank + 1), dtype=torch.float64)
    dist.all_reduce(c, op=dist.ReduceOp.MAX)
    w.wait()
    out["queued_sum"], out["max"] = float(queued.sum()), c.tolist()
    b = torch.arange(4, dtype=torch.int64) + 10 * rank
    dist.broadcast(b, src=world - 1)
    out["broadcast"] = b.tolist()
    gathered = torch.empty(3 * world, dtype=torch.bfloat16)
    dist.all_gather_into_tensor(gathered, (torch.arange(3) + rank).to(torch.bfloat16))
    out["all_gather"] = gathered.float().tolist()
    scattered = torch.empty(2)
    dist.reduce_scatter_tensor(scattered, torch.arange(2.0 * world) * (rank + 1))
    out["reduce_scatter"] = scattered.tolist()
    half = torch.tensor([0.1, 0.2, 0.3], dtype=torch.float16) * (rank + 1)
    dist.all_reduce(half)
    out["half"] = half.float().tolist()
    strided = (torch.arange(12.0).reshape(3, 4) + rank).t()  # not contiguous: the queued path
    dist.all_reduce(strided)
    out["strided"] = strided.tolist()
    flags = torch.tensor([rank == 0, False, True])
    dist.all_reduce(flags)  # bool: the queued path's any()
    out["bool"] = flags.tolist()
    out["ran_now"] = sorted({what for what, ran in ran_now if ran})
    return out


def blocking_calls(backend):
    """Blocking collectives between asynchronous ones, with the group's default timeout:
    results and issue order as gloo's; under fakegpu the ones that find the stream idle run
    on the caller's thread (fakegpu.torch.now)."""
    return _blocking_calls(backend, None)


def blocking_calls_short_timeout(backend):
    """The same with a group timeout shorter than the coordinator's: nothing runs on the
    caller's thread (only the stream's watchdog can keep that timeout)."""
    return _blocking_calls(backend, 60)


def main() -> int:
    case, backend, outdir = sys.argv[1], sys.argv[2], sys.argv[3]
    fn = globals()[case]
    result = fn(backend, outdir) if case in _FLAG_DIR_CASES else fn(backend)
    rank = int(os.environ["RANK"])
    with open(os.path.join(outdir, f"rank{rank}.json"), "w") as fh:
        json.dump(result, fh)
    sys.stdout.flush()
    if case in _FLAG_DIR_CASES:
        os._exit(0)  # a timed-out group cannot be torn down cleanly (as with gloo)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
