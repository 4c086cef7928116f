"""Soak: many collectives on 8 ranks against a live coordinator, sampling its RSS.

The default is a short run suitable for CI; the full soak of the hardening issue is

    FAKEGPU_SOAK_OPS=100000 PYTHONPATH=. python -m pytest -s tests/integration/test_coordinator_soak.py

which prints the coordinator's RSS over time. Ranks are plain Python clients of the wire
protocol (socket staging), one process each, so the figure is about the coordinator alone.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import secrets
import threading
import time

import numpy as np
import pytest

from fakegpu import protocol as P
from fakegpu.coordinator.client import SyncClient

from test_coordinator_server import Coordinator

psutil = pytest.importorskip("psutil")

RANKS = 8
OPS = int(os.environ.get("FAKEGPU_SOAK_OPS", "1500"))


def _rank(address: str, rank: int, uid: bytes, ops: int, result: "mp.Queue") -> None:
    try:
        c = SyncClient(address, timeout_s=120)
        c.hello(global_rank=rank, staging_bytes=1 << 16)
        info = c.request(P.CommInit(uid, RANKS, rank, "soak"), timeout_s=120)
        # Mix sizes and kinds so that several code paths run: small allreduce, 4 KiB allreduce,
        # a broadcast every 10th call and a ring Send/Recv every 25th.
        small = np.full(1, rank + 1, np.float32)
        big = np.full(1024, rank + 1, np.float32)
        want_small = sum(range(1, RANKS + 1))
        collectives = rings = 0   # the matching order the shim would number (match_seq)
        for i in range(ops):
            if i % 25 == 24:
                rings += 1
                peer_to, peer_from = (rank + 1) % RANKS, (rank - 1) % RANKS
                ops_ = (P.OpDesc(comm_handle=info.comm_handle, kind=P.KIND_SEND, datatype=7, root=peer_to,
                                 total_count=1, step_count=1, in_len=4, match_seq=rings),
                        P.OpDesc(comm_handle=info.comm_handle, kind=P.KIND_RECV, datatype=7, root=peer_from,
                                 total_count=1, step_count=1, in_offset=4, out_len=4, match_seq=rings))
                done = c.request(P.Group(ops=ops_, payload=small.tobytes()), timeout_s=120)
                assert np.frombuffer(done.payload, np.float32)[0] == peer_from + 1
                continue
            arr = big if i % 7 == 6 else small
            kind = P.KIND_BROADCAST if i % 10 == 9 else P.KIND_ALLREDUCE
            in_len = arr.nbytes if kind == P.KIND_ALLREDUCE or rank == 0 else 0
            collectives += 1
            d = P.OpDesc(comm_handle=info.comm_handle, kind=kind, datatype=7,
                         root=0 if kind == P.KIND_BROADCAST else -1, total_count=arr.size,
                         step_count=arr.size, in_len=in_len, out_len=arr.nbytes, match_seq=collectives)
            done = c.request(P.Group(ops=(d,), payload=arr.tobytes()[:in_len]), timeout_s=120)
            assert done.results == (0,), done.message
            got = np.frombuffer(done.payload, np.float32)[0]
            assert got == (1.0 if kind == P.KIND_BROADCAST else want_small), (i, got)
        c.close()
        result.put((rank, None))
    except BaseException as exc:  # report to the parent instead of hanging it
        result.put((rank, repr(exc)))


def test_soak_8_ranks_memory_stays_flat(tmp_path):
    coord = Coordinator("--address", str(tmp_path / "c.sock"), "--report", str(tmp_path / "r.json"),
                        "--timeout-ms", "120000")
    proc = psutil.Process(coord.proc.pid)
    samples = []
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            try:
                samples.append((time.monotonic(), proc.memory_info().rss))
            except psutil.Error:
                return
            stop.wait(0.5)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    ctx = mp.get_context("spawn")
    result = ctx.Queue()
    uid = secrets.token_bytes(128)
    t0 = time.monotonic()
    procs = [ctx.Process(target=_rank, args=(coord.address, r, uid, OPS, result)) for r in range(RANKS)]
    for p in procs:
        p.start()
    try:
        outcomes = [result.get(timeout=max(300, OPS * 0.05)) for _ in procs]
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
        stop.set()
        sampler.join(5)
    elapsed = time.monotonic() - t0
    assert all(err is None for _, err in outcomes), outcomes
    assert coord.stop() == 0
    rss = [r for _, r in samples]
    mid = rss[len(rss) // 4] if len(rss) > 4 else rss[0]
    print(f"\nsoak: {OPS} collectives x {RANKS} ranks in {elapsed:.1f} s "
          f"({OPS / elapsed:.0f} ops/s); coordinator RSS start {rss[0] / 2**20:.1f} MiB, "
          f"after warm-up {mid / 2**20:.1f} MiB, end {rss[-1] / 2**20:.1f} MiB, "
          f"max {max(rss) / 2**20:.1f} MiB ({len(rss)} samples)")
    # Flat after warm-up: growth bounded regardless of OPS.
    assert rss[-1] - mid < 64 << 20
    assert (tmp_path / "r.json").exists()
