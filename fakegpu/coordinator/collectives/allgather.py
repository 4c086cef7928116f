"""AllGather: block i of every rank's output is rank i's input."""
from __future__ import annotations

import numpy as np


def execute(dt, redop, count, root, ins, outs, scalars):
    nbytes = count * dt.size
    for i, src in enumerate(ins):
        lo = i * nbytes
        for out in outs:
            np.copyto(out[lo:lo + nbytes], src)
