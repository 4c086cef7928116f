"""Who is who: duplicate RANKs, RANK >= WORLD_SIZE, ranks the cluster config does not place,
a config with more ranks than the job, a peer that never reaches communicator init, and
`bandwidth --connect --timeout` on its one-rank path. Real coordinator, real shim, real rank
processes (this file's worker: ``python tests/integration/test_identity.py worker RUN_DIR RANK NRANKS``)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

HERE = Path(__file__).resolve()
# Also run as a script (the rank worker), before helpers is importable: the repository and
# tests/ (for helpers) on sys.path.
sys.path[:0] = [str(HERE.parents[2]), str(HERE.parents[1])]

TIMEOUT_MS = 2000
CONFIG = HERE.parents[2] / "cluster_configs" / "dev-2node-2gpu.yaml"   # 2 nodes x 2 ranks: 0-3


# ----------------------------------------------------------------------------- worker

def worker(run_dir: Path, rank: int, nranks: int) -> int:
    """Join an ``nranks`` communicator as comm rank ``rank`` and allreduce once; record the
    outcome (or the NCCL error and ncclGetLastError) in RUN_DIR/result-RANK.json."""
    import numpy as np

    from fakegpu.nccl import Nccl, NcclError

    nccl = Nccl()
    out = {"rank": rank, "pid": os.getpid(), "ok": False, "error": None}
    try:
        comm = nccl.comm_init_rank(nranks, nccl.shared_unique_id(run_dir / "uid", rank, 60), rank, name="identity-world")
        send = np.full(64, rank + 1, dtype=np.float32)
        recv = np.zeros(64, dtype=np.float32)
        comm.all_reduce(send, recv, 64, np.float32, "sum")
        out["ok"] = bool(np.all(recv == nranks * (nranks + 1) / 2))
        comm.destroy()
    except NcclError as exc:
        out["error"] = {"result": exc.name, "last_error": nccl.last_error()}
    tmp = run_dir / f".result-{rank}.tmp"
    tmp.write_text(json.dumps(out))
    os.replace(tmp, run_dir / f"result-{rank}.json")
    return 0


# ----------------------------------------------------------------------------- harness

def _coordinator(report: Path, *args: str):
    from helpers.coordinator import CoordinatorProcess

    return CoordinatorProcess("unix", extra_args=("--timeout-ms", str(TIMEOUT_MS), "--report", str(report), *args))


def _run(coord, library: str, ranks: list[dict], nranks: int, run_dir: Path) -> dict:
    """Start one worker per entry of ``ranks`` (its extra environment: RANK, WORLD_SIZE, and
    ``comm_rank``, its rank in the communicator); wait for all; return results by comm rank."""
    base = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    base.update(coord.client_env)
    base["FAKEGPU_NCCL_LIBRARY"] = library
    base["FAKEGPU_CLIENT_WAIT_MARGIN_MS"] = "1000"
    base["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE.parents[2]), os.environ.get("PYTHONPATH")]))
    procs = []
    for spec in ranks:
        spec = dict(spec)
        comm_rank = spec.pop("comm_rank")
        log = open(run_dir / f"log-{comm_rank}.txt", "w")
        procs.append(subprocess.Popen([sys.executable, str(HERE), "worker", str(run_dir), str(comm_rank), str(nranks)],
                                      env={**base, **spec}, stdout=log, stderr=subprocess.STDOUT,
                                      stdin=subprocess.DEVNULL))
    deadline = time.monotonic() + 60
    for p in procs:
        p.wait(max(1.0, deadline - time.monotonic()))
    out = {}
    for spec in ranks:
        r = spec["comm_rank"]
        path = run_dir / f"result-{r}.json"
        assert path.exists(), (run_dir / f"log-{r}.txt").read_text()[-3000:]
        out[r] = json.loads(path.read_text())
    return out


def _check(report: Path) -> dict:
    done = subprocess.run([sys.executable, "-m", "fakegpu", "report", "check", str(report)],
                          capture_output=True, text=True, timeout=120, cwd=str(HERE.parents[2]))
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(report.read_text())


def _refused(result: dict) -> str:
    err = result["error"]
    assert err is not None and err["result"] == "ncclInvalidUsage", result
    return err["last_error"]


# ----------------------------------------------------------------------------- tests

def test_two_processes_with_one_rank_the_second_is_refused(shim_library):
    run_dir = Path(tempfile.mkdtemp(prefix="fgpu-ident-"))
    report = run_dir / "report.json"
    with _coordinator(report) as coord:
        res = _run(coord, shim_library, [{"comm_rank": 0, "RANK": "0", "WORLD_SIZE": "2"},
                                         {"comm_rank": 1, "RANK": "0", "WORLD_SIZE": "2"}], 2, run_dir)
        coord.stop()
        log = coord.log()
    refused = [r for r in res.values() if r["error"] and r["error"]["result"] == "ncclInvalidUsage"]
    assert len(refused) == 1, res                       # before: both "succeeded", merged into rank 0
    holder = next(r for r in res.values() if r is not refused[0])
    message = refused[0]["error"]["last_error"]
    assert "RANK 0 is already held by pid %d" % holder["pid"] in message, message
    assert "RANK 0 is already held" in log                               # the coordinator logs it
    # The first one waited for its peer, which never came: a timeout that names it.
    assert holder["error"]["result"] == "ncclTimeout", holder
    data = _check(report)
    (timeout,) = [e for e in data["events"]["items"] if e["event"] == "init_timeout"]
    assert timeout["missing_ranks"] == [1 - holder["rank"]] and timeout["arrived_global_ranks"] == [0]


def test_rank_at_or_above_world_size_is_refused(shim_library):
    run_dir = Path(tempfile.mkdtemp(prefix="fgpu-ident-"))
    report = run_dir / "report.json"
    with _coordinator(report) as coord:
        res = _run(coord, shim_library, [{"comm_rank": 0, "RANK": "5", "WORLD_SIZE": "2"},
                                         {"comm_rank": 1, "RANK": "7", "WORLD_SIZE": "2"}], 2, run_dir)
        coord.stop()
    assert "RANK 5 is not below WORLD_SIZE 2" in _refused(res[0])
    assert "RANK 7 is not below WORLD_SIZE 2" in _refused(res[1])
    data = _check(report)
    assert data["world_size"] < 5                       # before: a world of 8 with 6 phantom ranks
    assert data["totals"]["operations"] == 0


def test_rank_the_cluster_config_does_not_place_is_refused(shim_library):
    run_dir = Path(tempfile.mkdtemp(prefix="fgpu-ident-"))
    report = run_dir / "report.json"
    with _coordinator(report, "--cluster-config", str(CONFIG)) as coord:
        res = _run(coord, shim_library, [{"comm_rank": 0, "RANK": "3"}, {"comm_rank": 1, "RANK": "4"}], 2, run_dir)
        coord.stop()
    message = _refused(res[1])
    assert f"RANK 4 is not placed by cluster config {CONFIG} (ranks 0-3)" in message, message
    assert res[0]["error"]["result"] == "ncclTimeout"   # its peer was refused
    data = _check(report)
    assert all(r["node"] is not None for r in data["ranks"])   # before: rank 4 on node None, 0 operations


def test_world_size_beyond_the_cluster_config_is_refused(shim_library):
    run_dir = Path(tempfile.mkdtemp(prefix="fgpu-ident-"))
    report = run_dir / "report.json"
    ranks = [{"comm_rank": r, "RANK": str(r), "WORLD_SIZE": "5"} for r in range(5)]
    with _coordinator(report, "--cluster-config", str(CONFIG)) as coord:
        res = _run(coord, shim_library, ranks, 5, run_dir)
        coord.stop()
    for r in range(4):
        assert f"WORLD_SIZE 5 is more than the 4 ranks cluster config {CONFIG} (ranks 0-3) places" in _refused(res[r])
    assert f"RANK 4 is not placed by cluster config {CONFIG}" in _refused(res[4])


def test_ranks_without_rank_variable_are_checked_against_the_cluster_config(shim_library):
    run_dir = Path(tempfile.mkdtemp(prefix="fgpu-ident-"))
    report = run_dir / "report.json"
    with _coordinator(report, "--cluster-config", str(CONFIG)) as coord:
        res = _run(coord, shim_library, [{"comm_rank": r} for r in range(5)], 5, run_dir)   # no RANK at all
        coord.stop()
        log = coord.log()
    for r in range(5):
        message = _refused(res[r])
        assert f"global ranks 4 are not placed by cluster config {CONFIG} (ranks 0-3)" in message, message
    assert "are not placed by cluster config" in log
    data = _check(report)
    assert [r["rank"] for r in data["ranks"]] == [0, 1, 2, 3] and data["totals"]["operations"] == 0


def test_cluster_config_with_more_ranks_than_the_job_warns(shim_library):
    run_dir = Path(tempfile.mkdtemp(prefix="fgpu-ident-"))
    report = run_dir / "report.json"
    with _coordinator(report, "--cluster-config", str(CONFIG)) as coord:
        res = _run(coord, shim_library, [{"comm_rank": r, "RANK": str(r), "WORLD_SIZE": "2"} for r in range(2)],
                   2, run_dir)
        coord.stop()
        log = coord.log()
    assert res[0]["ok"] and res[1]["ok"], res
    assert "WORLD_SIZE is 2 but cluster config" in log and "ranks 2-3 will have nothing to do" in log
    assert "places 4 ranks but the job used 2: ranks 2-3 never connected" in log   # at the end, on stderr
    data = _check(report)
    notes = [n for n in data["notes"] if "never connected" in n]
    assert notes and notes[0].startswith("cluster config warning:") and "ranks 2-3" in notes[0], data["notes"]
    done = subprocess.run([sys.executable, "-m", "fakegpu", "report", "show", str(report)], capture_output=True,
                          text=True, timeout=60, cwd=str(HERE.parents[2]))
    assert "warning: " in done.stdout and "ranks 2-3 never connected" in done.stdout, done.stdout


def test_peer_missing_at_init_is_an_event_a_rank_entry_and_an_fgpu_line(shim_library, tmp_path):
    """Under fgpu: a 2-rank job of which only rank 0 starts."""
    job = tmp_path / "job.py"
    job.write_text(textwrap.dedent(f"""
        import os, subprocess, sys
        env = dict(os.environ, RANK="0", WORLD_SIZE="2")
        sys.exit(subprocess.call([sys.executable, {str(HERE)!r}, "worker", {str(tmp_path)!r}, "0", "2"], env=env))
    """))
    env = dict(os.environ, FAKEGPU_NCCL_LIBRARY=shim_library, PYTHONPATH=str(HERE.parents[2]),
               FAKEGPU_CLIENT_WAIT_MARGIN_MS="1000")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "FAKEGPU_COORDINATOR_ADDR"):
        env.pop(k, None)
    done = subprocess.run([sys.executable, "-m", "fakegpu", "run", "--coordinator-timeout-ms", str(TIMEOUT_MS),
                           "--report", str(tmp_path / "r.json"), "--", sys.executable, str(job)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    result = json.loads((tmp_path / "result-0.json").read_text())
    assert result["error"]["result"] == "ncclTimeout" and "ranks [1] did not arrive" in result["error"]["last_error"]
    assert "communicator init 'identity-world' of 2 ranks timed out after 2000 ms: ranks [1] never arrived" \
        in done.stderr, done.stderr
    data = _check(tmp_path / "r.json")
    (event,) = [e for e in data["events"]["items"] if e["event"] == "init_timeout"]
    assert event["missing_ranks"] == [1] and event["arrived_ranks"] == [0] and event["name"] == "identity-world"
    ranks = {r["rank"]: r for r in data["ranks"]}
    assert ranks[0]["init_timeouts"] == 1 and ranks[0]["comm_inits"] == 0
    assert "init_timeout" in (tmp_path / "r.md").read_text()


def test_bandwidth_connect_one_rank_honours_timeout(shim_library):
    from helpers.coordinator import CoordinatorProcess

    with CoordinatorProcess("unix") as coord:
        env = dict(os.environ, **coord.client_env, FAKEGPU_NCCL_LIBRARY=shim_library,
                   PYTHONPATH=str(HERE.parents[2]))
        env.pop("FAKEGPU_COORDINATOR_TIMEOUT_MS", None)   # the ranks' own wait: 120 s
        t0 = time.monotonic()
        done = subprocess.run([sys.executable, "-m", "fakegpu", "bandwidth", "--connect", coord.address,
                               "--world-size", "2", "--ranks", "0", "--session", "lonely", "--size", "4K",
                               "--timeout", "8"], env=env, capture_output=True, text=True, timeout=90)
        elapsed = time.monotonic() - t0
    assert done.returncode == 2, done.stdout + done.stderr
    assert "did not finish within --timeout 8 s" in done.stderr, done.stderr
    assert elapsed < 60, elapsed                        # before: the ranks' own 120 s wait


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "worker":
    sys.exit(worker(Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])))
