"""ClusterReport fed known traffic as coordinator records: exact calls, bytes per link and
node pair, modeled times equal to the cost formula; files, schema, and `report check`."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from fakegpu.cli import report as report_cli
from fakegpu.common.records import ClientRecord, CommRecord, OpRecord
from fakegpu.report import ClusterReport, check_report
from fakegpu.report.schema import REPORT_SCHEMA, repo_schema_path
from fakegpu.topology import default_topology, load_cluster_config
from helpers.paths import REPO_ROOT

CONFIGS = REPO_ROOT / "cluster_configs"
MiB = 1 << 20
PORT = 300e9 * 0.82                 # dev-2node-2gpu NVLink port, NVLink efficiency
NIC = 200e9 / 8 / 1.5 * 0.92        # HDR NIC after 1.5 oversubscription, IB efficiency
# hierarchical/Simple: launch + NCCL's ring base latency + 2 node-local + 2 network steps (test_costmodel)
LAUNCH = 10e-6                      # costmodel.LAUNCH_OVERHEAD_S
ALLREDUCE_1MIB = LAUNCH + 8.4e-6 + 2 * 3e-6 + 2 * 15e-6 + max(MiB / PORT, MiB / NIC)

WORLD = CommRecord(1, "world", (0, 1, 2, 3))
PIPE = CommRecord(2, "pp_stage_1_2", (1, 2), parent_id=1)
NODE0 = CommRecord(3, "node0_local", (0, 1), parent_id=1)


def op(comm, kind, count, *, elem=4, root=-1, peer=-1, ranks=None, seq=0, status="ok", dtype="float32",
       redop="sum", waits=None, socket_bytes=0):
    n = len(comm.global_ranks)
    logical = count * elem * (n if kind in ("AllGather", "ReduceScatter", "AlltoAll", "Gather", "Scatter") else 1)
    return OpRecord(
        comm=comm, kind=kind, datatype=dtype, redop=redop if kind in ("AllReduce", "Reduce", "ReduceScatter") else None,
        count=count, elem_size=elem, root=root, peer=peer,
        ranks=tuple(ranks if ranks is not None else range(n)) if kind != "SendRecv" else (root, peer),
        logical_bytes=logical, socket_bytes=socket_bytes, seq=seq, started_at=1.7e9 + seq,
        rendezvous_s=0.001, execution_s=0.002, arrival_wait_s=dict(waits or {}), status=status,
        error="" if status == "ok" else f"{status} waiting for peers",
    )


@pytest.fixture
def topo():
    return load_cluster_config(CONFIGS / "dev-2node-2gpu.yaml")


@pytest.fixture
def allreduce_report(topo, monkeypatch):
    # The byte attribution below is the hierarchical algorithm's (the model's own, not one NCCL
    # picks by default), asked for the way NCCL is: NCCL_ALGO.
    monkeypatch.setenv("NCCL_ALGO", "hierarchical")
    monkeypatch.setenv("NCCL_PROTO", "simple")
    rep = ClusterReport(topo, metadata={"transport": "unix", "timeout_ms": 60000})
    for g in range(4):
        rep.client_connected(ClientRecord(g + 10, 1000 + g, "host-a", g, "unix", True))
    rep.comm_created(WORLD, [0.01, 0.02, 0.0, 0.03])
    for i in range(10):
        rep.op_completed(op(WORLD, "AllReduce", MiB // 4, seq=i, waits={0: 0.001, 3: 0.002}))
    return rep


def test_ten_allreduces_on_two_nodes(allreduce_report):
    d = allreduce_report.to_dict()
    assert check_report(d, world_size=4, node_count=2, collectives=["AllReduce"]) == []
    ar = d["collectives"]["AllReduce"]
    assert ar["calls"] == 10 and ar["errors"] == 0
    assert ar["logical_bytes"] == 10 * MiB
    assert ar["modeled_time_s"] == pytest.approx(10 * ALLREDUCE_1MIB)
    assert ar["algorithms"] == {"hierarchical": 10}
    assert ar["algbw_gbs"] == pytest.approx(MiB / ALLREDUCE_1MIB / 1e9)
    assert ar["busbw_gbs"] == pytest.approx(1.5 * MiB / ALLREDUCE_1MIB / 1e9)
    # per op: each node's 2-rank ring moves S each way; each rail moves S/2 each way
    intra, inter = d["links"]["intra_node"], d["links"]["inter_node"]
    assert intra["bytes"] == 10 * 4 * MiB and intra["transfers"] == 40
    assert [n["bytes"] for n in intra["per_node"]] == [20 * MiB, 20 * MiB]
    assert inter["bytes"] == 10 * 2 * MiB and inter["transfers"] == 40
    (pair,) = d["node_pairs"]
    assert pair["nodes"] == ["node0", "node1"]
    assert pair["directions"] == {"node0->node1": 10 * MiB, "node1->node0": 10 * MiB}
    assert pair["total_bytes"] == 20 * MiB and pair["operations"] == 10 and pair["transfers"] == 40
    assert pair["peak_operation_bytes"] == 2 * MiB
    assert pair["modeled_avg_throughput_gbs"] == pytest.approx(2 * MiB / ALLREDUCE_1MIB / 1e9)
    assert pair["modeled_peak_throughput_gbs"] == pytest.approx(2 * MiB / ALLREDUCE_1MIB / 1e9)
    assert pair["by_operation"] == {"AllReduce": {"operations": 10, "bytes": 20 * MiB, "transfers": 40}}
    for r in d["ranks"]:
        assert r["collective_calls"] == 10 and r["comm_inits"] == 1
        assert r["bytes_sent"] == r["bytes_received"] == 15 * MiB    # 2(n-1)/n of 1 MiB, 10 times
        assert r["modeled_busy_s"] == pytest.approx(10 * ALLREDUCE_1MIB)
        assert r["pid"] == 1000 + r["rank"] and r["transport"] == "unix" and r["connected"]
    assert d["ranks"][0]["wait_s"] == pytest.approx(0.01)
    assert d["ranks"][3]["wait_s"] == pytest.approx(0.02)
    assert d["ranks"][3]["init_wait_s"] == pytest.approx(0.03)
    assert d["totals"]["modeled_makespan_s"] == pytest.approx(10 * ALLREDUCE_1MIB)
    tl = d["timeline"]
    assert tl["retained"] == 10 and tl["dropped_operations"] == 0
    first = tl["operations"][0]
    assert first["global_ranks"] == [0, 1, 2, 3] and first["datatype"] == "float32" and first["redop"] == "sum"
    assert first["modeled_s"] == pytest.approx(ALLREDUCE_1MIB)
    assert tl["operations"][3]["modeled_start_s"] == pytest.approx(3 * ALLREDUCE_1MIB)
    assert first["rendezvous_s"] == 0.001 and first["execution_s"] == 0.002
    assert d["metadata"] == {"transport": "unix", "timeout_ms": 60000}
    assert d["topology"]["is_default"] is False


def test_pair_only_send_recv_across_nodes(topo):
    rep = ClusterReport(topo)
    rep.comm_created(PIPE, [0.0, 0.0])
    rep.op_completed(op(PIPE, "SendRecv", 1000, elem=2, root=0, peer=1, dtype="bfloat16", socket_bytes=2000))
    d = rep.to_dict()
    assert check_report(d, collectives=["SendRecv"]) == []
    p2p = d["point_to_point"]
    assert (p2p["operations"], p2p["sends"], p2p["bytes"], p2p["inter_node_operations"]) == (1, 1, 2000, 1)
    assert p2p["modeled_time_s"] == pytest.approx(LAUNCH + 15e-6 + 2000 / NIC)
    assert d["collectives"] == {}
    (pair,) = d["node_pairs"]
    assert pair["directions"] == {"node0->node1": 2000, "node1->node0": 0}
    assert pair["by_operation"] == {"SendRecv": {"operations": 1, "bytes": 2000, "transfers": 1}}
    assert d["links"]["intra_node"]["bytes"] == 0
    ranks = {r["rank"]: r for r in d["ranks"]}
    assert (ranks[1]["p2p_sends"], ranks[2]["p2p_recvs"]) == (1, 1)
    assert ranks[0]["bytes_sent"] == ranks[3]["bytes_sent"] == 0   # bystanders untouched
    assert ranks[1]["bytes_sent"] == 2000 and ranks[2]["bytes_received"] == 2000
    entry = d["timeline"]["operations"][0]
    assert (entry["src"], entry["dst"], entry["global_ranks"]) == (1, 2, [1, 2])
    assert entry["socket_bytes"] == 2000 and entry["redop"] is None


def test_split_communicators(topo):
    rep = ClusterReport(topo)
    rep.comm_created(WORLD, [0.0] * 4)
    rep.comm_created(PIPE, [0.0, 0.0])
    rep.comm_created(NODE0, [0.0, 0.0])
    rep.op_completed(op(PIPE, "AllReduce", MiB // 4, seq=0))     # spans node0 rank 1 and node1 rank 2
    rep.op_completed(op(NODE0, "AllGather", 1000, seq=0))        # stays inside node0
    d = rep.to_dict()
    assert check_report(d) == []
    (pair,) = d["node_pairs"]
    assert pair["directions"] == {"node0->node1": MiB, "node1->node0": MiB}
    # ring/Simple: two network steps with NCCL's base latency and multi-node plateau; 1 MiB
    # feeds all 24 channels (512 threads x 64 B each, test_costmodel)
    assert d["collectives"]["AllReduce"]["modeled_time_s"] == pytest.approx(
        LAUNCH + 1.9 * (8.4e-6 + 2 * 15e-6) + MiB / NIC)
    ag = d["collectives"]["AllGather"]["modeled_time_s"]
    assert d["links"]["intra_node"]["per_node"] == [
        {"node": "node0", "bytes": 2 * 4000, "transfers": 2, "operations": 1, "peak_operation_bytes": 8000,
         "modeled_time_s": ag}]
    comms = {c["id"]: c for c in d["communicators"]}
    assert comms[2]["members"] == [1, 2] and comms[2]["nodes"] == ["node0", "node1"]
    assert comms[2]["name"] == "pp_stage_1_2" and comms[2]["parent_id"] == 1 and comms[2]["size"] == 2
    assert comms[3]["nodes"] == ["node0"] and comms[3]["by_kind"] == {"AllGather": 1}
    ranks = {r["rank"]: r for r in d["ranks"]}
    assert ranks[3]["bytes_sent"] == 0 and ranks[3]["collective_calls"] == 0
    assert ranks[1]["comm_inits"] == 3 and ranks[3]["comm_inits"] == 1


def failed_call(rep, record):
    """What the coordinator does for a failed call: one failed record and one op_failed event."""
    rep.op_completed(record)
    rep.fault_event({"event": "op_failed", "at": 1.7e9, "seq": record.seq, "op": record.kind})


def test_failed_operations_count_as_timeouts_not_calls(topo):
    rep = ClusterReport(topo)
    failed_call(rep, op(WORLD, "AllReduce", 16, status="timeout", waits={0: 1.0, 1: 1.0}))
    failed_call(rep, op(WORLD, "Broadcast", 16, root=0, status="mismatch"))
    d = rep.to_dict()
    assert check_report(d) == []
    assert d["collectives"]["AllReduce"]["calls"] == 0 and d["collectives"]["AllReduce"]["errors"] == 1
    assert d["totals"]["failed_operations"] == 2
    assert d["totals"]["by_status"] == {"mismatch": 1, "timeout": 1}
    assert [r["timeouts"] for r in d["ranks"]] == [1, 1, 1, 1]
    assert [r["errors"] for r in d["ranks"]] == [1, 1, 1, 1]
    assert d["links"]["inter_node"]["bytes"] == 0
    # rank 3 never joined a collective the others timed out on
    failed_call(rep, op(WORLD, "AllGather", 16, ranks=[0, 1, 2], status="timeout", seq=5))
    d = rep.to_dict()
    assert check_report(d) == []
    assert [r["absences"] for r in d["ranks"]] == [0, 0, 0, 1]
    assert [r["timeouts"] for r in d["ranks"]] == [2, 2, 2, 1]


def test_check_wants_one_op_failed_event_per_failed_operation(topo):
    rep = ClusterReport(topo)
    failed_call(rep, op(WORLD, "AllReduce", 16, status="mismatch"))
    rep.op_completed(op(WORLD, "AllReduce", 16, status="peer_failed", seq=1))   # no event: counted apart
    problems = check_report(rep.to_dict())
    assert problems == ["consistency: totals.failed_operations 2 != 1 op_failed events (each failed call is one "
                        "of each)"]
    rep.fault_event({"event": "op_failed", "at": 1.7e9})
    assert check_report(rep.to_dict()) == []


def test_unplaced_rank_does_not_break_the_report(topo):
    rep = ClusterReport(topo)
    rogue = CommRecord(9, "", (0, 7))
    rep.op_completed(op(rogue, "AllReduce", 16))
    rep.op_completed(op(WORLD, "AllReduce", 16))
    d = rep.to_dict()
    assert check_report(d) == []
    assert d["totals"]["unattributed_operations"] == 1
    assert any("global rank 7" in n for n in d["notes"])


def test_timeline_is_bounded(topo):
    rep = ClusterReport(topo, max_operations=3)
    for i in range(5):
        rep.op_completed(op(WORLD, "AllReduce", 256, seq=i))
    d = rep.to_dict()
    assert check_report(d) == []
    assert d["timeline"]["retained"] == 3 and d["timeline"]["dropped_operations"] == 2
    assert d["collectives"]["AllReduce"]["calls"] == 5
    off = ClusterReport(topo, max_operations=0)
    off.op_completed(op(WORLD, "AllReduce", 256))
    d = off.to_dict()
    assert d["timeline"]["operations"] == [] and d["timeline"]["dropped_operations"] == 1
    assert check_report(d) == []


def test_every_kind_round_trips(topo):
    rep = ClusterReport(topo)
    for i, (kind, root) in enumerate([("AllReduce", -1), ("Broadcast", 1), ("Reduce", 2), ("AllGather", -1),
                                      ("ReduceScatter", -1), ("AlltoAll", -1), ("Gather", 3), ("Scatter", 0)]):
        rep.op_completed(op(WORLD, kind, 4096, root=root, seq=i))
    rep.op_completed(op(WORLD, "SendRecv", 4096, root=3, peer=0, seq=8))
    d = rep.to_dict()
    assert check_report(d, collectives=["AllReduce", "alltoall", "gather", "send"]) == []
    assert len(d["collectives"]) == 8


def test_default_topology_is_said_so():
    rep = ClusterReport(default_topology(2))
    rep.op_completed(op(CommRecord(1, "", (0, 1)), "AllReduce", 1024))
    d = rep.to_dict()
    assert d["topology"]["is_default"] is True
    assert any("No cluster config was given" in n for n in d["notes"])
    from fakegpu.report.markdown import render_markdown
    assert "No cluster config was given" in render_markdown(d)


def test_write_files_atomically(allreduce_report, tmp_path):
    out = tmp_path / "sub" / "cluster.json"
    paths = allreduce_report.write(out, trace_path=tmp_path / "trace.json")
    assert paths["markdown"] == str(tmp_path / "sub" / "cluster.md")
    assert sorted(p.name for p in (tmp_path / "sub").iterdir()) == ["cluster.json", "cluster.md"]  # no temp files
    d = json.loads(out.read_text())
    assert check_report(d, world_size=4) == []
    md = (tmp_path / "sub" / "cluster.md").read_text()
    for heading in ("## Summary", "## Collectives", "## Node pairs", "## Ranks", "## Communicators",
                    "## What the modeled numbers mean"):
        assert heading in md
    assert "| AllReduce | 10 |" in md and "node0 <-> node1" in md
    trace = json.loads((tmp_path / "trace.json").read_text())
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(events) == 40 and {e["tid"] for e in events} == {0, 1, 2, 3}
    rank0 = sorted((e for e in events if e["tid"] == 0), key=lambda e: e["ts"])
    for a, b in zip(rank0, rank0[1:]):      # end to end on the modeled clock
        assert b["ts"] == pytest.approx(a["ts"] + a["dur"])
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M" and e["name"] == "thread_name"}
    assert "rank 2 (h100)" in names
    custom = allreduce_report.write(tmp_path / "r.json", markdown_path=tmp_path / "elsewhere" / "x.md")
    assert Path(custom["markdown"]).is_file() and "trace" not in custom


def test_repo_schema_file_matches_code():
    assert json.loads(repo_schema_path().read_text()) == REPORT_SCHEMA
    assert REPORT_SCHEMA["$schema"] == "https://json-schema.org/draft/2020-12/schema"


# -- report check / show ----------------------------------------------------------------------
@pytest.fixture
def report_file(allreduce_report, tmp_path):
    rep = allreduce_report
    rep.comm_created(PIPE, [0.0, 0.0])
    rep.op_completed(op(PIPE, "SendRecv", 100, root=0, peer=1, seq=0))
    path = tmp_path / "report.json"
    rep.write(path)
    return path


def test_cli_check_and_show_accept_a_good_report(report_file, capsys):
    assert report_cli.main(["check", str(report_file), "--expect-world-size", "4", "--expect-node-count", "2",
                            "--expect-collective", "AllReduce", "--expect-collective", "SendRecv"]) == 0
    assert "OK" in capsys.readouterr().out
    assert report_cli.main(["show", str(report_file)]) == 0
    out = capsys.readouterr().out
    assert "world size 4" in out and "AllReduce" in out and "node0 <-> node1" in out


def _tamper(path: Path, edit) -> Path:
    d = json.loads(path.read_text())
    edit(d)
    bad = path.with_name("tampered.json")
    bad.write_text(json.dumps(d))
    return bad


TAMPERS = [
    ("pair-direction", lambda d: d["node_pairs"][0]["directions"].__setitem__("node0->node1", 1), "directions sum"),
    ("link-bytes", lambda d: d["links"]["inter_node"].__setitem__("bytes", 5), "links.inter_node.bytes"),
    ("calls", lambda d: d["collectives"]["AllReduce"].__setitem__("calls", 11), "collectives.AllReduce.calls"),
    ("missing-field", lambda d: d.pop("ranks"), "'ranks' is a required property"),
    ("schema-version", lambda d: d.__setitem__("schema_version", 7), "schema: schema_version"),
    ("negative", lambda d: d["point_to_point"].__setitem__("bytes", -1), "schema: point_to_point/bytes"),
    ("timeline", lambda d: d["timeline"]["operations"].pop(), "timeline.retained"),
    ("rank-calls", lambda d: d["ranks"][2].__setitem__("collective_calls", 3), "rank 2 collective_calls"),
]


@pytest.mark.parametrize("name, edit, message", TAMPERS, ids=[t[0] for t in TAMPERS])
def test_cli_check_catches_tampering(report_file, capsys, name, edit, message):
    bad = _tamper(report_file, edit)
    assert report_cli.main(["check", str(bad)]) == 1
    err = capsys.readouterr().err
    assert "INVALID" in err and message in err


def test_cli_check_expectations_and_bad_files(report_file, tmp_path, capsys):
    assert report_cli.main(["check", str(report_file), "--expect-world-size", "8",
                            "--expect-collective", "AlltoAll"]) == 1
    err = capsys.readouterr().err
    assert "expected world size 8" in err and "AlltoAll" in err
    assert report_cli.main(["check", str(tmp_path / "missing.json")]) == 2
    assert "cannot read" in capsys.readouterr().err
    garbage = tmp_path / "garbage.json"
    garbage.write_text("{not json")
    assert report_cli.main(["check", str(garbage)]) == 2
    assert "not valid JSON" in capsys.readouterr().err
    assert report_cli.main(["show", str(garbage)]) == 2


def test_cli_via_package_entry_point(report_file):
    from fakegpu.__main__ import main
    assert main(["report", "check", "-q", str(report_file)]) == 0


def test_failed_send_known_only_by_one_side(topo):
    rep = ClusterReport(topo)
    failed = OpRecord(comm=PIPE, kind="Send", datatype="float32", redop=None, count=10, elem_size=4,
                      root=-1, peer=-1, ranks=(0,), logical_bytes=40, socket_bytes=0, seq=0,
                      started_at=1.7e9, rendezvous_s=0.0, execution_s=0.0, status="timeout",
                      error="no matching recv")
    failed_call(rep, failed)
    d = rep.to_dict()
    assert check_report(d) == []
    assert d["totals"]["unattributed_operations"] == 0
    assert d["point_to_point"]["errors"] == 1
    assert d["ranks"][1]["timeouts"] == 1 and d["ranks"][2]["timeouts"] == 0
    entry = d["timeline"]["operations"][0]
    assert entry["global_ranks"] == [1] and entry["src"] is None


def test_nested_metadata_in_markdown(topo):
    from fakegpu.report.markdown import render_markdown
    rep = ClusterReport(topo, metadata={"coordinator": {"transport": "tcp", "pid": 42}, "cluster_config": None})
    md = render_markdown(rep.to_dict())
    assert "| metadata: coordinator.transport | tcp |" in md


def test_report_files_are_readable_and_keep_their_mode(allreduce_report, tmp_path):
    out = tmp_path / "r.json"
    allreduce_report.write(out)
    assert out.stat().st_mode & 0o777 == 0o644
    out.chmod(0o640)
    allreduce_report.write(out)
    assert out.stat().st_mode & 0o777 == 0o640


def test_config_warnings_reach_the_report(tmp_path):
    from fakegpu.topology import parse_cluster_config
    text = (CONFIGS / "dev-2node-2gpu.yaml").read_text().replace("bandwidth_gbps: 2400", "bandwidth_gbps: 300")
    d = ClusterReport(parse_cluster_config(text, "x.yaml")).to_dict()
    assert check_report(d) == []
    assert d["topology"]["warnings"] and any("cluster config warning" in n for n in d["notes"])
