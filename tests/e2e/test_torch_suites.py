"""A small slice of PyTorch's own generic distributed tests through the suite driver
(verification/torch_suites/run.py) with fakegpu groups: every test of the slice passes, as it
does with gloo groups (the driver's side-by-side run, ``--backends gloo,fakegpu``, compares
the two; here the gloo half would only test torch itself, so the slice runs fakegpu alone and
each test is one that passes under gloo on the pinned torch).  The full driver (world sizes
2, 4, 8) takes hours; this slice takes a few minutes."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
from helpers.paths import REPO_ROOT as REPO


pytestmark = [
    pytest.mark.torch,
    pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed"),
    pytest.mark.skipif(importlib.util.find_spec("expecttest") is None,
                       reason="torch's test suites need expecttest"),
]

# async collectives, all_gather_coalesced's layout and recv from any source (all differed from
# gloo before; the -k of the last also selects its two profiler variants)
SUBSET = ["test_all_reduce_sum_async", "test_all_gather_coalesced_simple", "test_send_recv_any_source"]


def _run_driver(tmp_path, shim_library, options: list[str], tests: list[str]) -> dict:
    """run.py with fakegpu groups and ``options`` over ``tests`` (by -k); its JSON, after
    checking it exited 0."""
    import json

    env = dict(os.environ, FAKEGPU_NCCL_LIBRARY=shim_library,
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    argv = [sys.executable, str(REPO / "verification" / "torch_suites" / "run.py"), *options,
            "--workdir", str(tmp_path), "--json", str(tmp_path / "out.json"), "--timeout", "600", "--backends", "fakegpu"]
    for name in tests:
        argv += ["-k", name]
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    return json.loads((tmp_path / "out.json").read_text())


def test_suite_slice_passes_under_fakegpu(tmp_path, shim_library):
    results = _run_driver(tmp_path, shim_library, ["--world-sizes", "2"], SUBSET)["2"]
    assert {results["fakegpu"][name] for name in SUBSET} == {"passed"}


# DDP under RPC and distributed autograd (ddp_under_dist_autograd_test over TensorPipe): DDP
# over a trainers' subgroup of a 6-rank world with a remote worker, and DDP gradients checked
# against dist_autograd's
RPC_SUBSET = ["test_backward_ddp_inside", "test_ddp_dist_autograd_local_vs_remote"]


def test_ddp_under_rpc_slice_passes_under_fakegpu(tmp_path, shim_library):
    results = _run_driver(tmp_path, shim_library, ["--suites", "ddp_rpc"], RPC_SUBSET)["ddp_rpc"]
    assert results["fakegpu"] == {name: "passed" for name in RPC_SUBSET}


# A PyTorch-style test file given by path (`--suites file --test-file`), as torch's own
# test/distributed/tensor/test_redistribute.py is run from a source checkout: DTensor
# redistribution between Shard / Replicate / Partial on 1-D and 2-D meshes of four ranks, and
# backward through it, with exact results under both backends.
DTENSOR_CASES = REPO / "tests" / "e2e" / "torch_programs" / "dtensor_redistribute_cases.py"


def test_dtensor_redistribution_file_passes_under_fakegpu(tmp_path, shim_library):
    results = _run_driver(tmp_path, shim_library, ["--suites", "file", "--test-file", str(DTENSOR_CASES)],
                          [])["dtensor_redistribute_cases"]
    assert len(results["fakegpu"]) == 3
    assert set(results["fakegpu"].values()) == {"passed"}, results["fakegpu"]


def test_a_test_file_that_is_not_there_is_named(tmp_path):
    proc = subprocess.run([sys.executable, str(REPO / "verification" / "torch_suites" / "run.py"),
                           "--suites", "file", "--test-file", str(tmp_path / "missing_test.py")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "missing_test.py" in proc.stderr, proc.stderr
