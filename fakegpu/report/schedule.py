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

Calls a rank makes in one group (ncclGroupStart/End: one GROUP frame) are one launch on a GPU:
they run together, not one after the other. The calls of such groups, joined through the ranks
they share, start together when the last of their ranks is free; each rank is then busy for the
larger of what it sends and what it receives (a collective counts as both), so a grouped
send/recv exchange costs one transfer, not two, and a ring of grouped exchanges (pipeline
parallelism) is not modeled as a chain.

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
    frames: tuple                      # per participant: its group's frame, or None
    roles: tuple[str, ...]             # per participant: "send", "recv" or "both"
    entry: Optional[dict]              # the timeline entry whose modeled_start_s this sets


class ModeledSchedule:
    def __init__(self, pending_limit: int = 2_000_000):
        self.pending_limit = max(1, int(pending_limit))
        self._clock: dict[int, float] = {}
        self._pending: list[_Op] = []
        self._pending_entries = 0

    def add(self, participants: Sequence[int], seconds: float, arrivals: dict, tiebreak: tuple,
            entry: Optional[dict] = None, frames: Optional[dict] = None,
            roles: Optional[dict] = None) -> None:
        """One operation: its participants (global ranks), modeled seconds, each participant's
        arrival wall time (missing ones: the earliest known), a tiebreak for calls a rank made at
        the same instant, the group frame each participant sent it in (``frames``) and, for a
        point-to-point call, who sends and who receives (``roles``)."""
        parts = tuple(dict.fromkeys(int(g) for g in participants))
        if not parts:
            return
        known = [float(arrivals[g]) for g in parts if g in arrivals]
        default = min(known) if known else 0.0
        keys = tuple((float(arrivals.get(g, default)),) + tuple(tiebreak) for g in parts)
        frames = frames or {}
        roles = roles or {}
        self._pending.append(_Op(parts, float(seconds), keys, tuple(frames.get(g) for g in parts),
                                 tuple(roles.get(g, "both") for g in parts), entry))
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
        """Kahn's algorithm over the per-rank orders of *units* (one call, or the calls of one
        rank's group): a block of units joined by shared calls is ready when each of its units
        is the next one of its rank. Arrival times from one host clock are consistent; should
        they ever not be (a cycle), the waiting block with the earliest arrival goes first."""
        if not ops:
            return
        unit_ops: dict[tuple, list[int]] = {}
        unit_key: dict[tuple, tuple] = {}
        for i, op in enumerate(ops):
            for g, key, frame in zip(op.participants, op.keys, op.frames):
                u = (g, ("frame", frame) if frame is not None else ("op", i))
                unit_ops.setdefault(u, []).append(i)
                if u not in unit_key or key < unit_key[u]:
                    unit_key[u] = key
        # blocks: units joined through the calls they share (union-find)
        parent = {u: u for u in unit_ops}

        def find(u):
            while parent[u] != u:
                parent[u] = parent[parent[u]]
                u = parent[u]
            return u

        for i, op in enumerate(ops):
            units = [(g, ("frame", f) if f is not None else ("op", i)) for g, f in zip(op.participants, op.frames)]
            root = find(units[0])
            for u in units[1:]:
                r = find(u)
                if r != root:
                    parent[r] = root
        blocks: dict[tuple, list[tuple]] = {}
        for u in unit_ops:
            blocks.setdefault(find(u), []).append(u)
        block_of = {u: b for b, units in blocks.items() for u in units}
        block_key = {b: min(unit_key[u] for u in units) for b, units in blocks.items()}

        queues: dict[int, list[tuple]] = {}
        for u in unit_ops:
            queues.setdefault(u[0], []).append(u)
        for q in queues.values():
            q.sort(key=lambda u: (unit_key[u], u[1]))
        head = {g: 0 for g in queues}
        at_head = {b: 0 for b in blocks}
        done: set = set()
        ready: list[tuple] = []

        def advance(g: int) -> None:
            q = queues[g]
            while head[g] < len(q) and block_of[q[head[g]]] in done:
                head[g] += 1
            if head[g] < len(q):
                b = block_of[q[head[g]]]
                at_head[b] += 1
                if at_head[b] == len(blocks[b]):
                    heapq.heappush(ready, (block_key[b], b))

        for g in queues:
            advance(g)
        remaining = len(blocks)
        while remaining:
            if ready:
                _, b = heapq.heappop(ready)
                if b in done:
                    continue
            else:
                # inconsistent arrival times: take the earliest block at some rank's head
                b = min((block_of[queues[g][head[g]]] for g in queues if head[g] < len(queues[g])),
                        key=lambda b: block_key[b])
            units = blocks[b]
            members = sorted({i for u in units for i in unit_ops[u]})
            ranks = {u[0] for u in units}
            start = max((clock.get(g, 0.0) for g in ranks), default=0.0)
            sent: dict[int, float] = {}
            received: dict[int, float] = {}
            for i in members:
                op = ops[i]
                if op.entry is not None:
                    op.entry["modeled_start_s"] = start
                for g, role in zip(op.participants, op.roles):
                    if role != "recv":
                        sent[g] = sent.get(g, 0.0) + op.seconds
                    if role != "send":
                        received[g] = received.get(g, 0.0) + op.seconds
            for g in ranks:
                clock[g] = start + max(sent.get(g, 0.0), received.get(g, 0.0))
            done.add(b)
            remaining -= 1
            for u in units:
                g = u[0]
                q = queues[g]
                if head[g] < len(q) and q[head[g]] == u:
                    head[g] += 1
                    advance(g)
