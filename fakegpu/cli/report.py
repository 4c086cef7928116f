"""`python -m fakegpu report check|show PATH`: validate or summarise a cluster report."""
from __future__ import annotations

import argparse
import sys
from typing import Optional

from fakegpu.report.check import ReportLoadError, check_report, load_report
from fakegpu.report.groups import parallelism_groups
from fakegpu.report.markdown import fmt_bytes, fmt_gbs, fmt_seconds


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m fakegpu report",
                                     description="Check or show a fakegpu cluster report (JSON).")
    sub = parser.add_subparsers(dest="command", required=True)
    check = sub.add_parser("check", help="validate against cluster_report.schema.json and cross-check the totals")
    check.add_argument("path")
    check.add_argument("--expect-world-size", type=int, metavar="N")
    check.add_argument("--expect-node-count", type=int, metavar="N")
    check.add_argument("--expect-collective", action="append", default=[], metavar="NAME",
                       help="require at least one successful operation of this kind (repeatable)")
    check.add_argument("-q", "--quiet", action="store_true", help="print nothing when the report is valid")
    show = sub.add_parser("show", help="print the report's summary")
    show.add_argument("path")
    return parser


def _check(args: argparse.Namespace) -> int:
    report = load_report(args.path)
    problems = check_report(report, world_size=args.expect_world_size, node_count=args.expect_node_count,
                            collectives=args.expect_collective)
    if problems:
        print(f"{args.path}: INVALID ({len(problems)} problem(s))", file=sys.stderr)
        for problem in problems[:50]:
            print(f"  - {problem}", file=sys.stderr)
        if len(problems) > 50:
            print(f"  ... and {len(problems) - 50} more", file=sys.stderr)
        return 1
    if not args.quiet:
        print(f"{args.path}: OK (schema {report['schema_version']}, world size {report['world_size']}, "
              f"{report['topology']['node_count']} node(s), {report['totals']['operations']} operation(s))")
    return 0


def _show(args: argparse.Namespace) -> int:
    report = load_report(args.path)
    problems = check_report(report)
    if problems and any(p.startswith("schema:") for p in problems):
        print(f"{args.path}: not a valid cluster report; run `report check` for details", file=sys.stderr)
        return 1
    print(summary_text(report))
    if problems:
        print(f"\nwarning: {len(problems)} consistency problem(s); run `report check` for details")
    return 0


def summary_text(report: dict) -> str:
    topo = report["topology"]
    totals = report["totals"]
    lines = [
        f"cluster {topo['name']}: world size {report['world_size']}, {topo['node_count']} node(s)"
        + (" [default topology: no cluster config given]" if topo["is_default"] else ""),
        f"operations {totals['operations']} ok, {totals['failed_operations']} failed; payload "
        f"{fmt_bytes(totals['logical_bytes'])}; modeled {fmt_seconds(totals['modeled_time_s'])} "
        f"(makespan {fmt_seconds(totals['modeled_makespan_s'])})",
        "",
        f"{'operation':<14}{'calls':>8}{'payload':>14}{'modeled':>12}{'algbw':>9}{'busbw':>9}  algorithms"
        + "\n" + f"{'':<14}{'':>8}{'':>14}{'':>12}{'(GB/s)':>9}{'(GB/s)':>9}",
    ]
    for kind, s in report["collectives"].items():
        algos = ", ".join(f"{a} x{c}" for a, c in s["algorithms"].items())
        lines.append(f"{kind:<14}{s['calls']:>8}{fmt_bytes(s['logical_bytes']):>14}"
                     f"{fmt_seconds(s['modeled_time_s']):>12}{fmt_gbs(s['algbw_gbs']):>9}{fmt_gbs(s['busbw_gbs']):>9}  {algos}")
    p2p = report["point_to_point"]
    if p2p["operations"] or p2p["errors"]:
        lines.append(f"{'SendRecv':<14}{p2p['operations']:>8}{fmt_bytes(p2p['bytes']):>14}"
                     f"{fmt_seconds(p2p['modeled_time_s']):>12}{fmt_gbs(p2p['modeled_avg_throughput_gbs']):>9}{'':>9}"
                     f"  {p2p['intra_node_operations']} intra-node, {p2p['inter_node_operations']} inter-node")
    links = report["links"]
    lines += ["", f"intra-node: {fmt_bytes(links['intra_node']['bytes'])} in {links['intra_node']['transfers']} transfers"
                  f"; inter-node: {fmt_bytes(links['inter_node']['bytes'])} in {links['inter_node']['transfers']} transfers"]
    for p in report["node_pairs"]:
        dirs = ", ".join(f"{d} {fmt_bytes(b)}" for d, b in p["directions"].items())
        lines.append(f"  {' <-> '.join(p['nodes'])}: {dirs}; peak/op {fmt_bytes(p['peak_operation_bytes'])}; "
                     f"modeled avg {fmt_gbs(p['modeled_avg_throughput_gbs'])} GB/s")
    lines += ["", f"{'rank':>4} {'node':<12}{'coll':>6}{'send':>6}{'recv':>6}{'wait':>11}{'timeouts':>9}{'busy':>11}"]
    for r in report["ranks"]:
        lines.append(f"{r['rank']:>4} {str(r['node']):<12}{r['collective_calls']:>6}{r['p2p_sends']:>6}{r['p2p_recvs']:>6}"
                     f"{fmt_seconds(r['wait_s']):>11}{r['timeouts']:>9}{fmt_seconds(r['modeled_busy_s']):>11}")
    lines += [""] + groups_text(report)
    tl = report["timeline"]
    lines += ["", f"timeline: {tl['retained']} retained, {tl['dropped_operations']} dropped "
                  f"(limit {tl['max_operations']}); {len(report['communicators'])} communicator(s)"]
    prefix = "cluster config warning: "
    warnings = [n[len(prefix):] for n in report["notes"] if n.startswith(prefix)]
    if warnings:
        lines.append("")
        lines += [f"warning: {w}" for w in warnings]
    return "\n".join(lines)


INSTANCES_SHOWN = 8


def groups_text(report: dict) -> list[str]:
    """Per parallelism group (communicators by name, fakegpu/report/groups.py): the sum over
    its instances, then each instance (the first INSTANCES_SHOWN)."""
    groups = parallelism_groups(report)
    if not groups:
        return ["no communicators"]
    lines = [f"{'group / instance':<28}{'ranks':>14}{'ops':>8}{'payload':>14}{'modeled':>12}"]
    for g in groups:
        sizes = ",".join(sorted({str(i["size"]) for i in g["instances"]}))
        shape = f"{len(g['instances'])}x{sizes}"
        lines.append(f"{g['name'][:27]:<28}{shape:>14}{g['operations']:>8}"
                     f"{fmt_bytes(g['logical_bytes']):>14}{fmt_seconds(g['modeled_time_s']):>12}")
        for inst in g["instances"][:INSTANCES_SHOWN]:
            label = f"  #{inst['id']} {inst['name'] or ''}".rstrip()
            lines.append(f"{label[:27]:<28}{_members(inst['members']):>14}{inst['operations']:>8}"
                         f"{fmt_bytes(inst['logical_bytes']):>14}{fmt_seconds(inst['modeled_time_s']):>12}")
        if len(g["instances"]) > INSTANCES_SHOWN:
            lines.append(f"  ... {len(g['instances']) - INSTANCES_SHOWN} more instances in the JSON report")
    return lines


def _members(ranks: list[int]) -> str:
    if len(ranks) > 2 and ranks == list(range(ranks[0], ranks[0] + len(ranks))):
        return f"{ranks[0]}..{ranks[-1]}"
    text = ",".join(map(str, ranks[:4]))
    return text + (",..." if len(ranks) > 4 else "")


def main(argv: Optional[list[str]] = None) -> int:
    args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        return _check(args) if args.command == "check" else _show(args)
    except ReportLoadError as exc:
        print(f"fakegpu report: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
