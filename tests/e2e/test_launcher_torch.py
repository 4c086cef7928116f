"""`fgpu -- torchrun ...` with a script that only names the backend: init_process_group("fakegpu")
must work without importing fakegpu.torch, because fgpu puts the autoload hook on PYTHONPATH."""
from __future__ import annotations

import json
import textwrap

from helpers.torchrun import TORCH_UNDER_FGPU, fgpu_env, run_fgpu_torchrun

pytestmark = TORCH_UNDER_FGPU

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
    run_fgpu_torchrun(tmp_path, fgpu_env(shim_library),
                      ["--cluster-config", "cluster.yaml", "--report", "run.json"],
                      ["--standalone", "--nproc-per-node", "2", "--max-restarts", "0", "train.py"])
    for rank in range(2):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert result == {"ok": True, "backend": "fakegpu"}
    report = json.loads((tmp_path / "run.json").read_text())
    assert report["world_size"] == 2
    assert report["collectives"]["AllReduce"]["calls"] >= 1
    assert report["collectives"]["AllGather"]["calls"] >= 1
    assert report["links"]["inter_node"]["bytes"] > 0
