"""PROBE_SOURCE (a receive from any source) in the sans-I/O coordinator core, on a fake clock:
which sender is named, that a named Send is claimed so no other probe names it, the order
among several waiting senders, timeouts and a world with nobody left to send."""
from __future__ import annotations

import numpy as np

import test_coordinator_core as core_tests
from fakegpu import protocol as P

Harness, world, p2p = core_tests.Harness, core_tests.world, core_tests.p2p


def _probe(h, conn, handle, timeout_ms=0, posted=None, nranks=None):
    """PROBE_SOURCE; ``posted`` {rank: Recv calls so far} (the shim's counters), else none."""
    nranks = nranks if nranks is not None else h.core.handles[handle].comm.nranks
    counts = tuple((posted or {}).get(r, 0) for r in range(nranks))
    return h.send(conn, P.ProbeSource(comm_handle=handle, timeout_ms=timeout_ms, recvs_posted=counts))


def _send_from(h, handles, rank, value, dst=0, seq=1):
    h.staging(rank)[0][:4] = np.frombuffer(np.array([value], np.int32).tobytes(), np.uint8)
    return h.send(rank, P.Group(ops=(p2p(handles[rank], P.KIND_SEND, dst, 1, dtype=2, seq=seq),)))


def _recv_on(h, handles, rank, peer, seq=1):
    rid = h.send(rank, P.Group(ops=(p2p(handles[rank], P.KIND_RECV, peer, 1, dtype=2, seq=seq),)))
    done = h.reply(rank, rid)
    assert done.results == (0,), done
    return int(h.staging(rank)[1][:4].view(np.int32)[0])


def test_a_waiting_send_is_named_at_once_and_its_recv_completes_it():
    h = Harness()
    handles = world(h, 3)
    s2 = _send_from(h, handles, 2, 42)
    assert h.reply(0, _probe(h, 0, handles[0])) == P.Source(peer=2)
    assert _recv_on(h, handles, 0, 2) == 42
    assert h.reply(2, s2).results == (0,)


def test_a_probe_waits_for_a_send_and_senders_are_named_in_arrival_order_each_once():
    h = Harness()
    handles = world(h, 4)
    first = _probe(h, 0, handles[0])
    assert h.reply(0, first) is None             # nobody sent yet
    h.clock.now += 0.5
    s3 = _send_from(h, handles, 3, 300)
    assert h.reply(0, first) == P.Source(peer=3)
    h.clock.now += 0.5
    s1 = _send_from(h, handles, 1, 100)
    h.clock.now += 0.5
    s2 = _send_from(h, handles, 2, 200)
    # Rank 3's Send is claimed by the first probe (its Recv has not arrived yet): the next
    # probes name rank 1 (earlier) and then rank 2, never rank 3 again.
    assert h.reply(0, _probe(h, 0, handles[0])) == P.Source(peer=1)
    assert h.reply(0, _probe(h, 0, handles[0])) == P.Source(peer=2)
    fourth = _probe(h, 0, handles[0])
    assert h.reply(0, fourth) is None
    assert [_recv_on(h, handles, 0, peer) for peer in (3, 1, 2)] == [300, 100, 200]
    assert all(h.reply(r, rid).results == (0,) for r, rid in ((3, s3), (1, s1), (2, s2)))
    # Rank 1's second Send (match_seq 2) answers the probe still waiting.
    _send_from(h, handles, 1, 101, seq=2)
    assert h.reply(0, fourth) == P.Source(peer=1)
    assert _recv_on(h, handles, 0, 1, seq=2) == 101


def test_several_sends_of_one_sender_are_named_one_per_probe_in_their_order():
    h = Harness()
    handles = world(h, 2)
    h.staging(1)[0][:8] = np.frombuffer(np.array([7, 8], np.int32).tobytes(), np.uint8)
    group = h.send(1, P.Group(ops=(p2p(handles[1], P.KIND_SEND, 0, 1, dtype=2, seq=1),
                                   p2p(handles[1], P.KIND_SEND, 0, 1, dtype=2, in_off=4, seq=2))))
    assert h.reply(0, _probe(h, 0, handles[0])) == P.Source(peer=1)
    assert h.reply(0, _probe(h, 0, handles[0])) == P.Source(peer=1)
    third = _probe(h, 0, handles[0])
    assert h.reply(0, third) is None              # both Sends are claimed
    assert [_recv_on(h, handles, 0, 1, seq=s) for s in (1, 2)] == [7, 8]
    assert h.reply(1, group).results == (0, 0)


def test_sends_to_other_ranks_or_already_received_are_not_named():
    h = Harness()
    handles = world(h, 3)
    _send_from(h, handles, 1, 5, dst=2)           # to rank 2, not to rank 0
    probe = _probe(h, 0, handles[0])
    assert h.reply(0, probe) is None
    assert h.reply(2, _probe(h, 2, handles[2])) == P.Source(peer=1)
    assert _recv_on(h, handles, 2, 1) == 5
    assert h.reply(0, probe) is None


def test_a_probe_times_out_after_its_timeout_capped_by_the_coordinators():
    h = Harness()                                   # coordinator timeout: 5000 ms
    handles = world(h, 2)
    short = _probe(h, 0, handles[0], timeout_ms=1000)
    capped = _probe(h, 1, handles[1], timeout_ms=60_000)
    h.tick(0.9)
    assert h.reply(0, short) is None
    h.tick(0.2)
    err = h.reply(0, short)
    assert isinstance(err, P.Error) and err.result == P.NCCL_TIMEOUT
    assert "rank 0: receive from any source timed out: no rank sent to rank 0 within 1000 ms" in err.message
    assert h.reply(1, capped) is None
    h.tick(4)
    err = h.reply(1, capped)
    assert err.result == P.NCCL_TIMEOUT and "within 5000 ms (FAKEGPU_COORDINATOR_TIMEOUT_MS)" in err.message
    # A probe that timed out claimed nothing: a later Send is named to the next probe.
    _send_from(h, handles, 1, 9)
    assert h.reply(0, _probe(h, 0, handles[0])) == P.Source(peer=1)
    assert _recv_on(h, handles, 0, 1) == 9


def test_a_probe_fails_when_every_other_rank_left():
    h = Harness()
    handles = world(h, 3)
    probe = _probe(h, 0, handles[0])
    h.disconnect(1)
    h.tick(0.1)
    assert h.reply(0, probe) is None                # rank 2 may still send
    h.disconnect(2)
    h.tick(0.1)
    err = h.reply(0, probe)
    assert err.result == P.NCCL_REMOTE_ERROR and "every other rank of the communicator left" in err.message


def test_a_probe_on_a_foreign_handle_is_refused():
    h = Harness()
    handles = world(h, 2)
    err = h.reply(0, _probe(h, 0, handles[1]))
    assert err.result == P.NCCL_INVALID_ARGUMENT and "PROBE_SOURCE" in err.message


def test_a_malformed_probe_closes_the_connection():
    h = Harness()
    world(h, 2)
    raw = P.encode_frame(P.ProbeSource(comm_handle=1, timeout_ms=0), 7)[:-1]
    bad = bytearray(raw)
    bad[12:16] = (len(raw) - 16).to_bytes(4, "little")
    for f in P.FrameParser(1 << 40).feed(bytes(bad)):
        h._apply(h.core.on_frame(0, f, "unix", core_tests.shm_factory))
    assert "PROBE_SOURCE" in h.closed[0]


def test_recvs_still_in_flight_count_a_sender_whose_sends_they_take_is_not_named():
    h = Harness()
    handles = world(h, 3)
    h.staging(1)[0][:8] = np.frombuffer(np.array([7, 8], np.int32).tobytes(), np.uint8)
    h.send(1, P.Group(ops=(p2p(handles[1], P.KIND_SEND, 0, 1, dtype=2, seq=1),
                           p2p(handles[1], P.KIND_SEND, 0, 1, dtype=2, in_off=4, seq=2))))
    # Rank 0 has issued two Recvs from rank 1 (not arrived yet): both of rank 1's Sends are theirs.
    waiting = _probe(h, 0, handles[0], posted={1: 2})
    assert h.reply(0, waiting) is None
    _send_from(h, handles, 2, 20)
    assert h.reply(0, waiting) == P.Source(peer=2)
    # With one Recv from rank 1 in flight, rank 1's second Send is the next one.
    assert h.reply(0, _probe(h, 0, handles[0], posted={1: 1})) == P.Source(peer=1)
    assert [_recv_on(h, handles, 0, 1, seq=s) for s in (1, 2)] == [7, 8]
    assert _recv_on(h, handles, 0, 2) == 20


def test_a_probe_with_the_wrong_number_of_recv_counts_is_refused():
    h = Harness()
    handles = world(h, 3)
    err = h.reply(0, _probe(h, 0, handles[0], nranks=2))
    assert err.result == P.NCCL_INVALID_ARGUMENT and "2 Recv counts for a 3-rank communicator" in err.message


def test_a_probe_fails_when_its_communicator_is_freed_while_it_waits():
    h = Harness()
    handles = world(h, 2)
    probe = _probe(h, 0, handles[0])
    h.send(0, P.CommFree(comm_handle=handles[0], how=P.FREE_ABORT))   # another thread of rank 0
    h.tick(0.1)
    err = h.reply(0, probe)
    assert err.result == P.NCCL_INVALID_USAGE and "the communicator was freed while it waited" in err.message
