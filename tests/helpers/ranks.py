"""Start N rank worker processes against a coordinator, run scenarios, collect the results."""
from __future__ import annotations

import os
import pickle
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

from fakegpu.processes import wait_all

from .coordinator import CoordinatorProcess
from .shim import REPO_ROOT

WORKER = Path(__file__).resolve().parent / "rank_worker.py"
_STRIPPED = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
             "LD_PRELOAD")

Scenario = tuple[str, dict]


class RankRunFailed(AssertionError):
    pass


@dataclass
class RankRun:
    """Results of one run: ``outcomes[rank][i]`` for scenario ``i``."""

    scenarios: Sequence[Scenario]
    outcomes: list[list[tuple[str, Any]]]
    logs: list[str]

    @property
    def nranks(self) -> int:
        return len(self.outcomes)

    def ok(self, index: int, rank: int) -> Any:
        """The value scenario ``index`` returned on ``rank``; fails the test if it raised."""
        status, value = self.outcomes[rank][index]
        if status != "ok":
            name, params = self.scenarios[index]
            raise RankRunFailed(f"scenario {name} {params} failed on rank {rank}:\n{value}")
        return value

    def all_ok(self, index: int) -> list[Any]:
        return [self.ok(index, r) for r in range(self.nranks)]


def run_ranks(nranks: int, scenarios: Sequence[Scenario], coordinator: CoordinatorProcess, *,
              library: str, env: Optional[dict] = None, timeout_s: float = 300.0,
              op_timeout_ms: int = 30000) -> RankRun:
    """Run ``scenarios`` (in order) on ``nranks`` fresh worker processes.

    Every worker gets the coordinator's client environment plus ``env``.  The whole run is
    bounded by ``timeout_s``; on expiry every worker is killed and the error shows the last
    lines each one printed (which scenario it was in) and the coordinator's log.
    """
    run_dir = Path(tempfile.mkdtemp(prefix="fgpu-ranks-"))
    (run_dir / "job.pkl").write_bytes(pickle.dumps(list(scenarios)))
    child_env = {k: v for k, v in os.environ.items() if k not in _STRIPPED}
    child_env.update(coordinator.client_env)
    child_env["FAKEGPU_NCCL_LIBRARY"] = library
    child_env["FAKEGPU_COORDINATOR_TIMEOUT_MS"] = str(op_timeout_ms)
    child_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT),
                                                            os.environ.get("PYTHONPATH")]))
    child_env.update(env or {})
    procs, logs = [], []
    for rank in range(nranks):
        log = open(run_dir / f"log-{rank}.txt", "w+")
        logs.append(log)
        procs.append(subprocess.Popen([sys.executable, str(WORKER), str(run_dir), str(rank),
                                       str(nranks)], env=child_env, stdin=subprocess.DEVNULL,
                                      stdout=log, stderr=subprocess.STDOUT, cwd=str(REPO_ROOT)))
    timed_out = not wait_all(procs, timeout_s)
    texts = []
    for log in logs:
        log.seek(0)
        texts.append(log.read())
        log.close()
    failed = [r for r, p in enumerate(procs) if p.returncode != 0]
    if timed_out or failed:
        what = f"timed out after {timeout_s} s" if timed_out else f"ranks {failed} failed"
        tails = "\n".join(f"--- rank {r} (exit {procs[r].returncode}) ---\n{_tail(t)}"
                          for r, t in enumerate(texts))
        raise RankRunFailed(f"{nranks}-rank run {what}\n{tails}\n--- coordinator "
                            f"({'alive' if coordinator.alive() else 'exited'}) ---\n"
                            f"{coordinator.log(40)}")
    outcomes = [pickle.loads((run_dir / f"result-{r}.pkl").read_bytes()) for r in range(nranks)]
    for path in run_dir.iterdir():
        path.unlink()
    run_dir.rmdir()
    return RankRun(list(scenarios), outcomes, texts)


def _tail(text: str, lines: int = 25) -> str:
    return "\n".join(text.splitlines()[-lines:])
