"""Gather: block i of the root's output is rank i's input."""
from __future__ import annotations

import numpy as np


def execute(dt, redop, count, root, ins, outs, scalars):
    nbytes = count * dt.size
    dst = outs[root]
    for i, src in enumerate(ins):
        np.copyto(dst[i * nbytes:(i + 1) * nbytes], src)
