"""Waiting for a set of rank processes without hanging on the ones that outlive a failure."""
from __future__ import annotations

import subprocess
import time
from typing import Sequence


def wait_all(procs: Sequence[subprocess.Popen], timeout_s: float, grace_s: float = 10.0) -> bool:
    """Wait for every process; False on timeout.  When one fails, the others get ``grace_s``
    to notice (their own calls fail with a peer error) and are then killed, so a crashed
    rank costs seconds, not the whole timeout.  Nothing is left running on return."""
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            codes = [p.poll() for p in procs]
            if all(c is not None for c in codes):
                return True
            if any(c not in (None, 0) for c in codes):
                deadline = min(deadline, time.monotonic() + grace_s)
            if time.monotonic() > deadline:
                return any(c not in (None, 0) for c in codes)  # a failure, not a timeout
            time.sleep(0.02)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
