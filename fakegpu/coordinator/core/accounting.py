"""Accounting: events, SIMULATE answers, and the records of completed and failed calls that the reports
are built from.
"""
from __future__ import annotations

from typing import Optional

from fakegpu import protocol as P
from fakegpu.common.dtypes import DTYPES
from fakegpu.coordinator.matching import (D_CALL_SEQ, D_DTYPE, D_FLAGS, D_IN_LEN, D_KIND, D_MATCH_SEQ,
                                          D_OUT_LEN, D_REDOP, D_ROOT, D_TOTAL, PairQueue, Slot, Step)
from fakegpu.common.records import OpRecord
from fakegpu.coordinator.registry import Client, Comm

from .common import _FIRST, _LAST, _RECV_KIND, _SEND_KIND, _STATUS_BY_RESULT, frame_bytes, log, logical_bytes


class AccountingMixin:
    """The Core's accounting (mixed into fakegpu.coordinator.core.Core)."""

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
        self._send(client, frame_bytes(P.SIMULATE_DONE, rid, P.encode_body(P.SimulateDone(total * 1e6))))

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
