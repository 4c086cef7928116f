"""The modeled timeline: every operation placed in each rank's program order.

The coordinator learns of operations out of program order: calls the ranks run in a host-local
arena reach it later, in LOCAL_OPS batches, than calls it matched itself, and calls of different
communicators complete in whatever order the processes are scheduled. Placing each operation when
it is *recorded* made the modeled timeline depend on that order (a subgroup allreduce issued before
a barrier could be modeled after it). Instead each operation carries, per participant, the wall
time at which that rank arrived at it; a rank's calls are sequential, so these times give its
program order. An operation starts on the modeled timeline when every participant has finished
its previous operation there, and lasts its modeled time. That is a longest-path computation over
the per-rank orders, so any processing order consistent with them gives the same result: the
same program gives the same modeled timeline and makespan on every run.

Operations are kept until the report is built (then placed on a copy of the clocks, so a report
built while the job runs does not freeze the order of calls still to be reported) or until more
than ``pending_limit`` participant entries wait; then they are placed for good, and a call reported
after that is placed after them.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Optional, Sequence


@dataclass
class _Op:
    participants: tuple[int, ...]
    seconds: float
    keys: tuple[tuple, ...]            # per participant: (arrival wall time, *tiebreak)
    entry: Optional[dict]              # the timeline entry whose modeled_start_s this sets


class ModeledSchedule:
    def __init__(self, pending_limit: int = 2_000_000):
        self.pending_limit = max(1, int(pending_limit))
        self._clock: dict[int, float] = {}
        self._pending: list[_Op] = []
        self._pending_entries = 0

    def add(self, participants: Sequence[int], seconds: float, arrivals: dict, tiebreak: tuple,
            entry: Optional[dict] = None) -> None:
        """One operation: its participants (global ranks), modeled seconds, each participant's
        arrival wall time (missing ones: the earliest known), and a tiebreak for calls a rank
        made at the same instant (one GROUP frame)."""
        parts = tuple(dict.fromkeys(int(g) for g in participants))
        if not parts:
            return
        known = [float(arrivals[g]) for g in parts if g in arrivals]
        default = min(known) if known else 0.0
        keys = tuple((float(arrivals.get(g, default)),) + tuple(tiebreak) for g in parts)
        self._pending.append(_Op(parts, float(seconds), keys, entry))
        self._pending_entries += len(parts)
        if self._pending_entries > self.pending_limit:
            self._place(self._pending, self._clock)
            self._pending, self._pending_entries = [], 0

    def clocks(self) -> dict[int, float]:
        """Each rank's modeled clock (end of its last operation) with every operation so far
        placed; sets the pending entries' modeled_start_s."""
        clock = dict(self._clock)
        self._place(self._pending, clock)
        return clock

    @staticmethod
    def _place(ops: list[_Op], clock: dict[int, float]) -> None:
        """Kahn's algorithm over the per-rank orders: an operation is ready when it is the next
        one of every participant. Arrival times from one host clock are consistent; should they
        ever not be (a cycle), the waiting operation with the earliest arrival goes first."""
        if not ops:
            return
        queues: dict[int, list[tuple[tuple, int]]] = {}
        for i, op in enumerate(ops):
            for g, key in zip(op.participants, op.keys):
                queues.setdefault(g, []).append((key, i))
        for q in queues.values():
            q.sort()
        head = {g: 0 for g in queues}
        at_head = [0] * len(ops)
        done = [False] * len(ops)
        ready: list[tuple[tuple, int]] = []

        def first_key(i: int) -> tuple:
            return min(ops[i].keys)

        def advance(g: int) -> None:
            q = queues[g]
            while head[g] < len(q) and done[q[head[g]][1]]:
                head[g] += 1
            if head[g] < len(q):
                i = q[head[g]][1]
                at_head[i] += 1
                if at_head[i] == len(ops[i].participants):
                    heapq.heappush(ready, (first_key(i), i))

        for g in queues:
            advance(g)
        remaining = len(ops)
        while remaining:
            if ready:
                _, i = heapq.heappop(ready)
                if done[i]:
                    continue
            else:
                # inconsistent arrival times: take the earliest operation at some rank's head
                i = min((queues[g][head[g]][1] for g in queues if head[g] < len(queues[g])), key=first_key)
            op = ops[i]
            start = max((clock.get(g, 0.0) for g in op.participants), default=0.0)
            for g in op.participants:
                clock[g] = start + op.seconds
            if op.entry is not None:
                op.entry["modeled_start_s"] = start
            done[i] = True
            remaining -= 1
            for g in op.participants:
                q = queues[g]
                if head[g] < len(q) and q[head[g]][1] == i:
                    head[g] += 1
                    advance(g)
