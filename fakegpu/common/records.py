"""What the coordinator core tells the accounting/report layer.

The core (sans-I/O) produces these plain records; `fakegpu.report` consumes them.
Keeping them in one small module lets both sides evolve without importing each other.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Protocol, Sequence


@dataclass(frozen=True)
class ClientRecord:
    client_id: int
    pid: int
    hostname: str
    global_rank: int          # -1 until known
    transport: str            # "unix" | "tcp"
    shared_memory: bool


@dataclass(frozen=True)
class CommRecord:
    comm_id: int              # coordinator-wide id of the communicator (not a member handle)
    name: str                 # ncclConfig_t.commName / torch group name, "" if none
    global_ranks: tuple[int, ...]   # global rank of each member, index = rank in comm
    parent_id: Optional[int] = None  # set for communicators made by split


@dataclass(frozen=True)
class OpRecord:
    """One user-level call (all its steps), as the members executed it together.

    For a collective all members appear; for Send/Recv one record per matched pair,
    with ``ranks == (sender, receiver)`` (ranks in the communicator).
    """
    comm: CommRecord
    kind: str                 # "AllReduce", "Broadcast", ..., "SendRecv"
    datatype: str             # "float32", "bfloat16", ...
    redop: Optional[str]      # "sum", "prod", "max", "min", "avg", "premulsum", None
    count: int                # the user's count
    elem_size: int
    root: int                 # root rank in the comm (or sender for SendRecv), -1 if none
    peer: int                 # receiver rank for SendRecv, -1 otherwise
    ranks: tuple[int, ...]    # participating ranks in the comm
    logical_bytes: int        # payload size in the nccl-tests sense (S in docs/cost-model.md, "nccl-tests conventions")
    socket_bytes: int         # bytes that crossed sockets (0 with shared memory)
    seq: int                  # coordinator sequence number of the op on this communicator
    started_at: float         # wall time (time.time()) when the first member arrived
    rendezvous_s: float       # first arrival -> last arrival
    execution_s: float        # coordinator-side execution time
    arrival_wait_s: dict[int, float] = field(default_factory=dict)  # global rank -> wait
    status: str = "ok"        # "ok" | "mismatch" | "timeout" | "peer_failed" | "error"
    error: str = ""
    # global rank -> epoch seconds of its first arrival at the call: a rank's calls are
    # sequential, so these give its program order (the modeled timeline, fakegpu/report/schedule.py)
    arrived_at: dict[int, float] = field(default_factory=dict)
    # global rank -> (client id, request id) of the GROUP frame that carried its part: calls one
    # rank made in one ncclGroupStart/End run together, as one launch (the modeled timeline)
    frames: dict[int, tuple[int, int]] = field(default_factory=dict)


class Recorder(Protocol):
    """Receives accounting events. Implementations must be cheap: called on the hot path."""

    def client_connected(self, client: ClientRecord) -> None: ...
    def client_disconnected(self, client: ClientRecord, reason: str) -> None: ...
    def comm_created(self, comm: CommRecord, init_wait_s: Sequence[float]) -> None: ...
    def op_completed(self, op: OpRecord) -> None: ...


class NullRecorder:
    def client_connected(self, client: ClientRecord) -> None:
        pass

    def client_disconnected(self, client: ClientRecord, reason: str) -> None:
        pass

    def comm_created(self, comm: CommRecord, init_wait_s: Sequence[float]) -> None:
        pass

    def op_completed(self, op: OpRecord) -> None:
        pass
