"""PROBE_SOURCE: which rank has a Send waiting for the caller (a receive from any source).

NCCL has no wildcard receive, so a backend that offers one (torch's ``recv`` without ``src``)
first asks here which peer to receive from and then posts an ordinary Recv from that peer.
The coordinator already holds every Send that waits for its Recv (p2p.py), so it can answer
exactly: a probe is answered with a sender whose *next* Send to the caller — the one the
caller's next Recv from that sender pairs with, by the Recv counts the probe carries (its
Recvs still in flight count too) — is waiting, and that Send is then claimed
(``PairQueue.claimed``), so a second probe of the same rank never names it again. Among
several such senders the one whose Send reached the coordinator first wins (ties: the lower
rank), so no sender can be starved and each sender's Sends are received in their order.
docs/protocol.md, "Receive from any source".
"""
from __future__ import annotations

from typing import Optional

from fakegpu import protocol as P
from fakegpu.coordinator.registry import Client, Member
from fakegpu.coordinator.states import PROBE_TRANSITIONS, Machine, MemberState, ProbeState, transition

from .common import frame_bytes, log


class SourceProbe(Machine):
    """A PROBE_SOURCE that waits for a Send to its member (states: ProbeState)."""
    __slots__ = ("client", "request_id", "member", "recvs_posted", "timeout_ms", "capped", "deadline", "state")
    TRANSITIONS = PROBE_TRANSITIONS

    def __init__(self, client: Client, request_id: int, member: Member, recvs_posted: tuple, timeout_ms: int,
                 capped: bool, deadline: float):
        self.client = client
        self.recvs_posted = recvs_posted
        self.request_id = request_id
        self.member = member
        self.timeout_ms = timeout_ms
        self.capped = capped          # the coordinator's own timeout was the shorter one
        self.deadline = deadline
        self.state = ProbeState.WAITING

    answer = transition("answer")
    fail = transition("fail")
    expire = transition("expire")
    abandon = transition("abandon")


class AnySourceMixin:
    """The Core's PROBE_SOURCE (mixed into fakegpu.coordinator.core.Core); the Core holds
    ``self._probes``, the waiting probes in arrival order."""

    def _probe_source(self, client: Client, frame: P.Frame) -> None:
        msg = P.decode_body(P.PROBE_SOURCE, frame.body)
        member = self._own_member(client, msg.comm_handle, "PROBE_SOURCE", frame.request_id)
        if member is None:
            return
        if len(msg.recvs_posted) != member.comm.nranks:
            self._error(client, frame.request_id, P.NCCL_INVALID_ARGUMENT,
                        f"PROBE_SOURCE on {member.comm.label()}: {len(msg.recvs_posted)} Recv counts for a "
                        f"{member.comm.nranks}-rank communicator")
            return
        capped = msg.timeout_ms == 0 or msg.timeout_ms > self.timeout_ms
        timeout_ms = self.timeout_ms if capped else msg.timeout_ms
        probe = SourceProbe(client, frame.request_id, member, msg.recvs_posted, timeout_ms, capped,
                            self.clock() + timeout_ms / 1000.0)
        if not self._answer_probe(probe):
            self._probes.append(probe)

    def _answer_probe(self, probe: SourceProbe) -> bool:
        """Answer ``probe`` with the sender of the earliest waiting, unclaimed next Send to its
        member and claim that Send; False when there is none yet."""
        member = probe.member
        comm = member.comm
        me = member.rank
        best: Optional[tuple] = None
        for sender in range(comm.nranks):
            q = comm.p2p.get((sender, me)) if sender != me else None
            if q is None:
                continue
            # The caller's next Recv from `sender` takes match_seq recvs_posted + 1, or the one
            # after those already promised to earlier probes.
            seq = max(probe.recvs_posted[sender], q.claimed) + 1
            step = q.sends.get((seq, 0))
            if step is None:
                continue
            order = (step.arrived_at, sender)
            if best is None or order < best[0]:
                best = (order, sender, q, seq)
        if best is None:
            return False
        _order, sender, q, seq = best
        probe.answer()
        q.claimed = seq
        self._send(probe.client, frame_bytes(P.SOURCE, probe.request_id, P.encode_body(P.Source(sender))))
        return True

    def _wake_probes(self, comm, receiver: int) -> None:
        """A Send to ``receiver`` of ``comm`` now waits: answer that rank's probes, oldest first."""
        answered = [p for p in self._probes if p.member.comm is comm and p.member.rank == receiver]
        for probe in answered:
            if self._answer_probe(probe):
                self._probes.remove(probe)
            else:
                break

    def _tick_probes(self, now: float) -> None:
        """Fail probes past their deadline, and those that no Send can reach any more."""
        keep = []
        for probe in self._probes:
            member = probe.member
            comm = member.comm
            label = f"{comm.label()} rank {member.rank}"
            if probe.client.closed:
                probe.abandon()   # nobody waits for the answer
                continue
            if member.state is MemberState.GONE:
                probe.fail()
                # Another thread of the caller freed or aborted the communicator meanwhile.
                self._error(probe.client, probe.request_id, P.NCCL_INVALID_USAGE,
                            f"{label}: receive from any source: the communicator was freed while it waited "
                            f"({member.gone[1]})")
                continue
            if len(comm.gone_ranks) >= comm.nranks - 1:
                probe.fail()
                self._error(probe.client, probe.request_id, P.NCCL_REMOTE_ERROR,
                            f"{label}: receive from any source: every other rank of the communicator left, "
                            "nobody can send to it")
            elif probe.deadline <= now:
                probe.expire()
                bound = "FAKEGPU_COORDINATOR_TIMEOUT_MS" if probe.capped else "the caller's timeout"
                message = (f"{label}: receive from any source timed out: no rank sent to rank {member.rank} within "
                           f"{probe.timeout_ms} ms ({bound})")
                log.warning("timeout: %s", message)
                self._error(probe.client, probe.request_id, P.NCCL_TIMEOUT, message)
            else:
                keep.append(probe)
        self._probes = keep
