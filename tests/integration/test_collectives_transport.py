"""Payload paths: 64 MiB calls cut into many steps by a small staging size (shared memory and
socket staging), groups larger than the staging regions (partial GROUP frames), and the same
collectives over a TCP coordinator."""
from __future__ import annotations

import pytest

from fakegpu.nccl import DataType
from helpers import data
from helpers.scenarios import expected_collective

MIB = 1 << 20
SMALL_STAGING = {"FAKEGPU_STAGING_CHUNK_BYTES": str(1 * MIB)}
SOCKET = {"FAKEGPU_STAGING_FORCE_SOCKET": "1"}


@pytest.mark.parametrize("staging", ["shm", "socket"])
def test_64mib_payloads_in_small_chunks(start_coordinator, ranks, staging):
    env = dict(SMALL_STAGING, **(SOCKET if staging == "socket" else {}))
    coordinator = start_coordinator("unix")
    scenarios = [
        ("staging_info", {}),
        ("large_allreduce", {"nbytes": 64 * MIB}),
        ("large_allreduce", {"nbytes": 64 * MIB, "inplace": True}),
        ("large_mixed_group", {"nbytes": 64 * MIB}),
    ]
    run = ranks(2, scenarios, coordinator, env=env, timeout_s=400, op_timeout_ms=120000)
    _assert_staging(run, shared_memory=(staging == "shm"))
    for index, (name, params) in enumerate(scenarios[1:], start=1):
        for rank, got in enumerate(run.all_ok(index)):
            assert got["wrong"] == 0, f"{name} {params} rank {rank}: {got['wrong']} wrong"
    assert coordinator.alive()


def _assert_staging(run, *, shared_memory: bool, index: int = 0) -> None:
    """Prove which staging path the ranks used: a shm segment is mapped only with shared memory."""
    for rank, info in enumerate(run.all_ok(index)):
        if shared_memory:
            assert info["shm_segments"], f"rank {rank} maps no /dev/shm staging segment"
        else:
            assert not info["shm_segments"], f"rank {rank} maps {info['shm_segments']}"


def test_partial_groups_on_four_ranks(start_coordinator, ranks):
    """A 16 MiB all-gather + ring + allreduce group through 1 MiB regions on 4 ranks."""
    coordinator = start_coordinator("unix")
    run = ranks(4, [("large_mixed_group", {"nbytes": 16 * MIB})], coordinator,
                env=SMALL_STAGING, timeout_s=300, op_timeout_ms=120000)
    assert [got["wrong"] for got in run.all_ok(0)] == [0, 0, 0, 0]


SMALL_CASES = [
    {"kind": "all_reduce", "dtype": int(DataType.float32), "reduction": "sum", "count": 1000},
    {"kind": "all_reduce", "dtype": int(DataType.bfloat16), "reduction": "premul_device",
     "count": 33},
    {"kind": "reduce", "dtype": int(DataType.int32), "reduction": "max", "count": 77, "root": 1},
    {"kind": "broadcast", "dtype": int(DataType.float64), "count": 10, "root": 1},
    {"kind": "all_gather", "dtype": int(DataType.uint8), "count": 301},
    {"kind": "reduce_scatter", "dtype": int(DataType.float16), "reduction": "avg", "count": 9},
    {"kind": "all_to_all", "dtype": int(DataType.int64), "count": 5},
    {"kind": "gather", "dtype": int(DataType.float8e4m3), "count": 12, "root": 0},
    {"kind": "scatter", "dtype": int(DataType.uint32), "count": 12, "root": 1},
    {"kind": "send_recv", "dtype": int(DataType.float32), "count": 4096},
]


def _check_small(run, nranks):
    for index, params in enumerate(SMALL_CASES):
        for rank, got in enumerate(run.all_ok(index)):
            expected = expected_collective(nranks, rank, **params)
            assert data.same_bits(got["out"], expected), (
                f"{params} rank {rank}: {data.describe_mismatch(got['out'], expected)}")


def test_collectives_over_tcp(start_coordinator, ranks):
    coordinator = start_coordinator("tcp")
    scenarios = [("collective", params) for params in SMALL_CASES]
    scenarios.append(("large_allreduce", {"nbytes": 16 * MIB}))
    scenarios.append(("staging_info", {}))
    run = ranks(2, scenarios, coordinator, timeout_s=300)
    _check_small(run, 2)
    assert [got["wrong"] for got in run.all_ok(len(SMALL_CASES))] == [0, 0]
    _assert_staging(run, shared_memory=False, index=len(SMALL_CASES) + 1)  # TCP: socket only


def test_socket_staging_with_tiny_chunks(start_coordinator, ranks):
    """Every small case cut into many steps: 4 KiB staging over the socket path."""
    coordinator = start_coordinator("unix")
    run = ranks(3, [("collective", params) for params in SMALL_CASES] + [("staging_info", {})],
                coordinator, env={"FAKEGPU_STAGING_CHUNK_BYTES": "4096", **SOCKET},
                timeout_s=300)
    _check_small(run, 3)
    _assert_staging(run, shared_memory=False, index=len(SMALL_CASES))
