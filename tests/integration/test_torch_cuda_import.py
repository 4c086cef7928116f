"""torch's CUDA build runs on our libnccl.so.2 when it is LD_PRELOADed.

torch's CUDA libraries NEED libnccl.so.2 and find NVIDIA's through DT_RPATH, which
LD_LIBRARY_PATH cannot override; a preloaded library with the same SONAME satisfies the NEEDED
entry instead. This imports torch 2.14.1 (CUDA build) under the shim and checks that
``torch.cuda.nccl.version()`` reports 2.30.7 and that the calls reach the shim (its unique
ids start with "fakegpu1"). torch's own start-up still maps NVIDIA's copy by path (it preloads the
nvidia-* wheels' libraries), but the preloaded SONAME wins symbol resolution.

It needs a separate virtual environment with that build (about 5.5 GB):
    python -m venv /opt/venv-torch-cuda && /opt/venv-torch-cuda/bin/pip install torch==2.14.1
FAKEGPU_TORCH_CUDA_PYTHON may name another interpreter. Skipped when there is none (CI).
"""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

PYTHON = Path(os.environ.get("FAKEGPU_TORCH_CUDA_PYTHON", "/opt/venv-torch-cuda/bin/python"))

SCRIPT = r"""
import torch
print("version", torch.cuda.nccl.version())
print("cuda_build", torch.version.cuda)
# NVIDIA's library reports 2.30.7 too: our unique ids are what tells the two apart.
print("unique_id", bytes(torch.cuda.nccl.unique_id())[:8])
maps = open("/proc/self/maps").read()
print("nccl_maps", sorted({line.split()[-1] for line in maps.splitlines() if "libnccl" in line}))
"""


def _torch_cuda_python() -> Path:
    if not PYTHON.exists():
        pytest.skip(f"no torch CUDA environment at {PYTHON} (create it with: python -m venv /opt/venv-torch-cuda "
                    "&& /opt/venv-torch-cuda/bin/pip install torch==2.14.1)")
    probe = subprocess.run([str(PYTHON), "-c", "import importlib.util as u; print(u.find_spec('torch') is not None)"],
                           capture_output=True, text=True, timeout=60)
    if probe.stdout.strip() != "True":
        pytest.skip(f"{PYTHON} has no torch installed")
    return PYTHON


def test_torch_cuda_build_imports_under_the_shim(shim_library):
    python = _torch_cuda_python()
    shim = str(Path(shim_library).resolve())
    env = dict(os.environ, LD_PRELOAD=shim)
    env.pop("PYTHONPATH", None)
    proc = subprocess.run([str(python), "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"import torch failed under the shim:\n{proc.stdout}\n{proc.stderr}"
    lines = dict(line.split(" ", 1) for line in proc.stdout.strip().splitlines() if " " in line)
    assert lines.get("version") == "(2, 30, 7)", proc.stdout
    assert lines.get("cuda_build") not in (None, "None"), "this torch is not a CUDA build"
    assert lines.get("unique_id") == repr(b"fakegpu1"), f"torch's NCCL calls do not reach the shim:\n{proc.stdout}"
    mapped = eval(lines["nccl_maps"])  # a list of paths printed by the child  # noqa: S307
    assert shim in mapped, f"libnccl mappings: {mapped}"


HYBRID_SCRIPT = r"""
import ctypes, torch
lib = ctypes.CDLL("libnccl.so.2", mode=4 | ctypes.RTLD_GLOBAL)  # RTLD_NOLOAD: the preloaded shim
lib.ncclGetLastError.restype = ctypes.c_char_p
p = ctypes.c_void_p()
rc = lib.ncclMemAlloc(ctypes.byref(p), 1024)
print("rc", rc)
print("err", lib.ncclGetLastError(None).decode())
"""


def test_hybrid_mode_uses_torchs_cuda_runtime(shim_library):
    """FAKEGPU_MODE=hybrid: ncclMemAlloc goes to cudaMalloc of the runtime torch loaded. Without
    a GPU that call fails, and the failure must be the CUDA runtime's own (not 'no runtime')."""
    python = _torch_cuda_python()
    shim = str(Path(shim_library).resolve())
    env = dict(os.environ, LD_PRELOAD=shim, FAKEGPU_MODE="hybrid")
    env.pop("PYTHONPATH", None)
    proc = subprocess.run([str(python), "-c", HYBRID_SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    lines = dict(line.split(" ", 1) for line in proc.stdout.strip().splitlines() if " " in line)
    if lines.get("rc") == "0":
        return  # a GPU is present: cudaMalloc succeeded
    assert lines.get("rc") == "1", proc.stdout  # ncclUnhandledCudaError
    assert "cudaMalloc failed" in lines["err"], lines["err"]
