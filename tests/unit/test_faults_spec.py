"""Fault specifications: FAKEGPU_FAULTS and the cluster YAML's `faults:` section are validated
with clear errors; slow_link scales the cost model; the coordinator refuses a bad spec."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from fakegpu import costmodel
from fakegpu.coordinator.faults import FaultPlan, FaultSpecError, load_plan, parse_fault_env
from fakegpu.topology import ClusterConfigError, parse_cluster_config
from helpers.paths import REPO_ROOT


YAML = textwrap.dedent("""
    version: 1
    nodes:
      - {id: node0, ranks: [0, 1], gpus: [{profile: h100}, {profile: h100}]}
      - {id: node1, ranks: [2, 3], gpus: [{profile: h100}, {profile: h100}]}
      - {id: node2, ranks: [4, 5], gpus: [{profile: h100}, {profile: h100}]}
    fabric:
      intra_node: {type: nvlink, bandwidth_gbps: 3600, latency_us: 2}
      inter_node: {type: infiniband, bandwidth_gbps: 400, latency_us: 5}
""")


def test_env_spec_parses_every_kind():
    faults = parse_fault_env("kill:rank=1:seq=5; delay:rank=0:op=allreduce:ms=200;hang:rank=2:seq=3;"
                             "drop:rank=1:seq=7:count=2;slow_link:nodes=node0-node1:factor=4")
    assert [f.kind for f in faults] == ["kill", "delay", "hang", "drop", "slow_link"]
    assert (faults[0].rank, faults[0].seq, faults[0].op) == (1, 5, None)
    assert (faults[1].op, faults[1].ms) == ("AllReduce", 200)
    assert faults[3].count == 2
    assert faults[4].nodes == ("node0", "node1") and faults[4].factor == 4.0
    assert parse_fault_env("") == [] and parse_fault_env(None) == []


@pytest.mark.parametrize("spec, expected", [
    ("explode:rank=1", "unknown fault kind 'explode'"),
    ("kill:seq=3", "kill needs rank=N"),
    ("kill:rank=-1", "rank='-1' must be an integer >= 0"),
    ("kill:rank=1:seq=0", "seq='0' must be an integer >= 1"),
    ("kill:rank=1:ms=5", "kill does not take ms"),
    ("delay:rank=1", "delay needs ms=N"),
    ("hang:rank=1:op=AllReduse", "op='AllReduse' is not an operation"),
    ("kill:rank=1:rank=2", "rank is given twice"),
    ("kill:rank", "'rank' is not key=value"),
    ("slow_link:nodes=node0:factor=2", "must name two different nodes"),
    ("slow_link:nodes=node0-node1:factor=0.5", "must be a number >= 1"),
])
def test_env_spec_errors_name_the_item_and_key(spec, expected):
    with pytest.raises(FaultSpecError) as info:
        parse_fault_env("kill:rank=0;" + spec)
    assert "FAKEGPU_FAULTS item 2" in str(info.value) and expected in str(info.value), str(info.value)


def test_yaml_faults_section_is_loaded_and_validated():
    topo = parse_cluster_config(YAML + textwrap.dedent("""
        faults:
          - {kind: kill, rank: 1, seq: 5}
          - {kind: slow_link, nodes: [node0, node1], factor: 4}
    """))
    assert [f.kind for f in topo.faults] == ["kill", "slow_link"]
    assert topo.link_factor(0, 1) == 4.0 and topo.link_factor(1, 0) == 4.0 and topo.link_factor(1, 2) == 1.0
    with pytest.raises(ClusterConfigError) as info:
        parse_cluster_config(YAML + "faults:\n  - {kind: hang, rank: 1, sek: 3}\n")
    text = str(info.value)
    assert "faults[0]" in text and "hang does not take sek" in text and ":11" in text, text
    with pytest.raises(ClusterConfigError) as info:
        parse_cluster_config(YAML + "faults:\n  - {kind: slow_link, nodes: node0-node9, factor: 2}\n")
    assert "node 'node9' is not in the cluster config" in str(info.value)
    with pytest.raises(ClusterConfigError) as info:
        parse_cluster_config(YAML + "faults:\n  - {rank: 1}\n")
    assert "kind" in str(info.value)


def test_slow_link_scales_the_modeled_time_of_that_node_pair_only():
    base = parse_cluster_config(YAML)
    slow = parse_cluster_config(YAML)
    load_plan("slow_link:nodes=node0-node1:factor=4", slow)
    size = 256 << 20
    t01 = costmodel.estimate_seconds("SendRecv", size, 1, [0, 2], 0, 1, base)
    s01 = costmodel.estimate_seconds("SendRecv", size, 1, [0, 2], 0, 1, slow)
    s12 = costmodel.estimate_seconds("SendRecv", size, 1, [2, 4], 0, 1, slow)
    t12 = costmodel.estimate_seconds("SendRecv", size, 1, [2, 4], 0, 1, base)
    assert s01 == pytest.approx(4 * t01, rel=0.02)          # latency is not scaled, bandwidth is
    assert s12 == pytest.approx(t12)
    ring_base = costmodel.estimate_seconds("AllReduce", size, 1, list(range(6)), -1, -1, base)
    ring_slow = costmodel.estimate_seconds("AllReduce", size, 1, list(range(6)), -1, -1, slow)
    assert ring_slow > 2 * ring_base                           # a ring is as fast as its slowest link


def test_slow_link_without_a_cluster_config_is_refused():
    with pytest.raises(FaultSpecError, match="needs a cluster config"):
        load_plan("slow_link:nodes=a-b:factor=2", None)


def test_fault_fires_count_times():
    plan = FaultPlan(parse_fault_env("drop:rank=1:op=Send:count=2"))

    class M:
        global_rank = 1

    desc = (7, 9, 7, 0, 6, 0, 1, 1, 0, 4, 0, 0, b"\0" * 8, 1, 0)     # a Send, first+last step
    lookup = {7: M()}.get
    assert plan.match(lookup, [desc]) is not None
    assert plan.match(lookup, [desc]) is not None
    assert plan.match(lookup, [desc]) is None and not plan.armed


def test_coordinator_refuses_a_bad_fault_spec(tmp_path):
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO_ROOT), "FAKEGPU_FAULTS": "kill:rank=one"}
    proc = subprocess.run([sys.executable, "-m", "fakegpu", "coordinator", "--address", str(tmp_path / "c.sock")],
                          env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "FAKEGPU_FAULTS item 1 'kill:rank=one': rank='one' must be an integer >= 0" in proc.stderr
