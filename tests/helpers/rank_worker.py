"""One rank of a test run: ``python rank_worker.py RUN_DIR RANK NRANKS``.

Reads the scenario list from RUN_DIR/job.pkl, joins the world communicator (rank 0 makes the
unique id and publishes it as a file), runs every scenario, and writes
RUN_DIR/result-RANK.pkl: a list of ("ok", value) or ("error", text) in scenario order.
"""
from __future__ import annotations

import os
import pickle
import sys
import traceback
from pathlib import Path

_HERE = Path(__file__).resolve()
sys.path[:0] = [str(_HERE.parents[2]), str(_HERE.parents[1])]

from fakegpu.nccl import Nccl, NcclError  # noqa: E402

from helpers.scenarios import SCENARIOS, RankContext  # noqa: E402

UID_WAIT_S = float(os.environ.get("FAKEGPU_TEST_UID_WAIT_S", "120"))


def make_exchange(run_dir: Path, rank: int, nccl: Nccl):
    def exchange(tag: str) -> bytes:
        return nccl.shared_unique_id(run_dir / f"uid-{tag}", rank, UID_WAIT_S)

    return exchange


def main(argv: list[str]) -> int:
    run_dir, rank, nranks = Path(argv[0]), int(argv[1]), int(argv[2])
    job = pickle.loads((run_dir / "job.pkl").read_bytes())
    nccl = Nccl()
    exchange = make_exchange(run_dir, rank, nccl)
    comm = nccl.comm_init_rank(nranks, exchange("world"), rank, name="test-world")
    ctx = RankContext(nccl, comm, rank, nranks, exchange)
    results = []
    for index, (name, params) in enumerate(job):
        print(f"rank {rank}: scenario {index} {name} {params}", file=sys.stderr, flush=True)
        try:
            results.append(("ok", SCENARIOS[name](ctx, **params)))
        except NcclError as exc:
            results.append(("error", f"{exc}\n{traceback.format_exc()}"))
        except Exception:  # reported to the test, which fails that one scenario
            results.append(("error", traceback.format_exc()))
    comm.destroy()
    tmp = run_dir / f".result-{rank}.tmp"
    tmp.write_bytes(pickle.dumps(results, protocol=pickle.HIGHEST_PROTOCOL))
    os.replace(tmp, run_dir / f"result-{rank}.pkl")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
