"""Model vs published nccl-tests results (verification/data/published_nccl_tests.csv).

`python verification/calibration.py` prints the table; tests/test_calibration.py guards the
figures. Clusters named in the CSV are bundled configs, or built here when none fits.
"""
from __future__ import annotations

import csv
import statistics
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "verification" / "data" / "published_nccl_tests.csv"

# 2 nodes x 1 H100, four 400G NICs each (NVIDIA/nccl-tests issue 232)
_EXTRA = {"h100-2node-1gpu-4nic": """
version: 1
cluster: {name: h100-2x1-4nic}
nodes:
  - {id: n0, host: a, ranks: [0], nics: 4, gpus: [{profile: h100}]}
  - {id: n1, host: b, ranks: [1], nics: 4, gpus: [{profile: h100}]}
fabric:
  intra_node: {type: nvlink, bandwidth_gbps: 3600, latency_us: 2.5}
  inter_node: {type: infiniband, bandwidth_gbps: 400, latency_us: 5}
"""}


def topology(name: str):
    from fakegpu.topology import load_cluster_config, parse_cluster_config

    if name in _EXTRA:
        return parse_cluster_config(_EXTRA[name], name)
    return load_cluster_config(ROOT / "cluster_configs" / f"{name}.yaml")


def rows(estimate=None) -> list[dict]:
    from fakegpu import costmodel
    from fakegpu.cli.model import OPS

    estimate = estimate or costmodel.estimate
    out = []
    with open(DATA, newline="") as fh:
        for rec in csv.DictReader(fh):
            topo = topology(rec["cluster"])
            ranks = [r for node in topo.nodes for r in node.ranks]
            kind = OPS[rec["op"]]
            size = int(rec["size_bytes"])
            algos = None
            if rec["env"].startswith("NCCL_ALGO="):
                algos = [a.lower() for a in rec["env"].split("=", 1)[1].split(",")]
            e = estimate(kind, size // 4, 4, ranks, 0, -1, topo, algos) if algos else \
                estimate(kind, size // 4, 4, ranks, 0, -1, topo)
            busbw = costmodel.busbw_gbs(kind, size, e.seconds, len(ranks))
            published = float(rec["busbw_gbs"])
            out.append({**rec, "model_busbw": busbw, "algorithm": e.algorithm,
                        "protocol": getattr(e, "protocol", "simple"), "error": busbw / published - 1})
    return out


def summary(table: list[dict]) -> tuple[float, float]:
    """(fraction of points within 20 %, median |error|)."""
    errors = [abs(r["error"]) for r in table]
    return sum(e <= 0.20 for e in errors) / len(errors), statistics.median(errors)


def main() -> int:
    table = rows()
    print("| Hardware | Size | Published busbw | Model busbw | Model algo/proto | Error |")
    print("|---|---|---|---|---|---|")
    for r in table:
        print(f"| {r['hardware']} | {int(r['size_bytes'])} | {float(r['busbw_gbs']):.1f} | {r['model_busbw']:.1f} | "
              f"{r['algorithm']}/{r['protocol']} | {r['error']:+.0%} |")
    within, median = summary(table)
    print(f"\n{len(table)} points: {within:.0%} within 20 %, median |error| {median:.1%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
