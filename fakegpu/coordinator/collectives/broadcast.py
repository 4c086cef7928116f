"""Broadcast: every rank's output is the root's input."""
from __future__ import annotations

import numpy as np


def execute(dt, redop, count, root, ins, outs, scalars):
    src = ins[root]
    for out in outs:
        np.copyto(out, src)
