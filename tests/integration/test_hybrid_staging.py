"""Hybrid mode's device-buffer staging, checked on CPU with a test-only CUDA runtime.

native/tests/fake_cudart.c is built as ``libcudart.so.12``: "device" memory is host memory
mapped PROT_NONE (the shim touching it directly would crash), and cudaMemcpyAsync copies are
deferred until their stream is synchronized (a shim that reads inputs without waiting for the
caller's stream sees stale data). native/tests/fake_cudart_test.c runs collectives, send/recv,
PreMulSum with a device scalar and ncclMemAlloc on those buffers, one process per rank, through
the real shim and a real coordinator, and checks every result and that copies really went
through the runtime. The runtime is found the three ways the shim supports: global symbols,
a privately (RTLD_LOCAL) loaded library, and loaded by the shim itself (FAKEGPU_MODE=hybrid).
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from helpers.native_programs import build_c_program, run_c_ranks
from helpers.paths import REPO_ROOT as REPO

NATIVE = REPO / "native"

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler")


@pytest.fixture(scope="module")
def built(shim_library, tmp_path_factory):
    """(test binary, directory holding the fake libcudart.so.12)."""
    out = tmp_path_factory.mktemp("hybrid")
    cudart_dir = out / "cudart"
    cudart_dir.mkdir()
    cmd = ["cc", "-std=c11", "-O1", "-Wall", "-shared", "-fPIC", "-fvisibility=hidden",
           "-Wl,-soname,libcudart.so.12", "-o", str(cudart_dir / "libcudart.so.12"),
           str(NATIVE / "tests" / "fake_cudart.c"), "-pthread"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"building fake_cudart.c failed:\n{proc.stderr}"
    binary = build_c_program("fake_cudart_test.c", out / "fake_cudart_test", shim_library, ["-ldl"])
    return binary, cudart_dir


def run_ranks(binary: Path, cudart_dir: Path, nranks: int, coordinator, tmp_path: Path, env_extra: dict,
              timeout_s: float = 120) -> list[str]:
    return run_c_ranks(binary, nranks, coordinator, tmp_path,
                       {"LD_LIBRARY_PATH": str(cudart_dir), **env_extra}, timeout_s)


def counts(out: str) -> dict:
    m = re.search(r"OK d2h=(\d+) h2d=(\d+) syncs=(\d+) pinned=(\d+)", out)
    assert m, out
    return dict(zip(("d2h", "h2d", "syncs", "pinned"), map(int, m.groups())))


@pytest.mark.parametrize("load,extra", [
    ("global", {}),
    ("local", {}),
    # The shim loads it; the path is explicit because a real libcudart.so.13 may be installed.
    ("shim", {"FAKEGPU_MODE": "hybrid", "FAKEGPU_CUDART_PATH": "{cudart_dir}/libcudart.so.12"}),
])
def test_device_buffers_shared_memory(built, start_coordinator, tmp_path, load, extra):
    binary, cudart_dir = built
    coordinator = start_coordinator("unix")
    extra = {k: v.format(cudart_dir=cudart_dir) for k, v in extra.items()}
    # 64 KiB staging: the 70000-float allreduce and the 1500-float per-rank-block calls are
    # cut into steps, so strided device pieces are staged one step at a time.
    outs = run_ranks(binary, cudart_dir, 3, coordinator, tmp_path,
                     {"FAKE_CUDART_LOAD": load, "FAKEGPU_STAGING_CHUNK_BYTES": "64K", **extra})
    for out in outs:
        c = counts(out)
        assert c["syncs"] > 0
        assert c["pinned"] == 1, "the shared-memory staging segment should be registered (pinned) once"


def test_device_buffers_socket_staging(built, start_coordinator, tmp_path):
    binary, cudart_dir = built
    coordinator = start_coordinator("unix")
    outs = run_ranks(binary, cudart_dir, 2, coordinator, tmp_path,
                     {"FAKE_CUDART_LOAD": "local", "FAKEGPU_STAGING_FORCE_SOCKET": "1",
                      "FAKEGPU_STAGING_CHUNK_BYTES": "64K"})
    for out in outs:
        assert counts(out)["pinned"] == 0  # no segment to pin


def test_hybrid_without_runtime_is_a_clear_error(shim_library, tmp_path):
    """FAKEGPU_MODE=hybrid where no libcudart can be found: ncclMemAlloc names the problem."""
    import ctypes
    script = (
        "import ctypes, sys\n"
        f"lib = ctypes.CDLL({str(shim_library)!r})\n"
        "p = ctypes.c_void_p()\n"
        "rc = lib.ncclMemAlloc(ctypes.byref(p), 64)\n"
        "lib.ncclGetLastError.restype = ctypes.c_char_p\n"
        "print(rc, lib.ncclGetLastError(None).decode())\n"
    )
    env = dict(os.environ, FAKEGPU_MODE="hybrid", FAKEGPU_CUDART_PATH=str(tmp_path / "no-such-libcudart.so"))
    proc = subprocess.run([os.environ.get("PYTHON", "python3"), "-c", script], env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    rc, _, msg = proc.stdout.strip().partition(" ")
    assert int(rc) == 1  # ncclUnhandledCudaError
    assert "FAKEGPU_MODE=hybrid needs the CUDA runtime" in msg and "no-such-libcudart.so" in msg
    del ctypes
