"""verification/gpu/run_all.py without a GPU: what it would run, its argument checks, and one case
end to end on CPU (--dry-run: the same workload and reference code, fakegpu backend)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from helpers.paths import REPO_ROOT as REPO

SCRIPT = REPO / "verification" / "gpu" / "run_all.py"


def run(args, **kw):
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=kw.pop("timeout", 60),
                          **kw)


def test_commands_are_hybrid_nccl_four_ranks(tmp_path):
    proc = run(["--out", str(tmp_path), "--print-commands"])
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    cases = [line.split("workloads.py ")[1].split()[0] for line in lines]
    assert cases == ["ddp_plain", "ddp_no_sync", "ddp_find_unused", "ddp_static_graph", "ddp_bucket_view",
                     "fsdp2_fp32", "fsdp2_bf16", "tp", "pp", "bandwidth"]
    for line in lines:
        assert "-m fakegpu run --mode hybrid" in line
        assert "--nproc-per-node 4" in line and "--device cuda --backend nccl" in line


def test_bad_arguments_are_refused(tmp_path):
    proc = run(["--out", str(tmp_path), "--cases", "ddp_plain,nonsense"])
    assert proc.returncode == 2 and "unknown case(s) ['nonsense']" in proc.stderr
    proc = run(["--out", str(tmp_path), "--nproc", "1"])
    assert proc.returncode == 2 and "--nproc must be at least 2" in proc.stderr


@pytest.mark.slow
def test_dry_run_pipeline_case_on_cpu(shim_library, tmp_path):
    pytest.importorskip("torch")
    env = dict(os.environ, FAKEGPU_NCCL_LIBRARY=str(shim_library))
    proc = run(["--dry-run", "--out", str(tmp_path), "--cases", "pp", "--nproc", "4"], env=env, timeout=400)
    assert proc.returncode == 0, proc.stdout + proc.stderr + (tmp_path / "pp" / "log.txt").read_text()[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    (result,) = summary["results"]
    assert result["ok"] and result["max_abs_err"] < 1e-5
    ranks = [json.loads((tmp_path / "pp" / f"rank{r}.json").read_text()) for r in range(4)]
    assert all(r["ok"] for r in ranks)
    assert len(ranks[3]["losses"]) == 4 * 4  # the last stage: 4 steps x 4 micro-batches
