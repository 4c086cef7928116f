"""Injected faults through the real shim, real coordinator and real rank processes.

Each test starts a coordinator with a 2000 ms timeout and FAKEGPU_FAULTS, runs N ranks of
this file's worker (``python tests/integration/test_faults.py worker ...``: world communicator, then
allreduces checked against numpy), and asserts what every live rank got, how fast, what
ncclGetLastError said, and that the coordinator's report passes ``report check``.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve()
# Also run as a script (the rank worker), before helpers is importable: the repository and
# tests/ (for helpers) on sys.path.
sys.path[:0] = [str(HERE.parents[2]), str(HERE.parents[1])]

TIMEOUT_MS = 2000
MARGIN_S = 1.5          # tick granularity (250 ms) + process scheduling on a loaded CI box
CALLS = 6
COUNT = 1024


# ----------------------------------------------------------------------------- worker

def worker(run_dir: Path, rank: int, nranks: int, plan: dict) -> int:
    import numpy as np

    from fakegpu.nccl import Nccl, NcclError

    nccl = Nccl()

    def uid(tag: str, leader: bool) -> bytes:
        path = run_dir / f"uid-{tag}"
        if leader:
            tmp = run_dir / f".uid-{tag}.tmp"
            tmp.write_bytes(nccl.get_unique_id())
            os.replace(tmp, path)
        deadline = time.monotonic() + 60
        while not path.exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"no unique id {tag}")
            time.sleep(0.005)
        return path.read_bytes()

    out = {"rank": rank, "calls_ok": 0, "error": None}

    def save():
        tmp = run_dir / f".result-{rank}.tmp"
        tmp.write_text(json.dumps(out))
        os.replace(tmp, run_dir / f"result-{rank}.json")

    comm = nccl.comm_init_rank(nranks, uid("world", rank == 0), rank, name="faults-world")
    for call in range(1, plan.get("calls", CALLS) + 1):
        size = plan.get("count", COUNT)
        count = size // 2 if plan.get("mismatch") == [rank, call] else size
        send = np.full(count, rank + call, dtype=np.float32)
        recv = np.zeros(count, dtype=np.float32)
        t0 = time.monotonic()
        try:
            comm.all_reduce(send, recv, count, np.float32, "sum")
        except NcclError as exc:
            out["error"] = {"call": call, "result": exc.name, "elapsed_s": time.monotonic() - t0,
                            "at": time.time(), "last_error": nccl.last_error(comm),
                            "async": int(comm.get_async_error())}
            break
        out["calls_ok"] += 1
        out.setdefault("call_s", []).append(time.monotonic() - t0)
        expected = sum(r + call for r in range(nranks))
        assert np.all(recv == expected), (call, recv[:4], expected)
        if plan.get("pause_s"):
            (run_dir / f"progress-{rank}").write_text(str(call))
            time.sleep(plan["pause_s"])
    save()
    survivors = plan.get("recover")
    excluded = plan.get("shrink")
    if out["error"] and excluded is not None and rank not in excluded:
        new = comm.shrink(excluded)      # recovery: the same communicator minus the dead
        out["shrunk"] = {"rank": new.rank, "size": new.size}
        send = np.full(COUNT, rank + 1, dtype=np.float32)
        recv = np.zeros(COUNT, dtype=np.float32)
        new.all_reduce(send, recv, COUNT, np.float32, "sum")
        out["recovered_sum"] = float(recv[0])
        new.destroy()
        comm.abort()
        save()
    elif out["error"] and survivors and rank in survivors:
        comm.abort()                       # recovery: abort, then a new communicator of the survivors
        new_rank = survivors.index(rank)
        new = nccl.comm_init_rank(len(survivors), uid("survivors", new_rank == 0), new_rank, name="survivors")
        send = np.full(COUNT, rank + 1, dtype=np.float32)
        recv = np.zeros(COUNT, dtype=np.float32)
        new.all_reduce(send, recv, COUNT, np.float32, "sum")
        out["recovered_sum"] = float(recv[0])
        new.destroy()
        save()
    elif not out["error"]:
        comm.destroy()
    return 0


# ----------------------------------------------------------------------------- harness

@pytest.fixture(scope="module")
def library(shim_library):
    return shim_library


def start_coordinator(faults: str, report: Path, extra_env=None, extra_args=()):
    from helpers.coordinator import CoordinatorProcess

    env = {"FAKEGPU_FAULTS": faults} if faults else {}
    env.update(extra_env or {})
    return CoordinatorProcess("unix", extra_env=env,
                              extra_args=("--timeout-ms", str(TIMEOUT_MS), "--report", str(report), *extra_args))


def start_ranks(nranks: int, coordinator, library: str, plan: dict, run_dir: Path, env=None):
    child = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    child.update(coordinator.client_env)
    child["FAKEGPU_NCCL_LIBRARY"] = library
    child["FAKEGPU_CLIENT_WAIT_MARGIN_MS"] = "1000"
    child["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE.parents[2]), os.environ.get("PYTHONPATH")]))
    child.update(env or {})
    procs = []
    for rank in range(nranks):
        log = open(run_dir / f"log-{rank}.txt", "w")
        procs.append(subprocess.Popen([sys.executable, str(HERE), "worker", str(run_dir), str(rank), str(nranks),
                                       json.dumps(plan)], env={**child, "RANK": str(rank)}, stdout=log, stderr=subprocess.STDOUT,
                                      stdin=subprocess.DEVNULL))
    return procs


def wait(procs, timeout_s: float = 60.0) -> list:
    deadline = time.monotonic() + timeout_s
    try:
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
    return [p.returncode for p in procs]


def results(run_dir: Path, ranks) -> dict:
    out = {}
    for r in ranks:
        path = run_dir / f"result-{r}.json"
        assert path.exists(), f"rank {r} wrote no result:\n{(run_dir / f'log-{r}.txt').read_text()[-3000:]}"
        out[r] = json.loads(path.read_text())
    return out


def check_report(report: Path) -> dict:
    proc = subprocess.run([sys.executable, "-m", "fakegpu", "report", "check", str(report)],
                          capture_output=True, text=True, timeout=120, cwd=str(HERE.parents[2]))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    md = report.with_suffix(".md")
    assert md.exists() and "## Summary" in md.read_text()
    return json.loads(report.read_text())


def run_fault(library, faults: str, nranks: int = 3, plan=None, env=None, extra_args=()):
    run_dir = Path(tempfile.mkdtemp(prefix="fgpu-faults-"))
    report = run_dir / "report.json"
    with start_coordinator(faults, report, extra_args=extra_args) as coord:
        procs = start_ranks(nranks, coord, library, plan or {}, run_dir, env)
        codes = wait(procs)
        coord.stop()
        log = coord.log()
    return run_dir, codes, check_report(report), log


# ----------------------------------------------------------------------------- tests

def test_kill_fails_peers_with_remote_error(library):
    run_dir, codes, report, _ = run_fault(library, "kill:rank=1:seq=3")
    assert codes[1] == -9, codes                      # really SIGKILLed
    res = results(run_dir, [0, 2])
    for r in (0, 2):
        err = res[r]["error"]
        assert res[r]["calls_ok"] == 2 and err["call"] == 3, res[r]
        assert err["result"] == "ncclRemoteError", err
        assert err["elapsed_s"] < TIMEOUT_MS / 1000 + MARGIN_S, err
        assert "faults-world" in err["last_error"] and "collective #3 AllReduce" in err["last_error"], err["last_error"]
        assert "injected fault kill:rank=1:seq=3" in err["last_error"], err["last_error"]
        assert err["async"] != 0
    events = report["events"]
    assert events["faults"][0]["kind"] == "kill" and events["faults"][0]["fired"] == 1
    injected = [e for e in events["items"] if e["event"] == "fault_injected"]
    assert injected and injected[0]["rank"] == 1 and injected[0]["call_seq"] == 3
    assert "SIGKILL" in injected[0]["action"]
    failed = [e for e in events["items"] if e["event"] == "op_failed"]
    assert failed and 1 in failed[0]["missing_ranks"] and failed[0]["op"] == "AllReduce"
    ranks = {r["rank"]: r for r in report["ranks"]}
    assert ranks[0]["collective_calls"] >= 2 and ranks[2]["collective_calls"] >= 2   # accounting kept
    markdown = (run_dir / "report.md").read_text()
    assert "## Failures and recovery" in markdown and "kill:rank=1:seq=3" in markdown


def test_drop_gives_victim_system_error_and_peers_remote_error(library):
    run_dir, codes, report, _ = run_fault(library, "drop:rank=1:seq=3")
    res = results(run_dir, [0, 1, 2])
    assert res[1]["error"]["result"] == "ncclSystemError", res[1]
    for r in (0, 2):
        assert res[r]["error"]["result"] == "ncclRemoteError", res[r]
    for r in (0, 1, 2):
        assert res[r]["error"]["call"] == 3
        assert res[r]["error"]["elapsed_s"] < TIMEOUT_MS / 1000 + MARGIN_S
    assert report["events"]["by_event"].get("fault_injected") == 1


def test_hang_times_out_peers_and_names_the_missing_rank(library):
    run_dir, codes, report, _ = run_fault(library, "hang:rank=2:seq=2")
    res = results(run_dir, [0, 1, 2])
    for r in (0, 1):
        err = res[r]["error"]
        assert err["result"] == "ncclTimeout" and err["call"] == 2, err
        assert TIMEOUT_MS / 1000 - 0.1 < err["elapsed_s"] < TIMEOUT_MS / 1000 + MARGIN_S, err
        assert "ranks [2] did not arrive" in err["last_error"], err["last_error"]
    # The hung rank's own wait is bounded by the coordinator timeout + the client margin (1 s).
    hung = res[2]["error"]
    assert hung["call"] == 2 and hung["result"] != "ncclSuccess"
    assert hung["elapsed_s"] < TIMEOUT_MS / 1000 + 1.0 + MARGIN_S, hung
    failed = [e for e in report["events"]["items"] if e["event"] == "op_failed"]
    assert failed[0]["missing_ranks"] == [2] and failed[0]["result"] == "ncclTimeout"


def test_short_delay_slows_the_call_but_it_succeeds(library):
    run_dir, codes, report, _ = run_fault(library, "delay:rank=0:op=AllReduce:seq=2:ms=800")
    res = results(run_dir, [0, 1, 2])
    assert codes == [0, 0, 0]
    for r in (1, 2):
        assert res[r]["calls_ok"] == CALLS and res[r]["error"] is None
        assert res[r]["call_s"][1] >= 0.75, res[r]["call_s"]        # waited for the delayed rank
        assert max(res[r]["call_s"][2:]) < 0.75                     # fired once


def test_delay_beyond_the_timeout_fails_every_rank_with_timeout(library):
    run_dir, codes, report, _ = run_fault(library, "delay:rank=0:seq=3:ms=2500",
                                          env={"FAKEGPU_CLIENT_WAIT_MARGIN_MS": "4000"})
    res = results(run_dir, [0, 1, 2])
    for r in (1, 2):
        err = res[r]["error"]
        assert err["result"] == "ncclTimeout" and err["call"] == 3
        assert err["elapsed_s"] < TIMEOUT_MS / 1000 + MARGIN_S
    # The late rank learns it too, once its call is released (2.5 s, well before its own 6 s client limit).
    assert res[0]["error"]["result"] == "ncclTimeout" and res[0]["error"]["elapsed_s"] < 2.5 + MARGIN_S


def test_disagreement_is_invalid_usage_naming_what_each_rank_asked(library):
    run_dir, codes, report, _ = run_fault(library, "", plan={"mismatch": [1, 4]})
    res = results(run_dir, [0, 1, 2])
    for r in (0, 1, 2):
        err = res[r]["error"]
        assert err["result"] == "ncclInvalidUsage" and err["call"] == 4, err
        assert err["elapsed_s"] < MARGIN_S
        assert "512" in err["last_error"] and "1024" in err["last_error"], err["last_error"]
    assert report["totals"]["by_status"].get("mismatch") == 1


def test_lost_coordinator_is_system_error_on_every_rank(library):
    run_dir = Path(tempfile.mkdtemp(prefix="fgpu-faults-"))
    report = run_dir / "report.json"
    with start_coordinator("", report) as coord:
        procs = start_ranks(3, coord, library, {"calls": 200, "pause_s": 0.05}, run_dir)
        deadline = time.monotonic() + 60
        while not all((run_dir / f"progress-{r}").exists() for r in range(3)):
            assert time.monotonic() < deadline, "ranks never progressed"
            time.sleep(0.02)
        killed_at = time.time()
        coord.proc.kill()
        wait(procs)
    res = results(run_dir, [0, 1, 2])
    for r in (0, 1, 2):
        err = res[r]["error"]
        assert err["result"] == "ncclSystemError", err
        assert err["at"] - killed_at < MARGIN_S, err


def test_abort_then_survivors_build_a_new_communicator(library):
    run_dir, codes, report, _ = run_fault(library, "kill:rank=2:seq=3", plan={"recover": [0, 1]})
    res = results(run_dir, [0, 1])
    for r in (0, 1):
        assert res[r]["error"]["result"] == "ncclRemoteError"
        assert res[r]["recovered_sum"] == 1 + 2                       # ranks 0 and 1 contribute r+1
    aborts = [e for e in report["events"]["items"] if e["event"] == "comm_abort"]
    assert {e["rank"] for e in aborts} == {0, 1}
    assert any(c["name"] == "survivors" and c["operations"] == 1 for c in report["communicators"])


def test_shrink_excluding_the_dead_rank_gives_a_working_communicator(library):
    run_dir, codes, report, _ = run_fault(library, "kill:rank=1:seq=3", plan={"shrink": [1]})
    res = results(run_dir, [0, 2])
    assert res[0]["shrunk"] == {"rank": 0, "size": 2} and res[2]["shrunk"] == {"rank": 1, "size": 2}
    for r in (0, 2):
        assert res[r]["error"]["result"] == "ncclRemoteError"
        assert res[r]["recovered_sum"] == 1 + 3                        # global ranks 0 and 2 contribute r+1
    shrinks = [e for e in report["events"]["items"] if e["event"] == "comm_shrink"]
    assert len(shrinks) == 1 and shrinks[0]["excluded"] == [1] and shrinks[0]["members"] == [0, 2]
    child = [c for c in report["communicators"] if c["id"] == shrinks[0]["comm"]][0]
    assert child["parent_id"] == shrinks[0]["parent"] and child["members"] == [0, 2] and child["operations"] == 1


CLUSTER = """
version: 1
nodes:
  - {id: node0, ranks: [0], gpus: [{profile: h100}]}
  - {id: node1, ranks: [1], gpus: [{profile: h100}]}
fabric:
  intra_node: {type: nvlink, bandwidth_gbps: 3600, latency_us: 2}
  inter_node: {type: infiniband, bandwidth_gbps: 400, latency_us: 5}
"""


def test_slow_link_slows_the_modeled_time_in_the_report(library, tmp_path):
    config = tmp_path / "cluster.yaml"
    config.write_text(CLUSTER)
    times = {}
    for faults in ("", "slow_link:nodes=node0-node1:factor=4"):
        run_dir, codes, report, _ = run_fault(library, faults, nranks=2, plan={"calls": 3, "count": 1 << 22},
                                              extra_args=("--cluster-config", str(config)))
        assert codes == [0, 0]
        times[faults] = report["collectives"]["AllReduce"]["modeled_time_s"]
    base, slow = times[""], times["slow_link:nodes=node0-node1:factor=4"]
    assert slow > 2 * base, times          # 4x on the bandwidth term; the latency term is unchanged
    assert report["events"]["faults"] == [{"kind": "slow_link", "spec": "slow_link:nodes=node0-node1:factor=4",
                                           "nodes": ["node0", "node1"], "factor": 4.0}]


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "worker":
    sys.exit(worker(Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), json.loads(sys.argv[5])))
