"""`python -m fakegpu bandwidth`: an nccl-tests style sweep through the shim and a coordinator.

Three ways to run it:

* local (default): ``--ranks 4 --op allreduce -b 1K -e 64M -f 4`` starts a private Unix-socket
  coordinator and 4 rank processes on this host, and prints the table;
* ``--listen HOST:PORT``: the same, but the coordinator we start listens on TCP there, and
  ``--nodes``/``--ranks-per-node`` lay the ranks out as logical nodes of a cluster config;
* ``--connect ADDR --world-size W --ranks R --session NAME``: only rank(s) R run here, against a
  coordinator started elsewhere; invocations on other hosts with the same ``--session`` meet in
  one communicator.

The communicator's unique id depends only on the world size, not on the session, so every
bandwidth rank of that size on a coordinator meets the others; each rank then all-gathers its
parameters (session included), so a host started with another ``--session``, ``--size``,
``--iterations``, op or datatype is reported by name instead of waited on until a timeout.  Times are the median
of per-call times, then the maximum over ranks (the slowest rank bounds a collective).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np

from fakegpu.processes import wait_all

# --------------------------------------------------------------------------------------------
# Operations and their nccl-tests conventions
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class OpSpec:
    name: str
    code: int            # stable number used in the parameter check
    reduces: bool        # takes a reduction operator
    rooted: bool         # takes a root
    per_rank_blocks: bool  # the size S covers n per-rank blocks (count = S / (n * elem))

    def busbw_factor(self, n: int) -> float:
        """The nccl-tests convention (docs/cost-model.md, "nccl-tests conventions")."""
        if self.name == "allreduce":
            return 2.0 * (n - 1) / n
        if self.name in ("reducescatter", "allgather", "alltoall", "gather", "scatter"):
            return (n - 1) / n
        return 1.0


OPS = {spec.name: spec for spec in (
    OpSpec("allreduce", 1, True, False, False),
    OpSpec("broadcast", 2, False, True, False),
    OpSpec("reduce", 3, True, True, False),
    OpSpec("allgather", 4, False, False, True),
    OpSpec("reducescatter", 5, True, False, True),
    OpSpec("alltoall", 6, False, False, True),
    OpSpec("gather", 7, False, True, True),
    OpSpec("scatter", 8, False, True, True),
    OpSpec("sendrecv", 9, False, False, False),
)}
OP_ALIASES = {"all_reduce": "allreduce", "bcast": "broadcast", "all_gather": "allgather",
              "reduce_scatter": "reducescatter", "all_to_all": "alltoall", "a2a": "alltoall",
              "send_recv": "sendrecv", "p2p": "sendrecv"}
DTYPE_ALIASES = {"float": "float32", "half": "float16", "double": "float64", "bf16": "bfloat16",
                 "fp16": "float16", "fp32": "float32", "fp64": "float64", "int": "int32",
                 "fp8e4m3": "float8e4m3", "fp8e5m2": "float8e5m2", "e4m3": "float8e4m3",
                 "e5m2": "float8e5m2", "char": "int8", "uchar": "uint8"}
REDOPS = ("sum", "prod", "max", "min", "avg")
# nccl-tests' short type names for the table
TABLE_TYPE = {"int8": "int8", "uint8": "uint8", "int32": "int32", "uint32": "uint32",
              "int64": "int64", "uint64": "uint64", "float16": "half", "float32": "float",
              "float64": "double", "bfloat16": "bfloat16", "float8e4m3": "f8e4m3",
              "float8e5m2": "f8e5m2"}


class BandwidthError(RuntimeError):
    """A problem the user must fix (bad flags, mismatched hosts, a failed rank)."""


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------

def _size(text: str) -> int:
    from fakegpu.env import ConfigError, parse_size

    try:
        return parse_size(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m fakegpu bandwidth",
        description="Measure collective bandwidth through the fakegpu shim and coordinator "
                    "(an nccl-tests style table).")
    sweep = p.add_argument_group("sweep (nccl-tests flags)")
    sweep.add_argument("--op", "-o", default="allreduce",
                       help=f"collective: {', '.join(OPS)} (default allreduce)")
    sweep.add_argument("--dtype", "-d", default="float32", help="datatype (default float32)")
    sweep.add_argument("--redop", default="sum", choices=REDOPS, help="reduction (default sum)")
    sweep.add_argument("--root", "-r", type=int, default=0, help="root rank for rooted ops")
    sweep.add_argument("-b", "--minbytes", type=_size, default=None, help="smallest size (1K)")
    sweep.add_argument("-e", "--maxbytes", type=_size, default=None, help="largest size (64M)")
    sweep.add_argument("-f", "--stepfactor", type=float, default=2.0,
                       help="multiply the size by this between rows (default 2)")
    sweep.add_argument("--size", type=_size, default=None,
                       help="measure only this size (same as -b SIZE -e SIZE)")
    sweep.add_argument("-n", "--iterations", "--iters", type=int, default=20,
                       help="timed calls per size and placement (default 20)")
    sweep.add_argument("-w", "--warmup", "--warmup-iters", type=int, default=5,
                       help="untimed calls before timing (default 5)")
    sweep.add_argument("-c", "--check", type=int, default=1,
                       help="1: verify every result and report #wrong (default); 0: skip")
    sweep.add_argument("--json", "-J", metavar="PATH", default=None,
                       help="also write the results as JSON here")

    world = p.add_argument_group("ranks and coordinator")
    world.add_argument("--ranks", default=None,
                       help="without --world-size: how many local ranks to run (default 2); "
                            "with --world-size: which ranks run here, e.g. 0 or 0,1 or 2-3")
    world.add_argument("--world-size", type=int, default=None,
                       help="ranks in the communicator when they are started separately")
    world.add_argument("--nodes", type=int, default=None,
                       help="logical nodes (with --ranks-per-node); world = nodes x ranks/node")
    world.add_argument("--ranks-per-node", type=int, default=None)
    world.add_argument("--session", default=None,
                       help="name shared by every invocation of one run (required when ranks "
                            "are started separately); it determines the communicator's id")
    world.add_argument("--listen", metavar="HOST:PORT", default=None,
                       help="start a TCP coordinator listening here (ranks connect to it)")
    world.add_argument("--connect", metavar="ADDR", default=None,
                       help="use the running coordinator at HOST:PORT (TCP) or a socket path")
    world.add_argument("--token-file", default=None,
                       help="coordinator token file (default: FAKEGPU_COORDINATOR_TOKEN[_FILE], "
                            "or a fresh one for a coordinator started here)")
    world.add_argument("--timeout", type=float, default=900.0,
                       help="give up after this many seconds (default 900)")

    report = p.add_argument_group("cluster report (of a coordinator started here)")
    report.add_argument("--cluster-config", default=None, help="cluster topology YAML")
    report.add_argument("--cluster-report", default=None, help="JSON cluster report path")
    report.add_argument("--cluster-markdown-report", default=None,
                        help="Markdown project report path")

    # Internal: one rank in this process; parameters come from the flags above.
    p.add_argument("--rank-worker", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--result-file", default=None, help=argparse.SUPPRESS)
    return p


@dataclass
class Sweep:
    op: OpSpec
    dtype: Any            # fakegpu.nccl.DataType
    redop: int
    root: int
    sizes: list[int]
    iterations: int
    warmup: int
    check: bool

    def parameter_vector(self, world_size: int, session_hash: int) -> np.ndarray:
        """What every rank must agree on, as int64s (compared by an initial all-gather)."""
        return np.array([session_hash, world_size, self.op.code, int(self.dtype), self.redop,
                         self.root, self.sizes[0], self.sizes[-1], len(self.sizes),
                         self.iterations, self.warmup, int(self.check)], dtype=np.int64)


PARAMETER_NAMES = ("session", "world size", "op", "dtype", "redop", "root", "smallest size",
                   "largest size", "number of sizes", "iterations", "warmup", "check")


def resolve_sweep(args: argparse.Namespace, world_size: int) -> Sweep:
    from fakegpu.nccl import DataType

    op_name = OP_ALIASES.get(args.op.lower(), args.op.lower())
    if op_name not in OPS:
        raise BandwidthError(f"--op {args.op!r}: unknown collective (choose from {', '.join(OPS)})")
    op = OPS[op_name]
    dtype_name = DTYPE_ALIASES.get(args.dtype.lower(), args.dtype.lower())
    try:
        dtype = DataType[dtype_name]
    except KeyError:
        raise BandwidthError(f"--dtype {args.dtype!r}: unknown datatype (choose from "
                             f"{', '.join(d.name for d in DataType)})") from None
    if args.iterations < 1:
        raise BandwidthError(f"--iterations {args.iterations}: must be at least 1")
    if args.warmup < 0:
        raise BandwidthError(f"--warmup {args.warmup}: must not be negative")
    if op.rooted and not 0 <= args.root < world_size:
        raise BandwidthError(f"--root {args.root}: must be a rank below the world size "
                             f"{world_size}")
    if args.size is not None:
        if args.minbytes is not None or args.maxbytes is not None:
            raise BandwidthError("--size measures one size; do not combine it with -b/-e")
        low = high = args.size
    else:
        low = args.minbytes if args.minbytes is not None else 1024
        high = args.maxbytes if args.maxbytes is not None else max(low, 64 << 20)
    if low < 0 or high < low:
        raise BandwidthError(f"sizes: -b {low} must be at most -e {high}")
    if args.stepfactor <= 1.0 and high > low:
        raise BandwidthError(f"-f {args.stepfactor}: the step factor must be above 1")
    return Sweep(op, dtype, REDOPS.index(args.redop), args.root if op.rooted else -1,
                 sweep_sizes(low, high, args.stepfactor), args.iterations, args.warmup,
                 bool(args.check))


def sweep_sizes(low: int, high: int, factor: float) -> list[int]:
    sizes, size = [], low
    while size <= high:
        sizes.append(int(size))
        if factor <= 1.0:
            break
        nxt = int(size * factor)
        size = nxt if nxt > size else size + 1
    return sizes


def element_count(op: OpSpec, nbytes: int, elem: int, n: int) -> int:
    """The count passed to the call for a row of ``nbytes`` (nccl-tests' size S)."""
    return nbytes // (elem * n) if op.per_rank_blocks else nbytes // elem


def parse_rank_list(text: str, world_size: int) -> list[int]:
    ranks: list[int] = []
    for part in str(text).split(","):
        part = part.strip()
        if not part:
            continue
        try:
            if "-" in part:
                lo, hi = part.split("-", 1)
                ranks.extend(range(int(lo), int(hi) + 1))
            else:
                ranks.append(int(part))
        except ValueError:
            raise BandwidthError(f"--ranks {text!r}: expected rank numbers like 0 or 0,1 or 2-3")
    bad = [r for r in ranks if not 0 <= r < world_size]
    if bad:
        raise BandwidthError(f"--ranks {text!r}: {bad} outside 0..{world_size - 1} "
                             f"(--world-size {world_size})")
    if len(set(ranks)) != len(ranks):
        raise BandwidthError(f"--ranks {text!r}: a rank is listed twice")
    return sorted(ranks)


def rendezvous_unique_id(world_size: int) -> bytes:
    """128 id bytes every host derives identically (see the module docstring for why the
    session is not part of it)."""
    return hashlib.shake_256(b"fakegpu-bandwidth\0%d" % world_size).digest(128)


def session_hash(session: str) -> int:
    return int.from_bytes(hashlib.sha256(session.encode()).digest()[:7], "little")


# --------------------------------------------------------------------------------------------
# One rank
# --------------------------------------------------------------------------------------------

class _Buffers:
    def __init__(self, sweep: Sweep, n: int):
        elem = sweep.dtype.itemsize
        top = max(sweep.sizes) if sweep.sizes else 0
        count = element_count(sweep.op, top, elem, n)
        span = count * n if sweep.op.per_rank_blocks else count
        self.np_dtype = sweep.dtype.numpy_dtype
        self.send = np.zeros(max(span, 1), dtype=self.np_dtype)
        self.recv = np.zeros(max(span, 1), dtype=self.np_dtype)


def _call(comm, nccl, sweep: Sweep, bufs: _Buffers, count: int, rank: int, n: int,
          in_place: bool) -> None:
    """One call of the swept collective on the first ``count``-sized layout of the buffers."""
    op, dt, root = sweep.op.name, sweep.dtype, sweep.root
    send, recv = bufs.send, bufs.recv
    if op == "allreduce":
        comm.all_reduce(recv if in_place else send, recv, count, dt, sweep.redop)
    elif op == "broadcast":
        comm.broadcast(recv if in_place else send, recv, count, dt, root)
    elif op == "reduce":
        comm.reduce(recv if in_place else send, recv, count, dt, sweep.redop, root)
    elif op == "allgather":
        src = recv[rank * count:(rank + 1) * count] if in_place else send
        comm.all_gather(src, recv, count, dt)
    elif op == "reducescatter":
        dst = send[rank * count:(rank + 1) * count] if in_place else recv
        comm.reduce_scatter(send, dst, count, dt, sweep.redop)
    elif op == "alltoall":
        comm.all_to_all(recv if in_place else send, recv, count, dt)
    elif op == "gather":
        src = recv[rank * count:(rank + 1) * count] if (in_place and rank == root) else send
        comm.gather(src, recv, count, dt, root)
    elif op == "scatter":
        dst = send[rank * count:(rank + 1) * count] if (in_place and rank == root) else recv
        comm.scatter(send, dst, count, dt, root)
    elif op == "sendrecv":
        with nccl.group():
            comm.send(recv if in_place else send, count, dt, (rank + 1) % n)
            comm.recv(recv, count, dt, (rank - 1) % n)
    else:  # pragma: no cover - OPS is closed
        raise BandwidthError(op)


def _pattern(rank: int, length: int, start: int, np_dtype) -> np.ndarray:
    """Rank ``rank``'s check data: 1 or 2 alternating, phase by rank (exact in every type)."""
    values = np.array([1 + (rank + start) % 2, 1 + (rank + start + 1) % 2], dtype=np.float64)
    return np.resize(values, length).astype(np_dtype)


def _reduce_small(sweep: Sweep, n: int, start: int) -> np.ndarray:
    """Reduction of every rank's pattern at positions ``start`` and ``start+1`` (our numerics:
    float32 accumulation for narrow floats, wrap-around integers, truncating integer avg)."""
    from fakegpu.nccl import DataType

    dt = sweep.dtype
    acc_type = np.float64 if dt is DataType.float64 else (np.float32 if dt.is_float
                                                          else dt.numpy_dtype)
    parts = [_pattern(r, 2, start, np.float64).astype(acc_type) for r in range(n)]
    with np.errstate(over="ignore", invalid="ignore"):
        acc = parts[0].copy()
        for part in parts[1:]:
            if sweep.redop in (0, 4):
                acc = acc + part
            elif sweep.redop == 1:
                acc = acc * part
            elif sweep.redop == 2:
                acc = np.maximum(acc, part)
            else:
                acc = np.minimum(acc, part)
        if sweep.redop == 4:
            acc = acc / acc_type(n) if dt.is_float else (acc // n).astype(acc_type)
    return acc.astype(dt.numpy_dtype)


def _expected_and_output(sweep: Sweep, bufs: _Buffers, count: int, rank: int, n: int,
                         in_place: bool) -> tuple[Optional[np.ndarray], Optional[np.ndarray]]:
    """(what this rank's output must be, the output view), or (None, None) if it has none."""
    op, root, dt = sweep.op.name, sweep.root, bufs.np_dtype
    if op in ("allreduce",):
        return np.resize(_reduce_small(sweep, n, 0), count), bufs.recv[:count]
    if op == "reduce":
        if rank != root:
            return None, None
        return np.resize(_reduce_small(sweep, n, 0), count), bufs.recv[:count]
    if op == "broadcast":
        return _pattern(root, count, 0, dt), bufs.recv[:count]
    if op == "allgather":
        return (np.concatenate([_pattern(j, count, 0, dt) for j in range(n)]),
                bufs.recv[:n * count])
    if op == "reducescatter":
        small = _reduce_small(sweep, n, rank * count)
        out = bufs.send[rank * count:(rank + 1) * count] if in_place else bufs.recv[:count]
        return np.resize(small, count), out
    if op == "alltoall":
        return (np.concatenate([_pattern(j, count, rank * count, dt) for j in range(n)]),
                bufs.recv[:n * count])
    if op == "gather":
        if rank != root:
            return None, None
        return (np.concatenate([_pattern(j, count, 0, dt) for j in range(n)]),
                bufs.recv[:n * count])
    if op == "scatter":
        out = bufs.send[rank * count:(rank + 1) * count] if (in_place and rank == root) \
            else bufs.recv[:count]
        return _pattern(root, count, rank * count, dt), out
    if op == "sendrecv":
        return _pattern((rank - 1) % n, count, 0, dt), bufs.recv[:count]
    raise BandwidthError(op)


def _fill_inputs(sweep: Sweep, bufs: _Buffers, count: int, rank: int, n: int,
                 in_place: bool) -> None:
    op, dt = sweep.op.name, bufs.np_dtype
    span = count * n if sweep.op.per_rank_blocks else count
    if op == "allgather" and in_place:
        bufs.recv[rank * count:(rank + 1) * count] = _pattern(rank, count, 0, dt)
    elif op == "gather" and in_place and rank == sweep.root:
        bufs.recv[rank * count:(rank + 1) * count] = _pattern(rank, count, 0, dt)
    elif in_place and op in ("allreduce", "broadcast", "reduce", "alltoall", "sendrecv"):
        bufs.recv[:span] = _pattern(rank, span, 0, dt)
    else:
        bufs.send[:span] = _pattern(rank, span, 0, dt)


def _count_wrong(comm, nccl, sweep: Sweep, bufs: _Buffers, count: int, rank: int, n: int,
                 in_place: bool) -> int:
    bufs.recv[:] = np.zeros(1, dtype=bufs.np_dtype)
    _fill_inputs(sweep, bufs, count, rank, n, in_place)
    _call(comm, nccl, sweep, bufs, count, rank, n, in_place)
    expected, out = _expected_and_output(sweep, bufs, count, rank, n, in_place)
    if expected is None:
        return 0
    got = np.ascontiguousarray(out).view(np.uint8).reshape(len(out), -1)
    want = np.ascontiguousarray(expected).view(np.uint8).reshape(len(expected), -1)
    return int(np.count_nonzero(np.any(got != want, axis=1)))


def _agree(comm, value: float, op: int) -> float:
    from fakegpu.nccl import DataType

    buf = np.array([value], dtype=np.float64)
    comm.all_reduce(buf, buf, 1, DataType.float64, op)
    return float(buf[0])


def check_parameters(comm, mine: np.ndarray, rank: int, n: int) -> None:
    """All-gather every rank's parameters; raise naming each disagreement and who has what."""
    from fakegpu.nccl import DataType

    everyone = np.zeros(n * len(mine), dtype=np.int64)
    comm.all_gather(mine, everyone, len(mine), DataType.int64)
    table = everyone.reshape(n, len(mine))
    problems = []
    for i, name in enumerate(PARAMETER_NAMES):
        column = table[:, i]
        if np.all(column == column[0]):
            continue
        by_value: dict[int, list[int]] = {}
        for r, v in enumerate(column.tolist()):
            by_value.setdefault(v, []).append(r)
        shown = "; ".join(f"ranks {rs}: {_describe_parameter(name, v)}"
                          for v, rs in by_value.items())
        problems.append(f"{name} differs ({shown})")
    if problems:
        raise BandwidthError("the ranks were started with different parameters: "
                             + " | ".join(problems)
                             + " -- start every host with the same --session, --size/-b/-e/-f, "
                               "--iterations, --warmup, --op and --dtype")


def _describe_parameter(name: str, value: int) -> str:
    if name == "op":
        return next((s.name for s in OPS.values() if s.code == value), str(value))
    if name == "dtype":
        from fakegpu.nccl import DataType
        return DataType(value).name if 0 <= value <= 11 else str(value)
    if name == "session":
        return f"session hash {value:x}"
    return str(value)


def run_rank(sweep: Sweep, rank: int, world_size: int, session: str,
             log=sys.stderr) -> dict:
    """Join the session's communicator as ``rank`` and run the sweep; every rank returns the
    same agreed table."""
    from fakegpu.nccl import Nccl, RedOp

    nccl = Nccl()
    comm = nccl.comm_init_rank(world_size, rendezvous_unique_id(world_size), rank,
                               name=f"bandwidth:{session}")
    n = world_size
    try:
        check_parameters(comm, sweep.parameter_vector(n, session_hash(session)), rank, n)
        bufs = _Buffers(sweep, n)
        bufs.send[:] = _pattern(rank, len(bufs.send), 0, bufs.np_dtype)
        rows = []
        for nbytes in sweep.sizes:
            count = element_count(sweep.op, nbytes, sweep.dtype.itemsize, n)
            row = {"size": _logical_bytes(sweep.op, count, sweep.dtype.itemsize, n),
                   "count": count}
            for placement, in_place in (("out_of_place", False), ("in_place", True)):
                _agree(comm, 0.0, RedOp.max)  # line the ranks up before timing
                for _ in range(sweep.warmup):
                    _call(comm, nccl, sweep, bufs, count, rank, n, in_place)
                times = []
                for _ in range(sweep.iterations):
                    start = time.perf_counter()
                    _call(comm, nccl, sweep, bufs, count, rank, n, in_place)
                    times.append(time.perf_counter() - start)
                seconds = _agree(comm, statistics.median(times), RedOp.max)
                wrong = -1
                if sweep.check:
                    wrong = int(_agree(comm, _count_wrong(comm, nccl, sweep, bufs, count, rank,
                                                          n, in_place), RedOp.sum))
                    if not in_place:   # what the check call left, as every rank saw it
                        row["sample"] = _result_sample(comm, bufs, n)
                logical = _logical_bytes(sweep.op, count, sweep.dtype.itemsize, n)
                algbw = logical / seconds / 1e9 if seconds > 0 else 0.0
                row[placement] = {"time_us": seconds * 1e6, "algbw": algbw,
                                  "busbw": algbw * sweep.op.busbw_factor(n), "wrong": wrong}
                moved = rank_payload_bytes(sweep.op, count, sweep.dtype.itemsize, n)
                row[placement]["rank_payload_gbits"] = moved * 8 / seconds / 1e9 if seconds > 0 else 0.0
            rows.append(row)
            if rank == 0 and log is not None:
                print(f"rank 0: {nbytes} B done", file=log, flush=True)
    finally:
        comm.destroy()
    return {"rows": rows}


def _logical_bytes(op: OpSpec, count: int, elem: int, n: int) -> int:
    return count * elem * n if op.per_rank_blocks else count * elem


SAMPLE_ELEMENTS = 3


def _result_sample(comm, bufs: "_Buffers", n: int) -> list[list[float]]:
    """The first elements of every rank's output buffer (all-gathered, so each rank returns
    the same list): the usage doc's "all-reduce sample [3, 3, 3] on both ranks"."""
    from fakegpu.nccl import DataType

    k = min(SAMPLE_ELEMENTS, len(bufs.recv))
    mine = np.zeros(SAMPLE_ELEMENTS, dtype=np.float64)
    mine[:k] = bufs.recv[:k].astype(np.float64)
    everyone = np.zeros(n * SAMPLE_ELEMENTS, dtype=np.float64)
    comm.all_gather(mine, everyone, SAMPLE_ELEMENTS, DataType.float64)
    return [[float(v) for v in everyone[r * SAMPLE_ELEMENTS:r * SAMPLE_ELEMENTS + k]] for r in range(n)]


def rank_payload_bytes(op: OpSpec, count: int, elem: int, n: int) -> int:
    """Bytes one rank hands to the coordinator and gets back per call (both directions; the
    busiest rank for rooted ops). Over TCP all of it crosses the rank's socket."""
    block = count * elem
    if op.name in ("allgather", "gather"):
        return block + n * block
    if op.name in ("reducescatter", "scatter"):
        return n * block + block
    if op.name == "alltoall":
        return 2 * n * block
    if op.name in ("broadcast", "reduce"):
        return block                 # the root sends (broadcast) or receives (reduce) it once
    return 2 * block                 # allreduce, sendrecv: the buffer out and the result back


def format_summary(sweep: Sweep, rows: Sequence[dict], iterations: int) -> str:
    """The usage doc's validation table: per size, the iterations timed, a sample of the result
    on every rank, the end-to-end algorithm bandwidth and each rank's payload in both directions,
    in Gbit/s (network units; the nccl-tests table above is in GB/s)."""
    head = (f"# {'size (B)':>10} {'iterations':>10}  {'result sample (first elements, per rank)':<44} "
            f"{'algbw (Gbit/s)':>14} {'rank payload in+out (Gbit/s)':>29}")
    lines = ["#", "# out-of-place, end to end through the coordinator:", head]
    for row in rows:
        sample = row.get("sample")
        if sample is None:
            shown = "not checked (-c 0)"
        else:
            values = [[int(v) if float(v).is_integer() else v for v in r] for r in sample]
            same = all(v == values[0] for v in values)
            shown = (f"{values[0]} on all {len(values)} ranks" if same
                     else "; ".join(f"rank {i}: {v}" for i, v in enumerate(values)))
        r = row["out_of_place"]
        lines.append(f"  {row['size']:>10} {iterations:>10}  {shown:<44} {r['algbw'] * 8:>14.3f} "
                     f"{r.get('rank_payload_gbits', 0.0):>29.3f}")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------------------------

def format_table(sweep: Sweep, world_size: int, rows: Sequence[dict], header: str) -> str:
    redop = REDOPS[sweep.redop] if sweep.op.reduces else "none"
    type_name = TABLE_TYPE[sweep.dtype.name]
    lines = [f"# {header}", "#",
             f"# {'':>46}{'out-of-place':^32}  {'in-place':^32}".rstrip(),
             f"# {'size':>10} {'count':>12} {'type':>8} {'redop':>6} {'root':>5} "
             f"{'time':>8} {'algbw':>7} {'busbw':>7} {'#wrong':>7}  "
             f"{'time':>8} {'algbw':>7} {'busbw':>7} {'#wrong':>7}",
             f"# {'(B)':>10} {'(elements)':>12} {'':>8} {'':>6} {'':>5} "
             f"{'(us)':>8} {'(GB/s)':>7} {'(GB/s)':>7} {'':>7}  "
             f"{'(us)':>8} {'(GB/s)':>7} {'(GB/s)':>7}"]
    busbws = []
    for row in rows:
        cells = []
        for placement in ("out_of_place", "in_place"):
            r = row[placement]
            wrong = "N/A" if r["wrong"] < 0 else str(r["wrong"])
            cells.append(f"{r['time_us']:8.1f} {r['algbw']:7.3f} {r['busbw']:7.3f} {wrong:>7}")
            busbws.append(r["busbw"])
        lines.append(f"  {row['size']:>10} {row['count']:>12} {type_name:>8} {redop:>6} "
                     f"{sweep.root:>5} {cells[0]}  {cells[1]}")
    wrong_total = sum(max(row[p]["wrong"], 0) for row in rows for p in ("out_of_place", "in_place"))
    lines.append(f"# Out of bounds values : {wrong_total} {'OK' if wrong_total == 0 else 'FAILED'}")
    if busbws:
        lines.append(f"# Avg bus bandwidth    : {sum(busbws) / len(busbws):.3f} GB/s")
    return "\n".join(lines)


def result_document(sweep: Sweep, world_size: int, rows: Sequence[dict], *, transport: str,
                    address: str, session: str) -> dict:
    return {
        "tool": "fakegpu bandwidth",
        "op": sweep.op.name,
        "dtype": sweep.dtype.name,
        "redop": REDOPS[sweep.redop] if sweep.op.reduces else None,
        "root": sweep.root,
        "world_size": world_size,
        "iterations": sweep.iterations,
        "warmup": sweep.warmup,
        "timing": "median per-call time over the iterations, maximum over ranks",
        "busbw_factor": sweep.op.busbw_factor(world_size),
        "transport": transport,
        "coordinator": address,
        "session": session,
        "rows": list(rows),
    }


# --------------------------------------------------------------------------------------------
# Driver: coordinator + rank processes
# --------------------------------------------------------------------------------------------

@dataclass
class Plan:
    world_size: int
    local_ranks: list[int]
    session: str
    transport: str
    address: Optional[str]       # None until a coordinator we start reports it
    start_coordinator: bool
    nodes: Optional[int]
    ranks_per_node: Optional[int]


def make_plan(args: argparse.Namespace) -> Plan:
    if args.listen and args.connect:
        raise BandwidthError("--listen starts a coordinator and --connect uses a running one: "
                             "give only one")
    nodes, per_node = args.nodes, args.ranks_per_node
    if (nodes is None) != (per_node is None):
        if nodes is not None and per_node is None:
            per_node = 1
        else:
            raise BandwidthError("--ranks-per-node needs --nodes")
    if nodes is not None and (nodes < 1 or per_node < 1):
        raise BandwidthError("--nodes and --ranks-per-node must be at least 1")
    world = args.world_size
    if nodes is not None:
        if world is not None and world != nodes * per_node:
            raise BandwidthError(f"--world-size {world} disagrees with --nodes {nodes} x "
                                 f"--ranks-per-node {per_node}")
        world = nodes * per_node
    if world is not None:
        if world < 1:
            raise BandwidthError(f"--world-size {world}: must be at least 1")
        local = parse_rank_list(args.ranks, world) if args.ranks is not None else list(range(world))
    else:
        try:
            world = int(args.ranks) if args.ranks is not None else 2
        except ValueError:
            raise BandwidthError(f"--ranks {args.ranks!r}: without --world-size it is the number "
                                 "of local ranks (add --world-size W to list rank numbers)")
        if world < 1:
            raise BandwidthError(f"--ranks {world}: must be at least 1")
        local = list(range(world))
    all_local = len(local) == world
    if not all_local and not args.session:
        raise BandwidthError("--session NAME is required when the ranks are started by "
                             "separate commands (every host passes the same name)")
    if not all_local and not args.connect:
        raise BandwidthError("only some ranks run here: pass --connect HOST:PORT of the "
                             "coordinator the other hosts use")
    session = args.session or f"local-{os.getpid()}-{secrets.token_hex(4)}"
    if args.connect:
        transport, address = _connect_address(args.connect)
        return Plan(world, local, session, transport, address, False, nodes, per_node)
    if args.listen:
        return Plan(world, local, session, "tcp", None, True, nodes, per_node)
    return Plan(world, local, session, "unix", None, True, nodes, per_node)


def _connect_address(text: str) -> tuple[str, str]:
    """--connect's transport and the address as FAKEGPU_COORDINATOR_ADDR spells it: a path
    (or unix:PATH) is a Unix socket, HOST:PORT (or tcp:HOST:PORT) is TCP."""
    from fakegpu.coordinator.client import parse_address

    try:
        transport, target = parse_address(text)
    except Exception as exc:
        raise BandwidthError(f"--connect {text!r}: {exc}") from None
    if transport == "unix":
        return "unix", str(target)
    host, port = target
    return "tcp", f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _cluster_yaml(nodes: int, per_node: int) -> str:
    lines = ["version: 1", "cluster:", f"  name: bandwidth-{nodes}x{per_node}",
             "  default_backend: nccl", "nodes:"]
    for k in range(nodes):
        ranks = ", ".join(str(k * per_node + i) for i in range(per_node))
        lines += [f"  - id: node{k}", "    host: 127.0.0.1", f"    ranks: [{ranks}]", "    gpus:"]
        lines += ["      - profile: h100"] * per_node
    lines += ["fabric:", "  intra_node:", "    type: nvlink", "    bandwidth_gbps: 3600",
              "    latency_us: 3", "  inter_node:", "    type: tcp", "    bandwidth_gbps: 10",
              "    latency_us: 50", "    oversubscription: 1"]
    return "\n".join(lines) + "\n"


def _python_path() -> str:
    package_parent = str(Path(__file__).resolve().parents[2])
    return os.pathsep.join(filter(None, [package_parent, os.environ.get("PYTHONPATH")]))


def _start_coordinator(args, plan: Plan, workdir: Path, token_file: Path):
    from fakegpu.launcher import CoordinatorProcess, LaunchError

    argv = [sys.executable, "-m", "fakegpu", "coordinator"]
    if plan.transport == "unix":
        argv += ["--transport", "unix", "--address", str(workdir / "coordinator.sock")]
    else:
        argv += ["--listen", args.listen]
    argv += ["--token-file", str(token_file)]
    config = args.cluster_config
    if config is None and plan.nodes is not None:
        generated = workdir / "cluster.yaml"
        generated.write_text(_cluster_yaml(plan.nodes, plan.ranks_per_node))
        config = str(generated)
    if config:
        argv += ["--cluster-config", str(Path(config).resolve())]
    if args.cluster_report:
        argv += ["--report", str(Path(args.cluster_report).resolve())]
    if args.cluster_markdown_report:
        argv += ["--markdown-report", str(Path(args.cluster_markdown_report).resolve())]
    env = dict(os.environ)
    env["PYTHONPATH"] = _python_path()
    env["PYTHONUNBUFFERED"] = "1"
    env.pop("LD_PRELOAD", None)
    if not args.cluster_report:
        env.pop("FAKEGPU_CLUSTER_REPORT_PATH", None)
        env.pop("FAKEGPU_CLUSTER_REPORT_MARKDOWN_PATH", None)
    coordinator = CoordinatorProcess(argv, env, plan.transport)
    try:
        address = coordinator.wait_ready(60.0)
    except LaunchError as exc:
        raise BandwidthError(str(exc)) from None
    if plan.transport == "unix" and not address:
        address = str(workdir / "coordinator.sock")
    return coordinator, address


def _rank_env(plan: Plan, rank: int, token_file: Optional[Path]) -> dict:
    env = dict(os.environ)
    env.pop("LD_PRELOAD", None)
    env["PYTHONPATH"] = _python_path()
    env["FAKEGPU_DIST_MODE"] = "simulate"
    env["FAKEGPU_COORDINATOR_TRANSPORT"] = plan.transport
    env["FAKEGPU_COORDINATOR_ADDR"] = plan.address or ""
    env.setdefault("FAKEGPU_COORDINATOR_TIMEOUT_MS", "120000")
    if token_file is not None:
        env.pop("FAKEGPU_COORDINATOR_TOKEN", None)
        env["FAKEGPU_COORDINATOR_TOKEN_FILE"] = str(token_file)
    per_node = plan.ranks_per_node or plan.world_size
    env["RANK"] = str(rank)
    env["WORLD_SIZE"] = str(plan.world_size)
    env["LOCAL_RANK"] = str(rank % per_node)
    env["LOCAL_WORLD_SIZE"] = str(per_node)
    return env


def _forwarded_flags(args: argparse.Namespace, plan: Plan) -> list[str]:
    flags = ["--op", args.op, "--dtype", args.dtype, "--redop", args.redop, "--root",
             str(args.root), "-f", repr(args.stepfactor), "-n", str(args.iterations),
             "-w", str(args.warmup), "-c", str(args.check), "--world-size", str(plan.world_size),
             "--session", plan.session]
    if args.size is not None:
        flags += ["--size", str(args.size)]
    if args.minbytes is not None:
        flags += ["-b", str(args.minbytes)]
    if args.maxbytes is not None:
        flags += ["-e", str(args.maxbytes)]
    return flags


def _run_rank_processes(args, plan: Plan, token_file: Optional[Path], workdir: Path) -> dict:
    procs = []
    for rank in plan.local_ranks:
        result = workdir / f"rank-{rank}.json"
        log = open(workdir / f"rank-{rank}.log", "w+")
        cmd = [sys.executable, "-m", "fakegpu", "bandwidth", "--rank-worker", str(rank),
               "--result-file", str(result), *_forwarded_flags(args, plan)]
        procs.append((rank, subprocess.Popen(cmd, env=_rank_env(plan, rank, token_file),
                                             stdin=subprocess.DEVNULL, stdout=log,
                                             stderr=subprocess.STDOUT), log, result))
    timed_out = not wait_all([proc for _, proc, _, _ in procs], args.timeout, grace_s=15.0)
    failures = []
    for rank, proc, log, _ in procs:
        log.seek(0)
        text = log.read()
        log.close()
        if proc.returncode != 0:
            tail = "\n".join(text.strip().splitlines()[-8:])
            failures.append(f"rank {rank} exited with {proc.returncode}:\n{tail}")
    if timed_out:
        raise BandwidthError(f"the ranks did not finish within --timeout {args.timeout:g} s\n"
                             + "\n".join(failures))
    if failures:
        raise BandwidthError("\n".join(failures))
    return json.loads(procs[0][3].read_text())


def _worker_main(args: argparse.Namespace) -> int:
    world = args.world_size
    if world is None or args.session is None:
        raise BandwidthError("--rank-worker needs --world-size and --session")
    sweep = resolve_sweep(args, world)
    result = run_rank(sweep, args.rank_worker, world, args.session)
    tmp = Path(args.result_file + ".tmp")
    tmp.write_text(json.dumps(result))
    os.replace(tmp, args.result_file)
    return 0


def _run(args: argparse.Namespace) -> int:
    plan = make_plan(args)
    sweep = resolve_sweep(args, plan.world_size)
    workdir = Path(tempfile.mkdtemp(prefix="fgpu-bw-"))
    os.chmod(workdir, 0o700)
    coordinator = None
    token_file: Optional[Path] = None
    try:
        if plan.start_coordinator:
            if args.token_file:
                token_file = Path(args.token_file).resolve()
            else:
                token_file = workdir / "token"
                fd = os.open(token_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                with os.fdopen(fd, "w") as handle:
                    handle.write(secrets.token_hex(32) + "\n")
            coordinator, plan.address = _start_coordinator(args, plan, workdir, token_file)
        else:
            if args.token_file:
                token_file = Path(args.token_file).resolve()
            if args.cluster_report or args.cluster_markdown_report:
                print("note: --cluster-report/--cluster-markdown-report are written by the "
                      "coordinator; pass them to the command that started it", file=sys.stderr)
        # Every rank runs in a process of its own, one here too: --timeout bounds them all.
        result = _run_rank_processes(args, plan, token_file, workdir)
    finally:
        if coordinator is not None:
            code = coordinator.stop()
            if code not in (0, None) and coordinator.running() is False:
                print(f"note: the coordinator exited with status {code}:\n"
                      f"{coordinator.output_tail()}", file=sys.stderr)
        shutil.rmtree(workdir, ignore_errors=True)

    rows = result["rows"]
    where = f"{plan.transport} coordinator {plan.address}"
    layout = (f", {plan.nodes} nodes x {plan.ranks_per_node} ranks" if plan.nodes else "")
    header = (f"fakegpu bandwidth: {sweep.op.name}, {sweep.dtype.name}, {plan.world_size} ranks"
              f"{layout} (here: {','.join(map(str, plan.local_ranks))}), {where}, "
              f"median of {sweep.iterations} calls after {sweep.warmup} warmup")
    print(format_table(sweep, plan.world_size, rows, header))
    print(format_summary(sweep, rows, sweep.iterations))
    if args.json:
        doc = result_document(sweep, plan.world_size, rows, transport=plan.transport,
                              address=plan.address or "", session=plan.session)
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")
        print(f"# JSON results: {args.json}")
    if plan.start_coordinator and args.cluster_report:
        print(f"# cluster report: {args.cluster_report}")
    if plan.start_coordinator and args.cluster_markdown_report:
        print(f"# markdown report: {args.cluster_markdown_report}")
    wrong = sum(max(row[p]["wrong"], 0) for row in rows for p in ("out_of_place", "in_place"))
    return 1 if wrong else 0


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.rank_worker is not None:
            return _worker_main(args)
        return _run(args)
    except BandwidthError as exc:
        print(f"fakegpu bandwidth: error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:
        from fakegpu.nccl import NcclError

        if isinstance(exc, NcclError):
            print(f"fakegpu bandwidth: error: {exc}", file=sys.stderr)
            return 3
        raise


if __name__ == "__main__":
    sys.exit(main())
