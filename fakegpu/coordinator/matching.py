"""Matching state and diagnostics: collective slots, Send/Recv queues, op validation.

An OpDesc travels as the raw tuple ``OPDESC_STRUCT.unpack_from`` returns (no dataclass on
the hot path); the ``D_*`` constants name its indices.
"""
from __future__ import annotations

from typing import Optional

from fakegpu import protocol as P
from fakegpu.common.dtypes import DTYPES
from fakegpu.coordinator.states import (GROUP_FRAME_TRANSITIONS, P2P_TRANSITIONS, RESULT_PENDING, SLOT_TRANSITIONS,
                                        GroupFrameState, Machine, P2PState, SlotState, by_event, transition)

# Per-event tables of the Send/Recv and slot machines: these run once or more per op.
_P2P_QUEUE, _P2P_MATCH, _P2P_COMPLETE, _P2P_FAIL, _P2P_EXPIRE = (
    by_event(P2P_TRANSITIONS, e) for e in ("queue", "match", "complete", "fail", "expire"))
_SLOT_MATCH, _SLOT_EXECUTE, _SLOT_ANSWER, _SLOT_FAIL, _SLOT_EXPIRE = (
    by_event(SLOT_TRANSITIONS, e) for e in ("match", "execute", "answer", "fail", "expire"))
from fakegpu.wire_spec import (D_CALL_SEQ, D_DTYPE, D_FLAGS, D_HANDLE, D_IN_LEN, D_IN_OFF, D_KIND,  # noqa: F401
                               D_MATCH_SEQ, D_OUT_LEN, D_OUT_OFF, D_REDOP, D_ROOT, D_SCALAR, D_STEP,
                               D_STEP_INDEX, D_STEP_TOTAL, D_TOTAL)

_REDUCING = P.REDUCING_KINDS
_ROOTED = P.ROOTED_KINDS


class GroupState(Machine):
    """One GROUP (or ACCOUNT) frame of one client, until every op has completed or failed.
    ``accounted``: an ACCOUNT frame (proxy mode) -- matched and recorded, no data moves."""
    __slots__ = ("client", "request_id", "descs", "results", "messages", "remaining", "partial", "accounted",
                 "split", "unanswered", "state")
    TRANSITIONS = GROUP_FRAME_TRANSITIONS

    def __init__(self, client, request_id: int, descs: list, partial: bool, accounted: bool = False,
                 split: "Optional[SplitGroup]" = None):
        self.client = client
        self.request_id = request_id
        self.descs = descs
        self.results = [RESULT_PENDING] * len(descs)
        self.messages: list = []
        self.remaining = len(descs)
        self.partial = partial
        self.accounted = accounted
        self.split = split   # the group this frame is one of, when the group spans several frames
        self.unanswered = False   # rejected placeholders posted outside a group: no GROUP_DONE
        self.state = GroupFrameState.PENDING

    decide = transition("decide")
    answer = transition("answer")
    drop = transition("drop")


class SplitGroup:
    """A group a client sent in several GROUP frames (one group id in their flags). Sends
    parked from its partial frames were answered early; its final frame is answered only once
    each of them matched or failed, and fails with them, so a Send whose Recv disagrees (or
    never comes) fails on the sender too."""
    __slots__ = ("parked", "failure", "final")

    def __init__(self):
        self.parked: set = set()    # parked Send steps not yet matched
        self.failure = None         # (result, message) of the first parked Send that failed
        self.final = None           # the final frame's GroupState, once it came


class Step(Machine):
    """One op of a GROUP frame, as it waits to be matched. ``state`` is a Send/Recv step's
    (P2PState); a collective step stays ARRIVED, its slot holds the state."""
    __slots__ = ("group", "index", "desc", "member", "arrived_at", "error", "deadline", "payload", "sig",
                 "parked_in", "state")
    TRANSITIONS = P2P_TRANSITIONS

    def __init__(self, group: GroupState, index: int, desc: tuple, member, arrived_at: float):
        self.group = group
        self.index = index
        self.desc = desc
        self.member = member
        self.arrived_at = arrived_at
        self.error: Optional[str] = None   # set when this rank's arguments were rejected
        self.deadline = 0.0
        self.payload = None                # a Send's copied input, once its group went on
        self.sig = None                    # signature(desc), for collectives
        self.parked_in = None              # the SplitGroup of a parked Send
        self.state = P2PState.ARRIVED

    # Send/Recv transitions (states.P2P_TRANSITIONS).
    def queue(self) -> None:
        self._move(_P2P_QUEUE, "queue")

    def match(self) -> None:
        self._move(_P2P_MATCH, "match")

    def complete(self) -> None:
        self._move(_P2P_COMPLETE, "complete")

    def fail(self) -> None:
        self._move(_P2P_FAIL, "fail")

    def expire(self) -> None:
        self._move(_P2P_EXPIRE, "expire")


class Slot(Machine):
    """Step ``step_index`` of collective call ``seq`` (the match_seq) of every member of a
    communicator (states.SLOT_TRANSITIONS)."""
    __slots__ = ("comm", "seq", "step_index", "steps", "arrived", "first_at", "first_wall", "deadline", "state")
    TRANSITIONS = SLOT_TRANSITIONS

    def __init__(self, comm, seq: int, step_index: int, nranks: int, now: float, wall: float, deadline: float):
        self.comm = comm
        self.seq = seq
        self.step_index = step_index
        self.steps: list = [None] * nranks
        self.arrived = 0
        self.first_at = now
        self.first_wall = wall
        self.deadline = deadline
        self.state = SlotState.WAITING

    def match(self) -> None:
        """WAITING -> MATCHED: the last rank arrived (the slot left comm.slots and the deadline queue)."""
        self._move(_SLOT_MATCH, "match")

    def execute(self) -> None:
        """MATCHED -> EXECUTING: its Execution was run, offloaded or queued."""
        self._move(_SLOT_EXECUTE, "execute")

    def answer(self) -> None:
        """MATCHED/EXECUTING -> ANSWERED: every rank's op succeeded."""
        self._move(_SLOT_ANSWER, "answer")

    def fail(self) -> None:
        """WAITING/MATCHED/EXECUTING -> FAILED."""
        self._move(_SLOT_FAIL, "fail")

    def expire(self) -> None:
        """WAITING -> EXPIRED: ranks missing at the deadline."""
        self._move(_SLOT_EXPIRE, "expire")


class FailedCall:
    """A call that failed on its members (a disagreement, a rejected argument, a timeout, a
    member gone): every later step of it fails at once with the same result, so that no step
    of it can pair with a step of another call. Dropped once every member is past it."""
    __slots__ = ("codes", "default_code", "message", "done")

    def __init__(self, default_code: int, message: str, codes: Optional[dict] = None, steps: tuple = ()):
        self.default_code = default_code
        self.codes = codes or {}   # rank -> result, where it differs from default_code
        self.message = message
        # Ranks whose every step of the call has been answered (``steps`` already are).
        self.done: set = {s.member.rank for s in steps if ends_call(s.desc)}

    def code_for(self, rank: int) -> int:
        return self.codes.get(rank, self.default_code)


class PairQueue:
    """Send/Recv steps of one (communicator, sender, receiver), keyed by (match_seq,
    step_index): the k-th Send of the sender to the receiver pairs with the receiver's k-th
    Recv from the sender, step by step."""
    __slots__ = ("sends", "recvs", "matched", "failed", "sender_at", "receiver_at", "claimed")

    def __init__(self):
        self.sends: dict = {}
        self.recvs: dict = {}
        self.matched = 0
        self.failed: dict = {}   # match_seq -> FailedCall
        self.sender_at = 0       # the highest match_seq seen from each side
        self.receiver_at = 0
        self.claimed = 0         # the highest match_seq of a Send a PROBE_SOURCE named (anysource.py)


def ends_call(desc: tuple) -> bool:
    """Whether this step is its rank's last of its call (a rejected placeholder is all of it)."""
    return bool(desc[D_FLAGS] & P.OP_FLAG_REJECTED) or desc[D_STEP_INDEX] + 1 >= desc[D_STEP_TOTAL]


def signature(desc: tuple) -> tuple:
    """What all members of a collective step must agree on (its call and place in the call are
    the slot's key: match_seq, step_index)."""
    kind = desc[D_KIND]
    return (kind, desc[D_DTYPE], desc[D_REDOP] if kind in _REDUCING else 0,
            desc[D_ROOT] if kind in _ROOTED else -1, desc[D_TOTAL], desc[D_STEP], desc[D_STEP_TOTAL],
            order_of(desc))


_ORDER_NAMES = {P.ORDER_RANK: "rank order", P.ORDER_GLOO_ALLREDUCE: "gloo all-reduce order",
                P.ORDER_GLOO_REDUCE: "gloo reduce order"}


def order_of(desc: tuple) -> int:
    """The reduction order of a reducing step (OpDesc flags bits 4-5); 0 for other kinds."""
    if desc[D_KIND] not in _REDUCING:
        return 0
    return (desc[D_FLAGS] & P.OP_ORDER_MASK) >> P.OP_ORDER_SHIFT


def describe_op(desc: tuple) -> str:
    kind = desc[D_KIND]
    dt = DTYPES.get(desc[D_DTYPE])
    parts = [P.KIND_NAMES.get(kind, f"kind {kind}"), dt.name if dt else f"datatype {desc[D_DTYPE]}"]
    if kind in _REDUCING:
        parts.append(P.REDOP_NAMES.get(desc[D_REDOP], f"redop {desc[D_REDOP]}"))
        if order_of(desc):
            parts.append(f"[{_ORDER_NAMES.get(order_of(desc), f'order {order_of(desc)}')}]")
    parts.append(f"count={desc[D_TOTAL]}")
    if desc[D_STEP_TOTAL] != 1:
        parts.append(f"step {desc[D_STEP_INDEX] + 1} of {desc[D_STEP_TOTAL]} (step_count={desc[D_STEP]})")
    if kind in _ROOTED:
        parts.append(f"root={desc[D_ROOT]}")
    if kind in P.P2P_KINDS:
        parts.append(f"peer={desc[D_ROOT]}")
    if desc[D_FLAGS] & P.OP_FLAG_REJECTED:
        parts.append("[arguments rejected by the rank]")
    return " ".join(parts) + f" (call {desc[D_CALL_SEQ]})"


def mismatch_message(comm, seq: int, steps: list) -> str:
    sigs = [signature(s.desc) for s in steps]
    names = ("op", "datatype", "reduction", "root", "count", "step count", "number of steps",
             "reduction order (FAKEGPU_REDUCTION_ORDER)")
    differing = [names[i] for i in range(len(names)) if len({sig[i] for sig in sigs}) > 1]
    asked = "; ".join(f"rank {s.member.rank} asked {describe_op(s.desc)}" for s in steps)
    return (f"{comm.label()} collective #{seq}: members disagree on {', '.join(differing)}: {asked}")


def expected_lengths(kind: int, count: int, size: int, n: int, rank: int, root: int) -> tuple:
    """(in_len, out_len) a member must stage for one step (docs/protocol.md table)."""
    return P.rank_lengths(kind, count, size, n, rank == root)


# A placeholder for a call whose arguments the shim rejected (OP_FLAG_REJECTED): the rank
# already has its own error; the op only keeps its place in the matching order.
REJECTED_ERROR = "its arguments were rejected by the shim (that rank's ncclGetLastError says which)"

_SHAPE_CACHE: dict = {}
_SHAPE_CACHE_MAX = 4096  # a job has a handful of distinct op shapes


def validate(desc: tuple, member, S: int, accounted: bool = False) -> tuple:
    """(error, signature): error is None when the op is well formed for this member, else
    what is wrong; signature is what the members of a collective must agree on.

    The hot path: the shape checks depend only on (kind, dtype, redop, root, counts,
    lengths, rank, nranks) and are memoised; only the staging offsets are checked per op.
    An accounted op (ACCOUNT, proxy mode) stages nothing: its lengths and offsets are not checked."""
    if desc[D_FLAGS] & P.OP_FLAG_REJECTED:
        return REJECTED_ERROR, None
    if desc[D_MATCH_SEQ] == 0 or not desc[D_STEP_INDEX] < desc[D_STEP_TOTAL]:
        return _validate_shape(desc, member, not accounted), None
    # The reduction order too: it is part of the signature and checked. order_of, as signature
    # and _validate_shape read it: both ignore the bits on an op that does not reduce.
    if accounted:
        key = (desc[1], desc[2], desc[3], desc[5], desc[6], desc[7], None, None, member.rank, member.comm.nranks,
               desc[D_STEP_TOTAL], order_of(desc))
    else:
        key = (desc[1], desc[2], desc[3], desc[5], desc[6], desc[7], desc[9], desc[11],
               member.rank, member.comm.nranks, desc[D_STEP_TOTAL], order_of(desc))
    cached = _SHAPE_CACHE.get(key)
    if cached is None:
        cached = (_validate_shape(desc, member, not accounted), signature(desc))
        if cached[0] is None:  # only well-formed shapes: garbage must not fill the cache
            if len(_SHAPE_CACHE) >= _SHAPE_CACHE_MAX:
                _SHAPE_CACHE.clear()
            _SHAPE_CACHE[key] = cached
    if cached[0] is None and not accounted and (desc[D_IN_OFF] + desc[D_IN_LEN] > S or desc[D_OUT_OFF] + desc[D_OUT_LEN] > S):
        return (f"staging ranges in [{desc[D_IN_OFF]}, +{desc[D_IN_LEN]}) / out [{desc[D_OUT_OFF]}, "
                f"+{desc[D_OUT_LEN]}) exceed the {S}-byte regions granted"), cached[1]
    return cached


def _validate_shape(desc: tuple, member, check_lengths: bool = True) -> Optional[str]:
    kind = desc[D_KIND]
    if kind not in P.KIND_NAMES:
        return f"unknown op kind {kind}"
    dt = DTYPES.get(desc[D_DTYPE])
    if dt is None:
        return f"unknown datatype {desc[D_DTYPE]} (valid: 0..11)"
    if kind in _REDUCING and desc[D_REDOP] not in P.REDOP_NAMES:
        return f"unknown reduction {desc[D_REDOP]} (valid: 0..5)"
    if order_of(desc) not in _ORDER_NAMES:
        return f"unknown reduction order {order_of(desc)} in flags bits 4-5 (valid: 0..2)"
    n = member.comm.nranks
    root = desc[D_ROOT]
    if (kind in _ROOTED or kind in P.P2P_KINDS) and not 0 <= root < n:
        what = "root" if kind in _ROOTED else "peer"
        return f"{P.KIND_NAMES[kind]} {what} {root} is not a rank of a {n}-rank communicator"
    if desc[D_STEP] > desc[D_TOTAL]:
        return f"step_count {desc[D_STEP]} exceeds the call's count {desc[D_TOTAL]}"
    if not desc[D_STEP_INDEX] < desc[D_STEP_TOTAL]:
        return f"step_index {desc[D_STEP_INDEX]} is not below step_total {desc[D_STEP_TOTAL]}"
    if desc[D_MATCH_SEQ] == 0:
        return "match_seq 0 (calls are counted from 1)"
    if not check_lengths:
        return None
    want_in, want_out = expected_lengths(kind, desc[D_STEP], dt.size, n, member.rank, root)
    if desc[D_IN_LEN] != want_in or desc[D_OUT_LEN] != want_out:
        return (f"{P.KIND_NAMES[kind]} of {desc[D_STEP]} {dt.name} on rank {member.rank} of {n} stages "
                f"in_len={desc[D_IN_LEN]} out_len={desc[D_OUT_LEN]}, expected in_len={want_in} "
                f"out_len={want_out}")
    return None
