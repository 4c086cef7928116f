"""Reports survive: a coordinator SIGTERMed mid-job writes complete-so-far JSON and Markdown,
and a rank killed mid-job does not lose the other ranks' accounting. Real shim, real
coordinator, real rank processes (the worker of tests/integration/test_faults.py)."""
from __future__ import annotations

import json
import os
import signal
import tempfile
import time
from pathlib import Path

from test_faults import check_report, results, start_coordinator, start_ranks, wait


def _wait_progress(run_dir: Path, ranks, calls: int, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        done = [int((run_dir / f"progress-{r}").read_text() or 0) if (run_dir / f"progress-{r}").exists() else 0
                for r in ranks]
        if min(done) >= calls:
            return
        assert time.monotonic() < deadline, f"ranks did not reach call {calls}: {done}"
        time.sleep(0.02)


def test_sigterm_mid_job_writes_complete_so_far_reports(shim_library):
    run_dir = Path(tempfile.mkdtemp(prefix="fgpu-survive-"))
    report = run_dir / "report.json"
    with start_coordinator("", report) as coord:
        procs = start_ranks(3, coord, shim_library, {"calls": 400, "pause_s": 0.02}, run_dir)
        _wait_progress(run_dir, range(3), 5)
        assert not report.exists()
        coord.proc.send_signal(signal.SIGTERM)
        assert coord.proc.wait(30) == 0
        codes = wait(procs)
    assert "received SIGTERM" in coord.log()
    res = results(run_dir, range(3))
    data = check_report(report)                    # schema + cross-section consistency, and the .md
    completed = min(r["calls_ok"] for r in res.values())
    assert completed >= 5
    # Every allreduce that completed on all ranks is in the report; at most the one in flight differs.
    assert completed <= data["collectives"]["AllReduce"]["calls"] <= completed + 1
    for r in res.values():
        assert r["error"]["result"] == "ncclSystemError"      # the ranks learn the coordinator is gone
    assert codes == [0, 0, 0]
    markdown = report.with_suffix(".md").read_text()
    assert "AllReduce" in markdown


def test_killed_rank_keeps_the_others_accounting(shim_library):
    run_dir = Path(tempfile.mkdtemp(prefix="fgpu-survive-"))
    report = run_dir / "report.json"
    with start_coordinator("", report) as coord:
        procs = start_ranks(3, coord, shim_library, {"calls": 400, "pause_s": 0.02}, run_dir)
        _wait_progress(run_dir, range(3), 4)
        os.kill(procs[2].pid, signal.SIGKILL)              # a crash: no destroy, no goodbye
        codes = wait(procs)
        coord.stop()
    assert codes[2] == -9
    res = results(run_dir, [0, 1])
    data = check_report(report)
    completed = res[0]["calls_ok"]
    assert res[1]["calls_ok"] == completed and completed >= 4
    for r in (0, 1):
        assert res[r]["error"]["result"] == "ncclRemoteError"
    assert data["collectives"]["AllReduce"]["calls"] == completed
    ranks = {r["rank"]: r for r in data["ranks"]}
    for g in (0, 1, 2):
        assert ranks[g]["collective_calls"] == completed           # the dead rank's share is kept too
    assert ranks[2]["connected"] is False and ranks[2]["disconnect_reason"]
    assert data["events"]["by_event"].get("rank_disconnected", 0) >= 1
    failed = [e for e in data["events"]["items"] if e["event"] == "op_failed"]
    assert failed and 2 in failed[0]["missing_ranks"]
