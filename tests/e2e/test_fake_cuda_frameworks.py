"""torch's own distributed frameworks, unmodified, on fake CUDA devices under fgpu, against the
same program on CPU + gloo (tests/e2e/torch_programs/frameworks.py): ZeroRedundancyOptimizer
(torch.distributed.optim, which TorchScript-compiles at import), torch.distributed.checkpoint's
async save and load of FSDP2 state, and TorchScript / torch.compile models under DDP (issue 30).
Each result is equal, not close: the collectives are exact and the kernels are CPU's on both."""
from __future__ import annotations

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
