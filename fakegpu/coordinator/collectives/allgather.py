"""AllGather: block i of every rank's output is rank i's input."""
from __future__ import annotations

import numpy as np

from .numerics import run_in_parallel


def execute(dt, redop, count, root, ins, outs, scalars):
    nbytes = count * dt.size

    def copy(lo, hi):
        for i, src in enumerate(ins):
            base = i * nbytes
            for out in outs:
                np.copyto(out[base + lo:base + hi], src[lo:hi])

    # Large payloads are split over threads (the ranks' cores are idle while we copy).
    run_in_parallel(nbytes, len(ins) * (1 + len(outs)), copy, align=1 << 16)
