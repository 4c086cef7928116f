"""Reduce: the root's output is the reduction of all inputs; other ranks get nothing."""
from __future__ import annotations

from .numerics import reduce_into


def execute(dt, redop, count, root, ins, outs, scalars, order=(0, 0, 0)):
    plan, offset, total = order  # as in allreduce.execute
    reduce_into(dt, redop, [x.view(dt.storage) for x in ins], [outs[root].view(dt.storage)], scalars, plan, offset, total)
