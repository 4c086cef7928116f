"""The coordinator's logic, sans I/O.

``Core.on_frame(conn_id, frame)`` takes one decoded frame header + body from a
connection and returns *actions* for the I/O layer:

    (SEND, conn_id, data)      data is bytes, or a list of bytes-like pieces to write in order
    (CLOSE, conn_id, reason)   close that connection after flushing what was queued
    (SHUTDOWN, None, reason)   write the reports and stop the coordinator
    (KILL, conn_id, pid)       SIGKILL that rank process (an injected fault); a CLOSE follows
    (ARENA_*, arena, value)    write an arena's pending / failed / closing flag, or unlink it
                               (core/common.py); performed before the batch's other actions

``Core.tick(now)`` fails whatever has waited past the timeout; ``Core.disconnect`` fails
the peers of a process that went away. Time comes from the injected ``clock``
(monotonic seconds) and ``wall`` (epoch seconds), so tests drive every timeout with a
fake clock. Collective results are computed in place in the clients' staging buffers
(numpy views) by the modules in ``collectives/``.
"""
from __future__ import annotations

import hmac
import json
import logging
import os
import socket
import time
from collections import OrderedDict
from typing import Callable, Optional

from fakegpu import protocol as P
from fakegpu.coordinator import arena as A, shm as SHM
from fakegpu.coordinator.faults import FaultPlan, load_plan
from fakegpu.coordinator.matching import Slot, Step
from fakegpu.common.records import NullRecorder
from fakegpu.coordinator.registry import Client, InitRendezvous, ShrinkRendezvous, SplitRendezvous
from fakegpu.topology.model import rank_ranges

from .accounting import AccountingMixin
from .anysource import AnySourceMixin
from .arenas import ArenasMixin
from .common import (CLOSE, DEFAULT_STAGING_BYTES, MAX_STAGING_BYTES, MIN_STAGING_BYTES, OFFLOAD_MIN_BYTES,
                     SEND, SHUTDOWN, _env_local_collectives, _env_local_slot_bytes, _version,
                     default_staging_factory, error_frame, frame_bytes, log)
from .communicators import CommunicatorsMixin
from .groups import Execution, GroupsMixin
from .injection import InjectionMixin
from .p2p import P2PMixin


class Core(CommunicatorsMixin, GroupsMixin, P2PMixin, AnySourceMixin, ArenasMixin, AccountingMixin, InjectionMixin):
    def __init__(self, *, token: str = "", timeout_ms: int = 600_000,
                 default_staging_bytes: int = DEFAULT_STAGING_BYTES,
                 max_staging_bytes: int = MAX_STAGING_BYTES, recorder=None,
                 clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time,
                 transport: str = "unix", cost_fn=None, topology=None, defer_records: bool = False,
                 faults: Optional[FaultPlan] = None, max_events: int = 1000,
                 local_collectives: Optional[bool] = None, local_slot_bytes: Optional[int] = None,
                 arena_factory: Optional[A.ArenaFactory] = None, host_shm_bytes: Optional[int] = None,
                 hostname: Optional[str] = None, own_pids: Optional[tuple] = None):
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
        # Who "this host" and "this process" are, for deciding which rank processes a KILL may
        # reach (never the coordinator itself or its parent, the launcher).
        self.hostname = hostname if hostname is not None else socket.gethostname()
        self.own_pids = own_pids if own_pids is not None else (os.getpid(), os.getppid())
        self.transport = transport
        self.cost_fn = cost_fn
        self.topology = topology
        self.started_wall = wall()
        self.clients: dict = {}
        self.handles: dict = {}
        self.comms: dict = {}
        self.inits: dict = {}
        self._waiting: OrderedDict = OrderedDict()   # item -> None; deadline order
        # PROBE_SOURCE requests waiting for a Send (anysource.py), in arrival order; kept apart
        # from _waiting because their deadlines come from the callers, not in arrival order.
        self._probes: list = []
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
            elif t == P.PROBE_SOURCE:
                self._probe_source(client, frame)
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
            nxt.start()
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
        client.disconnect()
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
                rdv.fail()
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
        if self._probes:
            self._tick_probes(now)
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

    def close(self) -> list:
        """The coordinator is stopping: actions unlinking every arena still there (ARENA_CLOSE)."""
        out = self._out = []
        for comm_id in list(self.arenas):
            self._close_arena(comm_id)
        return out

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

    def _send(self, client: Client, data) -> None:
        if not client.closed:
            self._out.append((SEND, client.id, data))

    def _error(self, client: Client, request_id: int, result: int, message: str) -> None:
        self.n_errors += 1
        self._send(client, error_frame(request_id, result, message))

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
        return frame_bytes(P.PONG, request_id, P.encode_body(P.Pong(json.dumps(self.describe()))))

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
        body = P.encode_body(P.HelloOk(conn_id, flags, S, self.timeout_ms))
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
