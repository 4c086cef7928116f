"""`fgpu -- torchrun ...` with a script that only names the backend: init_process_group("fakegpu")
must work without importing fakegpu.torch, because fgpu puts the autoload hook on PYTHONPATH."""
from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from fakegpu import launcher

REPO_ROOT = Path(__file__).resolve().parents[1]

pytestmark = [
    pytest.mark.torch,
    pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed"),
    pytest.mark.skipif(launcher.torch_autoload_dir() is None, reason="fakegpu.torch ships no autoload hook"),
]

SCRIPT = textwrap.dedent("""
    import json, os, sys
    import torch
    import torch.distributed as dist
    dist.init_process_group("fakegpu")
    rank, world = dist.get_rank(), dist.get_world_size()
    t = torch.arange(1000, dtype=torch.float32) * (rank + 1)
    dist.all_reduce(t)
    gathered = [torch.zeros(3, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(gathered, torch.full((3,), rank, dtype=torch.int64))
    ok = torch.equal(t, torch.arange(1000, dtype=torch.float32) * (world * (world + 1) // 2)) and \\
         all(torch.equal(g, torch.full((3,), r, dtype=torch.int64)) for r, g in enumerate(gathered))
    backend = dist.get_backend()
    dist.destroy_process_group()
    with open("rank%d.json" % rank, "w") as f:
        json.dump({"ok": bool(ok), "backend": backend}, f)
""")

YAML = textwrap.dedent("""
    version: 1
    cluster: {name: torch-two-nodes, default_backend: nccl}
    nodes:
      - {id: n0, host: 127.0.0.1, ranks: [0], gpus: [{profile: a100}]}
      - {id: n1, host: 127.0.0.1, ranks: [1], gpus: [{profile: a100}]}
    fabric:
      intra_node: {type: nvlink, bandwidth_gbps: 300, latency_us: 3}
      inter_node: {type: infiniband, bandwidth_gbps: 200, latency_us: 15}
""")


def test_torchrun_under_fgpu_with_backend_name_only(tmp_path, shim_library):
    (tmp_path / "train.py").write_text(SCRIPT)
    (tmp_path / "cluster.yaml").write_text(YAML)
    env = {k: v for k, v in os.environ.items() if not k.startswith("FAKEGPU_")}
    env["FAKEGPU_NCCL_LIBRARY"] = shim_library
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
    # Own process group, so a hang cannot leave torchrun and its workers behind.
    proc = subprocess.Popen(
        [sys.executable, "-m", "fakegpu", "run", "--cluster-config", "cluster.yaml", "--report", "run.json", "--",
         sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "--max-restarts", "0", "train.py"],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail("fgpu -- torchrun did not finish within 300 s:\n" + err[-5000:])
    assert proc.returncode == 0, out[-3000:] + err[-5000:]
    for rank in range(2):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert result == {"ok": True, "backend": "fakegpu"}
    report = json.loads((tmp_path / "run.json").read_text())
    assert report["world_size"] == 2
    assert report["collectives"]["AllReduce"]["calls"] >= 1
    assert report["collectives"]["AllGather"]["calls"] >= 1
    assert report["links"]["inter_node"]["bytes"] > 0
