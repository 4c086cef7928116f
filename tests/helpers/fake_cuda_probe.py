"""Probes of the fake CUDA runtime (tests/e2e/fake_cuda/probe_*.py): each runs in a fresh
interpreter set up as fgpu sets up a rank (the autoload hook on PYTHONPATH, FAKEGPU_FAKE_CUDA=1),
so the patches never touch the pytest process, and prints one JSON object as its last line."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from .paths import REPO_ROOT, TESTS

AUTOLOAD = REPO_ROOT / "fakegpu" / "torch" / "autoload"
PROBES = TESTS / "e2e" / "fake_cuda"
HAS_TORCH = importlib.util.find_spec("torch") is not None
# Module-level `pytestmark` for tests that read a probe.
NEEDS_TORCH = [pytest.mark.torch, pytest.mark.skipif(not HAS_TORCH, reason="torch is not installed")]


def probe_process(name: str, devices: int, **extra_env: str) -> subprocess.CompletedProcess:
    """Run PROBES/name with ``devices`` fake CUDA devices (and no other FAKEGPU_ setting but
    ``extra_env``'s); returns the finished process."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FAKEGPU_")}
    env.update(PYTHONPATH=os.pathsep.join([str(AUTOLOAD), str(REPO_ROOT)]), FAKEGPU_FAKE_CUDA="1",
               FAKEGPU_DEVICE_COUNT=str(devices), OMP_NUM_THREADS="1")
    env.update(extra_env)
    return subprocess.run([sys.executable, str(PROBES / name)], env=env, capture_output=True, text=True,
                          timeout=180, stdin=subprocess.DEVNULL)


def run_probe(name: str, devices: int, **extra_env: str) -> dict:
    """The probe's JSON object; fails the test on a non-zero exit."""
    done = probe_process(name, devices, **extra_env)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])
