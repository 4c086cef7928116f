"""ReduceScatter: rank j's output is the reduction of block j of every rank's input."""
from __future__ import annotations

from .numerics import reduce_into


def execute(dt, redop, count, root, ins, outs, scalars):
    nbytes = count * dt.size
    for j, out in enumerate(outs):
        lo = j * nbytes
        reduce_into(dt, redop, [x[lo:lo + nbytes].view(dt.np) for x in ins], [out.view(dt.np)], scalars)
