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


def effective(call: dict, rank: int, nranks: int) -> dict:
    """The arguments ``rank`` passes (its fault applied) and whether the shim rejects them."""
    kind = call["kind"]
    args = {"kind": kind, "dtype": call["dtype"], "count": call["count"], "op": call["op"], "root": call["root"],
            "null_send": False, "rejected": False, "send_rejected": False}
    fault = call["bad"].get(rank)
    if fault is None:
        return args
    what = fault[0]
    if what in ("count", "dtype", "op", "root"):
        args[what] = fault[1]
    elif what == "bad_dtype":
        args["dtype"] = 99
        args["rejected"] = args["send_rejected"] = True
    elif what == "bad_op":
        args["op"] = 42
        args["rejected"] = True
    elif what == "bad_root":
        args["root"] = nranks + 2
        args["rejected"] = True
    elif what == "null":
        args["null_send"] = args["send_rejected"] = True
        args["rejected"] = kind != "ring"   # in the ring only the Send needs the buffer
    return args


def rank_call(call: dict, rank: int, nranks: int) -> dict:
    """The arguments ``rank`` passes (its fault applied) and its buffers."""
    a = effective(call, rank, nranks)
    dtype, count = a["dtype"], a["count"]
    buf_dtype = dtype if dtype in {int(d) for d in DataType} else int(DataType.float64)
    a["send"] = inputs(call, rank, nranks, buf_dtype, count)
    a["out"] = np.full(_out_count(a["kind"], count, nranks), SENTINEL, dtype=DataType(buf_dtype).numpy_dtype)
    return a


def _agreement(a: dict) -> tuple:
    kind = a["kind"]
    return (a["dtype"], a["count"], a["op"] if kind in REDUCING else None, a["root"] if kind in ROOTED else None)


def failing_ranks(call: dict, nranks: int) -> set:
    """The ranks whose call must fail: every member of a collective in which a rank's arguments
    are rejected or the ranks disagree; in the ring, a rank whose Send or Recv pairs with a
    rejected or disagreeing side."""
    eff = [effective(call, r, nranks) for r in range(nranks)]
    if call["kind"] != "ring":
        if any(a["rejected"] for a in eff) or len({_agreement(a) for a in eff}) > 1:
            return set(range(nranks))
        return set()

    def pair_fails(sender: int) -> bool:
        receiver = (sender + 1) % nranks
        s, r = eff[sender], eff[receiver]
        return s["send_rejected"] or r["rejected"] or _agreement(s) != _agreement(r)

    return {q for q in range(nranks) if pair_fails(q) or pair_fails((q - 1) % nranks)}


def expected_output(call: dict, rank: int, nranks: int):
    """What ``rank``'s output buffer must hold when its call succeeds (None: not defined, a
    non-root of Reduce). The ranks of a successful call agree on their arguments."""
    a = effective(call, rank, nranks)
    kind, dtype, count = call["kind"], a["dtype"], a["count"]
    ins = [inputs(call, r, nranks, dtype, count) for r in range(nranks)]
    if kind == "broadcast":
        return ins[a["root"]]
    if kind == "all_gather":
        return np.concatenate(ins)
    if kind == "ring":
        return ins[(rank - 1) % nranks]
    fold = REDUCERS[a["op"]]
    total = ins[0].copy()
    for x in ins[1:]:
        total = fold(total, x)
    if kind == "all_reduce":
        return total
    if kind == "reduce":
        return total if rank == a["root"] else None
    return total[rank * count:(rank + 1) * count]  # reduce_scatter
