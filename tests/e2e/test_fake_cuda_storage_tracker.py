"""The C++ storage tracker (fakegpu/fake_cuda/native/storage_tracker.cc) against the Python
dispatch mode it replaces: the same program, the same allocator figures at every point."""
from __future__ import annotations

import json

import pytest

from tests.helpers.fake_cuda_probe import NEEDS_TORCH, probe_process, run_probe

pytestmark = NEEDS_TORCH

PROBE = "probe_storage_tracker.py"


@pytest.fixture(scope="module")
def python_mode():
    figures = run_probe(PROBE, 2, FAKEGPU_FAKE_CUDA_MEMORY="python")
    assert figures.pop("native") is False
    return figures


def test_native_tracker_matches_the_python_mode(python_mode):
    native = run_probe(PROBE, 2)
    assert native.pop("native") is True, "the C++ tracker did not load (a compiler is needed)"
    # a foreach op over 8 subclasses: its device from the first argument, then its 8 results
    assert native.pop("foreach_subclass_walks") == 1 + 8
    assert native == python_mode


def test_figures_are_the_allocators(python_mode):
    # Linear(64,256) + LayerNorm(256) + Linear(256,64), each parameter rounded up to 512 bytes.
    params = 64 * 256 * 4 + 1024 + 1024 + 1024 + 256 * 64 * 4 + 512
    assert python_mode["model"] == [[0, 0, 0], [params, params, 2 << 20]]
    allocated_after_step = python_mode["after_del"][1][0]
    assert python_mode["flat"][1][0] == allocated_after_step + (4 << 20)      # 4 MiB of floats
    assert python_mode["flat_freed"][1][0] == allocated_after_step
    assert python_mode["flat_regrown"][1][0] == allocated_after_step + (4 << 20)
    assert python_mode["below_api"][1][0] == allocated_after_step + 4096      # 1000 floats -> 4096
    assert python_mode["below_api_device"] == "cpu"
    assert python_mode["cpu_only"][1][0] == allocated_after_step
    assert python_mode["thread"][1][0] == allocated_after_step + (1 << 18)
    assert python_mode["thread_freed"][1][0] == allocated_after_step
    assert python_mode["oom"] == "CUDA out of memory|fraction"
    # a wrapper subclass's results are charged by their inner tensors (two 4 KiB tensors each)
    made = python_mode["subclass_made"][1][0]
    assert made == python_mode["checkpoint"][1][0] + 2 * 4096
    assert python_mode["subclass_ops"][1][0] == made + 2 * 4096
    assert python_mode["subclass_freed"][1][0] == made
    foreach_made = python_mode["foreach_made"][1][0]
    assert python_mode["foreach_ops"][1][0] == foreach_made + 8 * 2 * 1024   # 8 pairs of 1 KiB


def test_without_a_compiler_the_python_mode_takes_over(tmp_path, python_mode):
    done = probe_process(PROBE, 2, CXX="false", FAKEGPU_CACHE_DIR=str(tmp_path), FAKEGPU_DEBUG="1")
    assert done.returncode == 0, done.stderr[-4000:]
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    assert figures.pop("native") is False
    assert "the C++ storage tracker is not available (the C++ compiler failed" in done.stderr
    assert figures == python_mode


def test_outputs_of_inductor_graphs_are_charged():
    got = run_probe("probe_inductor_outputs.py", 1)
    assert got["native"] is True
    assert got["graphs"] >= 1                          # dynamo compiled under the tracker
    assert got["compiled_output"] == 64 * 256 * 4      # the graph's one output
    assert got["op_on_compiled_output"] == 2 * 64 * 256 * 4
    assert got["equal_to_eager"]
