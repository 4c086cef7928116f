"""The sans-I/O coordinator core, driven without sockets: rendezvous, handles, global ranks,
split, matching, mismatch messages, timeouts on a fake clock, disconnects, partial groups,
socket-staged payloads and accounting records."""
from __future__ import annotations

import json
import struct

import numpy as np
import pytest

from fakegpu import protocol as P
from fakegpu.coordinator import core as C
from fakegpu.coordinator.collectives.numerics import DTYPES
from fakegpu.coordinator.server import perform_arena_action


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


class ListRecorder:
    def __init__(self):
        self.clients, self.gone, self.comms, self.ops = [], [], [], []

    def client_connected(self, c):
        self.clients.append(c)

    def client_disconnected(self, c, reason):
        self.gone.append((c, reason))

    def comm_created(self, comm, waits):
        self.comms.append(comm)

    def op_completed(self, op):
        self.ops.append(op)


def shm_factory(hello, S):
    return np.zeros(2 * S, dtype=np.uint8), True


class Harness:
    """Feeds frames to a Core and collects the decoded replies per connection."""

    def __init__(self, **kw):
        self.clock = FakeClock()
        kw.setdefault("timeout_ms", 5000)
        self.core = C.Core(clock=self.clock, wall=lambda: 1.7e9, **kw)
        self.inbox: dict = {}
        self.closed: dict = {}
        self.shutdown = []
        self.killed = []      # (conn, pid) of the KILL actions, in order
        self.arena_actions = []   # (kind, arena, value) of the ARENA_* actions, in order; performed as the server does
        self._rid = 100

    def _apply(self, actions):
        for kind, conn, data in actions:
            if kind == C.SEND:
                raw = data if isinstance(data, bytes) else b"".join(bytes(memoryview(p)) for p in data)
                for f in P.FrameParser(1 << 40).feed(raw):
                    self.inbox.setdefault(conn, []).append((f.request_id, P.decode_body(f.msg_type, f.body)))
            elif kind == C.CLOSE:
                self.closed[conn] = data
            elif kind == C.KILL:
                assert conn not in self.closed, "KILL must come before the connection's CLOSE"
                self.killed.append((conn, data))
            elif kind in C.ARENA_ACTIONS:
                self.arena_actions.append((kind, conn, data))
                perform_arena_action(kind, conn, data)
            else:
                self.shutdown.append(data)

    def send(self, conn, msg, rid=None, factory=shm_factory):
        if rid is None:
            self._rid += 1
            rid = self._rid
        raw = P.encode_frame(msg, rid)
        for f in P.FrameParser(1 << 40).feed(raw):
            self._apply(self.core.on_frame(conn, f, "unix", factory))
        return rid

    def take(self, conn):
        msgs = self.inbox.pop(conn, [])
        return msgs

    def reply(self, conn, rid):
        for i, (r, m) in enumerate(self.inbox.get(conn, [])):
            if r == rid:
                del self.inbox[conn][i]
                return m
        return None

    def tick(self, advance):
        self.clock.now += advance
        self._apply(self.core.tick())

    def disconnect(self, conn, reason="test"):
        self._apply(self.core.disconnect(conn, reason))

    def hello(self, conn, rank=-1, factory=shm_factory, staging=1 << 16, **kw):
        rid = self.send(conn, P.Hello(flags=1, global_rank=rank, pid=1000 + conn, staging_bytes=staging,
                                      hostname=f"host{conn}", **kw), factory=factory)
        return self.reply(conn, rid)

    def init(self, conns, uid=b"u" * 128, ranks=None, name="world"):
        ranks = list(range(len(conns))) if ranks is None else ranks
        rids = [self.send(c, P.CommInit(uid, len(conns), r, name)) for c, r in zip(conns, ranks)]
        return [self.reply(c, rid) for c, rid in zip(conns, rids)]

    def staging(self, conn):
        c = self.core.clients[conn]
        return c.inp, c.outp


def op(handle, kind, dtype, count, n, rank=0, root=-1, redop=0, in_off=0, out_off=0, scalar=b"",
       total=None, flags=6, seq=1, step=0, steps=1):
    """An OpDesc as the shim builds it: ``seq`` is the call's match_seq (collective calls on the
    communicator, or Send/Recv calls of the pair), ``step``/``steps`` its place in the call."""
    size = DTYPES[dtype].size
    from fakegpu.coordinator.matching import expected_lengths
    in_len, out_len = expected_lengths(kind, count, size, n, rank, root)
    return P.OpDesc(comm_handle=handle, kind=kind, datatype=dtype, redop=redop, flags=flags, root=root,
                    total_count=count if total is None else total, step_count=count, in_offset=in_off,
                    in_len=in_len, out_offset=out_off, out_len=out_len, scalar=scalar, match_seq=seq,
                    step_index=step, step_total=steps)


@pytest.fixture
def h():
    return Harness()


def world(h, n, rank_env=True):
    for c in range(n):
        assert isinstance(h.hello(c, rank=c if rank_env else -1), P.HelloOk)
    infos = h.init(list(range(n)))
    return [i.comm_handle for i in infos]


# --------------------------------------------------------------------------- hello, auth


def test_hello_grants_staging_and_reports_shm(h):
    ok = h.hello(1, staging=1 << 20)
    assert ok.flags & P.HELLO_FLAG_SHM and ok.staging_bytes == 1 << 20 and ok.timeout_ms == 5000


def test_wrong_token_is_rejected_before_any_state():
    h = Harness(token="sesame")
    calls = []

    def factory(hello, S):
        calls.append(S)
        return shm_factory(hello, S)

    reply = h.hello(1, factory=factory, token="nope")
    assert isinstance(reply, P.Error) and reply.result == P.NCCL_INVALID_USAGE
    assert "authentication failed" in reply.message
    assert 1 in h.closed and not calls and not h.core.clients
    assert isinstance(h.hello(2, token="sesame"), P.HelloOk)


def test_before_a_valid_token_nothing_but_authentication_required_is_answered():
    """A coordinator with a token tells a connection that has not shown it nothing about
    itself: no pid, client, communicator or op counts (on main an empty PING got them all)."""
    h = Harness(token="t")
    h.hello(9, token="t")
    rid = h.send(1, P.Ping())
    assert h.take(1) == [(rid, P.Error(P.NCCL_INVALID_USAGE, "authentication required"))]
    assert h.closed[1] == "authentication required (PING before HELLO without a token)"
    rid = h.send(2, P.Ping("wrong"))
    assert h.take(2) == [(rid, P.Error(P.NCCL_INVALID_USAGE, "authentication failed"))] and 2 in h.closed
    rid = h.send(3, P.CommInit(b"x" * 128, 1, 0))
    assert h.take(3) == [(rid, P.Error(P.NCCL_INVALID_USAGE, "authentication required"))]
    assert "HELLO must be the first frame" in h.closed[3]
    rid = h.send(5, P.Shutdown(""))
    assert h.take(5) == [(rid, P.Error(P.NCCL_INVALID_USAGE, "authentication required"))] and not h.shutdown
    assert h.hello(6) == P.Error(P.NCCL_INVALID_USAGE, "authentication required")
    assert h.closed[6] == "authentication required (HELLO of pid 1006 on host6 without a token)"
    rid = h.send(4, P.Ping("t"))
    assert json.loads(h.reply(4, rid).description)["clients"] == 1 and 4 not in h.closed
    # After an authenticated HELLO the connection itself is trusted: its PINGs need no token.
    rid = h.send(9, P.Ping())
    assert json.loads(h.reply(9, rid).description)["clients"] == 1 and 9 not in h.closed


def test_without_a_token_any_ping_is_answered(h):
    for conn, msg in ((1, P.Ping()), (2, P.Ping("ignored"))):
        rid = h.send(conn, msg)
        assert isinstance(h.reply(conn, rid), P.Pong) and conn not in h.closed


def test_frames_before_hello_are_refused(h):
    h.send(1, P.CommInit(b"x" * 128, 1, 0))
    assert "HELLO must be the first frame" in h.closed[1]


def test_ping_and_shutdown_token():
    h = Harness(token="t")
    rid = h.send(1, P.Ping("t"))
    assert '"clients": 0' in h.reply(1, rid).description
    h.send(2, P.Shutdown("bad"))
    assert 2 in h.closed and not h.shutdown
    rid = h.send(3, P.Shutdown("t"))
    assert isinstance(h.reply(3, rid), P.Ok) and h.shutdown


# --------------------------------------------------------------------------- communicators


def test_init_rendezvous_handles_and_global_ranks(h):
    for c, g in ((0, 5), (1, -1), (2, 7)):
        h.hello(c, rank=g)
    infos = h.init([0, 1, 2])
    assert [i.rank for i in infos] == [0, 1, 2]
    assert len({i.comm_handle for i in infos}) == 3
    # Global ranks: RANK when given, else the rank taken in the first communicator.
    assert infos[0].global_ranks == (5, 1, 7)


def test_one_process_holding_several_ranks(h):
    h.hello(0)
    uid = b"a" * 128
    r0 = h.send(0, P.CommInit(uid, 2, 0))
    r1 = h.send(0, P.CommInit(uid, 2, 1))
    a, b = h.reply(0, r0), h.reply(0, r1)
    assert a.comm_handle != b.comm_handle and a.global_ranks == (0, 1)


def test_init_disagreements_and_bad_rank(h):
    for c in range(3):
        h.hello(c)
    uid = b"z" * 128
    h.send(0, P.CommInit(uid, 3, 0))
    rid = h.send(1, P.CommInit(uid, 2, 1))
    err = h.reply(1, rid)
    assert err.result == P.NCCL_INVALID_USAGE and "nranks=3" in err.message and "nranks=2" in err.message
    rid = h.send(2, P.CommInit(uid, 3, 0))
    assert "joined twice" in h.reply(2, rid).message
    rid = h.send(2, P.CommInit(uid, 3, 3))
    assert h.reply(2, rid).result == P.NCCL_INVALID_ARGUMENT


def test_init_timeout_names_missing_ranks(h):
    for c in range(3):
        h.hello(c)
    uid = b"t" * 128
    r0 = h.send(0, P.CommInit(uid, 3, 0, "pg"))
    r2 = h.send(2, P.CommInit(uid, 3, 2, "pg"))
    h.tick(4.9)
    assert h.reply(0, r0) is None
    h.tick(0.2)
    for c, rid in ((0, r0), (2, r2)):
        err = h.reply(c, rid)
        assert err.result == P.NCCL_TIMEOUT and "ranks [1] did not arrive" in err.message and "'pg'" in err.message


def test_split_by_color_and_key(h):
    handles = world(h, 4)
    colors = [0, 1, 0, -1]
    keys = [5, 0, 1, 0]
    rids = [h.send(c, P.CommSplit(handles[c], colors[c], keys[c], "sub")) for c in range(4)]
    infos = [h.reply(c, r) for c, r in zip(range(4), rids)]
    # color 0: ranks 0 (key 5) and 2 (key 1) -> 2 becomes rank 0.
    assert infos[2].rank == 0 and infos[0].rank == 1 and infos[0].global_ranks == (2, 0)
    assert infos[1].rank == 0 and infos[1].global_ranks == (1,)
    assert infos[3].comm_handle == 0 and infos[3].nranks == 0
    # The split communicator works.
    a, b = infos[2].comm_handle, infos[0].comm_handle
    for conn, hd, val in ((2, a, 1.0), (0, b, 2.0)):
        h.staging(conn)[0][:4] = np.frombuffer(struct.pack("<f", val), np.uint8)
    r_a = h.send(2, P.Group(ops=(op(a, P.KIND_ALLREDUCE, 7, 1, 2),)))
    r_b = h.send(0, P.Group(ops=(op(b, P.KIND_ALLREDUCE, 7, 1, 2),)))
    assert h.reply(2, r_a).results == (0,) and h.reply(0, r_b).results == (0,)
    assert h.staging(2)[1][:4].view(np.float32)[0] == 3.0


def test_finalize_then_destroy_is_fine(h):
    handles = world(h, 2)
    for how in (P.FREE_FINALIZE, P.FREE_DESTROY):
        rid = h.send(0, P.CommFree(handles[0], how))
        assert isinstance(h.reply(0, rid), P.Ok)


def test_one_process_runs_both_ranks_in_one_group(h):
    h.hello(0)
    uid = b"b" * 128
    r0 = h.send(0, P.CommInit(uid, 2, 0))
    r1 = h.send(0, P.CommInit(uid, 2, 1))
    a, b = h.reply(0, r0).comm_handle, h.reply(0, r1).comm_handle
    inp = h.staging(0)[0]
    inp[:8] = np.frombuffer(np.array([1, 2], np.int32).tobytes(), np.uint8)
    ops = (op(a, P.KIND_ALLREDUCE, 2, 1, 2, in_off=0, out_off=0),
           op(b, P.KIND_ALLREDUCE, 2, 1, 2, rank=1, in_off=4, out_off=4))
    rid = h.send(0, P.Group(ops=ops))
    assert h.reply(0, rid).results == (0, 0)
    assert h.staging(0)[1][:8].view(np.int32).tolist() == [3, 3]


def test_comm_free_and_use_after_destroy(h):
    handles = world(h, 2)
    rid = h.send(0, P.CommFree(handles[0], P.FREE_DESTROY))
    assert isinstance(h.reply(0, rid), P.Ok)
    rid = h.send(1, P.Group(ops=(op(handles[1], P.KIND_ALLREDUCE, 7, 1, 2, rank=1),)))
    done = h.reply(1, rid)
    assert done.results == (P.NCCL_INVALID_USAGE,) and "rank 0 has destroyed" in done.message
    rid = h.send(0, P.Group(ops=(op(handles[0], P.KIND_ALLREDUCE, 7, 1, 2),)))
    assert h.reply(0, rid).results == (P.NCCL_INVALID_ARGUMENT,)
    rid = h.send(1, P.CommFree(handles[1], P.FREE_DESTROY))
    assert isinstance(h.reply(1, rid), P.Ok) and not h.core.comms


# --------------------------------------------------------------------------- collectives


_CALLS_RUN: dict = {}   # (harness id, handles) -> collective calls run_collective made there


def run_collective(h, handles, kind, dtype, count, inputs, root=-1, redop=0, scalars=None, seq=None):
    """One collective call on every member; ``seq`` (its match_seq) defaults to the next call
    of the communicator, counting the calls this helper made on it (as the shim counts)."""
    n = len(handles)
    key = (id(h), tuple(handles))
    if seq is None:
        seq = _CALLS_RUN.get(key, 0) + 1
    _CALLS_RUN[key] = seq
    rids = []
    for r in range(n):
        inp, _ = h.staging(r)
        raw = inputs[r].view(np.uint8) if inputs[r] is not None else np.zeros(0, np.uint8)
        inp[:len(raw)] = raw
    for r in range(n):
        d = op(handles[r], kind, dtype, count, n, rank=r, root=root, redop=redop,
               scalar=scalars[r] if scalars else b"", seq=seq)
        rids.append(h.send(r, P.Group(ops=(d,))))
    outs = []
    for r in range(n):
        done = h.reply(r, rids[r])
        assert done.results == (0,), done.message
        d = op(handles[r], kind, dtype, count, n, rank=r, root=root)
        outs.append(h.staging(r)[1][:d.out_len].view(DTYPES[dtype].np).copy())
    return outs


def _inputs(dt, n, count, rng):
    if dt.is_float:
        return [(rng.standard_normal(count) * 4).astype(dt.np) for _ in range(n)]
    info = np.iinfo(dt.np)
    return [rng.integers(info.min, info.max, count, dtype=dt.np, endpoint=True) for _ in range(n)]


@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_every_collective_on_every_dtype(n):
    from helpers.numpy_reduce import reference_reduce
    rng = np.random.default_rng(n)
    h = Harness(max_staging_bytes=1 << 16)
    handles = world(h, n)
    count = 5
    for code, dt in DTYPES.items():
        ins = _inputs(dt, n, count, rng)
        for redop in range(6):
            sc = [np.array([rng.integers(-3, 4) if not dt.is_float else 0.5 + r], dt.np).tobytes()
                  for r in range(n)] if redop == P.REDOP_PREMULSUM else None
            if sc and not dt.is_float and np.iinfo(dt.np).min == 0:
                sc = [np.array([r + 1], dt.np).tobytes() for r in range(n)]
            want = reference_reduce(dt, redop, ins, sc)
            got = run_collective(h, handles, P.KIND_ALLREDUCE, code, count, ins, redop=redop, scalars=sc)
            for g in got:
                assert g.tobytes() == want.tobytes(), (dt.name, redop)
            root = n - 1
            got = run_collective(h, handles, P.KIND_REDUCE, code, count, ins, root=root, redop=redop, scalars=sc)
            assert got[root].tobytes() == want.tobytes()
            big = _inputs(dt, n, count * n, rng)
            got = run_collective(h, handles, P.KIND_REDUCESCATTER, code, count, big, redop=redop, scalars=sc)
            for j in range(n):
                blk = [b[j * count:(j + 1) * count] for b in big]
                assert got[j].tobytes() == reference_reduce(dt, redop, blk, sc).tobytes()
        root = 1 % n
        got = run_collective(h, handles, P.KIND_BROADCAST, code, count,
                             [ins[r] if r == root else None for r in range(n)], root=root)
        assert all(g.tobytes() == ins[root].tobytes() for g in got)
        got = run_collective(h, handles, P.KIND_ALLGATHER, code, count, ins)
        assert all(g.tobytes() == np.concatenate(ins).tobytes() for g in got)
        big = _inputs(dt, n, count * n, rng)
        got = run_collective(h, handles, P.KIND_ALLTOALL, code, count, big)
        for j in range(n):
            assert got[j].tobytes() == np.concatenate([b[j * count:(j + 1) * count] for b in big]).tobytes()
        got = run_collective(h, handles, P.KIND_GATHER, code, count, ins, root=root)
        assert got[root].tobytes() == np.concatenate(ins).tobytes()
        got = run_collective(h, handles, P.KIND_SCATTER, code, count,
                             [big[r] if r == root else None for r in range(n)], root=root)
        for j in range(n):
            assert got[j].tobytes() == big[root][j * count:(j + 1) * count].tobytes()


def test_mismatch_lists_what_each_rank_asked(h):
    handles = world(h, 3)
    rids = [h.send(r, P.Group(ops=(op(handles[r], P.KIND_ALLREDUCE, 7 if r != 2 else 6, 4, 3, rank=r),)))
            for r in range(3)]
    for r in range(3):
        done = h.reply(r, rids[r])
        assert done.results == (P.NCCL_INVALID_USAGE,)
        assert "disagree on datatype" in done.message
        assert "rank 2 asked AllReduce float16 sum count=4" in done.message
        assert "rank 0 asked AllReduce float32 sum count=4" in done.message
    # The communicator is not poisoned.
    ins = [np.full(4, r, np.float32) for r in range(3)]
    assert run_collective(h, handles, P.KIND_ALLREDUCE, 7, 4, ins)[0].tolist() == [3.0] * 4


def test_argument_error_fails_the_call_not_the_communicator(h):
    handles = world(h, 2)
    bad = op(handles[0], P.KIND_BROADCAST, 7, 4, 2, root=0)
    bad = P.OpDesc(**{**bad.__dict__, "root": 5})
    r0 = h.send(0, P.Group(ops=(bad,)))
    r1 = h.send(1, P.Group(ops=(op(handles[1], P.KIND_BROADCAST, 7, 4, 2, rank=1, root=0),)))
    assert h.reply(0, r0).results == (P.NCCL_INVALID_ARGUMENT,)
    d1 = h.reply(1, r1)
    assert d1.results == (P.NCCL_INVALID_USAGE,) and "root 5 is not a rank" in d1.message
    ins = [np.full(4, r + 1, np.int32) for r in range(2)]
    assert run_collective(h, handles, P.KIND_ALLREDUCE, 2, 4, ins)[1].tolist() == [3] * 4


def test_collective_timeout_then_late_arrival(h):
    handles = world(h, 3)
    r0 = h.send(0, P.Group(ops=(op(handles[0], P.KIND_ALLREDUCE, 7, 4, 3),)))
    r1 = h.send(1, P.Group(ops=(op(handles[1], P.KIND_ALLREDUCE, 7, 4, 3, rank=1),)))
    h.tick(5.01)
    for c, rid in ((0, r0), (1, r1)):
        done = h.reply(c, rid)
        assert done.results == (P.NCCL_TIMEOUT,)
        assert "collective #1 AllReduce float32 sum count=4" in done.message
        assert "ranks [2] did not arrive within 5000 ms" in done.message
    # The late rank's call #1 fails with the others' (it must not pair with their call #2).
    r2 = h.send(2, P.Group(ops=(op(handles[2], P.KIND_ALLREDUCE, 7, 4, 3, rank=2),)))
    assert h.reply(2, r2).results == (P.NCCL_TIMEOUT,)
    ins = [np.full(4, 1, np.float32) for _ in range(3)]
    assert run_collective(h, handles, P.KIND_ALLREDUCE, 7, 4, ins, seq=2)[2].tolist() == [3.0] * 4


def test_disconnect_fails_peers_with_remote_error(h):
    handles = world(h, 3)
    r0 = h.send(0, P.Group(ops=(op(handles[0], P.KIND_ALLREDUCE, 7, 4, 3),)))
    h.disconnect(2, "connection reset")
    done = h.reply(0, r0)
    assert done.results == (P.NCCL_REMOTE_ERROR,)
    assert "rank 2 pid 1002 on host2 (RANK 2) disconnected (connection reset)" in done.message
    r1 = h.send(1, P.Group(ops=(op(handles[1], P.KIND_ALLREDUCE, 7, 4, 3, rank=1),)))
    assert h.reply(1, r1).results == (P.NCCL_REMOTE_ERROR,)
    r1 = h.send(1, P.Group(ops=(op(handles[1], P.KIND_ALLREDUCE, 7, 4, 3, rank=1),)))
    assert h.reply(1, r1).results == (P.NCCL_REMOTE_ERROR,)


def test_disconnect_during_init_fails_the_others(h):
    for c in range(3):
        h.hello(c)
    uid = b"d" * 128
    rid = h.send(0, P.CommInit(uid, 3, 0))
    h.send(1, P.CommInit(uid, 3, 1))
    h.disconnect(1)
    assert h.reply(0, rid).result == P.NCCL_REMOTE_ERROR


# --------------------------------------------------------------------------- send / recv


def p2p(handle, kind, peer, count, dtype=7, in_off=0, out_off=0, seq=1, step=0, steps=1):
    size = DTYPES[dtype].size
    return P.OpDesc(comm_handle=handle, kind=kind, datatype=dtype, flags=6, root=peer, total_count=count,
                    step_count=count, in_offset=in_off, in_len=count * size if kind == P.KIND_SEND else 0,
                    out_offset=out_off, out_len=count * size if kind == P.KIND_RECV else 0, match_seq=seq,
                    step_index=step, step_total=steps)


def test_pair_only_sendrecv_while_others_idle(h):
    handles = world(h, 4)
    h.staging(0)[0][:8] = np.frombuffer(np.array([1.5, 2.5], np.float32).tobytes(), np.uint8)
    h.staging(1)[0][:8] = np.frombuffer(np.array([7, 8], np.float32).tobytes(), np.uint8)
    r0 = h.send(0, P.Group(ops=(p2p(handles[0], P.KIND_SEND, 1, 2), p2p(handles[0], P.KIND_RECV, 1, 2))))
    r1 = h.send(1, P.Group(ops=(p2p(handles[1], P.KIND_RECV, 0, 2), p2p(handles[1], P.KIND_SEND, 0, 2))))
    assert h.reply(0, r0).results == (0, 0) and h.reply(1, r1).results == (0, 0)
    assert h.staging(1)[1][:8].view(np.float32).tolist() == [1.5, 2.5]
    assert h.staging(0)[1][:8].view(np.float32).tolist() == [7, 8]


def test_uneven_alltoall_from_sendrecv_with_zero_counts(h):
    n = 3
    handles = world(h, n)
    counts = [[0, 2, 1], [3, 0, 0], [1, 1, 2]]  # counts[src][dst]
    rids = []
    for src in range(n):
        ops, off_in, off_out = [], 0, 0
        inp = h.staging(src)[0]
        for dst in range(n):
            c = counts[src][dst]
            inp[off_in:off_in + 4 * c] = np.frombuffer(np.full(c, 10 * src + dst, np.int32).tobytes(), np.uint8)
            ops.append(p2p(handles[src], P.KIND_SEND, dst, c, dtype=2, in_off=off_in))
            off_in += 4 * c
        for peer in range(n):
            c = counts[peer][src]
            ops.append(p2p(handles[src], P.KIND_RECV, peer, c, dtype=2, out_off=off_out))
            off_out += 4 * c
        rids.append(h.send(src, P.Group(ops=tuple(ops))))
    for dst in range(n):
        assert all(r == 0 for r in h.reply(dst, rids[dst]).results)
        got = h.staging(dst)[1][:4 * sum(counts[p][dst] for p in range(n))].view(np.int32).tolist()
        assert got == [10 * p + dst for p in range(n) for _ in range(counts[p][dst])]


def test_partial_group_buffers_unmatched_sends(h):
    handles = world(h, 2)
    h.staging(0)[0][:4] = np.frombuffer(np.array([42], np.int32).tobytes(), np.uint8)
    # Rank 0's group is partial: its send completes although rank 1 has not posted the recv yet.
    r0 = h.send(0, P.Group(ops=(p2p(handles[0], P.KIND_SEND, 1, 1, dtype=2),), flags=P.GROUP_FLAG_PARTIAL))
    assert h.reply(0, r0).results == (0,)
    h.staging(0)[0][:4] = 0  # staging reused by the next frame
    r1 = h.send(1, P.Group(ops=(p2p(handles[1], P.KIND_RECV, 0, 1, dtype=2),)))
    assert h.reply(1, r1).results == (0,)
    assert h.staging(1)[1][:4].view(np.int32)[0] == 42


def test_p2p_timeout_and_size_mismatch(h):
    handles = world(h, 2)
    r0 = h.send(0, P.Group(ops=(p2p(handles[0], P.KIND_SEND, 1, 4),)))
    h.tick(6)
    done = h.reply(0, r0)
    assert done.results == (P.NCCL_TIMEOUT,) and "rank 1 did not post the matching Recv" in done.message
    # The receiver's Recv #1 comes after the sender's Send #1 timed out: it fails at once (it must
    # not wait for, or pair with, the sender's Send #2) ...
    r1 = h.send(1, P.Group(ops=(p2p(handles[1], P.KIND_RECV, 0, 4),)))
    assert h.reply(1, r1).results == (P.NCCL_TIMEOUT,)
    # ... and the next pair of calls matches (and disagrees on the count).
    r0 = h.send(0, P.Group(ops=(p2p(handles[0], P.KIND_SEND, 1, 4, seq=2),)))
    r1 = h.send(1, P.Group(ops=(p2p(handles[1], P.KIND_RECV, 0, 3, seq=2),)))
    assert h.reply(0, r0).results == (P.NCCL_INVALID_USAGE,)
    assert "disagree" in h.reply(1, r1).message


def test_group_of_many_calls_across_communicators(h):
    handles = world(h, 2)
    infos = h.init([0, 1], uid=b"second" + bytes(122))
    h2 = [i.comm_handle for i in infos]
    rids = []
    for r in range(2):
        inp = h.staging(r)[0]
        inp[:400] = np.frombuffer(np.arange(100, dtype=np.float32).tobytes(), np.uint8)
        ops = [op((handles if i % 2 else h2)[r], P.KIND_ALLREDUCE, 7, 1, 2, rank=r, in_off=4 * i, out_off=4 * i,
                  seq=i // 2 + 1) for i in range(100)]
        rids.append(h.send(r, P.Group(ops=tuple(ops))))
    for r in range(2):
        assert h.reply(r, rids[r]).results == (0,) * 100
        assert h.staging(r)[1][:400].view(np.float32).tolist() == [2.0 * i for i in range(100)]


# --------------------------------------------------------------------------- socket staging


def test_socket_staged_payload_roundtrip():
    h = Harness()
    for c in range(2):
        assert not h.hello(c, factory=C.default_staging_factory).flags & P.HELLO_FLAG_SHM
    handles = [i.comm_handle for i in h.init([0, 1])]
    rids = []
    for r in range(2):
        d = op(handles[r], P.KIND_ALLGATHER, 7, 2, 2, rank=r, in_off=8, out_off=16)
        payload = np.array([r + 0.5, r + 1.5], np.float32).tobytes()
        rids.append(h.send(r, P.Group(ops=(d,), payload=payload)))
    for r in range(2):
        done = h.reply(r, rids[r])
        assert done.results == (0,)
        assert np.frombuffer(done.payload, np.float32).tolist() == [0.5, 1.5, 1.5, 2.5]


def test_payload_outside_region_closes_connection():
    h = Harness()
    h.hello(0, factory=C.default_staging_factory, staging=4096)
    handle = h.init([0])[0].comm_handle
    d = P.OpDesc(comm_handle=handle, kind=1, datatype=7, total_count=1, step_count=1, in_offset=4094,
                 in_len=4, out_offset=0, out_len=4)
    h.send(0, P.Group(ops=(d,), payload=b"abcd"))
    assert "outside the 4096-byte input region" in h.closed[0]


# --------------------------------------------------------------------------- records


def test_records_cover_clients_comms_and_multi_step_calls():
    rec = ListRecorder()
    h = Harness(recorder=rec)
    handles = world(h, 2)
    assert len(rec.clients) == 2 and rec.comms[0].global_ranks == (0, 1)
    # One call of count 4 cut into two steps of 2.
    rids = []
    for r in range(2):
        ops = (op(handles[r], P.KIND_ALLREDUCE, 7, 2, 2, rank=r, total=4, flags=P.OP_FLAG_FIRST_STEP,
                  step=0, steps=2),
               op(handles[r], P.KIND_ALLREDUCE, 7, 2, 2, rank=r, total=4, in_off=8, out_off=8,
                  flags=P.OP_FLAG_LAST_STEP, step=1, steps=2))
        rids.append(h.send(r, P.Group(ops=ops)))
    assert [h.reply(r, rids[r]).results for r in range(2)] == [(0, 0), (0, 0)]
    assert len(rec.ops) == 1
    rec_op = rec.ops[0]
    assert rec_op.kind == "AllReduce" and rec_op.count == 4 and rec_op.logical_bytes == 16
    assert rec_op.redop == "sum" and rec_op.ranks == (0, 1) and rec_op.status == "ok"
    r0 = h.send(0, P.Group(ops=(p2p(handles[0], P.KIND_SEND, 1, 3),)))
    r1 = h.send(1, P.Group(ops=(p2p(handles[1], P.KIND_RECV, 0, 3),)))
    assert rec.ops[-1].kind == "SendRecv" and rec.ops[-1].ranks == (0, 1) and rec.ops[-1].logical_bytes == 12
    h.disconnect(1)
    assert rec.gone and rec.gone[0][1] == "test"


def test_simulate_without_cost_model_is_a_clear_error(h):
    handles = world(h, 2)
    rid = h.send(0, P.Simulate(ops=(op(handles[0], P.KIND_ALLREDUCE, 7, 4, 2),)))
    err = h.reply(0, rid)
    assert isinstance(err, P.Error) and "cost model" in err.message


def test_simulate_calls_cost_model():
    seen = []

    def cost(kind, count, size, granks, root, peer, topo):
        seen.append((kind, count, size, granks, root, peer))
        return 2e-6

    h = Harness(cost_fn=cost)
    handles = world(h, 2)
    rid = h.send(1, P.Simulate(ops=(op(handles[1], P.KIND_ALLREDUCE, 7, 4, 2, rank=1),
                                    p2p(handles[1], P.KIND_SEND, 0, 8))))
    assert h.reply(1, rid).estimated_time_us == pytest.approx(4.0)
    assert seen == [("AllReduce", 4, 4, (0, 1), -1, -1), ("SendRecv", 8, 4, (0, 1), 1, 0)]


def _accounted(desc):
    """An OpDesc as the proxy shim sends it in ACCOUNT: nothing staged."""
    import dataclasses
    return dataclasses.replace(desc, in_offset=0, in_len=0, out_offset=0, out_len=0)


def test_account_matches_and_records_without_moving_data():
    rec = ListRecorder()
    h = Harness(recorder=rec)
    socket = lambda hello, S: (np.zeros(2 * S, dtype=np.uint8), False)  # noqa: E731
    for c in range(2):
        assert isinstance(h.hello(c, rank=c, factory=socket), P.HelloOk)
    handles = [i.comm_handle for i in h.init([0, 1])]
    h.staging(1)[1][:16] = 7  # an accounted op must not write the output region
    rids = [h.send(r, P.Account(ops=(_accounted(op(handles[r], P.KIND_ALLREDUCE, 7, 1 << 30, 2, rank=r)),
                                     _accounted(p2p(handles[r], P.KIND_SEND, 1 - r, 3)),
                                     _accounted(p2p(handles[r], P.KIND_RECV, 1 - r, 3)))))
            for r in range(2)]
    for r in range(2):
        done = h.reply(r, rids[r])
        assert isinstance(done, P.GroupDone) and done.results == (0, 0, 0) and done.payload == b""
    assert h.staging(1)[1][:16].tolist() == [7] * 16
    kinds = [(o.kind, o.count, o.socket_bytes, o.status) for o in rec.ops]
    assert kinds[0] == ("AllReduce", 1 << 30, 0, "ok")  # larger than the staging regions: not staged
    assert sorted(kinds[1:]) == [("SendRecv", 3, 0, "ok")] * 2
    # A disagreement fails every member with the same message, as for GROUP.
    rids = [h.send(r, P.Account(ops=(_accounted(op(handles[r], P.KIND_ALLREDUCE, 7, 12 if r == 0 else 8, 2,
                                                  rank=r)),)))
            for r in range(2)]
    for r in range(2):
        done = h.reply(r, rids[r])
        assert done.results == (P.NCCL_INVALID_USAGE,)
        assert "count=12" in done.message and "count=8" in done.message
    assert rec.ops[-1].status == "mismatch"


def test_account_and_group_do_not_mix(h):
    handles = world(h, 2)
    r0 = h.send(0, P.Account(ops=(_accounted(op(handles[0], P.KIND_ALLREDUCE, 7, 4, 2, rank=0)),)))
    r1 = h.send(1, P.Group(ops=(op(handles[1], P.KIND_ALLREDUCE, 7, 4, 2, rank=1),)))
    for r, rid in ((0, r0), (1, r1)):
        done = h.reply(r, rid)
        assert done.results == (P.NCCL_INVALID_USAGE,) and "FAKEGPU_DIST_MODE" in done.message


# --------------------------------------------------------------------------- keeping the I/O layer responsive


def test_offloaded_collective_is_answered_before_later_ones_of_its_communicator(h):
    """With an offload hook (the server's worker thread), a collective touching 4 MiB or more
    is handed out and answered only after ``executed``; a small collective of the same
    communicator that becomes ready meanwhile waits behind it, so answers keep their order."""
    jobs = []
    h.core.offload = jobs.append
    for c in (2, 3):
        assert isinstance(h.hello(c, rank=c - 2, staging=8 << 20), P.HelloOk)
    handles = [i.comm_handle for i in h.init([2, 3])]
    count = 1 << 20   # 4 MiB in and out per rank
    at = 4 << 20      # the small call's input and output, after the big one's
    big = []
    for c, hd in zip((2, 3), handles):
        inp, _ = h.staging(c)
        inp[:4 * count].view(np.float32)[:] = c
        big.append(h.send(c, P.Group(ops=(op(hd, P.KIND_ALLREDUCE, 7, count, 2, rank=c - 2),))))
    assert len(jobs) == 1 and h.take(2) == [] and h.take(3) == []
    small = []
    for c, hd in zip((2, 3), handles):
        inp, _ = h.staging(c)
        inp[at:at + 4].view(np.float32)[:] = 10 * c
        small.append(h.send(c, P.Group(ops=(op(hd, P.KIND_ALLREDUCE, 7, 1, 2, rank=c - 2, in_off=at,
                                               out_off=at, seq=2),))))
    assert h.take(2) == [] and h.take(3) == [], "the small call must wait behind the offloaded one"
    job = jobs.pop()
    job.run()                      # what the worker thread does
    h._apply(h.core.executed(job))
    for c, (rb, rs) in zip((2, 3), zip(big, small)):
        replies = h.take(c)
        assert [r for r, _ in replies] == [rb, rs]
        assert all(m.results == (0,) for _, m in replies)
        _, outp = h.staging(c)
        assert np.all(outp[:4 * count].view(np.float32) == 5)
        assert outp[at:at + 4].view(np.float32)[0] == 50
    assert h.core._executing == {} and jobs == []


def test_large_group_is_submitted_in_slices(h):
    """group_slice_ops: a GROUP of more ops goes in one slice per resume(); the answer is the
    same as all at once."""
    h.core.group_slice_ops = 100
    assert isinstance(h.hello(0, rank=0, factory=C.default_staging_factory), P.HelloOk)
    (info,) = h.init([0])
    n = 1000
    values = np.arange(n, dtype=np.float32)
    ops = tuple(op(info.comm_handle, P.KIND_ALLREDUCE, 7, 1, 1, in_off=4 * i, out_off=4 * i, seq=i + 1)
                for i in range(n))
    rid = h.send(0, P.Group(ops=ops, payload=values.tobytes()), factory=C.default_staging_factory)
    slices = 0
    while h.core.submitting(0):
        assert h.reply(0, rid) is None
        h._apply(h.core.resume(0))
        slices += 1
    assert slices == 9
    done = h.reply(0, rid)
    assert done.results == (0,) * n
    assert np.array_equal(np.frombuffer(done.payload, np.float32), values)
# --------------------------------------------------------------------------- identities


def test_a_rank_is_held_by_one_process_until_it_disconnects(h):
    assert isinstance(h.hello(0, rank=0), P.HelloOk)
    err = h.hello(1, rank=0)
    assert isinstance(err, P.Error) and err.result == P.NCCL_INVALID_USAGE
    assert "RANK 0 is already held by pid 1000 on host0" in err.message and 1 in h.closed
    assert 1 not in h.core.clients
    h.disconnect(0)
    assert isinstance(h.hello(2, rank=0), P.HelloOk)       # free again once its process left


def test_rank_must_be_below_world_size(h):
    err = h.hello(0, rank=2, world_size=2)
    assert isinstance(err, P.Error) and "RANK 2 is not below WORLD_SIZE 2" in err.message
    assert isinstance(h.hello(1, rank=1, world_size=2), P.HelloOk)
    assert isinstance(h.hello(2, rank=5), P.HelloOk)       # no WORLD_SIZE, no config: taken as given


def _topology(n):
    from fakegpu.topology import default_topology
    import dataclasses
    return dataclasses.replace(default_topology(n), source="/cfg/two.yaml", is_default=False)


def test_ranks_the_cluster_config_does_not_place_are_refused():
    h = Harness(topology=_topology(2))
    err = h.hello(0, rank=2)
    assert "RANK 2 is not placed by cluster config /cfg/two.yaml (ranks 0-1)" in err.message
    err = h.hello(1, rank=0, world_size=3)
    assert "WORLD_SIZE 3 is more than the 2 ranks cluster config /cfg/two.yaml (ranks 0-1) places" in err.message
    # Without RANK the global ranks come from the first communicator: checked when it forms.
    for c in range(2, 5):
        assert isinstance(h.hello(c), P.HelloOk)
    infos = h.init([2, 3, 4])
    for e in infos:
        assert isinstance(e, P.Error) and e.result == P.NCCL_INVALID_USAGE
        assert "global ranks 2 are not placed by cluster config /cfg/two.yaml (ranks 0-1)" in e.message
    assert all(h.core.clients[c].global_ranks is None for c in (2, 3, 4)) and not h.core.comms


def test_global_ranks_of_two_processes_must_not_collide(h):
    assert isinstance(h.hello(0, rank=1), P.HelloOk)
    assert isinstance(h.hello(1), P.HelloOk)             # no RANK: would take rank 1 of this communicator
    infos = h.init([0, 1])
    for e in infos:
        assert isinstance(e, P.Error) and "would both be global rank 1" in e.message, e
        assert "set RANK" in e.message


def test_init_timeout_is_an_event_naming_who_never_arrived():
    rec = ListRecorder()
    events = []
    rec.fault_event = events.append
    h = Harness(recorder=rec)
    for c in range(3):
        h.hello(c, rank=c)
    uid = b"m" * 128
    h.send(0, P.CommInit(uid, 3, 0, "pg"))
    h.send(2, P.CommInit(uid, 3, 2, "pg"))
    h.tick(5.1)
    (event,) = [e for e in events if e["event"] == "init_timeout"]
    assert event["name"] == "pg" and event["nranks"] == 3 and event["missing_ranks"] == [1]
    assert event["arrived_ranks"] == [0, 2] and event["arrived_global_ranks"] == [0, 2]
    assert event["timeout_ms"] == 5000 and "ranks [1] did not arrive" in event["message"]


# --------------------------------------------------------------------------- failed calls, counted once


def test_survivors_failed_calls_are_one_record_and_one_event_each():
    rec = ListRecorder()
    events = []
    rec.fault_event = events.append
    h = Harness(recorder=rec)
    handles = world(h, 3)
    h.disconnect(2, "crashed")
    for seq in (1, 2):        # two calls of two steps each, by both survivors
        for r in (0, 1):
            ops = tuple(op(handles[r], P.KIND_ALLREDUCE, 7, 2, 3, rank=r, total=4, seq=seq, step=k, steps=2,
                           in_off=8 * k, out_off=8 * k,
                           flags=P.OP_FLAG_FIRST_STEP if k == 0 else P.OP_FLAG_LAST_STEP) for k in range(2))
            rid = h.send(r, P.Group(ops=ops))
            assert h.reply(r, rid).results == (P.NCCL_REMOTE_ERROR, P.NCCL_REMOTE_ERROR)
    failed = [o for o in rec.ops if o.status != "ok"]
    assert [o.seq for o in failed] == [0, 1] and all(o.status == "peer_failed" for o in failed)
    assert [e["seq"] for e in events if e["event"] == "op_failed"] == [1, 2]


def test_a_parked_send_that_fails_later_fails_its_groups_final_frame(h):
    """A Send parked from a partial frame is answered early; when the peer's Recv then
    disagrees, the sender's group must fail too: its final frame (same group id) carries it."""
    handles = world(h, 2)
    gid = 7 << P.GROUP_ID_SHIFT
    first = h.send(0, P.Group(ops=(p2p(handles[0], P.KIND_SEND, 1, 4, step=0, steps=2, seq=1),),
                              flags=P.GROUP_FLAG_PARTIAL | gid))
    assert h.reply(0, first).results == (0,)          # parked and answered
    final = h.send(0, P.Group(ops=(p2p(handles[0], P.KIND_SEND, 1, 4, in_off=64, step=1, steps=2, seq=1),),
                              flags=gid))
    assert h.reply(0, final) is None                   # waits for the parked Send's fate
    recv = h.send(1, P.Group(ops=(p2p(handles[1], P.KIND_RECV, 0, 3, seq=1),)))
    assert h.reply(1, recv).results == (P.NCCL_INVALID_USAGE,)
    done = h.reply(0, final)
    assert done.results == (P.NCCL_INVALID_USAGE,) and "disagree" in done.message
    # The next pair of calls is unaffected.
    h.staging(0)[0][:8] = np.frombuffer(np.array([1.5, 2.5], np.float32).tobytes(), np.uint8)
    r0 = h.send(0, P.Group(ops=(p2p(handles[0], P.KIND_SEND, 1, 2, seq=2),)))
    r1 = h.send(1, P.Group(ops=(p2p(handles[1], P.KIND_RECV, 0, 2, seq=2),)))
    assert h.reply(0, r0).results == (0,) and h.reply(1, r1).results == (0,)
    assert h.staging(1)[1][:8].view(np.float32).tolist() == [1.5, 2.5]


def test_a_parked_send_that_matches_lets_the_final_frame_succeed(h):
    handles = world(h, 2)
    gid = 9 << P.GROUP_ID_SHIFT
    h.staging(0)[0][:16] = np.frombuffer(np.arange(4, dtype=np.float32).tobytes(), np.uint8)
    first = h.send(0, P.Group(ops=(p2p(handles[0], P.KIND_SEND, 1, 4),), flags=P.GROUP_FLAG_PARTIAL | gid))
    assert h.reply(0, first).results == (0,)
    final = h.send(0, P.Group(ops=(p2p(handles[0], P.KIND_RECV, 1, 1, seq=1),), flags=gid))
    recv = h.send(1, P.Group(ops=(p2p(handles[1], P.KIND_RECV, 0, 4),)))
    assert h.reply(1, recv).results == (0,)
    assert h.staging(1)[1][:16].view(np.float32).tolist() == [0.0, 1.0, 2.0, 3.0]
    assert h.reply(0, final) is None                   # its own Recv still waits
    h.staging(1)[0][:4] = np.frombuffer(np.array([9.0], np.float32).tobytes(), np.uint8)
    send = h.send(1, P.Group(ops=(p2p(handles[1], P.KIND_SEND, 0, 1, seq=1),)))
    assert h.reply(1, send).results == (0,) and h.reply(0, final).results == (0,)


def test_rejected_placeholders_posted_outside_a_group_are_never_answered(h):
    handles = world(h, 2)
    bad = P.OpDesc(comm_handle=handles[0], kind=P.KIND_ALLREDUCE, datatype=99, redop=42,
                   flags=6 | P.OP_FLAG_REJECTED, total_count=8, match_seq=1)
    h.send(0, P.Group(ops=(bad,), flags=P.GROUP_FLAG_UNANSWERED), rid=0)
    h.send(0, P.Group(ops=(P.OpDesc(**{**bad.__dict__, "match_seq": 2}),), flags=P.GROUP_FLAG_UNANSWERED), rid=0)
    assert not h.inbox.get(0) and not h.closed       # never answered, and two may be in flight
    r1 = h.send(1, P.Group(ops=(op(handles[1], P.KIND_ALLREDUCE, 7, 8, 2, rank=1),)))
    done = h.reply(1, r1)
    assert done.results == (P.NCCL_INVALID_USAGE,) and "rejected by the shim" in done.message
    assert not h.inbox.get(0)
    # Only rejected ops may go unanswered.
    good = op(handles[0], P.KIND_ALLREDUCE, 7, 8, 2, seq=3)
    h.send(0, P.Group(ops=(good,), flags=P.GROUP_FLAG_UNANSWERED), rid=0)
    assert "only rejected ops" in h.closed[0]
