"""CUDA graphs on fake CUDA devices: capture records, replay reruns (docs/fake-cuda.md,
"CUDA graphs"); each graph's results equal the same computation run eagerly."""
from __future__ import annotations

import pytest

from helpers.fake_cuda_probe import NEEDS_TORCH, run_probe

pytestmark = NEEDS_TORCH


@pytest.fixture(scope="module", params=["native", "python", "0"])
def probed(request) -> dict:
    # The C++ storage tracker, the Python tracking mode, and no memory accounting.
    return run_probe("probe_cuda_graphs.py", devices=1, FAKEGPU_FAKE_CUDA_MEMORY={"native": "1"}.get(
        request.param, request.param))


def test_capture_does_not_do_the_work_and_replays_do(probed):
    assert probed["capture_did_not_change_acc"]
    assert probed["replay_outputs_equal"] and probed["replay_accumulates"]
    assert probed["capturing_outside"] is False
    assert probed["recorded_steps"] > 0


def test_training_step_in_a_graph_trains_as_eager(probed):
    assert probed["train_losses_equal"] and probed["params_equal"]


def test_flex_attention_backward_in_a_graph_reads_this_replays_values(probed):
    # flex saves its logsumexp for backward without returning it; a replay refreshes it (and,
    # under selective activation checkpointing, the one its recomputation saves)
    assert probed["flex_grads_equal"] and probed["flex_sac_grads_equal"]


def test_make_graphed_callables(probed):
    assert probed["graphed_callable_grads_equal"]


def test_replay_before_capture_says_so(probed):
    assert "before a capture ended" in probed["errors"]["replay_before_capture"]


def test_fsdp2_step_in_a_graph_trains_as_eager(tmp_path, shim_library):
    import json

    from helpers.shim import REPO_ROOT
    from helpers.torchrun import fgpu_env, run_fgpu_torchrun

    program = REPO_ROOT / "tests" / "e2e" / "torch_programs" / "fsdp2_cuda_graph.py"
    run_fgpu_torchrun(tmp_path, fgpu_env(shim_library), ["-q", "--device-count", "2"],
                      ["--standalone", "--nproc-per-node", "2", str(program), str(tmp_path)])
    rows = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("rank*.json"))]
    assert sorted(r["rank"] for r in rows) == [0, 1]
    for row in rows:
        # losses and gradient norms of 5 steps (3 replays) equal the eager run's bit for bit
        assert row["graph"] == row["eager"] and len(row["eager"][0]) == 5, row
