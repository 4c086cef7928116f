"""Every collective x datatype x reduction NCCL defines, on 2, 3, 4 and 8 ranks, through the
real shim and a real coordinator, against numpy references (exact, bit for bit).

All cases of one rank count run in a single set of worker processes (one world communicator),
so the whole matrix costs a few process start-ups; each case is still its own pytest item.
"""
from __future__ import annotations

import pytest

from fakegpu.nccl import DataType
from helpers import data
from helpers.coordinator import CoordinatorProcess
from helpers.ranks import RankRunFailed, run_ranks
from helpers.scenarios import expected_collective

COUNT = 37  # odd and prime: no accidental alignment with anything
REDUCING = ("all_reduce", "reduce", "reduce_scatter")
MOVING = ("broadcast", "bcast", "all_gather", "all_to_all", "gather", "scatter", "send_recv")
IN_PLACE = ("all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter", "gather",
            "scatter")
IN_PLACE_DTYPES = (DataType.uint8, DataType.int64, DataType.float16, DataType.float32,
                   DataType.bfloat16, DataType.float8e5m2)

# variant -> (nranks, extra environment for the ranks)
VARIANTS = {
    "2r": (2, {}),
    "3r": (3, {}),
    "4r": (4, {}),
    "8r": (8, {}),
    "4r-socket": (4, {"FAKEGPU_STAGING_FORCE_SOCKET": "1"}),
}


def _cases(nranks: int) -> list[dict]:
    cases = []
    index = 0

    def add(**params):
        nonlocal index
        params.setdefault("root", index % nranks)
        params.setdefault("seed", index)
        params.setdefault("count", COUNT)
        cases.append(params)
        index += 1

    for kind in REDUCING:
        for dtype in DataType:
            for reduction in data.REDUCTIONS:
                add(kind=kind, dtype=int(dtype), reduction=reduction)
    for kind in MOVING:
        for dtype in DataType:
            add(kind=kind, dtype=int(dtype))
    for kind in IN_PLACE:
        for dtype in IN_PLACE_DTYPES:
            add(kind=kind, dtype=int(dtype), reduction="sum", inplace=True)
    add(kind="all_reduce", dtype=int(DataType.float32), reduction="sum", count=0)
    add(kind="all_reduce", dtype=int(DataType.float64), reduction="avg", count=4099)
    return cases


def _case_id(params: dict) -> str:
    parts = [params["kind"], DataType(params["dtype"]).name]
    if params["kind"] in REDUCING:
        parts.append(params["reduction"])
    if params.get("inplace"):
        parts.append("inplace")
    if params["count"] != COUNT:
        parts.append(f"n{params['count']}")
    return "-".join(parts)


def _all_params():
    for variant, (nranks, _) in VARIANTS.items():
        for i, params in enumerate(_cases(nranks)):
            yield pytest.param(variant, i, params, id=f"{variant}-{_case_id(params)}")


@pytest.fixture(scope="module")
def matrix_runs(shim_library):
    """variant -> the RankRun (or the failure) of that variant's whole case list, run lazily."""
    runs: dict = {}
    coordinators: dict = {}

    def get(variant: str):
        if variant not in runs:
            nranks, env = VARIANTS[variant]
            if "coord" not in coordinators:
                coordinators["coord"] = CoordinatorProcess("unix")
            scenarios = [("collective", params) for params in _cases(nranks)]
            scenarios.append(("staging_info", {}))  # last: which staging path was used
            try:
                runs[variant] = run_ranks(nranks, scenarios, coordinators["coord"],
                                          library=shim_library, env=env, timeout_s=600)
            except RankRunFailed as exc:
                runs[variant] = exc
        result = runs[variant]
        if isinstance(result, Exception):
            raise RankRunFailed(f"the {variant} worker run failed as a whole:\n{result}")
        return result

    yield get
    for coordinator in coordinators.values():
        coordinator.stop()


@pytest.mark.parametrize("variant,index,params", list(_all_params()))
def test_collective_matches_numpy(matrix_runs, variant, index, params):
    run = matrix_runs(variant)
    nranks = run.nranks
    for rank in range(nranks):
        got = run.ok(index, rank)
        expected = expected_collective(nranks, rank, **params)
        assert data.same_bits(got["out"], expected), (
            f"rank {rank} of {nranks}: {data.describe_mismatch(got['out'], expected)}")
        if "send_unchanged" in got:
            assert got["send_unchanged"], f"rank {rank}: the send buffer was modified"


@pytest.mark.parametrize("variant,shared_memory", [("4r", True), ("4r-socket", False)])
def test_matrix_used_the_intended_staging_path(matrix_runs, variant, shared_memory):
    run = matrix_runs(variant)
    for rank, info in enumerate(run.all_ok(len(run.scenarios) - 1)):
        assert bool(info["shm_segments"]) == shared_memory, (rank, info)
