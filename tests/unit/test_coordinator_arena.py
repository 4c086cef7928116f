"""Host-local collectives, the coordinator's side (docs/protocol.md "Host-local collectives"):
HELLO bit1 negotiation, ARENA grants and refusals, the arena file's header and flags, its
removal, and LOCAL_OPS records in the report. Sans-I/O through Core.on_frame, plus one real
coordinator process for the shutdown path."""
from __future__ import annotations

import functools
import glob
import logging
import os
import signal
import socket
import stat
import struct
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from fakegpu import protocol as P
from fakegpu.coordinator import arena as A
from fakegpu.coordinator import core as C
from fakegpu.coordinator.faults import FaultPlan, parse_fault_env

from test_coordinator_core import Harness as CoreHarness, shm_factory
from helpers.paths import REPO_ROOT as REPO

SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else None
F32 = 7


def _own_arena_files(pid=None) -> list:
    if SHM_DIR is None:
        return []
    return glob.glob(os.path.join(SHM_DIR, f"fakegpu-arena-{pid or os.getpid()}-*"))


class Recorder:
    def __init__(self):
        self.ops = []

    def client_connected(self, c):
        pass

    def client_disconnected(self, c, reason):
        pass

    def comm_created(self, comm, waits):
        pass

    def op_completed(self, op):
        self.ops.append(op)


def socket_factory(hello, S):
    return np.zeros(2 * S, dtype=np.uint8), False


class Harness(CoreHarness):
    """test_coordinator_core's harness, with local collectives on and arenas in ``arena_dir``."""

    def __init__(self, arena_dir, **kw):
        kw.setdefault("faults", FaultPlan([]))
        kw.setdefault("local_collectives", True)
        kw.setdefault("arena_factory", functools.partial(A.create_arena, directory=arena_dir))
        super().__init__(**kw)

    def send_raw(self, conn, msg_type, body, rid=0):
        self._apply(self.core.on_frame(conn, P.Frame(msg_type, rid, body), "unix", shm_factory))

    def hello(self, conn, rank=-1, flags=P.HELLO_FLAG_SHM | P.HELLO_FLAG_LOCAL, factory=shm_factory,
              staging=1 << 16):
        rid = self.send(conn, P.Hello(flags=flags, global_rank=rank, pid=1000 + conn, staging_bytes=staging,
                                      hostname="host"), factory=factory)
        return self.reply(conn, rid)

    def init(self, conns, ranks=None, uid=b"a" * 128):
        return [info.comm_handle for info in super().init(conns, uid=uid, ranks=ranks, name="w")]

    def arena(self, conn, handle):
        return self.reply(conn, self.send(conn, P.ArenaRequest(handle)))


@pytest.fixture
def arena_dir(tmp_path):
    return SHM_DIR or str(tmp_path)


@pytest.fixture
def make(arena_dir):
    """Harness factory; after the test, closing each core must leave no arena file behind."""
    made = []

    def build(**kw):
        h = Harness(arena_dir, **kw)
        made.append(h)
        return h

    yield build
    for h in made:
        h._apply(h.core.close())
        assert not h.core.arenas
    left = glob.glob(os.path.join(arena_dir, f"fakegpu-arena-{os.getpid()}-*"))
    assert not left, f"arena files left behind: {left}"


def world(h, n, **hello_kw):
    for c in range(n):
        assert isinstance(h.hello(c, rank=10 + c, **hello_kw), P.HelloOk)
    return h.init(list(range(n)))


def read_header(path):
    with open(path, "rb") as f:
        return A.HEADER.unpack(f.read(A.HEADER.size))


# --------------------------------------------------------------------------- HELLO bit1


def test_hello_ok_sets_bit1_only_when_offered_and_shared_memory(make):
    h = make()
    both = P.HELLO_FLAG_SHM | P.HELLO_FLAG_LOCAL
    assert h.hello(1, flags=both).flags == both
    assert h.hello(2, flags=P.HELLO_FLAG_SHM).flags == P.HELLO_FLAG_SHM          # an old client
    assert h.hello(3, flags=both, factory=socket_factory).flags == 0            # no bit1 without bit0


def test_switched_off_on_the_coordinator(make, monkeypatch):
    both = P.HELLO_FLAG_SHM | P.HELLO_FLAG_LOCAL
    assert make(local_collectives=False).hello(1, flags=both).flags == P.HELLO_FLAG_SHM
    monkeypatch.setenv("FAKEGPU_LOCAL_COLLECTIVES", "0")
    assert make(local_collectives=None).hello(1, flags=both).flags == P.HELLO_FLAG_SHM
    monkeypatch.setenv("FAKEGPU_LOCAL_COLLECTIVES", "1")
    assert make(local_collectives=None).hello(1, flags=both).flags == both
    monkeypatch.delenv("FAKEGPU_LOCAL_COLLECTIVES")
    assert make(local_collectives=None).hello(1, flags=both).flags == both


# --------------------------------------------------------------------------- ARENA grant


def test_grant_is_one_file_with_the_documented_header(make):
    h = make()
    handles = world(h, 3)
    infos = [h.arena(c, handles[c]) for c in (2, 0, 1)]
    assert all(isinstance(i, P.ArenaInfo) and i.granted == 1 and i.reason == "" for i in infos)
    assert [i.rank for i in infos] == [2, 0, 1]
    assert len({(i.path, i.slot_bytes, i.total_bytes) for i in infos}) == 1
    info = infos[0]
    # Staging is 64 KiB here, so the slot is capped by it; D = align4096(4096 + 3 * 256).
    assert info.slot_bytes == 1 << 16
    assert info.total_bytes == 8192 + 2 * 4 * (1 << 16) == A.total_bytes(3, info.slot_bytes)
    assert os.path.basename(info.path).startswith(f"fakegpu-arena-{os.getpid()}-")
    st = os.stat(info.path)
    assert st.st_size == info.total_bytes and stat.S_IMODE(st.st_mode) == 0o600
    assert read_header(info.path) == (0x52414746, A.LAYOUT_VERSION, 3, 0, 1 << 16, 0, 0)
    with open(info.path, "rb") as f:
        data = f.read()
    assert data[:4] == b"FGAR" and data[A.HEADER.size:] == bytes(info.total_bytes - A.HEADER.size)


def test_slot_size_rules():
    assert A.slot_bytes_for(4, 32 << 20) == 1 << 20                       # min(1 MiB, 256 MiB / 10)
    assert A.slot_bytes_for(127, 32 << 20) == 1 << 20                     # 256 MiB / 256: still 1 MiB
    assert A.slot_bytes_for(200, 32 << 20) == ((256 << 20) // 402) // 4096 * 4096   # the budget binds
    assert A.slot_bytes_for(4, 10000) == 8192                              # staging caps it, page multiple
    assert A.slot_bytes_for(4, 4096) == 4096
    assert A.slot_bytes_for(4, 32 << 20, override=12345) == 12288
    assert A.slot_bytes_for(4, 8192, override=1 << 20) == 8192             # never above staging
    assert A.data_offset(1) == 8192 and A.data_offset(15) == 8192 and A.data_offset(16) == 8192 and A.data_offset(17) == 12288


def test_slot_override_from_parameter_and_environment(make, monkeypatch):
    h = make(local_slot_bytes=8192)
    handles = world(h, 2)
    assert h.arena(0, handles[0]).slot_bytes == 8192
    monkeypatch.setenv("FAKEGPU_LOCAL_SLOT_BYTES", "16KiB")
    h = make(local_slot_bytes=None)
    handles = world(h, 2)
    assert h.arena(1, handles[1]).slot_bytes == 16384
    monkeypatch.setenv("FAKEGPU_LOCAL_SLOT_BYTES", "100")
    with pytest.raises(ValueError, match="below the minimum"):
        make(local_slot_bytes=None)


def test_unknown_handle_is_invalid_argument(make):
    h = make()
    world(h, 2)
    err = h.arena(0, 0xDEAD)
    assert isinstance(err, P.Error) and err.result == P.NCCL_INVALID_ARGUMENT and "0xdead" in err.message


# --------------------------------------------------------------------------- refusals


def _refusal(h, handles, conns):
    infos = [h.arena(c, handles[i]) for i, c in enumerate(conns)]
    assert all(i.granted == 0 and i.path == "" and i.slot_bytes == 0 for i in infos)
    assert len({i.reason for i in infos}) == 1, "every member must get the same answer"
    assert not h.core.arenas
    return infos[0].reason


def test_refused_when_a_member_did_not_offer_bit1(make):
    h = make()
    h.hello(0, rank=0)
    h.hello(1, rank=1, flags=P.HELLO_FLAG_SHM)
    assert "rank 1" in _refusal(h, h.init([0, 1]), [0, 1]) and "did not offer" in h.core.comms[1].arena_refusal


def test_refused_without_shared_memory(make):
    h = make()
    h.hello(0, rank=0)
    h.hello(1, rank=1, factory=socket_factory)
    assert "no shared-memory staging" in _refusal(h, h.init([0, 1]), [0, 1])


def test_refused_with_two_ranks_in_one_process(make):
    h = make()
    h.hello(0)
    h.hello(1)
    rids = [h.send(c, P.CommInit(b"b" * 128, 3, r, "")) for c, r in ((0, 0), (0, 1), (1, 2))]
    handles = [h.reply(c, rid).comm_handle for c, rid in zip((0, 0, 1), rids)]
    assert "one rank per process" in _refusal(h, handles, [0, 0, 1])


def test_refused_for_one_rank(make):
    h = make()
    handles = world(h, 1)
    assert "at least 2" in _refusal(h, handles, [0])


def test_refused_with_a_fault_plan(make):
    h = make(faults=FaultPlan(parse_fault_env("delay:rank=1:seq=9:ms=5")))
    assert "fault plan" in _refusal(h, world(h, 2), [0, 1])


def test_refused_when_switched_off(make):
    h = make(local_collectives=False)
    assert "FAKEGPU_LOCAL_COLLECTIVES=0" in _refusal(h, world(h, 2), [0, 1])


def test_refused_once_a_member_is_gone_and_stays_refused(make):
    h = make()
    handles = world(h, 3)
    h.disconnect(2)
    assert "rank 2" in _refusal(h, handles[:2], [0, 1])


def test_refused_when_the_file_cannot_be_created(make, caplog):
    def broken(comm_id, nranks, slot):
        raise OSError(28, "No space left on device")

    h = make(arena_factory=broken)
    handles = world(h, 3)
    with caplog.at_level(logging.INFO, logger="fakegpu.coordinator"):
        reason = _refusal(h, handles, [0, 1, 2])
        for conn in range(3):                       # asked again: the same answer, no new line
            assert h.arena(conn, handles[conn]).granted == 0
    assert "No space left on device" in reason and "go through the coordinator" in reason
    lines = [r.getMessage() for r in caplog.records if "arena" in r.getMessage()]
    assert len(lines) == 1 and "No space left on device" in lines[0], lines


def test_arena_file_is_allocated_not_sparse(make):
    # A sparse file on a /dev/shm too small for it kills the ranks with SIGBUS mid-call; every
    # page is allocated when the arena is created.
    h = make()
    _, path = _granted(h)
    st = os.stat(path)
    assert st.st_blocks * 512 >= st.st_size > 0


def test_create_arena_leaves_nothing_behind_when_allocation_fails(tmp_path, monkeypatch):
    def no_space(fd, offset, length):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(A.os, "posix_fallocate", no_space)
    with pytest.raises(OSError):
        A.create_arena(1, 2, 4096, directory=str(tmp_path))
    assert list(tmp_path.iterdir()) == []


# --------------------------------------------------------------------------- flags and removal


def _granted(h, n=3):
    handles = world(h, n)
    info = h.arena(0, handles[0])
    assert info.granted == 1
    return handles, info.path


def _group(handle, kind=P.KIND_ALLREDUCE, count=1, rank=0, n=3, seq=1):
    size = 4
    in_len = count * size
    out_len = count * size * (n if kind == P.KIND_ALLGATHER else 1)
    return P.Group(ops=(P.OpDesc(comm_handle=handle, kind=kind, datatype=F32, total_count=count, step_count=count,
                                 in_len=in_len, out_len=out_len, match_seq=seq),))


def test_pending_counts_collectives_waiting_at_the_coordinator(make):
    h = make()
    handles, path = _granted(h)
    rid = h.send(0, _group(handles[0]))
    # Written before any answer: members waiting in the arena withdraw and come here.
    assert read_header(path)[5] == 1 and h.core.comms[1].arena.pending == 1
    assert h.reply(0, rid) is None        # the collective still waits for its peers
    rid1 = h.send(1, _group(handles[1]))
    assert read_header(path)[5] == 1
    rid2 = h.send(2, _group(handles[2]))
    assert read_header(path)[5] == 0      # matched: the arena may be used again
    assert all(isinstance(h.reply(c, r), P.GroupDone) for c, r in zip((0, 1, 2), [rid, rid1, rid2]))
    assert h.arena(1, handles[1]).granted == 1


def test_pending_drops_when_the_waiting_collective_times_out(make):
    h = make()
    handles, path = _granted(h)
    h.send(0, _group(handles[0]))
    assert read_header(path)[5] == 1
    h.tick(h.core.timeout_s + 1)
    assert read_header(path)[5] == 0


def test_arena_created_while_a_collective_waits_starts_with_pending(make):
    h = make()
    handles = world(h, 3)
    h.send(0, _group(handles[0]))
    info = h.arena(1, handles[1])
    assert info.granted == 1 and read_header(info.path)[5] == 1


def test_sendrecv_is_not_pending(make):
    h = make()
    handles, path = _granted(h)
    send = P.OpDesc(comm_handle=handles[0], kind=P.KIND_SEND, datatype=F32, root=1, total_count=1, step_count=1,
                    in_len=4)
    h.send(0, P.Group(ops=(send,)))
    assert read_header(path)[5] == 0


def test_failed_names_the_first_member_to_leave(make):
    h = make()
    handles, path = _granted(h)
    h.disconnect(1)
    assert read_header(path)[3] == 2
    h.send(2, P.CommFree(handles[2], P.FREE_ABORT))
    assert read_header(path)[3] == 2
    assert os.path.exists(path)
    h.disconnect(0)
    assert not os.path.exists(path) and not h.core.arenas


def test_unlinked_when_every_member_destroyed_it(make):
    h = make()
    handles, path = _granted(h, n=2)
    h.send(0, P.CommFree(handles[0], P.FREE_DESTROY))
    assert read_header(path)[3] == 1 and os.path.exists(path)
    h.send(1, P.CommFree(handles[1], P.FREE_FINALIZE))
    assert not os.path.exists(path)


def test_close_unlinks_every_arena(make):
    h = make()
    _, path1 = _granted(h, n=2)
    for c in (2, 3):
        h.hello(c)
    handles = h.init([2, 3], uid=b"z" * 128)
    path2 = h.arena(2, handles[0]).path
    assert os.path.exists(path1) and os.path.exists(path2) and path1 != path2
    h._apply(h.core.close())
    assert not os.path.exists(path1) and not os.path.exists(path2)


# --------------------------------------------------------------------------- LOCAL_OPS


def _record(handle, kind, count, waits, root=-1, redop=P.REDOP_SUM, started=1.7e9 + 1, rendezvous=2e-5,
            execution=1e-5, n=3, datatype=F32, seq=1):
    size = 4 if datatype == F32 else 8
    in_len = count * size * (n if kind == P.KIND_REDUCESCATTER else 1)
    out_len = count * size * (n if kind == P.KIND_ALLGATHER else 1)
    return P.LocalOpRecord(P.OpDesc(comm_handle=handle, kind=kind, datatype=datatype, redop=redop, root=root,
                                    total_count=count, step_count=count, in_len=in_len, out_len=out_len,
                                    match_seq=seq),
                           started, rendezvous, execution, tuple(waits))


def test_local_ops_are_recorded_like_matched_collectives(make):
    rec = Recorder()
    h = make(recorder=rec)
    handles, _ = _granted(h)              # comm ranks 0..2 are global ranks 10..12
    h.send(0, P.LocalOps(handles[0], 3, (
        _record(handles[0], P.KIND_ALLREDUCE, 4, (2e-5, 0.0, 1e-5)),
        _record(handles[0], P.KIND_ALLGATHER, 3, (0.0, 5e-6, 1e-6), started=1.7e9 + 2, rendezvous=5e-6, seq=2),
        _record(handles[0], P.KIND_BROADCAST, 2, (0.0, 0.0, 0.0), root=2, datatype=8, seq=3),
    )), rid=0)
    assert not h.inbox.get(0) and not h.closed          # never answered
    assert [(o.kind, o.count, o.logical_bytes, o.seq) for o in rec.ops] == [
        ("AllReduce", 4, 16, 0), ("AllGather", 3, 36, 1), ("Broadcast", 2, 16, 2)]
    first = rec.ops[0]
    assert first.status == "ok" and first.socket_bytes == 0 and first.ranks == (0, 1, 2)
    assert first.comm.global_ranks == (10, 11, 12) and first.datatype == "float32" and first.redop == "sum"
    assert first.arrival_wait_s == {10: 2e-5, 11: 0.0, 12: 1e-5}
    assert (first.started_at, first.rendezvous_s, first.execution_s) == (1.7e9 + 1, 2e-5, 1e-5)
    assert rec.ops[1].redop is None and rec.ops[2].root == 2 and rec.ops[2].elem_size == 8
    assert h.core.n_ops == 3
    # A collective through the coordinator afterwards continues the communicator's seq.
    rids = [h.send(c, _group(handles[c], seq=4)) for c in range(3)]
    assert all(isinstance(h.reply(c, r), P.GroupDone) for c, r in zip(range(3), rids))
    assert rec.ops[-1].seq == 3 and rec.ops[-1].kind == "AllReduce"


def test_local_ops_seq_follows_earlier_coordinator_collectives(make):
    rec = Recorder()
    h = make(recorder=rec)
    handles = world(h, 2)
    rids = [h.send(c, _group(handles[c], n=2)) for c in range(2)]
    assert all(isinstance(h.reply(c, r), P.GroupDone) for c, r in zip(range(2), rids))
    assert h.arena(0, handles[0]).granted == 1
    h.send(0, P.LocalOps(handles[0], 2, (_record(handles[0], P.KIND_REDUCE, 1, (0, 0), root=1, n=2, seq=2),)))
    assert [(o.kind, o.seq) for o in rec.ops] == [("AllReduce", 0), ("Reduce", 1)]


def _malformed_cases(handles):
    good = _record(handles[0], P.KIND_ALLREDUCE, 1, (0, 0, 0))
    body = P.encode_body(P.LocalOps(handles[0], 3, (good,)))
    nan = P.encode_body(P.LocalOps(handles[0], 3, (_record(handles[0], P.KIND_ALLREDUCE, 1, (0, float("nan"), 0)),)))
    return {
        "not rank 0": (1, P.encode_body(P.LocalOps(handles[1], 3, (good,)))),
        "wrong nranks": (0, P.encode_body(P.LocalOps(handles[0], 2, (_record(handles[0], P.KIND_ALLREDUCE, 1,
                                                                              (0, 0)),)))),
        "send kind": (0, P.encode_body(P.LocalOps(handles[0], 3, (_record(handles[0], P.KIND_SEND, 1, (0, 0, 0),
                                                                           root=1),)))),
        "alltoall kind": (0, P.encode_body(P.LocalOps(handles[0], 3, (_record(handles[0], P.KIND_ALLTOALL, 1,
                                                                               (0, 0, 0)),)))),
        "truncated": (0, body[:-1]),
        "trailing bytes": (0, body + b"\0"),
        "huge count": (0, struct.pack("<QII", handles[0], 0xFFFFFFFF, 3) + body[16:]),
        "nan wait": (0, nan),
        "negative time": (0, P.encode_body(P.LocalOps(handles[0], 3, (_record(handles[0], P.KIND_ALLREDUCE, 1,
                                                                               (0, 0, 0), execution=-1.0),)))),
        "bad root": (0, P.encode_body(P.LocalOps(handles[0], 3, (_record(handles[0], P.KIND_REDUCE, 1, (0, 0, 0),
                                                                          root=3),)))),
        "bad datatype": (0, P.encode_body(P.LocalOps(handles[0], 3, (_record(handles[0], P.KIND_ALLREDUCE, 1,
                                                                              (0, 0, 0), datatype=99),)))),
        "foreign handle": (0, P.encode_body(P.LocalOps(handles[1], 3, (good,)))),
        "desc of another handle": (0, P.encode_body(P.LocalOps(handles[0], 3, (_record(handles[1], P.KIND_ALLREDUCE,
                                                                                        1, (0, 0, 0)),)))),
    }


MALFORMED = list(_malformed_cases([1, 2, 3]))


@pytest.mark.parametrize("case", MALFORMED)
def test_malformed_local_ops_closes_the_connection(make, case):
    rec = Recorder()
    h = make(recorder=rec)
    handles, _ = _granted(h)
    conn, body = _malformed_cases(handles)[case]
    h.send_raw(conn, P.LOCAL_OPS, body)
    assert conn in h.closed and "protocol error" in h.closed[conn] and "LOCAL_OPS" in h.closed[conn]
    assert not rec.ops


def test_local_ops_without_an_arena_closes_the_connection(make):
    h = make()
    handles = world(h, 2)
    h.send(0, P.LocalOps(handles[0], 2, (_record(handles[0], P.KIND_ALLREDUCE, 1, (0, 0), n=2),)))
    assert "has no arena" in h.closed[0]


def test_local_ops_after_freeing_the_comm_is_dropped_quietly(make):
    h = make()
    handles, _ = _granted(h, n=2)
    h.send(0, P.CommFree(handles[0], P.FREE_DESTROY))
    h.send(0, P.LocalOps(handles[0], 2, (_record(handles[0], P.KIND_ALLREDUCE, 1, (0, 0), n=2),)))
    assert 0 not in h.closed


# --------------------------------------------------------------------------- the real process


def _frame_roundtrip(sock, msg, rid):
    sock.sendall(P.encode_frame(msg, rid))
    parser = P.FrameParser(1 << 30)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        data = sock.recv(65536)
        assert data, "coordinator closed the connection"
        frames = parser.feed(data)
        if frames:
            return P.decode_body(frames[0].msg_type, frames[0].body)
    raise AssertionError("no answer within 20 s")


@pytest.mark.skipif(SHM_DIR is None, reason="needs /dev/shm")
def test_coordinator_process_removes_arenas_at_shutdown(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("FAKEGPU_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    sock_path = str(tmp_path / "c.sock")
    proc = subprocess.Popen([sys.executable, "-m", "fakegpu", "coordinator", "--address", sock_path,
                             "--local-slot-bytes", "8KiB"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env, cwd=str(REPO))
    segments, socks = [], []
    try:
        line = proc.stdout.readline()
        assert line.startswith("fakegpu coordinator listening on "), proc.stderr.read()
        S = 1 << 16
        for r in range(2):
            name = f"fakegpu-test-{os.getpid()}-{r}"
            with open(os.path.join(SHM_DIR, name), "wb") as f:
                f.truncate(2 * S)
            segments.append(os.path.join(SHM_DIR, name))
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(20)
            s.connect(sock_path)
            socks.append(s)
            ok = _frame_roundtrip(s, P.Hello(flags=3, global_rank=r, pid=os.getpid(), staging_bytes=S,
                                             shm_name="/" + name, hostname="h"), 1)
            assert ok.flags == 3, ok
        results = [None, None]

        def init(r):
            results[r] = _frame_roundtrip(socks[r], P.CommInit(b"q" * 128, 2, r, ""), 2)

        threads = [threading.Thread(target=init, args=(r,)) for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        info = _frame_roundtrip(socks[1], P.ArenaRequest(results[1].comm_handle), 3)
        assert info.granted == 1 and info.slot_bytes == 8192 and info.rank == 1, info
        assert os.path.exists(info.path) and info.path.startswith(f"/dev/shm/fakegpu-arena-{proc.pid}-")
        proc.send_signal(signal.SIGTERM)
        proc.wait(20)
        assert not os.path.exists(info.path)
        assert not _own_arena_files(proc.pid)
    finally:
        for s in socks:
            s.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)
        for path in segments:
            os.unlink(path)


def test_close_arenas_raises_closing_in_every_arena(make):
    h = make()
    _, path = _granted(h)
    assert read_header(path)[6] == 0
    actions = h.core.close_arenas()
    assert actions == [(C.ARENA_CLOSING, h.core.comms[1].arena, None)]
    assert read_header(path)[6] == 0          # the core writes nothing itself
    h._apply(actions)
    assert read_header(path)[6] == 1


def test_close_arenas_without_arenas_says_so(make):
    assert make().core.close_arenas() == []


def test_stale_arena_files_of_dead_coordinators_are_removed(tmp_path):
    import subprocess
    import sys
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)
    dead_pid = int(dead.stdout)
    stale = tmp_path / f"fakegpu-arena-{dead_pid}-3-abcd1234"
    live = tmp_path / f"fakegpu-arena-{os.getpid()}-3-abcd1234"
    other = tmp_path / "fakegpu-12-1"
    for f in (stale, live, other):
        f.write_bytes(b"x")
    assert A.remove_stale_arenas(str(tmp_path)) == [stale.name]
    assert not stale.exists() and live.exists() and other.exists()
