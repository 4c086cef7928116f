"""Whole-world accounting: replica tiling, report totals, shape-shared estimates, event files."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from fakegpu import costmodel
from fakegpu.common.records import CommRecord, OpRecord
from fakegpu.fake.cluster import uniform_cluster, uniform_cluster_yaml
from fakegpu.fake.events import EventFormatError, EventLog, read_events, replay
from fakegpu.fake.world import WorldAccountant, replica_groups
from fakegpu.report.check import check_report
from fakegpu.report.cluster_report import ClusterReport
from helpers.paths import REPO_ROOT as ROOT



@pytest.fixture(scope="module")
def topo64():
    return uniform_cluster(8, 8)


# -- tiling ---------------------------------------------------------------------------------------
def test_arithmetic_groups_tile_into_all_strided_groups():
    groups, method = replica_groups([0, 8, 16, 24], 64)
    assert method == "arithmetic" and len(groups) == 16
    assert groups[:3] == [(0, 8, 16, 24), (1, 9, 17, 25), (2, 10, 18, 26)]
    assert (32, 40, 48, 56) in groups
    assert sorted(r for g in groups for r in g) == list(range(64))


def test_group_not_at_the_origin_and_contiguous_groups():
    groups, method = replica_groups([13, 14, 15, 12][::-1][::-1], 16)   # a permuted contiguous group
    assert method == "translation" and len(groups) == 4
    assert groups[3] == (13, 14, 15, 12)   # member order (comm ranks) is kept
    groups, method = replica_groups([4, 5, 6, 7], 16)
    assert method == "arithmetic" and groups == [(0, 1, 2, 3), (4, 5, 6, 7), (8, 9, 10, 11), (12, 13, 14, 15)]


def test_two_axis_group_tiles_by_translation():
    groups, method = replica_groups([0, 1, 4, 5], 16)
    assert method == "translation"
    assert groups == [(0, 1, 4, 5), (2, 3, 6, 7), (8, 9, 12, 13), (10, 11, 14, 15)]


@pytest.mark.parametrize("members", [[0, 3], [0, 1, 5], [1, 2, 3]])
def test_groups_that_do_not_tile_stand_alone(members):
    groups, method = replica_groups(members, 8)
    assert method == "none" and groups == [tuple(members)]


def test_domain_limits_tiling_to_a_slice():
    groups, _ = replica_groups([8, 10], 16, domain=(8, 16))
    assert groups == [(8, 10), (9, 11), (12, 14), (13, 15)]
    assert replica_groups([0, 8], 16, domain=(8, 16)) == ([(0, 8)], "none")


def test_world_group_and_single_rank():
    assert replica_groups(list(range(8)), 8) == ([tuple(range(8))], "arithmetic")
    groups, method = replica_groups([5], 8)
    assert method == "arithmetic" and len(groups) == 8


# -- report totals ----------------------------------------------------------------------------------
def _single_group_report(topo, kind, members, count, elem_size, **kw):
    rep = ClusterReport(topo)
    comm = CommRecord(0, "g", tuple(members))
    n = len(members)
    ranks = (kw.get("root", -1), kw.get("peer", -1)) if kind == "SendRecv" else tuple(range(n))
    rep.op_completed(OpRecord(comm=comm, kind=kind, datatype="float32", redop=None, count=count,
                              elem_size=elem_size, root=kw.get("root", -1), peer=kw.get("peer", -1),
                              ranks=ranks, logical_bytes=costmodel.logical_bytes(kind, count, elem_size, n),
                              socket_bytes=0, seq=1, started_at=0.0, rendezvous_s=0.0, execution_s=0.0))
    return rep.to_dict()


@pytest.mark.parametrize("kind, members, kw", [
    ("AllReduce", [0, 8, 16, 24, 32, 40, 48, 56], {}),          # dp across nodes
    ("AllGather", [0, 1, 2, 3], {}),                            # tp inside a node
    ("ReduceScatter", [0, 1, 8, 9], {}),                        # two axes
    ("AlltoAll", [0, 16, 32, 48], {}),
    ("SendRecv", [0, 32], {"root": 0, "peer": 1}),              # pipeline edge
    ("Broadcast", [0, 2, 4, 6], {"root": 1}),
])
def test_fake_totals_are_replicas_times_one_group(topo64, kind, members, kw):
    acc = WorldAccountant(topo64, 64)
    n_rep = acc.op("g", members, kind, "float32", 4, 1000, **kw)
    groups, _ = replica_groups(members, 64)
    assert n_rep == len(groups) == 64 // len(members)
    fake = acc.report.to_dict()
    one = _single_group_report(topo64, kind, members, 1000, 4, **kw)
    assert check_report(fake) == []
    assert fake["totals"]["operations"] == n_rep
    assert fake["totals"]["logical_bytes"] == n_rep * one["totals"]["logical_bytes"]
    assert fake["totals"]["modeled_time_s"] == pytest.approx(n_rep * one["totals"]["modeled_time_s"])
    for scope in ("intra_node", "inter_node"):
        assert fake["links"][scope]["bytes"] == n_rep * one["links"][scope]["bytes"]
        assert fake["links"][scope]["transfers"] == n_rep * one["links"][scope]["transfers"]
    assert sum(r["bytes_sent"] for r in fake["ranks"]) == n_rep * sum(r["bytes_sent"] for r in one["ranks"])
    assert sum(p["total_bytes"] for p in fake["node_pairs"]) == n_rep * sum(p["total_bytes"] for p in one["node_pairs"])
    # every rank of the world takes part once (the groups partition the world)
    busy = [r for r in fake["ranks"] if r["collective_calls"] or r["p2p_sends"] or r["p2p_recvs"]]
    assert len(busy) == 64


def test_renamed_estimates_equal_direct_cost_model(topo64):
    acc = WorldAccountant(topo64, 64)
    acc.op("dp", [0, 8, 16, 24, 32, 40, 48, 56], "AllReduce", "float32", 4, 4096)
    rep = acc.report
    assert rep.estimates_computed == 1          # 8 replicas, one shape
    for comm in acc.replicas("dp", [0, 8, 16, 24, 32, 40, 48, 56]):
        op = OpRecord(comm=comm, kind="AllReduce", datatype="float32", redop="sum", count=4096, elem_size=4,
                      root=-1, peer=-1, ranks=tuple(range(8)), logical_bytes=16384, socket_bytes=0, seq=0,
                      started_at=0.0, rendezvous_s=0.0, execution_s=0.0)
        got = rep._estimate(op, "AllReduce")
        want = costmodel.estimate("AllReduce", 4096, 4, comm.global_ranks, -1, -1, topo64)
        assert got.seconds == pytest.approx(want.seconds)
        assert got.algorithm == want.algorithm and got.transfers == want.transfers
        assert got.node_bytes == want.node_bytes


def test_mixed_gpu_shapes_do_not_share_estimates():
    text = uniform_cluster_yaml(2, 4).replace("[{profile: h100}, {profile: h100}, {profile: h100}, {profile: h100}]",
                                              "[{profile: a100}, {profile: a100}, {profile: a100}, {profile: a100}]", 1)
    from fakegpu.topology import parse_cluster_config
    topo = parse_cluster_config(text)
    acc = WorldAccountant(topo, 8)
    acc.op("tp", [0, 1, 2, 3], "AllReduce", "float32", 4, 1 << 20)
    assert acc.report.estimates_computed == 2    # the A100 node and the H100 node differ
    times = {c["members"][0]: c["modeled_time_s"] for c in acc.report.to_dict()["communicators"]}
    assert times[0] != times[4]


def test_untiled_groups_are_named_in_metadata(topo64):
    acc = WorldAccountant(topo64, 64)
    assert acc.op("odd", [0, 3, 7], "AllReduce", "float32", 4, 10) == 1
    meta = acc.finish_metadata()
    assert meta["untiled_communicators"] == {"odd": [0, 3, 7]}


def test_topology_smaller_than_world_is_refused(topo64):
    with pytest.raises(ValueError, match="places 64 ranks but the logical world has 128"):
        WorldAccountant(topo64, 128)


def test_a_1024_rank_world_evaluates_each_shape_once():
    topo = uniform_cluster(128, 8)
    acc = WorldAccountant(topo, 1024)
    tp, dp, pp = list(range(8)), [k * 8 for k in range(32)], [k * 256 for k in range(4)]
    ops = 0
    for step in range(2):
        for i in range(10):
            acc.op("dp", dp, "AllGather", "bfloat16", 2, 1000 * (i + 1))
            acc.op("dp", dp, "ReduceScatter", "float32", 4, 1000 * (i + 1), redop="avg")
            acc.op("tp", tp, "AllReduce", "bfloat16", 2, 4096 * (i + 1))
            ops += 3
        for i in range(8):
            acc.op("pp", pp, "SendRecv", "bfloat16", 2, 65536, root=0, peer=1)
            ops += 1
    report = acc.report.to_dict()
    assert check_report(report, world_size=1024) == []
    assert report["totals"]["operations"] == acc.records == 2 * (10 * (32 + 32 + 128) + 8 * 256)
    # one cost-model evaluation per distinct (operation, size, group shape), not per replica
    assert acc.report.estimates_computed <= 2 * 10 + 10 + 1


# -- events --------------------------------------------------------------------------------------------
def _write_events(path: Path, world=16, rank=0, physical=(0,)):
    log = EventLog(str(path))
    log.add({"event": "world", "version": 1, "mode": "fake", "logical_world_size": world,
             "logical_rank": rank, "physical_logical_ranks": list(physical), "pp_degree": 1})
    log.add({"event": "comm", "id": 0, "name": "tp", "members": [0, 1, 2, 3]})
    log.add({"event": "op", "comm": 0, "kind": "all_reduce", "dtype": "bfloat16", "elem_size": 2,
             "count": 512, "redop": "sum", "rank": 0})
    log.add({"event": "comm", "id": 1, "name": "pp", "members": [0, 8]})
    log.add({"event": "op", "comm": 1, "kind": "SendRecv", "dtype": "float32", "elem_size": 4,
             "count": 64, "root": 0, "peer": 1, "rank": 0})
    log.add({"event": "memory", "point": "after_init", "logical_rank": 0, "device": "cpu",
             "stats": {"rss_bytes": 123}})
    log.close()


def test_event_file_round_trip_and_cli(tmp_path):
    ev = tmp_path / "events.jsonl"
    _write_events(ev)
    events = read_events(str(ev))
    assert [e["event"] for e in events] == ["world", "comm", "op", "comm", "op", "memory"]
    cfg = tmp_path / "c.yaml"
    cfg.write_text(uniform_cluster_yaml(2, 8))
    out = tmp_path / "r.json"
    proc = subprocess.run([sys.executable, "-m", "fakegpu.fake.build_report", str(ev), "--cluster-config",
                           str(cfg), "--report", str(out)], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    assert check_report(report, world_size=16, node_count=2) == []
    assert report["collectives"]["AllReduce"]["calls"] == 4
    assert report["point_to_point"]["operations"] == 8 and report["point_to_point"]["inter_node_operations"] == 8
    assert report["metadata"]["mode"] == "fake" and report["metadata"]["logical_world_size"] == 16
    assert report["metadata"]["memory_captures"][0]["rss_bytes"] == 123
    assert (tmp_path / "r.md").exists()


def test_bad_events_are_named(tmp_path, topo64):
    acc = WorldAccountant(topo64, 64)
    with pytest.raises(EventFormatError, match="op on unknown communicator 5"):
        replay([{"event": "op", "comm": 5, "kind": "AllReduce", "count": 1}], acc)
    with pytest.raises(EventFormatError, match="op event lacks 'count'"):
        replay([{"event": "comm", "id": 0, "members": [0, 1]}, {"event": "op", "comm": 0, "kind": "AllReduce"}], acc)
    with pytest.raises(EventFormatError, match="unknown operation kind 'Shuffle'"):
        replay([{"event": "comm", "id": 0, "members": [0, 1]},
                {"event": "op", "comm": 0, "kind": "Shuffle", "count": 1}], acc)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"event": "world"}\nnot json\n')
    with pytest.raises(EventFormatError, match="bad.jsonl:2: not JSON"):
        read_events(str(bad))


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_pure_fake_pipeline_transfers_stand_for_every_stage(stage, monkeypatch):
    """Whichever stage one process plays, a microbatch's activations forward and gradients
    back are accounted on all 3 edges of a 4-stage pipeline, in every one of the 4 pipelines."""
    from fakegpu.fake import runtime
    from fakegpu.fake.contract import resolve

    for var in ("FAKEGPU_CLUSTER_REPORT_PATH", "FAKEGPU_FAKE_REPORT_PATH", "FAKEGPU_FAKE_EVENTS_PATH"):
        monkeypatch.delenv(var, raising=False)
    lc = resolve({"NGPU": "16", "FAKEGPU_PP_DEGREE": "4", "FAKE_PP_RANK": str(stage)})
    world = runtime.FakeWorld(lc, topology=uniform_cluster(2, 8))
    members = [0, 4, 8, 12]
    me = stage
    if stage > 0:
        world.comm_op("pp", members, me, "SendRecv", "bfloat16", 2, 1024, root=me - 1, peer=me)
    if stage < 3:
        world.comm_op("pp", members, me, "SendRecv", "bfloat16", 2, 1024, root=me, peer=me + 1)
        world.comm_op("pp", members, me, "SendRecv", "bfloat16", 2, 1024, root=me + 1, peer=me)
    if stage > 0:
        world.comm_op("pp", members, me, "SendRecv", "bfloat16", 2, 1024, root=me, peer=me - 1)
    world.finished = True
    report = world.accountant.report.to_dict()
    p2p = report["point_to_point"]
    assert p2p["operations"] == 2 * 3 * 4 and p2p["bytes"] == 2 * 3 * 4 * 2048
    sends = {r["rank"]: r["p2p_sends"] for r in report["ranks"]}
    recvs = {r["rank"]: r["p2p_recvs"] for r in report["ranks"]}
    for b in range(4):   # each pipeline {b, b+4, b+8, b+12}: ends send/receive once, middles twice
        assert [sends[b + 4 * k] for k in range(4)] == [1, 2, 2, 1]
        assert [recvs[b + 4 * k] for k in range(4)] == [1, 2, 2, 1]


def test_groups_with_the_same_members_keep_their_own_names(topo64):
    """DeviceMesh makes several groups over the same ranks (a dim and a flattened dim of size
    one elsewhere); each is its own communicator in the report, under its own name."""
    acc = WorldAccountant(topo64, 64)
    dp = list(range(0, 64, 8))
    assert acc.op("mesh_dp", dp, "AllReduce", "float32", 4, 100) == 8
    assert acc.op("mesh_dp_shard_cp", dp, "ReduceScatter", "float32", 4, 100) == 8
    assert acc.op("mesh_dp", dp, "AllReduce", "float32", 4, 100) == 8
    report = acc.report.to_dict()
    by_name: dict = {}
    for c in report["communicators"]:
        base = c["name"].split("[")[0]
        by_name[base] = by_name.get(base, 0) + c["operations"]
    assert by_name == {"mesh_dp": 16, "mesh_dp_shard_cp": 8}
