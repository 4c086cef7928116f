"""Run one case of tests/integration/torch_programs/backend_cases.py on N real rank processes, under
gloo or under fakegpu (the real shim and a real coordinator), with a hard time limit."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

from .coordinator import CoordinatorProcess
from .paths import TESTS
from .shim import REPO_ROOT

PROGRAM = TESTS / "integration" / "torch_programs" / "backend_cases.py"
_STRIPPED = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
             "MASTER_PORT", "LD_PRELOAD", "TORCHELASTIC_RESTART_COUNT")


class CaseFailed(AssertionError):
    pass


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_case(case: str, backend: str, nranks: int, *, library: Optional[str] = None,
             timeout_s: float = 120.0) -> list[dict]:
    """Every rank's JSON result; CaseFailed (with the logs) on a non-zero exit or a hang."""
    outdir = Path(tempfile.mkdtemp(prefix=f"fgpu-{case}-"))
    env = {k: v for k, v in os.environ.items() if k not in _STRIPPED and not k.startswith("FAKEGPU_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), WORLD_SIZE=str(nranks),
               OMP_NUM_THREADS="1")
    coordinator = None
    if backend == "fakegpu":
        coordinator = CoordinatorProcess("unix")
        env.update(coordinator.client_env)
        if library:
            env["FAKEGPU_NCCL_LIBRARY"] = library
    procs = []
    try:
        for rank in range(nranks):
            log = open(outdir / f"rank{rank}.log", "w")
            procs.append(subprocess.Popen(
                [sys.executable, str(PROGRAM), case, backend, str(outdir)],
                env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)}, stdout=log,
                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True))
        deadline = time.monotonic() + timeout_s
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            time.sleep(0.05)
        hung = [r for r, p in enumerate(procs) if p.poll() is None]
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        logs = "\n".join(f"--- rank {r} ---\n" + (outdir / f"rank{r}.log").read_text()[-4000:]
                         for r in range(nranks))
        if hung:
            raise CaseFailed(f"{case} under {backend}: ranks {hung} still running after "
                             f"{timeout_s:g} s (hang)\n{logs}")
        failed = [r for r, p in enumerate(procs) if p.returncode != 0]
        if failed:
            raise CaseFailed(f"{case} under {backend}: ranks {failed} exited non-zero\n{logs}")
        return [json.loads((outdir / f"rank{r}.json").read_text()) for r in range(nranks)]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        if coordinator is not None:
            coordinator.stop()
