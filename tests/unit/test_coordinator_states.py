"""The coordinator's named states (fakegpu/coordinator/states.py, docs/architecture.md
"Coordinator states"): each machine's legal sequences and an illegal move, on the objects
alone and as a Core drives them through frames (no sockets); and the arena flag writes, which
the Core returns as ARENA_* actions instead of writing shared memory itself."""
from __future__ import annotations

import functools
import os

import pytest

from fakegpu import protocol as P
from fakegpu.coordinator import arena as A
from fakegpu.coordinator import core as C
from fakegpu.coordinator.faults import FaultPlan
from fakegpu.coordinator.matching import GroupState, Slot, Step
from fakegpu.coordinator.registry import Client, Comm, InitRendezvous, Member, ShrinkRendezvous, SplitRendezvous
from fakegpu.coordinator.core.anysource import SourceProbe
from fakegpu.coordinator.states import (ClientState, CommState, ExecutionState, GroupFrameState, IllegalTransition,
                                        MemberState, P2PState, ProbeState, RendezvousState, SlotState)

from test_coordinator_core import Harness, op, p2p, world

F32 = 7


def _client():
    hello = P.Hello(flags=0, global_rank=-1, pid=1, staging_bytes=4096, hostname="h")
    import numpy as np
    return Client(1, hello, "unix", np.zeros(8192, np.uint8), 4096, False)


def _comm(n=2):
    comm = Comm(1, "w", None)
    c = _client()
    comm.set_members([Member(r + 1, comm, r, c, r) for r in range(n)])
    return comm


def _step(comm):
    group = GroupState(comm.members[0].client, 1, [None], False)
    return Step(group, 0, None, comm.members[0], 0.0)


# --------------------------------------------------------------------------- on the objects


@pytest.mark.parametrize("events,final", [
    (["match", "execute", "answer"], SlotState.ANSWERED),
    (["match", "answer"], SlotState.ANSWERED),            # proxy mode: matched and accounted
    (["match", "fail"], SlotState.FAILED),                # disagreement, bad arguments
    (["match", "execute", "fail"], SlotState.FAILED),     # internal error while executing
    (["fail"], SlotState.FAILED),                         # its call or a member failed
    (["expire"], SlotState.EXPIRED),
])
def test_slot_legal_sequences(events, final):
    slot = Slot(_comm(), 1, 0, 2, 0.0, 0.0, 1.0)
    assert slot.state is SlotState.WAITING
    for e in events:
        getattr(slot, e)()
    assert slot.state is final


def test_slot_cannot_expire_once_matched():
    slot = Slot(_comm(), 1, 0, 2, 0.0, 0.0, 1.0)
    slot.match()
    with pytest.raises(IllegalTransition, match="Slot cannot 'expire' in state MATCHED") as info:
        slot.expire()
    assert info.value.state is SlotState.MATCHED and slot.state is SlotState.MATCHED
    slot.answer()
    with pytest.raises(IllegalTransition, match="final state"):
        slot.fail()


@pytest.mark.parametrize("events,final", [
    (["queue", "match", "complete"], P2PState.DONE),
    (["match", "complete"], P2PState.DONE),     # its peer's step was already queued
    (["match", "fail"], P2PState.FAILED),       # the pair disagrees
    (["queue", "fail"], P2PState.FAILED),       # peer gone, or its call failed
    (["fail"], P2PState.FAILED),                # rejected alone, duplicate
    (["queue", "expire"], P2PState.EXPIRED),
])
def test_p2p_legal_sequences(events, final):
    step = _step(_comm())
    assert step.state is P2PState.ARRIVED
    for e in events:
        getattr(step, e)()
    assert step.state is final


def test_p2p_cannot_complete_unmatched():
    step = _step(_comm())
    step.queue()
    with pytest.raises(IllegalTransition, match="Step cannot 'complete' in state QUEUED"):
        step.complete()


@pytest.mark.parametrize("event,final", [("answer", ProbeState.ANSWERED), ("fail", ProbeState.FAILED),
                                         ("expire", ProbeState.EXPIRED), ("abandon", ProbeState.ABANDONED)])
def test_probe_legal_moves_and_nothing_after(event, final):
    comm = _comm()
    probe = SourceProbe(comm.members[0].client, 7, comm.members[0], (0, 0), 1000, False, 1.0)
    assert probe.state is ProbeState.WAITING
    getattr(probe, event)()
    assert probe.state is final
    with pytest.raises(IllegalTransition, match=f"SourceProbe cannot 'answer' in state {final.name}"):
        probe.answer()


@pytest.mark.parametrize("events,final", [(["decide", "answer"], GroupFrameState.ANSWERED),
                                          (["decide", "drop"], GroupFrameState.DROPPED)])
def test_group_frame_legal_sequences(events, final):
    group = GroupState(_client(), 1, [None, None], False)
    assert group.state is GroupFrameState.PENDING
    for event in events:
        getattr(group, event)()
    assert group.state is final
    with pytest.raises(IllegalTransition, match=f"GroupState cannot 'answer' in state {final.name}"):
        group.answer()


def test_group_frame_cannot_be_answered_before_every_op_has_a_result():
    with pytest.raises(IllegalTransition, match="cannot 'answer' in state PENDING"):
        GroupState(_client(), 1, [None], False).answer()


def test_comm_and_member_lifecycle():
    comm = _comm(2)
    a, b = comm.members
    assert comm.state is CommState.READY and a.state is MemberState.LIVE
    a.leave(P.NCCL_REMOTE_ERROR, "gone")
    comm.member_left(0, P.NCCL_REMOTE_ERROR, "gone")
    assert a.state is MemberState.GONE and a.gone == (P.NCCL_REMOTE_ERROR, "gone")
    assert comm.state is CommState.FAILED and comm.gone_ranks == {0: (P.NCCL_REMOTE_ERROR, "gone")}
    comm.member_left(1, P.NCCL_INVALID_USAGE, "destroyed")
    comm.free()
    assert comm.state is CommState.FREED
    with pytest.raises(IllegalTransition, match="Member cannot 'leave' in state GONE"):
        a.leave(P.NCCL_REMOTE_ERROR, "again")


def test_comm_cannot_be_freed_while_ready():
    with pytest.raises(IllegalTransition, match="Comm cannot 'free' in state READY"):
        _comm().free()


def test_client_lifecycle():
    c = _client()
    assert c.state is ClientState.OPEN and not c.closed
    c.close("injected fault a")
    c.close("injected fault b")          # frames already read may hit a second fault
    assert c.state is ClientState.CLOSING and c.close_reason == "injected fault b" and not c.closed
    c.disconnect()
    assert c.state is ClientState.CLOSED and c.closed
    with pytest.raises(IllegalTransition, match="Client cannot 'disconnect' in state CLOSED"):
        c.disconnect()
    d = _client()
    d.disconnect()
    assert d.closed


@pytest.mark.parametrize("make", [
    lambda: InitRendezvous(b"u" * 128, 2, "", 0.0, 1.0, 0.0),
    lambda: SplitRendezvous(_comm(), 0, 0.0, 1.0),
    lambda: ShrinkRendezvous(_comm(3), 0, (2,), 0.0, 1.0),
])
@pytest.mark.parametrize("events,final", [
    (["complete"], RendezvousState.COMPLETE),
    (["fail"], RendezvousState.FAILED),
    (["fail", "expire"], RendezvousState.EXPIRED),
    (["expire"], RendezvousState.EXPIRED),
])
def test_rendezvous_legal_sequences(make, events, final):
    rdv = make()
    assert rdv.state is RendezvousState.GATHERING
    for e in events:
        getattr(rdv, e)()
    assert rdv.state is final


def test_rendezvous_cannot_complete_after_it_expired():
    rdv = InitRendezvous(b"u" * 128, 2, "", 0.0, 1.0, 0.0)
    rdv.expire()
    with pytest.raises(IllegalTransition, match="InitRendezvous cannot 'complete' in state EXPIRED"):
        rdv.complete()


def test_shrink_fail_with_keeps_the_answer():
    rdv = ShrinkRendezvous(_comm(3), 0, (2,), 0.0, 1.0)
    rdv.fail_with(P.NCCL_INVALID_USAGE, "disagree")
    assert rdv.state is RendezvousState.FAILED and rdv.failed == (P.NCCL_INVALID_USAGE, "disagree")
    with pytest.raises(IllegalTransition):
        rdv.fail_with(P.NCCL_INVALID_USAGE, "twice")


# --------------------------------------------------------------------------- driven by a Core


def _allreduce(h, handles, ranks, seq=1):
    return [h.send(r, P.Group(ops=(op(handles[r], P.KIND_ALLREDUCE, F32, 2, len(handles), rank=r, seq=seq),)))
            for r in ranks]


def test_core_slot_answered_and_expired():
    h = Harness()
    handles = world(h, 2)
    comm = h.core.comms[1]
    _allreduce(h, handles, [0])
    (slot,) = comm.slots.values()
    assert slot.state is SlotState.WAITING
    _allreduce(h, handles, [1])
    assert slot.state is SlotState.ANSWERED and not comm.slots
    _allreduce(h, handles, [0], seq=2)
    (late,) = comm.slots.values()
    h.tick(h.core.timeout_s + 1)
    assert late.state is SlotState.EXPIRED


def test_core_slot_failed_on_disagreement():
    h = Harness()
    handles = world(h, 2)
    comm = h.core.comms[1]
    h.send(0, P.Group(ops=(op(handles[0], P.KIND_ALLREDUCE, F32, 2, 2),)))
    (slot,) = comm.slots.values()
    h.send(1, P.Group(ops=(op(handles[1], P.KIND_ALLREDUCE, F32, 3, 2, rank=1),)))
    assert slot.state is SlotState.FAILED


def test_core_p2p_queued_then_done_and_expired():
    h = Harness()
    handles = world(h, 2)
    comm = h.core.comms[1]
    h.send(0, P.Group(ops=(p2p(handles[0], P.KIND_SEND, 1, 2),)))
    (send,) = comm.p2p[(0, 1)].sends.values()
    assert send.state is P2PState.QUEUED
    h.send(1, P.Group(ops=(p2p(handles[1], P.KIND_RECV, 0, 2),)))
    assert send.state is P2PState.DONE
    h.send(1, P.Group(ops=(p2p(handles[1], P.KIND_RECV, 0, 2, seq=2),)))
    (recv,) = comm.p2p[(0, 1)].recvs.values()
    h.tick(h.core.timeout_s + 1)
    assert recv.state is P2PState.EXPIRED


def test_core_probe_answered_by_a_send_and_expired_without_one():
    h = Harness()
    handles = world(h, 2)
    h.send(0, P.ProbeSource(comm_handle=handles[0], timeout_ms=0, recvs_posted=(0, 0)))
    (probe,) = h.core._probes
    assert probe.state is ProbeState.WAITING
    h.send(1, P.Group(ops=(p2p(handles[1], P.KIND_SEND, 0, 2),)))
    assert probe.state is ProbeState.ANSWERED and not h.core._probes
    h.send(1, P.ProbeSource(comm_handle=handles[1], timeout_ms=0, recvs_posted=(0, 0)))
    (late,) = h.core._probes
    h.tick(h.core.timeout_s + 1)
    assert late.state is ProbeState.EXPIRED and not h.core._probes


def _instances_of(cls, monkeypatch) -> list:
    """Every ``cls`` the core makes from now on, in order."""
    made = []
    original = cls.__init__

    def record(self, *args, **kwargs):
        original(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(cls, "__init__", record)
    return made


def test_core_group_frames_pending_answered_and_dropped(monkeypatch):
    made = _instances_of(GroupState, monkeypatch)
    h = Harness()
    handles = world(h, 2)
    _allreduce(h, handles, [0])
    (first,) = made
    assert first.state is GroupFrameState.PENDING
    _allreduce(h, handles, [1])
    assert [g.state for g in made] == [GroupFrameState.ANSWERED] * 2
    _allreduce(h, handles, [0], seq=2)
    h.disconnect(0)          # rank 0 leaves with its group unanswered ...
    _allreduce(h, handles, [1], seq=2)
    assert made[2].state is GroupFrameState.DROPPED   # ... nothing is sent to a closed client
    assert made[3].state is GroupFrameState.ANSWERED  # the peer is answered (with the failure)


def test_core_execution_queue_waiting_running_done(monkeypatch):
    """With an offload hook, a big collective RUNS off the I/O thread while a later small one of
    the same communicator WAITS behind it; both end DONE, in their order."""
    import numpy as np

    from fakegpu.coordinator.core.groups import Execution

    made = _instances_of(Execution, monkeypatch)
    h = Harness()
    jobs = []
    h.core.offload = jobs.append
    for c in (0, 1):
        h.hello(c, rank=c, staging=8 << 20)
    handles = [i.comm_handle for i in h.init([0, 1])]
    count, at = 1 << 20, 4 << 20
    for c in (0, 1):
        h.staging(c)[0][:4 * count].view(np.float32)[:] = 1
        h.send(c, P.Group(ops=(op(handles[c], P.KIND_ALLREDUCE, F32, count, 2, rank=c),)))
    for c in (0, 1):
        h.send(c, P.Group(ops=(op(handles[c], P.KIND_ALLREDUCE, F32, 1, 2, rank=c, in_off=at, out_off=at, seq=2),)))
    big, small = made
    assert (big.state, small.state) == (ExecutionState.RUNNING, ExecutionState.WAITING)
    with pytest.raises(IllegalTransition, match="Execution cannot 'finish' in state WAITING"):
        small.finish()
    (job,) = jobs
    job.run()
    h._apply(h.core.executed(job))
    assert (big.state, small.state) == (ExecutionState.DONE, ExecutionState.DONE)
    assert big.slot.state is SlotState.ANSWERED and small.slot.state is SlotState.ANSWERED


def test_core_member_gone_fails_the_comm_and_its_waiting_work():
    h = Harness()
    handles = world(h, 2)
    comm = h.core.comms[1]
    _allreduce(h, handles, [0])
    (slot,) = comm.slots.values()
    h.send(0, P.Group(ops=(p2p(handles[0], P.KIND_RECV, 1, 2),)))
    (recv,) = comm.p2p[(1, 0)].recvs.values()
    client1 = h.core.clients[1]
    h.disconnect(1)
    assert client1.state is ClientState.CLOSED
    assert comm.members[1].state is MemberState.GONE and comm.members[0].state is MemberState.LIVE
    assert comm.state is CommState.FAILED
    assert slot.state is SlotState.FAILED and recv.state is P2PState.FAILED
    h.disconnect(0)
    assert comm.state is CommState.FREED and not h.core.comms


def test_core_init_rendezvous_complete_failed_expired():
    h = Harness()
    for c in range(4):
        h.hello(c, rank=c)
    h.send(0, P.CommInit(b"a" * 128, 2, 0, "a"))
    a = h.core.inits[b"a" * 128]
    h.send(1, P.CommInit(b"a" * 128, 2, 1, "a"))
    assert a.state is RendezvousState.COMPLETE
    h.send(2, P.CommInit(b"b" * 128, 2, 0, "b"))
    b = h.core.inits[b"b" * 128]
    h.disconnect(2)
    assert b.state is RendezvousState.FAILED
    h.send(3, P.CommInit(b"c" * 128, 2, 0, "c"))
    c = h.core.inits[b"c" * 128]
    h.tick(h.core.timeout_s + 1)
    assert c.state is RendezvousState.EXPIRED


def test_core_injected_kill_leaves_the_client_closing():
    from fakegpu.coordinator.faults import parse_fault_env
    from test_faults_core import allreduce
    h = Harness(faults=FaultPlan(parse_fault_env("kill:rank=1:seq=1")), own_pids=(4242,))
    handles = world(h, 2)
    allreduce(h, [1], handles[1:], 1)
    client = h.core.clients[1]
    assert client.state is ClientState.CLOSING and "injected fault" in client.close_reason
    h.disconnect(1)
    assert client.state is ClientState.CLOSED


# --------------------------------------------------------------------------- arena flags as actions


def _arena_world(arena_dir, n):
    from test_coordinator_arena import Harness as ArenaHarness, world as arena_world
    h = ArenaHarness(arena_dir)
    return h, arena_world(h, n)


def _header(arena):
    return A.HEADER.unpack_from(arena.map, 0)


def test_arena_flags_are_actions_the_core_does_not_perform(tmp_path):
    arena_dir = "/dev/shm" if os.path.isdir("/dev/shm") else str(tmp_path)
    h, handles = _arena_world(arena_dir, 3)
    info = h.reply(0, h.send(0, P.ArenaRequest(handles[0])))
    assert info.granted == 1
    comm = h.core.comms[1]
    arena = comm.arena
    assert h.arena_actions == []                     # a fresh arena: nothing waits, nothing to write
    # Driven without the harness: the core returns the write and leaves the file alone.
    frame = next(iter(P.FrameParser(1 << 40).feed(P.encode_frame(
        P.Group(ops=(op(handles[0], P.KIND_ALLREDUCE, F32, 2, 3),)), 7))))
    actions = h.core.on_frame(0, frame, "unix")
    assert (C.ARENA_PENDING, arena, 1) in actions and _header(arena)[5] == 0
    h._apply(actions)
    assert _header(arena)[5] == 1
    _allreduce(h, handles, [1])                      # still one collective waiting: no write
    assert h.arena_actions == [(C.ARENA_PENDING, arena, 1)]
    _allreduce(h, handles, [2])
    assert h.arena_actions[-1] == (C.ARENA_PENDING, arena, 0) and _header(arena)[5] == 0
    h.disconnect(1)
    assert (C.ARENA_FAILED, arena, 1) in h.arena_actions and _header(arena)[3] == 2
    h.disconnect(2)
    assert [a for a in h.arena_actions if a[0] == C.ARENA_FAILED] == [(C.ARENA_FAILED, arena, 1)]  # first wins
    assert os.path.exists(arena.path)
    h.disconnect(0)
    assert h.arena_actions[-1] == (C.ARENA_CLOSE, arena, None) and not os.path.exists(arena.path)
    assert h.core.close() == [] and h.core.close_arenas() == []


def test_core_close_returns_the_unlinks(tmp_path):
    arena_dir = "/dev/shm" if os.path.isdir("/dev/shm") else str(tmp_path)
    h, handles = _arena_world(arena_dir, 2)
    arena_path = h.reply(0, h.send(0, P.ArenaRequest(handles[0]))).path
    arena = h.core.comms[1].arena
    actions = h.core.close()
    assert actions == [(C.ARENA_CLOSE, arena, None)] and os.path.exists(arena_path)
    h._apply(actions)
    assert not os.path.exists(arena_path) and not h.core.arenas
