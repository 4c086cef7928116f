"""Fuzz a live coordinator with >= 10,000 random and mutated frames over many connections and
check, throughout, that a well-behaved pair of clients keeps getting correct allreduces and
that the coordinator's memory stays bounded."""
from __future__ import annotations

import json
import os
import random
import socket
import struct
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fakegpu import protocol as P
from fakegpu.coordinator.client import SyncClient
from helpers.paths import VECTORS

from test_coordinator_server import Coordinator, allreduce, world

psutil = pytest.importorskip("psutil")

VECTORS = [bytes.fromhex(v["hex"]) for v in
           json.loads((VECTORS / "protocol_vectors.json").read_text())]
CLIENT_VECTORS = [v for v in VECTORS if struct.unpack_from("<H", v, 6)[0] in P.CLIENT_TO_SERVER]
HELLO = P.encode_frame(P.Hello(flags=0, global_rank=-1, pid=1, staging_bytes=8192, hostname="fuzz"), 1)

FRAMES_PER_CONNECTION = 6
EXAMPLES = 1800   # x 6 frames = 10,800 frames


def _mutate(data: bytes, rnd: random.Random) -> bytes:
    b = bytearray(data)
    for _ in range(rnd.randint(1, 4)):
        choice = rnd.random()
        if choice < 0.4 and b:
            b[rnd.randrange(len(b))] = rnd.randrange(256)
        elif choice < 0.55:
            b = b[:rnd.randrange(len(b) + 1)]
        elif choice < 0.7 and len(b) >= 16:   # lie about body_len
            struct.pack_into("<I", b, 12, rnd.choice([0, 1, len(b) - 16 + 1, 1 << 31, rnd.randrange(1 << 20)]))
        elif choice < 0.8 and len(b) >= 8:    # another type
            struct.pack_into("<H", b, 6, rnd.choice(sorted(P.MESSAGE_NAMES) + [0, 5, 99, 65535]))
        elif choice < 0.9:
            b += bytes(rnd.randrange(256) for _ in range(rnd.randrange(64)))
        else:
            pos = rnd.randrange(len(b) + 1)
            b[pos:pos] = bytes(rnd.randrange(256) for _ in range(rnd.randrange(1, 32)))
    return bytes(b)


def _frame(kind: int, seed: int) -> bytes:
    rnd = random.Random(seed)
    if kind == 0:      # random bytes
        return bytes(rnd.randrange(256) for _ in range(rnd.randrange(1, 200)))
    if kind == 1:      # a valid header with a random body
        t = rnd.choice(sorted(P.CLIENT_TO_SERVER))
        body = bytes(rnd.randrange(256) for _ in range(rnd.randrange(0, 300)))
        return P.encode_header(t, rnd.randrange(1 << 32), len(body)) + body
    base = rnd.choice(CLIENT_VECTORS)
    return base if kind == 2 else _mutate(base, rnd)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fuzz")
    c = Coordinator("--address", str(tmp / "c.sock"), "--token", "fuzz-token-not-guessable",
                    "--timeout-ms", "2000")
    clients, handles = world(c.address, 2, token="fuzz-token-not-guessable")
    state = {"coord": c, "clients": clients, "handles": handles, "frames": 0, "examples": 0,
             "proc": psutil.Process(c.proc.pid), "rss": []}
    yield state
    for cl in clients:
        cl.close()
    c.stop()


def _send_connection(address: str, frames: list, authenticate: bool) -> None:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(5)
    s.connect(address)
    try:
        if authenticate:
            # Right token so that later frames get past the HELLO gate.
            s.sendall(P.encode_frame(P.Hello(flags=0, pid=1, staging_bytes=8192, hostname="fuzz",
                                             token="fuzz-token-not-guessable"), 1))
        for f in frames:
            s.sendall(f)
    except OSError:
        pass  # the coordinator closed us: expected for most inputs
    finally:
        s.close()


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 1 << 30)),
                min_size=FRAMES_PER_CONNECTION, max_size=FRAMES_PER_CONNECTION),
       st.booleans())
def test_fuzz_frames_keep_coordinator_serving(target, specs, authenticate):
    frames = [_frame(kind, seed) for kind, seed in specs]
    _send_connection(target["coord"].address, frames, authenticate)
    target["frames"] += len(frames)
    target["examples"] += 1
    if target["examples"] % 100 == 0:
        a, b = np.random.default_rng(target["examples"]).standard_normal((2, 16)).astype(np.float32)
        outs = allreduce(target["clients"], target["handles"], [a, b])
        assert all(np.array_equal(o, a + b) for o in outs)
        target["rss"].append(target["proc"].memory_info().rss)


def test_fuzz_summary(target):
    """Runs after the fuzz test in this module: the totals and memory figures."""
    assert target["coord"].proc.poll() is None, target["coord"].stderr()[-3000:]
    outs = allreduce(target["clients"], target["handles"], [[1.0], [2.0]])
    assert [o.tolist() for o in outs] == [[3.0], [3.0]]
    assert target["frames"] >= 10_000
    # Nothing the fuzz connections left behind: only the well-behaved pair and its communicator.
    with SyncClient(target["coord"].address) as probe:
        state = json.loads(probe.request(P.Ping("fuzz-token-not-guessable")).description)
    print("coordinator state after fuzz:", state)
    print("RSS MiB every 100 connections:", " ".join(f"{r / 2**20:.1f}" for r in target["rss"]))
    assert state["clients"] == 2 and state["communicators"] == 1 and state["pending"] == 0, state
    rss = target["rss"]
    print(f"fuzz: {target['frames']} frames over {target['examples']} connections; coordinator RSS "
          f"{rss[0] / 2**20:.1f} -> {rss[-1] / 2**20:.1f} MiB (max {max(rss) / 2**20:.1f})")
    assert max(rss) < rss[0] + (200 << 20)
