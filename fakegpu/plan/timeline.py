"""One rank's GPU timeline: a compute stream and one communication stream per process group.

Input: the rank's work in program order as :class:`Task` s (a kernel or a collective, its
modeled seconds, the buffers it reads and writes).  Output: when each task runs, the makespan,
and how long the compute stream stood waiting on each group's communication (the *exposed*
communication; the rest of it hid behind compute).

The rules are a GPU's:

* the compute stream runs its kernels in program order, one at a time;
* each process group's collectives run in order on that group's own stream (NCCL gives every
  communicator its stream; FSDP2 and TP use separate groups, so their collectives overlap);
* collectives of different groups that run at once share the links of the rank's GPU and
  node that both use (its NVLink port, its NIC rail, its PCIe link): a link carries one's
  bytes and the other's, so the collective that starts while another group's bytes are still
  queued on a link it needs is slowed by the overlap, as two fair shares of the link would
  slow it (by the shorter of its own time on the link and the queued time), and the link
  stays busy with both (work-conserving, so a third finds it busy for their sum);
* a task starts once its stream is free and every buffer it reads has been written by the task
  that last wrote it (a collective's output is ready when the collective ends; a kernel that
  reads it - ``wait_tensor``, FSDP2's copy-out, the optimizer reading a reduce-scattered
  gradient - waits for it, as the stream's event wait does on a GPU).

The host is assumed to run ahead of the GPU (a training step long enough to be GPU-bound), so
issue order constrains nothing beyond the streams' order.  FSDP2's prefetch follows from this:
the all-gather of the next block is issued, in program order, before the current block's
compute, and its input (the copy-in, on the compute stream) is ready early, so it overlaps.

Pure and deterministic: no clocks, no I/O (tests drive it with hand-made tasks).
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Iterable, Optional, Sequence

COMPUTE = "compute"
# A kernel that runs while a collective is in flight is slowed: NCCL's kernels take SMs (one
# per channel) and HBM bandwidth from it. The share of its overlapped time added; fitted on
# TorchTitan's Llama 3.1 8B FSDP row on 8 H100 (docs/planning.md, verification/plan_calibration.py).
OVERLAP_SLOWDOWN = 0.25


@dataclass(frozen=True)
class Task:
    name: str
    seconds: float
    stream: str = COMPUTE               # COMPUTE, or the process group's name for a collective
    reads: tuple = ()                   # buffer keys
    writes: tuple = ()
    group_label: Optional[str] = None   # what to report exposure under (e.g. "fsdp", "tp")
    step: int = 0                       # training step the task belongs to
    # a collective's links at this rank: ((link key, seconds it keeps the link busy), ...)
    links: tuple = ()


@dataclass
class Timeline:
    tasks: list
    start: list
    end: list
    makespan: float
    compute_busy: float
    # group label -> seconds the compute stream waited on that group's collectives
    exposed: dict = field(default_factory=dict)
    # group label -> total seconds of that group's collectives
    communication: dict = field(default_factory=dict)
    # group label -> seconds its collectives were slowed by other groups' sharing their links
    contention: dict = field(default_factory=dict)
    # per task, the seconds it was slowed by other groups' bytes on its links (0 for kernels)
    link_delays: list = field(default_factory=list, repr=False)

    def contention_in_step(self, step: int) -> dict:
        out: dict = defaultdict(float)
        for task, delay in zip(self.tasks, self.link_delays):
            if delay and task.step == step:
                out[task.group_label or task.stream] += delay
        return dict(out)

    def step_seconds(self, step: int) -> float:
        """Time from the end of the previous step's last task to the end of this step's."""
        ends = [e for t, e in zip(self.tasks, self.end) if t.step == step]
        before = [e for t, e in zip(self.tasks, self.end) if t.step < step]
        if not ends:
            raise ValueError(f"no task of step {step}")
        return max(ends) - (max(before) if before else 0.0)

    def exposed_in_step(self, step: int) -> dict:
        return dict(self._exposed_by_step.get(step, {}))

    _exposed_by_step: dict = field(default_factory=dict, repr=False)

    def trace_events(self, pid: int = 0) -> list[dict]:
        """Chrome/Perfetto trace events ("X" slices, microseconds), one thread per stream."""
        threads: dict[str, int] = {}
        events = []
        for task, s, e in zip(self.tasks, self.start, self.end):
            if e <= s:
                continue
            tid = threads.setdefault(task.stream, len(threads))
            events.append({"name": task.name, "ph": "X", "pid": pid, "tid": tid,
                           "ts": round(s * 1e6, 3), "dur": round((e - s) * 1e6, 3),
                           "args": {"step": task.step}})
        for stream, tid in threads.items():
            label = "compute stream" if stream == COMPUTE else f"comm stream: {stream}"
            events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid,
                           "args": {"name": label}})
        return events


def simulate(tasks: Sequence[Task], overlap_slowdown: Optional[float] = None) -> Timeline:
    """Schedule ``tasks`` (program order) on their streams; see the module docstring.
    ``overlap_slowdown``: OVERLAP_SLOWDOWN unless given (0 for the ideal overlap)."""
    slowdown = OVERLAP_SLOWDOWN if overlap_slowdown is None else overlap_slowdown
    comm_busy_until = 0.0
    free: dict[str, float] = defaultdict(float)
    ready: dict = {}                 # buffer key -> (time written, index of the writer)
    start, end = [], []
    exposed: dict[str, float] = defaultdict(float)
    by_step: dict[int, dict] = defaultdict(lambda: defaultdict(float))
    communication: dict[str, float] = defaultdict(float)
    contention: dict[str, float] = defaultdict(float)
    link_free: dict = {}              # link key -> when the bytes queued on it are through
    link_delays: list = []
    compute_busy = 0.0
    tasks = list(tasks)
    for index, task in enumerate(tasks):
        if task.seconds < 0:
            raise ValueError(f"task {task.name!r} has negative duration {task.seconds}")
        stream_free = free[task.stream]
        begin, waited_on = stream_free, None
        for key in task.reads:
            written = ready.get(key)
            if written is not None and written[0] > begin:
                begin, waited_on = written[0], written[1]
        if task.stream == COMPUTE:
            compute_busy += task.seconds
            if waited_on is not None and tasks[waited_on].stream != COMPUTE:
                label = tasks[waited_on].group_label or tasks[waited_on].stream
                exposed[label] += begin - stream_free
                by_step[task.step][label] += begin - stream_free
        else:
            communication[task.group_label or task.stream] += task.seconds
        seconds = task.seconds
        slowed = 0.0
        if task.stream == COMPUTE and slowdown and comm_busy_until > begin:
            seconds += slowdown * min(seconds, comm_busy_until - begin)
        elif task.stream != COMPUTE:
            slowed = _shared_link_delay(task, begin, link_free)
            if slowed:
                seconds += slowed
                contention[task.group_label or task.stream] += slowed
            comm_busy_until = max(comm_busy_until, begin + seconds)
        finish = begin + seconds
        link_delays.append(slowed)
        free[task.stream] = finish
        for key in task.writes:
            ready[key] = (finish, index)
        start.append(begin)
        end.append(finish)
    makespan = max(end, default=0.0)
    # Communication still running after the last kernel is exposed too: the step ends with it.
    last_compute = free[COMPUTE]
    if makespan > last_compute:
        tail = max(range(len(tasks)), key=lambda i: end[i])
        label = tasks[tail].group_label or tasks[tail].stream
        exposed[label] += makespan - last_compute
        by_step[tasks[tail].step][label] += makespan - last_compute
    timeline = Timeline(tasks, start, end, makespan, compute_busy, dict(exposed), dict(communication),
                        dict(contention), link_delays)
    timeline._exposed_by_step = {k: dict(v) for k, v in by_step.items()}
    return timeline


def _shared_link_delay(task: Task, begin: float, link_free: dict) -> float:
    """Seconds ``task`` (a collective starting at ``begin``) loses to bytes of other
    collectives still queued on its links; books its own bytes on them."""
    delay = 0.0
    for key, busy in task.links:
        queued_until = link_free.get(key, 0.0)
        if queued_until > begin:
            delay = max(delay, min(busy, queued_until - begin))
        link_free[key] = max(queued_until, begin) + busy
    return delay
