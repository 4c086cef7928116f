"""Chrome trace / Perfetto JSON of each rank's modeled communication.

One process per node and one thread (track) per global rank; every retained timeline
operation becomes a complete ("X") event on each participant's track, placed at its
modeled start so that collectives line up across ranks and a rank's operations sit end
to end. Open the file at https://ui.perfetto.dev or chrome://tracing.
"""
from __future__ import annotations


def build_trace(report: dict) -> dict:
    topo = report["topology"]
    node_index = {n["id"]: i for i, n in enumerate(topo["nodes"])}
    rank_node = {}
    events: list[dict] = []
    for node in topo["nodes"]:
        pid = node_index[node["id"]]
        events.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0,
                       "args": {"name": f"{node['id']} ({node['host']})"}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": pid}})
        for local, rank in enumerate(node["ranks"]):
            rank_node[rank] = pid
            events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": rank,
                           "args": {"name": f"rank {rank} ({node['gpus'][local]})"}})
            events.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": rank,
                           "args": {"sort_index": rank}})
    for op in report["timeline"]["operations"]:
        label = op["kind"] if not op["comm_name"] else f"{op['kind']} [{op['comm_name']}]"
        # Kept small: these args repeat on every participant's event, and the JSON report's
        # timeline has the full record (global ranks, datatype, wall times) under the same seq.
        args = {
            "seq": op["seq"],
            "comm_id": op["comm_id"],
            "algorithm": op["algorithm"],
            "logical_bytes": op["logical_bytes"],
            "inter_node_bytes": op["inter_node_bytes"],
        }
        for rank in op["global_ranks"]:
            if op["status"] != "ok":
                # A failed operation moved nothing: mark the moment instead of a zero-length box.
                events.append({"name": f"{label} {op['status']}", "cat": "failure", "ph": "i", "s": "t",
                               "ts": op["modeled_start_s"] * 1e6, "pid": rank_node.get(rank, 0), "tid": rank,
                               "args": dict(args, status=op["status"], error=op["error"])})
                continue
            events.append({
                "name": label,
                "cat": "p2p" if op["kind"] == "SendRecv" else "collective",
                "ph": "X",
                "ts": op["modeled_start_s"] * 1e6,
                "dur": op["modeled_s"] * 1e6,
                "pid": rank_node.get(rank, 0),
                "tid": rank,
                "args": args,
            })
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {
            "generator": "fakegpu",
            "clock": "modeled: microseconds on the cost model's timeline, not wall time",
            "cluster": topo["name"],
            "dropped_operations": report["timeline"]["dropped_operations"],
        },
    }
