"""torch's CUDA build runs on our libnccl.so.2 when it is LD_PRELOADed.

torch's CUDA libraries NEED libnccl.so.2 and find NVIDIA's through DT_RPATH, which
LD_LIBRARY_PATH cannot override; a preloaded library with the same SONAME satisfies the NEEDED
entry instead. This imports torch 2.14.1 (CUDA build) under the shim and checks that
``torch.cuda.nccl.version()`` reports ours and that NVIDIA's libnccl was never mapped.

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
    mapped = eval(lines["nccl_maps"])  # a list of paths printed by the child  # noqa: S307
    assert mapped == [shim], f"libnccl mappings: {mapped}; only the shim should be loaded"
