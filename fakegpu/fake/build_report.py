"""``python -m fakegpu.fake.build_report EVENTS.jsonl [...] --report R.json``

Turns fake-world event files (fakegpu.fake.events) into a whole-world cluster report.
Several files (one per physical process) are merged; each starts with its ``world`` line.
"""
from __future__ import annotations

import argparse
import sys
from typing import Optional

from .events import EventFormatError, read_events, replay
from .world import WorldAccountant


def build(paths: list[str], *, cluster_config: Optional[str] = None, world_size: Optional[int] = None,
          max_operations: int = 4096) -> WorldAccountant:
    from .runtime import load_topology

    streams = [(p, read_events(p)) for p in paths]
    worlds = [e for _, events in streams for e in events if e.get("event") == "world"]
    if world_size is None:
        sizes = {int(w["logical_world_size"]) for w in worlds if "logical_world_size" in w}
        if len(sizes) != 1:
            raise EventFormatError(f"the event files name logical world sizes {sorted(sizes) or 'none'}: "
                                   f"pass --world-size")
        world_size = sizes.pop()
    acc = WorldAccountant(load_topology(world_size, cluster_config), world_size,
                          metadata={"mode": "fake"}, max_operations=max_operations)
    memory: list[dict] = []
    for path, events in streams:
        memory.extend(replay(events, acc, source=path)["memory"])
    meta = {"logical_world_size": world_size, "event_files": paths,
            "physical_logical_ranks": sorted({int(w["logical_rank"]) for w in worlds if "logical_rank" in w})}
    if worlds:
        meta["mode"] = worlds[0].get("mode", "fake")
        meta["pp_degree"] = worlds[0].get("pp_degree")
    acc.finish_metadata(meta)
    acc.report.metadata["logical_world_size"] = world_size
    acc.report.metadata["physical_logical_ranks"] = meta["physical_logical_ranks"]
    if memory:
        from .memory import summarize_for_report
        acc.report.metadata["memory_captures"] = summarize_for_report(memory)
    acc.report.extra_notes.append(
        f"fake world rebuilt from {len(paths)} event file(s): each communicator's traffic is replicated "
        f"over the groups of the same shape (SPMD assumption) to estimate the whole logical world")
    return acc


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fakegpu.fake.build_report",
                                     description="Build a whole-world cluster report from fake-world events.")
    parser.add_argument("events", nargs="+", help="event files (JSON lines), one per physical process")
    parser.add_argument("--report", required=True, help="JSON report to write (Markdown beside it)")
    parser.add_argument("--markdown", help="Markdown path (default: the report path with .md)")
    parser.add_argument("--trace", help="also write a Chrome trace here")
    parser.add_argument("--cluster-config", help="cluster YAML (default: FAKEGPU_CLUSTER_CONFIG, else one "
                                                 "default node holding the whole world)")
    parser.add_argument("--world-size", type=int, help="logical world size (default: from the events)")
    args = parser.parse_args(argv)
    try:
        acc = build(args.events, cluster_config=args.cluster_config, world_size=args.world_size)
        written = acc.report.write(args.report, args.markdown, args.trace)
    except (OSError, ValueError) as exc:
        print(f"fakegpu build_report: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {written['json']} ({acc.records} replica records from {acc.ops} operations)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
