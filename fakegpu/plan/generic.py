"""Planning a user's own script: record its ops in a fake world, time its last training step.

``fgpu plan -- torchrun ... train.py`` runs ``train.py`` once under ``fgpu --dist-mode fake``
(one process, logical rank 0 of the launch's world) with ``FAKEGPU_PLAN_RECORD=FILE``.  When
the program initialises its process group, :func:`start_recording` (called by the fake-world
entry, fakegpu/fake/entry.py) pushes an OpRecorder that stays on for the rest of the run; a
global optimizer hook marks each ``optimizer.step()`` (phase "optimizer", and the step count
after it).  At exit the records, the step count and the fake device's peak reserved memory
are pickled to FILE; :func:`plan_records` times them on the cluster YAML.

The script runs at the size it is written for, on this machine's CPU: planning a model too
large for it is what the TorchTitan path (fake tensors at full size) is for.
"""
from __future__ import annotations

import atexit
import os
import pickle
from typing import Optional

ENV = "FAKEGPU_PLAN_RECORD"
GiB = 1024 ** 3
_state: dict = {}


def start_recording(path: Optional[str] = None) -> None:
    """Record every op from now until exit (idempotent)."""
    path = path or os.environ.get(ENV)
    if not path or _state:
        return
    import torch

    from .capture import OpRecorder

    recorder = OpRecorder()
    recorder.__enter__()
    _state.update(recorder=recorder, steps=0, path=path)

    def before_step(optimizer, args, kwargs):
        recorder.current_phase = "optimizer"

    def after_step(optimizer, args, kwargs):
        _state["steps"] += 1
        recorder.current_phase = ""
        recorder.current_step = _state["steps"]

    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    register_optimizer_step_pre_hook(before_step)
    register_optimizer_step_post_hook(after_step)
    from fakegpu.fake import process_group as fake_pg

    fake_pg.COLLECTIVE_OBSERVERS.append(_observer(recorder))
    atexit.register(_dump)


def _observer(recorder):
    """Records a fake-world collective (its groups compute in numpy, below the dispatcher,
    so the recorder does not see them as ops) with the buffers it reads and writes."""
    from .capture import _buffers
    from .collectives import Collective
    from .compute import OpRecord

    def observe(kind, members, elem_size, count, comm_name, tensors, group_name=""):
        if group_name:
            # the recorder names a functional collective's group by its c10d name: report it
            # under the communicator's name, as the collectives observed here are
            _state.setdefault("labels", {})[group_name] = comm_name
        if recorder.running_functional_collective:
            return      # a functional collective's own call: the recorder has it as that op
        buffers = recorder.buffer_ids(_buffers(tensors))
        collective = Collective(kind, count, elem_size, members, comm_name)
        recorder.records.append(OpRecord(
            f"fakegpu_fake.{kind}", kind, "communication", (), (), (), (), 0, count * elem_size,
            reads=buffers, writes=buffers, collective=collective,
            phase=recorder.current_phase, step=recorder.current_step))

    return observe


def _peak_reserved() -> int:
    try:
        import torch

        if torch.cuda.is_available():
            return int(torch.cuda.max_memory_reserved())
    except Exception:  # noqa: BLE001 - a CPU program: no device memory to report
        pass
    return 0


def _dump() -> None:
    recorder = _state.get("recorder")
    if recorder is None:
        return
    try:
        recorder.__exit__(None, None, None)
    except Exception:  # noqa: BLE001 - the mode stack may already be unwound at exit
        pass
    captured = {"records": recorder.records, "steps": _state["steps"], "peak_reserved_bytes": _peak_reserved(),
                "labels": dict(_state.get("labels", {}))}
    with open(_state["path"], "wb") as fh:
        pickle.dump(captured, fh)


def plan_records(captured: dict, topology, world_size: int, tokens_per_step: Optional[int] = None):
    """The plan of a recorded script, its last complete step on rank 0's GPU: (the plan's
    dict, the timeline)."""
    from .planner import scaled_topology
    from .step import step_times

    steps = int(captured.get("steps", 0))
    if steps < 1:
        raise ValueError("the program ran no optimizer step: fgpu plan times one training step "
                         "(forward, backward, optimizer.step())")
    topology = scaled_topology(topology, world_size)
    gpu = topology.gpu_of(0)
    # the last step that ended with optimizer.step(); the first warms up (optimizer state)
    last = steps - 1
    records = [r for r in captured["records"] if r.step <= last]
    st = step_times(records, gpu, topology, labels=captured.get("labels"), step=last)
    peak = (gpu.bf16_tflops or 0.0) * 1e12
    tokens = tokens_per_step / st.step_seconds if tokens_per_step else None
    memory_gib = float(gpu.memory_gb) * 1e9 / GiB
    # torch.cuda.max_memory_reserved() of the fake device; None where the program did not run
    # on fake CUDA memory accounting (a CPU program)
    reserved = (captured.get("peak_reserved_bytes") or 0) / GiB or None
    return ({
        "layout_text": f"the script's own, {world_size} ranks ({steps} steps recorded, step {last + 1} timed)",
        "gpu": gpu.name,
        "step_seconds": st.step_seconds,
        "tokens_per_second_per_gpu": tokens,
        # the FLOPs the step's kernels run (recomputation included: hardware FLOPs)
        "mfu": st.flops / st.step_seconds / peak if peak else None,
        "peak_memory_reserved_gib": reserved,
        "gpu_memory_gib": memory_gib,
        "fits": reserved is None or reserved <= memory_gib,
        "exposed_communication_seconds": st.exposed,
        "communication_seconds": st.communication,
        "link_contention_seconds": st.contention,
        "phase_seconds": st.phase_seconds,
        "compute_seconds": st.compute_seconds,
        "flops_per_step": st.flops,
    }, st.timeline)
