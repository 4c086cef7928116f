"""Run float reductions on real torch + gloo (CPU) ranks and bring back every rank's raw
result, to hold tests/helpers/gloo_order.py's model to gloo bit for bit.

``run_gloo(world, cases)`` starts ``world`` processes of this file (a fresh interpreter each,
torch's device-backend autoload off so fakegpu's entry point stays out), each generates its own
inputs with ``case_inputs`` and runs every case; the parent reads the results back.
A case is a dict: coll (all_reduce | all_reduce_coalesced | reduce | reduce_scatter_tensor |
reduce_scatter), op (sum | prod | max | min), dtype (float32 | float64 | float16 | bfloat16),
count (elements per rank; for the reduce-scatters the input's), data (wide | near1 | randn |
nan), seed, root (reduce), sizes (all_reduce_coalesced and coalescing: the tensors' sizes),
group (global ranks of a new_group to run in, with sort_ranks; the others return None),
async (async_op=True, then wait), coalescing (all_reduce of each piece inside
dist._coalescing_manager). GLOO_ORDER_PROBE_DEVICES / _THREADS set the process group's number
of gloo devices (contexts) and worker threads.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List

import numpy as np

_STRIPPED = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
             "MASTER_PORT", "LD_PRELOAD", "TORCHELASTIC_RESTART_COUNT")


def np_dtype(name: str) -> np.dtype:
    if name == "bfloat16":
        import ml_dtypes
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def case_inputs(case: Dict, rank: int) -> np.ndarray:
    """Rank ``rank``'s input: values whose sums depend strongly on the association (a wide
    spread of magnitudes), or products of values near 1."""
    rng = np.random.default_rng([int(case["seed"]), rank])
    n = int(case["count"])
    dt = np_dtype(case["dtype"])
    kind = case.get("data", "wide")
    if kind == "nan":  # a few NaNs among wide values, for max / min
        x = rng.standard_normal(n, dtype=np.float32)
        x[rng.random(n) < 0.2] = np.nan
    elif kind == "near1":
        x = 1.0 + 0.05 * rng.standard_normal(n, dtype=np.float32)
    elif kind == "randn":
        x = rng.standard_normal(n, dtype=np.float32)
    else:
        span = 6 if dt.itemsize == 2 else 12
        x = rng.standard_normal(n, dtype=np.float32) * np.exp2(
            rng.integers(-span, span + 1, n).astype(np.float32))
    if dt == np.float64:
        x = x.astype(np.float64) * (1.0 + 1e-9 * rng.standard_normal(n))  # use the low bits too
    return x.astype(dt)


def _worker(outdir: str) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    pg_options = None
    if os.environ.get("GLOO_ORDER_PROBE_DEVICES") or os.environ.get("GLOO_ORDER_PROBE_THREADS"):
        pg_options = dist.ProcessGroupGloo._Options()
        ndev = int(os.environ.get("GLOO_ORDER_PROBE_DEVICES", "1"))
        pg_options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")
                               for _ in range(ndev)]
        pg_options._threads = int(os.environ.get("GLOO_ORDER_PROBE_THREADS", "2"))
    # GLOO_ORDER_PROBE_BACKEND=fakegpu runs the same cases through fakegpu's torch backend (the
    # caller passes the coordinator's environment): tests/test_reduction_order.py.
    backend = os.environ.get("GLOO_ORDER_PROBE_BACKEND", "gloo")
    if backend == "fakegpu":
        import fakegpu.torch  # noqa: F401 (registers the backend)
    dist.init_process_group(backend, rank=rank, world_size=world,
                            **({"pg_options": pg_options} if pg_options is not None else {}))
    cases = json.loads(Path(outdir, "cases.json").read_text())
    ops = {"sum": dist.ReduceOp.SUM, "prod": dist.ReduceOp.PRODUCT,
           "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN, "avg": dist.ReduceOp.AVG}
    timing = {}
    for case in cases:
        group = None
        if case.get("group"):
            group = dist.new_group(case["group"], sort_ranks=case.get("sort_ranks", True))
            if rank not in case["group"]:
                dist.barrier()
                continue
        grank = dist.get_rank(group) if group is not None else rank
        gworld = dist.get_world_size(group) if group is not None else world
        x = case_inputs(case, grank)
        tdt = getattr(torch, case["dtype"])
        # ml_dtypes' bfloat16 has no torch twin for from_numpy: go through the raw bits
        t = torch.from_numpy(x.view(np.int16) if x.itemsize == 2 else x).view(tdt).clone()
        op = ops[case["op"]]
        coll = case["coll"]
        err = None
        t0 = time.perf_counter()
        try:
            if coll == "all_reduce" and case.get("coalescing"):
                parts = [p.clone() for p in torch.split(t, case["coalescing"])]
                with dist._coalescing_manager(group=group):
                    for p in parts:
                        dist.all_reduce(p, op=op, group=group)
                out = torch.cat(parts)
            elif coll == "all_reduce":
                work = dist.all_reduce(t, op=op, group=group, async_op=bool(case.get("async")))
                if case.get("async"):
                    work.wait()
                out = t
            elif coll == "all_reduce_coalesced":
                parts = list(torch.split(t, case["sizes"]))
                parts = [p.clone() for p in parts]
                dist.all_reduce_coalesced(parts, op=op, group=group)
                out = torch.cat(parts)
            elif coll == "reduce":
                dist.reduce(t, group_dst=int(case.get("root", 0)), op=op, group=group)
                out = t
            elif coll == "reduce_scatter_tensor":
                out = torch.empty(t.numel() // gworld, dtype=tdt)
                dist.reduce_scatter_tensor(out, t, op=op, group=group)
            elif coll == "reduce_scatter":
                out = torch.empty(t.numel() // gworld, dtype=tdt)
                dist.reduce_scatter(out, list(t.chunk(gworld)), op=op, group=group)
            else:
                raise ValueError(coll)
        except Exception as e:  # recorded: some collectives are not supported by gloo
            err = f"{type(e).__name__}: {e}"
            out = None
        timing[case["id"]] = time.perf_counter() - t0
        base = Path(outdir, f"{case['id']}.{grank}")
        if err is not None:
            base.with_suffix(base.suffix + ".err").write_text(err)
        else:
            raw = out.contiguous().view(torch.int16 if out.element_size() == 2 else
                                        {4: torch.int32, 8: torch.int64}[out.element_size()])
            raw.numpy().tofile(str(base) + ".bin")
        dist.barrier()
    Path(outdir, f"timing.{rank}.json").write_text(json.dumps(timing))
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_gloo(world: int, cases: List[Dict], timeout_s: float = 300.0,
             extra_env: Dict[str, str] = None) -> Dict[str, List]:
    """{case id: [rank 0's result, ...]}: a numpy array in the case's dtype, or the error
    text where the collective raised; for a case in a group, one entry per group rank. Raises RuntimeError (with the logs) on a crash or hang."""
    outdir = Path(tempfile.mkdtemp(prefix="gloo-order-"))
    for i, case in enumerate(cases):
        case.setdefault("id", f"c{i}")
    Path(outdir, "cases.json").write_text(json.dumps(cases))
    env = {k: v for k, v in os.environ.items() if k not in _STRIPPED and not k.startswith("FAKEGPU_")}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), WORLD_SIZE=str(world),
               OMP_NUM_THREADS="1", TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    env.update(extra_env or {})
    procs = []
    try:
        for rank in range(world):
            log = open(outdir / f"rank{rank}.log", "w")
            procs.append(subprocess.Popen(
                [sys.executable, __file__, str(outdir)], env={**env, "RANK": str(rank)},
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL))
            log.close()
        deadline = time.monotonic() + timeout_s
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            time.sleep(0.05)
        bad = [r for r, p in enumerate(procs) if p.poll() != 0]
        if bad:
            logs = "\n".join(f"--- rank {r}\n" + (outdir / f"rank{r}.log").read_text()[-3000:]
                             for r in bad)
            raise RuntimeError(f"gloo ranks {bad} failed or hung:\n{logs}")
        results: Dict[str, List] = {}
        for case in cases:
            per_rank = []
            for r in range(len(case["group"]) if case.get("group") else world):
                base = outdir / f"{case['id']}.{r}"
                err = Path(str(base) + ".err")
                if err.exists():
                    per_rank.append(err.read_text())
                else:
                    raw = np.fromfile(str(base) + ".bin", dtype=np.dtype(f"i{np_dtype(case['dtype']).itemsize}"))
                    per_rank.append(raw.view(np_dtype(case["dtype"])))
            results[case["id"]] = per_rank
        timing = [json.loads((outdir / f"timing.{r}.json").read_text()) for r in range(world)]
        results["_timing"] = timing
        return results
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for f in outdir.iterdir():
            f.unlink()
        outdir.rmdir()


if __name__ == "__main__":
    _worker(sys.argv[1])
