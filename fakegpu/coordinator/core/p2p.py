"""Send/Recv: steps matched per (communicator, sender, receiver) by match_seq, copied, failed together.
"""
from __future__ import annotations

from typing import Optional

from fakegpu import protocol as P
from fakegpu.coordinator.collectives.sendrecv import execute as copy_p2p
from fakegpu.coordinator.matching import (D_DTYPE, D_IN_LEN, D_IN_OFF, D_KIND, D_MATCH_SEQ, D_OUT_LEN,
                                          D_OUT_OFF, D_ROOT, D_STEP, D_STEP_INDEX, D_STEP_TOTAL, D_TOTAL,
                                          FailedCall, PairQueue, Step, describe_op, validate)
from fakegpu.coordinator.registry import Comm

from .common import _SEND_KIND, _reported_code, log


class P2PMixin:
    """The Core's Send/Recv (mixed into fakegpu.coordinator.core.Core)."""

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
                step.fail()
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
            step.fail()
            self._answer_failed_step(q.failed, seq, failed, step, 2)
            return False
        skey = (seq, d[D_STEP_INDEX])
        mine, theirs = (q.sends, q.recvs) if sending else (q.recvs, q.sends)
        other = theirs.pop(skey, None)
        if other is not None:
            self._waiting.pop(other, None)
            other.match()
            step.match()
            if sending:
                self._match_p2p(comm, key, q, step, other)
            else:
                self._match_p2p(comm, key, q, other, step)
            return False
        if peer in comm.gone_ranks:
            what = (f"Send from rank {member.rank} to rank {peer}" if sending
                    else f"Recv on rank {member.rank} from rank {peer}")
            step.fail()
            self._op_done(step.group, step.index, comm.gone_ranks[peer][0],
                          f"{comm.label()} {what}: {comm.gone_ranks[peer][1]}")
            return False
        if skey in mine:
            step.fail()
            self._op_done(step.group, step.index, P.NCCL_INVALID_USAGE,
                          f"{comm.label()} rank {member.rank} sent step {d[D_STEP_INDEX]} of its "
                          f"{'Send' if sending else 'Recv'} #{seq} twice ({describe_op(d)})")
            return False
        step.deadline = now + self.timeout_s
        step.queue()
        mine[skey] = step
        self._waiting[step] = None
        if sending and self._probes:
            self._wake_probes(comm, peer)   # the receiver may wait to learn who sends to it
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
                s.fail()
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
            send.fail()
            recv.fail()
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
                send.complete()
                recv.complete()
                self._op_done(send.group, send.index, 0, None)
                self._op_done(recv.group, recv.index, 0, None)
                return
            msg = (f"{comm.label()} Send/Recv #{q.matched - 1} from rank {key[0]} to rank {key[1]}: one side runs "
                   "in proxy mode and the other does not; every rank must use the same FAKEGPU_DIST_MODE")
            send.fail()
            recv.fail()
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
        send.complete()
        recv.complete()
        if send.payload is None:
            self._op_done(send.group, send.index, 0, None)
        self._parked_resolved(send, 0, None)
        self._op_done(recv.group, recv.index, 0, None)

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
        step.expire()
        msg = (f"{comm.label()} rank {me} {describe_op(d)}: rank {peer} did not post the matching "
               f"{'Recv' if sending else 'Send'} within {self.timeout_ms} ms (FAKEGPU_COORDINATOR_TIMEOUT_MS)")
        log.warning("timeout: %s", msg)
        self._op_done(step.group, step.index, P.NCCL_TIMEOUT, msg)
        self._parked_resolved(step, P.NCCL_TIMEOUT, msg)
        if q is not None:
            self._fail_p2p_call(q, d[D_MATCH_SEQ], [step], P.NCCL_TIMEOUT, msg, missing=[peer])
        else:
            self._report_failed_call(comm, None, [step], P.NCCL_TIMEOUT, msg, self._arrival_wall(step), [peer])
