"""No desync, by construction (docs/protocol.md "Matching"): every step names its call and its
place in it, so a call that fails -- a rank passing rejected arguments, ranks disagreeing on
count / datatype / op / root, at any staging size, in an arena or at the coordinator -- fails
on every member and leaves them all at the same next call.

Real ranks (tests/helpers/plan_worker.py) on one communicator run plan after plan; every
ncclSuccess result is checked exact against numpy, every failure must be seen by every member
it concerns, and since the communicator is shared by all plans, a call that put the ranks out
of step would corrupt the plans after it.
"""
from __future__ import annotations

import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fakegpu.nccl import DataType, RedOp
from helpers.call_plans import REDUCING, ROOTED, expected_output, failing_ranks
from helpers.coordinator import CoordinatorProcess
from helpers.paths import TESTS
from helpers.ranks import REPO_ROOT, _STRIPPED

WORKER = TESTS / "helpers" / "plan_worker.py"
PLAN_TIMEOUT_S = float(os.environ.get("FAKEGPU_TEST_PLAN_TIMEOUT_S", "120"))


class PlanPool:
    """``nranks`` plan workers on one communicator, each with ``env``; ``run(plan)`` -> the
    per-rank results of the plan's calls."""

    def __init__(self, nranks: int, coordinator: CoordinatorProcess, library: str, env: dict):
        self.nranks = nranks
        self.coordinator = coordinator
        self.dir = Path(tempfile.mkdtemp(prefix="fgpu-plans-"))
        self.k = 0
        child_env = {k: v for k, v in os.environ.items() if k not in _STRIPPED}
        child_env.update(coordinator.client_env)
        child_env.update({"FAKEGPU_NCCL_LIBRARY": library, "FAKEGPU_COORDINATOR_TIMEOUT_MS": "30000",
                          "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))})
        child_env.update(env)
        self.logs = [open(self.dir / f"log-{r}.txt", "w+") for r in range(nranks)]
        self.procs = [subprocess.Popen([sys.executable, str(WORKER), str(self.dir), str(r), str(nranks)],
                                       env=child_env, stdin=subprocess.DEVNULL, stdout=self.logs[r],
                                       stderr=subprocess.STDOUT, cwd=str(REPO_ROOT))
                      for r in range(nranks)]

    def _tails(self) -> str:
        out = []
        for r, log in enumerate(self.logs):
            log.flush()
            text = (self.dir / f"log-{r}.txt").read_text()
            out.append(f"--- rank {r} (exit {self.procs[r].poll()}) ---\n" + "\n".join(text.splitlines()[-12:]))
        return "\n".join(out) + f"\n--- coordinator ---\n{self.coordinator.log(30)}"

    def run(self, plan: list) -> list:
        k = self.k
        self.k += 1
        tmp = self.dir / f".plan-{k}.tmp"
        tmp.write_bytes(pickle.dumps(plan))
        os.replace(tmp, self.dir / f"plan-{k}.pkl")
        deadline = time.monotonic() + PLAN_TIMEOUT_S
        paths = [self.dir / f"result-{k}-{r}.pkl" for r in range(self.nranks)]
        while not all(p.exists() for p in paths):
            if time.monotonic() > deadline or any(p.poll() is not None for p in self.procs):
                raise AssertionError(f"plan {k} did not finish on every rank\n{self._tails()}")
            time.sleep(0.01)
        return [pickle.loads(p.read_bytes()) for p in paths]

    def close(self) -> None:
        (self.dir / "stop").touch()
        for p in self.procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for log in self.logs:
            log.close()
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture(scope="module")
def coordinator():
    with CoordinatorProcess("unix") as c:
        yield c


@pytest.fixture
def pools(coordinator, shim_library):
    made: dict = {}

    def get(nranks: int, **env) -> PlanPool:
        key = (nranks, tuple(sorted(env.items())))
        if key not in made:
            made[key] = PlanPool(nranks, coordinator, shim_library, {k: str(v) for k, v in env.items()})
        return made[key]

    yield get
    for pool in made.values():
        pool.close()


def check_plan(pool: PlanPool, plan: list) -> None:
    """Runs ``plan`` and checks every call on every rank: exact results where no rank passed a
    fault, a failure on every rank the fault concerns."""
    n = pool.nranks
    results = pool.run(plan)
    for i, call in enumerate(plan):
        failing = failing_ranks(call, n)
        for rank in range(n):
            status, value = results[rank][i]
            where = f"call {i} of the plan, rank {rank}: {call}"
            if rank in failing:
                assert status == "error", f"{where}: succeeded although it must fail"
                continue
            assert status == "ok", f"{where}: failed with ncclResult {value}"
            want = expected_output(call, rank, n)
            if want is not None:
                assert value.dtype == want.dtype and value.tobytes() == want.tobytes(), \
                    f"{where}: wrong result {value[:8]}... expected {want[:8]}..."


def _calls(kind: str, count: int, n_calls: int, dtype=DataType.float32, bad_at=None, fault=None,
           bad_rank: int = 1, root: int = 0) -> list:
    return [{"kind": kind, "dtype": int(dtype), "count": count, "op": int(RedOp.sum), "root": root, "seed": i,
             "bad": {bad_rank: fault} if i == bad_at else {}} for i in range(n_calls)]


# ----------------------------------------------------------------------------- the reported cases

@pytest.mark.parametrize("local", ["1", "0"])
def test_short_count_mid_call_leaves_no_leftover_step(pools, local):
    """2 ranks, 64 KiB staging, float32 AllReduce of 32768 elements (two steps); at one call
    rank 1 passes 16384 (one step). Before protocol 2 the other rank's second step paired with
    rank 1's next call: 5 of 8 later calls returned ncclSuccess with half the elements wrong."""
    pool = pools(2, FAKEGPU_STAGING_CHUNK_BYTES=65536, FAKEGPU_LOCAL_COLLECTIVES=local)
    check_plan(pool, _calls("all_reduce", 32768, 9, bad_at=1, fault=("count", 16384)))


def test_short_count_on_large_calls_four_ranks_default_staging(pools):
    """4 ranks, default staging, 64 MiB float32 AllReduce (several steps), one rank short."""
    pool = pools(4)
    check_plan(pool, _calls("all_reduce", 16 << 20, 4, bad_at=1, fault=("count", 8 << 20), bad_rank=2))


@pytest.mark.parametrize("local", ["1", "0"])
@pytest.mark.parametrize("fault", [("bad_dtype",), ("bad_op",), ("null",)], ids=lambda f: f[0])
def test_rejected_argument_on_one_rank_fails_the_call_everywhere(pools, local, fault):
    """One rank passes datatype 99, op 42 or a NULL sendbuff: the shim rejects it locally, and
    its placeholder fails the others' call too (before: it sent nothing, so its next call paired
    with the others' current one and 4 of 8 later calls per rank succeeded with wrong data)."""
    pool = pools(2, FAKEGPU_LOCAL_COLLECTIVES=local)
    check_plan(pool, _calls("all_reduce", 1000, 8, bad_at=2, fault=fault))


@pytest.mark.parametrize("local", ["1", "0"])
def test_root_out_of_range_on_one_rank(pools, local):
    pool = pools(2, FAKEGPU_LOCAL_COLLECTIVES=local)
    check_plan(pool, _calls("broadcast", 1000, 6, bad_at=1, fault=("bad_root",)))


def test_multi_step_send_recv_with_a_short_receiver(pools):
    """A Send of 2 steps against a Recv of 1: the Send's leftover step must not pair with the
    receiver's next Recv."""
    pool = pools(2, FAKEGPU_STAGING_CHUNK_BYTES=65536)
    check_plan(pool, _calls("ring", 32768, 6, bad_at=1, fault=("count", 16384)))


# ----------------------------------------------------------------------------- property

DTYPES = [DataType.int32, DataType.int64, DataType.float16, DataType.float32, DataType.float64]
OPS = [RedOp.sum, RedOp.max, RedOp.min]
KINDS = ["all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter", "ring"]


@st.composite
def plan_calls(draw, nranks: int, max_count: int):
    kind = draw(st.sampled_from(KINDS))
    dtype = draw(st.sampled_from(DTYPES))
    count = draw(st.integers(0, max_count))
    op = draw(st.sampled_from(OPS)) if kind in REDUCING else RedOp.sum
    root = draw(st.integers(0, nranks - 1)) if kind in ROOTED else 0
    call = {"kind": kind, "dtype": int(dtype), "count": count, "op": int(op), "root": root,
            "seed": draw(st.integers(0, 2 ** 16)), "bad": {}}
    faults = ["count", "dtype", "bad_dtype"]
    if kind in REDUCING:
        faults += ["op", "bad_op"]
    if kind in ROOTED:
        faults += ["root", "bad_root"]
    for rank in draw(st.sets(st.integers(0, nranks - 1), max_size=2)) if draw(st.booleans()) else ():
        what = draw(st.sampled_from(faults + (["null"] if count > 0 and (kind != "broadcast" or rank == root)
                                              else [])))
        if what == "count":
            fault = ("count", draw(st.integers(0, max_count).filter(lambda c: c != count)))
        elif what == "dtype":
            fault = ("dtype", int(draw(st.sampled_from([d for d in DTYPES if d != dtype]))))
        elif what == "op":
            fault = ("op", int(draw(st.sampled_from([o for o in OPS if o != op]))))
        elif what == "root":
            fault = ("root", draw(st.integers(0, nranks - 1).filter(lambda r: r != root)))
        else:
            fault = (what,)
        call["bad"][rank] = fault
    return call


# (ranks, environment): random staging sizes, both paths.
CONFIGS = [
    (2, {"FAKEGPU_STAGING_CHUNK_BYTES": 4096}),
    (3, {"FAKEGPU_STAGING_CHUNK_BYTES": 65536, "FAKEGPU_LOCAL_COLLECTIVES": 0}),
    (4, {"FAKEGPU_STAGING_CHUNK_BYTES": 20480}),
]


@pytest.mark.parametrize("nranks, env", CONFIGS, ids=[f"{n}ranks-{e['FAKEGPU_STAGING_CHUNK_BYTES']}" for n, e in CONFIGS])
def test_random_call_sequences_with_random_faults(pools, nranks, env):
    pool = pools(nranks, **env)

    @settings(max_examples=30, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(st.lists(plan_calls(nranks, 6000), min_size=1, max_size=6))
    def check(plan):
        check_plan(pool, plan)

    check()


HANDSHAKE_RANK = r"""
import os, sys, time
from pathlib import Path
import numpy as np
from fakegpu.nccl import DataType, Nccl, NcclError, RedOp
run_dir, rank = Path(sys.argv[1]), int(sys.argv[2])
nccl = Nccl()
comm = nccl.comm_init_rank(2, nccl.shared_unique_id(run_dir / "uid", rank, 60), rank, name="handshake")
buf = np.ones(8, np.float32)
marker = run_dir / "rank0-returned"
if rank == 0:
    try:
        comm.all_reduce(buf, buf, 8, 99, RedOp.sum)          # datatype 99: rejected here
        raise SystemExit("a rejected call succeeded")
    except NcclError as exc:
        assert exc.result == 4, exc                            # ncclInvalidArgument
    marker.touch()                                             # returned before rank 1 called
else:
    deadline = time.monotonic() + 60
    while not marker.exists():
        assert time.monotonic() < deadline, "rank 0's rejected call did not return on its own"
        time.sleep(0.01)
    try:
        comm.all_reduce(buf, buf, 8, DataType.float32, RedOp.sum)
        raise SystemExit("the call rank 0 rejected succeeded on rank 1")
    except NcclError as exc:
        assert exc.result == 5, exc                            # ncclInvalidUsage
out = np.zeros(8, np.float32)
comm.all_reduce(buf, out, 8, DataType.float32, RedOp.sum)      # the next call: both in step
assert out.tolist() == [2.0] * 8, out
comm.destroy()
"""


@pytest.mark.parametrize("local", ["1", "0"])
def test_a_rejected_call_returns_at_once_and_still_fails_the_peers_call(coordinator, shim_library, tmp_path, local):
    """Outside a group the placeholder is posted unanswered: the rejecting rank gets its error at
    once, as from NCCL, even when its peer makes the call only after that (a rank that waited for
    its peers here would never return: the peer waits for it first)."""
    env = {k: v for k, v in os.environ.items() if k not in _STRIPPED}
    env.update(coordinator.client_env)
    env.update({"FAKEGPU_NCCL_LIBRARY": shim_library, "FAKEGPU_LOCAL_COLLECTIVES": local,
                "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))})
    script = tmp_path / "rank.py"
    script.write_text(HANDSHAKE_RANK)
    procs = [subprocess.Popen([sys.executable, str(script), str(tmp_path), str(r)], env=env, cwd=str(REPO_ROOT),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(2)]
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=120)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
    assert [p.returncode for p in procs] == [0, 0], "\n".join(outs)
