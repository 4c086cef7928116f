"""Cluster YAML loading: bundled configs, placement queries, and one error per rule
(each naming file, field path and line)."""
from __future__ import annotations

from pathlib import Path

import pytest

from fakegpu.topology import (
    PROFILES,
    ClusterConfigError,
    default_topology,
    get_profile,
    load_cluster_config,
)
from helpers.paths import REPO_ROOT as REPO

CONFIGS = REPO / "cluster_configs"

BASE = """\
version: 1
cluster:
  name: test
  default_backend: nccl
nodes:
  - id: node0
    host: 10.0.0.1
    ranks: [0, 1]
    gpus:
      - profile: a100
      - profile: a100
  - id: node1
    host: 10.0.0.2
    ranks: [2, 3]
    gpus:
      - profile: h100
      - profile: h100
fabric:
  intra_node:
    type: nvlink
    bandwidth_gbps: 2400
    latency_us: 3
  inter_node:
    type: infiniband
    bandwidth_gbps: 200
    latency_us: 15
    oversubscription: 1.5
"""


def _load(tmp_path: Path, text: str, name: str = "cluster.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return load_cluster_config(path), path


def _error(tmp_path: Path, text: str) -> tuple[ClusterConfigError, Path]:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ClusterConfigError) as info:
        load_cluster_config(path)
    return info.value, path


# -- bundled configs -----------------------------------------------------------------------
@pytest.mark.parametrize("name, world, nodes", [
    ("h100-1node-8gpu-nvlink.yaml", 8, 1),
    ("h100-2node-8gpu-ib-8x400g.yaml", 16, 2),
    ("a100-4node-4gpu-hdr.yaml", 16, 4),
    ("a100-1node-8gpu-nvlink.yaml", 8, 1),
    ("tcp-2rank-rtxpro5000-rtx3090ti.yaml", 2, 2),
    ("heterogeneous-3node.yaml", 7, 3),
    ("dev-2node-2gpu.yaml", 4, 2),
    ("gcp-a3mega-2node-8gpu-tcpxo.yaml", 16, 2),
    ("rtx5090-1node-8gpu-pcie5.yaml", 8, 1),
    ("h100pcie-1node-2gpu-nvlink-bridge.yaml", 2, 1),
    ("h100-96gb-500w-grand-teton-8gpu-rdma.yaml", 8, 1),
])
def test_bundled_configs_load(name, world, nodes):
    topo = load_cluster_config(CONFIGS / name)
    assert (topo.world_size, topo.node_count) == (world, nodes)
    assert not topo.is_default
    assert topo.source == str(CONFIGS / name)


def test_every_bundled_config_is_covered():
    assert len(list(CONFIGS.glob("*.yaml"))) == 11


def test_usage_doc_two_rank_tcp_example():
    topo = load_cluster_config(CONFIGS / "tcp-2rank-rtxpro5000-rtx3090ti.yaml")
    assert topo.gpu_of(0).name == "rtx-pro-5000-blackwell"
    assert topo.gpu_of(1).name == "rtx3090ti"
    assert topo.inter_node.type == "tcp"
    assert not topo.same_node(0, 1)


def test_placement_queries(tmp_path):
    topo, _ = _load(tmp_path, BASE)
    assert topo.world_size == 4 and topo.node_count == 2
    assert [topo.node_of(r) for r in range(4)] == [0, 0, 1, 1]
    assert topo.node_id_of(3) == "node1"
    assert topo.same_node(0, 1) and not topo.same_node(1, 2)
    assert topo.local_index(3) == 1
    assert topo.gpu_of(0).name == "a100" and topo.gpu_of(2).name == "h100"
    intra = topo.link(0, 1)
    assert intra.scope == "intra_node" and intra.type == "nvlink"
    assert intra.bandwidth_bytes_per_s == pytest.approx(300e9)   # 2400 Gb/s, A100 NVLink3 also 300 GB/s
    assert intra.latency_s == pytest.approx(3e-6)
    inter = topo.link(1, 2)
    assert inter.scope == "inter_node"
    assert inter.bandwidth_bytes_per_s == pytest.approx(200e9 / 8 / 1.5)  # oversubscription applies
    assert inter.latency_s == pytest.approx(15e-6)
    assert topo.link(2, 2).scope == "self"
    with pytest.raises(ValueError, match="global rank 4 is not placed"):
        topo.node_of(4)


def test_profile_caps_intra_node_bandwidth():
    topo = load_cluster_config(CONFIGS / "heterogeneous-3node.yaml")
    # Same 3600 Gb/s NVLink-class fabric, but the L40S has only PCIe Gen4.
    assert topo.link(0, 1).bandwidth_bytes_per_s == pytest.approx(450e9)
    assert topo.link(4, 5).bandwidth_bytes_per_s == pytest.approx(32e9)
    assert topo.nodes[2].nic_bandwidth_gbps == 25
    assert topo.nic_bytes_per_s(2) == pytest.approx(25e9 / 8 / 1.5)
    assert topo.node_network_bytes_per_s(0) == pytest.approx(2 * 100e9 / 8 / 1.5)


def test_profile_catalogue():
    for name in ("a100", "a100-80gb", "h100", "h100-pcie", "h200", "b200", "l40s", "rtx4090",
                 "rtx3090ti", "rtx-pro-5000-blackwell"):
        assert name in PROFILES
        profile = PROFILES[name]
        assert profile.memory_gb > 0 and profile.pcie_gbs > 0
    assert get_profile("H100").name == "h100"
    assert get_profile("A100-40GB").name == "a100"
    assert PROFILES["b200"].nvlink_gbs > PROFILES["h100"].nvlink_gbs > PROFILES["a100"].nvlink_gbs
    assert PROFILES["rtx4090"].nvlink_gbs is None
    with pytest.raises(KeyError, match="unknown GPU profile"):
        get_profile("tpu-v5")


def test_default_topology():
    topo = default_topology(3)
    assert topo.is_default and topo.world_size == 3 and topo.node_count == 1
    assert all(topo.same_node(0, r) for r in range(3))
    assert topo.to_dict()["is_default"] is True
    with pytest.raises(ValueError):
        default_topology(0)


def test_optional_fields(tmp_path):
    text = BASE.replace("    host: 10.0.0.2\n", "    host: 10.0.0.2\n    nics: 4\n    nic_bandwidth_gbps: 400\n")
    topo, _ = _load(tmp_path, text)
    assert topo.nodes[1].nics == 4
    assert topo.nic_bytes_per_s(1) == pytest.approx(400e9 / 8 / 1.5)
    single = "\n".join(line for line in BASE.splitlines()[:11]) + "\nfabric:\n  intra_node:\n    type: pcie\n" \
        "    bandwidth_gbps: 256\n    latency_us: 5\n"
    topo, _ = _load(tmp_path, single, "single.yaml")
    assert topo.node_count == 1 and topo.inter_node.type == "infiniband"


# -- one error per rule --------------------------------------------------------------------
INVALID = [
    # (id, replace-from, replace-to, path, line, message fragment)
    ("version", "version: 1", "version: 2", "version", 1, "unsupported version 2"),
    ("duplicate-rank", "ranks: [2, 3]", "ranks: [1, 3]", "nodes[1].ranks[0]", 14, "rank 1 is already assigned at nodes[0].ranks[1]"),
    ("not-contiguous", "ranks: [2, 3]", "ranks: [2, 5]", "nodes", 5, "contiguous from 0 to 3: missing 3"),
    ("not-from-zero", "ranks: [0, 1]", "ranks: [4, 1]", "nodes", 5, "missing 0"),
    ("gpu-count", "      - profile: h100\n      - profile: h100\n", "      - profile: h100\n", "nodes[1].gpus", 15,
     "lists 2 ranks but 1 gpus"),
    ("unknown-profile", "      - profile: h100\nfabric", "      - profile: h200x\nfabric", "nodes[1].gpus[1].profile", 17,
     "unknown GPU profile 'h200x'"),
    ("zero-bandwidth", "bandwidth_gbps: 200", "bandwidth_gbps: 0", "fabric.inter_node.bandwidth_gbps", 25,
     "must be greater than 0"),
    ("negative-bandwidth", "bandwidth_gbps: 2400", "bandwidth_gbps: -5", "fabric.intra_node.bandwidth_gbps", 21,
     "must be greater than 0"),
    ("oversubscription", "oversubscription: 1.5", "oversubscription: 0.5", "fabric.inter_node.oversubscription", 27,
     "must be at least 1"),
    ("negative-latency", "latency_us: 15", "latency_us: -1", "fabric.inter_node.latency_us", 26, "must be at least 0"),
    ("unknown-field", "    host: 10.0.0.1\n", "    host: 10.0.0.1\n    gpu_count: 2\n", "nodes[0].gpu_count", 8,
     "unknown field 'gpu_count'"),
    ("missing-field", "    ranks: [2, 3]\n", "", "nodes[1]", 12, "'ranks' is required"),
    ("wrong-type", "ranks: [2, 3]", "ranks: '2,3'", "nodes[1].ranks", 14, "must be of type array"),
    ("negative-rank", "ranks: [2, 3]", "ranks: [2, -3]", "nodes[1].ranks[1]", 14, "must be at least 0"),
    ("fabric-type", "type: infiniband", "type: carrier-pigeon", "fabric.inter_node.type", 24, "must be one of"),
    ("duplicate-node-id", "  - id: node1", "  - id: node0", "nodes[1].id", 12, "node id 'node0' is already used"),
    ("duplicate-key", "    host: 10.0.0.2\n", "    host: 10.0.0.2\n    host: 10.0.0.3\n", "nodes[1].host", 14,
     "duplicate key 'host'"),
    ("missing-inter-node", "  inter_node:\n    type: infiniband\n    bandwidth_gbps: 200\n    latency_us: 15\n"
     "    oversubscription: 1.5\n", "", "fabric", 18, "inter_node is required"),
    ("nics", "    host: 10.0.0.2\n", "    host: 10.0.0.2\n    nics: 0\n", "nodes[1].nics", 14, "must be at least 1"),
]


@pytest.mark.parametrize("case", INVALID, ids=[c[0] for c in INVALID])
def test_invalid_config_names_file_path_and_line(tmp_path, case):
    _, old, new, path, line, fragment = case
    assert old in BASE
    error, file = _error(tmp_path, BASE.replace(old, new, 1))
    matching = [i for i in error.issues if i.path == path]
    assert matching, f"no issue at {path}: {error}"
    issue = matching[0]
    assert fragment in issue.message, str(error)
    assert issue.line == line, str(error)
    assert issue.file == str(file)
    assert f"{file}:{line}: {path}: " in str(error)


def test_yaml_syntax_error_has_line(tmp_path):
    error, file = _error(tmp_path, BASE.replace("    ranks: [2, 3]", "    ranks: [2, 3"))
    assert len(error.issues) == 1
    assert "YAML syntax error" in error.issues[0].message
    assert error.issues[0].line >= 14


def test_empty_file(tmp_path):
    error, _ = _error(tmp_path, "# nothing here\n")
    assert "empty" in str(error)


def test_not_a_mapping(tmp_path):
    error, _ = _error(tmp_path, "- 1\n- 2\n")
    assert "must be of type object" in str(error)


def test_missing_file(tmp_path):
    with pytest.raises(ClusterConfigError, match="cannot read file"):
        load_cluster_config(tmp_path / "absent.yaml")


def test_all_problems_reported_together(tmp_path):
    text = BASE.replace("profile: a100\n  - id", "profile: nope\n  - id").replace("ranks: [2, 3]", "ranks: [2, 2]")
    error, _ = _error(tmp_path, text)
    paths = {i.path for i in error.issues}
    assert "nodes[0].gpus[1].profile" in paths and "nodes[1].ranks[1]" in paths


def test_yaml_anchors_and_merge_keys(tmp_path):
    text = BASE.replace("fabric:\n  intra_node:\n    type: nvlink\n", "fabric:\n  intra_node: &fast\n    type: nvlink\n")
    text = text.replace("  inter_node:\n    type: infiniband\n    bandwidth_gbps: 200\n",
                        "  inter_node:\n    <<: *fast\n    type: infiniband\n    bandwidth_gbps: 200\n")
    text = text.replace("    latency_us: 15\n", "")
    topo, _ = _load(tmp_path, text)
    assert topo.inter_node.type == "infiniband" and topo.inter_node.latency_us == 3   # merged from the anchor
    assert topo.inter_node.bandwidth_gbps == 200                                      # explicit key wins


def test_unknown_yaml_tag(tmp_path):
    error, _ = _error(tmp_path, BASE.replace("latency_us: 15", "latency_us: !microseconds 15"))
    assert "YAML error" in str(error) and error.issues[0].line == 26


def test_gigabit_units_warning(tmp_path):
    topo, path = _load(tmp_path, BASE.replace("bandwidth_gbps: 2400", "bandwidth_gbps: 300"))
    assert len(topo.warnings) == 1
    assert f"{path}:21: fabric.intra_node.bandwidth_gbps: 300 Gb/s (37.5 GB/s)" in topo.warnings[0]
    assert load_cluster_config(CONFIGS / "h100-1node-8gpu-nvlink.yaml").warnings == []


# -- hostile YAML: every limit is enforced while composing, with a message that names it -------
from fakegpu.topology import loader  # noqa: E402

_BILLION_LAUGHS = "".join(
    [f'l0: &l0 [{",".join(["lol"] * 10)}]\n']
    + [f"l{i}: &l{i} [{','.join([f'*l{i - 1}'] * 10)}]\n" for i in range(1, 10)])
_DEEP = "version: " + "[" * 50_000 + "]" * 50_000 + "\n"

HOSTILE = {
    # name: (file contents, text the single issue must contain)
    "billion-laughs": (_BILLION_LAUGHS, f"more than {loader.MAX_NODES:,} YAML nodes once its aliases are expanded (the limit for a cluster config"),
    "deep": (_DEEP, f"nesting deeper than {loader.MAX_DEPTH} levels (the limit for a cluster config)"),
    "10mb": (BASE + "padding: [" + ", ".join(["1"] * 3_400_000) + "]\n",
             f"is larger than {loader.MAX_CONFIG_BYTES >> 20} MiB (the limit for a cluster config)"),
    "recursive-alias": ("a: &a [1, *a]\n", "alias *a is inside the node it refers to"),
}


def _write_hostile(tmp_path: Path, name: str) -> tuple[Path, str]:
    text, fragment = HOSTILE[name]
    path = tmp_path / f"{name}.yaml"
    path.write_text(text)
    return path, fragment


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_yaml_is_rejected_naming_the_limit(tmp_path, name):
    path, fragment = _write_hostile(tmp_path, name)
    with pytest.raises(ClusterConfigError) as info:
        load_cluster_config(path)
    (issue,) = info.value.issues
    assert fragment in issue.message, issue
    assert issue.file == str(path)


def test_billion_laughs_is_small_and_would_expand_to_ten_billion_nodes():
    assert len(_BILLION_LAUGHS) == 500   # the attack is a tiny file: the size limit is not what stops it


def test_too_many_aliases(tmp_path):
    text = "a: &x 1\nb: [" + ", ".join(["*x"] * (loader.MAX_ALIASES + 1)) + "]\n"
    error, _ = _error(tmp_path, text)
    assert f"more than {loader.MAX_ALIASES:,} aliases (the limit for a cluster config)" in str(error)


def test_size_limit_does_not_trust_the_file_size(tmp_path):
    # /dev/zero (like a pipe) reports size 0: the reader stops one byte past the limit.
    with pytest.raises(ClusterConfigError, match="is larger than 4 MiB"):
        load_cluster_config("/dev/zero")


def test_text_that_is_not_utf8_or_has_control_characters(tmp_path):
    path = tmp_path / "latin1.yaml"
    path.write_bytes(BASE.replace("name: test", "name: t\xe9st").encode("latin-1"))
    with pytest.raises(ClusterConfigError, match=r"latin1.yaml:3: <document>: not UTF-8 text"):
        load_cluster_config(path)
    error, _ = _error(tmp_path, BASE.replace("name: test", "name: te\x07st"))
    assert "YAML error" in str(error) and "special characters are not allowed" in str(error)


def test_limits_leave_room_for_large_real_configs(tmp_path):
    # 1024 nodes x 8 GPUs, each node merging the first one's fields through an alias.
    gpus = ", ".join(["{profile: h100}"] * 8)
    lines = ["version: 1", "nodes:",
             f"  - &n0 {{id: n0, host: dgx, nics: 8, ranks: [0, 1, 2, 3, 4, 5, 6, 7], gpus: [{gpus}]}}"]
    lines += [f"  - {{<<: *n0, id: n{i}, ranks: [{', '.join(str(8 * i + j) for j in range(8))}]}}"
              for i in range(1, 1024)]
    lines += ["fabric:", "  intra_node: {type: nvlink, bandwidth_gbps: 3600, latency_us: 2.5}",
              "  inter_node: {type: infiniband, bandwidth_gbps: 400, latency_us: 5}", ""]
    topo, _ = _load(tmp_path, "\n".join(lines))
    assert (topo.world_size, topo.node_count) == (8192, 1024)
    assert topo.nodes[1023].nics == 8 and topo.gpu_of(8191).name == "h100"


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_coordinator_cli_rejects_hostile_yaml_with_one_clean_error(tmp_path, name):
    """Through the real CLI: exit status 2, the message, no traceback. On main these grew the
    coordinator past gigabytes, raised RecursionError, or parsed for over a minute: the address
    space cap and the timeout turn each into a failure instead of a stuck machine."""
    import os
    import resource
    import subprocess
    import sys

    path, fragment = _write_hostile(tmp_path, name)

    def cap_memory():
        resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))

    proc = subprocess.run([sys.executable, "-m", "fakegpu", "coordinator", "--address", str(tmp_path / "c.sock"),
                           "--cluster-config", str(path)], capture_output=True, text=True, timeout=30,
                          preexec_fn=cap_memory, env=dict(os.environ, PYTHONPATH=str(REPO)), cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert proc.stderr.startswith(f"fakegpu coordinator: --cluster-config {path}: invalid cluster config {path}:")
    assert fragment in proc.stderr and proc.stdout == ""


def test_a_bundled_config_is_found_by_bare_name_from_any_directory(tmp_path, monkeypatch):
    from fakegpu.topology.bundled import bundled_cluster_config, bundled_names

    monkeypatch.chdir(tmp_path)
    assert "dev-2node-2gpu.yaml" in bundled_names()
    for name in ("dev-2node-2gpu.yaml", "dev-2node-2gpu"):
        topo = load_cluster_config(name)
        assert topo.world_size == 4 and str(bundled_cluster_config(name)) in topo.describe()
    assert bundled_cluster_config("sub/dev-2node-2gpu.yaml") is None   # a path is never a bundled name
    with pytest.raises(ClusterConfigError, match="fakegpu ships these cluster configs.*dev-2node-2gpu.yaml"):
        load_cluster_config("no-such-config.yaml")
