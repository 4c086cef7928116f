"""`python -m fakegpu demo`: the real 4-rank FSDP2 x TP job over the bundled 2-node topology."""
from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest
from helpers.paths import REPO_ROOT as REPO


pytestmark = [
    pytest.mark.torch,
    pytest.mark.slow,  # four torch ranks plus torchrun: about a minute on two cores
    pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed"),
]


def test_demo_trains_and_reports_by_group(tmp_path, shim_library):
    env = dict(os.environ, FAKEGPU_NCCL_LIBRARY=shim_library,
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    out = tmp_path   # no --out: the reports go where the README says, the directory it ran from
    proc = subprocess.run([sys.executable, "-m", "fakegpu", "demo", "--steps", "3"],
                          env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text[-4000:]
    losses = [float(x) for x in re.findall(r"step \d/3\s+loss (\d+\.\d+)", text)]
    assert len(losses) == 3, text[-4000:]
    assert losses[-1] < losses[0]  # it learns
    assert "could not register" not in text
    report_path = out / "fakegpu-report.json"
    assert report_path.is_file() and (out / "fakegpu-report.md").is_file()
    assert str(report_path) in text  # the paths are printed
    report = json.loads(report_path.read_text())
    assert report["world_size"] == 4
    names = sorted(c["name"] for c in report["communicators"])
    assert names == ["default_pg", "mesh_dp", "mesh_dp", "mesh_tp", "mesh_tp"], names
    # dp groups span the two nodes, tp groups stay inside one
    for comm in report["communicators"]:
        if comm["name"] == "mesh_dp":
            assert len(comm["nodes"]) == 2
        if comm["name"] == "mesh_tp":
            assert len(comm["nodes"]) == 1
    check = subprocess.run([sys.executable, "-m", "fakegpu", "report", "check", str(report_path)],
                           env=env, capture_output=True, text=True, timeout=120)
    assert check.returncode == 0, check.stdout + check.stderr


def test_demo_rejects_bad_arguments(tmp_path, capsys):
    from fakegpu.cli import demo

    assert demo.main(["--steps", "0"]) == 2
    assert demo.main(["--cluster-config", str(tmp_path / "missing.yaml")]) == 2
    assert "missing.yaml" in capsys.readouterr().err


def test_bundled_topology_is_found():
    from fakegpu.cli import demo

    path = demo.bundled_topology()
    assert path is not None and path.name == "dev-2node-2gpu.yaml"
