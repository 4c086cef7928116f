"""AllReduce: every rank's output is the reduction of all inputs."""
from __future__ import annotations

from .numerics import reduce_into


def execute(dt, redop, count, root, ins, outs, scalars, order=(0, 0, 0)):
    # Reduce into rank 0's output, copy that into the others (block by block, in cache).
    # order: (reduction order, element offset of this step, the call's count); the order's
    # plan is over the call's elements (docs/numerics.md "Reduction order").
    plan, offset, total = order
    reduce_into(dt, redop, [x.view(dt.storage) for x in ins], [y.view(dt.storage) for y in outs], scalars,
                plan, offset, total)
