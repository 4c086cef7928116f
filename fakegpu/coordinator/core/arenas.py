"""Host-local arenas: ARENA requests granted or refused, arena files closed, LOCAL_OPS records checked
and accounted.
"""
from __future__ import annotations

import math
from typing import Optional

from fakegpu import protocol as P
from fakegpu.coordinator import arena as A, shm as SHM
from fakegpu.common.dtypes import DTYPES
from fakegpu.coordinator.matching import D_DTYPE, D_FLAGS, D_HANDLE, D_KIND, D_MATCH_SEQ, D_REDOP, D_ROOT
from fakegpu.coordinator.registry import Client, Comm

from .common import (ARENA_CLOSE, ARENA_CLOSING, ARENA_FAILED, ARENA_PENDING, _LOCAL_KINDS,
                     frame_bytes, log)


class ArenasMixin:
    """The Core's arenas (mixed into fakegpu.coordinator.core.Core)."""

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
        handle = P.decode_body(P.ARENA, frame.body).comm_handle
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
                    self._arena_pending(comm)   # calls may already wait here
                    log.debug("%s: arena %s, %d-byte slots", comm.label(), comm.arena.path, slot)
            comm.arena_refusal = refusal
        arena = comm.arena
        if arena is not None:
            info = P.ArenaInfo(1, member.rank, arena.slot_bytes, arena.total_bytes, arena.path)
        else:
            info = P.ArenaInfo(0, member.rank, reason=f"no arena for {comm.label()}: {comm.arena_refusal}")
        self._send(client, frame_bytes(P.ARENA_INFO, frame.request_id, P.encode_body(info)))

    def _arena_pending(self, comm: Comm) -> None:
        """Have the I/O layer publish how many collectives of ``comm`` wait here (ARENA_PENDING),
        when that changed and its arena is still open."""
        n = len(comm.slots)
        if n != comm.arena_pending and self.arenas.get(comm.id) is comm.arena:
            comm.arena_pending = n
            self._out.append((ARENA_PENDING, comm.arena, n))

    def _arena_failed(self, comm: Comm, rank: int) -> None:
        """The first member of ``comm`` to leave goes into its arena's ``failed`` (ARENA_FAILED)."""
        if not comm.arena_failed and self.arenas.get(comm.id) is comm.arena:
            comm.arena_failed = True
            self._out.append((ARENA_FAILED, comm.arena, rank))

    def close_arenas(self) -> list:
        """Stopping: actions raising ``closing`` in every arena (ARENA_CLOSING); none when there
        is no arena (otherwise the caller keeps reading LOCAL_OPS for a moment before it writes
        the reports)."""
        out = self._out = []
        for arena in self.arenas.values():
            out.append((ARENA_CLOSING, arena, None))
        return out

    def _close_arena(self, comm_id: int) -> None:
        arena = self.arenas.pop(comm_id, None)
        if arena is not None:
            self._out.append((ARENA_CLOSE, arena, None))

    def _local_ops(self, client: Client, frame: P.Frame) -> None:
        """LOCAL_OPS: comm rank 0's report of calls the ranks ran in their arena. Each is
        recorded like a collective matched here. Never answered; anything malformed is a
        protocol error (the connection closes)."""
        # The generated decoder checks every size against the body before building anything.
        r = P.Reader(frame.body, "LOCAL_OPS")
        handle, nranks, records = P.decode_local_ops_fields(r)
        r.done()
        n_records = len(records)
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
        for i, (d, *times, waits) in enumerate(records):
            problem = self._local_record_problem(d, times, waits, handle, comm)
            if problem:
                raise P.ProtocolError(f"LOCAL_OPS record {i} for {comm.label()}: {problem}")
        self.n_ops += n_records
        self.n_local_ops += n_records
        comm.local_records += n_records
        if not self.recording:
            return
        global_ranks = comm.record.global_ranks
        for d, started, rendezvous, execution, waits in records:
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
