"""Run a real coordinator and N ranks of native/tests/world_allreduce.c, optionally inside a
private mount namespace whose /dev/shm is a tmpfs of a given size (root only).

    python tests/helpers/world_job.py SPEC.json RESULT.json

runs the job described by SPEC (and is what ``run_world_job`` starts, under ``unshare -m``
when a /dev/shm size is asked for). RESULT holds each rank's exit status and output, the
coordinator's PING status and log (and its exit status, if it died before the ranks ended),
and the files of this job left in /dev/shm.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

_HERE = Path(__file__).resolve()
if __name__ == "__main__":
    sys.path[:0] = [str(_HERE.parents[2]), str(_HERE.parents[1])]

from fakegpu import protocol as P  # noqa: E402
from fakegpu.coordinator.client import SyncClient  # noqa: E402
from fakegpu.processes import wait_all  # noqa: E402

from helpers.coordinator import CoordinatorProcess  # noqa: E402


class NoPrivateShm(RuntimeError):
    """A private /dev/shm cannot be set up here (not root, no unshare, no mount)."""


def private_shm_problem() -> Optional[str]:
    """Why ``run_world_job(..., shm_size=...)`` cannot work here, or None."""
    if os.geteuid() != 0:
        return "needs root to mount a private /dev/shm"
    if shutil.which("unshare") is None:
        return "needs unshare(1)"
    probe = subprocess.run(["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=1m fgpu-probe /dev/shm"],
                           capture_output=True, text=True, timeout=30)
    if probe.returncode != 0:
        return f"cannot mount a tmpfs in a private mount namespace: {probe.stderr.strip()}"
    return None


def run_world_job(binary: Path, nranks: int, *, count: int = 1, iterations: int = 3,
                  shm_size: Optional[str] = None, rank_env: Optional[dict] = None,
                  coordinator_env: Optional[dict] = None, timeout_s: float = 300.0) -> dict:
    """Run the job and return RESULT (see the module docstring). ``shm_size`` (e.g. "260m")
    runs it all in a private mount namespace with a /dev/shm of that size."""
    work = Path(tempfile.mkdtemp(prefix="fgpu-world-"))
    spec = {"binary": str(binary), "nranks": nranks, "count": count, "iterations": iterations,
            "rank_env": rank_env or {}, "coordinator_env": coordinator_env or {},
            "timeout_s": timeout_s}
    (work / "spec.json").write_text(json.dumps(spec))
    job = [sys.executable, str(_HERE), str(work / "spec.json"), str(work / "result.json")]
    if shm_size is not None:
        script = f'mount -t tmpfs -o size={shm_size} fgpu-test /dev/shm && exec "$@"'
        job = ["unshare", "-m", "sh", "-c", script, "world_job", *job]
    try:
        proc = subprocess.run(job, capture_output=True, text=True, timeout=timeout_s + 60)
        result_path = work / "result.json"
        if not result_path.exists():
            raise AssertionError(f"world job wrote no result (exit {proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
        return json.loads(result_path.read_text())
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _status(coord: CoordinatorProcess) -> dict:
    with SyncClient(coord.address, coord.transport) as client:
        return json.loads(client.request(P.Ping(coord.token)).description)


def _main(spec_path: str, result_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    nranks = spec["nranks"]
    work = Path(spec_path).parent
    result: dict = {"shm_size": shutil.disk_usage("/dev/shm").total}
    with CoordinatorProcess("unix", extra_env=spec["coordinator_env"]) as coord:
        procs, logs = [], []
        started = time.monotonic()
        for rank in range(nranks):
            env = dict(os.environ)
            env.update(coord.client_env)
            env.update({"RANK": str(rank), "WORLD_SIZE": str(nranks)})
            env.update(spec["rank_env"])
            log = open(work / f"rank-{rank}.log", "w+")
            logs.append(log)
            procs.append(subprocess.Popen(
                [spec["binary"], str(work / "unique_id"), str(spec["count"]), str(spec["iterations"])],
                env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT))
        result["timed_out"] = not wait_all(procs, spec["timeout_s"])
        result["seconds"] = time.monotonic() - started
        result["returncodes"] = [p.returncode for p in procs]
        outputs = []
        for log in logs:
            log.seek(0)
            outputs.append(log.read())
            log.close()
        result["outputs"] = outputs
        died = coord.proc.poll()         # not None: the coordinator ended before the ranks did
        result["coordinator_died"] = died
        result["status"] = _status(coord) if died is None else None
        coord.stop()
        result["coordinator_log"] = coord.log(400)
    # This job's files only: other jobs may share /dev/shm.
    ours = (f"fakegpu-arena-{coord.proc.pid}-",) + tuple(f"fakegpu-{p.pid}-" for p in procs)
    result["shm_files_after"] = sorted(f for f in os.listdir("/dev/shm") if f.startswith(ours))
    Path(result_path).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1], sys.argv[2]))
