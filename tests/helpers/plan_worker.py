"""A persistent rank for call-plan tests: ``python plan_worker.py RUN_DIR RANK NRANKS``.

Joins a world communicator (rank 0 publishes the unique id as a file), then runs the plans
RUN_DIR/plan-K.pkl for K = 0, 1, ... as they appear, all on that one communicator, so a call
that leaves the ranks out of step shows up in every later plan. For each plan it writes
RUN_DIR/result-K-RANK.pkl: per call ("ok", output array) or ("error", ncclResult_t). It stops
at RUN_DIR/stop, or when no plan comes for IDLE_S seconds.

A plan is a list of calls (dicts, see helpers/call_plans.py); ``call_plans.rank_call`` gives
the arguments this rank passes, including the bad ones a plan asks some ranks to pass.
"""
from __future__ import annotations

import os
import pickle
import sys
import time
from pathlib import Path

_HERE = Path(__file__).resolve()
sys.path[:0] = [str(_HERE.parents[2]), str(_HERE.parents[1])]

from fakegpu.nccl import Nccl, NcclError  # noqa: E402

from helpers.call_plans import rank_call  # noqa: E402

IDLE_S = 300.0


def run_call(comm, nccl: Nccl, rank: int, nranks: int, call: dict):
    a = rank_call(call, rank, nranks)
    send, out = a["send"], a["out"]
    sendbuf = 0 if a["null_send"] else send
    kind = a["kind"]
    if kind == "all_reduce":
        comm.all_reduce(sendbuf, out, a["count"], a["dtype"], a["op"])
    elif kind == "broadcast":
        comm.broadcast(sendbuf if rank == a["root"] else send, out, a["count"], a["dtype"], a["root"])
    elif kind == "reduce":
        comm.reduce(sendbuf, out, a["count"], a["dtype"], a["op"], a["root"])
    elif kind == "all_gather":
        comm.all_gather(sendbuf, out, a["count"], a["dtype"])
    elif kind == "reduce_scatter":
        comm.reduce_scatter(sendbuf, out, a["count"], a["dtype"], a["op"])
    elif kind == "ring":  # Send to rank+1 and Recv from rank-1 in one group
        # Both calls are made whatever the first returns, as a C program that checks the result
        # of ncclGroupEnd would: a Send rejected here must not keep this rank's Recv from its peer.
        errors = []
        nccl.group_start()
        for issue in (lambda: comm.send(sendbuf, a["count"], a["dtype"], (rank + 1) % nranks),
                      lambda: comm.recv(out, a["count"], a["dtype"], (rank - 1) % nranks)):
            try:
                issue()
            except NcclError as exc:
                errors.append(exc)
        try:
            nccl.group_end()
        except NcclError as exc:
            errors.append(exc)
        if errors:
            raise errors[0]
    else:
        raise ValueError(f"unknown kind {kind!r}")
    return out


def main(argv: list[str]) -> int:
    run_dir, rank, nranks = Path(argv[0]), int(argv[1]), int(argv[2])
    nccl = Nccl()
    uid = nccl.shared_unique_id(run_dir / "uid", rank, 120)
    comm = nccl.comm_init_rank(nranks, uid, rank, name="plan-world")
    k = 0
    idle_since = time.monotonic()
    while not (run_dir / "stop").exists():
        plan_path = run_dir / f"plan-{k}.pkl"
        if not plan_path.exists():
            if time.monotonic() - idle_since > IDLE_S:
                print(f"rank {rank}: no plan {k} within {IDLE_S} s, stopping", file=sys.stderr)
                return 1
            time.sleep(0.005)
            continue
        plan = pickle.loads(plan_path.read_bytes())
        results = []
        for i, call in enumerate(plan):
            print(f"rank {rank}: plan {k} call {i} {call}", file=sys.stderr, flush=True)
            try:
                results.append(("ok", run_call(comm, nccl, rank, nranks, call)))
            except NcclError as exc:
                results.append(("error", exc.result))
        tmp = run_dir / f".result-{k}-{rank}.tmp"
        tmp.write_bytes(pickle.dumps(results, protocol=pickle.HIGHEST_PROTOCOL))
        os.replace(tmp, run_dir / f"result-{k}-{rank}.pkl")
        k += 1
        idle_since = time.monotonic()
    comm.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
