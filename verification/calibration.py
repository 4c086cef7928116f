"""Model vs published nccl-tests results (verification/data/published_nccl_tests.csv).

`python verification/calibration.py` prints the table; tests/unit/test_calibration.py guards the
figures. Clusters named in the CSV are bundled configs, or built here when none fits.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "verification" / "data" / "published_nccl_tests.csv"
sys.path.insert(0, str(ROOT))
from fakegpu.cli.model import OPS as OPS_BY_NAME  # noqa: E402  (the CSV's op names)

def _cluster(name: str, nodes: int, gpus: int, profile: str, intra: str, nics: int, inter: str,
             node_extra: str = "") -> str:
    lines = ["version: 1", f"cluster: {{name: {name}}}", "nodes:"]
    for i in range(nodes):
        ranks = list(range(i * gpus, (i + 1) * gpus))
        lines.append(f"  - {{id: n{i}, host: h{i}, ranks: {ranks}, nics: {nics}, {node_extra}"
                     f"gpus: [{', '.join(['{profile: ' + profile + '}'] * gpus)}]}}")
    lines += ["fabric:", f"  intra_node: {intra}", f"  inter_node: {inter}"]
    return "\n".join(lines) + "\n"


NVLINK4 = "{type: nvlink, bandwidth_gbps: 3600, latency_us: 2.5}"
NVLINK3 = "{type: nvlink, bandwidth_gbps: 2400, latency_us: 3}"
# PCIe Gen4 x16 per direction; NCCL's own Simple per-step PCIe latency (5.7 us)
PCIE4 = "{type: pcie, bandwidth_gbps: 256, latency_us: 5.7}"
NDR = "{type: infiniband, bandwidth_gbps: 400, latency_us: 5}"
HDR = "{type: infiniband, bandwidth_gbps: 200, latency_us: 5}"
ROCE400 = "{type: roce, bandwidth_gbps: 400, latency_us: 5}"
NVLINK4_H800 = "{type: nvlink, bandwidth_gbps: 1600, latency_us: 2.5}"

# Clusters of the published results that no bundled config describes (GCP A3 Mega, the 8x RTX
# 5090 box and the bridged H100 PCIe pair are bundled: cluster_configs/).
_EXTRA = {
    # NVIDIA/nccl-tests issue 232: 2 nodes x 1 H100, four 400G NICs each
    "h100-2node-1gpu-4nic": _cluster("h100-2x1-4nic", 2, 1, "h100", NVLINK4, 4, NDR),
    # aigatech/vpbenchmarking: 4 nodes x 8 H100, 8x 400G NDR per node
    "h100-4node-8gpu-ib-8x400g": _cluster("h100-4x8-ndr", 4, 8, "h100", NVLINK4, 8, NDR),
    # NVIDIA/nccl issue 1048: 2 nodes x 8 A100, 4x 200G HDR per node
    "a100-2node-8gpu-ib-4x200g": _cluster("a100-2x8-hdr4", 2, 8, "a100-80gb", NVLINK3, 4, HDR),
    # NVIDIA/nccl issue 1530: 8x RTX 4090 on PCIe 4
    "rtx4090-1node-8gpu-pcie": _cluster("rtx4090-1x8", 1, 8, "rtx4090", PCIE4, 1, NDR),
    # tinygrad/open-gpu-kernel-modules README: a tinybox's 6x RTX 4090 on PCIe 4 with the P2P driver
    "rtx4090-1node-6gpu-pcie": _cluster("rtx4090-1x6", 1, 6, "rtx4090", PCIE4, 1, NDR),
    # NVIDIA/nccl issue 1218: 32 nodes x 8 H100, eight 400G RoCE NICs each
    "h100-32node-8gpu-roce-8x400g": _cluster("h100-32x8-roce", 32, 8, "h100", NVLINK4, 8, ROCE400),
    # NVIDIA/nccl-tests issue 283: 248 nodes x 8 H200, eight 400G HCAs each
    "h200-248node-8gpu-ib-8x400g": _cluster("h200-248x8-ndr", 248, 8, "h200", NVLINK4, 8, NDR),
    # Azure/AI-benchmarking-guide, ND H200 v5: one node of 8 H200 SXM
    "h200-1node-8gpu-nvlink": _cluster("h200-1x8", 1, 8, "h200", NVLINK4, 8, NDR),
    # NVIDIA/nccl issue 1374: one node of 8 H800
    "h800-1node-8gpu-nvlink": _cluster("h800-1x8", 1, 8, "h800", NVLINK4_H800, 1, NDR),
    # NVIDIA/nccl-tests issue 153: 2 nodes x 8 H800, eight 100G CX-6 each
    "h800-2node-8gpu-8x100g": _cluster("h800-2x8-100g", 2, 8, "h800", NVLINK4_H800, 8,
                                       "{type: roce, bandwidth_gbps: 100, latency_us: 5}"),
    # oracle-japan/ocitutorials run-nccltests-h100.md: 2x BM.GPU.H100.8, 16 RDMA ports per node on
    # RoCEv2 (3.2 Tb/s per node, written as eight 400G NICs)
    "h100-2node-8gpu-roce-8x400g": _cluster("h100-2x8-roce", 2, 8, "h100", NVLINK4, 8, ROCE400),
    # coreweave/nccl-tests README: 8 nodes of 8x H100, eight NDR HCAs each, SHARP (CollNet)
    "h100-8node-8gpu-ib-8x400g-sharp": _cluster("h100-8x8-ndr-sharp", 8, 8, "h100", NVLINK4, 8,
                                                "{type: infiniband, bandwidth_gbps: 400, latency_us: 5, collnet: true}"),
    # oracle-japan/ocitutorials run-nccltests.md: 2x BM.GPU4.8 (8x A100 40 GB), 16 RDMA ports per
    # node on RoCEv2 (1.6 Tb/s per node, written as eight 200G NICs)
    "a100-2node-8gpu-roce-8x200g": _cluster("a100-2x8-roce", 2, 8, "a100-80gb", NVLINK3, 8,
                                            "{type: roce, bandwidth_gbps: 200, latency_us: 5}"),
}


def cluster_yaml(name: str) -> str:
    """The YAML text of a cluster the CSV names."""
    return _EXTRA[name] if name in _EXTRA else (ROOT / "cluster_configs" / f"{name}.yaml").read_text()


def topology(name: str):
    from fakegpu.topology import parse_cluster_config

    return parse_cluster_config(cluster_yaml(name), name)


def ranks_of(rec: dict) -> int:
    """How many GPUs a row's run used: the first gpus_per_node GPUs of the first `nodes` nodes."""
    return int(rec["nodes"]) * int(rec["gpus_per_node"])


def operation(rec: dict) -> tuple[str, int, int]:
    """A row's (kind, float32 count per rank, peer) as nccl-tests ran it: size is the total for
    AllGather / ReduceScatter / AlltoAll, and sendrecv_perf with 2 GPUs sends 0 -> 1."""
    kind = OPS_BY_NAME[rec["op"]]
    per_rank = ranks_of(rec) if kind in ("AllGather", "ReduceScatter", "AlltoAll") else 1
    return kind, int(rec["size_bytes"]) // 4 // per_rank, 1 if kind == "SendRecv" else -1


def rows(estimate=None) -> list[dict]:
    from fakegpu import costmodel

    estimate = estimate or costmodel.estimate
    out = []
    with open(DATA, newline="") as fh:
        for rec in csv.DictReader(fh):
            topo = topology(rec["cluster"])
            # the first gpus_per_node GPUs of the first `nodes` nodes
            ranks = [r for node in topo.nodes[:int(rec["nodes"])] for r in node.ranks[:int(rec["gpus_per_node"])]]
            kind, count, peer = operation(rec)
            size = int(rec["size_bytes"])
            # the row's NCCL environment ("NCCL_ALGO=Ring NCCL_NVLS_ENABLE=0"), read as NCCL would
            env = dict(item.split("=", 1) for item in rec["env"].split() if "=" in item)
            algos, protos = costmodel.tuning_from_env(kind, env)
            e = estimate(kind, count, 4, ranks, 0, peer, topo, algos or [a for a in costmodel.ALGORITHMS if a not in costmodel.NOT_NCCL],
                         protos or costmodel.PROTOCOLS) if env else estimate(kind, count, 4, ranks, 0, peer, topo)
            busbw = costmodel.busbw_gbs(kind, size, e.seconds, len(ranks))
            published = (float(rec["busbw_gbs"]) if rec["busbw_gbs"] else
                         costmodel.busbw_gbs(kind, size, float(rec["time_us"]) * 1e-6, len(ranks)))
            out.append({**rec, "model_busbw": busbw, "algorithm": e.algorithm,
                        "protocol": getattr(e, "protocol", "simple"), "published_busbw": published,
                        "error": busbw / published - 1})
    return out


def summary(table: list[dict], split: str = "") -> tuple[float, float]:
    """(fraction of points within 20 %, median |error|), of the rows of ``split`` ("fit" or
    "heldout"; all rows when empty)."""
    errors = [abs(r["error"]) for r in table if not split or r.get("split", "fit") == split]
    return sum(e <= 0.20 for e in errors) / len(errors), statistics.median(errors)


# Run in another checkout's interpreter path: its own topology loader and cost model time each
# row; a row whose cluster it cannot read or whose operation it cannot time gets null.
_OTHER_CHECKOUT = r"""
import json, sys
from fakegpu import costmodel
from fakegpu.topology import parse_cluster_config
out = []
for job in json.load(sys.stdin):
    try:
        topo = parse_cluster_config(job["yaml"], job["cluster"])
        ranks = [r for node in topo.nodes[:job["nodes"]] for r in node.ranks[:job["gpus"]]]
        out.append(costmodel.estimate_seconds(job["kind"], job["count"], 4, ranks, 0, job["peer"], topo))
    except Exception:
        out.append(None)
json.dump(out, sys.stdout)
"""


def other_checkout_seconds(checkout: Path, table: list[dict]) -> list:
    """Each row's modeled seconds from the cost model of another checkout (``None`` where that
    model cannot read the cluster or time the operation). It runs as that checkout's code, in a
    process of its own, on this tree's clusters and rows, without the rows' NCCL environment."""
    jobs = []
    for rec in table:
        kind, count, peer = operation(rec)
        jobs.append({"yaml": cluster_yaml(rec["cluster"]), "cluster": rec["cluster"], "kind": kind,
                     "nodes": int(rec["nodes"]), "gpus": int(rec["gpus_per_node"]),
                     "count": count, "peer": peer})
    env = {k: v for k, v in os.environ.items() if not k.startswith("NCCL_")}
    env["PYTHONPATH"] = str(checkout)
    done = subprocess.run([sys.executable, "-c", _OTHER_CHECKOUT], input=json.dumps(jobs), text=True,
                          capture_output=True, cwd=checkout, env=env, timeout=600)
    if done.returncode != 0:
        raise SystemExit(f"the cost model of {checkout} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout)


def compare_with(checkout: Path, table: list[dict]) -> None:
    """Print the fraction within 15 / 20 % and the median |error| of another checkout's model and
    of this one, on the rows both can time."""
    from fakegpu import costmodel

    seconds = other_checkout_seconds(checkout, table)
    before, now = [], []
    for rec, s in zip(table, seconds):
        if s is None or s <= 0:
            continue
        busbw = costmodel.busbw_gbs(OPS_BY_NAME[rec["op"]], int(rec["size_bytes"]), s, ranks_of(rec))
        before.append((rec.get("split", "fit"), abs(busbw / rec["published_busbw"] - 1)))
        now.append((rec.get("split", "fit"), abs(rec["error"])))
    print(f"\n{checkout}'s model could time {len(before)} of {len(table)} rows; on those rows:")
    print("| model | rows | within 15 % | within 20 % | within 30 % | median abs. error |")
    print("|---|---|---|---|---|---|")
    for split in ("", "fit", "heldout"):
        for name, errors in (("before", before), ("now", now)):
            part = [e for sp, e in errors if not split or sp == split]
            if part:
                share = lambda limit: f"{sum(e <= limit for e in part) / len(part):.0%}"
                print(f"| {name}{' (' + split + ')' if split else ''} | {len(part)} | {share(0.15)} | "
                      f"{share(0.20)} | {share(0.30)} | {statistics.median(part):.1%} |")


def print_by_hardware(table: list[dict]) -> None:
    """One line per published setup and operation: rows, sizes, median |error|, within 20 %,
    the worst row."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in table:
        groups.setdefault((r["hardware"], r["op"]), []).append(r)
    print("| Hardware | Op | Rows | Sizes | Median abs. error | Within 20 % | Worst | Split |")
    print("|---|---|---|---|---|---|---|---|")
    for (hardware, op), part in groups.items():
        errors = [abs(r["error"]) for r in part]
        worst = max(part, key=lambda r: abs(r["error"]))
        sizes = sorted(int(r["size_bytes"]) for r in part)
        span = _size_text(sizes[0]) + (f" - {_size_text(sizes[-1])}" if len(sizes) > 1 else "")
        splits = "/".join(sorted({r.get("split", "fit") for r in part}))
        print(f"| {hardware} | {op} | {len(part)} | {span} | {statistics.median(errors):.1%} | "
              f"{sum(e <= 0.20 for e in errors)}/{len(part)} | {worst['error']:+.0%} at "
              f"{_size_text(int(worst['size_bytes']))} | {splits} |")


def _size_text(nbytes: int) -> str:
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale}{unit}"
    return f"{nbytes}B"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--by-hardware", action="store_true",
                        help="print one line per published setup (rows, median |error|, within 20 %%) "
                             "instead of one per row")
    parser.add_argument("--before", type=Path, metavar="CHECKOUT",
                        help="also score the cost model of another checkout of fakegpu (e.g. a "
                             "`git worktree add` of an older commit) on the same rows")
    args = parser.parse_args(argv)
    table = rows()
    if args.by_hardware:
        print_by_hardware(table)
    else:
        print("| Hardware | Op | Size | Published busbw | Model busbw | Model algo/proto | Error | Split |")
        print("|---|---|---|---|---|---|---|---|")
        for r in table:
            print(f"| {r['hardware']} | {r['op']} | {int(r['size_bytes'])} | {r['published_busbw']:.3g} | "
                  f"{r['model_busbw']:.3g} | {r['algorithm']}/{r['protocol']} | {r['error']:+.0%} | "
                  f"{r.get('split', 'fit')} |")
    within, median = summary(table)
    print(f"\n{len(table)} points: {within:.0%} within 20 %, median |error| {median:.1%}")
    for split in ("fit", "heldout"):
        part = [r for r in table if r.get("split", "fit") == split]
        within, median = summary(part)
        print(f"  {split}: {len(part)} points, {within:.0%} within 20 %, median |error| {median:.1%}")
    if args.before is not None:
        compare_with(args.before.resolve(), table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
