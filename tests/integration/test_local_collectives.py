"""Host-local collectives: a call alone in its group, on a communicator whose members all share
the coordinator's host, runs among the rank processes in a shared-memory arena (docs/protocol.md,
"Host-local collectives"). These tests run real rank processes through the real shim and
coordinator and check that the arena path gives the numpy reference's exact bits, that the
coordinator still accounts every call, and that everything that does not fit the arena (calls
grouped on some ranks only, a rank that never comes) ends exactly as it does without arenas.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from fakegpu import protocol as P
from fakegpu.coordinator.client import SyncClient
from fakegpu.nccl import DataType

from helpers import data
from helpers.coordinator import CoordinatorProcess
from helpers.ranks import run_ranks
from helpers.scenarios import expected_collective

NRANKS = 4
SLOT = 4096   # tiny slots: every call below takes several rounds through the arena

CASES = [
    # small: every member reduces the whole round itself
    dict(kind="all_reduce", dtype=int(DataType.float32), count=1, reduction="sum"),
    dict(kind="all_reduce", dtype=int(DataType.bfloat16), count=3001, reduction="avg", inplace=True),
    dict(kind="all_reduce", dtype=int(DataType.int8), count=5000, reduction="sum"),
    dict(kind="all_reduce", dtype=int(DataType.float8e4m3), count=777, reduction="premul_host"),
    dict(kind="all_reduce", dtype=int(DataType.float16), count=2049, reduction="premul_device"),
    dict(kind="all_reduce", dtype=int(DataType.int64), count=0, reduction="prod"),
    # above 64 KiB per rank: slices in the shared output slot, pipelined rounds
    dict(kind="all_reduce", dtype=int(DataType.float32), count=40_000, reduction="sum"),
    dict(kind="all_reduce", dtype=int(DataType.float64), count=20_001, reduction="max", inplace=True),
    dict(kind="reduce", dtype=int(DataType.float32), count=30_000, reduction="min", root=2),
    dict(kind="reduce", dtype=int(DataType.uint8), count=100, reduction="sum", root=3, inplace=True),
    dict(kind="broadcast", dtype=int(DataType.float64), count=5000, root=1),
    dict(kind="broadcast", dtype=int(DataType.int32), count=17, root=0, inplace=True),
    dict(kind="all_gather", dtype=int(DataType.float32), count=2500),
    dict(kind="all_gather", dtype=int(DataType.uint64), count=9, inplace=True),
    dict(kind="reduce_scatter", dtype=int(DataType.float32), count=1500, reduction="sum"),
    dict(kind="reduce_scatter", dtype=int(DataType.bfloat16), count=333, reduction="avg", inplace=True),
]


def _status(coord: CoordinatorProcess) -> dict:
    with SyncClient(coord.address, coord.transport) as client:
        return json.loads(client.request(P.Ping(coord.token)).description)


def _arena_files(coord: CoordinatorProcess) -> list[str]:
    pid = coord.proc.pid
    return [f for f in os.listdir("/dev/shm") if f.startswith(f"fakegpu-arena-{pid}-")]


def _run_cases(shim_library, tmp_path: Path, local: bool):
    report = tmp_path / "report.json"
    env = {"FAKEGPU_LOCAL_SLOT_BYTES": str(SLOT)}
    with CoordinatorProcess("unix", extra_env=env, extra_args=("--report", str(report))) as coord:
        scenarios = [("collective", dict(case, seed=i)) for i, case in enumerate(CASES)]
        run = run_ranks(NRANKS, scenarios, coord, library=shim_library,
                        env={} if local else {"FAKEGPU_LOCAL_COLLECTIVES": "0"})
        status = _status(coord)
        leftover = _arena_files(coord)
    for i, case in enumerate(CASES):
        for rank in range(NRANKS):
            got = run.ok(i, rank)["out"]
            want = expected_collective(NRANKS, rank, **dict(case, seed=i))
            assert data.same_bits(got, want), f"{case} rank {rank}: {data.describe_mismatch(got, want)}"
    return status, json.loads(report.read_text()), leftover


def test_arena_calls_give_the_reference_bits_and_are_accounted(shim_library, tmp_path):
    status, report, leftover = _run_cases(shim_library, tmp_path, local=True)
    # Every case ran in the world communicator's arena, and rank 0 told the coordinator.
    assert status["arenas"] == 1
    assert status["local_ops"] == len(CASES)
    assert leftover == []         # the arena file went with the communicator
    kinds = {"all_reduce": "AllReduce", "reduce": "Reduce", "broadcast": "Broadcast",
             "all_gather": "AllGather", "reduce_scatter": "ReduceScatter"}
    for name, kind in kinds.items():
        want = sum(1 for c in CASES if c["kind"] == name)
        assert report["collectives"][kind]["calls"] >= want, kind


def test_switched_off_everything_goes_through_the_coordinator(shim_library, tmp_path):
    status, _, _ = _run_cases(shim_library, tmp_path, local=False)
    assert status["arenas"] == 0 and status["local_ops"] == 0


def test_calls_grouped_on_some_ranks_only_still_complete(shim_library):
    with CoordinatorProcess("unix") as coord:
        run = run_ranks(NRANKS, [("grouped_on_some_ranks", {})], coord, library=shim_library,
                        timeout_s=120)
        status = _status(coord)
    total = sum(range(1, NRANKS + 1))
    for rank in range(NRANKS):
        out = run.ok(0, rank)
        assert (out["a"] == total).all() and (out["b"] == 10 * total).all()
        assert (out["c"] == np.arange(1000, dtype=np.int32) * total).all()
    # The world arena was given up when the odd ranks' group reached the coordinator.
    assert status["arenas"] >= 1


def test_a_rank_that_never_comes_times_out_like_before(shim_library):
    timeout_ms = 1000
    with CoordinatorProcess("unix", extra_env={"FAKEGPU_COORDINATOR_TIMEOUT_MS": str(timeout_ms)}) as coord:
        run = run_ranks(NRANKS, [("missing_rank", {"absent": 1, "hold_s": 6.0})], coord,
                        library=shim_library, op_timeout_ms=timeout_ms, timeout_s=120)
    for rank in range(NRANKS):
        out = run.ok(0, rank)
        if rank == 1:
            assert out["error"] is None
            continue
        err = out["error"]
        assert err is not None and err["name"] == "ncclTimeout", err
        assert "did not arrive" in err["message"] and "[1]" in err["message"], err["message"]
        # The arena waits one timeout, then the coordinator another: bounded, never a hang.
        assert out["seconds"] < 5.5
