"""The modeled timeline: every operation placed in each rank's program order.

The coordinator learns of operations out of program order: calls the ranks run in a host-local
arena reach it later, in LOCAL_OPS batches, than calls it matched itself, and calls of different
communicators complete in whatever order the processes are scheduled. Placing each operation when
it is *recorded* made the modeled timeline depend on that order (a subgroup allreduce issued before
a barrier could be modeled after it). Instead each operation carries, per participant, the wall
time at which that rank arrived at it. An operation starts on the modeled timeline when every
participant has finished its previous operation there, and lasts its modeled time. That is a
longest-path computation over the per-rank program orders, so any processing order consistent
with them gives the same result: the same program gives the same modeled timeline and makespan on
every run. Operations are processed by their *last* arrival: a rank's next call arrives only
after its previous call completed, which needs every participant of it to have arrived, so the
last arrival of a rank's earlier call always precedes the last arrival of its later one.

Calls a rank makes in one group (ncclGroupStart/End: one GROUP frame) are one launch on a GPU:
they run together, not one after the other. The calls of such groups, joined through the ranks
they share, start together when the last of their ranks is free; each rank is then busy for the
larger of what it sends and what it receives (a collective counts as both), so a grouped
send/recv exchange costs one transfer, not two, and a ring of grouped exchanges (pipeline
parallelism) is not modeled as a chain.

Operations are kept until the report is built (then placed on a copy of the clocks, so a report
built while the job runs does not freeze the order of calls still to be reported) or until more
than ``pending_limit`` operations wait; then they are placed for good, and a call reported after
that is placed after them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence


@dataclass
class _Op:
    participants: tuple[int, ...]
    seconds: float
    key: tuple                         # (last arrival wall time, *tiebreak)
    frames: tuple                      # per participant: its group's frame, or None
    roles: tuple[str, ...]             # per participant: "send", "recv" or "both"
    entry: Optional[dict]              # the timeline entry whose modeled_start_s this sets


class ModeledSchedule:
    def __init__(self, pending_limit: int = 100_000):
        self.pending_limit = max(1, int(pending_limit))
        self._clock: dict[int, float] = {}
        self._pending: list[_Op] = []

    def add(self, participants: Sequence[int], seconds: float, arrivals: dict, tiebreak: tuple,
            entry: Optional[dict] = None, frames: Optional[dict] = None,
            roles: Optional[dict] = None) -> None:
        """One operation: its participants (global ranks), modeled seconds, each participant's
        arrival wall time, a tiebreak for operations that arrived at the same instant, the group
        frame each participant sent it in (``frames``) and, for a point-to-point call, who sends
        and who receives (``roles``)."""
        parts = tuple(dict.fromkeys(int(g) for g in participants))
        if not parts:
            return
        last = max((float(arrivals[g]) for g in parts if g in arrivals), default=0.0)
        frames = frames or {}
        roles = roles or {}
        self._pending.append(_Op(parts, float(seconds), (last,) + tuple(tiebreak),
                                 tuple(frames.get(g) for g in parts) if frames else (),
                                 tuple(roles.get(g, "both") for g in parts) if roles else (), entry))
        if len(self._pending) > self.pending_limit:
            self._place(self._pending, self._clock)
            self._pending = []

    def clocks(self) -> dict[int, float]:
        """Each rank's modeled clock (end of its last operation) with every operation so far
        placed; sets the pending entries' modeled_start_s."""
        clock = dict(self._clock)
        self._place(self._pending, clock)
        return clock

    @staticmethod
    def _place(ops: list[_Op], clock: dict[int, float]) -> None:
        """Place blocks in the order of their last arrival. A block is one operation, or the
        operations of group frames joined through the calls they share (union-find over the
        units (rank, frame))."""
        if not ops:
            return
        parent: dict = {}

        def find(u):
            while parent[u] != u:
                parent[u] = parent[parent[u]]
                u = parent[u]
            return u

        block_of_op: list = [None] * len(ops)
        for i, op in enumerate(ops):
            if not any(f is not None for f in op.frames):
                continue
            units = [(g, f) if f is not None else ("op", i) for g, f in zip(op.participants, op.frames)]
            for u in units:
                parent.setdefault(u, u)
            root = find(units[0])
            for u in units[1:]:
                r = find(u)
                if r != root:
                    parent[r] = root
            block_of_op[i] = units[0]
        blocks: dict = {}
        singles = []
        for i, op in enumerate(ops):
            if block_of_op[i] is None:
                singles.append((op.key, i, None))
            else:
                blocks.setdefault(find(block_of_op[i]), []).append(i)
        order = singles + [(max(ops[i].key for i in members), members[0], members)
                           for members in blocks.values()]
        order.sort(key=lambda item: (item[0], item[1]))
        for _, i, members in order:
            if members is None:
                op = ops[i]
                start = max(clock.get(g, 0.0) for g in op.participants)
                end = start + op.seconds
                for g in op.participants:
                    clock[g] = end
                if op.entry is not None:
                    op.entry["modeled_start_s"] = start
                continue
            ranks = {g for j in members for g in ops[j].participants}
            start = max(clock.get(g, 0.0) for g in ranks)
            sent: dict[int, float] = {}
            received: dict[int, float] = {}
            for j in members:
                op = ops[j]
                if op.entry is not None:
                    op.entry["modeled_start_s"] = start
                for k, g in enumerate(op.participants):
                    role = op.roles[k] if op.roles else "both"
                    if role != "recv":
                        sent[g] = sent.get(g, 0.0) + op.seconds
                    if role != "send":
                        received[g] = received.get(g, 0.0) + op.seconds
            for g in ranks:
                clock[g] = start + max(sent.get(g, 0.0), received.get(g, 0.0))
