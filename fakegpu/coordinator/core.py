"""The coordinator's logic, sans I/O.

``Core.on_frame(conn_id, frame)`` takes one decoded frame header + body from a
connection and returns *actions* for the I/O layer:

    (SEND, conn_id, data)      data is bytes, or a list of bytes-like pieces to write in order
    (CLOSE, conn_id, reason)   close that connection after flushing what was queued
    (SHUTDOWN, None, reason)   write the reports and stop the coordinator

``Core.tick(now)`` fails whatever has waited past the timeout; ``Core.disconnect`` fails
the peers of a process that went away. Time comes from the injected ``clock``
(monotonic seconds) and ``wall`` (epoch seconds), so tests drive every timeout with a
fake clock. Collective results are computed in place in the clients' staging buffers
(numpy views) by the modules in ``collectives/``.
"""
from __future__ import annotations

import array
import collections
import hmac
import json
import logging
import math
import os
import signal
import socket
import struct
import sys
import time
from collections import OrderedDict
from typing import Callable, Optional

import numpy as np

from fakegpu import protocol as P
from fakegpu.coordinator import arena as A
from fakegpu.coordinator import shm as SHM
from fakegpu.coordinator.collectives import EXECUTORS
from fakegpu.coordinator.collectives.numerics import DTYPES
from fakegpu.coordinator.collectives.sendrecv import execute as copy_p2p
from fakegpu.coordinator.faults import FaultPlan, load_plan
from fakegpu.coordinator.matching import (
    D_CALL_SEQ, D_DTYPE, D_FLAGS, D_HANDLE, D_IN_LEN, D_IN_OFF, D_KIND, D_MATCH_SEQ, D_OUT_LEN, D_OUT_OFF,
    D_REDOP, D_ROOT, D_SCALAR, D_STEP, D_STEP_INDEX, D_STEP_TOTAL, D_TOTAL, FailedCall, GroupState, PairQueue,
    Slot, SplitGroup, Step, describe_op, ends_call, mismatch_message, validate)
from fakegpu.coordinator.records import NullRecorder, OpRecord
from fakegpu.coordinator.registry import (
    Client, Comm, InitRendezvous, Member, ShrinkRendezvous, SplitRendezvous, assign_global_ranks)
from fakegpu.topology.model import rank_ranges

log = logging.getLogger("fakegpu.coordinator")

SEND, CLOSE, SHUTDOWN = 0, 1, 2

DEFAULT_STAGING_BYTES = 32 << 20
MAX_STAGING_BYTES = 256 << 20
MIN_STAGING_BYTES = 4096

# Collectives touching at least this many staging bytes run through ``Core.offload`` (the
# server's worker thread) when one is set; smaller ones inline, where a thread hop would cost
# more than the work.
OFFLOAD_MIN_BYTES = 4 << 20

_HDR = P.HEADER
_U32 = struct.Struct("<I")
_U32I32 = struct.Struct("<Ii")
_OPDESC_UNPACK = P.OPDESC_STRUCT.unpack_from
_OPDESC_SIZE = P.OPDESC_SIZE
# Failed calls kept per communicator (or Send/Recv pair) until every member is past them; a
# member that never moves on cannot make the coordinator keep more than this many.
_MAX_FAILED_CALLS = 1024
_NO_PAYLOAD = np.empty(0, dtype=np.uint8)
_MAX_SPLIT_GROUPS = 4096   # groups of one connection in several frames at once (one per thread)
_OPDESC_ITER = P.OPDESC_STRUCT.iter_unpack
_GROUP_PREFIX = struct.Struct("<II")
_COMM_INFO_FIXED = struct.Struct("<Qii")
_EMPTY_STR = b"\0\0"
_DONE_ONE_OK = struct.pack("<Ii", 1, 0) + _EMPTY_STR
_U64 = struct.Struct("<Q")
_LOCAL_OPS_FIXED = struct.Struct("<QII")
_LOCAL_TIMES = struct.Struct("<ddd")
_ARENA_INFO_FIXED = struct.Struct("<IIQQ")
_LOCAL_KINDS = P.LOCAL_KINDS

_FIRST = P.OP_FLAG_FIRST_STEP
_LAST = P.OP_FLAG_LAST_STEP
_SEND_KIND = P.KIND_SEND
_RECV_KIND = P.KIND_RECV
_PREMUL = P.REDOP_PREMULSUM

_STATUS_BY_RESULT = {P.NCCL_INVALID_USAGE: "mismatch", P.NCCL_INVALID_ARGUMENT: "error",
                     P.NCCL_TIMEOUT: "timeout", P.NCCL_REMOTE_ERROR: "peer_failed"}


def _reported_code(default_code: int, codes: Optional[dict]) -> int:
    """The result a failed call is reported with: ncclInvalidArgument when some rank passed a bad
    argument (the others got ncclInvalidUsage), else the call's result."""
    return P.NCCL_INVALID_ARGUMENT if codes and P.NCCL_INVALID_ARGUMENT in codes.values() else default_code


def frame_bytes(msg_type: int, request_id: int, body: bytes) -> bytes:
    return _HDR.pack(P.MAGIC, P.VERSION, msg_type, request_id, len(body)) + body


def error_frame(request_id: int, result: int, message: str) -> bytes:
    return frame_bytes(P.ERROR, request_id, struct.pack("<i", result) + P.encode_str(message, truncate=True))


def default_staging_factory(hello, staging_bytes: int):
    """Socket staging: a per-connection buffer. np.zeros is lazily backed by the OS, so
    untouched parts of the regions cost no memory."""
    return np.zeros(2 * staging_bytes, dtype=np.uint8), False


def _env_local_collectives() -> bool:
    """FAKEGPU_LOCAL_COLLECTIVES, read like the shim does: unset or empty = on."""
    from fakegpu.env import parse_bool
    text = os.environ.get("FAKEGPU_LOCAL_COLLECTIVES", "")
    return not text.strip() or parse_bool(text, "FAKEGPU_LOCAL_COLLECTIVES")


def _env_local_slot_bytes() -> Optional[int]:
    from fakegpu.env import parse_size
    text = os.environ.get("FAKEGPU_LOCAL_SLOT_BYTES", "")
    return parse_size(text, "FAKEGPU_LOCAL_SLOT_BYTES") if text.strip() else None


def logical_bytes(kind: int, count: int, size: int, n: int) -> int:
    """Payload size in the nccl-tests sense (docs/cost-model.md, "nccl-tests conventions")."""
    return count * size * (n if P.per_member_blocks(kind) else 1)


class Core:
    def __init__(self, *, token: str = "", timeout_ms: int = 600_000,
                 default_staging_bytes: int = DEFAULT_STAGING_BYTES,
                 max_staging_bytes: int = MAX_STAGING_BYTES, recorder=None,
                 clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time,
                 transport: str = "unix", cost_fn=None, topology=None, defer_records: bool = False,
                 faults: Optional[FaultPlan] = None, max_events: int = 1000,
                 local_collectives: Optional[bool] = None, local_slot_bytes: Optional[int] = None,
                 arena_factory: Optional[A.ArenaFactory] = None, host_shm_bytes: Optional[int] = None):
        self.token = token
        self.timeout_ms = int(timeout_ms)
        self.timeout_s = timeout_ms / 1000.0
        self.default_staging_bytes = default_staging_bytes
        self.max_staging_bytes = max_staging_bytes
        # min(/dev/shm size, physical memory), the base of the default staging size (shm.py);
        # read at the first HELLO that needs it.
        self.host_shm_bytes = host_shm_bytes
        self.recorder = recorder if recorder is not None else NullRecorder()
        self.recording = not isinstance(self.recorder, NullRecorder)
        self.defer_records = defer_records
        self._records: list = []
        self.clock = clock
        self.wall = wall
        self.transport = transport
        self.cost_fn = cost_fn
        self.topology = topology
        self.started_wall = wall()
        self.clients: dict = {}
        self.handles: dict = {}
        self.comms: dict = {}
        self.inits: dict = {}
        self._waiting: OrderedDict = OrderedDict()   # item -> None; deadline order
        self._freed: dict = {}                        # handle -> client that freed it
        self._next_handle = 1
        self._next_comm = 1
        self._out: list = []
        self.n_groups = 0
        self.n_ops = 0
        self.n_local_ops = 0      # calls the ranks ran in arenas (LOCAL_OPS records)
        self.n_arenas = 0         # arenas created
        self.n_errors = 0
        # Fault injection (faults.py, docs/faults.md): FAKEGPU_FAULTS plus the YAML's faults.
        self.faults = faults if faults is not None else load_plan(os.environ.get("FAKEGPU_FAULTS"), topology)
        self._delayed: list = []            # [due, client, group, descs] held back by a delay fault
        self.events: list = []              # failure and recovery events (the report's events section)
        self.max_events = max_events
        self.dropped_events = 0
        if self.faults and hasattr(self.recorder, "faults_configured"):
            self.recorder.faults_configured(self.faults)
        # Host-local collectives (arena.py, docs/protocol.md): None = from the environment.
        self.local_collectives = _env_local_collectives() if local_collectives is None else bool(local_collectives)
        self.local_slot_bytes = _env_local_slot_bytes() if local_slot_bytes is None else local_slot_bytes
        if self.local_slot_bytes is not None and self.local_slot_bytes < A.MIN_SLOT_BYTES:
            from fakegpu.env import ConfigError
            raise ConfigError(f"local slot bytes {self.local_slot_bytes} (--local-slot-bytes / FAKEGPU_LOCAL_SLOT_BYTES) "
                              f"is below the minimum of {A.MIN_SLOT_BYTES}")
        self.arena_factory = arena_factory or A.create_arena
        self.arenas: dict = {}    # comm id -> Arena, until every member is gone or close()
        # Keeping the I/O layer responsive (the server sets both; None = all work inline, as
        # the unit tests drive it):
        # offload(job): run job.run() elsewhere, then call executed(job) on the I/O thread.
        self.offload: Optional[Callable[["Execution"], None]] = None
        # group_slice_ops: a GROUP of more ops is submitted this many at a time; the I/O layer
        # calls resume(conn_id) while submitting(conn_id), holding that connection's next frames.
        self.group_slice_ops: Optional[int] = None
        self._submitting: dict = {}   # conn id -> the rest of a GROUP still to submit
        self._executing: dict = {}    # comm id -> deque of Executions; the first is running
        # Identities (docs/protocol.md): the live process holding each RANK.
        self._rank_holders: dict = {}
        self._warned_unused = False

    # ------------------------------------------------------------------ entry points

    def on_frame(self, conn_id: int, frame: P.Frame, transport: Optional[str] = None,
                 staging_factory=default_staging_factory) -> list:
        out = self._out = []
        client = self.clients.get(conn_id)
        t = frame.msg_type
        try:
            if client is None:
                if t == P.HELLO:
                    self._hello(conn_id, frame, transport or self.transport, staging_factory)
                elif t == P.PING:
                    self._ping_before_hello(conn_id, frame)
                elif t == P.SHUTDOWN:
                    self._shutdown(conn_id, frame)
                else:
                    reason = f"{P.MESSAGE_NAMES.get(t, t)} before HELLO (HELLO must be the first frame)"
                    # With a token, nothing but that is said to a connection that has not shown it.
                    answer = "authentication required" if self.token else reason
                    out.append((SEND, conn_id, error_frame(frame.request_id, P.NCCL_INVALID_USAGE, answer)))
                    out.append((CLOSE, conn_id, reason))
            elif t == P.GROUP:
                self._group(client, frame)
            elif t == P.COMM_INIT:
                self._comm_init(client, frame)
            elif t == P.COMM_SPLIT:
                self._comm_split(client, frame)
            elif t == P.COMM_FREE:
                self._comm_free(client, frame)
            elif t == P.COMM_SHRINK:
                self._comm_shrink(client, frame)
            elif t == P.SIMULATE:
                self._simulate(client, frame)
            elif t == P.ACCOUNT:
                self._account(client, frame)
            elif t == P.LOCAL_OPS:
                self._local_ops(client, frame)
            elif t == P.ARENA:
                self._arena(client, frame)
            elif t == P.PING:
                out.append((SEND, conn_id, self._pong(frame.request_id)))
            elif t == P.SHUTDOWN:
                self._shutdown(conn_id, frame)
            elif t == P.HELLO:
                raise P.ProtocolError("second HELLO on one connection")
            else:
                raise P.ProtocolError(f"{P.MESSAGE_NAMES.get(t, t)} is not a client-to-server message")
        except P.ProtocolError as exc:
            out.append((CLOSE, conn_id, f"protocol error: {exc}"))
        return out

    def submitting(self, conn_id: int) -> bool:
        """True while a GROUP of this connection has ops not yet submitted (see resume)."""
        return conn_id in self._submitting

    def resume(self, conn_id: int) -> list:
        """Submit the next slice of this connection's GROUP."""
        out = self._out = []
        state = self._submitting.pop(conn_id, None)
        if state is not None and not state[0].closed:
            self._submit_group(*state)
        return out

    def executed(self, job: "Execution") -> list:
        """An offloaded collective finished (on the I/O thread): answer it, then start what
        waited behind it on the same communicator."""
        out = self._out = []
        self._finish_execution(job)
        queue = self._executing.get(job.comm_id)
        if queue and queue[0] is job:
            queue.popleft()
        while queue:
            nxt = queue[0]
            if self.offload is not None and nxt.nbytes >= OFFLOAD_MIN_BYTES:
                self.offload(nxt)
                return out
            nxt.run()
            queue.popleft()
            self._finish_execution(nxt)
        self._executing.pop(job.comm_id, None)
        return out

    def disconnect(self, conn_id: int, reason: str) -> list:
        self._out = []
        self._submitting.pop(conn_id, None)
        client = self.clients.pop(conn_id, None)
        if client is None:
            return self._out
        client.closed = True
        if self._rank_holders.get(client.hello.global_rank) is client:
            del self._rank_holders[client.hello.global_rank]
        reason = client.close_reason or reason
        for handle in [h for h, c in self._freed.items() if c is client]:
            del self._freed[handle]
        if self.recording:
            self.flush_records()
            self.recorder.client_disconnected(client.record, reason)
        why = f"{client.describe()} disconnected ({reason})"
        if client.members or client.groups:
            self._event("rank_disconnected", rank=client.hello.global_rank, pid=client.hello.pid,
                        reason=reason, communicators=sorted({m.comm.id for m in client.members}))
        for member in list(client.members):
            self._member_gone(member, P.NCCL_REMOTE_ERROR, f"rank {member.rank} {why}")
        for uid, rdv in list(self.inits.items()):
            if any(a[0] is client for a in rdv.arrivals.values()):
                del self.inits[uid]
                self._waiting.pop(rdv, None)
                for rank, (c, rid, _) in rdv.arrivals.items():
                    if c is not client:
                        self._error(c, rid, P.NCCL_REMOTE_ERROR,
                                    f"communicator init {self._uid_label(rdv)}: rank {rank}'s peer {why}")
        return self._out

    def tick(self, now: Optional[float] = None) -> list:
        self._out = []
        now = self.clock() if now is None else now
        if self._delayed:
            self._release_delayed(now)
        waiting = self._waiting
        while waiting:
            item = next(iter(waiting))
            if item.deadline > now:
                break
            del waiting[item]
            if isinstance(item, Slot):
                self._expire_slot(item)
            elif isinstance(item, Step):
                self._expire_p2p(item)
            elif isinstance(item, InitRendezvous):
                self._expire_init(item)
            elif isinstance(item, SplitRendezvous):
                self._expire_split(item)
            elif isinstance(item, ShrinkRendezvous):
                self._expire_shrink(item)
        return self._out

    def close(self) -> None:
        """The coordinator is stopping: unlink every arena still there."""
        for comm_id in list(self.arenas):
            self._close_arena(comm_id)

    def max_body_len(self, conn_id: int) -> int:
        client = self.clients.get(conn_id)
        if client is None:
            return P.PRE_HELLO_MAX_BODY
        return 2 * client.S + (16 << 20)

    def describe(self) -> dict:
        return {"version": _version(), "pid": os.getpid(), "transport": self.transport,
                "clients": len(self.clients), "communicators": len(self.comms),
                "pending": len(self._waiting), "uptime_s": round(self.wall() - self.started_wall, 3),
                "groups": self.n_groups, "ops": self.n_ops, "errors": self.n_errors,
                "arenas": self.n_arenas, "local_ops": self.n_local_ops}

    # ------------------------------------------------------------------ helpers

    def _send(self, client: Client, data) -> None:
        if not client.closed:
            self._out.append((SEND, client.id, data))

    def _error(self, client: Client, request_id: int, result: int, message: str) -> None:
        self.n_errors += 1
        self._send(client, error_frame(request_id, result, message))

    def _uid_label(self, rdv: InitRendezvous) -> str:
        return f"(unique id {rdv.uid[:8].hex()}…" + (f", name {rdv.name!r}" if rdv.name else "") + ")"

    def _authenticated(self, conn_id: int, frame: P.Frame, presented: str, what: str,
                       level: int = logging.WARNING) -> bool:
        """Whether `presented` is the token (any is, without one). If not, the frame gets the one
        answer an unauthenticated connection is ever given, the connection is closed, and the
        log says who it was."""
        if not self.token or hmac.compare_digest(presented.encode("utf-8"), self.token.encode("utf-8")):
            return True
        answer = "authentication failed" if presented else "authentication required"
        reason = f"{answer} ({what} {'with a wrong' if presented else 'without a'} token)"
        log.log(level, "rejected connection %d: %s", conn_id, reason)
        self._out.append((SEND, conn_id, error_frame(frame.request_id, P.NCCL_INVALID_USAGE, answer)))
        self._out.append((CLOSE, conn_id, reason))
        return False

    def _ping_before_hello(self, conn_id: int, frame: P.Frame) -> None:
        """PING on a connection without HELLO (`--ping`, `fgpu doctor`): the coordinator's state
        (pid, clients, communicators, counts) goes only to a caller that presents the token."""
        msg = P.decode_body(P.PING, frame.body)
        # INFO, not WARNING: an old `--ping` without a token is a mistake, not an attack.
        if self._authenticated(conn_id, frame, msg.token, "PING before HELLO", logging.INFO):
            self._out.append((SEND, conn_id, self._pong(frame.request_id)))

    def _pong(self, request_id: int) -> bytes:
        return frame_bytes(P.PONG, request_id, P.encode_str(json.dumps(self.describe()), truncate=True))

    # ------------------------------------------------------------------ hello / shutdown

    def _hello(self, conn_id: int, frame: P.Frame, transport: str, staging_factory) -> None:
        hello = P.decode_body(P.HELLO, frame.body)
        # Authenticate before anything about this client is stored or any segment mapped.
        if not self._authenticated(conn_id, frame, hello.token,
                                   f"HELLO of pid {hello.pid} on {hello.hostname or '?'}"):
            return
        problem = self._identity_problem(hello)
        if problem is not None:
            who = f"pid {hello.pid} on {hello.hostname or '?'}"
            log.error("rejected %s: %s", who, problem)
            self._out.append((SEND, conn_id, error_frame(frame.request_id, P.NCCL_INVALID_USAGE, problem)))
            self._out.append((CLOSE, conn_id, f"rejected: {problem}"))
            return
        S = max(MIN_STAGING_BYTES, min(self._staging_size(hello), self.max_staging_bytes))
        staging, shm = staging_factory(hello, S)
        client = Client(conn_id, hello, transport, staging, S, shm)
        self.clients[conn_id] = client
        if hello.global_rank >= 0:
            self._rank_holders[hello.global_rank] = client
        topo = self.topology
        if topo is not None and 0 < hello.world_size < topo.world_size and not self._warned_unused:
            self._warned_unused = True
            log.warning("WORLD_SIZE is %d but %s places %d ranks: ranks %s will have nothing to do",
                        hello.world_size, topo.describe(), topo.world_size,
                        rank_ranges(range(hello.world_size, topo.world_size)))
        if self.recording:
            self.flush_records()
            self.recorder.client_connected(client.record)
        flags = 0
        if shm:
            flags = P.HELLO_FLAG_SHM
            # bit1 only to a client that offered it (old clients never see it) and got shared memory.
            if self.local_collectives and hello.flags & P.HELLO_FLAG_LOCAL:
                flags |= P.HELLO_FLAG_LOCAL
        body = struct.pack("<IIQI", conn_id, flags, S, self.timeout_ms)
        self._send(client, frame_bytes(P.HELLO_OK, frame.request_id, body))

    def _staging_size(self, hello) -> int:
        """S before the limits: what the client asked for, or, when it left the choice to the
        coordinator (0, the shim's default), a size that shrinks with its world so that the
        segments of all its ranks fit the host's shared memory together (shm.py)."""
        if hello.staging_bytes:
            return hello.staging_bytes
        if self.host_shm_bytes is None:
            self.host_shm_bytes = SHM.host_shm_bytes()
        return SHM.default_staging_bytes(hello.world_size, self.host_shm_bytes, self.default_staging_bytes)

    def _identity_problem(self, hello) -> Optional[str]:
        """Why a process's RANK / WORLD_SIZE cannot join this coordinator's job, or None.

        A RANK is held by one live process at a time, must be below WORLD_SIZE, and must be
        placed by the cluster config when there is one (docs/protocol.md, "Identities")."""
        g, world = hello.global_rank, hello.world_size
        topo = self.topology
        if g >= 0:
            holder = self._rank_holders.get(g)
            if holder is not None and not holder.closed:
                return (f"RANK {g} is already held by {holder.describe()}, connected before this process "
                        f"(pid {hello.pid} on {hello.hostname or '?'}); every process of a job needs its own RANK")
            if world >= 0 and g >= world:
                return f"RANK {g} is not below WORLD_SIZE {world}: ranks of a world of {world} are 0..{world - 1}"
            if topo is not None and not topo.places(g):
                return f"RANK {g} is not placed by {topo.describe()}"
        if topo is not None and world > topo.world_size:
            return (f"WORLD_SIZE {world} is more than the {topo.world_size} ranks {topo.describe()} places; "
                    "describe every rank of the job in the cluster config")
        return None

    def _shutdown(self, conn_id: int, frame: P.Frame) -> None:
        msg = P.decode_body(P.SHUTDOWN, frame.body)
        if not self._authenticated(conn_id, frame, msg.token, "SHUTDOWN"):
            return
        self._out.append((SEND, conn_id, frame_bytes(P.OK, frame.request_id, b"")))
        self._out.append((SHUTDOWN, None, f"SHUTDOWN requested by connection {conn_id}"))

    # ------------------------------------------------------------------ communicators

    def _new_comm(self, name: str, clients_by_rank: list, global_ranks: list, parent_id) -> Comm:
        comm = Comm(self._next_comm, name, parent_id)
        self._next_comm += 1
        members = []
        for rank, (client, g) in enumerate(zip(clients_by_rank, global_ranks)):
            m = Member(self._next_handle, comm, rank, client, g)
            self._next_handle += 1
            self.handles[m.handle] = m
            client.members.append(m)
            members.append(m)
        comm.set_members(members)
        self.comms[comm.id] = comm
        return comm

    def _comm_info_frame(self, request_id: int, handle: int, rank: int, ranks_body: bytes, n: int) -> bytes:
        return frame_bytes(P.COMM_INFO, request_id, _COMM_INFO_FIXED.pack(handle, rank, n) + ranks_body)

    def _comm_init(self, client: Client, frame: P.Frame) -> None:
        msg = P.decode_body(P.COMM_INIT, frame.body)
        rid = frame.request_id
        if msg.nranks < 1 or not 0 <= msg.rank < msg.nranks:
            self._error(client, rid, P.NCCL_INVALID_ARGUMENT,
                        f"communicator init: rank {msg.rank} is not valid for nranks {msg.nranks}")
            return
        now = self.clock()
        rdv = self.inits.get(msg.unique_id)
        if rdv is None:
            rdv = InitRendezvous(msg.unique_id, msg.nranks, msg.name, now, now + self.timeout_s, self.wall())
            self.inits[msg.unique_id] = rdv
            self._waiting[rdv] = None
        elif rdv.nranks != msg.nranks:
            self._error(client, rid, P.NCCL_INVALID_USAGE,
                        f"communicator init {self._uid_label(rdv)}: ranks {sorted(rdv.arrivals)} were "
                        f"called with nranks={rdv.nranks}, rank {msg.rank} with nranks={msg.nranks}")
            return
        if msg.rank in rdv.arrivals:
            self._error(client, rid, P.NCCL_INVALID_USAGE,
                        f"communicator init {self._uid_label(rdv)}: rank {msg.rank} joined twice")
            return
        rdv.arrivals[msg.rank] = (client, rid, now)
        if not rdv.name and msg.name:
            rdv.name = msg.name
        if len(rdv.arrivals) < rdv.nranks:
            return
        del self.inits[msg.unique_id]
        self._waiting.pop(rdv, None)
        arrivals = [rdv.arrivals[r] for r in range(rdv.nranks)]
        clients = [a[0] for a in arrivals]
        before = [c.global_ranks for c in clients]
        global_ranks = assign_global_ranks(clients)
        problem = self._comm_identity_problem(clients, global_ranks)
        if problem is not None:
            for c, g in zip(clients, before):   # the refused communicator gives nobody a global rank
                c.global_ranks = g
            msg = f"communicator init {self._uid_label(rdv)} of {rdv.nranks} ranks: {problem}"
            log.error("%s", msg)
            for c, r_id, _ in arrivals:
                self._error(c, r_id, P.NCCL_INVALID_USAGE, msg)
            return
        comm = self._new_comm(rdv.name, clients, global_ranks, None)
        if self.recording:
            self.flush_records()
            self.recorder.comm_created(comm.record, [now - a[2] for a in arrivals])
        ranks_body = struct.pack(f"<{comm.nranks}i", *comm.record.global_ranks)
        for m, (c, r_id, _) in zip(comm.members, arrivals):
            self._send(c, self._comm_info_frame(r_id, m.handle, m.rank, ranks_body, comm.nranks))

    def _comm_identity_problem(self, clients: list, global_ranks: list) -> Optional[str]:
        """Why these members cannot form a communicator (global ranks of two processes collide,
        or the cluster config does not place one), or None. Ranks from RANK were checked at
        HELLO; this catches the ones taken from a process's first communicator."""
        owner: dict = {}
        for rank, (c, g) in enumerate(zip(clients, global_ranks)):
            other = owner.setdefault(g, (rank, c))
            if other[1] is not c:
                def origin(cl: Client) -> str:
                    how = "its RANK" if cl.hello.global_rank >= 0 else "its first communicator"
                    return f"{cl.describe()}, global rank from {how}"
                return (f"ranks {other[0]} ({origin(other[1])}) and {rank} ({origin(c)}) would both be global rank "
                        f"{g}; set RANK (and WORLD_SIZE) for every process of the job")
        topo = self.topology
        if topo is not None:
            unplaced = sorted({g for g in global_ranks if not topo.places(g)})
            if unplaced:
                return f"global ranks {rank_ranges(unplaced)} are not placed by {topo.describe()}"
        return None

    def _own_member(self, client: Client, handle: int, what: str, rid: int) -> Optional[Member]:
        m = self.handles.get(handle)
        if m is None or m.client is not client:
            self._error(client, rid, P.NCCL_INVALID_ARGUMENT,
                        f"{what}: communicator handle {handle:#x} is not a live communicator of this process")
            return None
        return m

    def _comm_split(self, client: Client, frame: P.Frame) -> None:
        msg = P.decode_body(P.COMM_SPLIT, frame.body)
        rid = frame.request_id
        member = self._own_member(client, msg.parent_handle, "ncclCommSplit", rid)
        if member is None:
            return
        comm = member.comm
        if msg.color < -1:
            self._error(client, rid, P.NCCL_INVALID_ARGUMENT,
                        f"ncclCommSplit on {comm.label()}: color {msg.color} is negative "
                        "(only NCCL_SPLIT_NOCOLOR = -1 is allowed)")
            return
        if comm.gone_ranks:
            self._error(client, rid, *self._gone_error(comm, "ncclCommSplit"))
            return
        seq = member.split_seq
        member.split_seq += 1
        now = self.clock()
        rdv = comm.splits.get(seq)
        if rdv is None:
            rdv = comm.splits[seq] = SplitRendezvous(comm, seq, now, now + self.timeout_s)
            self._waiting[rdv] = None
        rdv.arrivals[member.rank] = (member, rid, msg.color, msg.key, msg.name, now)
        if len(rdv.arrivals) < comm.nranks:
            return
        del comm.splits[seq]
        self._waiting.pop(rdv, None)
        by_color: dict = {}
        for rank in range(comm.nranks):
            a = rdv.arrivals[rank]
            if a[2] != -1:
                by_color.setdefault(a[2], []).append(a)
            else:
                self._send(a[0].client, self._comm_info_frame(a[1], 0, -1, b"", 0))
        for color in sorted(by_color):
            group = sorted(by_color[color], key=lambda a: (a[3], a[0].rank))
            name = next((a[4] for a in group if a[4]), "")
            new = self._new_comm(name, [a[0].client for a in group], [a[0].global_rank for a in group], comm.id)
            if self.recording:
                self.flush_records()
                self.recorder.comm_created(new.record, [now - a[5] for a in group])
            ranks_body = struct.pack(f"<{new.nranks}i", *new.record.global_ranks)
            for m, a in zip(new.members, group):
                self._send(a[0].client, self._comm_info_frame(a[1], m.handle, m.rank, ranks_body, new.nranks))

    def _comm_shrink(self, client: Client, frame: P.Frame) -> None:
        """ncclCommShrink: the parent's members minus the excluded ranks (which never call,
        usually because they died), keeping their order. Works on a communicator whose
        excluded members are gone, which COMM_SPLIT refuses."""
        msg = P.decode_body(P.COMM_SHRINK, frame.body)
        rid = frame.request_id
        member = self._own_member(client, msg.parent_handle, "ncclCommShrink", rid)
        if member is None:
            return
        comm = member.comm
        excluded = tuple(sorted(set(msg.excluded)))
        what = f"ncclCommShrink on {comm.label()}"
        if (any(not 0 <= r < comm.nranks for r in excluded) or member.rank in excluded
                or len(excluded) != len(msg.excluded) or len(excluded) >= comm.nranks):
            self._error(client, rid, P.NCCL_INVALID_ARGUMENT,
                        f"{what}: rank {member.rank} cannot exclude {list(msg.excluded)} (distinct ranks of "
                        f"0..{comm.nranks - 1}, not itself, at least one rank left)")
            return
        seq = member.shrink_seq
        member.shrink_seq += 1
        now = self.clock()
        rdv = comm.shrinks.get(seq)
        if rdv is None:
            rdv = comm.shrinks[seq] = ShrinkRendezvous(comm, seq, excluded, now, now + self.timeout_s)
            self._waiting[rdv] = None
        if rdv.failed is None and rdv.excluded != excluded:
            asked = "; ".join(f"rank {r} excludes {list(a[2])}" for r, a in sorted(rdv.arrivals.items()))
            rdv.failed = (P.NCCL_INVALID_USAGE,
                          f"{what} #{seq}: the ranks disagree on whom to exclude: {asked}; "
                          f"rank {member.rank} excludes {list(excluded)}")
            for a in rdv.arrivals.values():
                self._error(a[0].client, a[1], *rdv.failed)
        if rdv.failed is not None:
            # Later callers of this shrink learn it failed at once (the entry expires on its deadline).
            self._error(client, rid, *rdv.failed)
            return
        rdv.arrivals[member.rank] = (member, rid, excluded, msg.name, now)
        survivors = rdv.survivors()
        if len(rdv.arrivals) < len(survivors):
            return
        del comm.shrinks[seq]
        self._waiting.pop(rdv, None)
        group = [rdv.arrivals[r] for r in survivors]
        name = next((a[3] for a in group if a[3]), "")
        new = self._new_comm(name, [a[0].client for a in group], [a[0].global_rank for a in group], comm.id)
        if self.recording:
            self.flush_records()
            self.recorder.comm_created(new.record, [now - a[4] for a in group])
        self._event("comm_shrink", comm=new.id, name=new.name, parent=comm.id, excluded=list(excluded),
                    excluded_global=[comm.members[r].global_rank for r in excluded],
                    members=list(new.record.global_ranks))
        ranks_body = struct.pack(f"<{new.nranks}i", *new.record.global_ranks)
        for m, a in zip(new.members, group):
            self._send(a[0].client, self._comm_info_frame(a[1], m.handle, m.rank, ranks_body, new.nranks))

    def _expire_shrink(self, rdv: ShrinkRendezvous) -> None:
        comm = rdv.comm
        if comm.shrinks.get(rdv.seq) is rdv:
            del comm.shrinks[rdv.seq]
        if rdv.failed is not None:
            return
        missing = [r for r in rdv.survivors() if r not in rdv.arrivals]
        msg = (f"ncclCommShrink #{rdv.seq} on {comm.label()} excluding {list(rdv.excluded)}: ranks {missing} did "
               f"not arrive within {self.timeout_ms} ms (FAKEGPU_COORDINATOR_TIMEOUT_MS); arrived: "
               f"{sorted(rdv.arrivals)}")
        log.warning("timeout: %s", msg)
        for a in rdv.arrivals.values():
            self._error(a[0].client, a[1], P.NCCL_TIMEOUT, msg)

    def _comm_free(self, client: Client, frame: P.Frame) -> None:
        msg = P.decode_body(P.COMM_FREE, frame.body)
        if msg.how not in (P.FREE_DESTROY, P.FREE_ABORT, P.FREE_FINALIZE):
            self._error(client, frame.request_id, P.NCCL_INVALID_ARGUMENT,
                        f"COMM_FREE: unknown mode {msg.how} (0 destroy, 1 abort, 2 finalize)")
            return
        if self._freed.get(msg.comm_handle) is client:
            # Destroy after finalize (or a second abort): already done, as in NCCL.
            self._send(client, frame_bytes(P.OK, frame.request_id, b""))
            return
        member = self._own_member(client, msg.comm_handle, "COMM_FREE", frame.request_id)
        if member is None:
            return
        self._freed[member.handle] = client
        if msg.how == P.FREE_ABORT:
            self._event("comm_abort", comm=member.comm.id, name=member.comm.name, rank=member.rank,
                        global_rank=member.global_rank)
            self._member_gone(member, P.NCCL_REMOTE_ERROR, f"rank {member.rank} aborted the communicator")
        else:
            verb = "destroyed" if msg.how == P.FREE_DESTROY else "finalized"
            self._member_gone(member, P.NCCL_INVALID_USAGE, f"rank {member.rank} has {verb} the communicator")
        self._send(client, frame_bytes(P.OK, frame.request_id, b""))

    def _gone_error(self, comm: Comm, what: str) -> tuple:
        rank, (code, reason) = next(iter(comm.gone_ranks.items()))
        return code, f"{what} on {comm.label()}: {reason}"

    def _member_gone(self, member: Member, code: int, reason: str) -> None:
        """A member left (disconnect, abort, destroy): fail everything that waits on it."""
        if member.gone is not None:
            return
        member.gone = (code, reason)
        comm = member.comm
        comm.gone_ranks[member.rank] = (code, reason)
        self.handles.pop(member.handle, None)
        if member in member.client.members:
            member.client.members.remove(member)
        rank = member.rank
        for key, slot in list(comm.slots.items()):
            if comm.slots.get(key) is not slot:   # failed with an earlier slot of its call
                continue
            del comm.slots[key]
            self._waiting.pop(slot, None)
            seq = slot.seq
            arrived = [s for s in slot.steps if s is not None]
            op = describe_op(arrived[0].desc) if arrived else "?"
            msg = f"{comm.label()} collective #{seq} {op}: {reason}"
            for s in arrived:
                self._op_done(s.group, s.index, code, msg)
            self._fail_call(comm, seq, arrived, code, msg, started=slot.first_wall,
                            missing=[r for r, s in enumerate(slot.steps) if s is None])
        reported: set = set()   # (pair, match_seq): a call with several steps waiting is one failure

        def fail_p2p(table: dict, k: tuple, s: Step, pair: tuple, msg: str) -> None:
            del table[k]
            self._waiting.pop(s, None)
            self._op_done(s.group, s.index, code, msg)   # a parked Send was answered: no-op
            self._parked_resolved(s, code, msg)
            if (pair, k[0]) not in reported:
                reported.add((pair, k[0]))
                self._report_failed_call(comm, None, [s], code, msg, self._arrival_wall(s), [rank])

        for (src, dst), q in comm.p2p.items():
            if dst == rank:
                for k, s in list(q.sends.items()):
                    fail_p2p(q.sends, k, s, (src, dst),
                             f"{comm.label()} Send from rank {src} to rank {dst}: {reason}")
                for k, s in list(q.recvs.items()):
                    fail_p2p(q.recvs, k, s, (src, dst), f"{comm.label()} Recv on rank {dst}: {reason}")
            if src == rank:
                for k, s in list(q.recvs.items()):
                    fail_p2p(q.recvs, k, s, (src, dst), f"{comm.label()} Recv on rank {dst} from rank {src}: {reason}")
                for k, s in list(q.sends.items()):
                    fail_p2p(q.sends, k, s, (src, dst), f"{comm.label()} Send from rank {src}: {reason}")
        for seq, rdv in list(comm.splits.items()):
            del comm.splits[seq]
            self._waiting.pop(rdv, None)
            for a in rdv.arrivals.values():
                if a[0] is not member:
                    self._error(a[0].client, a[1], code, f"ncclCommSplit on {comm.label()}: {reason}")
        for seq, rdv in list(comm.shrinks.items()):
            if rank in rdv.excluded or rdv.failed is not None:
                continue
            rdv.failed = (code, f"ncclCommShrink on {comm.label()}: {reason}")
            for a in rdv.arrivals.values():
                if a[0] is not member:
                    self._error(a[0].client, a[1], *rdv.failed)
        if comm.arena is not None:
            comm.arena.set_failed(rank)
            comm.arena.set_pending(len(comm.slots))
        if all(m.gone is not None for m in comm.members):
            self.comms.pop(comm.id, None)
            self._close_arena(comm.id)

    # ------------------------------------------------------------------ groups

    def _group(self, client: Client, frame: P.Frame) -> None:
        body = frame.body
        rid = frame.request_id
        if len(body) < 8:
            raise P.ProtocolError(f"GROUP body of {len(body)} bytes is shorter than its 8-byte prefix")
        n_ops, flags = _GROUP_PREFIX.unpack_from(body, 0)
        desc_end = 8 + n_ops * _OPDESC_SIZE
        if len(body) < desc_end:
            raise P.ProtocolError(f"GROUP declares {n_ops} ops but its body holds {len(body)} bytes")
        unanswered = bool(flags & P.GROUP_FLAG_UNANSWERED)
        if not unanswered and rid in client.groups:
            raise P.ProtocolError(f"GROUP request_id {rid} is already in flight on this connection")
        if frame.payload_placed:
            pass
        elif client.shm:
            if len(body) > desc_end:
                raise P.ProtocolError("GROUP carries payload bytes on a shared-memory connection")
        else:
            layout = P.group_payload_layout(body, len(body) - desc_end, client.S)
            pos = desc_end
            inp = client.inp
            for off, ln in layout:
                if ln:
                    inp[off:off + ln] = np.frombuffer(body, dtype=np.uint8, count=ln, offset=pos)
                    pos += ln
        faults = self.faults and self.faults.armed
        sliced = self.group_slice_ops and n_ops > self.group_slice_ops and not faults
        # A large table is decoded a slice at a time, as it is submitted (_submit_group).
        descs = [None] * n_ops if sliced else [_OPDESC_UNPACK(body, 8 + _OPDESC_SIZE * i) for i in range(n_ops)]
        partial = bool(flags & P.GROUP_FLAG_PARTIAL)
        split = None
        group_id = flags >> P.GROUP_ID_SHIFT
        if group_id:
            split = client.split_groups.get(group_id)
            if split is None:
                if len(client.split_groups) >= _MAX_SPLIT_GROUPS:
                    raise P.ProtocolError(f"more than {_MAX_SPLIT_GROUPS} groups in several frames at once")
                split = client.split_groups[group_id] = SplitGroup()
            if not partial:   # the group's last frame: its id may be used again
                del client.split_groups[group_id]
        group = GroupState(client, rid, descs, partial, split=split)
        if unanswered:
            # Only rejected placeholders, whose ranks already have their error: nothing to answer,
            # nothing staged, so several may be in flight at once.
            if partial or split is not None or sliced or any(not d[D_FLAGS] & P.OP_FLAG_REJECTED for d in descs):
                raise P.ProtocolError("an unanswered GROUP may hold only rejected ops, in one frame")
            group.unanswered = True
            self.n_groups += 1
            self._submit_group(client, group, descs)
            return
        if split is not None and not partial:
            split.final = group
        client.groups[rid] = group
        self.n_groups += 1
        if n_ops == 0:
            self._finish_group(group)
            return
        if faults:
            hit = self.faults.match(lambda h: self._own_handle(client, h), descs)
            if hit is not None and self._inject(client, group, descs, *hit):
                return
        self._submit_group(client, group, descs, memoryview(body) if sliced else None)

    def _account(self, client: Client, frame: P.Frame) -> None:
        """ACCOUNT (proxy mode): the ops a rank forwarded to NVIDIA's NCCL. They are matched
        exactly like a GROUP's steps (agreement checks, Send/Recv pairing, timeouts) and recorded
        in the report, but nothing is staged or executed; the answer is a GROUP_DONE without
        payload."""
        body = frame.body
        rid = frame.request_id
        if len(body) < 8:
            raise P.ProtocolError(f"ACCOUNT body of {len(body)} bytes is shorter than its 8-byte prefix")
        n_ops, _flags = _GROUP_PREFIX.unpack_from(body, 0)
        desc_end = 8 + n_ops * _OPDESC_SIZE
        if len(body) != desc_end:
            raise P.ProtocolError(f"ACCOUNT declares {n_ops} ops but its body holds {len(body)} bytes")
        if rid in client.groups:
            raise P.ProtocolError(f"ACCOUNT request_id {rid} is already in flight on this connection")
        sliced = self.group_slice_ops and n_ops > self.group_slice_ops
        descs = [None] * n_ops if sliced else [_OPDESC_UNPACK(body, 8 + _OPDESC_SIZE * i) for i in range(n_ops)]
        group = GroupState(client, rid, descs, False, accounted=True)
        client.groups[rid] = group
        self.n_groups += 1
        if n_ops == 0:
            self._finish_group(group)
            return
        self._submit_group(client, group, descs, memoryview(body) if sliced else None)

    def _own_handle(self, client: Client, handle: int) -> Optional[Member]:
        m = self.handles.get(handle)
        return m if m is not None and m.client is client else None

    def _submit_group(self, client: Client, group: GroupState, descs: list, body=None, start: int = 0,
                      queued_sends: Optional[list] = None) -> None:
        """Submit descs[start:]; with ``body`` (the GROUP body, for a sliced group) only the
        next group_slice_ops of them, decoded from the body here, and the rest is left for
        resume()."""
        now = self.clock()
        handles = self.handles
        end = len(descs)
        if body is not None:
            end = min(end, start + self.group_slice_ops)
            descs[start:end] = _OPDESC_ITER(body[8 + _OPDESC_SIZE * start:8 + _OPDESC_SIZE * end])
        for i in range(start, end):
            d = descs[i]
            member = handles.get(d[D_HANDLE])
            if member is None or member.client is not client:
                self._op_done(group, i, P.NCCL_INVALID_ARGUMENT,
                              f"op {i} ({describe_op(d)}): communicator handle {d[D_HANDLE]:#x} is not "
                              "a live communicator of this process")
                continue
            step = Step(group, i, d, member, now)
            kind = d[D_KIND]
            if kind == _SEND_KIND or kind == _RECV_KIND:
                if self._submit_p2p(step, now) and group.partial:
                    if queued_sends is None:
                        queued_sends = []
                    queued_sends.append(step)
            else:
                self._submit_collective(step, now)
        if end < len(descs):
            self._submitting[client.id] = (client, group, descs, body, end, queued_sends)
            return
        if queued_sends:
            # More frames of this group follow: keep unmatched Send payloads here so the
            # peer's Recv (perhaps in a later frame of its own group) cannot deadlock.
            for step in queued_sends:
                if group.results[step.index] == -1 and step.payload is None:
                    d = step.desc
                    # It stays in _waiting: a parked Send that is never received times out.
                    if group.split is not None:
                        group.split.parked.add(step)
                        step.parked_in = group.split
                    if step.error is not None:   # parked as a placeholder: the Recv fails with it
                        step.payload = _NO_PAYLOAD
                        self._op_done(group, step.index, P.NCCL_INVALID_ARGUMENT,
                                      f"{step.member.comm.label()} rank {step.member.rank} {describe_op(d)}: "
                                      f"{step.error}")
                        continue
                    step.payload = client.inp[d[D_IN_OFF]:d[D_IN_OFF] + d[D_IN_LEN]].copy()
                    self._op_done(group, step.index, 0, None)

    def _op_done(self, group: GroupState, index: int, result: int, message: Optional[str]) -> None:
        if group.results[index] != -1:
            return
        group.results[index] = result
        if result:
            group.messages.append(message)
        group.remaining -= 1
        if group.remaining == 0:
            self._finish_group(group)

    def _parked_resolved(self, step: Step, result: int, message: Optional[str]) -> None:
        """A parked Send matched (result 0) or failed: its group's final frame may be answered."""
        split = step.parked_in
        if split is None:
            return
        step.parked_in = None
        split.parked.discard(step)
        if result and split.failure is None:
            split.failure = (result, message)
        final = split.final
        if final is not None and not split.parked and final.remaining == 0:
            self._finish_group(final)

    def _finish_group(self, group: GroupState) -> None:
        if group.unanswered:
            return
        client = group.client
        split = group.split
        if split is not None and split.final is group:
            if split.parked and not client.closed:
                return   # answered by _parked_resolved once the parked Sends are decided
            if split.failure is not None:
                # A Send parked from an earlier frame of this group failed: the group fails.
                code, message = split.failure
                group.results = [code if r == 0 else r for r in group.results]
                group.messages.append(message)
        client.groups.pop(group.request_id, None)
        if client.closed:
            return
        results = group.results
        n = len(results)
        if n == 1 and results[0] == 0:
            head = _DONE_ONE_OK
        else:
            msg = ""
            if group.messages:
                uniq = list(dict.fromkeys(group.messages))
                msg = "; ".join(uniq)
            codes = array.array("i", results)   # faster than struct for a 200k-op group
            if sys.byteorder != "little":
                codes.byteswap()
            head = _U32.pack(n) + codes.tobytes() + P.encode_str(msg, truncate=True)
        if client.shm or group.accounted:
            self._out.append((SEND, client.id, _HDR.pack(P.MAGIC, P.VERSION, P.GROUP_DONE,
                                                          group.request_id, len(head)) + head))
            return
        # The outputs of the ops that succeeded, in op order; ranges that follow each other in
        # the output region become one piece (a packed group is one piece, not one per op).
        runs = []
        start = end = -1
        total = len(head)
        for d, r in zip(group.descs, results):
            ln = d[D_OUT_LEN]
            if r == 0 and ln:
                off = d[D_OUT_OFF]
                total += ln
                if off == end:
                    end += ln
                    continue
                if end > start:
                    runs.append((start, end))
                start, end = off, off + ln
        if end > start:
            runs.append((start, end))
        outp = client.outp
        pieces = [outp[a:b] for a, b in runs]
        first = _HDR.pack(P.MAGIC, P.VERSION, P.GROUP_DONE, group.request_id, total) + head
        if not pieces:
            self._out.append((SEND, client.id, first))
        elif total < 65536:
            self._out.append((SEND, client.id, first + b"".join(p.tobytes() for p in pieces)))
        else:
            self._out.append((SEND, client.id, [first, *pieces]))

    # ------------------------------------------------------------------ collectives

    def _submit_collective(self, step: Step, now: float) -> None:
        """Places a collective step in the slot of its call and step (match_seq, step_index):
        the k-th collective call of every member belongs together, whatever path or frame
        earlier calls took, so a call that failed cannot leave members out of step."""
        member = step.member
        comm = member.comm
        d = step.desc
        err, step.sig = validate(d, member, member.client.S, step.group.accounted)
        if err is not None:
            step.error = err
        seq = d[D_MATCH_SEQ]
        if seq > member.collective_at:
            member.collective_at = seq
            if comm.failed_calls:
                self._forget_failed_calls(comm)
        failed = comm.failed_calls.get(seq)
        if failed is not None:
            self._answer_failed_step(comm.failed_calls, seq, failed, step, comm.nranks)
            return
        if comm.gone_ranks:
            code, msg = self._gone_error(comm, f"collective #{seq} {describe_op(d)}")
            if seq > comm.reported_seq:   # one failure per call, not one per arriving rank or step
                comm.reported_seq = seq
                self._report_failed_call(comm, seq, [step], code, msg, self._arrival_wall(step),
                                         sorted(comm.gone_ranks))
            self._op_done(step.group, step.index, code, msg)
            return
        key = (seq, d[D_STEP_INDEX])
        slot = comm.slots.get(key)
        if slot is None:
            slot = comm.slots[key] = Slot(comm, seq, d[D_STEP_INDEX], comm.nranks, now, self.wall(),
                                          now + self.timeout_s)
            self._waiting[slot] = None
        elif slot.steps[member.rank] is not None:
            self._op_done(step.group, step.index, P.NCCL_INVALID_USAGE,
                          f"{comm.label()} rank {member.rank} sent step {d[D_STEP_INDEX]} of collective "
                          f"#{seq} twice ({describe_op(d)})")
            return
        slot.steps[member.rank] = step
        slot.arrived += 1
        if slot.arrived == comm.nranks:
            del comm.slots[key]
            del self._waiting[slot]
            self._run_slot(slot, now)
        if comm.arena is not None:
            comm.arena.set_pending(len(comm.slots))

    def _answer_failed_step(self, table: dict, seq: int, failed: FailedCall, step: Step, nranks: int) -> None:
        """A step of a call that already failed: it fails the same way, at once."""
        rank = step.member.rank
        self._op_done(step.group, step.index, failed.code_for(rank), failed.message)
        if ends_call(step.desc):
            failed.done.add(rank)
            if len(failed.done) >= nranks:
                table.pop(seq, None)

    @staticmethod
    def _keep_failed_call(table: dict, seq: int, failed: FailedCall, nranks: int) -> None:
        """Remembers a failed call until every member is past it (a bounded table)."""
        if len(failed.done) < nranks:
            if len(table) >= _MAX_FAILED_CALLS:
                del table[next(iter(table))]
            table[seq] = failed

    def _fail_call(self, comm: Comm, seq: int, steps: list, default_code: int, msg: str,
                   codes: Optional[dict] = None, *, started: float, missing: list = ()) -> None:
        """Call ``seq`` failed at one of its steps (``steps``, already answered): remember it so
        that its other steps -- already waiting in other slots, or still to come -- fail the
        same way instead of pairing with another call's steps. It is reported here, once."""
        self._report_failed_call(comm, seq, steps, _reported_code(default_code, codes), msg, started, missing)
        failed = FailedCall(default_code, msg, codes, steps)
        for key in [k for k in comm.slots if k[0] == seq]:
            slot = comm.slots.pop(key)
            self._waiting.pop(slot, None)
            for s in slot.steps:
                if s is not None:
                    self._answer_failed_step(comm.failed_calls, seq, failed, s, comm.nranks)
        failed.done.update(comm.gone_ranks)
        self._keep_failed_call(comm.failed_calls, seq, failed, comm.nranks)
        if comm.arena is not None:
            comm.arena.set_pending(len(comm.slots))

    @staticmethod
    def _forget_failed_calls(comm: Comm) -> None:
        """Drops failed calls every member has moved past (sent a later collective)."""
        live = [m.collective_at for m in comm.members if m.gone is None]
        oldest = min(live) if live else float("inf")
        for seq in [q for q in comm.failed_calls if q < oldest]:
            del comm.failed_calls[seq]

    def _run_slot(self, slot: Slot, now: float) -> None:
        steps = slot.steps
        comm = slot.comm
        first = steps[0].desc
        sig = steps[0].sig
        bad = None
        for s in steps:
            if s.error is not None:
                bad = s
                break
        if bad is None:
            for s in steps:
                if s.sig != sig:
                    msg = mismatch_message(comm, slot.seq, steps)
                    for t in steps:
                        self._op_done(t.group, t.index, P.NCCL_INVALID_USAGE, msg)
                    self._fail_call(comm, slot.seq, steps, P.NCCL_INVALID_USAGE, msg, started=slot.first_wall)
                    return
        else:
            rejected = "; ".join(f"rank {s.member.rank}: {s.error}" for s in steps if s.error)
            msg = f"{comm.label()} collective #{slot.seq}: invalid arguments ({rejected})"
            codes = {}
            for t in steps:
                code = P.NCCL_INVALID_ARGUMENT if t.error else P.NCCL_INVALID_USAGE
                codes[t.member.rank] = code
                self._op_done(t.group, t.index, code, msg)
            self._fail_call(comm, slot.seq, steps, P.NCCL_INVALID_USAGE, msg, codes, started=slot.first_wall)
            return
        kind = first[D_KIND]
        dt = DTYPES[first[D_DTYPE]]
        accounted = steps[0].group.accounted
        if any(s.group.accounted != accounted for s in steps):
            msg = (f"{comm.label()} collective #{slot.seq} {describe_op(first)}: ranks "
                   f"{[s.member.rank for s in steps if s.group.accounted]} run in proxy mode (real NCCL moves the "
                   f"data), ranks {[s.member.rank for s in steps if not s.group.accounted]} do not; every rank "
                   "must use the same FAKEGPU_DIST_MODE")
            for t in steps:
                self._op_done(t.group, t.index, P.NCCL_INVALID_USAGE, msg)
            self._fail_call(comm, slot.seq, steps, P.NCCL_INVALID_USAGE, msg, started=slot.first_wall)
            return
        if accounted:  # proxy mode: NVIDIA's NCCL moved the data; only match and account
            t0 = self.clock()
            self.n_ops += 1
            if self.recording:
                self._record_collective(slot, steps, first, dt, t0, t0)
            for s in steps:
                self._op_done(s.group, s.index, 0, None)
            return
        ins = []
        outs = []
        for s in steps:
            d = s.desc
            c = s.member.client
            ins.append(c.inp[d[D_IN_OFF]:d[D_IN_OFF] + d[D_IN_LEN]])
            outs.append(c.outp[d[D_OUT_OFF]:d[D_OUT_OFF] + d[D_OUT_LEN]])
        redop = first[D_REDOP]
        scalars = [s.desc[D_SCALAR] for s in steps] if redop == _PREMUL else None
        job = Execution(self, slot, first, dt, EXECUTORS[kind],
                        (dt, redop, first[D_STEP], first[D_ROOT], ins, outs, scalars),
                        sum(len(x) for x in ins) + sum(len(y) for y in outs))
        queue = self._executing.get(comm.id)
        if queue is not None:      # an earlier collective of this communicator is still running
            queue.append(job)
        elif self.offload is not None and job.nbytes >= OFFLOAD_MIN_BYTES:
            self._executing[comm.id] = collections.deque([job])
            self.offload(job)
        else:
            job.run()
            self._finish_execution(job)

    def _finish_execution(self, job: "Execution") -> None:
        slot, first, steps = job.slot, job.first, job.slot.steps
        comm = slot.comm
        if job.error is not None:  # a bug here must not take the coordinator down
            exc = job.error
            log.error("executing %s failed", describe_op(first), exc_info=(type(exc), exc, exc.__traceback__))
            msg = f"{comm.label()} collective #{slot.seq} {describe_op(first)}: internal error: {exc!r}"
            for t in steps:
                self._op_done(t.group, t.index, P.NCCL_INTERNAL_ERROR, msg)
            self._fail_call(comm, slot.seq, steps, P.NCCL_INTERNAL_ERROR, msg, started=slot.first_wall)
            return
        self.n_ops += 1
        if self.recording:
            self._record_collective(slot, steps, first, job.dt, job.t0, job.t1)
        for s in steps:
            self._op_done(s.group, s.index, 0, None)

    # ------------------------------------------------------------------ send / recv

    def _submit_p2p(self, step: Step, now: float) -> bool:
        """Pairs a Send or Recv step with its peer's by (match_seq, step_index) within its
        (communicator, sender, receiver). Returns True when a Send was queued unmatched.

        A step whose arguments were rejected (by the shim, or here) still takes its place, so
        the peer's matching step fails with it instead of pairing with a later call."""
        d = step.desc
        member = step.member
        comm = member.comm
        err = validate(d, member, member.client.S, step.group.accounted)[0]
        peer = d[D_ROOT]
        if err is not None:
            step.error = err
            if not 0 <= peer < comm.nranks or peer == member.rank or d[D_MATCH_SEQ] == 0 \
                    or not d[D_STEP_INDEX] < d[D_STEP_TOTAL]:
                # No pair to keep in step with: this rank's op alone fails.
                self._op_done(step.group, step.index, P.NCCL_INVALID_ARGUMENT,
                              f"{comm.label()} rank {member.rank} {describe_op(d)}: {err}")
                return False
        sending = d[D_KIND] == _SEND_KIND
        key = (member.rank, peer) if sending else (peer, member.rank)
        q = comm.p2p.get(key)
        if q is None:
            q = comm.p2p[key] = PairQueue()
        seq = d[D_MATCH_SEQ]
        if sending:
            if seq > q.sender_at:
                q.sender_at = seq
                if q.failed:
                    self._forget_failed_p2p(q)
        elif seq > q.receiver_at:
            q.receiver_at = seq
            if q.failed:
                self._forget_failed_p2p(q)
        failed = q.failed.get(seq)
        if failed is not None:
            self._answer_failed_step(q.failed, seq, failed, step, 2)
            return False
        skey = (seq, d[D_STEP_INDEX])
        mine, theirs = (q.sends, q.recvs) if sending else (q.recvs, q.sends)
        other = theirs.pop(skey, None)
        if other is not None:
            self._waiting.pop(other, None)
            if sending:
                self._match_p2p(comm, key, q, step, other)
            else:
                self._match_p2p(comm, key, q, other, step)
            return False
        if peer in comm.gone_ranks:
            what = (f"Send from rank {member.rank} to rank {peer}" if sending
                    else f"Recv on rank {member.rank} from rank {peer}")
            self._op_done(step.group, step.index, comm.gone_ranks[peer][0],
                          f"{comm.label()} {what}: {comm.gone_ranks[peer][1]}")
            return False
        if skey in mine:
            self._op_done(step.group, step.index, P.NCCL_INVALID_USAGE,
                          f"{comm.label()} rank {member.rank} sent step {d[D_STEP_INDEX]} of its "
                          f"{'Send' if sending else 'Recv'} #{seq} twice ({describe_op(d)})")
            return False
        step.deadline = now + self.timeout_s
        mine[skey] = step
        self._waiting[step] = None
        return sending

    @staticmethod
    def _forget_failed_p2p(q: PairQueue) -> None:
        oldest = min(q.sender_at, q.receiver_at)
        for seq in [s for s in q.failed if s < oldest]:
            del q.failed[seq]

    def _fail_p2p_call(self, q: PairQueue, seq: int, steps: list, default_code: int, msg: str,
                       codes: Optional[dict] = None, missing: list = ()) -> None:
        """Send/Recv call ``seq`` of a pair failed at one of its steps (``steps``, answered):
        its other steps, waiting or still to come, fail the same way. It is reported here, once."""
        self._report_failed_call(steps[0].member.comm, None, steps, _reported_code(default_code, codes), msg,
                                 min(self._arrival_wall(s) for s in steps), missing)
        failed = FailedCall(default_code, msg, codes, steps)
        for table in (q.sends, q.recvs):
            for skey in [k for k in table if k[0] == seq]:
                s = table.pop(skey)
                self._waiting.pop(s, None)
                self._answer_failed_step(q.failed, seq, failed, s, 2)
                self._parked_resolved(s, failed.code_for(s.member.rank), msg)
        self._keep_failed_call(q.failed, seq, failed, 2)

    def _match_p2p(self, comm: Comm, key: tuple, q: PairQueue, send: Step, recv: Step) -> None:
        sd, rd = send.desc, recv.desc
        q.matched += 1
        bad = [s for s in (send, recv) if s.error is not None]
        if bad or sd[D_DTYPE] != rd[D_DTYPE] or sd[D_STEP] != rd[D_STEP] or sd[D_TOTAL] != rd[D_TOTAL] \
                or sd[D_STEP_TOTAL] != rd[D_STEP_TOTAL]:
            if bad:
                why = "; ".join(f"rank {s.member.rank}: {s.error}" for s in bad)
                msg = (f"{comm.label()} Send/Recv #{sd[D_MATCH_SEQ]} from rank {key[0]} to rank {key[1]}: "
                       f"invalid arguments ({why})")
            else:
                msg = (f"{comm.label()} Send/Recv #{sd[D_MATCH_SEQ]} from rank {key[0]} to rank {key[1]} disagree: "
                       f"rank {key[0]} sends {describe_op(sd)}; rank {key[1]} receives {describe_op(rd)}")
            codes = {s.member.rank: (P.NCCL_INVALID_ARGUMENT if s.error else P.NCCL_INVALID_USAGE)
                     for s in (send, recv)}
            if send.payload is None:
                self._op_done(send.group, send.index, codes[send.member.rank], msg)
            self._parked_resolved(send, codes[send.member.rank], msg)
            self._op_done(recv.group, recv.index, codes[recv.member.rank], msg)
            self._fail_p2p_call(q, sd[D_MATCH_SEQ], [send, recv], P.NCCL_INVALID_USAGE, msg, codes)
            return
        if send.group.accounted or recv.group.accounted:
            t0 = self.clock()
            if send.group.accounted == recv.group.accounted:  # proxy mode: real NCCL moved the data
                self.n_ops += 1
                if self.recording:
                    self._record_p2p(comm, key, q, send, recv, t0, t0)
                self._op_done(send.group, send.index, 0, None)
                self._op_done(recv.group, recv.index, 0, None)
                return
            msg = (f"{comm.label()} Send/Recv #{q.matched - 1} from rank {key[0]} to rank {key[1]}: one side runs "
                   "in proxy mode and the other does not; every rank must use the same FAKEGPU_DIST_MODE")
            if send.payload is None:
                self._op_done(send.group, send.index, P.NCCL_INVALID_USAGE, msg)
            self._parked_resolved(send, P.NCCL_INVALID_USAGE, msg)
            self._op_done(recv.group, recv.index, P.NCCL_INVALID_USAGE, msg)
            self._fail_p2p_call(q, sd[D_MATCH_SEQ], [send, recv], P.NCCL_INVALID_USAGE, msg)
            return
        src = send.payload
        if src is None:
            src = send.member.client.inp[sd[D_IN_OFF]:sd[D_IN_OFF] + sd[D_IN_LEN]]
        dst = recv.member.client.outp[rd[D_OUT_OFF]:rd[D_OUT_OFF] + rd[D_OUT_LEN]]
        t0 = self.clock()
        copy_p2p(src, dst)
        self.n_ops += 1
        if self.recording:
            self._record_p2p(comm, key, q, send, recv, t0, self.clock())
        if send.payload is None:
            self._op_done(send.group, send.index, 0, None)
        self._parked_resolved(send, 0, None)
        self._op_done(recv.group, recv.index, 0, None)

    # ------------------------------------------------------------------ timeouts

    def _expire_slot(self, slot: Slot) -> None:
        comm = slot.comm
        comm.slots.pop((slot.seq, slot.step_index), None)
        if comm.arena is not None:
            comm.arena.set_pending(len(comm.slots))
        arrived = [s for s in slot.steps if s is not None]
        missing = [r for r, s in enumerate(slot.steps) if s is None]
        asked = "; ".join(f"rank {s.member.rank} asked {describe_op(s.desc)}" for s in arrived)
        msg = (f"{comm.label()} collective #{slot.seq} {describe_op(arrived[0].desc)}: "
               f"ranks {missing} did not arrive within {self.timeout_ms} ms "
               f"(FAKEGPU_COORDINATOR_TIMEOUT_MS); arrived: {asked}")
        log.warning("timeout: %s", msg)
        for s in arrived:
            self._op_done(s.group, s.index, P.NCCL_TIMEOUT, msg)
        self._fail_call(comm, slot.seq, arrived, P.NCCL_TIMEOUT, msg, started=slot.first_wall, missing=missing)

    def _expire_p2p(self, step: Step) -> None:
        d = step.desc
        comm = step.member.comm
        me = step.member.rank
        peer = d[D_ROOT]
        sending = d[D_KIND] == _SEND_KIND
        q = comm.p2p.get((me, peer) if sending else (peer, me))
        if q is not None:
            table = q.sends if sending else q.recvs
            skey = (d[D_MATCH_SEQ], d[D_STEP_INDEX])
            if table.get(skey) is step:
                del table[skey]
        msg = (f"{comm.label()} rank {me} {describe_op(d)}: rank {peer} did not post the matching "
               f"{'Recv' if sending else 'Send'} within {self.timeout_ms} ms (FAKEGPU_COORDINATOR_TIMEOUT_MS)")
        log.warning("timeout: %s", msg)
        self._op_done(step.group, step.index, P.NCCL_TIMEOUT, msg)
        self._parked_resolved(step, P.NCCL_TIMEOUT, msg)
        if q is not None:
            self._fail_p2p_call(q, d[D_MATCH_SEQ], [step], P.NCCL_TIMEOUT, msg, missing=[peer])
        else:
            self._report_failed_call(comm, None, [step], P.NCCL_TIMEOUT, msg, self._arrival_wall(step), [peer])

    def _expire_init(self, rdv: InitRendezvous) -> None:
        self.inits.pop(rdv.uid, None)
        missing = [r for r in range(rdv.nranks) if r not in rdv.arrivals]
        msg = (f"communicator init {self._uid_label(rdv)} of {rdv.nranks} ranks: ranks {missing} did not "
               f"arrive within {self.timeout_ms} ms (FAKEGPU_COORDINATOR_TIMEOUT_MS); arrived: "
               f"{sorted(rdv.arrivals)}")
        log.warning("timeout: %s", msg)
        arrived = sorted(rdv.arrivals)
        self._event("init_timeout", name=rdv.name, unique_id=rdv.uid[:8].hex(), nranks=rdv.nranks,
                    arrived_ranks=arrived, missing_ranks=missing,
                    arrived_global_ranks=[self._known_global_rank(rdv.arrivals[r][0]) for r in arrived],
                    timeout_ms=self.timeout_ms, message=msg)
        for client, rid, _ in rdv.arrivals.values():
            self._error(client, rid, P.NCCL_TIMEOUT, msg)

    @staticmethod
    def _known_global_rank(client: Client) -> int:
        """The global rank of a process waiting in a communicator init, or -1 when it has none yet
        (no RANK and no communicator so far); for one process holding several ranks, its first."""
        return client.global_ranks[0] if client.global_ranks else -1

    def _expire_split(self, rdv: SplitRendezvous) -> None:
        comm = rdv.comm
        comm.splits.pop(rdv.seq, None)
        missing = [r for r in range(comm.nranks) if r not in rdv.arrivals]
        msg = (f"ncclCommSplit #{rdv.seq} on {comm.label()}: ranks {missing} did not arrive within "
               f"{self.timeout_ms} ms (FAKEGPU_COORDINATOR_TIMEOUT_MS); arrived: {sorted(rdv.arrivals)}")
        log.warning("timeout: %s", msg)
        for a in rdv.arrivals.values():
            self._error(a[0].client, a[1], P.NCCL_TIMEOUT, msg)
        # A member that arrives after this has timed out starts a new rendezvous with the
        # same sequence number, which times out in turn and names the members missing then.

    # ------------------------------------------------------------------ faults and events

    def _event(self, event: str, **fields) -> None:
        """A failure or recovery event for the report's events section (bounded)."""
        item = {"event": event, "at": self.wall(), **fields}
        if len(self.events) < self.max_events:
            self.events.append(item)
        else:
            self.dropped_events += 1
        if self.recording and hasattr(self.recorder, "fault_event"):
            try:
                self.recorder.fault_event(item)
            except Exception:  # the report must never break the data path
                log.exception("recorder failed on fault_event")

    def _report_failed_call(self, comm: Comm, seq: Optional[int], steps: list, code: int, msg: str,
                            started: float, missing) -> None:
        """A call failed: one op_failed event and one failed record in the report, so that
        totals.failed_operations counts failed calls and equals the op_failed events. Callers
        call this once per call (_fail_call, _fail_p2p_call, the first step to find a member gone)."""
        if not steps:
            return
        self._op_failed_event(comm, seq, steps, code, msg, list(missing))
        self._record_failure(comm, seq if seq is not None else steps[0].desc[D_MATCH_SEQ], steps, code, msg, started)

    def _arrival_wall(self, step: Step) -> float:
        """Epoch seconds at which a step arrived (steps keep monotonic times)."""
        return self.wall() - max(0.0, self.clock() - step.arrived_at)

    def _op_failed_event(self, comm: Comm, seq, steps: list, code: int, msg: str, missing: list) -> None:
        d = steps[0].desc if steps else None
        self._event("op_failed", comm=comm.id, name=comm.name, seq=seq,
                    call_seq=d[D_CALL_SEQ] if d else None,
                    op=P.KIND_NAMES.get(d[D_KIND], str(d[D_KIND])) if d else None,
                    result=P.RESULT_NAMES.get(code, str(code)),
                    arrived_ranks=sorted(s.member.rank for s in steps), missing_ranks=list(missing),
                    message=msg)

    def _inject(self, client: Client, group: GroupState, descs: list, fault, d, member: Member) -> bool:
        """Carry out a fault that hit this GROUP frame; True when the frame is not to be
        submitted now (the rank is killed, dropped, hung or delayed)."""
        comm = member.comm
        where = (f"{comm.label()} rank {member.rank} (global {member.global_rank}) call {d[D_CALL_SEQ]} "
                 f"{describe_op(d)}")
        info = dict(kind=fault.kind, spec=fault.text, rank=member.global_rank, comm=comm.id,
                    comm_rank=member.rank, call_seq=d[D_CALL_SEQ], op=P.KIND_NAMES.get(d[D_KIND]))
        log.warning("fault injected: %s at %s", fault.text, where)
        if fault.kind == "delay":
            self._event("fault_injected", ms=fault.ms, **info)
            self._delayed.append((self.clock() + fault.ms / 1000.0, client, group, descs))
            return True
        if fault.kind == "hang":
            # The call is swallowed: the rank blocks with its connection open, its peers time out.
            self._event("fault_injected", **info)
            return True
        if fault.kind == "kill":
            info["action"] = self._kill(client)
        self._event("fault_injected", **info)
        client.close_reason = f"injected fault {fault.text}"
        self._out.append((CLOSE, client.id, f"fault injected: {fault.text} at {where}"))
        return True

    def _kill(self, client: Client) -> str:
        pid = client.hello.pid
        local = client.transport == "unix" or client.hello.hostname == socket.gethostname()
        if not local or pid <= 1 or pid in (os.getpid(), os.getppid()):
            return f"connection dropped (pid {pid} on {client.hello.hostname or '?'} cannot be signalled here)"
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError as exc:
            return f"SIGKILL to pid {pid} failed ({exc.strerror}); connection dropped"
        return f"SIGKILL sent to pid {pid}"

    def _release_delayed(self, now: float) -> None:
        due = [x for x in self._delayed if x[0] <= now]
        if not due:
            return
        self._delayed = [x for x in self._delayed if x[0] > now]
        for _, client, group, descs in due:
            if not client.closed and client.groups.get(group.request_id) is group:
                self._submit_group(client, group, descs)

    # ------------------------------------------------------------------ host-local collectives

    def _arena_refusal(self, comm: Comm) -> Optional[str]:
        """Why this communicator cannot have an arena, or None. Only communicator-level facts,
        so every member gets the same answer."""
        if not self.local_collectives:
            return "local collectives are switched off on the coordinator (FAKEGPU_LOCAL_COLLECTIVES=0)"
        if comm.nranks < 2:
            return f"the communicator has {comm.nranks} rank; local collectives need at least 2"
        if self.faults:
            return "a fault plan is loaded (FAKEGPU_FAULTS or the cluster config's faults); every call goes " \
                   "through the coordinator so the faults can hit it"
        if comm.gone_ranks:
            return f"rank {next(iter(comm.gone_ranks))} of the communicator is gone"
        seen: dict = {}
        for m in comm.members:
            c = m.client
            if not c.hello.flags & P.HELLO_FLAG_LOCAL:
                return f"rank {m.rank} ({c.describe()}) did not offer local collectives in HELLO"
            if not c.shm:
                return f"rank {m.rank} ({c.describe()}) has no shared-memory staging with the coordinator"
            if c.id in seen:
                return (f"ranks {seen[c.id]} and {m.rank} are in one process ({c.describe()}); an arena needs "
                        "one rank per process")
            seen[c.id] = m.rank
        return None

    def _arena(self, client: Client, frame: P.Frame) -> None:
        """ARENA: the communicator's arena, created by the first request of any member."""
        if len(frame.body) != 8:
            raise P.ProtocolError(f"ARENA body is {len(frame.body)} bytes, expected 8")
        (handle,) = _U64.unpack(frame.body)
        member = self._own_member(client, handle, "ARENA", frame.request_id)
        if member is None:
            return
        comm = member.comm
        if comm.arena is None and comm.arena_refusal is None:
            refusal = self._arena_refusal(comm)
            if refusal is None:
                slot = A.slot_bytes_for(comm.nranks, min(m.client.S for m in comm.members), self.local_slot_bytes)
                try:
                    comm.arena = self.arena_factory(comm.id, comm.nranks, slot)
                except OSError as exc:
                    # Decided once for the communicator, so this is its only line.
                    size = SHM.describe_bytes(A.total_bytes(comm.nranks, slot))
                    refusal = (f"cannot allocate its {size} arena in /dev/shm ({exc.strerror or exc}); "
                               "its collectives go through the coordinator")
                    log.warning("%s: %s", comm.label(), refusal)
                else:
                    self.arenas[comm.id] = comm.arena
                    self.n_arenas += 1
                    comm.arena.set_pending(len(comm.slots))   # calls may already wait here
                    log.debug("%s: arena %s, %d-byte slots", comm.label(), comm.arena.path, slot)
            comm.arena_refusal = refusal
        arena = comm.arena
        if arena is not None:
            body = (_ARENA_INFO_FIXED.pack(1, member.rank, arena.slot_bytes, arena.total_bytes)
                    + P.encode_str(arena.path) + _EMPTY_STR)
        else:
            body = (_ARENA_INFO_FIXED.pack(0, member.rank, 0, 0) + _EMPTY_STR
                    + P.encode_str(f"no arena for {comm.label()}: {comm.arena_refusal}", truncate=True))
        self._send(client, frame_bytes(P.ARENA_INFO, frame.request_id, body))

    def close_arenas(self) -> bool:
        """Stopping: raise ``closing`` in every arena; True when there was one (the caller then
        keeps reading LOCAL_OPS for a moment before it writes the reports)."""
        for arena in self.arenas.values():
            arena.set_closing()
        return bool(self.arenas)

    def _close_arena(self, comm_id: int) -> None:
        arena = self.arenas.pop(comm_id, None)
        if arena is not None:
            arena.close()

    def _local_ops(self, client: Client, frame: P.Frame) -> None:
        """LOCAL_OPS: comm rank 0's report of calls the ranks ran in their arena. Each is
        recorded like a collective matched here. Never answered; anything malformed is a
        protocol error (the connection closes)."""
        body = frame.body
        if len(body) < _LOCAL_OPS_FIXED.size:
            raise P.ProtocolError(f"LOCAL_OPS body of {len(body)} bytes is shorter than its 16-byte prefix")
        handle, n_records, nranks = _LOCAL_OPS_FIXED.unpack_from(body, 0)
        record_len = P.LOCAL_RECORD_FIXED + 8 * nranks
        if len(body) != _LOCAL_OPS_FIXED.size + n_records * record_len:
            raise P.ProtocolError(f"LOCAL_OPS declares {n_records} records of {nranks} ranks "
                                  f"({n_records * record_len} bytes) but its body holds {len(body) - 16}")
        member = self.handles.get(handle)
        if member is None or member.client is not client:
            if self._freed.get(handle) is client:
                # Sent before this process freed the communicator, which then went: nothing to add to.
                log.debug("LOCAL_OPS for freed handle %#x dropped (%d records)", handle, n_records)
                return
            raise P.ProtocolError(f"LOCAL_OPS: handle {handle:#x} is not a communicator of this process")
        comm = member.comm
        if member.rank != 0:
            raise P.ProtocolError(f"LOCAL_OPS from rank {member.rank} of {comm.label()}; only rank 0 sends it")
        if nranks != comm.nranks:
            raise P.ProtocolError(f"LOCAL_OPS for {comm.label()} says nranks {nranks}")
        if comm.arena is None:
            raise P.ProtocolError(f"LOCAL_OPS for {comm.label()}, which has no arena")
        waits_st = struct.Struct(f"<{nranks}d")
        records = []
        pos = _LOCAL_OPS_FIXED.size
        for i in range(n_records):
            d = _OPDESC_UNPACK(body, pos)
            times = _LOCAL_TIMES.unpack_from(body, pos + P.OPDESC_SIZE)
            waits = waits_st.unpack_from(body, pos + P.LOCAL_RECORD_FIXED)
            pos += record_len
            problem = self._local_record_problem(d, times, waits, handle, comm)
            if problem:
                raise P.ProtocolError(f"LOCAL_OPS record {i} for {comm.label()}: {problem}")
            records.append((d, times, waits))
        self.n_ops += n_records
        self.n_local_ops += n_records
        comm.local_records += n_records
        if not self.recording:
            return
        global_ranks = comm.record.global_ranks
        for d, (started, rendezvous, execution), waits in records:
            call = {"started_at": started, "seq": d[D_MATCH_SEQ] - 1, "rendezvous_s": rendezvous,
                    "execution_s": execution, "socket_bytes": 0, "waits": dict(zip(global_ranks, waits)),
                    "arrived": {g: started + rendezvous - w for g, w in zip(global_ranks, waits)}}
            self._emit_collective(comm, d, DTYPES[d[D_DTYPE]], call)

    @staticmethod
    def _local_record_problem(d: tuple, times: tuple, waits: tuple, handle: int, comm: Comm) -> Optional[str]:
        kind = d[D_KIND]
        if kind not in _LOCAL_KINDS:
            return f"kind {P.KIND_NAMES.get(kind, kind)} is not run in an arena"
        if d[D_HANDLE] != handle:
            return f"its OpDesc names handle {d[D_HANDLE]:#x}, the frame {handle:#x}"
        if d[D_DTYPE] not in DTYPES:
            return f"unknown datatype {d[D_DTYPE]}"
        if d[D_MATCH_SEQ] == 0 or d[D_FLAGS] & P.OP_FLAG_REJECTED:
            return "match_seq 0 or a rejected call (an arena runs only whole, valid calls)"
        if kind in P.REDUCING_KINDS and d[D_REDOP] not in P.REDOP_NAMES:
            return f"unknown reduction operator {d[D_REDOP]}"
        if kind in P.ROOTED_KINDS and not 0 <= d[D_ROOT] < comm.nranks:
            return f"root {d[D_ROOT]} is not a rank of the communicator"
        started, rendezvous, execution = times
        if not (math.isfinite(started) and 0 <= rendezvous < 1e9 and 0 <= execution < 1e9
                and all(0 <= w < 1e9 for w in waits)):
            return f"times out of range (started_at {started}, rendezvous {rendezvous} s, " \
                   f"execution {execution} s, arrival waits {list(waits)})"
        return None

    # ------------------------------------------------------------------ simulate

    def _simulate(self, client: Client, frame: P.Frame) -> None:
        msg = P.decode_body(P.SIMULATE, frame.body)
        rid = frame.request_id
        if self.cost_fn is None:
            self._error(client, rid, P.NCCL_INVALID_USAGE,
                        "SIMULATE: the cost model (fakegpu.costmodel) is not available in this coordinator")
            return
        total = 0.0
        for i, op in enumerate(msg.ops):
            member = self.handles.get(op.comm_handle)
            if member is None or member.client is not client:
                self._error(client, rid, P.NCCL_INVALID_ARGUMENT,
                            f"SIMULATE op {i}: communicator handle {op.comm_handle:#x} is not a live "
                            "communicator of this process")
                return
            dt = DTYPES.get(op.datatype)
            if dt is None or op.kind not in P.KIND_NAMES:
                self._error(client, rid, P.NCCL_INVALID_ARGUMENT,
                            f"SIMULATE op {i}: unknown kind {op.kind} or datatype {op.datatype}")
                return
            root, peer = op.root, -1
            if op.kind == _SEND_KIND:
                root, peer = member.rank, op.root
            elif op.kind == _RECV_KIND:
                root, peer = op.root, member.rank
            kind = "SendRecv" if op.kind in P.P2P_KINDS else P.KIND_NAMES[op.kind]
            try:
                total += float(self.cost_fn(kind, op.total_count, dt.size, member.comm.record.global_ranks,
                                            root, peer, self.topology))
            except Exception as exc:
                self._error(client, rid, P.NCCL_INTERNAL_ERROR, f"SIMULATE op {i}: cost model failed: {exc}")
                return
        self._send(client, frame_bytes(P.SIMULATE_DONE, rid, struct.pack("<d", total * 1e6)))

    # ------------------------------------------------------------------ accounting

    def _record_collective(self, slot: Slot, steps: list, first: tuple, dt, t0: float, t1: float) -> None:
        comm = slot.comm
        call = comm.call
        if call is None or first[D_FLAGS] & _FIRST:
            call = comm.call = {"started_at": slot.first_wall, "seq": slot.seq - 1,
                                "rendezvous_s": 0.0, "execution_s": 0.0, "socket_bytes": 0, "waits": {},
                                "arrived": {}, "frames": {}}
        last_arrival = max(s.arrived_at for s in steps)
        call["rendezvous_s"] += last_arrival - slot.first_at
        call["execution_s"] += t1 - t0
        waits = call["waits"]
        for s in steps:
            g = s.member.global_rank
            waits[g] = waits.get(g, 0.0) + (last_arrival - s.arrived_at)
            if g not in call["arrived"]:
                call["arrived"][g] = self._arrival_wall(s)
                call["frames"][g] = (s.group.client.id, s.group.request_id)
            if not s.member.client.shm and not s.group.accounted:
                call["socket_bytes"] += s.desc[D_IN_LEN] + s.desc[D_OUT_LEN]
        if first[D_FLAGS] & _LAST or not first[D_FLAGS] & (_FIRST | _LAST):
            comm.call = None
            self._emit_collective(comm, first, dt, call)

    def _emit_collective(self, comm: Comm, d: tuple, dt, call: dict) -> None:
        """Record one whole collective call that succeeded on every member (matched here, or
        run by the ranks in their arena and reported by LOCAL_OPS)."""
        kind = d[D_KIND]
        self._emit(comm, P.KIND_NAMES[kind], dt, d[D_REDOP] if kind in P.REDUCING_KINDS else None,
                   d[D_TOTAL], d[D_ROOT] if kind in P.ROOTED_KINDS else -1, -1,
                   tuple(range(comm.nranks)), logical_bytes(kind, d[D_TOTAL], dt.size, comm.nranks),
                   call, "ok", "")

    def _record_p2p(self, comm: Comm, key: tuple, q: PairQueue, send: Step, recv: Step,
                    t0: float, t1: float) -> None:
        sd = send.desc
        call = comm.p2p_calls.get(key)
        if call is None or sd[D_FLAGS] & _FIRST:
            call = comm.p2p_calls[key] = {"started_at": self.wall() - (t0 - send.arrived_at), "seq": q.matched - 1,
                                          "rendezvous_s": 0.0, "execution_s": 0.0, "socket_bytes": 0,
                                          "waits": {}, "arrived": {}, "frames": {}}
        later = max(send.arrived_at, recv.arrived_at)
        call["rendezvous_s"] += abs(send.arrived_at - recv.arrived_at)
        call["execution_s"] += t1 - t0
        for s in (send, recv):
            g = s.member.global_rank
            call["waits"][g] = call["waits"].get(g, 0.0) + (later - s.arrived_at)
            if g not in call["arrived"]:
                call["arrived"][g] = self._arrival_wall(s)
                call["frames"][g] = (s.group.client.id, s.group.request_id)
        if not send.member.client.shm and send.payload is None and not send.group.accounted:
            call["socket_bytes"] += sd[D_IN_LEN]
        if not recv.member.client.shm and not recv.group.accounted:
            call["socket_bytes"] += recv.desc[D_OUT_LEN]
        if sd[D_FLAGS] & _LAST or not sd[D_FLAGS] & (_FIRST | _LAST):
            del comm.p2p_calls[key]
            dt = DTYPES[sd[D_DTYPE]]
            self._emit(comm, "SendRecv", dt, None, sd[D_TOTAL], key[0], key[1], key,
                       sd[D_TOTAL] * dt.size, call, "ok", "")

    def _record_failure(self, comm: Comm, seq: int, steps: list, code: int, msg: str, started: float) -> None:
        if not self.recording or not steps:
            return
        # Describe the call as a member that passed valid arguments asked for it.
        d = next((s.desc for s in steps if not s.desc[D_FLAGS] & P.OP_FLAG_REJECTED), steps[0].desc)
        dt = DTYPES.get(d[D_DTYPE]) or DTYPES[0]
        kind = d[D_KIND] if d[D_KIND] in P.KIND_NAMES else P.KIND_ALLREDUCE
        call = {"started_at": started, "seq": seq - 1, "rendezvous_s": 0.0, "execution_s": 0.0,
                "socket_bytes": 0, "waits": {},
                "arrived": {s.member.global_rank: self._arrival_wall(s) for s in steps}}
        self._emit(comm, P.KIND_NAMES.get(kind, str(kind)), dt,
                   d[D_REDOP] if kind in P.REDUCING_KINDS else None, d[D_TOTAL],
                   d[D_ROOT] if kind in P.ROOTED_KINDS else -1, -1,
                   tuple(s.member.rank for s in steps), logical_bytes(kind, d[D_TOTAL], dt.size, comm.nranks),
                   call, _STATUS_BY_RESULT.get(code, "error"), msg)

    def _emit(self, *args) -> None:
        if self.defer_records:
            self._records.append(args)
        else:
            self._deliver(*args)

    def flush_records(self) -> None:
        """Deliver the op records deferred so far (the server calls this after the answers
        of a batch of frames went out, so accounting never delays a rank)."""
        if self._records:
            records, self._records = self._records, []
            for args in records:
                self._deliver(*args)

    def _deliver(self, comm, kind_name, dt, redop, count, root, peer, ranks, nbytes, call, status, error):
        try:
            self.recorder.op_completed(OpRecord(
                comm=comm.record, kind=kind_name, datatype=dt.name,
                redop=P.REDOP_NAMES.get(redop) if redop is not None else None, count=count,
                elem_size=dt.size, root=root, peer=peer, ranks=tuple(ranks), logical_bytes=nbytes,
                socket_bytes=call["socket_bytes"], seq=call["seq"], started_at=call["started_at"],
                rendezvous_s=call["rendezvous_s"], execution_s=call["execution_s"],
                arrival_wait_s=dict(call["waits"]), status=status, error=error,
                arrived_at=dict(call.get("arrived", {})), frames=dict(call.get("frames", {}))))
        except Exception:  # the report must never break the data path
            log.exception("recorder failed on op_completed")


class Execution:
    """One matched collective's computation. ``run()`` is the only part that may run off the
    I/O thread (it reads and writes staging memory only); ``Core.executed`` then answers it.
    Collectives of one communicator execute and are answered in their order: later ones wait
    in ``Core._executing`` while an earlier one runs."""
    __slots__ = ("slot", "comm_id", "first", "dt", "fn", "args", "nbytes", "clock", "t0", "t1", "error")

    def __init__(self, core: Core, slot: Slot, first: tuple, dt, fn, args: tuple, nbytes: int):
        self.slot = slot
        self.comm_id = slot.comm.id
        self.first = first
        self.dt = dt
        self.fn = fn
        self.args = args
        self.nbytes = nbytes
        self.clock = core.clock
        self.t0 = self.t1 = 0.0
        self.error: Optional[BaseException] = None

    def run(self) -> None:
        self.t0 = self.clock()
        try:
            self.fn(*self.args)
        except Exception as exc:
            self.error = exc
        self.t1 = self.clock()


def _version() -> str:
    try:
        from fakegpu import __version__
        return __version__
    except Exception:  # pragma: no cover
        return "unknown"
