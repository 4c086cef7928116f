"""torch's own distributed frameworks, unmodified, on fake CUDA devices under fgpu, against the
same program on CPU + gloo (tests/e2e/torch_programs/frameworks.py): ZeroRedundancyOptimizer
(torch.distributed.optim, which TorchScript-compiles at import), torch.distributed.checkpoint's
async save and load of FSDP2 state, and TorchScript / torch.compile models under DDP (issue 30).
Each result is equal, not close: the collectives are exact and the kernels are CPU's on both."""
from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.shim import REPO_ROOT
from helpers.torchrun import TORCH_UNDER_FGPU, fgpu_env, run_fgpu_torchrun, run_reference_torchrun

pytestmark = TORCH_UNDER_FGPU
PROGRAM = REPO_ROOT / "tests" / "e2e" / "torch_programs" / "frameworks.py"
NPROC = 2


def _results(out: Path) -> list[dict]:
    import torch

    return [torch.load(out / f"rank{r}.pt") for r in range(NPROC)]


CASES = ["zero", "dcp", "jit"]


@pytest.fixture(scope="module")
def results(tmp_path_factory, shim_library) -> tuple[list[dict], list[dict]]:
    """Every case in one run of each side (a torchrun's start-up is most of a case's time)."""
    tmp_path = tmp_path_factory.mktemp("frameworks")
    cuda, cpu = tmp_path / "cuda", tmp_path / "cpu"
    cuda.mkdir(), cpu.mkdir()
    launch = ["--standalone", "--nproc-per-node", str(NPROC), str(PROGRAM), ",".join(CASES)]
    run_fgpu_torchrun(tmp_path, fgpu_env(shim_library), ["-q", "--device-count", str(NPROC)],
                      launch + [str(cuda), "cuda"])
    run_reference_torchrun(tmp_path, shim_library, launch + [str(cpu), "cpu"])
    return _results(cuda), _results(cpu)


def _equal(got, want, where=""):
    import torch

    if isinstance(want, torch.Tensor):
        assert torch.equal(got, want), where
    elif isinstance(want, dict):
        assert got.keys() == want.keys(), where
        for key in want:
            _equal(got[key], want[key], f"{where}.{key}")
    elif isinstance(want, list):
        assert len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want)):
            _equal(g, w, f"{where}[{i}]")
    else:
        assert got == want, where


@pytest.mark.parametrize("case", CASES)
def test_framework_equals_cpu_gloo(results, case):
    got, want = results
    for rank in range(NPROC):
        _equal(got[rank][case], want[rank][case], f"rank {rank}")
    if case == "dcp":   # the checkpoint round trip itself, not only its agreement with gloo's
        assert all(r["dcp"]["loaded_equals_saved"] and all(r["dcp"]["loaded_equals_saved"]) for r in got)
    if case == "zero":  # four real optimizer steps on every parameter, consolidated on rank 0
        assert got[0]["zero"]["optimizer_steps"] and set(got[0]["zero"]["optimizer_steps"]) == {4.0}


# --- DeepSpeed ------------------------------------------------------------------------------

DEEPSPEED = REPO_ROOT / "tests" / "e2e" / "torch_programs" / "deepspeed_zero.py"
needs_deepspeed = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                     reason="DeepSpeed is not installed (.ci/run installs it: "
                                            "DS_BUILD_OPS=0 pip install deepspeed)")
ZERO_STAGES = [1, 2, 3]


@pytest.fixture(scope="module")
def deepspeed_results(tmp_path_factory, shim_library) -> tuple[list[dict], list[dict]]:
    tmp_path = tmp_path_factory.mktemp("deepspeed")
    cuda, cpu = tmp_path / "cuda", tmp_path / "cpu"
    cuda.mkdir(), cpu.mkdir()
    stages = ",".join(map(str, ZERO_STAGES))
    launch = ["--standalone", "--nproc-per-node", str(NPROC), str(DEEPSPEED), stages]
    run_fgpu_torchrun(tmp_path, fgpu_env(shim_library), ["-q", "--device-count", str(NPROC)],
                      launch + [str(cuda)])
    run_reference_torchrun(tmp_path, shim_library, launch + [str(cpu)], DS_ACCELERATOR="cpu")
    return _results(cuda), _results(cpu)


@needs_deepspeed
@pytest.mark.parametrize("stage", ZERO_STAGES)
def test_deepspeed_zero_equals_cpu_gloo(deepspeed_results, stage):
    got, want = deepspeed_results
    for rank in range(NPROC):
        assert got[rank][stage]["device_type"] == "cuda" and want[rank][stage]["device_type"] == "cpu"
        _equal(got[rank][stage]["losses"], want[rank][stage]["losses"], f"rank {rank} losses")
        _equal(got[rank][stage]["params"], want[rank][stage]["params"], f"rank {rank} params")
    # the ranks trained on different data and still hold one model (the collectives ran)
    assert got[0][stage]["losses"] != got[1][stage]["losses"]
    _equal(got[0][stage]["params"], got[1][stage]["params"], "rank 0 vs rank 1")


@needs_deepspeed
def test_deepspeed_fused_adam_is_one_line(tmp_path, shim_library):
    """DeepSpeed's FusedAdam is a CUDA extension it JIT-builds: fakegpu says so in one line,
    before any compiler runs, instead of torch's build traceback."""
    proc = subprocess.run(
        [sys.executable, "-m", "fakegpu", "run", "-q", "--device-count", "1", "--",
         sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
         str(DEEPSPEED), "fused", str(tmp_path)],
        cwd=tmp_path, env=fgpu_env(shim_library), capture_output=True, text=True, timeout=300,
        stdin=subprocess.DEVNULL)
    assert proc.returncode != 0
    worker = [line for line in proc.stderr.splitlines() if line.startswith("[rank0]:")]
    assert len(worker) == 1, proc.stderr[-3000:]
    assert "fakegpu: the CUDA extension 'fused_adam'" in worker[0], worker
    assert "CUDA_HOME" not in proc.stderr and "cpp_extension.py" not in proc.stderr
