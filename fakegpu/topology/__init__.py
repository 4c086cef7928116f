"""Cluster topology: YAML loading/validation, GPU profiles, rank placement and links.

The YAML loader (PyYAML and jsonschema) is imported when a name of it is first used, so the
default topology of a run without a cluster config needs neither package."""
from __future__ import annotations

from fakegpu._lazy import lazy_exports

from .model import Fabric, LinkParams, Node, Topology, default_topology
from .profiles import PROFILES, GpuProfile, get_profile

_LOADER = ("ClusterConfigError", "ConfigIssue", "load_cluster_config", "parse_cluster_config")
_EAGER = ("Fabric", "GpuProfile", "LinkParams", "Node", "PROFILES", "Topology", "default_topology", "get_profile")

__getattr__, _lazy_names = lazy_exports(__name__, {name: "fakegpu.topology.loader" for name in _LOADER})
__all__ = sorted(_lazy_names + list(_EAGER))
