"""fakegpu_probe_source through the real shim and a real coordinator: two ranks held by one
process (one thread each, one connection, as a torch rank's stream thread and a helper share
it), the rank named, the Recv that follows, the argument and usage errors and the timeout.
The torch backend's recv from any source is tested in tests/integration/test_torch_backend_parity.py."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from helpers.coordinator import CoordinatorProcess
from helpers.shim import REPO_ROOT

_PROGRAM = """
    import threading
    import numpy as np
    from fakegpu.nccl import Nccl, NcclError

    nccl = Nccl()
    uid = nccl.get_unique_id()
    comms = [None] * 3
    def init(rank):
        comms[rank] = nccl.comm_init_rank(3, uid, rank, name="anysource")
    threads = [threading.Thread(target=init, args=(r,)) for r in range(3)]
    [t.start() for t in threads]
    [t.join() for t in threads]

    def result(fn):
        try:
            return fn()
        except NcclError as exc:
            return f"{exc.name}: {exc}"

    print("NEGATIVE", result(lambda: comms[0].probe_source(-1)))
    with nccl.group():
        print("IN_GROUP", result(lambda: comms[0].probe_source(100)))
    print("TIMEOUT", result(lambda: comms[0].probe_source(300)))

    # Rank 2 sends, then rank 1: rank 0 hears of rank 2 first, then of rank 1.
    def send(rank, value):
        comms[rank].send(np.full(4, value, np.float32), 4, "float32", 0)
    senders = []
    for rank, value in ((2, 20.0), (1, 10.0)):
        senders.append(threading.Thread(target=send, args=(rank, value)))
        senders[-1].start()
        for _ in range(400):   # until the Send reached the coordinator (20 s at most)
            peer = result(lambda: comms[0].probe_source(50))
            if isinstance(peer, int):
                break
        else:
            raise SystemExit(f"rank {rank}'s Send never showed: {peer}")
        out = np.zeros(4, np.float32)
        comms[0].recv(out, 4, "float32", peer)
        print("GOT", peer, out.tolist())
    [t.join() for t in senders]
"""


def test_probe_source_names_the_waiting_sender_and_fails_clearly(shim_library):
    with CoordinatorProcess("unix") as coordinator:
        env = {k: v for k, v in os.environ.items() if not k.startswith("FAKEGPU_")}
        env.update(coordinator.client_env)
        env["FAKEGPU_NCCL_LIBRARY"] = shim_library
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
        done = subprocess.run([sys.executable, "-c", textwrap.dedent(_PROGRAM)], env=env, capture_output=True,
                              text=True, timeout=120, cwd=str(REPO_ROOT))
    lines = dict(line.split(" ", 1) for line in done.stdout.splitlines() if " " in line and line.split(" ", 1)[0]
                 in ("NEGATIVE", "IN_GROUP", "TIMEOUT"))
    assert done.returncode == 0, done.stdout + done.stderr
    assert lines["NEGATIVE"].startswith("ncclInvalidArgument") and "timeout_ms -1 is negative" in lines["NEGATIVE"]
    assert lines["IN_GROUP"].startswith("ncclInvalidUsage") and "inside ncclGroupStart" in lines["IN_GROUP"]
    assert lines["TIMEOUT"].startswith("ncclTimeout")
    assert "rank 0: receive from any source timed out: no rank sent to rank 0 within 300 ms" in lines["TIMEOUT"]
    assert [line for line in done.stdout.splitlines() if line.startswith("GOT")] == [
        "GOT 2 [20.0, 20.0, 20.0, 20.0]", "GOT 1 [10.0, 10.0, 10.0, 10.0]"]
