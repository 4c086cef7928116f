"""Clients, communicators and their members (pure data, no I/O).

A *client* is one connected process. A *communicator* has ``nranks`` *members*; each
member is one (communicator, rank) and has its own u64 handle, because one process may
hold several ranks of a communicator (ncclCommInitAll). Global ranks follow
docs/protocol.md: the process's HELLO global_rank, else the rank(s) it took in the first
communicator it joined.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from fakegpu.common.records import ClientRecord, CommRecord
from fakegpu.coordinator.states import (CLIENT_TRANSITIONS, COMM_TRANSITIONS, MEMBER_TRANSITIONS,
                                        RENDEZVOUS_TRANSITIONS, ClientState, CommState, Machine, MemberState,
                                        RendezvousState, transition)


class Client(Machine):
    __slots__ = ("id", "hello", "transport", "shm", "staging", "S", "inp", "outp", "global_ranks",
                 "members", "groups", "record", "state", "closed", "inp_mv", "close_reason", "split_groups")
    TRANSITIONS = CLIENT_TRANSITIONS

    def __init__(self, client_id: int, hello, transport: str, staging: np.ndarray, S: int, shm: bool):
        self.id = client_id
        self.hello = hello
        self.transport = transport
        self.shm = shm
        self.staging = staging
        self.S = S
        self.inp = staging[:S]
        self.outp = staging[S:2 * S]
        self.inp_mv = memoryview(self.inp) if not shm else None
        self.global_ranks: Optional[list] = [hello.global_rank] if hello.global_rank >= 0 else None
        self.members: list = []
        self.groups: dict = {}   # request_id -> GroupState in flight
        self.split_groups: dict = {}   # group id -> SplitGroup whose final frame has not come yet
        self.state = ClientState.OPEN
        self.closed = False   # state is CLOSED, kept as a plain attribute for the hot paths (every answer)
        self.close_reason: Optional[str] = None   # why the coordinator itself closed it (faults)
        self.record = ClientRecord(client_id=client_id, pid=hello.pid, hostname=hello.hostname,
                                   global_rank=hello.global_rank, transport=transport, shared_memory=shm)

    def close(self, reason: str) -> None:
        """OPEN/CLOSING -> CLOSING: the coordinator closes the connection (its CLOSE action goes out)."""
        self._advance("close")
        self.close_reason = reason

    def disconnect(self) -> None:
        """OPEN/CLOSING -> CLOSED: the connection went away; nothing is sent to it any more."""
        self._advance("disconnect")
        self.closed = True

    def describe(self) -> str:
        g = self.hello.global_rank
        return f"pid {self.hello.pid} on {self.hello.hostname or '?'}" + (f" (RANK {g})" if g >= 0 else "")


class Member(Machine):
    __slots__ = ("handle", "comm", "rank", "client", "global_rank", "collective_at", "split_seq", "shrink_seq",
                 "gone", "state")
    TRANSITIONS = MEMBER_TRANSITIONS

    def __init__(self, handle: int, comm: "Comm", rank: int, client: Client, global_rank: int):
        self.handle = handle
        self.comm = comm
        self.rank = rank
        self.client = client
        self.global_rank = global_rank
        self.collective_at = 0  # the highest collective match_seq this member has sent
        self.split_seq = 0     # index of this member's next CommSplit on this comm
        self.shrink_seq = 0    # index of this member's next CommShrink on this comm
        self.gone: Optional[tuple] = None   # (nccl_result, reason) once dead/aborted/freed
        self.state = MemberState.LIVE

    def leave(self, code: int, reason: str) -> None:
        """LIVE -> GONE, with the result and reason its peers' waiting calls fail with."""
        self._advance("leave")
        self.gone = (code, reason)


class Comm(Machine):
    __slots__ = ("id", "name", "nranks", "members", "record", "slots", "failed_calls", "p2p",
                 "gone_ranks", "splits", "shrinks", "call", "p2p_calls", "reported_seq", "arena",
                 "arena_refusal", "local_records", "state", "arena_pending", "arena_failed")
    TRANSITIONS = COMM_TRANSITIONS

    def __init__(self, comm_id: int, name: str, parent_id: Optional[int]):
        self.id = comm_id
        self.name = name
        self.nranks = 0
        self.members: list = []
        self.record = CommRecord(comm_id=comm_id, name=name, global_ranks=(), parent_id=parent_id)
        self.slots: dict = {}          # (match_seq, step_index) -> Slot
        self.failed_calls: dict = {}   # collective match_seq -> FailedCall (matching.py)
        self.p2p: dict = {}            # (sender, receiver) -> PairQueue
        self.gone_ranks: dict = {}     # rank -> (result, reason)
        self.splits: dict = {}         # split seq -> SplitRendezvous
        self.shrinks: dict = {}        # shrink seq -> ShrinkRendezvous
        self.reported_seq = -1         # last collective seq whose failure was counted (one per call)
        self.call = None               # accumulator of the collective call in progress
        self.p2p_calls: dict = {}      # (sender, receiver) -> accumulator
        # Host-local collectives (arena.py). The first ARENA request decides for the whole
        # communicator: an Arena, or the reason it was refused; later requests get the same answer.
        self.arena = None
        self.arena_refusal: Optional[str] = None
        # What the core last asked the I/O layer to write into the arena's flags (ARENA_* actions).
        self.arena_pending = 0
        self.arena_failed = False
        self.state = CommState.READY
        # Calls reported by LOCAL_OPS so far (they carry their match_seq like any other call, so
        # both paths share the records' seq of this communicator's collectives).
        self.local_records = 0

    def set_members(self, members: list) -> None:
        self.members = members
        self.nranks = len(members)
        self.record = CommRecord(comm_id=self.id, name=self.name,
                                 global_ranks=tuple(m.global_rank for m in members),
                                 parent_id=self.record.parent_id)

    def member_left(self, rank: int, code: int, reason: str) -> None:
        """READY/FAILED -> FAILED: comm rank ``rank`` left."""
        self._advance("member_left")
        self.gone_ranks[rank] = (code, reason)

    def free(self) -> None:
        """FAILED -> FREED: the last member left."""
        self._advance("free")

    def label(self) -> str:
        return f"comm {self.id}" + (f" ({self.name!r})" if self.name else "") + f" [{self.nranks} ranks]"


def assign_global_ranks(clients_by_rank: list) -> list:
    """Global rank of each member (index = rank in the new communicator)."""
    seen: dict = {}
    for rank, client in enumerate(clients_by_rank):
        seen.setdefault(client.id, []).append(rank)
    for client in {c.id: c for c in clients_by_rank}.values():
        if client.global_ranks is None:
            # First communicator this process joined without RANK: its ranks there.
            client.global_ranks = list(seen[client.id])
    out = []
    index_in_client: dict = {}
    for client in clients_by_rank:
        j = index_in_client.get(client.id, 0)
        index_in_client[client.id] = j + 1
        base = client.global_ranks
        out.append(base[j] if j < len(base) else base[-1] + (j - len(base) + 1))
    return out


class Rendezvous(Machine):
    """Members gathering (GATHERING), until COMPLETE, FAILED or EXPIRED."""
    __slots__ = ()
    TRANSITIONS = RENDEZVOUS_TRANSITIONS

    complete = transition("complete")
    fail = transition("fail")
    expire = transition("expire")


class InitRendezvous(Rendezvous):
    """Members of one unique id gathering for COMM_INIT."""
    __slots__ = ("uid", "nranks", "name", "arrivals", "first_at", "deadline", "first_wall", "state")

    def __init__(self, uid: bytes, nranks: int, name: str, now: float, deadline: float, wall: float):
        self.uid = uid
        self.nranks = nranks
        self.name = name
        self.arrivals: dict = {}   # rank -> (client, request_id, arrived_at)
        self.first_at = now
        self.deadline = deadline
        self.first_wall = wall
        self.state = RendezvousState.GATHERING


class SplitRendezvous(Rendezvous):
    """Members of a parent communicator gathering for their k-th COMM_SPLIT."""
    __slots__ = ("comm", "seq", "arrivals", "first_at", "deadline", "state")

    def __init__(self, comm: Comm, seq: int, now: float, deadline: float):
        self.comm = comm
        self.seq = seq
        self.arrivals: dict = {}   # parent rank -> (member, request_id, color, key, name, arrived_at)
        self.first_at = now
        self.deadline = deadline
        self.state = RendezvousState.GATHERING


class ShrinkRendezvous(Rendezvous):
    """The surviving members of a parent communicator gathering for their k-th COMM_SHRINK.
    The excluded ranks never call; all callers must name the same ones."""
    __slots__ = ("comm", "seq", "excluded", "arrivals", "first_at", "deadline", "failed", "state")

    def __init__(self, comm: Comm, seq: int, excluded: tuple, now: float, deadline: float):
        self.comm = comm
        self.seq = seq
        self.excluded = excluded
        self.arrivals: dict = {}   # parent rank -> (member, request_id, excluded, name, arrived_at)
        self.first_at = now
        self.deadline = deadline
        self.failed: Optional[tuple] = None   # (result, message) once it cannot complete (FAILED)
        self.state = RendezvousState.GATHERING

    def fail_with(self, code: int, message: str) -> None:
        """GATHERING -> FAILED: later callers get ``(code, message)`` at once until its deadline."""
        self.fail()
        self.failed = (code, message)

    def survivors(self) -> list:
        return [r for r in range(self.comm.nranks) if r not in self.excluded]
