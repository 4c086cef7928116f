"""Real pipeline / fake SPMD (``fgpu --dist-mode real_pp_fake_spmd``) as a user launches it:
``NGPU=N FAKEGPU_PP_DEGREE=P fgpu --dist-mode real_pp_fake_spmd -- torchrun --nproc-per-node P ...``
around a program that does not know fakegpu.

- A plain torch.distributed.pipelining program (tests/e2e/torch_programs/pipeline_fsdp_train.py: 2
  stages, FSDP2 on the data-parallel axis) against the same file under plain torchrun +
  gloo with every logical rank a process: the program is SPMD-symmetric (see its docstring), so
  losses and parameters must be equal bit for bit.
- TorchTitan 0.3.0's llama3 debug model with pipeline parallelism 2 x FSDP 4 (NGPU=8, two
  processes), when TorchTitan is installed (CI does not install it).
"""
from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.shim import REPO_ROOT
from helpers.titan import HAS_TORCHTITAN
from helpers.torchrun import TORCH_UNDER_FGPU, fgpu_env, run_fgpu_torchrun

pytestmark = TORCH_UNDER_FGPU

PROGRAM = Path(__file__).resolve().parent / "torch_programs" / "pipeline_fsdp_train.py"


def _results(stdout: str) -> dict:
    rows = [json.loads(line[len("RESULT "):]) for line in stdout.splitlines() if line.startswith("RESULT ")]
    return {row["rank"]: row for row in rows}


def _check_report(report: Path, env: dict, world_size: int) -> str:
    done = subprocess.run([sys.executable, "-m", "fakegpu", "report", "check", str(report),
                           "--expect-world-size", str(world_size)],
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


@pytest.mark.parametrize("schedule", [
    "1f1b",
    pytest.param("gpipe", marks=pytest.mark.slow),   # each case about a minute on 2 loaded cores
])
def test_plain_pipelining_program_matches_torchrun_gloo_at_the_full_world_size(tmp_path, shim_library, schedule):
    ngpu = 4   # pp 2 x dp 2: the reference runs 4 processes, the fake world 2
    reference_env = {k: v for k, v in fgpu_env(shim_library).items() if not k.startswith("FAKEGPU_")}
    reference_env["OMP_NUM_THREADS"] = "1"
    reference = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ngpu),
         str(PROGRAM), "--schedule", schedule],
        cwd=tmp_path, env=reference_env, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    assert reference.returncode == 0, reference.stderr[-5000:]
    real = _results(reference.stdout)
    assert sorted(real) == [0, 1, 2, 3]
    # the program is SPMD-symmetric for real: both dp ranks of a stage end equal
    assert real[2]["losses"] == real[3]["losses"] and len(real[2]["losses"]) == 3

    report = tmp_path / "report.json"
    env = fgpu_env(shim_library, NGPU=str(ngpu), FAKEGPU_PP_DEGREE="2", OMP_NUM_THREADS="1")
    out, err = run_fgpu_torchrun(tmp_path, env, ["-q", "--dist-mode", "real_pp_fake_spmd", "--report", str(report)],
                                 ["--standalone", "--nproc-per-node", "2", str(PROGRAM), "--schedule", schedule])
    # the processes are clients of torchrun's agent store, not a second server on its port
    assert "failed to bind" not in err, err[-3000:]
    fake = _results(out)
    # two processes playing logical ranks 0 and 2 of a 4-rank world (torchrun's RANK 1 became 2)
    assert sorted(fake) == [0, 2]
    assert all(fake[r]["world"] == ngpu and fake[r]["env"] == [str(ngpu), str(r)] for r in fake)
    assert fake[2]["losses"] == real[2]["losses"]                       # bit for bit
    for rank in (0, 2):
        assert fake[rank]["shard_checksum"] == real[rank]["shard_checksum"], rank

    _check_report(report, env, ngpu)
    data = json.loads(report.read_text())
    meta = data["metadata"]
    assert meta["physical_logical_ranks"] == [0, 2] and meta["fake_world"]["events_from_physical_ranks"] == [0, 1]
    # every pipeline send crossed the processes and is replicated over both pipelines {0,2} and {1,3}
    p2p = data["point_to_point"]["operations"]
    assert p2p > 0 and p2p % 2 == 0
    # FSDP2 on the fake dp groups {0,1} and {2,3}: all-gathers and reduce-scatters on both
    dp_groups = [c for c in data["communicators"] if c["members"] in ([0, 1], [2, 3])]
    assert sorted(c["members"] for c in dp_groups) == [[0, 1], [2, 3]]
    assert all(c["by_kind"].get("AllGather", 0) > 0 and c["by_kind"].get("ReduceScatter", 0) > 0
               for c in dp_groups)


def test_a_pipeline_group_with_ranks_no_process_plays_is_refused_with_the_fix(tmp_path, shim_library):
    """With the mesh (dp, pp) the pipeline groups are {0,1} and {2,3}, but the default contract
    puts the processes at logical ranks 0 and 2: the schedule's first step says so and what to set;
    with that setting the same program trains."""
    args = ["--standalone", "--nproc-per-node", "2", str(PROGRAM), "--pp-inner", "--steps", "2"]
    env = fgpu_env(shim_library, NGPU="4", FAKEGPU_PP_DEGREE="2", OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-m", "fakegpu", "run", "-q", "--dist-mode", "real_pp_fake_spmd", "--",
                           sys.executable, "-m", "torch.distributed.run", *args],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
                          stdin=subprocess.DEVNULL, start_new_session=True)
    assert done.returncode != 0
    assert ("LaunchContractError: fakegpu: pipeline stage 0 sends over the group of logical ranks [0, 1], "
            "but no process plays rank(s) 1") in done.stderr, done.stderr[-4000:]
    assert "processes play logical ranks [0, 2]" in done.stderr
    assert "FAKEGPU_PHYSICAL_RANKS=0,1" in done.stderr

    env = fgpu_env(shim_library, NGPU="4", FAKEGPU_PHYSICAL_RANKS="0,1", OMP_NUM_THREADS="1")
    out, _ = run_fgpu_torchrun(tmp_path, env, ["-q", "--dist-mode", "real_pp_fake_spmd"], args)
    results = _results(out)
    assert sorted(results) == [0, 1] and results[1]["stage"] == 1
    assert len(results[1]["losses"]) == 2 and all(math.isfinite(v) and v > 0 for v in results[1]["losses"])


STEP_LINE = re.compile(r"step:\s*(\d+)\s+loss:\s*(-?[0-9.]+)\s+grad_norm:\s*([0-9.]+)")


@pytest.mark.slow   # about 1.5 to 3 minutes on the 2-core box
@pytest.mark.skipif(not HAS_TORCHTITAN,
                    reason="TorchTitan 0.3.0 (with tensorboard, tokenizers, datasets) is not "
                           "installed; CI does not install it")
@pytest.mark.parametrize("launch", ["explicit-pp-standalone", "inferred-pp"])
def test_torchtitan_pipeline_parallel_under_real_pp_fake_spmd(tmp_path, shim_library, launch):
    """As TorchTitan's users launch it: with FAKEGPU_PP_DEGREE and --standalone, and with
    neither (P is the number of processes torchrun starts)."""
    sys.path.insert(0, str(REPO_ROOT / "verification" / "titan"))
    try:
        from assets import write_assets
    finally:
        sys.path.pop(0)
    tokenizer, dataset = write_assets(str(tmp_path / "assets"))
    report = tmp_path / "report.json"
    steps = 2
    explicit = launch == "explicit-pp-standalone"
    env = fgpu_env(shim_library, NGPU="8", **({"FAKEGPU_PP_DEGREE": "2"} if explicit else {}))
    out, err = run_fgpu_torchrun(
        tmp_path, env, ["-q", "--dist-mode", "real_pp_fake_spmd", "--report", str(report)],
        [*(["--standalone"] if explicit else []), "--nproc-per-node", "2", "-m", "torchtitan.train",
         "--module", "llama3", "--config", "llama3_debugmodel",
         "--hf-assets-path", tokenizer, "--dataloader.dataset-path", dataset,
         "--parallelism.pipeline-parallel-degree", "2", "--parallelism.data-parallel-shard-degree", "4",
         "--parallelism.spmd-backend", "partial_dtensor", "--training.disable-cuda-graphs",
         "--training.steps", str(steps), "--training.seq-len", "64", "--training.local-batch-size", "2",
         "--validator.no-enable", "--checkpoint.no-enable", "--debug.seed", "0",
         "--metrics.disable-color-printing", "--dump-folder", str(tmp_path / "dump")],
        timeout_s=900)
    log = out + err
    assert "Training completed" in log, log[-5000:]
    assert "failed to bind" not in log                          # torchrun's agent serves the store
    assert "Set timeout is now only supported" not in log       # set_timeout on fake groups: nothing to set
    # Both processes log; the first stage reports TorchTitan's placeholder loss (-1 per dp rank,
    # summed over the 4 ranks of its loss mesh), the last stage the real one.
    by_step: dict[int, list[float]] = {}
    for step, loss, grad_norm in STEP_LINE.findall(log):
        by_step.setdefault(int(step), []).append(float(loss))
        assert math.isfinite(float(grad_norm)) and float(grad_norm) > 0
    assert sorted(by_step) == list(range(1, steps + 1)), log[-5000:]
    for losses in by_step.values():
        assert sorted(losses)[0] == -4.0 and len(losses) == 2
        assert math.isfinite(losses[1]) and 5.0 < max(losses) < 10.0   # about ln(2048) = 7.6 at the start

    _check_report(report, env, 8)
    data = json.loads(report.read_text())
    meta = data["metadata"]
    assert meta["logical_world_size"] == 8 and meta["physical_logical_ranks"] == [0, 4]
    assert meta["fake_world"]["events_from_physical_ranks"] == [0, 1]
    # DeviceMesh's groups keep their names: the pipeline's send/recv on its 4 replicas {b, b + 4}
    # (mesh_pp[b]), FSDP2 on each stage's fsdp group
    comms = data["communicators"]
    pipelines = sorted(c["members"] for c in comms if c["name"].startswith("mesh_pp") and "SendRecv" in c["by_kind"])
    assert pipelines == [[b, b + 4] for b in range(4)], pipelines
    fsdp = sorted(c["members"] for c in comms if c["name"] == "mesh_fsdp")
    assert fsdp == [[0, 1, 2, 3], [4, 5, 6, 7]], fsdp
    p2p = data["point_to_point"]["operations"]
    assert p2p > 0 and p2p % 4 == 0            # replicated over the 4 pipelines {b, b + 4}
    assert data["collectives"]["AllGather"]["calls"] > 0 and data["collectives"]["ReduceScatter"]["calls"] > 0
