"""Traffic per parallelism group: the report's communicators gathered by name.

A parallel layout (data, tensor, pipeline, FSDP... parallelism over a device mesh) gives each
mesh dimension one communicator per instance: with a (dp=4, tp=2) mesh there are two `mesh_dp`
communicators of four ranks and four `mesh_tp` ones of two. PyTorch names all instances of one
dimension alike (the process group's description, `mesh_<dim>`), and a name may also end in an
instance index (`mesh_dp[1]`, `mesh_dp#1`), which is dropped. Communicators without a name are
one group, `(unnamed)`. Each group sums its instances and keeps them, so a report reader can
compare dimensions and spot an instance that moves more than its siblings.
"""
from __future__ import annotations

import re

_INSTANCE_SUFFIX = re.compile(r"(\[\d+\]|#\d+)$")
UNNAMED = "(unnamed)"


def group_name(name: str) -> str:
    """The parallelism group (mesh dimension) a communicator name belongs to."""
    base = _INSTANCE_SUFFIX.sub("", name or "").strip()
    return base or UNNAMED


def parallelism_groups(report: dict) -> list[dict]:
    """One entry per group, most modeled time first: name, instances, their total operations,
    payload and modeled time, the largest instance's modeled time, and every instance (id, name,
    members, operations, payload, modeled time) in id order."""
    groups: dict[str, dict] = {}
    for c in report.get("communicators", ()):
        key = group_name(c.get("name", ""))
        g = groups.setdefault(key, {"name": key, "instances": [], "operations": 0, "errors": 0,
                                    "logical_bytes": 0, "modeled_time_s": 0.0,
                                    "max_instance_modeled_time_s": 0.0, "by_kind": {}})
        g["instances"].append({k: c[k] for k in ("id", "name", "size", "members", "nodes", "operations",
                                                 "logical_bytes", "modeled_time_s")})
        g["operations"] += c["operations"]
        g["errors"] += c.get("errors", 0)
        g["logical_bytes"] += c["logical_bytes"]
        g["modeled_time_s"] += c["modeled_time_s"]
        g["max_instance_modeled_time_s"] = max(g["max_instance_modeled_time_s"], c["modeled_time_s"])
        for kind, n in c.get("by_kind", {}).items():
            g["by_kind"][kind] = g["by_kind"].get(kind, 0) + n
    out = sorted(groups.values(), key=lambda g: (-g["modeled_time_s"], g["name"]))
    for g in out:
        g["instances"].sort(key=lambda i: i["id"])
    return out
