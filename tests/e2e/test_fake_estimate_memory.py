"""Per-rank memory of TorchTitan's llama3 on fake tensors (fakegpu.fake.estimate_memory)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from helpers.paths import REPO_ROOT as ROOT



def _estimate(tmp_path, name, *args) -> dict:
    out = tmp_path / f"{name}.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FAKEGPU_", "RANK", "WORLD_SIZE", "NGPU"))}
    env.update(PYTHONPATH=str(ROOT), FAKEGPU_TORCH_AUTOLOAD="0", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-W", "ignore", "-m", "fakegpu.fake.estimate_memory",
                           "--flavor", "debugmodel", "--seq-len", "256", *args, "--json", str(out)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-6000:]
    return json.loads(out.read_text())


def test_sharded_state_and_activations_scale_as_they_must(tmp_path):
    # The real package (its trainer), not a namespace package a folder on sys.path could make.
    pytest.importorskip("torchtitan.train", reason="TorchTitan is not installed (CI does not install it)")
    dp8 = _estimate(tmp_path, "dp8", "--dp-shard", "8", "--local-batch-size", "1")
    dp2 = _estimate(tmp_path, "dp2", "--dp-shard", "2", "--local-batch-size", "1")
    big = _estimate(tmp_path, "big", "--dp-shard", "8", "--local-batch-size", "4")
    for r in (dp8, dp2, big):
        # AdamW: two fp32 moments per (sharded) fp32 parameter
        assert r["optimizer_state_bytes"] == pytest.approx(2 * r["parameter_bytes"], rel=0.01)
        # after the last step (gradients set to None) only parameters, optimizer state and
        # buffers remain: nothing leaks through the replay (DTensor wrappers, FSDP's resizes)
        state = r["parameter_bytes"] + r["optimizer_state_bytes"]
        assert state <= r["allocator_end_allocated_bytes"] <= 1.2 * state
        assert r["allocator_peak_reserved_bytes"] >= r["allocator_peak_allocated_bytes"] > state
        # torch's FSDPMemTracker and the allocator replay see the same peak
        assert r["tracked_peak_bytes"] == pytest.approx(r["allocator_peak_allocated_bytes"], rel=0.15)
    assert dp2["parameter_bytes"] == pytest.approx(4 * dp8["parameter_bytes"], rel=0.02)
    assert big["allocator_peak_allocated_bytes"] > dp8["allocator_peak_allocated_bytes"]
