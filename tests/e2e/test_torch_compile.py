"""torch.compile of a DDP model on fakegpu (docs/fake-cuda.md, "torch.compile").

DDP's reducer calls the process group from C++ inside the compiled forward; fakegpu's groups
are Python, and dynamo must not try to compile their frames (fakegpu/torch/dynamo_skip.py).
Each run is compared with the hand port on CPU + gloo compiled the same way.  The compile
backend is aot_eager (dynamo and AOT autograd, no C++ code generation) to keep the test short;
inductor goes through the same frames.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from helpers.shim import REPO_ROOT
from helpers.torchrun import TORCH_UNDER_FGPU, fgpu_env, run_fgpu_torchrun, run_reference_torchrun

pytestmark = TORCH_UNDER_FGPU
PROGRAMS = REPO_ROOT / "verification" / "fake_cuda"
COMPILE = "aot_eager"


def _load(out: Path, nproc: int) -> list[dict]:
    import torch

    return [torch.load(out / f"rank{r}.pt") for r in range(nproc)]


def _port(tmp_path: Path, shim_library: str, nproc: int = 2) -> list[dict]:
    out = tmp_path / "port"
    out.mkdir()
    run_reference_torchrun(tmp_path, shim_library,
                           ["--standalone", "--nproc-per-node", str(nproc), str(PROGRAMS / "compile_cpu.py"),
                            str(out), COMPILE, "gloo"])
    return _load(out, nproc)


def _same(got: list[dict], want: list[dict]) -> None:
    import torch

    for rank, (g, w) in enumerate(zip(got, want)):
        assert g["losses"] == w["losses"], rank
        for name in w["params"]:
            assert torch.equal(g["params"][name], w["params"][name]), (rank, name)


def test_compiled_ddp_on_the_fakegpu_backend_equals_gloo(tmp_path, shim_library):
    """The lower-level path: CPU tensors, the fakegpu backend by name, no fake devices."""
    out = tmp_path / "fakegpu"
    out.mkdir()
    run_fgpu_torchrun(tmp_path, fgpu_env(shim_library, FAKEGPU_FAKE_CUDA="0"), ["-q"],
                      ["--standalone", "--nproc-per-node", "2", str(PROGRAMS / "compile_cpu.py"), str(out),
                       COMPILE, "fakegpu"])
    got = _load(out, 2)
    assert all(g["frames_compiled"] >= 1 for g in got)   # dynamo compiled the model
    _same(got, _port(tmp_path, shim_library))


@pytest.mark.parametrize("memory", ["1", "python", "0"], ids=["cpp-tracker", "python-mode", "memory-off"])
def test_compiled_gpu_script_on_fake_devices_equals_its_port(tmp_path, shim_library, memory):
    """Fake CUDA devices.  Under the Python tracking mode torch's dynamo skips the frames
    entered under that user dispatch mode and the model runs eagerly (the port compiles it:
    aot_eager keeps eager's arithmetic here, so the bits agree); with the C++ tracker (a
    dispatch key, not a mode) and with the accounting off, dynamo compiles."""
    out = tmp_path / "fake"
    out.mkdir()
    run_fgpu_torchrun(tmp_path, fgpu_env(shim_library, FAKEGPU_FAKE_CUDA_MEMORY=memory),
                      ["-q", "--device-count", "2"],
                      ["--standalone", "--nproc-per-node", "2", str(PROGRAMS / "compile_gpu.py"), str(out),
                       COMPILE])
    got = _load(out, 2)
    port = _port(tmp_path, shim_library)
    if memory != "python":
        # dynamo compiled at least the frames it compiles in the port (and the fake-CUDA
        # pieces it traces with them, the device-rewrite mode and tensor methods)
        assert all(g["frames_compiled"] >= p["frames_compiled"] > 0 for g, p in zip(got, port))
    _same(got, port)
