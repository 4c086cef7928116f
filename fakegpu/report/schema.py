"""JSON Schema (2020-12) of the cluster report; cluster_report.schema.json at the repository
root is this dict written out (tests keep the two identical: `python -m fakegpu.report.schema`
regenerates the file)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

SCHEMA_ID = "https://fakegpu.dev/schemas/cluster_report.schema.json"

_INT = {"type": "integer", "minimum": 0}
_NUM = {"type": "number", "minimum": 0}
_STR_OR_NULL = {"type": ["string", "null"]}
_COUNTER = {"type": "object", "additionalProperties": _INT}


def _obj(required: dict, optional: dict | None = None, extra: bool = False) -> dict:
    props = dict(required)
    props.update(optional or {})
    return {"type": "object", "required": sorted(required), "properties": props, "additionalProperties": extra}


_FABRIC = _obj({
    "type": {"type": "string"},
    "bandwidth_gbps": {"type": "number", "exclusiveMinimum": 0},
    "latency_us": _NUM,
    "oversubscription": {"type": "number", "minimum": 1},
}, {
    "per_message_us": _NUM,
    "efficiency": {"type": ["number", "null"]},
    "gpudirect_rdma": {"type": "boolean"},
    "collnet": {"type": "boolean"},
})

_TOPOLOGY = _obj({
    "name": {"type": "string"},
    "source": _STR_OR_NULL,
    "is_default": {"type": "boolean"},
    "warnings": {"type": "array", "items": {"type": "string"}},
    "default_backend": {"type": "string"},
    "world_size": _INT,
    "node_count": _INT,
    "nodes": {"type": "array", "items": _obj({
        "id": {"type": "string"},
        "host": {"type": "string"},
        "ranks": {"type": "array", "items": _INT},
        "gpus": {"type": "array", "items": {"type": "string"}},
        "nics": {"type": "integer", "minimum": 1},
        "nic_bandwidth_gbps": {"type": "number", "exclusiveMinimum": 0},
    }, {"pcie_host_gbs": {"type": ["number", "null"]}})},
    "fabric": _obj({"intra_node": _FABRIC, "inter_node": _FABRIC}),
})

_KIND_STATS = _obj({
    "calls": _INT,
    "errors": _INT,
    "logical_bytes": _INT,
    "socket_bytes": _INT,
    "modeled_time_s": _NUM,
    "algbw_gbs": _NUM,
    "busbw_gbs": _NUM,
    "rendezvous_s": _NUM,
    "execution_s": _NUM,
    "algorithms": _COUNTER,
    "datatypes": _COUNTER,
})

_LINK_COMMON = {
    "fabric_type": {"type": "string"},
    "bandwidth_gbps": _NUM,
    "latency_us": _NUM,
    "oversubscription": _NUM,
    "bytes": _INT,
    "transfers": _INT,
    "operations": _INT,
    "peak_operation_bytes": _INT,
    "modeled_time_s": _NUM,
    "modeled_avg_throughput_gbs": _NUM,
}

_TIMELINE_OP = _obj({
    "seq": {"type": "integer"},
    "comm_id": {"type": "integer"},
    "comm_name": {"type": "string"},
    "kind": {"enum": ["AllReduce", "Broadcast", "Reduce", "AllGather", "ReduceScatter", "AlltoAll",
                      "Gather", "Scatter", "SendRecv"]},
    "status": {"type": "string"},
    "error": {"type": "string"},
    "global_ranks": {"type": "array", "items": _INT, "minItems": 1},
    "root": {"type": ["integer", "null"]},
    "src": {"type": ["integer", "null"]},
    "dst": {"type": ["integer", "null"]},
    "datatype": {"type": "string"},
    "redop": _STR_OR_NULL,
    "count": _INT,
    "elem_size": _INT,
    "logical_bytes": _INT,
    "socket_bytes": _INT,
    "started_at": {"type": "number"},
    "rendezvous_s": {"type": "number"},
    "execution_s": {"type": "number"},
    "algorithm": _STR_OR_NULL,
    "modeled_s": _NUM,
    "modeled_start_s": _NUM,
    "intra_node_bytes": _INT,
    "inter_node_bytes": _INT,
})

# Failure and recovery (docs/faults.md): the faults configured, and what happened.
_EVENTS = _obj({
    "faults": {"type": "array", "items": {"type": "object", "required": ["kind", "spec"]}},
    "retained": _INT,
    "dropped": _INT,
    "by_event": _COUNTER,
    "items": {"type": "array", "items": {
        "type": "object", "required": ["event", "at"],
        "properties": {"event": {"enum": ["fault_injected", "op_failed", "comm_abort", "comm_shrink",
                                          "rank_disconnected", "init_timeout"]},
                       "at": {"type": "number"}},
    }},
})

REPORT_SCHEMA = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "$id": SCHEMA_ID,
    "title": "fakegpu cluster communication report",
    "description": "Written by the fakegpu coordinator. Bytes are integers; times are seconds; "
                   "throughputs are GB/s (1e9 bytes/s). modeled_* values come from the cost model.",
    **_obj({
        "schema_version": {"const": 1},
        "generator": _obj({"name": {"const": "fakegpu"}, "version": {"type": "string"}, "host": {"type": "string"}}),
        "generated_at": {"type": "number"},
        "started_at": {"type": "number"},
        "world_size": {"type": "integer", "minimum": 1},
        "metadata": {"type": "object"},
        "topology": _TOPOLOGY,
        "clients": _obj({"connected_total": _INT, "disconnected_total": _INT, "connected_now": _INT}),
        "totals": _obj({
            "operations": _INT,
            "failed_operations": _INT,
            "logical_bytes": _INT,
            "socket_bytes": _INT,
            "modeled_time_s": _NUM,
            "modeled_makespan_s": _NUM,
            "by_status": _COUNTER,
            "unattributed_operations": _INT,
        }),
        "collectives": {
            "type": "object",
            "propertyNames": {"enum": ["AllReduce", "Broadcast", "Reduce", "AllGather", "ReduceScatter",
                                       "AlltoAll", "Gather", "Scatter"]},
            "additionalProperties": _KIND_STATS,
        },
        "point_to_point": _obj({
            "operations": _INT,
            "sends": _INT,
            "recvs": _INT,
            "errors": _INT,
            "bytes": _INT,
            "socket_bytes": _INT,
            "modeled_time_s": _NUM,
            "intra_node_operations": _INT,
            "inter_node_operations": _INT,
            "modeled_avg_throughput_gbs": _NUM,
        }),
        "links": _obj({
            "intra_node": _obj({**_LINK_COMMON, "per_node": {"type": "array", "items": _obj({
                "node": {"type": "string"},
                "bytes": _INT,
                "transfers": _INT,
                "operations": _INT,
                "peak_operation_bytes": _INT,
            }, {"modeled_time_s": _NUM})}}),
            "inter_node": _obj(_LINK_COMMON),
        }),
        "node_pairs": {"type": "array", "items": _obj({
            "nodes": {"type": "array", "items": {"type": "string"}, "minItems": 2, "maxItems": 2},
            "hosts": {"type": "array", "items": {"type": "string"}, "minItems": 2, "maxItems": 2},
            "directions": {"type": "object", "additionalProperties": _INT, "minProperties": 2, "maxProperties": 2},
            "total_bytes": _INT,
            "transfers": _INT,
            "operations": _INT,
            "peak_operation_bytes": _INT,
            "modeled_time_s": _NUM,
            "modeled_avg_throughput_gbs": _NUM,
            "modeled_peak_throughput_gbs": _NUM,
            "by_operation": {"type": "object", "additionalProperties": _obj(
                {"operations": _INT, "bytes": _INT, "transfers": _INT})},
        })},
        "ranks": {"type": "array", "items": _obj({
            "rank": _INT,
            "node": _STR_OR_NULL,
            "gpu_profile": _STR_OR_NULL,
            "pid": {"type": ["integer", "null"]},
            "hostname": _STR_OR_NULL,
            "transport": _STR_OR_NULL,
            "shared_memory": {"type": ["boolean", "null"]},
            "connected": {"type": "boolean"},
            "disconnect_reason": _STR_OR_NULL,
            "wait_s": _NUM,
            "timeouts": _INT,
            "errors": _INT,
            "absences": _INT,
            "comm_inits": _INT,
            "init_wait_s": _NUM,
            "collective_calls": _INT,
            "p2p_sends": _INT,
            "p2p_recvs": _INT,
            "bytes_sent": _INT,
            "bytes_received": _INT,
            "modeled_busy_s": _NUM,
            "modeled_end_s": _NUM,
        }, {"init_timeouts": _INT})},
        "communicators": {"type": "array", "items": _obj({
            "id": {"type": "integer"},
            "name": {"type": "string"},
            "parent_id": {"type": ["integer", "null"]},
            "size": _INT,
            "members": {"type": "array", "items": _INT},
            "nodes": {"type": "array", "items": {"type": "string"}},
            "operations": _INT,
            "errors": _INT,
            "logical_bytes": _INT,
            "modeled_time_s": _NUM,
            "by_kind": _COUNTER,
        })},
        "timeline": _obj({
            "max_operations": _INT,
            "retained": _INT,
            "dropped_operations": _INT,
            "operations": {"type": "array", "items": _TIMELINE_OP},
        }),
        "notes": {"type": "array", "items": {"type": "string"}},
    }, {"events": _EVENTS}),
}


def schema_json() -> str:
    return json.dumps(REPORT_SCHEMA, indent=2) + "\n"


def repo_schema_path() -> Path:
    return Path(__file__).resolve().parents[2] / "cluster_report.schema.json"


if __name__ == "__main__":  # regenerate the repository-root copy
    path = Path(sys.argv[1]) if len(sys.argv) > 1 else repo_schema_path()
    path.write_text(schema_json(), encoding="utf-8")
    print(f"wrote {path}")
