"""The report shows the model: per-link modeled time in the Markdown, and a per-parallelism-group
table (communicators gathered by name, summed over the instances of one mesh dimension and per
instance) in `report show` and the Markdown."""
from __future__ import annotations

import json

from fakegpu.cli import report as report_cli
from fakegpu.common.records import CommRecord, OpRecord
from fakegpu.report.cluster_report import ClusterReport
from fakegpu.report.groups import group_name, parallelism_groups
from fakegpu.report.markdown import render_markdown
from fakegpu.topology import load_cluster_config

from helpers.shim import REPO_ROOT


def _mesh_report() -> dict:
    """2 nodes x 8 H100: eight node-local tp pairs (mesh_tp) and two dp groups of eight that
    span both nodes (mesh_dp), one allreduce each; the last dp instance moves twice as much."""
    topo = load_cluster_config(REPO_ROOT / "cluster_configs" / "h100-2node-8gpu-ib-8x400g.yaml")
    rep = ClusterReport(topo)
    comms = [CommRecord(1 + k, "mesh_tp", (2 * k, 2 * k + 1)) for k in range(8)]
    comms += [CommRecord(9 + k, "mesh_dp", tuple(range(k, 16, 2))) for k in range(2)]
    for i, c in enumerate(comms):
        count = 2 << 20 if c.comm_id == 10 else 1 << 20
        rep.op_completed(OpRecord(
            comm=c, kind="AllReduce", datatype="float32", redop="sum", count=count, elem_size=4, root=-1,
            peer=-1, ranks=tuple(range(len(c.global_ranks))), logical_bytes=count * 4, socket_bytes=0, seq=0,
            started_at=10.0 + i, rendezvous_s=0.0, execution_s=0.0,
            arrived_at={g: 10.0 + i for g in c.global_ranks}))
    return rep.to_dict()


def test_group_names_drop_an_instance_index():
    assert group_name("mesh_dp") == group_name("mesh_dp[3]") == group_name("mesh_dp#12") == "mesh_dp"
    assert group_name("") == "(unnamed)"


def test_parallelism_groups_sum_their_instances():
    report = _mesh_report()
    groups = {g["name"]: g for g in parallelism_groups(report)}
    assert set(groups) == {"mesh_tp", "mesh_dp"}
    by_id = {c["id"]: c for c in report["communicators"]}
    for name, ids in (("mesh_tp", range(1, 9)), ("mesh_dp", (9, 10))):
        g = groups[name]
        assert [i["id"] for i in g["instances"]] == list(ids)
        assert g["operations"] == len(ids)
        assert g["logical_bytes"] == sum(by_id[i]["logical_bytes"] for i in ids)
        assert g["modeled_time_s"] == sum(by_id[i]["modeled_time_s"] for i in ids)
    assert groups["mesh_dp"]["max_instance_modeled_time_s"] == by_id[10]["modeled_time_s"] > by_id[9]["modeled_time_s"]


def test_report_show_has_a_group_table_and_markdown_per_link_time(tmp_path, capsys):
    report = _mesh_report()
    path = tmp_path / "r.json"
    path.write_text(json.dumps(report))
    assert report_cli.main(["show", str(path)]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("group / instance"))
    dp = next(i for i, line in enumerate(lines) if line.startswith("mesh_dp "))
    assert head < dp and "2x8" in lines[dp] and "2" in lines[dp].split()
    assert lines[dp + 1].split()[:2] == ["#9", "mesh_dp"] and lines[dp + 2].split()[:2] == ["#10", "mesh_dp"]
    assert any(line.startswith("mesh_tp ") and "8x2" in line for line in lines)

    md = render_markdown(report)
    links = md[md.index("## Links"):md.index("## Node pairs")]
    intra = next(line for line in links.splitlines() if line.startswith("| intra-node"))
    inter = next(line for line in links.splitlines() if line.startswith("| inter-node"))
    from fakegpu.report.markdown import fmt_seconds
    assert fmt_seconds(report["links"]["intra_node"]["modeled_time_s"]) in intra
    assert fmt_seconds(report["links"]["inter_node"]["modeled_time_s"]) in inter
    assert report["links"]["inter_node"]["modeled_time_s"] > 0
    pairs = md[md.index("## Node pairs"):md.index("## Ranks")]
    assert fmt_seconds(report["node_pairs"][0]["modeled_time_s"]) in pairs
    per_node = report["links"]["intra_node"]["per_node"]
    assert all(n["modeled_time_s"] > 0 for n in per_node)
    groups = md[md.index("## Parallelism groups"):md.index("## Communicators")]
    assert "| mesh_tp | 8 | 2 | 8 |" in groups and "| mesh_dp | 2 | 8 | 2 |" in groups
