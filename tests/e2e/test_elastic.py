"""Elastic restart after an injected failure: `fgpu -- torchrun --max-restarts 1` with the
`fakegpu` backend; the cluster YAML's `faults:` section SIGKILLs rank 1 at its 3rd call on
a communicator. Faults fire once per coordinator, and fgpu's coordinator outlives the first
attempt, so the restarted attempt runs clean and the job finishes."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from helpers.torchrun import TORCH_UNDER_FGPU, fgpu_env, run_fgpu_torchrun

pytestmark = TORCH_UNDER_FGPU

SCRIPT = textwrap.dedent("""
    import json, os
    import torch
    import torch.distributed as dist
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    # A plain script: torchrun's agent store outlives the first attempt, and fakegpu.torch must
    # not hand the restarted ranks the dead attempt's unique id.
    dist.init_process_group("fakegpu")
    rank, world = dist.get_rank(), dist.get_world_size()
    with open("attempt%d-rank%d.started" % (attempt, rank), "w"):
        pass
    for step in range(6):
        t = torch.full((256,), float(rank + step))
        dist.all_reduce(t)
        assert torch.all(t == sum(r + step for r in range(world))), (step, t[:3])
    dist.destroy_process_group()
    with open("rank%d.json" % rank, "w") as f:
        json.dump({"attempt": attempt, "steps": 6}, f)
""")

YAML = textwrap.dedent("""
    version: 1
    cluster: {name: elastic-two-nodes}
    nodes:
      - {id: n0, host: 127.0.0.1, ranks: [0], gpus: [{profile: a100}]}
      - {id: n1, host: 127.0.0.1, ranks: [1], gpus: [{profile: a100}]}
    fabric:
      intra_node: {type: nvlink, bandwidth_gbps: 300, latency_us: 3}
      inter_node: {type: infiniband, bandwidth_gbps: 200, latency_us: 15}
    faults:
      - {kind: kill, rank: 1, seq: 3}
""")


@pytest.mark.parametrize("source", ["yaml", "env"])
def test_torchrun_restarts_after_injected_kill_and_finishes(tmp_path, shim_library, source):
    (tmp_path / "train.py").write_text(SCRIPT)
    # init waits for torch imports on a loaded box; the kill needs no timeout
    env = fgpu_env(shim_library, FAKEGPU_COORDINATOR_TIMEOUT_MS="60000")
    if source == "yaml":
        (tmp_path / "cluster.yaml").write_text(YAML)
    else:   # FAKEGPU_FAULTS reaches the coordinator fgpu starts
        (tmp_path / "cluster.yaml").write_text(YAML.split("faults:")[0])
        env["FAKEGPU_FAULTS"] = "kill:rank=1:seq=3"
    run_fgpu_torchrun(tmp_path, env, ["--cluster-config", "cluster.yaml", "--report", "run.json"],
                      ["--standalone", "--nproc-per-node", "2", "--max-restarts", "1", "--monitor-interval", "0.2",
                       "train.py"])
    assert (tmp_path / "attempt0-rank1.started").exists()          # the first attempt ran ...
    for rank in range(2):                                          # ... and the second finished
        assert json.loads((tmp_path / f"rank{rank}.json").read_text()) == {"attempt": 1, "steps": 6}
    check = subprocess.run([sys.executable, "-m", "fakegpu", "report", "check", "run.json"], cwd=tmp_path,
                           env=env, capture_output=True, text=True, timeout=120)
    assert check.returncode == 0, check.stdout + check.stderr
    report = json.loads((tmp_path / "run.json").read_text())
    events = report["events"]
    assert events["faults"] == [{"kind": "kill", "spec": "kill:rank=1:seq=3", "rank": 1, "seq": 3, "op": None,
                                 "count": 1, "fired": 1}]
    injected = [e for e in events["items"] if e["event"] == "fault_injected"]
    assert len(injected) == 1 and "SIGKILL" in injected[0]["action"]
    assert report["totals"]["by_status"].get("ok", 0) >= 6
