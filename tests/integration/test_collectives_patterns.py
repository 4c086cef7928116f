"""Groups of 100+ calls, nested groups, groups spanning communicators, splits, pair-only
Send/Recv, uneven all-to-all from grouped Send/Recv, non-blocking init, CommInitAll, and
argument errors that fail one call without harming the communicator.

Scenarios for one rank count share one set of worker processes (see helpers/scenarios.py).
"""
from __future__ import annotations

import time

import numpy as np
import pytest

from fakegpu.nccl import DataType, Result
from helpers import data
from helpers.coordinator import CoordinatorProcess
from helpers.ranks import RankRunFailed, run_ranks
from helpers.scenarios import expected_collective, group_plan, per_rank_scalar, uneven_counts

# (rank count, scenario list); tests refer to scenarios by (nranks, name).
PLANS = {
    4: [
        ("comm_info", {}),
        ("big_group", {"n_calls": 120, "nested": True, "span_split": True}),
        ("big_group", {"n_calls": 300, "nested": False, "span_split": False}),
        ("split", {}),
        ("pair_sendrecv", {"count": 1000, "rounds": 3}),
        ("uneven_alltoall", {"dtype": int(DataType.float32)}),
        ("uneven_alltoall", {"dtype": int(DataType.bfloat16)}),
        ("argument_errors", {}),
        ("nonblocking_init", {}),
        ("mem_alloc_buffers", {"count": 1000}),
    ] + [("premul_per_rank", {"dtype": int(d), "device": dev, "kind": kind})
         for d in DataType for dev in (False, True)
         for kind in ("all_reduce", "reduce_scatter", "reduce")],
    3: [
        ("peer_aborts", {"victim": 1}),
        ("split", {"nocolor_rank": 2}),
        ("uneven_alltoall", {"dtype": int(DataType.int64)}),
        ("big_group", {"n_calls": 101, "nested": True, "span_split": True}),
        ("big_group", {"n_calls": 1000, "nested": False, "span_split": True}),
        ("argument_errors", {}),
    ],
    1: [
        ("init_all_in_one_process", {"ndev": 3}),
    ],
}


def _index(nranks: int, name: str, **params) -> int:
    for i, (scenario_name, scenario_params) in enumerate(PLANS[nranks]):
        if scenario_name == name and all(scenario_params.get(k) == v for k, v in params.items()):
            return i
    raise KeyError((nranks, name, params))


@pytest.fixture(scope="module")
def plan_runs(shim_library):
    runs: dict = {}
    coordinator = CoordinatorProcess("unix")

    def get(nranks: int):
        if nranks not in runs:
            try:
                runs[nranks] = run_ranks(nranks, PLANS[nranks], coordinator,
                                         library=shim_library, timeout_s=300,
                                         op_timeout_ms=20000)
            except RankRunFailed as exc:
                runs[nranks] = exc
        if isinstance(runs[nranks], Exception):
            raise RankRunFailed(f"the {nranks}-rank run failed as a whole:\n{runs[nranks]}")
        return runs[nranks]

    yield get
    coordinator.stop()


def test_comm_info(plan_runs):
    run = plan_runs(4)
    infos = run.all_ok(_index(4, "comm_info"))
    assert [i["rank"] for i in infos] == [0, 1, 2, 3]
    assert all(i["size"] == 4 for i in infos)
    assert all(i["version"] == 23007 for i in infos)


@pytest.mark.parametrize("nranks,n_calls", [(4, 120), (4, 300), (3, 101), (3, 1000)])
def test_big_group(plan_runs, nranks, n_calls):
    run = plan_runs(nranks)
    index = _index(nranks, "big_group", n_calls=n_calls)
    plan = group_plan(n_calls, nranks)
    for rank, got in enumerate(run.all_ok(index)):
        assert got["deferred"], "calls ran before the outermost GroupEnd"
        assert len(got["outs"]) == n_calls
        for call, out in zip(plan, got["outs"]):
            expected = expected_collective(nranks, rank, **call)
            assert data.same_bits(out, expected), (
                f"rank {rank}, call {call}: {data.describe_mismatch(out, expected)}")


def test_split_colour_and_key(plan_runs):
    run = plan_runs(4)
    infos = run.all_ok(_index(4, "split", nocolor_rank=None))
    for rank, info in enumerate(infos):
        assert not info["none"]
        assert info["size"] == 2
        # key = -rank: the higher world rank comes first in the new communicator.
        members = [r for r in (3, 2, 1, 0) if r % 2 == rank % 2]
        assert info["rank"] == members.index(rank)
        assert list(info["members"]) == members
        assert list(info["sum"]) == [sum(m + 1 for m in members), 10 * sum(m + 1 for m in members)]


def test_split_nocolor_gives_none(plan_runs):
    run = plan_runs(3)
    infos = run.all_ok(_index(3, "split", nocolor_rank=2))
    assert infos[2] == {"none": True}
    assert infos[0]["size"] == 1 and infos[1]["size"] == 1
    assert list(infos[0]["sum"]) == [1, 10] and list(infos[1]["sum"]) == [2, 20]


def test_pair_only_sendrecv(plan_runs):
    run = plan_runs(4)
    got = run.all_ok(_index(4, "pair_sendrecv"))
    for rank in (0, 1):
        for i, theirs in enumerate(got[rank]["got"]):
            expected = data.make_input(500 + i, 1 - rank, DataType.float32, 1000)
            assert data.same_bits(theirs, expected), data.describe_mismatch(theirs, expected)
    assert got[2]["got"] == [] and got[3]["got"] == []


@pytest.mark.parametrize("nranks,dtype", [(4, DataType.float32), (4, DataType.bfloat16),
                                          (3, DataType.int64)])
def test_uneven_alltoall(plan_runs, nranks, dtype):
    run = plan_runs(nranks)
    got = run.all_ok(_index(nranks, "uneven_alltoall", dtype=int(dtype)))
    assert any(uneven_counts(nranks, i, j) == 0 for i in range(nranks) for j in range(nranks))
    for rank in range(nranks):
        for sender in range(nranks):
            expected = data.make_input(700 + rank, sender, dtype,
                                       uneven_counts(nranks, sender, rank))
            actual = got[rank]["recvs"][sender]
            assert data.same_bits(actual, expected), (
                f"rank {rank} from {sender}: {data.describe_mismatch(actual, expected)}")


LOCAL_ERRORS = ("bad_datatype", "bad_redop", "root_out_of_range", "negative_root",
                "peer_out_of_range", "null_buffer", "destroyed_premul")
MISMATCHES = ("count_mismatch", "dtype_mismatch")


@pytest.mark.parametrize("nranks", [4, 3])
@pytest.mark.parametrize("case", LOCAL_ERRORS + MISMATCHES)
def test_argument_error_fails_only_that_call(plan_runs, nranks, case):
    run = plan_runs(nranks)
    for rank, results in enumerate(run.all_ok(_index(nranks, "argument_errors"))):
        outcome = results[case]
        assert outcome["error"] is not None, f"rank {rank}: {case} was accepted"
        if case in MISMATCHES:
            assert outcome["error"]["result"] == Result.invalid_usage, outcome["error"]
        else:
            assert outcome["error"]["result"] in (Result.invalid_argument,
                                                  Result.invalid_usage), outcome["error"]
        assert outcome["error"]["message"].count(":") >= 1
        assert outcome["alive"], f"rank {rank}: the communicator stopped working after {case}"


def test_mismatch_message_lists_members(plan_runs):
    run = plan_runs(4)
    message = run.ok(_index(4, "argument_errors"), 0)["count_mismatch"]["error"]["message"]
    assert "4" in message and "5" in message, message


def test_nonblocking_init(plan_runs):
    run = plan_runs(4)
    for rank, info in enumerate(run.all_ok(_index(4, "nonblocking_init"))):
        assert info["first_state"] in (Result.success, Result.in_progress)
        assert (info["rank"], info["size"], info["sum"]) == (rank, 4, 6)


def test_comm_init_all(plan_runs):
    run = plan_runs(1)
    info = run.ok(_index(1, "init_all_in_one_process"), 0)
    assert info["ranks"] == [0, 1, 2] and info["sizes"] == [3, 3, 3]
    for out in info["outs"]:
        assert np.array_equal(out, np.full(5, 6.0))


def test_mem_alloc_buffers(plan_runs):
    run = plan_runs(4)
    for out in (got["out"] for got in run.all_ok(_index(4, "mem_alloc_buffers"))):
        assert np.array_equal(out, np.arange(1000) * 10.0)


@pytest.mark.parametrize("kind", ["all_reduce", "reduce_scatter", "reduce"])
@pytest.mark.parametrize("device", [False, True], ids=["host", "device"])
@pytest.mark.parametrize("dtype", list(DataType), ids=lambda d: d.name)
def test_premul_sum_with_a_different_scalar_per_rank(plan_runs, dtype, device, kind):
    run = plan_runs(4)
    n, count = 4, 53
    got = run.all_ok(_index(4, "premul_per_rank", dtype=int(dtype), device=device, kind=kind))
    sends = [data.make_input(900, r, dtype, count * (n if kind == "reduce_scatter" else 1))
             for r in range(n)]
    total = data.reduce_arrays(sends, dtype, "premul",
                               scalar=[per_rank_scalar(dtype, r) for r in range(n)])
    for rank in range(n):
        if kind == "all_reduce":
            expected = total
        elif kind == "reduce_scatter":
            expected = total[rank * count:(rank + 1) * count]
        else:
            expected = total if rank == n - 1 else data.sentinel(dtype, count)
        out = got[rank]["out"]
        assert data.same_bits(out, expected), f"rank {rank}: {data.describe_mismatch(out, expected)}"


def test_peer_abort_fails_the_others_promptly(plan_runs):
    run = plan_runs(3)
    got = run.all_ok(_index(3, "peer_aborts"))
    assert got[1] == {"aborted": True}
    for rank in (0, 2):
        error = got[rank]["error"]
        assert error is not None, f"rank {rank}: allreduce succeeded without rank 1"
        assert error["result"] in (Result.remote_error, Result.invalid_usage), error
        assert "rank 1" in error["message"], error
        assert got[rank]["seconds"] < 10, got[rank]  # far below the 20 s operation timeout


def test_dead_rank_fails_the_run_quickly(start_coordinator, ranks):
    coordinator = start_coordinator("unix")
    start = time.monotonic()
    with pytest.raises(RankRunFailed, match=r"rank 1 \(exit 7\)"):
        ranks(3, [("rank_dies", {"victim": 1})], coordinator, op_timeout_ms=120000,
              timeout_s=200)
    assert time.monotonic() - start < 60, "a dead rank kept the others waiting"
    assert coordinator.alive()
