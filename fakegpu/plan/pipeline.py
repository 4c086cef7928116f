"""Pipeline-parallel schedules: when each stage runs each micro-batch, and the step's makespan.

A rank of a pipeline of ``p`` ranks holds ``v`` model chunks (virtual stages ``r, r + p, ...``;
v = 1 for GPipe and 1F1B, v > 1 for interleaved 1F1B).  Each chunk runs a forward and a
backward per micro-batch, taking ``forward[s]`` and ``backward[s]`` seconds for virtual stage
``s``; an activation (forward) or its gradient (backward) crosses to the neighbouring rank in
``p2p`` seconds.  A rank runs its actions in the schedule's order, each once its input has
arrived:

* **GPipe**: all forwards, then all backwards;
* **1F1B**: rank r runs ``p - r - 1`` warm-up forwards, then alternates one forward and one
  backward, then drains its backwards (the schedule of Narayanan et al. 2021, torch's
  ``Schedule1F1B``);
* **interleaved 1F1B**: the same with ``v`` chunks per rank, micro-batches in groups of ``p``
  per chunk (Megatron-LM's order, torch's ``ScheduleInterleaved1F1B``); warm-up
  ``2 (p - r - 1) + (v - 1) p`` chunk-forwards.

With equal stages the makespan is the textbook ``(m + p - 1)(f + b)`` for 1F1B and GPipe and
``(m + (p - 1) / v)(f + b)`` for interleaved (chunk times ``f / v``, ``b / v``), plus the p2p
hops on the critical path; the unit tests check those figures.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")
_ALIASES = {"gpipe": "gpipe", "1f1b": "1f1b", "interleaved1f1b": "interleaved_1f1b",
            "interleaved_1f1b": "interleaved_1f1b", "looped_bfs": "interleaved_1f1b",
            "interleavedzerobubble": "interleaved_1f1b", "zbvzerobubble": "interleaved_1f1b"}


def normalize_schedule(name: str) -> str:
    key = str(name).strip().lower().replace("-", "_")
    if key.replace("_", "") in _ALIASES:
        return _ALIASES[key.replace("_", "")]
    if key in _ALIASES:
        return _ALIASES[key]
    raise ValueError(f"unknown pipeline schedule {name!r}; expected one of {', '.join(SCHEDULES)} "
                     f"(TorchTitan's names: GPipe, 1F1B, Interleaved1F1B)")


@dataclass
class PipelineRun:
    makespan: float
    busy: list            # per rank, seconds of forward + backward work
    bubble: float         # makespan - the busiest rank's work
    actions: list         # (rank, "F"|"B", virtual stage, micro-batch, start, end)


def _order(schedule: str, rank: int, p: int, v: int, m: int) -> list[tuple[str, int, int]]:
    """(F|B, chunk, micro-batch) in the order ``rank`` runs them."""
    if schedule == "gpipe":
        return [("F", 0, mb) for mb in range(m)] + [("B", 0, mb) for mb in range(m)]
    total = m * v

    def unit(k: int, backward: bool) -> tuple[int, int]:
        group = k // p
        chunk = group % v
        if backward:
            chunk = v - 1 - chunk
        return chunk, (group // v) * p + k % p

    if v == 1:
        warmup = min(p - rank - 1, m)
        fwd = [(0, mb) for mb in range(m)]
        bwd = [(0, mb) for mb in range(m)]
    else:
        warmup = min(2 * (p - rank - 1) + (v - 1) * p, total)
        fwd = [unit(k, False) for k in range(total)]
        bwd = [unit(k, True) for k in range(total)]
    order, f, b = [], 0, 0
    for _ in range(warmup):
        order.append(("F", *fwd[f]))
        f += 1
    while f < total:
        order.append(("F", *fwd[f]))
        f += 1
        order.append(("B", *bwd[b]))
        b += 1
    while b < total:
        order.append(("B", *bwd[b]))
        b += 1
    return order


def simulate_pipeline(schedule: str, stages: int, microbatches: int, forward: Sequence[float],
                      backward: Sequence[float], p2p: float = 0.0, chunks: int = 1) -> PipelineRun:
    """Run the schedule; ``forward`` / ``backward`` hold one time per virtual stage
    (``stages * chunks`` of them, or one value for all)."""
    schedule = normalize_schedule(schedule)
    p, v, m = int(stages), int(chunks), int(microbatches)
    if p < 1 or v < 1 or m < 1:
        raise ValueError(f"stages, chunks and micro-batches must be positive (got {p}, {v}, {m})")
    if schedule != "interleaved_1f1b" and v != 1:
        raise ValueError(f"{schedule} holds one chunk per rank; got chunks={v}")
    if schedule == "interleaved_1f1b" and v > 1 and m % p:
        raise ValueError(f"interleaved 1F1B needs the micro-batches ({m}) to be a multiple of the "
                         f"pipeline degree ({p})")
    n_virtual = p * v
    fw = list(forward) * n_virtual if len(forward) == 1 else list(forward)
    bw = list(backward) * n_virtual if len(backward) == 1 else list(backward)
    if len(fw) != n_virtual or len(bw) != n_virtual:
        raise ValueError(f"need {n_virtual} forward and backward times (one per virtual stage)")
    orders = [_order(schedule, r, p, v, m) for r in range(p)]
    position = [0] * p
    clock = [0.0] * p
    done: dict[tuple[str, int, int], float] = {}
    actions = []
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for r in range(p):
            while position[r] < len(orders[r]):
                what, chunk, mb = orders[r][position[r]]
                stage = chunk * p + r
                if what == "F":
                    dep = done.get(("F", stage - 1, mb)) if stage > 0 else 0.0
                    hop = p2p if stage > 0 and p > 1 else 0.0
                    cost = fw[stage]
                else:
                    if stage == n_virtual - 1:
                        dep, hop = done.get(("F", stage, mb)), 0.0
                    else:
                        dep, hop = done.get(("B", stage + 1, mb)), (p2p if p > 1 else 0.0)
                    cost = bw[stage]
                if dep is None:
                    break
                begin = max(clock[r], dep + hop)
                clock[r] = begin + cost
                done[(what, stage, mb)] = clock[r]
                actions.append((r, what, stage, mb, begin, clock[r]))
                position[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise RuntimeError(f"pipeline schedule {schedule} deadlocked (p={p}, v={v}, m={m})")
    busy = [sum(fw[c * p + r] + bw[c * p + r] for c in range(v)) * m for r in range(p)]
    makespan = max(clock)
    return PipelineRun(makespan, busy, makespan - max(busy), actions)
