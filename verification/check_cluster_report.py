"""Validate cluster reports against the repository-root cluster_report.schema.json and cross-check
their totals (the same check as `python3 -m fakegpu report check`).

    python3 verification/check_cluster_report.py [REPORT.json ...] [--expect-world-size N]
        [--expect-node-count N] [--expect-collective NAME ...]

Without a path it checks $FAKEGPU_CLUSTER_REPORT_PATH, else ./fakegpu-report.json.
"""
import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fakegpu.cli import report  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("reports", nargs="*", help="JSON cluster reports")
    p.add_argument("--expect-world-size", metavar="N")
    p.add_argument("--expect-node-count", metavar="N")
    p.add_argument("--expect-collective", action="append", default=[], metavar="NAME")
    args = p.parse_args(argv)
    paths = args.reports or [os.environ.get("FAKEGPU_CLUSTER_REPORT_PATH") or "fakegpu-report.json"]
    extra = []
    for flag, value in (("--expect-world-size", args.expect_world_size),
                        ("--expect-node-count", args.expect_node_count)):
        if value is not None:
            extra += [flag, value]
    for name in args.expect_collective:
        extra += ["--expect-collective", name]
    return max(report.main(["check", path, *extra]) for path in paths)


if __name__ == "__main__":
    sys.exit(main())
