"""The modeled timeline is a property of the program, not of the run: one program, run ten times
with host-local collectives and ten times through the coordinator alone, gives the same modeled
per-rank timeline and makespan every time, and a barrier lines the ranks up (a subgroup allreduce
issued before it is modeled before it, however late its arena reported it). Real rank processes,
the real shim and the real coordinator; each rank sleeps a random moment before every call, so
the order in which calls reach the coordinator changes from run to run.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from fakegpu.common.records import CommRecord, OpRecord
from fakegpu.report.cluster_report import ClusterReport
from fakegpu.topology import default_topology

from helpers.coordinator import CoordinatorProcess
from helpers.ranks import run_ranks

NRANKS = 4
RUNS = 10


def _run(shim_library, tmp_path: Path, i: int, local: bool) -> dict:
    report = tmp_path / f"report-{'local' if local else 'coord'}-{i}.json"
    with CoordinatorProcess("unix", extra_args=("--report", str(report))) as coord:
        run = run_ranks(NRANKS, [("barrier_timeline", {})], coord, library=shim_library,
                        env={} if local else {"FAKEGPU_LOCAL_COLLECTIVES": "0"}, timeout_s=120)
        for rank in range(NRANKS):
            assert run.ok(0, rank)["partner_value"] == rank ^ 1
    return json.loads(report.read_text())


def _per_rank(report: dict) -> dict[int, list[tuple]]:
    """Each rank's operations in modeled order: (kind, members, bytes, start, duration)."""
    out: dict[int, list[tuple]] = {r: [] for r in range(NRANKS)}
    for op in report["timeline"]["operations"]:
        for g in op["global_ranks"]:
            out[g].append((op["kind"], tuple(sorted(op["global_ranks"])), op["logical_bytes"],
                           round(op["modeled_start_s"], 12), round(op["modeled_s"], 12)))
    return {r: sorted(ops, key=lambda o: o[3]) for r, ops in out.items()}


def test_same_program_same_modeled_timeline_local_or_through_the_coordinator(shim_library, tmp_path):
    results = []
    for i in range(RUNS):
        for local in (True, False):
            report = _run(shim_library, tmp_path, i, local)
            assert report["timeline"]["dropped_operations"] == 0
            results.append((local, report["totals"]["modeled_makespan_s"], _per_rank(report)))
    first_makespan, first_timeline = results[0][1], results[0][2]
    for local, makespan, timeline in results[1:]:
        assert makespan == pytest.approx(first_makespan, rel=1e-12), (local, makespan, first_makespan)
        assert timeline == first_timeline, f"{'local' if local else 'coordinator'} run differs"
    # The barrier (a 1-element world allreduce) starts only when pair {0, 1}'s large allreduce,
    # issued before it, has ended on the modeled timeline, on every rank.
    ops0 = first_timeline[0]
    pair_ar = next(o for o in ops0 if o[0] == "AllReduce" and o[1] == (0, 1))
    barrier = next(o for o in ops0 if o[0] == "AllReduce" and o[1] == (0, 1, 2, 3) and o[2] == 4)
    assert barrier[3] >= pair_ar[3] + pair_ar[4] > 0
    for r in (2, 3):
        mine = next(o for o in first_timeline[r] if o[1] == (0, 1, 2, 3) and o[2] == 4)
        assert mine[3] == barrier[3]


def _op(comm: CommRecord, seq: int, count: int, arrived: dict) -> OpRecord:
    return OpRecord(comm=comm, kind="AllReduce", datatype="float32", redop="sum", count=count,
                    elem_size=4, root=-1, peer=-1, ranks=tuple(range(len(comm.global_ranks))),
                    logical_bytes=count * 4, socket_bytes=0, seq=seq, started_at=min(arrived.values()),
                    rendezvous_s=0.0, execution_s=0.0, arrived_at=arrived)


def test_report_places_operations_in_program_order_whatever_order_they_are_recorded():
    """The recorder alone: a subgroup call reported after the barrier that followed it (as an
    arena's LOCAL_OPS batch can be) is still modeled before the barrier."""
    world = CommRecord(1, "world", (0, 1, 2, 3))
    pair = CommRecord(2, "pair", (0, 1))
    sub = _op(pair, 0, 1 << 24, {0: 10.0, 1: 10.1})
    barrier = _op(world, 0, 1, {0: 11.0, 1: 11.0, 2: 10.5, 3: 10.6})
    reports = []
    for order in ((sub, barrier), (barrier, sub)):
        rep = ClusterReport(default_topology(4))
        for op in order:
            rep.op_completed(op)
        reports.append(rep.to_dict())
    a, b = reports
    assert a["totals"]["modeled_makespan_s"] == b["totals"]["modeled_makespan_s"]
    assert [(o["comm_name"], o["modeled_start_s"]) for o in a["timeline"]["operations"]] == \
           [(o["comm_name"], o["modeled_start_s"]) for o in b["timeline"]["operations"]]
    starts = {o["comm_name"]: o for o in b["timeline"]["operations"]}
    assert starts["world"]["modeled_start_s"] == pytest.approx(starts["pair"]["modeled_s"])
    assert [r["modeled_end_s"] for r in b["ranks"]] == [starts["world"]["modeled_start_s"]
                                                        + starts["world"]["modeled_s"]] * 4


def test_calls_of_one_group_run_together_on_the_modeled_timeline():
    """A ring exchange, every rank sending to the next and receiving from the previous in one
    group (pipeline parallelism): one launch per rank, so all four transfers overlap and each
    rank is busy for one transfer, not a chain of four."""
    world = CommRecord(1, "world", (0, 1, 2, 3))

    def p2p(src: int, dst: int, frames: bool) -> OpRecord:
        return OpRecord(comm=world, kind="SendRecv", datatype="float32", redop=None, count=1 << 20,
                        elem_size=4, root=src, peer=dst, ranks=(src, dst), logical_bytes=4 << 20,
                        socket_bytes=0, seq=0, started_at=1.0, rendezvous_s=0.0, execution_s=0.0,
                        arrived_at={src: 1.0 + src * 1e-3, dst: 1.0 + dst * 1e-3},
                        frames={src: (src, 7), dst: (dst, 7)} if frames else {})

    grouped, chained = ClusterReport(default_topology(4)), ClusterReport(default_topology(4))
    for r in (3, 1, 0, 2):   # any recording order
        grouped.op_completed(p2p(r, (r + 1) % 4, True))
        chained.op_completed(p2p(r, (r + 1) % 4, False))
    g, c = grouped.to_dict(), chained.to_dict()
    one = g["timeline"]["operations"][0]["modeled_s"]
    assert [o["modeled_start_s"] for o in g["timeline"]["operations"]] == [0.0] * 4
    assert [r["modeled_end_s"] for r in g["ranks"]] == pytest.approx([one] * 4)
    assert g["totals"]["modeled_makespan_s"] == pytest.approx(one)
    # without the group each rank's two transfers follow each other
    assert c["totals"]["modeled_makespan_s"] > 1.5 * one
