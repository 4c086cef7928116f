"""Cluster topology: YAML loading/validation, GPU profiles, rank placement and links."""
from __future__ import annotations

from .loader import ClusterConfigError, ConfigIssue, load_cluster_config, parse_cluster_config
from .model import Fabric, LinkParams, Node, Topology, default_topology
from .profiles import PROFILES, GpuProfile, get_profile

__all__ = [
    "ClusterConfigError",
    "ConfigIssue",
    "Fabric",
    "GpuProfile",
    "LinkParams",
    "Node",
    "PROFILES",
    "Topology",
    "default_topology",
    "get_profile",
    "load_cluster_config",
    "parse_cluster_config",
]
