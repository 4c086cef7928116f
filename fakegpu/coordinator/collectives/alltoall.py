"""AlltoAll: block i of rank j's output is block j of rank i's input."""
from __future__ import annotations

import numpy as np


def execute(dt, redop, count, root, ins, outs, scalars):
    nbytes = count * dt.size
    for i, src in enumerate(ins):
        for j, out in enumerate(outs):
            np.copyto(out[i * nbytes:(i + 1) * nbytes], src[j * nbytes:(j + 1) * nbytes])
