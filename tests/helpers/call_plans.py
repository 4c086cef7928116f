"""Call plans for the matching-order tests: what each rank passes, and what must come out.

A call is a dict: ``kind`` (all_reduce, broadcast, reduce, all_gather, reduce_scatter, or ring:
a grouped Send to rank+1 and Recv from rank-1), ``dtype`` (a DataType value), ``count``,
``op`` (a RedOp value), ``root``, ``seed`` (the inputs), and ``bad``: {rank: fault}, the ranks
that pass something else, where a fault is one of

    ("count", c) ("dtype", d) ("op", o) ("root", r)   valid but disagreeing with the others
    ("bad_dtype",) ("bad_op",) ("bad_root",) ("null",) rejected by the shim on that rank

Inputs are small integers, so every reduction is exact in every datatype used here.
"""
from __future__ import annotations

import numpy as np

from fakegpu.nccl import DataType, RedOp

SENTINEL = 77
REDUCERS = {int(RedOp.sum): np.add, int(RedOp.max): np.maximum, int(RedOp.min): np.minimum}
REDUCING = ("all_reduce", "reduce", "reduce_scatter")
ROOTED = ("broadcast", "reduce")


def _in_count(kind: str, count: int, nranks: int) -> int:
    return count * nranks if kind == "reduce_scatter" else count


def _out_count(kind: str, count: int, nranks: int) -> int:
    return count * nranks if kind == "all_gather" else count


def inputs(call: dict, rank: int, nranks: int, dtype: int, count: int) -> np.ndarray:
    rng = np.random.default_rng([call["seed"], rank])
    n = _in_count(call["kind"], count, nranks)
    return rng.integers(-4, 5, size=n).astype(DataType(dtype).numpy_dtype)


def rank_call(call: dict, rank: int, nranks: int) -> dict:
    """The arguments ``rank`` passes (its fault applied) and its buffers."""
    kind = call["kind"]
    dtype, count, op, root = call["dtype"], call["count"], call["op"], call["root"]
    fault = call["bad"].get(rank)
    null_send = False
    if fault is not None:
        what = fault[0]
        if what == "count":
            count = fault[1]
        elif what == "dtype":
            dtype = fault[1]
        elif what == "op":
            op = fault[1]
        elif what == "root":
            root = fault[1]
        elif what == "bad_dtype":
            dtype = 99
        elif what == "bad_op":
            op = 42
        elif what == "bad_root":
            root = nranks + 2
        elif what == "null":
            null_send = True
    buf_dtype = dtype if dtype in {int(d) for d in DataType} else int(DataType.float64)
    send = inputs(call, rank, nranks, buf_dtype, count)
    out = np.full(_out_count(kind, count, nranks), SENTINEL, dtype=DataType(buf_dtype).numpy_dtype)
    return {"kind": kind, "dtype": dtype, "count": count, "op": op, "root": root, "send": send, "out": out,
            "null_send": null_send}


def failing_ranks(call: dict, nranks: int) -> set:
    """The ranks whose call must fail: every member of a collective with any fault; for the
    ring, a rank whose Send or Recv pairs with a faulty side."""
    bad = call["bad"]
    if not bad:
        return set()
    if call["kind"] != "ring":
        return set(range(nranks))
    send_bad = {r for r in bad}
    recv_bad = {r for r, f in bad.items() if f[0] != "null"}
    out = set()
    for q in range(nranks):
        if q in send_bad or (q + 1) % nranks in recv_bad or q in recv_bad or (q - 1) % nranks in send_bad:
            out.add(q)
    return out


def expected_output(call: dict, rank: int, nranks: int):
    """What ``rank``'s output buffer must hold when no rank passed a fault (None: not defined,
    a non-root of Reduce)."""
    kind, dtype, count = call["kind"], call["dtype"], call["count"]
    ins = [inputs(call, r, nranks, dtype, count) for r in range(nranks)]
    if kind == "broadcast":
        return ins[call["root"]]
    if kind == "all_gather":
        return np.concatenate(ins)
    if kind == "ring":
        return ins[(rank - 1) % nranks]
    fold = REDUCERS[call["op"]]
    total = ins[0].copy()
    for x in ins[1:]:
        total = fold(total, x)
    if kind == "all_reduce":
        return total
    if kind == "reduce":
        return total if rank == call["root"] else None
    return total[rank * count:(rank + 1) * count]  # reduce_scatter
