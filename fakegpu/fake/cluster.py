"""Synthetic uniform clusters for fake worlds (N identical nodes of G GPUs).

A 1024-rank logical world needs a 1024-rank topology; writing that YAML by hand is
tedious, so ``uniform_cluster_yaml`` writes it (the same schema as cluster_configs/) and
``uniform_cluster`` parses it, so the usual validation applies.
"""
from __future__ import annotations

from fakegpu.topology import Topology, parse_cluster_config


def uniform_cluster_yaml(nodes: int, gpus_per_node: int, *, profile: str = "h100",
                         nics: int | None = None, intra: str = "nvlink", intra_gbps: float = 3600,
                         inter: str = "infiniband", inter_gbps: float = 400,
                         name: str | None = None) -> str:
    if nodes < 1 or gpus_per_node < 1:
        raise ValueError(f"need at least one node and one GPU per node, got {nodes} x {gpus_per_node}")
    nics = gpus_per_node if nics is None else nics
    lines = ["version: 1", "cluster:", f"  name: {name or f'{nodes}x{gpus_per_node}-{profile}'}", "nodes:"]
    gpu_list = "[" + ", ".join(f"{{profile: {profile}}}" for _ in range(gpus_per_node)) + "]"
    for i in range(nodes):
        ranks = ", ".join(str(i * gpus_per_node + j) for j in range(gpus_per_node))
        lines += [f"  - id: node{i}", f"    host: host{i}", f"    ranks: [{ranks}]",
                  f"    nics: {nics}", f"    gpus: {gpu_list}"]
    lines += ["fabric:", "  intra_node:", f"    type: {intra}", f"    bandwidth_gbps: {intra_gbps}",
              "    latency_us: 2.5", "  inter_node:", f"    type: {inter}", f"    bandwidth_gbps: {inter_gbps}",
              "    latency_us: 5", "    oversubscription: 1", ""]
    return "\n".join(lines)


def uniform_cluster(nodes: int, gpus_per_node: int, **kw) -> Topology:
    return parse_cluster_config(uniform_cluster_yaml(nodes, gpus_per_node, **kw),
                                source=f"<synthetic {nodes}x{gpus_per_node}>")
