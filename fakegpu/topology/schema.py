"""JSON Schema (2020-12) of the cluster YAML. Semantic rules live in loader.py."""
from __future__ import annotations

from .model import INTER_NODE_TYPES, INTRA_NODE_TYPES

_POSITIVE = {"type": "number", "exclusiveMinimum": 0}

_FABRIC = {
    "type": "object",
    "required": ["type", "bandwidth_gbps", "latency_us"],
    "additionalProperties": False,
    "properties": {
        "type": {"type": "string"},
        "bandwidth_gbps": _POSITIVE,
        "latency_us": {"type": "number", "minimum": 0},
        "oversubscription": {"type": "number", "minimum": 1},
        "per_message_us": {"type": "number", "minimum": 0},
        "efficiency": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
        "gpudirect_rdma": {"type": "boolean"},
        "collnet": {"type": "boolean"},
    },
}

CLUSTER_CONFIG_SCHEMA = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "fakegpu cluster configuration",
    "type": "object",
    "required": ["version", "nodes", "fabric"],
    "additionalProperties": False,
    "properties": {
        "version": {"type": "integer"},
        "cluster": {
            "type": "object",
            "additionalProperties": False,
            "properties": {
                "name": {"type": "string", "minLength": 1},
                "default_backend": {"type": "string", "enum": ["nccl"]},
            },
        },
        "nodes": {
            "type": "array",
            "minItems": 1,
            "items": {
                "type": "object",
                "required": ["id", "ranks", "gpus"],
                "additionalProperties": False,
                "properties": {
                    "id": {"type": "string", "minLength": 1},
                    "host": {"type": "string", "minLength": 1},
                    "ranks": {
                        "type": "array",
                        "minItems": 1,
                        "items": {"type": "integer", "minimum": 0},
                    },
                    "gpus": {
                        "type": "array",
                        "minItems": 1,
                        "items": {
                            "type": "object",
                            "required": ["profile"],
                            "additionalProperties": False,
                            "properties": {"profile": {"type": "string", "minLength": 1},
                                           # board power cap, watts (nvidia-smi -pl); lowers clocks
                                           "power_limit_w": _POSITIVE},
                        },
                    },
                    "nics": {"type": "integer", "minimum": 1},
                    # pairs of GPU slots (0-based, in `gpus` order) joined by an NVLink bridge
                    "nvlink_bridges": {
                        "type": "array",
                        "items": {"type": "array", "minItems": 2, "maxItems": 2,
                                  "items": {"type": "integer", "minimum": 0}},
                    },
                    "nic_bandwidth_gbps": _POSITIVE,
                    # GB/s per direction the host moves GPU-to-GPU over PCIe, all GPUs together
                    "pcie_host_gbs": _POSITIVE,
                },
            },
        },
        # Checked by fakegpu.coordinator.faults (same rules as FAKEGPU_FAULTS, docs/faults.md).
        "faults": {"type": "array", "items": {"type": "object", "required": ["kind"]}},
        "fabric": {
            "type": "object",
            "required": ["intra_node"],
            "additionalProperties": False,
            "properties": {
                "intra_node": {
                    **_FABRIC,
                    "properties": {**_FABRIC["properties"], "type": {"enum": list(INTRA_NODE_TYPES)}},
                },
                "inter_node": {
                    **_FABRIC,
                    "properties": {**_FABRIC["properties"], "type": {"enum": list(INTER_NODE_TYPES)}},
                },
            },
        },
    },
}
