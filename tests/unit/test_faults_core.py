"""Faults and COMM_SHRINK in the sans-I/O core on a fake clock: delay/hang/drop/kill decisions,
shrink rendezvous (success after a death, disagreement, timeout, bad arguments), events."""
from __future__ import annotations

import pytest

from fakegpu import protocol as P
from fakegpu.coordinator.faults import FaultPlan, parse_fault_env
from test_coordinator_core import Harness, op, world

F32 = 7


def plan(text):
    return FaultPlan(parse_fault_env(text))


def allreduce(h, conns, handles, call_seq):
    rids = []
    for c, hd in zip(conns, handles):
        d = op(hd, P.KIND_ALLREDUCE, F32, 4, len(handles))
        d = P.OpDesc(**{**d.__dict__, "call_seq": call_seq, "match_seq": call_seq})
        rids.append(h.send(c, P.Group(ops=(d,), flags=0)))
    return rids


def results(h, conns, rids):
    out = []
    for c, rid in zip(conns, rids):
        m = h.reply(c, rid)
        out.append(None if m is None else (m.results[0] if isinstance(m, P.GroupDone) else m))
    return out


def test_delay_holds_the_rank_back_until_its_time():
    h = Harness(faults=plan("delay:rank=1:seq=1:ms=300"))
    hs = world(h, 3)
    rids = allreduce(h, [0, 1, 2], hs, 1)
    assert results(h, [0, 1, 2], rids) == [None, None, None]
    h.tick(0.2)
    assert results(h, [0, 1, 2], rids) == [None, None, None]
    h.tick(0.2)
    assert results(h, [0, 1, 2], rids) == [0, 0, 0]
    rids = allreduce(h, [0, 1, 2], hs, 2)                      # fired once
    assert results(h, [0, 1, 2], rids) == [0, 0, 0]
    ev = [e for e in h.core.events if e["event"] == "fault_injected"]
    assert ev == [{"event": "fault_injected", "at": 1.7e9, "ms": 300, "kind": "delay", "spec": "delay:rank=1:seq=1:ms=300",
                   "rank": 1, "comm": 1, "comm_rank": 1, "call_seq": 1, "op": "AllReduce"}]


def test_hang_swallows_the_call_and_peers_time_out_naming_it():
    h = Harness(faults=plan("hang:rank=2:op=AllReduce"))
    hs = world(h, 3)
    rids = allreduce(h, [0, 1, 2], hs, 1)
    h.tick(5.1)
    assert results(h, [0, 1], rids[:2]) == [P.NCCL_TIMEOUT, P.NCCL_TIMEOUT]
    assert h.reply(2, rids[2]) is None and 2 not in h.closed         # blocked, connection open
    failed = [e for e in h.core.events if e["event"] == "op_failed"][0]
    assert failed["missing_ranks"] == [2] and failed["result"] == "ncclTimeout" and failed["op"] == "AllReduce"


@pytest.mark.parametrize("kind", ["drop", "kill"])
def test_drop_and_remote_kill_close_the_connection(kind):
    h = Harness(faults=plan(f"{kind}:rank=0:seq=2"))
    hs = world(h, 2)
    assert results(h, [0, 1], allreduce(h, [0, 1], hs, 1)) == [0, 0]
    h.core.clients[0].transport = "tcp"                      # another host: never signalled
    allreduce(h, [0, 1], hs, 2)
    assert "fault injected" in h.closed[0]
    ev = [e for e in h.core.events if e["event"] == "fault_injected"][0]
    if kind == "kill":
        assert "connection dropped" in ev["action"]


def test_kill_is_an_action_for_the_io_layer():
    """The core never signals anything itself: a kill fault on a rank of this host comes out as a
    KILL action with that rank's pid, before its CLOSE; its own process (or the launcher) never."""
    h = Harness(faults=plan("kill:rank=0:seq=2"), own_pids=(4242,))
    hs = world(h, 2)
    assert results(h, [0, 1], allreduce(h, [0, 1], hs, 1)) == [0, 0]
    allreduce(h, [0, 1], hs, 2)
    assert h.killed == [(0, 1000)] and "fault injected" in h.closed[0]
    ev = [e for e in h.core.events if e["event"] == "fault_injected"][0]
    assert ev["action"] == "SIGKILL sent to pid 1000"
    h2 = Harness(faults=plan("kill:rank=0:seq=1"), own_pids=(1000,))
    hs2 = world(h2, 2)
    allreduce(h2, [0, 1], hs2, 1)
    assert h2.killed == [] and "fault injected" in h2.closed[0]


def test_shrink_after_a_death_builds_the_survivors_communicator():
    h = Harness()
    hs = world(h, 4)
    h.disconnect(2)
    rids = [h.send(c, P.CommShrink(hs[c], 0, (2,), "shrunk")) for c in (0, 1, 3)]
    infos = [h.reply(c, r) for c, r in zip((0, 1, 3), rids)]
    assert [(i.rank, i.nranks, i.global_ranks) for i in infos] == [(0, 3, (0, 1, 3)), (1, 3, (0, 1, 3)),
                                                                    (2, 3, (0, 1, 3))]
    new = [i.comm_handle for i in infos]
    assert results(h, [0, 1, 3], allreduce(h, [0, 1, 3], new, 1)) == [0, 0, 0]
    ev = [e for e in h.core.events if e["event"] == "comm_shrink"][0]
    assert ev["excluded"] == [2] and ev["members"] == [0, 1, 3] and ev["parent"] == 1


def test_shrink_disagreement_fails_every_caller():
    h = Harness()
    hs = world(h, 3)
    r0 = h.send(0, P.CommShrink(hs[0], 0, (2,), ""))
    r1 = h.send(1, P.CommShrink(hs[1], 0, (0,), ""))
    for c, r in ((0, r0), (1, r1)):
        m = h.reply(c, r)
        assert isinstance(m, P.Error) and m.result == P.NCCL_INVALID_USAGE
        assert "rank 0 excludes [2]; rank 1 excludes [0]" in m.message


def test_shrink_timeout_names_the_missing_survivor():
    h = Harness()
    hs = world(h, 3)
    r0 = h.send(0, P.CommShrink(hs[0], 0, (2,), ""))
    h.tick(5.1)
    m = h.reply(0, r0)
    assert isinstance(m, P.Error) and m.result == P.NCCL_TIMEOUT and "ranks [1] did not arrive" in m.message


@pytest.mark.parametrize("excluded", [(0,), (5,), (1, 1), (-1,)])
def test_shrink_bad_exclusions_are_invalid_argument(excluded):
    h = Harness()
    hs = world(h, 3)
    m = h.reply(0, h.send(0, P.CommShrink(hs[0], 0, excluded, "")))
    assert isinstance(m, P.Error) and m.result == P.NCCL_INVALID_ARGUMENT, m
