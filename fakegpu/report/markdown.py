"""The human-readable Markdown rendering of a cluster report dict."""
from __future__ import annotations

import datetime as _dt
from typing import Iterable, Sequence

from fakegpu.report.groups import parallelism_groups

TOP_COMMUNICATORS = 10
TOP_OPERATIONS = 10


def fmt_bytes(n: float) -> str:
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


def fmt_seconds(s: float) -> str:
    s = float(s)
    if s == 0:
        return "0"
    if s < 1e-3:
        return f"{s * 1e6:.1f} us"
    if s < 1:
        return f"{s * 1e3:.2f} ms"
    return f"{s:.3f} s"


def fmt_gbs(x: float) -> str:
    return f"{x:.1f}" if x else "-"


def table(headers: Sequence[str], rows: Iterable[Sequence[object]]) -> list[str]:
    out = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    for row in rows:
        out.append("| " + " | ".join(str(c).replace("|", "\\|") for c in row) + " |")
    return out


def render_markdown(report: dict) -> str:
    topo = report["topology"]
    totals = report["totals"]
    p2p = report["point_to_point"]
    when = _dt.datetime.fromtimestamp(report["generated_at"], _dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    lines = [f"# Cluster communication report: {topo['name']}", ""]
    lines.append(f"Generated {when} by fakegpu {report['generator']['version']} (schema {report['schema_version']}).")
    if topo["is_default"]:
        lines += ["", f"> **No cluster config was given.** The numbers below model a default topology: one node "
                      f"with {topo['world_size']} GPUs ({', '.join(sorted(set(topo['nodes'][0]['gpus'])))}) on NVLink. "
                      "Pass `--cluster-config` / `FAKEGPU_CLUSTER_CONFIG` to model your cluster."]
    lines += ["", "## Summary", ""]
    intra, inter = report["links"]["intra_node"], report["links"]["inter_node"]
    rows = [
        ("World size", report["world_size"]),
        ("Nodes", f"{topo['node_count']} ({', '.join(n['id'] for n in topo['nodes'])})"),
        ("Topology source", topo["source"] or ("default (derived from world size)" if topo["is_default"] else "built in code")),
        ("Intra-node fabric", f"{intra['fabric_type']}, {intra['bandwidth_gbps']:g} Gb/s, {intra['latency_us']:g} us"),
        ("Inter-node fabric", f"{inter['fabric_type']}, {inter['bandwidth_gbps']:g} Gb/s per NIC, "
                              f"{inter['latency_us']:g} us, oversubscription {inter['oversubscription']:g}"),
        ("Operations (ok / failed)", f"{totals['operations']} / {totals['failed_operations']}"),
        ("Logical payload", fmt_bytes(totals["logical_bytes"])),
        ("Bytes over coordinator sockets", fmt_bytes(totals["socket_bytes"])),
        ("Modeled communication time (sum)", fmt_seconds(totals["modeled_time_s"])),
        ("Modeled makespan (ranks in parallel)", fmt_seconds(totals["modeled_makespan_s"])),
        ("Intra-node bytes moved", fmt_bytes(intra["bytes"])),
        ("Inter-node bytes moved", fmt_bytes(inter["bytes"])),
    ]
    for key, value in _flatten(report["metadata"]):
        rows.append((f"metadata: {key}", value))
    lines += table(("Item", "Value"), rows)

    lines += ["", "## Collectives", ""]
    if report["collectives"]:
        lines += table(
            ("Operation", "Calls", "Failed", "Payload", "Modeled time", "algbw GB/s", "busbw GB/s", "Algorithms"),
            (
                (k, s["calls"], s["errors"], fmt_bytes(s["logical_bytes"]), fmt_seconds(s["modeled_time_s"]),
                 fmt_gbs(s["algbw_gbs"]), fmt_gbs(s["busbw_gbs"]),
                 ", ".join(f"{a} x{c}" for a, c in s["algorithms"].items()))
                for k, s in report["collectives"].items()
            ),
        )
    else:
        lines.append("No collective operations were recorded.")
    lines += ["", "## Point-to-point", ""]
    lines += table(
        ("Send/recv pairs", "Failed", "Payload", "Intra-node", "Inter-node", "Modeled time", "Avg GB/s"),
        [(p2p["operations"], p2p["errors"], fmt_bytes(p2p["bytes"]), p2p["intra_node_operations"],
          p2p["inter_node_operations"], fmt_seconds(p2p["modeled_time_s"]), fmt_gbs(p2p["modeled_avg_throughput_gbs"]))],
    )

    lines += ["", "## Links", "",
              "Modeled time is the summed modeled time of the operations that used the link.", ""]
    lines += table(
        ("Link", "Fabric", "Bytes", "Transfers", "Ops", "Peak per op", "Modeled time", "Modeled avg GB/s"),
        ((scope.replace("_", "-"), f"{link['fabric_type']}, {link['bandwidth_gbps']:g} Gb/s", fmt_bytes(link["bytes"]),
          link["transfers"], link["operations"], fmt_bytes(link["peak_operation_bytes"]),
          fmt_seconds(link["modeled_time_s"]), fmt_gbs(link["modeled_avg_throughput_gbs"]))
         for scope, link in (("intra_node", intra), ("inter_node", inter))),
    )

    lines += ["", "## Node pairs", ""]
    if report["node_pairs"]:
        lines += table(
            ("Pair", "Direction bytes", "Total", "Transfers", "Ops", "Peak per op", "Modeled time", "Modeled avg GB/s",
             "Modeled peak GB/s", "By operation"),
            (
                (" <-> ".join(p["nodes"]),
                 "; ".join(f"{d}: {fmt_bytes(b)}" for d, b in p["directions"].items()),
                 fmt_bytes(p["total_bytes"]), p["transfers"], p["operations"], fmt_bytes(p["peak_operation_bytes"]),
                 fmt_seconds(p["modeled_time_s"]),
                 fmt_gbs(p["modeled_avg_throughput_gbs"]), fmt_gbs(p["modeled_peak_throughput_gbs"]),
                 ", ".join(f"{k} {v['operations']}x/{fmt_bytes(v['bytes'])}" for k, v in p["by_operation"].items()))
                for p in report["node_pairs"]
            ),
        )
    else:
        lines.append("No traffic crossed between nodes.")
    if intra["per_node"]:
        lines += ["", "Inside each node:", ""]
        lines += table(("Node", "Bytes", "Transfers", "Ops", "Peak per op", "Modeled time"),
                       ((n["node"], fmt_bytes(n["bytes"]), n["transfers"], n["operations"],
                         fmt_bytes(n["peak_operation_bytes"]),
                         fmt_seconds(n["modeled_time_s"]) if "modeled_time_s" in n else "-")
                        for n in intra["per_node"]))

    lines += ["", "## Ranks", ""]
    lines += table(
        ("Rank", "Node", "GPU", "Host / pid", "Collectives", "Sends / recvs", "Sent", "Received", "Wait",
         "Timeouts", "Errors", "Absent", "Comm inits", "Modeled busy"),
        (
            (r["rank"], r["node"] or "?", r["gpu_profile"] or "?",
             f"{r['hostname'] or '-'} / {r['pid'] if r['pid'] is not None else '-'}",
             r["collective_calls"], f"{r['p2p_sends']} / {r['p2p_recvs']}", fmt_bytes(r["bytes_sent"]),
             fmt_bytes(r["bytes_received"]), fmt_seconds(r["wait_s"]), r["timeouts"], r["errors"],
             r["absences"], r["comm_inits"], fmt_seconds(r["modeled_busy_s"]))
            for r in report["ranks"]
        ),
    )

    lines += ["", "## Parallelism groups", "",
              "Communicators gathered by name (one per mesh dimension; its instances summed).", ""]
    groups = parallelism_groups(report)
    if groups:
        lines += table(
            ("Group", "Instances", "Ranks per instance", "Ops", "Payload", "Modeled time (sum)",
             "Largest instance", "By kind"),
            ((g["name"], len(g["instances"]), ", ".join(sorted({str(i["size"]) for i in g["instances"]})),
              g["operations"], fmt_bytes(g["logical_bytes"]), fmt_seconds(g["modeled_time_s"]),
              fmt_seconds(g["max_instance_modeled_time_s"]),
              ", ".join(f"{k} {v}" for k, v in sorted(g["by_kind"].items())))
             for g in groups),
        )
    else:
        lines.append("No communicators were created.")

    lines += ["", "## Communicators", ""]
    comms = sorted(report["communicators"], key=lambda c: (-c["modeled_time_s"], c["id"]))
    if comms:
        shown = comms[:TOP_COMMUNICATORS]
        lines += table(
            ("Id", "Name", "Size", "Members", "Nodes", "Ops", "Payload", "Modeled time", "By kind"),
            (
                (c["id"], c["name"] or "-", c["size"], _ranks_text(c["members"]), ", ".join(c["nodes"]),
                 c["operations"], fmt_bytes(c["logical_bytes"]), fmt_seconds(c["modeled_time_s"]),
                 ", ".join(f"{k} {v}" for k, v in c["by_kind"].items()))
                for c in shown
            ),
        )
        if len(comms) > len(shown):
            lines.append(f"\n{len(comms) - len(shown)} more communicators are listed in the JSON report.")
    else:
        lines.append("No communicators were created.")

    tl = report["timeline"]
    lines += ["", "## Timeline", "",
              f"{tl['retained']} operations retained (limit {tl['max_operations']}), "
              f"{tl['dropped_operations']} dropped from the timeline (still counted above)."]
    costly = sorted((o for o in tl["operations"] if o["status"] == "ok" and o["modeled_s"] > 0),
                    key=lambda o: -o["modeled_s"])[:TOP_OPERATIONS]
    if costly:
        lines += ["", "Most expensive retained operations (modeled):", ""]
        lines += table(
            ("Comm", "Seq", "Operation", "Ranks", "Type", "Payload", "Inter-node bytes", "Algorithm", "Modeled"),
            ((o["comm_name"] or o["comm_id"], o["seq"], o["kind"], _ranks_text(o["global_ranks"]), o["datatype"],
              fmt_bytes(o["logical_bytes"]), fmt_bytes(o["inter_node_bytes"]), o["algorithm"],
              fmt_seconds(o["modeled_s"])) for o in costly),
        )
    failed = [o for o in tl["operations"] if o["status"] != "ok"][:TOP_OPERATIONS]
    if failed:
        lines += ["", "Failed operations:", ""]
        lines += table(("Comm", "Seq", "Operation", "Ranks", "Status", "Error"),
                       ((o["comm_name"] or o["comm_id"], o["seq"], o["kind"], _ranks_text(o["global_ranks"]),
                         o["status"], o["error"][:120]) for o in failed))
    lines += _events_section(report.get("events"))
    lines += ["", "## What the modeled numbers mean", ""]
    lines += [f"- {note}" for note in report["notes"]]
    lines += [
        "- algbw = payload / modeled time; busbw = algbw x the nccl-tests factor of the operation "
        "(2(n-1)/n for AllReduce, (n-1)/n for AllGather/ReduceScatter/AlltoAll, 1 for Broadcast/Reduce/SendRecv).",
        "- Node-pair and link bytes are what the chosen algorithm moves over each link, "
        "not the coordinator's own socket traffic.",
    ]
    return "\n".join(lines) + "\n"


def _flatten(value, prefix: str = "", depth: int = 0):
    """(dotted key, scalar) pairs of nested metadata, for the summary table."""
    if isinstance(value, dict) and depth < 3:
        for key, item in value.items():
            yield from _flatten(item, f"{prefix}.{key}" if prefix else str(key), depth + 1)
    elif isinstance(value, (str, int, float, bool)) and prefix:
        yield prefix, value
    elif value is not None and prefix:
        yield prefix, str(value)[:80]


def _ranks_text(ranks: list[int]) -> str:
    if not ranks:
        return "-"
    if ranks == list(range(ranks[0], ranks[0] + len(ranks))) and len(ranks) > 2:
        return f"{ranks[0]}..{ranks[-1]}"
    text = ", ".join(map(str, ranks[:12]))
    return text + (", ..." if len(ranks) > 12 else "")


def _events_section(events) -> list[str]:
    """Failures and recovery (docs/faults.md); nothing when the run had none."""
    if not events or not (events["items"] or events["faults"]):
        return []
    lines = ["", "## Failures and recovery", ""]
    if events["faults"]:
        lines += ["Injected faults:", ""]
        lines += table(("Kind", "Spec", "Fired"),
                       ((f["kind"], f["spec"], f.get("fired", "-")) for f in events["faults"]))
        lines.append("")
    counts = ", ".join(f"{k}: {v}" for k, v in events["by_event"].items()) or "none"
    lines.append(f"Events: {counts} ({events['dropped']} not retained).")
    if events["items"]:
        lines += [""]
        lines += table(("Time", "Event", "Details"),
                       ((_dt.datetime.fromtimestamp(e["at"], _dt.timezone.utc).strftime("%H:%M:%S.%f")[:-3],
                         e["event"], _event_details(e)) for e in events["items"][:50]))
    return lines


def _event_details(e: dict) -> str:
    keys = ("kind", "spec", "comm", "name", "seq", "call_seq", "op", "rank", "result", "missing_ranks",
            "action", "reason", "excluded")
    text = ", ".join(f"{k}={e[k]}" for k in keys if e.get(k) not in (None, "", []))
    return text.replace("|", "/")[:200]
