"""Validate a cluster report: the JSON schema, then that its tables agree with each other."""
from __future__ import annotations

import json
import math
import os
from collections import Counter, defaultdict
from typing import Iterable, Optional, Union

from jsonschema import Draft202012Validator

from .schema import REPORT_SCHEMA


class ReportLoadError(ValueError):
    pass


def load_report(path: Union[str, os.PathLike]) -> dict:
    try:
        with open(path, encoding="utf-8") as fh:
            return json.load(fh)
    except OSError as exc:
        raise ReportLoadError(f"{os.fspath(path)}: cannot read: {exc.strerror or exc}") from None
    except json.JSONDecodeError as exc:
        raise ReportLoadError(f"{os.fspath(path)}: not valid JSON: {exc.msg} at line {exc.lineno}") from None


def schema_problems(report: object) -> list[str]:
    validator = Draft202012Validator(REPORT_SCHEMA)
    problems = []
    for error in sorted(validator.iter_errors(report), key=lambda e: list(map(str, e.absolute_path))):
        where = "/".join(str(p) for p in error.absolute_path) or "<root>"
        problems.append(f"schema: {where}: {error.message}")
    return problems


def _close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)


def consistency_problems(report: dict) -> list[str]:
    """Cross-checks between sections; assumes the report already passed the schema."""
    out: list[str] = []

    def expect(cond: bool, message: str) -> None:
        if not cond:
            out.append("consistency: " + message)

    topo = report["topology"]
    expect(topo["world_size"] == report["world_size"],
           f"world_size {report['world_size']} != topology.world_size {topo['world_size']}")
    expect(topo["node_count"] == len(topo["nodes"]),
           f"topology.node_count {topo['node_count']} != {len(topo['nodes'])} nodes listed")
    placed = sorted(r for n in topo["nodes"] for r in n["ranks"])
    expect(placed == list(range(len(placed))), "topology ranks are not unique and contiguous from 0")

    kinds, p2p, totals = report["collectives"], report["point_to_point"], report["totals"]
    expect(totals["operations"] == sum(k["calls"] for k in kinds.values()) + p2p["operations"],
           "totals.operations != collective calls + point-to-point operations")
    expect(totals["failed_operations"] == sum(k["errors"] for k in kinds.values()) + p2p["errors"],
           "totals.failed_operations != collective + point-to-point errors")
    expect(totals["logical_bytes"] == sum(k["logical_bytes"] for k in kinds.values()) + p2p["bytes"],
           "totals.logical_bytes != collective + point-to-point bytes")
    expect(totals["socket_bytes"] == sum(k["socket_bytes"] for k in kinds.values()) + p2p["socket_bytes"],
           "totals.socket_bytes != collective + point-to-point socket bytes")
    expect(_close(totals["modeled_time_s"], sum(k["modeled_time_s"] for k in kinds.values()) + p2p["modeled_time_s"]),
           "totals.modeled_time_s != collective + point-to-point modeled time")
    expect(p2p["intra_node_operations"] + p2p["inter_node_operations"] == p2p["operations"],
           "point_to_point intra + inter operations != operations")

    # Links against node pairs and nodes.
    inter, intra = report["links"]["inter_node"], report["links"]["intra_node"]
    pair_bytes = 0
    pair_transfers = 0
    for p in report["node_pairs"]:
        name = " <-> ".join(p["nodes"])
        dirs = sum(p["directions"].values())
        expect(dirs == p["total_bytes"], f"node pair {name}: directions sum {dirs} != total_bytes {p['total_bytes']}")
        by_op = p["by_operation"].values()
        expect(sum(v["bytes"] for v in by_op) == p["total_bytes"],
               f"node pair {name}: by_operation bytes != total_bytes")
        expect(sum(v["transfers"] for v in by_op) == p["transfers"],
               f"node pair {name}: by_operation transfers != transfers")
        expect(sum(v["operations"] for v in by_op) == p["operations"],
               f"node pair {name}: by_operation operations != operations")
        expect(p["peak_operation_bytes"] <= p["total_bytes"], f"node pair {name}: peak above total")
        pair_bytes += dirs
        pair_transfers += p["transfers"]
    expect(inter["bytes"] == pair_bytes,
           f"links.inter_node.bytes {inter['bytes']} != node-pair directions total {pair_bytes}")
    expect(inter["transfers"] == pair_transfers,
           f"links.inter_node.transfers {inter['transfers']} != node-pair transfers {pair_transfers}")
    node_bytes = sum(n["bytes"] for n in intra["per_node"])
    expect(intra["bytes"] == node_bytes,
           f"links.intra_node.bytes {intra['bytes']} != per-node total {node_bytes}")
    expect(intra["transfers"] == sum(n["transfers"] for n in intra["per_node"]),
           "links.intra_node.transfers != per-node transfers")
    sent = sum(r["bytes_sent"] for r in report["ranks"])
    received = sum(r["bytes_received"] for r in report["ranks"])
    moved = intra["bytes"] + inter["bytes"]
    expect(sent == moved, f"ranks' bytes_sent {sent} != link bytes {moved}")
    expect(received == moved, f"ranks' bytes_received {received} != link bytes {moved}")
    expect(sum(c["operations"] for c in report["communicators"]) == totals["operations"],
           "communicators' operations != totals.operations")

    # Timeline against the summaries, when it holds every operation.
    tl = report["timeline"]
    ops = tl["operations"]
    expect(tl["retained"] == len(ops), f"timeline.retained {tl['retained']} != {len(ops)} operations listed")
    expect(tl["retained"] <= tl["max_operations"], "timeline holds more operations than max_operations")
    recorded = sum(totals["by_status"].values())
    expect(tl["retained"] + tl["dropped_operations"] == recorded,
           f"timeline retained + dropped ({tl['retained']} + {tl['dropped_operations']}) != operations recorded {recorded}")
    if tl["dropped_operations"] == 0:
        out.extend(_timeline_problems(report, ops))

    # Failure and recovery events (docs/faults.md), when the report has the section.
    events = report.get("events")
    if events is not None:
        items = events["items"]
        expect(events["retained"] == len(items), f"events.retained {events['retained']} != {len(items)} items listed")
        expect(sum(events["by_event"].values()) == events["retained"] + events["dropped"],
               f"events.by_event {events['by_event']} does not add up to retained + dropped "
               f"({events['retained']} + {events['dropped']})")
        # Every failed call is one op_failed event and one failed operation (docs/reports.md);
        # an unattributed record may be a failure the totals could not count.
        op_failed = events["by_event"].get("op_failed", 0)
        if totals["unattributed_operations"] == 0:
            expect(op_failed == totals["failed_operations"],
                   f"totals.failed_operations {totals['failed_operations']} != {op_failed} op_failed events "
                   "(each failed call is one of each)")
        fired = sum(f.get("fired", 0) for f in events["faults"])
        injected = events["by_event"].get("fault_injected", 0)
        expect(injected == fired, f"{injected} fault_injected events but the faults fired {fired} times")
    return out


def _timeline_problems(report: dict, ops: list[dict]) -> list[str]:
    out = []
    ok = [o for o in ops if o["status"] == "ok"]
    calls = Counter(o["kind"] for o in ok)
    nbytes: dict[str, int] = defaultdict(int)
    modeled: dict[str, float] = defaultdict(float)
    errors = Counter(o["kind"] for o in ops if o["status"] != "ok")
    for o in ok:
        nbytes[o["kind"]] += o["logical_bytes"]
        modeled[o["kind"]] += o["modeled_s"]
    for kind, stats in report["collectives"].items():
        if stats["calls"] != calls.get(kind, 0):
            out.append(f"consistency: collectives.{kind}.calls {stats['calls']} != {calls.get(kind, 0)} in the timeline")
        if stats["logical_bytes"] != nbytes.get(kind, 0):
            out.append(f"consistency: collectives.{kind}.logical_bytes {stats['logical_bytes']} != "
                       f"{nbytes.get(kind, 0)} in the timeline")
        if not _close(stats["modeled_time_s"], modeled.get(kind, 0.0)):
            out.append(f"consistency: collectives.{kind}.modeled_time_s != timeline sum")
        if stats["errors"] != errors.get(kind, 0):
            out.append(f"consistency: collectives.{kind}.errors {stats['errors']} != {errors.get(kind, 0)} in the timeline")
    for kind in calls:
        if kind != "SendRecv" and kind not in report["collectives"]:
            out.append(f"consistency: timeline has {kind} operations missing from collectives")
    p2p = report["point_to_point"]
    if p2p["operations"] != calls.get("SendRecv", 0):
        out.append(f"consistency: point_to_point.operations {p2p['operations']} != {calls.get('SendRecv', 0)} in the timeline")
    if p2p["bytes"] != nbytes.get("SendRecv", 0):
        out.append("consistency: point_to_point.bytes != timeline SendRecv bytes")
    links = report["links"]
    for scope, key in (("intra_node", "intra_node_bytes"), ("inter_node", "inter_node_bytes")):
        total = sum(o[key] for o in ok)
        if links[scope]["bytes"] != total:
            out.append(f"consistency: links.{scope}.bytes {links[scope]['bytes']} != timeline {key} total {total}")
    statuses = Counter(o["status"] for o in ops)
    if dict(statuses) != report["totals"]["by_status"]:
        out.append(f"consistency: totals.by_status {report['totals']['by_status']} != timeline statuses {dict(statuses)}")
    per_rank = Counter()
    for o in ok:
        if o["kind"] != "SendRecv":
            per_rank.update(o["global_ranks"])
    for r in report["ranks"]:
        if r["collective_calls"] != per_rank.get(r["rank"], 0):
            out.append(f"consistency: rank {r['rank']} collective_calls {r['collective_calls']} != "
                       f"{per_rank.get(r['rank'], 0)} in the timeline")
    return out


def expectation_problems(report: dict, world_size: Optional[int] = None, node_count: Optional[int] = None,
                         collectives: Iterable[str] = ()) -> list[str]:
    from fakegpu.costmodel import normalize_kind

    out = []
    if world_size is not None and report.get("world_size") != world_size:
        out.append(f"expected world size {world_size}, report has {report.get('world_size')}")
    nodes = report.get("topology", {}).get("node_count")
    if node_count is not None and nodes != node_count:
        out.append(f"expected {node_count} nodes, report has {nodes}")
    for name in collectives:
        try:
            kind = normalize_kind(name)
        except ValueError as exc:
            out.append(str(exc))
            continue
        if kind == "SendRecv":
            count = report.get("point_to_point", {}).get("operations", 0)
        else:
            count = report.get("collectives", {}).get(kind, {}).get("calls", 0)
        if not count:
            out.append(f"expected at least one successful {kind}, report has none")
    return out


def check_report(report: object, *, world_size: Optional[int] = None, node_count: Optional[int] = None,
                 collectives: Iterable[str] = ()) -> list[str]:
    """Every problem found (empty list: the report is valid and consistent)."""
    problems = schema_problems(report)
    if problems:
        return problems  # the cross-checks assume the structure is right
    assert isinstance(report, dict)
    problems = consistency_problems(report)
    problems += expectation_problems(report, world_size, node_count, collectives)
    return problems
