"""Plan a TorchTitan job on a cluster: step time, tokens/s per GPU, MFU, peak memory.

``plan_titan(config, world_size, topology)`` captures the step (fakegpu.plan.titan), times it
on the topology's GPU and fabric (fakegpu.plan.step), schedules pipeline stages
(fakegpu.plan.pipeline) and extrapolates the depth; :class:`Plan` is the answer, with
``to_dict()`` the JSON ``fgpu plan --json`` prints.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Optional

from .pipeline import normalize_schedule, simulate_pipeline
from .options import compiled_activation_savings
from .step import CollectiveTimer, ModelOptions, step_times

GiB = 1024 ** 3
# Depths captured when a model (or pipeline chunk) is deeper: two points fix the per-layer line.
EXTRAPOLATION_DEPTHS = (2, 4)


@dataclass
class Plan:
    layout: object
    gpu: str
    step_seconds: float
    tokens_per_second_per_gpu: float
    mfu: float
    peak_memory_reserved_gib: float
    exposed_communication_seconds: dict
    communication_seconds: dict
    phase_seconds: dict
    compute_seconds: float
    flops_per_token: int
    nparams: int
    pipeline_bubble_seconds: float = 0.0
    captured_layers: tuple = ()
    fits: bool = True
    memory_gib: float = 0.0
    timeline: object = field(default=None, repr=False)
    # group -> seconds its collectives lost to other groups' bytes on shared links (per step)
    link_contention_seconds: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        layout = dataclasses.asdict(self.layout)
        return {
            "layout": layout,
            "layout_text": self.layout.describe(),
            "gpu": self.gpu,
            "step_seconds": self.step_seconds,
            "tokens_per_second_per_gpu": self.tokens_per_second_per_gpu,
            "mfu": self.mfu,
            "peak_memory_reserved_gib": self.peak_memory_reserved_gib,
            "gpu_memory_gib": self.memory_gib,
            "fits": self.fits,
            "exposed_communication_seconds": self.exposed_communication_seconds,
            "communication_seconds": self.communication_seconds,
            "link_contention_seconds": self.link_contention_seconds,
            "phase_seconds": self.phase_seconds,
            "compute_seconds": self.compute_seconds,
            "pipeline_bubble_seconds": self.pipeline_bubble_seconds,
            "flops_per_token": self.flops_per_token,
            "nparams": self.nparams,
            "captured_layers": list(self.captured_layers),
        }


def scaled_topology(topology, world_size: int):
    """``topology`` grown to ``world_size`` ranks by repeating its nodes (a YAML describing one
    or two nodes of a kind plans a job on many); unchanged when it places enough ranks."""
    from fakegpu.topology.model import Node, Topology

    if topology.world_size >= world_size:
        return topology
    template = topology.nodes
    sizes = {len(n.ranks) for n in template}
    if len(sizes) != 1:
        raise ValueError(f"{topology.describe()} places {topology.world_size} ranks and its nodes differ in "
                         f"size; the job needs {world_size}: describe every node in the YAML")
    per_node = sizes.pop()
    if world_size % per_node:
        raise ValueError(f"the job's {world_size} ranks do not fill nodes of {per_node} GPUs "
                         f"({topology.describe()})")
    nodes = []
    for index in range(world_size // per_node):
        base = template[index % len(template)]
        ranks = tuple(range(index * per_node, (index + 1) * per_node))
        nodes.append(dataclasses.replace(base, id=f"{base.id}-{index}", host=f"{base.host}-{index}", ranks=ranks))
    grown = Topology(name=f"{topology.name} x{len(nodes)} nodes", nodes=tuple(nodes),
                     intra_node=topology.intra_node, inter_node=topology.inter_node,
                     default_backend=topology.default_backend, source=topology.source,
                     is_default=topology.is_default, warnings=list(topology.warnings))
    grown.link_factors = dict(topology.link_factors)
    return grown


def _metrics(capture, gpu, topology, options) -> dict:
    st = step_times(capture.records, gpu, topology, options, capture.labels)
    phases = st.phase_seconds
    return {
        "step": st.step_seconds,
        "forward": phases.get("forward", 0.0) + phases.get("loss", 0.0),
        "backward": phases.get("backward", 0.0),
        "optimizer": phases.get("optimizer", 0.0),
        "compute": st.compute_seconds,
        "exposed": st.exposed,
        "communication": st.communication,
        "contention": st.contention,
        "reserved": float(capture.peak_reserved_bytes),
        # torch.compile keeps fewer activations (fakegpu.plan.options.compiled_activation_savings)
        "compile_savings": float(compiled_activation_savings(capture.records)) if options.compile else 0.0,
        "allocated": float(capture.peak_allocated_bytes),
        "phase_peaks": {k: float(v) for k, v in capture.phase_peaks.items()},
        "activation": float(capture.activation_bytes),
        "timeline": st.timeline,
    }


def _extrapolate(points: list, depths: tuple, target: int) -> dict:
    """Linear in depth through the two captures (or the one capture, at its own depth)."""
    if len(points) == 1:
        return points[0]
    (a, b), (da, db) = points, depths
    out = {}
    for key, va in a.items():
        vb = b[key]
        if key == "timeline":
            out[key] = vb
        elif isinstance(va, dict):
            out[key] = {k: max(0.0, vb.get(k, 0.0) + (vb.get(k, 0.0) - va.get(k, 0.0)) / (db - da) * (target - db))
                        for k in set(va) | set(vb)}
        else:
            out[key] = vb + (vb - va) / (db - da) * (target - db)
    return out


def _reserved(points: list, m: dict) -> float:
    """Peak reserved bytes at the target depth: the largest phase peak of allocated memory in
    the steady (last) step, each linear in depth, less what a compiled forward does not keep,
    times the caching allocator's reserved / allocated ratio in the deepest capture's steady
    step (its rounding, segments and the holes freed gradients leave: the allocator keeps the
    segments of the step before, as on the GPU).  The reserved figure itself is not
    extrapolated: which blocks fit which holes does not change linearly with depth."""
    deepest = points[-1]
    ratio = deepest["reserved"] / deepest["allocated"] if deepest["allocated"] else 1.0
    # the probe phases hold a second micro-batch; the pipeline's in-flight count adds those
    peaks = [v for k, v in m["phase_peaks"].items() if not k.startswith("probe")]
    return max(0.0, max(peaks, default=m["allocated"]) - m["compile_savings"]) * ratio


def model_options(layout, vocab_size: int, labels: dict, float8_tp_gathers: bool = False) -> ModelOptions:
    return ModelOptions(compile=layout.compile, float8=layout.float8, float8_excluded_dims=(vocab_size,),
                        float8_tp_gathers=float8_tp_gathers,
                        async_tp=layout.async_tp, tp_groups=tuple(g for g, n in labels.items() if n == "tp"))


def plan_titan(config, world_size: int, topology, *, extrapolate: bool = True,
               gpu_memory_gib: Optional[float] = None, float8: Optional[bool] = None,
               float8_tp_gathers: bool = False) -> Plan:
    """``float8``: cost the linears as TorchTitan's Float8 converter runs them (its converter
    needs torchao at config time; this needs nothing); None: as the config says.
    ``float8_tp_gathers``: the tensor-parallel all-gathers feeding Float8 linears move float8,
    as torchao's Float8 TP plans ran them in TorchTitan before 0.3.0 (whose TP plans gather in
    the activations' dtype whatever the linears compute in)."""
    from . import titan

    topology = scaled_topology(topology, world_size)
    layout = titan.layout_of(config, world_size)
    if float8 is not None:
        layout = dataclasses.replace(layout, float8=bool(float8))
    gpu = topology.gpu_of(0)
    chunks = titan.pipeline_chunks(layout, getattr(config.parallelism, "pipeline_parallel_layers_per_stage", None))
    stage_layers = math.ceil(layout.n_layers / (layout.pp * chunks))
    batch = layout.microbatch_size if layout.pp > 1 else layout.local_batch_size
    depths = (tuple(d for d in EXTRAPOLATION_DEPTHS if d < stage_layers)
              if extrapolate and stage_layers > max(EXTRAPOLATION_DEPTHS) else (stage_layers,))
    points, first = [], None
    for depth in depths:
        cap = titan.capture(config, world_size, n_layers=depth, batch_size=batch, probe_in_flight=layout.pp > 1)
        first = first or cap
        points.append(_metrics(cap, gpu, topology,
                              model_options(layout, cap.vocab_size, cap.labels, float8_tp_gathers)))
    m = _extrapolate(points, depths, stage_layers)
    nparams, flops_per_token = titan.model_size(config)
    bubble = 0.0
    reserved = _reserved(points, m)
    exposed = dict(m["exposed"])
    communication = dict(m["communication"])
    contention = {k: v for k, v in m["contention"].items() if v > 0}
    if layout.pp > 1:
        microbatches = max(1, layout.local_batch_size // layout.microbatch_size)
        schedule = normalize_schedule(layout.pp_schedule)
        timer = CollectiveTimer(topology)
        stride = world_size // layout.pp
        activation_elems = batch * layout.seq_len * first.dim // max(1, layout.cp)
        p2p = timer.seconds("SendRecv", activation_elems, 2, [0, stride], peer=1)
        run = simulate_pipeline(schedule, layout.pp, microbatches, [m["forward"]], [m["backward"]], p2p, chunks)
        step = run.makespan + m["optimizer"]
        bubble = run.bubble
        # activations held at once on the first stage: its warm-up forwards plus the one in flight
        in_flight = (min(layout.pp, microbatches) if chunks == 1
                     else min(microbatches * chunks, 2 * (layout.pp - 1) + (chunks - 1) * layout.pp + 1))
        reserved += max(0, in_flight - 1) * m["activation"]
        communication["pp"] = communication.get("pp", 0.0) + 2 * microbatches * chunks * p2p
        compute = m["compute"] * microbatches * chunks
        for k in exposed:
            exposed[k] *= microbatches * chunks
        for k in contention:
            contention[k] *= microbatches * chunks
    else:
        step = m["step"]
        compute = m["compute"]
    tokens_per_gpu = layout.local_batch_size * layout.seq_len * layout.dp / world_size / step
    peak_bf16 = (gpu.bf16_tflops or 0.0) * 1e12
    mfu = flops_per_token * tokens_per_gpu / peak_bf16 if peak_bf16 else 0.0
    memory_gib = gpu_memory_gib if gpu_memory_gib is not None else float(gpu.memory_gb) * 1e9 / GiB
    phases = {k: m[k] for k in ("forward", "backward", "optimizer")}
    return Plan(layout, gpu.name, step, tokens_per_gpu, mfu, reserved / GiB, exposed, communication, phases,
                compute, flops_per_token, nparams, bubble, depths, reserved / GiB <= memory_gib, memory_gib,
                m["timeline"], contention)
