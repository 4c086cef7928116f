"""`fgpu -- torchrun ...` from a test: the marks such tests need and one bounded run."""
from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from fakegpu import launcher

from .shim import REPO_ROOT

# Module-level `pytestmark` for tests that run torch under fgpu.
TORCH_UNDER_FGPU = [
    pytest.mark.torch,
    pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed"),
    pytest.mark.skipif(launcher.torch_autoload_dir() is None, reason="fakegpu.torch ships no autoload hook"),
]


def fgpu_env(shim_library: str, **extra: str) -> dict:
    """This environment without any FAKEGPU_ setting, plus the shim under test and the checkout."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FAKEGPU_")}
    env["FAKEGPU_NCCL_LIBRARY"] = shim_library
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
    env.update(extra)
    return env


def run_fgpu_torchrun(cwd: Path, env: dict, fgpu_args: list, torchrun_args: list,
                      timeout_s: float = 300) -> tuple[str, str]:
    """Run `python -m fakegpu run FGPU_ARGS -- python -m torch.distributed.run TORCHRUN_ARGS` in its
    own process group (a hang cannot leave torchrun and its workers behind); fail the test on a
    timeout or a non-zero exit; return stdout and stderr."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "fakegpu", "run", *fgpu_args, "--",
         sys.executable, "-m", "torch.distributed.run", *torchrun_args],
        cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"fgpu -- torchrun did not finish within {timeout_s:g} s:\n" + err[-5000:])
    assert proc.returncode == 0, out[-3000:] + err[-5000:]
    return out, err


def run_reference_torchrun(cwd: Path, shim_library: str, torchrun_args: list,
                           timeout_s: float = 300, **extra_env: str) -> None:
    """Run `python -m torch.distributed.run TORCHRUN_ARGS` as plain torch (CPU + gloo, no fakegpu in
    its processes): the reference a run under fgpu is compared with; fail the test if it fails.

    On a loaded machine torch's own gloo teardown now and then aborts a rank ("terminate called
    without an active exception") after the outputs are saved, and torchrun then stops the other
    rank: that is torch's, not what the tests are about, so the reference is computed again (at
    most three tries); any other failure fails the test at once."""
    env = fgpu_env(shim_library, TORCH_DEVICE_BACKEND_AUTOLOAD="0", **extra_env)
    for _ in range(3):
        done = subprocess.run([sys.executable, "-m", "torch.distributed.run", *torchrun_args],
                              cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout_s,
                              stdin=subprocess.DEVNULL)
        if done.returncode == 0 or "terminate called without an active exception" not in done.stderr:
            break
    assert done.returncode == 0, done.stderr[-5000:]
