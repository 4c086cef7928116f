"""Failed calls in the report: each failed call is one failed operation in ``totals`` and one
``op_failed`` event, whoever learns of it and however many steps it has, and ``report check``
holds the report to that. Real coordinator, real shim, real rank processes (this file's
worker: ``python tests/integration/test_report_failures.py worker RUN_DIR RANK NRANKS PLAN``), through the
coordinator path (FAKEGPU_LOCAL_COLLECTIVES=0), where failures are matched."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve()
# Also run as a script (the rank worker), before helpers is importable: the repository and
# tests/ (for helpers) on sys.path.
sys.path[:0] = [str(HERE.parents[2]), str(HERE.parents[1])]


# ----------------------------------------------------------------------------- worker

def worker(run_dir: Path, rank: int, nranks: int, plan: dict) -> int:
    """``plan["calls"]`` float32 sum-allreduces of ``plan["count"]`` elements, carrying on after
    errors. ``die: [rank, call]`` exits that rank before that call; ``max_at: [rank, call]``
    makes that rank ask for max instead of sum; ``p2p_at: call`` makes that call a Send from
    rank 0 of ``count`` elements to rank 1, which receives half as many."""
    import numpy as np

    from fakegpu.nccl import Nccl, NcclError

    nccl = Nccl()
    comm = nccl.comm_init_rank(nranks, nccl.shared_unique_id(run_dir / "uid", rank, 60), rank, name="failures-world")
    count = plan["count"]
    outcomes = []
    for call in range(1, plan["calls"] + 1):
        if plan.get("die") == [rank, call]:
            os._exit(0)
        try:
            if plan.get("p2p_at") == call:
                if rank == 0:
                    comm.send(np.ones(count, dtype=np.float32), count, np.float32, 1)
                elif rank == 1:
                    comm.recv(np.zeros(count // 2, dtype=np.float32), count // 2, np.float32, 0)
                outcomes.append("ok")
                continue
            op = "max" if plan.get("max_at") == [rank, call] else "sum"
            send = np.full(count, rank + call, dtype=np.float32)
            recv = np.zeros(count, dtype=np.float32)
            comm.all_reduce(send, recv, count, np.float32, op)
            exact = bool(np.all(recv == sum(r + call for r in range(nranks))))
            outcomes.append("ok" if exact else "WRONG")
        except NcclError as exc:
            outcomes.append(exc.name)
        if plan.get("pause_s"):
            time.sleep(plan["pause_s"])
    tmp = run_dir / f".result-{rank}.tmp"
    tmp.write_text(json.dumps(outcomes))
    os.replace(tmp, run_dir / f"result-{rank}.json")
    comm.abort()
    return 0


# ----------------------------------------------------------------------------- harness

def _run(library: str, nranks: int, plan: dict, env: dict) -> tuple[dict, dict]:
    from helpers.coordinator import CoordinatorProcess

    run_dir = Path(tempfile.mkdtemp(prefix="fgpu-failures-"))
    report = run_dir / "report.json"
    with CoordinatorProcess("unix", extra_args=("--timeout-ms", "5000", "--report", str(report))) as coord:
        base = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
        base.update(coord.client_env, FAKEGPU_NCCL_LIBRARY=library, FAKEGPU_LOCAL_COLLECTIVES="0", **env)
        base["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE.parents[2]), os.environ.get("PYTHONPATH")]))
        procs = [subprocess.Popen([sys.executable, str(HERE), "worker", str(run_dir), str(r), str(nranks),
                                   json.dumps(plan)], env={**base, "RANK": str(r)}, stdin=subprocess.DEVNULL,
                                  stdout=open(run_dir / f"log-{r}.txt", "w"), stderr=subprocess.STDOUT)
                 for r in range(nranks)]
        for p in procs:
            p.wait(90)
        coord.stop()
    outcomes = {}
    for r in range(nranks):
        path = run_dir / f"result-{r}.json"
        if path.exists():
            outcomes[r] = json.loads(path.read_text())
    done = subprocess.run([sys.executable, "-m", "fakegpu", "report", "check", str(report)],
                          capture_output=True, text=True, timeout=120, cwd=str(HERE.parents[2]))
    assert done.returncode == 0, done.stdout + done.stderr
    return outcomes, json.loads(report.read_text())


def _failed_events(report: dict) -> list:
    return [e for e in report["events"]["items"] if e["event"] == "op_failed"]


# ----------------------------------------------------------------------------- tests

def test_survivors_failed_calls_after_a_rank_died_are_counted_once_each(shim_library):
    outcomes, report = _run(shim_library, 3, {"calls": 5, "count": 256, "die": [2, 3], "pause_s": 0.1}, {})
    assert set(outcomes) == {0, 1}
    for r in (0, 1):
        assert outcomes[r][:2] == ["ok", "ok"] and outcomes[r][2:] == ["ncclRemoteError"] * 3, outcomes[r]
    # Calls 3, 4 and 5 failed: three failed operations (before: the events only), three events.
    assert report["totals"]["failed_operations"] == 3, report["totals"]
    assert len(_failed_events(report)) == 3
    assert report["collectives"]["AllReduce"]["calls"] == 2


def test_a_mismatched_two_step_call_is_one_failed_operation(shim_library):
    # 32768 float32 = 128 KiB in 64 KiB staging: two steps per call.
    outcomes, report = _run(shim_library, 2, {"calls": 4, "count": 32768, "max_at": [1, 2]},
                            {"FAKEGPU_STAGING_CHUNK_BYTES": "64K"})
    for r in (0, 1):
        assert outcomes[r] == ["ok", "ncclInvalidUsage", "ok", "ok"], outcomes[r]
    assert report["totals"]["failed_operations"] == 1, report["totals"]     # before: 2
    (event,) = _failed_events(report)
    assert event["op"] == "AllReduce" and event["result"] == "ncclInvalidUsage"
    assert report["collectives"]["AllReduce"]["calls"] == 3


def test_a_send_recv_disagreement_is_one_failed_operation(shim_library):
    outcomes, report = _run(shim_library, 2, {"calls": 3, "count": 1000, "p2p_at": 2}, {})
    for r in (0, 1):
        assert outcomes[r] == ["ok", "ncclInvalidUsage", "ok"], outcomes[r]
    assert report["point_to_point"]["errors"] == 1                           # before: 0, and no event
    assert report["totals"]["failed_operations"] == 1
    (event,) = _failed_events(report)
    assert event["op"] == "Send" and "disagree" in event["message"]


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "worker":
    sys.exit(worker(Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), json.loads(sys.argv[5])))
