"""One rank's training step on the cluster: captured records -> timed tasks -> timeline.

Compute records are timed by the compute model on the GPU the cluster YAML gives the rank
(fakegpu.plan.compute.model_op); collectives by fakegpu's communication cost model on the
YAML's topology (fakegpu.costmodel.estimate), each on its process group's stream.  The model
options (torch.compile fusion, Float8 linears) rewrite the records first
(fakegpu.plan.options).  The result, :class:`StepTimes`, is what the planner reports.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from typing import Optional, Sequence

from fakegpu import costmodel

from .compute import OpRecord, model_op
from .gpu_compute import compute_of
from .options import async_tensor_parallel, float8_matmuls, float8_tensor_parallel_gathers, fuse_memory_chains
from .timeline import COMPUTE, Task, Timeline, simulate


@dataclass(frozen=True)
class ModelOptions:
    compile: bool = False
    float8: bool = False
    float8_excluded_dims: tuple = ()   # matmul dimensions left in bf16 (the vocabulary's)
    # tensor-parallel all-gathers that feed Float8 linears move float8 (torchao's Float8 TP plans)
    float8_tp_gathers: bool = False
    async_tp: bool = False
    tp_groups: tuple = ()              # the tensor-parallel groups' names (for async_tp, float8_tp_gathers)
    allow_tf32: Optional[bool] = None


@dataclass
class StepTimes:
    timeline: Timeline
    step_seconds: float                 # the last captured step, steady state
    phase_seconds: dict                 # phase -> compute-stream span of the last step
    exposed: dict                       # group label -> exposed seconds in the last step
    communication: dict                 # group label -> collective seconds in the last step
    # group label -> seconds its collectives lost to other groups sharing their links, last step
    contention: dict
    compute_seconds: float              # kernel time of the last step
    flops: int                          # FLOPs of the last step (recomputation included)
    records: list = field(default_factory=list, repr=False)


def apply_options(records: Sequence[OpRecord], options: ModelOptions) -> list[OpRecord]:
    out = list(records)
    if options.float8 and options.float8_tp_gathers and options.tp_groups:
        # before async TP, which splits the gathers it overlaps
        out = float8_tensor_parallel_gathers(out, options.tp_groups, options.float8_excluded_dims, options.compile)
    if options.async_tp and options.tp_groups:
        out = async_tensor_parallel(out, options.tp_groups)
    if options.compile:
        out = fuse_memory_chains(out)
    if options.float8:
        out = float8_matmuls(out, options.float8_excluded_dims, compiled=options.compile)
    return out


class CollectiveTimer:
    """Seconds of a collective on the topology and the links of the planned rank (``rank``)
    it keeps busy, cached by (kind, count, size, ranks)."""

    def __init__(self, topology, rank: int = 0):
        self.topology = topology
        self.rank = rank
        self._cached = lru_cache(maxsize=None)(self._estimate)

    def _estimate(self, kind: str, count: int, elem_size: int, ranks: tuple, peer: int) -> tuple[float, tuple]:
        estimate = costmodel.estimate(kind, count, elem_size, list(ranks), 0, peer, self.topology)
        links = costmodel.links_of_rank(estimate, self.rank, self.topology) if self.rank in ranks else {}
        return estimate.seconds, tuple(sorted(links.items()))

    def timed(self, kind: str, count: int, elem_size: int, ranks: Sequence[int], peer: int = 0) -> tuple[float, tuple]:
        """(seconds, ((link key, busy seconds), ...) at the planned rank)."""
        if len(ranks) <= 1 and kind != "SendRecv":
            return 0.0, ()
        return self._cached(kind, int(count), int(elem_size), tuple(ranks), peer)

    def seconds(self, kind: str, count: int, elem_size: int, ranks: Sequence[int], peer: int = 0) -> float:
        return self.timed(kind, count, elem_size, ranks, peer)[0]


def tasks_of(records: Sequence[OpRecord], gpu, timer: CollectiveTimer, labels: Optional[dict] = None,
             allow_tf32: Optional[bool] = None) -> list[Task]:
    """Timed tasks, program order.  ``labels``: group name -> what to report it as."""
    gpu = compute_of(gpu)
    labels = labels or {}
    tasks = []
    for r in records:
        reads = tuple(k for k, _ in r.reads)
        writes = tuple(k for k, _ in r.writes)
        if r.collective is not None:
            c = r.collective
            seconds, links = timer.timed(c.kind, c.count, c.elem_size, c.ranks, 1 if c.kind == "SendRecv" else 0)
            label = labels.get(c.group, c.group)
            tasks.append(Task(r.name, seconds, f"group:{c.group}", reads, writes, label, r.step, links))
        elif r.kind in ("view", "no_kernel"):
            continue
        else:
            cost = model_op(r, gpu, allow_tf32)
            tasks.append(Task(r.name, cost.seconds, COMPUTE, reads, writes, None, r.step))
    return tasks


def step_times(records: Sequence[OpRecord], gpu, topology, options: ModelOptions = ModelOptions(),
               labels: Optional[dict] = None, step: Optional[int] = None) -> StepTimes:
    """Time the captured step(s) and report the last one (earlier ones warm up: the optimizer
    creates its state in the first)."""
    # a memory probe's ops (fakegpu.plan.titan's second micro-batch in flight) are not the step's
    records = apply_options([r for r in records if not r.phase.startswith("probe")], options)
    timer = CollectiveTimer(topology)
    tasks = tasks_of(records, gpu, timer, labels, options.allow_tf32)
    timeline = simulate(tasks)
    last = max((t.step for t in tasks), default=0) if step is None else step
    phases: dict[str, list] = {}
    # the phase spans on the compute stream (records and tasks line up once passive ones drop)
    kept = [r for r in records if r.collective is not None or r.kind not in ("view", "no_kernel")]
    communication: dict[str, float] = {}
    compute_s = 0.0
    for record, task, s, e in zip(kept, tasks, timeline.start, timeline.end):
        if task.step != last:
            continue
        if task.stream == COMPUTE:
            compute_s += task.seconds
            span = phases.setdefault(record.phase or "other", [s, e])
            span[0], span[1] = min(span[0], s), max(span[1], e)
        else:
            communication[task.group_label] = communication.get(task.group_label, 0.0) + task.seconds
    flops = sum(r.flops for r in records if r.step == last)
    return StepTimes(timeline, timeline.step_seconds(last), {k: v[1] - v[0] for k, v in phases.items()},
                     timeline.exposed_in_step(last), communication, timeline.contention_in_step(last),
                     compute_s, flops, records)
