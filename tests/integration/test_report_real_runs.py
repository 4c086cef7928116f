"""The cluster report from real runs: 4 rank processes through the shim and a real
coordinator over a 2-node YAML, and a coordinator stopped with SIGTERM mid-run."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fakegpu.cli import report as report_cli
from fakegpu.report import check_report

from helpers.coordinator import CoordinatorProcess
from helpers.shim import REPO_ROOT

CONFIG = REPO_ROOT / "cluster_configs" / "dev-2node-2gpu.yaml"


def _env(shim_library: str, **extra: str) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    env["FAKEGPU_NCCL_LIBRARY"] = shim_library
    env.update(extra)
    return env


def test_four_ranks_on_two_nodes_write_valid_report_markdown_and_trace(shim_library, tmp_path, capsys):
    report = tmp_path / "cluster.json"
    trace = tmp_path / "trace.json"
    cmd = [sys.executable, "-m", "fakegpu", "bandwidth", "--ranks", "4", "--op", "allreduce", "--size", "1M",
           "-n", "10", "-w", "0", "--cluster-config", str(CONFIG), "--cluster-report", str(report)]
    proc = subprocess.run(cmd, env=_env(shim_library, FAKEGPU_TRACE_PATH=str(trace)), capture_output=True,
                          text=True, timeout=240, cwd=str(REPO_ROOT))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    assert report_cli.main(["check", str(report), "--expect-world-size", "4", "--expect-node-count", "2",
                            "--expect-collective", "AllReduce"]) == 0
    d = json.loads(report.read_text())
    assert d["topology"]["source"] == str(CONFIG) and not d["topology"]["is_default"]
    ar = d["collectives"]["AllReduce"]
    big = [o for o in d["timeline"]["operations"] if o["kind"] == "AllReduce" and o["logical_bytes"] == 1 << 20]
    assert len(big) >= 20                       # 10 out-of-place + 10 in-place, all 4 ranks
    # NCCL's ring (the model's own hierarchical allreduce competes only when named)
    assert all(o["global_ranks"] == [0, 1, 2, 3] and o["algorithm"] == "ring" for o in big)
    assert ar["calls"] >= len(big)
    # ring allreduce of 1 MiB over 4 ranks: each of the two ring edges between the nodes
    # carries 2(n-1)/n = 1.5 MiB per call
    (pair,) = d["node_pairs"]
    assert pair["by_operation"]["AllReduce"]["bytes"] >= 2 * len(big) * 1.5 * (1 << 20)
    every_call = sum(k["calls"] for k in d["collectives"].values())   # the tool's own AllGathers too
    assert all(r["collective_calls"] == every_call for r in d["ranks"])
    assert all(r["pid"] for r in d["ranks"])

    md = report.with_suffix(".md").read_text()
    assert "# Cluster communication report: dev-2x2" in md and "node0 <-> node1" in md

    t = json.loads(trace.read_text())
    events = [e for e in t["traceEvents"] if e["ph"] == "X"]
    assert {e["tid"] for e in events} == {0, 1, 2, 3}
    assert {e["pid"] for e in events} == {0, 1}         # one process per node
    assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in events)


def test_sigterm_mid_run_leaves_a_valid_report(shim_library, tmp_path):
    report = tmp_path / "cluster.json"
    coordinator = CoordinatorProcess(
        "unix", extra_args=("--cluster-config", str(CONFIG), "--report", str(report), "--report-interval", "0.3"))
    ranks = None
    try:
        env = _env(shim_library, **coordinator.client_env)
        cmd = [sys.executable, "-m", "fakegpu", "bandwidth", "--connect", coordinator.address, "--world-size", "4",
               "--ranks", "0-3", "--session", "sigterm-test", "--size", "64K", "-n", "100000", "-w", "0", "-c", "0"]
        ranks = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                 cwd=str(REPO_ROOT), start_new_session=True)
        deadline = time.monotonic() + 120
        seen = 0
        while time.monotonic() < deadline and seen < 20:   # wait until the run is well under way
            time.sleep(0.3)
            try:
                seen = json.loads(report.read_text())["totals"]["operations"]
            except (OSError, ValueError, KeyError):
                continue
        assert seen >= 20, coordinator.log()
        coordinator.proc.send_signal(signal.SIGTERM)
        coordinator.proc.wait(30)
        d = json.loads(report.read_text())
        assert check_report(d, world_size=4, node_count=2, collectives=["AllReduce"]) == []
        assert d["totals"]["operations"] >= seen
        assert report.with_suffix(".md").is_file()
    finally:
        if ranks is not None and ranks.poll() is None:
            os.killpg(ranks.pid, signal.SIGKILL)
            ranks.wait(10)
        coordinator.stop()


def test_nccl_algo_and_proto_reach_the_coordinators_model(shim_library, tmp_path):
    """NCCL_ALGO / NCCL_PROTO set for the job pick the algorithm the report models, as in NCCL."""
    report = tmp_path / "forced.json"
    cmd = [sys.executable, "-m", "fakegpu", "bandwidth", "--ranks", "4", "--op", "allreduce", "--size", "1M",
           "-n", "2", "-w", "0", "--cluster-config", str(CONFIG), "--cluster-report", str(report)]
    proc = subprocess.run(cmd, env=_env(shim_library, NCCL_ALGO="Tree", NCCL_PROTO="LL"), capture_output=True,
                          text=True, timeout=240, cwd=str(REPO_ROOT))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    d = json.loads(report.read_text())
    big = [o for o in d["timeline"]["operations"] if o["kind"] == "AllReduce" and o["logical_bytes"] == 1 << 20]
    assert big and all(o["algorithm"] == "tree" for o in big)
