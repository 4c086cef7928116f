"""GROUP and ACCOUNT frames: a rank's steps submitted in order, collective steps matched by
(match_seq, step_index) into slots, executed (on the event loop or a worker thread) and answered;
failed calls remembered so their later steps fail too.
"""
from __future__ import annotations

import collections
from typing import Optional

import numpy as np

from fakegpu import protocol as P
from fakegpu.coordinator.collectives import EXECUTORS
from fakegpu.common.dtypes import DTYPES
from fakegpu.coordinator.matching import (D_DTYPE, D_FLAGS, D_HANDLE, D_IN_LEN, D_IN_OFF, D_KIND,
                                          D_MATCH_SEQ, D_OUT_LEN, D_OUT_OFF, D_REDOP, D_ROOT, D_SCALAR,
                                          D_STEP, D_STEP_INDEX, D_STEP_TOTAL, D_TOTAL, FailedCall, GroupState,
                                          Slot, SplitGroup,
                                          Step, describe_op, ends_call, mismatch_message, order_of,
                                          validate)
from fakegpu.coordinator.collectives.numerics import step_offset
from fakegpu.coordinator.registry import Client, Comm, Member
from fakegpu.coordinator.states import (EXECUTION_TRANSITIONS, RESULT_PENDING, ExecutionState, GroupFrameState,
                                        Machine, MemberState, transition)

from .common import (OFFLOAD_MIN_BYTES, SEND, _DONE_ONE_OK, _GROUP_HEAD, _HDR, _MAX_FAILED_CALLS,
                     _MAX_SPLIT_GROUPS, _NO_PAYLOAD, _OPDESC_ITER, _OPDESC_SIZE, _OPDESC_UNPACK, _PREMUL,
                     _RECV_KIND, _SEND_KIND, _reported_code, log)


class GroupsMixin:
    """The Core's groups (mixed into fakegpu.coordinator.core.Core)."""

    def _group(self, client: Client, frame: P.Frame) -> None:
        body = frame.body
        rid = frame.request_id
        if len(body) < 8:
            raise P.ProtocolError(f"GROUP body of {len(body)} bytes is shorter than its 8-byte prefix")
        n_ops, flags = _GROUP_HEAD.unpack_from(body, 0)
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
            group.decide()
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
        n_ops, _flags = _GROUP_HEAD.unpack_from(body, 0)
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
            group.decide()
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
                if group.results[step.index] == RESULT_PENDING and step.payload is None:
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
        if group.results[index] != RESULT_PENDING:
            return
        group.results[index] = result
        if result:
            group.messages.append(message)
        group.remaining -= 1
        if group.remaining == 0:
            group.decide()
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
        # A final frame already answered (or dropped with its client) is not finished again.
        if final is not None and not split.parked and final.state is GroupFrameState.DECIDED:
            self._finish_group(final)

    def _finish_group(self, group: GroupState) -> None:
        """Answer a DECIDED group with GROUP_DONE, or drop it when nobody is to be answered; a
        split group's last frame stays DECIDED while Sends of its earlier frames are parked."""
        if group.unanswered:
            group.drop()
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
            group.drop()
            return
        group.answer()
        results = group.results
        n = len(results)
        if n == 1 and results[0] == 0:
            head = _DONE_ONE_OK
        else:
            msg = ""
            if group.messages:
                uniq = list(dict.fromkeys(group.messages))
                msg = "; ".join(uniq)
            head = P.encode_body(P.GroupDone(results, msg))
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
            slot.match()
            self._run_slot(slot, now)
        if comm.arena is not None:
            self._arena_pending(comm)

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
            slot.fail()
            for s in slot.steps:
                if s is not None:
                    self._answer_failed_step(comm.failed_calls, seq, failed, s, comm.nranks)
        failed.done.update(comm.gone_ranks)
        self._keep_failed_call(comm.failed_calls, seq, failed, comm.nranks)
        if comm.arena is not None:
            self._arena_pending(comm)

    @staticmethod
    def _forget_failed_calls(comm: Comm) -> None:
        """Drops failed calls every member has moved past (sent a later collective)."""
        live = [m.collective_at for m in comm.members if m.state is MemberState.LIVE]
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
                    slot.fail()
                    for t in steps:
                        self._op_done(t.group, t.index, P.NCCL_INVALID_USAGE, msg)
                    self._fail_call(comm, slot.seq, steps, P.NCCL_INVALID_USAGE, msg, started=slot.first_wall)
                    return
        else:
            rejected = "; ".join(f"rank {s.member.rank}: {s.error}" for s in steps if s.error)
            msg = f"{comm.label()} collective #{slot.seq}: invalid arguments ({rejected})"
            slot.fail()
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
            slot.fail()
            for t in steps:
                self._op_done(t.group, t.index, P.NCCL_INVALID_USAGE, msg)
            self._fail_call(comm, slot.seq, steps, P.NCCL_INVALID_USAGE, msg, started=slot.first_wall)
            return
        if accounted:  # proxy mode: NVIDIA's NCCL moved the data; only match and account
            t0 = self.clock()
            self.n_ops += 1
            if self.recording:
                self._record_collective(slot, steps, first, dt, t0, t0)
            slot.answer()
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
        args = (dt, redop, first[D_STEP], first[D_ROOT], ins, outs, scalars)
        order = order_of(first)
        if order:  # the plan is over the call's global element indices (docs/numerics.md)
            args += ((order, step_offset(first[D_STEP_INDEX], first[D_STEP_TOTAL], first[D_STEP], first[D_TOTAL]),
                      first[D_TOTAL]),)
        job = Execution(self, slot, first, dt, EXECUTORS[kind], args,
                        sum(len(x) for x in ins) + sum(len(y) for y in outs))
        slot.execute()
        queue = self._executing.get(comm.id)
        if queue is not None:      # an earlier collective of this communicator is still running
            queue.append(job)
        elif self.offload is not None and job.nbytes >= OFFLOAD_MIN_BYTES:
            self._executing[comm.id] = collections.deque([job])
            job.start()
            self.offload(job)
        else:
            job.start()
            job.run()
            self._finish_execution(job)

    def _finish_execution(self, job: "Execution") -> None:
        slot, first, steps = job.slot, job.first, job.slot.steps
        comm = slot.comm
        if job.error is not None:  # a bug here must not take the coordinator down
            job.fail()
            exc = job.error
            log.error("executing %s failed", describe_op(first), exc_info=(type(exc), exc, exc.__traceback__))
            msg = f"{comm.label()} collective #{slot.seq} {describe_op(first)}: internal error: {exc!r}"
            slot.fail()
            for t in steps:
                self._op_done(t.group, t.index, P.NCCL_INTERNAL_ERROR, msg)
            self._fail_call(comm, slot.seq, steps, P.NCCL_INTERNAL_ERROR, msg, started=slot.first_wall)
            return
        job.finish()
        self.n_ops += 1
        if self.recording:
            self._record_collective(slot, steps, first, job.dt, job.t0, job.t1)
        slot.answer()
        for s in steps:
            self._op_done(s.group, s.index, 0, None)

    def _expire_slot(self, slot: Slot) -> None:
        comm = slot.comm
        comm.slots.pop((slot.seq, slot.step_index), None)
        slot.expire()
        if comm.arena is not None:
            self._arena_pending(comm)
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


class Execution(Machine):
    """One matched collective's computation (states: ExecutionState). ``run()`` is the only
    part that may run off the I/O thread (it reads and writes staging memory only; the state
    moves on the I/O thread only); ``Core.executed`` then answers it. Collectives of one
    communicator execute and are answered in their order: later ones wait in
    ``Core._executing`` while an earlier one runs."""
    __slots__ = ("slot", "comm_id", "first", "dt", "fn", "args", "nbytes", "clock", "t0", "t1", "error", "state")
    TRANSITIONS = EXECUTION_TRANSITIONS

    def __init__(self, core, slot: Slot, first: tuple, dt, fn, args: tuple, nbytes: int):
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
        self.state = ExecutionState.WAITING

    start = transition("start")
    finish = transition("finish")
    fail = transition("fail")

    def run(self) -> None:
        self.t0 = self.clock()
        try:
            self.fn(*self.args)
        except Exception as exc:
            self.error = exc
        self.t1 = self.clock()
