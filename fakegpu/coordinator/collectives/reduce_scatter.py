"""ReduceScatter: rank j's output is the reduction of block j of every rank's input."""
from __future__ import annotations

from .numerics import reduce_into


def execute(dt, redop, count, root, ins, outs, scalars, order=(0, 0, 0)):
    # A gloo order's plan covers the whole n·total input (torch's gloo reduce_scatter_tensor
    # all-reduces it and keeps block j): element i of block j is element j·total + i.
    plan, offset, total = order
    nbytes = count * dt.size
    for j, out in enumerate(outs):
        lo = j * nbytes
        reduce_into(dt, redop, [x[lo:lo + nbytes].view(dt.storage) for x in ins], [out.view(dt.storage)], scalars,
                    plan, j * total + offset, len(outs) * total)
