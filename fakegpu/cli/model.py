"""`fgpu model CLUSTER.yaml --op allreduce -b 8 -e 8G -f 2` (also `python -m fakegpu model`).

Prints what the cost model (fakegpu/costmodel.py, docs/cost-model.md) predicts nccl-tests would
print on the cluster a YAML describes: one line per size with time, algbw, busbw and the
algorithm and protocol NCCL's tuner would pick. Nothing runs; it is the model only.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Optional, Sequence

from fakegpu import costmodel

EPILOG = """\
examples:
  fgpu model cluster_configs/h100-2node-8gpu-ib-8x400g.yaml -b 8 -e 8G -f 2
  fgpu model cluster_configs/h100-2node-8gpu-ib-8x400g.yaml --nodes 1 --op allgather --candidates
  fgpu model cluster_configs/a100-1node-8gpu-nvlink.yaml --algo ring --proto simple --json
  fgpu model --world-size 4 --op alltoall          (no YAML: one node of default H100s)

NCCL_ALGO and NCCL_PROTO in the environment restrict the choice as they do in NCCL;
--algo and --proto take precedence over them."""

# nccl-tests' op names (all_reduce_perf -> allreduce) and NCCL's own spellings.
OPS = {
    "allreduce": "AllReduce", "allgather": "AllGather", "reducescatter": "ReduceScatter",
    "broadcast": "Broadcast", "reduce": "Reduce", "alltoall": "AlltoAll", "gather": "Gather",
    "scatter": "Scatter", "sendrecv": "SendRecv",
}
DTYPE_SIZES = {
    "int8": 1, "uint8": 1, "char": 1, "float8": 1, "fp8": 1,
    "half": 2, "float16": 2, "bfloat16": 2, "bf16": 2,
    "float": 4, "float32": 4, "int32": 4, "uint32": 4, "int": 4,
    "double": 8, "float64": 8, "int64": 8, "uint64": 8,
}


class ModelArgumentError(ValueError):
    """A command-line argument the model cannot use; the message names it."""


def build_parser(prog: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog, description="Print the cost model's nccl-tests table of one operation on a cluster.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    parser.add_argument("config", nargs="?", metavar="CLUSTER.yaml",
                        help="cluster YAML (default: one node of --world-size default GPUs)")
    parser.add_argument("--op", "--kind", dest="op", default="allreduce",
                        help=f"operation: {', '.join(OPS)} (default allreduce)")
    parser.add_argument("-b", "--minbytes", default="8", help="smallest size (default 8)")
    parser.add_argument("-e", "--maxbytes", default="8G", help="largest size (default 8G)")
    parser.add_argument("-f", "--stepfactor", default="2", help="multiply the size by this each line (default 2)")
    parser.add_argument("-d", "--dtype", default="float32", help="datatype (default float32)")
    who = parser.add_mutually_exclusive_group()
    who.add_argument("--ranks", metavar="N", help="use the first N ranks of the cluster (node by node)")
    who.add_argument("--nodes", metavar="K", help="use every rank of the first K nodes")
    parser.add_argument("--world-size", type=int, default=8, help="ranks of the default topology (no YAML)")
    parser.add_argument("--algo", help="force algorithm(s), comma separated: "
                        + ", ".join(costmodel.ALGORITHMS) + " (default: NCCL_ALGO, else the fastest)")
    parser.add_argument("--proto", help="force protocol(s), comma separated: "
                        + ", ".join(costmodel.PROTOCOLS) + " (default: NCCL_PROTO, else the fastest)")
    parser.add_argument("--candidates", action="store_true", help="show every candidate's modeled time")
    parser.add_argument("--json", action="store_true", help="print JSON instead of the table")
    return parser


def _positive_int(text: str, what: str) -> int:
    try:
        value = int(str(text), 0)
    except ValueError:
        raise ModelArgumentError(f"{what} {text!r} is not an integer") from None
    if value < 1:
        raise ModelArgumentError(f"{what} must be at least 1, got {value}")
    return value


def _size(text: str, what: str) -> int:
    from fakegpu.env import ConfigError, parse_size

    try:
        value = parse_size(text, what)
    except ConfigError as exc:
        raise ModelArgumentError(str(exc)) from None
    if value < 1:
        raise ModelArgumentError(f"{what} must be at least 1 byte, got {text!r}")
    return value


def _names(text: Optional[str], check, option: str, what: str) -> Optional[list]:
    """A comma-separated --algo / --proto value, each name checked by the cost model; None when
    the option was not given."""
    if text is None:
        return None
    try:
        names = [check(name) for name in text.split(",") if name.strip()]
    except ValueError as exc:
        raise ModelArgumentError(f"{option}: {exc}") from None
    if not names:
        raise ModelArgumentError(f"{option} needs at least one {what} name")
    return names


def _members(topo, ranks: Optional[str], nodes: Optional[str]) -> list[int]:
    order = [r for node in topo.nodes for r in node.ranks]
    if ranks is not None:
        n = _positive_int(ranks, "--ranks")
        if n > len(order):
            raise ModelArgumentError(f"--ranks {n}: {topo.describe()} has only {len(order)} ranks")
        return order[:n]
    if nodes is not None:
        k = _positive_int(nodes, "--nodes")
        if k > topo.node_count:
            raise ModelArgumentError(f"--nodes {k}: {topo.describe()} has only {topo.node_count} node(s)")
        return [r for node in topo.nodes[:k] for r in node.ranks]
    return order


def _sendrecv_pairs(members: list[int]) -> list[tuple[int, int]]:
    """nccl-tests sendrecv: every rank sends to the next one; the slowest pair sets the time."""
    n = len(members)
    return [(i, (i + 1) % n) for i in range(n)] if n > 1 else [(0, 0)]


def rows(topo, kind: str, members: list[int], sizes: list[int], elem_size: int,
         algorithms=None, protocols=None) -> list[dict]:
    n = len(members)
    per_rank_blocks = kind in ("AllGather", "ReduceScatter", "AlltoAll", "Gather", "Scatter")
    out = []
    for size in sizes:
        count = size // elem_size // (n if per_rank_blocks else 1)
        if count < 1:
            continue
        if kind == "SendRecv":
            e = max((costmodel.estimate(kind, count, elem_size, members, a, b, topo, algorithms, protocols)
                     for a, b in _sendrecv_pairs(members)), key=lambda est: est.seconds)
        else:
            e = costmodel.estimate(kind, count, elem_size, members, 0, -1, topo, algorithms, protocols)
        out.append({
            "size": e.logical_bytes, "count": count, "time_us": e.seconds * 1e6,
            "algbw_gbs": e.algbw_gbs, "busbw_gbs": e.busbw_gbs,
            "algorithm": e.algorithm, "protocol": e.protocol,
            "candidates_us": {name: t * 1e6 for name, t in sorted(e.candidates.items(), key=lambda kv: kv[1])},
        })
    return out


def main(argv: Optional[Sequence[str]] = None, prog: str = "fgpu model") -> int:
    from fakegpu.topology import ClusterConfigError, default_topology, load_cluster_config

    parser = build_parser(prog)
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        key = args.op.replace("_", "").replace("-", "").lower()
        if key not in OPS:
            raise ModelArgumentError(f"--op {args.op!r}: unknown operation (choose from {', '.join(OPS)})")
        kind = OPS[key]
        if args.dtype.lower() not in DTYPE_SIZES:
            raise ModelArgumentError(f"--dtype {args.dtype!r}: unknown datatype (choose from {', '.join(DTYPE_SIZES)})")
        elem_size = DTYPE_SIZES[args.dtype.lower()]
        lo, hi = _size(args.minbytes, "-b/--minbytes"), _size(args.maxbytes, "-e/--maxbytes")
        if lo > hi:
            raise ModelArgumentError(f"-b {args.minbytes} is larger than -e {args.maxbytes}")
        factor = _positive_int(args.stepfactor, "-f/--stepfactor")
        if factor < 2 and lo != hi:
            raise ModelArgumentError("-f/--stepfactor must be at least 2 (or give -b equal to -e)")
        algorithms = _names(args.algo, costmodel._check_algorithm, "--algo", "algorithm")
        protocols = _names(args.proto, costmodel._check_protocol, "--proto", "protocol")
        if args.config:
            topo = load_cluster_config(args.config)   # a path, or a bundled config's bare name
        else:
            if args.world_size < 1:
                raise ModelArgumentError(f"--world-size must be at least 1, got {args.world_size}")
            topo = default_topology(args.world_size)
        members = _members(topo, args.ranks, args.nodes)
    except (ModelArgumentError, ClusterConfigError) as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 2
    sizes = []
    size = lo
    while size <= hi:
        sizes.append(size)
        if factor < 2:
            break
        size *= factor
    table = rows(topo, kind, members, sizes, elem_size, algorithms, protocols)
    nodes = len({topo.node_of(r) for r in members})
    if args.json:
        json.dump({"cluster": topo.name, "source": topo.source, "op": kind, "ranks": len(members),
                   "nodes": nodes, "dtype": args.dtype, "rows": table}, sys.stdout, indent=1)
        print()
        return 0
    print(f"# fakegpu model: {topo.name}, {kind} over {len(members)} ranks on {nodes} node(s), "
          f"{args.dtype} (modeled, not measured)")
    for flag, value, env in (("--algo", args.algo, "NCCL_ALGO"), ("--proto", args.proto, "NCCL_PROTO")):
        if value is not None:
            print(f"# {flag} {value}")
        elif os.environ.get(env):
            print(f"# {env}={os.environ[env]} (from the environment)")
    head = f"{'size':>12} {'count':>12} {'time(us)':>10} {'algbw':>8} {'busbw':>8}  {'algorithm':<12} {'protocol':<8}"
    print(head + ("  candidates (us)" if args.candidates else ""))
    for row in table:
        line = (f"{row['size']:>12} {row['count']:>12} {row['time_us']:>10.1f} {row['algbw_gbs']:>8.2f} "
                f"{row['busbw_gbs']:>8.2f}  {row['algorithm']:<12} {row['protocol']:<8}")
        if args.candidates:
            line += "  " + " ".join(f"{name}={t:.1f}" for name, t in row["candidates_us"].items())
        print(line)
    if not table:
        print(f"# no size in {lo}..{hi} holds one {args.dtype} element per rank")
    return 0
