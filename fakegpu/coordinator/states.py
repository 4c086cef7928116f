"""Named states of the coordinator's objects and the transitions between them.

Each object with a lifecycle (a client connection, a communicator, a member, a rendezvous, a
collective slot, a Send/Recv step) holds ``state``, one member of its enum, and changes it only
through named methods (``slot.match()``, ``member.leave(...)``, ...) that look the move up in a
table of legal transitions and raise ``IllegalTransition`` for any other: a bug in the core
shows up where the state went wrong, not later as a hang or a double answer (the h11 way).
The tables are listed in docs/architecture.md, "Coordinator states".
"""
from __future__ import annotations

import enum


class IllegalTransition(RuntimeError):
    """An internal error: the core asked an object for a move its current state does not allow."""

    def __init__(self, what: str, state: enum.Enum, event: str, legal: tuple):
        self.what = what
        self.state = state
        self.event = event
        allowed = ", ".join(legal) or "none (a final state)"
        super().__init__(f"internal error: {what} cannot {event!r} in state {state.name} (allowed there: {allowed})")


class Machine:
    """Mixin for a slotted class with a ``state`` attribute and a class-level ``TRANSITIONS``
    table: {state: {event: next state}}."""
    __slots__ = ()
    TRANSITIONS: dict = {}

    def _advance(self, event: str) -> None:
        new = self.TRANSITIONS[self.state].get(event)
        if new is None:
            self._illegal(event)
        self.state = new

    def _move(self, by_state: dict, event: str) -> None:
        """The hot paths' transition: ``by_state`` is :func:`by_event`'s table of ``event``."""
        new = by_state.get(self.state)
        if new is None:
            self._illegal(event)
        self.state = new

    def _illegal(self, event: str):
        raise IllegalTransition(type(self).__name__, self.state, event, tuple(self.TRANSITIONS[self.state]))


def transition(event: str):
    """A machine's named move: ``complete = transition("complete")`` in the class body gives
    ``obj.complete()``, which advances by ``event`` or raises IllegalTransition."""
    def move(self) -> None:
        self._advance(event)
    move.__name__ = move.__qualname__ = event
    move.__doc__ = f"The {event!r} transition (see TRANSITIONS)."
    return move


def by_event(table: dict, event: str) -> dict:
    """{state: next state} of one event: what the hot paths' transition methods look up (one
    dict lookup instead of two)."""
    return {state: moves[event] for state, moves in table.items() if event in moves}


class ClientState(enum.Enum):
    """A connected process, from its HELLO_OK on (before HELLO there is no Client object)."""
    OPEN = "open"          # talking to the coordinator
    CLOSING = "closing"    # the coordinator closed it (an injected fault); its disconnect is to come
    CLOSED = "closed"      # disconnected: nothing more is sent to it


CLIENT_TRANSITIONS = {
    ClientState.OPEN: {"close": ClientState.CLOSING, "disconnect": ClientState.CLOSED},
    # A second fault may hit frames already read from a closing connection; the last reason wins.
    ClientState.CLOSING: {"close": ClientState.CLOSING, "disconnect": ClientState.CLOSED},
    ClientState.CLOSED: {},
}


class RendezvousState(enum.Enum):
    """Members gathering for COMM_INIT, COMM_SPLIT or COMM_SHRINK."""
    GATHERING = "gathering"   # waiting for members, in the deadline queue
    COMPLETE = "complete"     # every member came: the communicator(s) made and answered
    FAILED = "failed"         # cannot complete (a member left, disagreement, refused identities)
    EXPIRED = "expired"       # its deadline passed (a failed shrink is dropped at its deadline too)


RENDEZVOUS_TRANSITIONS = {
    RendezvousState.GATHERING: {"complete": RendezvousState.COMPLETE, "fail": RendezvousState.FAILED,
                                "expire": RendezvousState.EXPIRED},
    # A failed COMM_SHRINK stays until its deadline so later callers learn it failed at once.
    RendezvousState.FAILED: {"expire": RendezvousState.EXPIRED},
    RendezvousState.COMPLETE: {},
    RendezvousState.EXPIRED: {},
}


class CommState(enum.Enum):
    """A communicator, from its rendezvous' completion on."""
    READY = "ready"     # every member live
    FAILED = "failed"   # a member left (disconnect, abort, destroy): calls that need it fail
    FREED = "freed"     # every member gone: dropped by the coordinator, its arena closed


COMM_TRANSITIONS = {
    CommState.READY: {"member_left": CommState.FAILED},
    CommState.FAILED: {"member_left": CommState.FAILED, "free": CommState.FREED},
    CommState.FREED: {},
}


class MemberState(enum.Enum):
    LIVE = "live"
    GONE = "gone"       # dead, aborted, destroyed or finalized


MEMBER_TRANSITIONS = {MemberState.LIVE: {"leave": MemberState.GONE}, MemberState.GONE: {}}


class SlotState(enum.Enum):
    """Step ``step_index`` of collective call ``match_seq`` of a communicator."""
    WAITING = "waiting"       # in comm.slots and the deadline queue, ranks still to arrive
    MATCHED = "matched"       # every rank arrived; being checked for agreement
    EXECUTING = "executing"   # its reduction runs (inline, in the worker thread, or queued behind one)
    ANSWERED = "answered"     # done; every rank's op answered with success
    FAILED = "failed"         # disagreement, bad arguments, internal error, a call or member that failed
    EXPIRED = "expired"       # ranks missing at the deadline


SLOT_TRANSITIONS = {
    SlotState.WAITING: {"match": SlotState.MATCHED, "fail": SlotState.FAILED, "expire": SlotState.EXPIRED},
    SlotState.MATCHED: {"execute": SlotState.EXECUTING, "answer": SlotState.ANSWERED, "fail": SlotState.FAILED},
    SlotState.EXECUTING: {"answer": SlotState.ANSWERED, "fail": SlotState.FAILED},
    SlotState.ANSWERED: {},
    SlotState.FAILED: {},
    SlotState.EXPIRED: {},
}


class P2PState(enum.Enum):
    """One Send or Recv step, matched per (communicator, sender, receiver). Collective steps
    stay ARRIVED: their lifecycle is their slot's."""
    ARRIVED = "arrived"   # submitted, not yet paired or queued
    QUEUED = "queued"     # waiting for its peer's step (a parked Send waits here, already answered)
    MATCHED = "matched"   # paired with its peer's step
    DONE = "done"         # copied (or accounted) and answered
    FAILED = "failed"     # rejected, peer gone, disagreement, a failed call
    EXPIRED = "expired"   # the peer did not post its step by the deadline


P2P_TRANSITIONS = {
    P2PState.ARRIVED: {"queue": P2PState.QUEUED, "match": P2PState.MATCHED, "fail": P2PState.FAILED},
    P2PState.QUEUED: {"match": P2PState.MATCHED, "fail": P2PState.FAILED, "expire": P2PState.EXPIRED},
    P2PState.MATCHED: {"complete": P2PState.DONE, "fail": P2PState.FAILED},
    P2PState.DONE: {},
    P2PState.FAILED: {},
    P2PState.EXPIRED: {},
}

class ExecutionState(enum.Enum):
    """A matched collective's computation (one per slot that moves data), in its communicator's
    execution queue: collectives of one communicator run and are answered in their order."""
    WAITING = "waiting"   # behind an earlier execution of its communicator
    RUNNING = "running"   # its reduction runs, inline on the I/O thread or in a worker thread
    DONE = "done"         # finished; its slot is answered
    FAILED = "failed"     # the computation raised (an internal error): its call fails


EXECUTION_TRANSITIONS = {
    ExecutionState.WAITING: {"start": ExecutionState.RUNNING},
    ExecutionState.RUNNING: {"finish": ExecutionState.DONE, "fail": ExecutionState.FAILED},
    ExecutionState.DONE: {},
    ExecutionState.FAILED: {},
}


class GroupFrameState(enum.Enum):
    """One GROUP (or ACCOUNT) frame of a client, from its arrival to its GROUP_DONE."""
    PENDING = "pending"     # some of its ops have no result yet
    DECIDED = "decided"     # every op has a result; a split group's last frame may wait here for
                            # the Sends its earlier frames parked
    ANSWERED = "answered"   # its GROUP_DONE is queued for the client
    DROPPED = "dropped"     # nothing to answer: its client is gone, or it held only rejected
                            # placeholders (their ranks already have their error)


GROUP_FRAME_TRANSITIONS = {
    GroupFrameState.PENDING: {"decide": GroupFrameState.DECIDED},
    GroupFrameState.DECIDED: {"answer": GroupFrameState.ANSWERED, "drop": GroupFrameState.DROPPED},
    GroupFrameState.ANSWERED: {},
    GroupFrameState.DROPPED: {},
}


class ProbeState(enum.Enum):
    """A PROBE_SOURCE (receive from any source) waiting to learn which rank sends to it."""
    WAITING = "waiting"       # no unclaimed Send to its member yet: in the core's probe list
    ANSWERED = "answered"     # SOURCE sent naming a sender, whose Send is now claimed
    FAILED = "failed"         # its communicator was freed, or no other rank is left to send
    EXPIRED = "expired"       # no Send came by its deadline
    ABANDONED = "abandoned"   # its client disconnected: nobody waits for the answer


PROBE_TRANSITIONS = {
    ProbeState.WAITING: {"answer": ProbeState.ANSWERED, "fail": ProbeState.FAILED, "expire": ProbeState.EXPIRED,
                         "abandon": ProbeState.ABANDONED},
    ProbeState.ANSWERED: {},
    ProbeState.FAILED: {},
    ProbeState.EXPIRED: {},
    ProbeState.ABANDONED: {},
}

# GroupState.results[i] while op i has no result yet (results are NCCL codes, never negative).
RESULT_PENDING = -1
