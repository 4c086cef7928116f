"""The numerical worker of the physical-host checks: one torchrun rank per host, communication
through fakegpu's coordinator over TCP (the usage doc's "Physical-host Hybrid DDP check"; run by
verification/run_physical_multihost.py, or by hand on each host with the doc's environment).

    LD_PRELOAD=$PWD/build/libnccl.so.2 python3 -m torch.distributed.run --nnodes=2 --nproc-per-node=1 \\
        --node-rank=$NODE_RANK --master-addr=HOST --master-port=29592 --max-restarts=0 \\
        verification/test_ddp_hybrid_numerics.py --report-dir=/tmp/fakegpu-cross-ddp-rank$NODE_RANK

With a CUDA device (FAKEGPU_MODE=hybrid): CUDA tensors, backend nccl (fakegpu's shim). Without
one: CPU tensors, backend fakegpu, and the first line says so. Cases (--cases, comma-separated):
the numerical cases of verification/gpu/workloads.py (each rank's parameters against a
single-process reference; the default) and two fault cases on a raw NCCL communicator beside torch's:
mismatched_op (ranks disagree on the reduction: every rank must get ncclInvalidUsage naming it)
and missing_peer (the last rank initialises a communicator rank 0 never joins: ncclTimeout after
FAKEGPU_COORDINATOR_TIMEOUT_MS). Writes REPORT_DIR/rank<R>.json and prints it on one line
prefixed "FAKEGPU-RESULT ". Exit status 0 when every case passed on this rank.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE / "gpu"), str(HERE.parent)]

NUMERIC_CASES = ("ddp_all", "fsdp1", "fsdp2_fp32", "fsdp2_fp16", "fsdp2_bf16", "fsdp2_fp16_param",
                 "fsdp2_bf16_param")
FAULT_CASES = ("mismatched_op", "missing_peer")
ALL_CASES = (*NUMERIC_CASES, *FAULT_CASES)
# By hand: the numerics. run_physical_multihost.py adds the fault cases (missing_peer waits one
# whole FAKEGPU_COORDINATOR_TIMEOUT_MS).
DEFAULT_CASES = NUMERIC_CASES
RESULT_PREFIX = "FAKEGPU-RESULT "


def _raw_comm(session: str, case: str, world: int, rank: int):
    """A communicator of fakegpu's shim next to torch's, met through an id every host derives
    from the session (the coordinator matches ranks by it)."""
    from fakegpu.nccl import Nccl

    uid = hashlib.shake_256(f"fakegpu-physical\0{session}\0{case}\0{world}".encode()).digest(128)
    nccl = Nccl()
    return nccl, uid


def mismatched_op(session: str, rank: int, world: int) -> dict:
    import numpy as np
    from fakegpu.nccl import DataType, NcclError, RedOp

    nccl, uid = _raw_comm(session, "mismatched_op", world, rank)
    comm = nccl.comm_init_rank(world, uid, rank)
    buf = np.full(4, rank + 1, dtype=np.float32)
    error = None
    try:
        comm.all_reduce(buf, buf, 4, DataType.float32, RedOp.sum if rank == 0 else RedOp.max)
    except NcclError as exc:
        error = {"name": exc.name, "message": str(exc)}
    after = comm.get_async_error()   # observed and reported, not asserted
    comm.abort()
    ok = bool(error) and error["name"] == "ncclInvalidUsage" and "disagree" in error["message"]
    return {"ok": ok, "error": error, "async_error_after": int(after)}


def missing_peer(session: str, rank: int, world: int) -> dict:
    from fakegpu.nccl import NcclError

    if rank != world - 1:
        # Stay out of every collective (the barrier after this case included) until the waiting
        # rank's init has timed out, or our barrier would time out the same way.
        hold_s = int(os.environ.get("FAKEGPU_COORDINATOR_TIMEOUT_MS", "600000")) / 1000 + 3
        time.sleep(hold_s)
        return {"ok": True, "role": f"absent (never joins; held back {hold_s:g} s)"}
    nccl, uid = _raw_comm(session, "missing_peer", world, rank)
    started = time.monotonic()
    error = None
    try:
        nccl.comm_init_rank(world, uid, rank).abort()
    except NcclError as exc:
        error = {"name": exc.name, "message": str(exc)}
    seconds = time.monotonic() - started
    return {"ok": bool(error) and error["name"] == "ncclTimeout", "role": "waits for rank 0",
            "error": error, "seconds": round(seconds, 2)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--report-dir", required=True, help="where this rank writes rank<R>.json")
    p.add_argument("--cases", default=",".join(DEFAULT_CASES),
                   help=f"comma-separated, in order (default: {','.join(DEFAULT_CASES)})")
    p.add_argument("--session", default=os.environ.get("TORCHELASTIC_RUN_ID", "default"),
                   help="the same on every host (names the fault cases' communicators)")
    args = p.parse_args(argv)
    cases = [c for c in args.cases.split(",") if c]
    unknown = [c for c in cases if c not in ALL_CASES]
    if unknown:
        p.error(f"unknown case(s) {unknown}; choose from {', '.join(ALL_CASES)}")

    import socket

    import torch
    import torch.distributed as dist
    import workloads

    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        backend = "nccl"
    else:
        import fakegpu.torch  # noqa: F401  registers the backend
        device, backend = torch.device("cpu"), "fakegpu"
        torch.set_num_threads(1)
        print("test_ddp_hybrid_numerics: no CUDA device visible to torch: CPU tensors, backend fakegpu "
              "(the CPU form of the hybrid check)", flush=True)
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    results = {}
    for case in cases:
        started = time.monotonic()
        try:
            if case == "mismatched_op":
                result = mismatched_op(args.session, rank, world)
            elif case == "missing_peer":
                result = missing_peer(args.session, rank, world)
            else:
                result = workloads.run_named_case(case, rank, world, device)
        except Exception:
            result = {"ok": False, "error": traceback.format_exc()}
        result["seconds"] = round(time.monotonic() - started, 2)
        results[case] = result
        print(f"rank {rank}: {case}: {'ok' if result['ok'] else 'FAILED'}", flush=True)
        dist.barrier()   # the hosts move to the next case together
    import platform

    doc = {"rank": rank, "world_size": world, "hostname": socket.gethostname(), "device": str(device),
           "backend": backend, "python": platform.python_version(), "torch": torch.__version__,
           "cuda": torch.version.cuda, "ok": all(r["ok"] for r in results.values()), "cases": results}
    out = Path(args.report_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{rank}.json").write_text(json.dumps(doc, indent=1) + "\n")
    print(RESULT_PREFIX + json.dumps(doc), flush=True)
    dist.destroy_process_group()
    return 0 if doc["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
