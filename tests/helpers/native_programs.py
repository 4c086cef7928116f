"""Build the C test programs in native/tests against the shim under test, and run them as ranks."""
from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

NATIVE = Path(__file__).resolve().parents[2] / "native"


def build_c_program(source_name: str, out: Path, shim_library, extra_args=()) -> Path:
    """Compile native/tests/<source_name> against our nccl.h, linked to the shim under test.

    It links through a private directory whose libnccl.so.2 is that shim, so the binary's
    NEEDED entry and rpath can only ever resolve to it.
    """
    libdir = out.parent / f"{out.name}-lib"
    libdir.mkdir(parents=True, exist_ok=True)
    link = libdir / "libnccl.so.2"
    if not link.exists():
        link.symlink_to(Path(shim_library))
    cmd = ["cc", "-std=c11", "-D_DEFAULT_SOURCE", "-O1", "-Wall", "-pthread",
           "-Werror=implicit-function-declaration", f"-I{NATIVE / 'include'}",
           str(NATIVE / "tests" / source_name), "-o", str(out), str(link),
           f"-Wl,-rpath,{libdir}", *extra_args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"compiling {source_name} failed:\n{proc.stderr}"
    return out


def run_c_ranks(binary: Path, nranks: int, coordinator, tmp_path: Path, extra_env=None,
                timeout_s: float = 120) -> list[str]:
    """Run ``binary UNIQUE_ID_FILE`` once per rank; each must exit 0 and print '<name> rank R: OK'."""
    uid = tmp_path / "unique_id"
    procs = []
    for rank in range(nranks):
        env = dict(os.environ)
        env.update(coordinator.client_env)
        env.update({"RANK": str(rank), "WORLD_SIZE": str(nranks), "LOCAL_RANK": str(rank)})
        env.update(extra_env or {})
        procs.append(subprocess.Popen([str(binary), str(uid)], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    deadline = time.monotonic() + timeout_s
    outputs = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail(f"{binary.name} ranks did not finish in {timeout_s} s\n{coordinator.log()}")
        outputs.append((p.returncode, out))
    for rank, (rc, out) in enumerate(outputs):
        assert rc == 0, f"rank {rank} exited {rc}:\n{out}\ncoordinator log:\n{coordinator.log()}"
        assert f"{binary.name} rank {rank}: OK" in out, out
    return [out for _, out in outputs]
