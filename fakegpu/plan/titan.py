"""Capture one TorchTitan training step at full size, on fake tensors, as one rank plays it.

The model, its parallelization (TorchTitan's own ``parallelize_fn``: FSDP2 / HSDP with its
mixed-precision policy, tensor and sequence parallelism, activation checkpointing), the
optimizer and the step's ops are those TorchTitan's trainer builds from the same config, run
as estimate_memory runs them: fake tensors (no memory), torch's ``fake`` process group over
the whole logical world (collectives complete at once), logical rank 0.  Every op and
collective of two steps is recorded (fakegpu.plan.capture.OpRecorder), tagged with its phase
(forward, loss, backward, optimizer), and every allocation is replayed through fakegpu's model
of the CUDA caching allocator for the peak reserved memory.

Layers are identical, so a deep model is captured at two small depths and extrapolated
linearly in the layer count (times, FLOPs, memory): what a layer adds is what the difference
of the two captures adds per layer.  Pipeline parallelism captures one model chunk (its share
of the layers) for one micro-batch; fakegpu.plan.pipeline schedules the chunks.

What TorchTitan compiles or converts is not run here: ``compile.enable`` and a Float8 linear
converter become model options of the cost model (fakegpu.plan.options).
"""
from __future__ import annotations

import contextlib
import copy
import gc
import math
from dataclasses import dataclass, field
from typing import Optional

GiB = 1024 ** 3


@dataclass
class Layout:
    """The parallelism and batch a TorchTitan config resolves to on ``world_size`` GPUs."""
    world_size: int
    dp_replicate: int
    dp_shard: int
    tp: int
    pp: int
    cp: int
    local_batch_size: int
    seq_len: int
    microbatch_size: int
    pp_schedule: str
    ac: str                 # none | selective | full
    compile: bool
    float8: bool
    async_tp: bool
    n_layers: int
    flavor: str
    module: str

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    def describe(self) -> str:
        parts = [f"dp_shard {self.dp_shard}"]
        for name in ("dp_replicate", "tp", "pp", "cp"):
            if getattr(self, name) > 1:
                parts.append(f"{name} {getattr(self, name)}")
        parts.append(f"local batch {self.local_batch_size}")
        parts.append(f"seq {self.seq_len}")
        parts.append(f"AC {self.ac}")
        if self.pp > 1:
            parts.append(self.pp_schedule)
        if self.compile:
            parts.append("compile")
        if self.float8:
            parts.append("float8")
        if self.async_tp:
            parts.append("async TP")
        return ", ".join(parts)


@dataclass
class TitanCapture:
    layout: Layout
    records: list
    labels: dict                         # group name -> mesh dimension name
    # the caching allocator's peaks in the last (steady) step: the peaks are reset before it
    peak_reserved_bytes: int
    peak_allocated_bytes: int
    activation_bytes: int                # one micro-batch's saved activations (forward's output excluded)
    phase_peaks: dict                    # phase -> peak allocated bytes in the last step
    captured_layers: int
    nparams: int                         # of the captured (maybe shallower) model
    flops_per_token: int                 # TorchTitan's own count for the captured model
    vocab_size: int
    dim: int
    extra: dict = field(default_factory=dict)


def _ac_name(config) -> str:
    ac = getattr(config, "activation_checkpoint", None)
    if ac is None:
        return "none"
    name = type(ac).__qualname__.lower()
    return "full" if "full" in name else ("selective" if "selective" in name else "none")


def _is_float8(value) -> bool:
    return "float8" in type(value).__qualname__.lower()


def _float8_linears(value, depth: int):
    """(parent, field name, config) of every Float8 linear config under ``value`` (dataclass
    configs and lists of them, ``depth`` levels down): TorchTitan's Float8 converter swaps a
    linear's config for a Float8Linear one."""
    import dataclasses as dc

    if depth == 0:
        return
    if isinstance(value, (list, tuple)):
        for each in value:
            yield from _float8_linears(each, depth - 1)
        return
    if not dc.is_dataclass(value) or isinstance(value, type):
        return
    for f in dc.fields(value):
        child = getattr(value, f.name, None)
        if _is_float8(child) and dc.is_dataclass(child):
            yield value, f.name, child
        else:
            yield from _float8_linears(child, depth - 1)


def _float8_converters(model_spec) -> bool:
    """Whether TorchTitan's Float8 converter swapped the model's linears (in the first block's
    attention and feed-forward)."""
    layers = getattr(getattr(model_spec, "model", None), "layers", None) or []
    return bool(layers) and next(_float8_linears(layers[0], 4), None) is not None


def _plain_config(value):
    """A Float8 linear's config as the plain linear config it extends (the first dataclass base
    without "float8" in its name), with the fields they share; None if it has no such base."""
    import dataclasses as dc

    for base in type(value).__mro__[1:]:
        if "float8" not in base.__qualname__.lower() and dc.is_dataclass(base):
            names = {f.name for f in dc.fields(base) if f.init}
            return base(**{n: getattr(value, n) for n in names if hasattr(value, n)})
    return None


def _strip_float8(model_config, depth: int = 6) -> None:
    """Replaces, in place, every Float8 linear config under ``model_config`` by its plain
    linear config: the model is built in bf16 and the cost model prices its linears as Float8
    (the rest of the config, a user's own changes included, stays as it is)."""
    for parent, name, config in list(_float8_linears(model_config, depth)):
        plain = _plain_config(config)
        if plain is not None:
            object.__setattr__(parent, name, plain)


def layout_of(config, world_size: int) -> Layout:
    """The layout a TorchTitan config resolves to (TorchTitan's own ParallelDims rules)."""
    from torchtitan.distributed import ParallelDims

    par = config.parallelism
    dims = ParallelDims.from_config(par, world_size)
    spec = config.model_spec
    n_layers = len(spec.model.layers)
    schedule = str(par.pipeline_parallel_schedule)
    compile_on = bool(getattr(config.compile, "enable", False)) and "model" in list(config.compile.components)
    return Layout(world_size, dims.dp_replicate, dims.dp_shard, dims.tp, dims.pp, dims.cp,
                  int(config.training.local_batch_size), int(config.training.seq_len),
                  int(par.pipeline_parallel_microbatch_size), schedule, _ac_name(config), compile_on,
                  _float8_converters(spec),
                  bool(getattr(config.compile, "enable_async_tensor_parallel", False)) and dims.tp > 1,
                  n_layers, spec.flavor, spec.name)


def pipeline_chunks(layout: Layout, layers_per_stage: Optional[int] = None) -> int:
    """Model chunks per pipeline rank: 1 for single-stage schedules, else TorchTitan's default
    of two stages per rank (or what ``layers_per_stage`` gives)."""
    from .pipeline import normalize_schedule

    if layout.pp == 1 or normalize_schedule(layout.pp_schedule) != "interleaved_1f1b":
        return 1
    if layers_per_stage:
        return max(1, math.ceil(layout.n_layers / layers_per_stage / layout.pp))
    return 2


def _flex_on_fake():
    from fakegpu.fake.estimate_memory import _flex_attention_on_fake_tensors

    return _flex_attention_on_fake_tensors()


def _uses_flex(model) -> bool:
    from torchtitan.models.common.attention import FlexAttention

    return any(isinstance(m, FlexAttention) for m in model.modules())


def _attention_inputs(model, parallel_dims, par, batch: int, seq: int) -> dict:
    """The forward's keyword inputs: flex attention's causal block mask and, under context
    parallelism, the global positions of the rank's tokens, as TorchTitan's ``cp_shard`` shards
    them (fakegpu.plan.block_masks builds the mask block by block: torch's own would
    materialise seq x seq booleans and compile a mask per rank)."""
    cp = parallel_dims.cp
    if not _uses_flex(model):
        if cp == 1:
            return {}
        # SDPA: torch's ring attention over the cp group (the capture runs it through the fused
        # kernel a GPU picks, fakegpu.fake_cuda.context_parallel); RoPE gets the positions
        from .block_masks import ring_positions

        balancer = getattr(par, "context_parallel_load_balancer", "headtail")
        return {"positions": ring_positions(batch, seq, cp, balancer)}
    from torchtitan.models.common.attention import FlexAttention

    from .block_masks import causal_block_mask

    FlexAttention.compiled_flex_attn = staticmethod(_flex_on_fake())
    balancer = getattr(par, "context_parallel_load_balancer", "headtail") if cp > 1 else None
    mask, positions = causal_block_mask(batch, seq, cp, balancer)
    inputs = {"attention_masks": mask}
    if positions is not None:
        inputs["positions"] = positions
    return inputs


def capture(config, world_size: int, n_layers: Optional[int] = None, batch_size: Optional[int] = None,
            steps: int = 2, device_gib: float = 96.0, probe_in_flight: bool = False) -> TitanCapture:
    """Record ``steps`` training steps of ``config`` as logical rank 0 of ``world_size``.

    ``probe_in_flight``: in the last step, run a second forward before the first one's backward
    (phase "probe", not timed) and measure what it adds: the memory one more micro-batch in
    flight holds on a pipeline stage (FSDP2 keeps the parameters unsharded between a stage's
    micro-batches, so the first forward's growth would count them too).

    ``n_layers``: build that many transformer blocks instead of the config's (pipeline chunks,
    depth extrapolation).  ``batch_size``: the batch one forward runs (a micro-batch under
    pipeline parallelism); default the config's local batch."""
    import torch
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import torchtitan.distributed.parallel_dims as titan_dims
    from torchtitan.distributed import ParallelDims

    from fakegpu.fake.estimate_memory import _AllocatorReplay, _replay_mode, _resize_hook
    from fakegpu.fake_cuda.context_parallel import ring_sdpa_patched

    from .capture import OpRecorder

    layout = layout_of(config, world_size)
    config = copy.deepcopy(config)
    par = config.parallelism
    if str(getattr(par, "spmd_backend", "")) == "spmd_types" and not hasattr(dist, "set_timeout"):
        par.spmd_backend = "partial_dtensor"   # torch 2.13's FSDP2 refuses spmd_types' plain tensors
    config.compile.enable = False              # a model option here, not a compiled program
    spec = config.model_spec
    if layout.float8:                          # likewise: the linears as the plain ones they convert
        _strip_float8(spec.model)
    model_config = spec.model
    if n_layers is not None:
        model_config.layers = list(model_config.layers)[:n_layers]
    batch = int(batch_size or layout.local_batch_size)
    seq = layout.seq_len

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        titan_dims.device_type = "cpu"          # fake tensors live on the CPU (see estimate_memory)
        from torchtitan.distributed import utils as titan_utils

        titan_utils.set_spmd_backend(par.spmd_backend)   # as the trainer does before building
        parallel_dims = ParallelDims.from_config(par, world_size)
        parallel_dims.build_mesh()
        labels = _group_labels(parallel_dims)
        model_config.update_from_config(config=config)
        with torch.device("meta"):
            previous = torch.get_default_dtype()
            torch.set_default_dtype(torch.float32)
            model = model_config.build()
            torch.set_default_dtype(previous)
        model = spec.parallelize_fn(model, parallel_dims=parallel_dims, training=config.training,
                                    parallelism=config.parallelism, compile_config=config.compile,
                                    ac_config=config.activation_checkpoint, dump_folder="/tmp")
        # the trainer's loss, as its trainer sets it up: with the chunked wrapper (TorchTitan's
        # default) the model skips its output projection and the loss runs it chunk by chunk
        from torchtitan.components.loss import ChunkedLossWrapper

        loss_fn = config.loss.build(compile_config=config.compile)
        if isinstance(loss_fn, ChunkedLossWrapper):
            loss_fn.set_lm_head(model.lm_head)
            model._skip_lm_head = True
        train_context = titan_utils.get_spmd_context(parallel_dims=parallel_dims)
        attention_kwargs = _attention_inputs(model, parallel_dims, par, batch, seq)
        local_seq = seq // parallel_dims.cp
        replay = _AllocatorReplay(int(device_gib * GiB))
        vocab = int(getattr(model_config, "vocab_size", 0) or 128256)
        dim = int(getattr(model_config, "dim", 0) or 0)
        tp_mesh = parallel_dims.get_optional_mesh("tp") if parallel_dims.tp > 1 else None
        activation = 0
        # SDPA under context parallelism runs as torch's ring attention, as on a GPU
        ring = ring_sdpa_patched() if parallel_dims.cp > 1 and not _uses_flex(model) else contextlib.nullcontext()
        with FakeTensorMode(allow_non_fake_inputs=True), _resize_hook(replay), ring:
            with _replay_mode(replay):
                model.to_empty(device="cpu")
            model.train()
            # TorchTitan's AdamW; the per-parameter loop (see estimate_memory for why).
            optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), eps=1e-8,
                                          weight_decay=0.1, foreach=False, fused=False)
            valid_tokens = torch.tensor(float(batch * seq * parallel_dims.dp_replicate * parallel_dims.dp_shard))
            recorder = OpRecorder()
            peaks = _PhasePeaks(replay, recorder)
            with _replay_mode(replay), peaks, recorder, recorder.marking_recomputation(), _collected_at_phases():
                for step in range(steps):
                    if step:
                        # The steady step's reserved memory, as the caching allocator holds it
                        # from the step before: the first step's free segments are given back
                        # (its optimizer-state creation runs full-size temporaries on fake CPU
                        # tensors that a GPU run does not), the gradients' stay.
                        replay.allocator.release_cached()
                        replay.allocator.reset_peak()
                    # TorchTitan zeroes the gradients at the start of a step: their blocks stay
                    # cached (holes the next activations may not fit in)
                    optimizer.zero_grad()
                    # under context parallelism a rank holds seq / cp tokens of each sequence
                    tokens = torch.randint(0, vocab, (batch, local_seq))
                    labels_t = torch.randint(0, vocab, (batch, local_seq))
                    before = replay.allocator.stat("allocated_bytes")
                    with _phase(recorder, "forward", step):
                        logits = model(tokens, **attention_kwargs)
                    # what a pipeline stage keeps per micro-batch in flight: the forward's saved
                    # tensors, not its output (only the last stage has logits, and it frees them
                    # with each micro-batch's backward)
                    output = _local(logits)
                    output_bytes = output.numel() * output.element_size()
                    del output
                    if not probe_in_flight:
                        activation = max(activation, replay.allocator.stat("allocated_bytes") - before
                                         - output_bytes)
                        with train_context():
                            with _phase(recorder, "loss", step):
                                loss, _ = loss_fn(logits, labels_t, valid_tokens)
                                del logits
                            with _phase(recorder, "backward", step):
                                loss.backward()
                    else:
                        # A pipeline stage: a second micro-batch's forward in flight measures
                        # what one adds; the first micro-batch's backward runs as the schedule
                        # runs it (no gradient sync, parameters left unsharded: the unsharded
                        # gradients accumulate over the micro-batches), not timed; the second's
                        # is the timed backward, with the accumulated gradients already there.
                        held = replay.allocator.stat("allocated_bytes")
                        with _phase(recorder, "probe", step):
                            second = model(tokens, **attention_kwargs)
                            activation = max(0, replay.allocator.stat("allocated_bytes") - held - output_bytes)
                        _stage_backward_without_sync(model)
                        with train_context():
                            with _phase(recorder, "probe_backward", step):
                                loss, _ = loss_fn(logits, labels_t, valid_tokens)
                                del logits
                                loss.backward()
                            with _phase(recorder, "loss", step):
                                loss, _ = loss_fn(second, labels_t, valid_tokens)
                                del second
                            with _phase(recorder, "backward", step):
                                loss.backward()
                    with _phase(recorder, "optimizer", step):
                        if probe_in_flight:
                            _stage_reduce_gradients(model)
                        _clip_grad_norm(model, parallel_dims)
                        optimizer.step()
            nparams_local = sum(_local(p).numel() for p in model.parameters())
        nparams, flops_per_token = _titan_flops(model_config, model, seq, parallel_dims)
        return TitanCapture(layout, recorder.records, labels,
                            int(replay.allocator.stat("reserved_bytes", field="peak")),
                            int(replay.allocator.stat("allocated_bytes", field="peak")),
                            int(activation), peaks.last_step(), len(model_config.layers), nparams, flops_per_token, vocab, dim,
                            {"nparams_local": nparams_local, "tp_mesh": tp_mesh is not None,
                             "all_peaks": dict(peaks.peaks)})
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


# Which name a group is reported under when several mesh dimensions share it (with data
# parallelism only, "batch", "loss" and "fsdp" are the same ranks): the parallelism first.
_LABEL_ORDER = ("tp", "cp", "pp", "fsdp", "dp_shard", "dp_replicate", "ep", "efsdp", "dp", "batch", "loss")


def _group_labels(parallel_dims) -> dict:
    meshes = dict(getattr(parallel_dims, "_single_axis_meshes", {}) or {})
    labels: dict = {}
    for name in sorted(meshes, key=lambda n: _LABEL_ORDER.index(n) if n in _LABEL_ORDER else len(_LABEL_ORDER)):
        mesh = meshes[name]
        if mesh is not None and mesh.size() > 1:
            labels.setdefault(mesh.get_group().group_name, name)
    return labels


@contextlib.contextmanager
def _collected_at_phases():
    """No garbage collection inside a phase, a full one between phases: the allocator replay
    frees a storage when Python does, and cyclic garbage collected at arbitrary moments made
    the peak differ from run to run by several GiB."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _fsdp_root(model):
    from torch.distributed.fsdp import FSDPModule

    return model if isinstance(model, FSDPModule) else None


def _stage_backward_without_sync(model) -> None:
    """Sets up a pipeline stage's backward of every micro-batch but the last, as
    torch.distributed.pipelining's stage runs it under FSDP2: no reduce-scatter, no resharding
    (until :func:`_stage_reduce_gradients` turns both back on)."""
    root = _fsdp_root(model)
    if root is not None:
        root.set_is_last_backward(False)
        root.set_reshard_after_backward(False)
        root.set_requires_gradient_sync(False)


def _stage_reduce_gradients(model) -> None:
    """The schedule's gradient reduction after the last micro-batch (the stage's
    ``perform_reduce_grad``): FSDP2's post-backward of every parameter group, then resharding."""
    from torch.distributed.fsdp import fully_shard

    root = _fsdp_root(model)
    if root is None:
        return
    root.set_is_last_backward(True)
    root.set_reshard_after_backward(True)
    root.set_requires_gradient_sync(True)
    state = fully_shard.state(root)
    for each in state._state_ctx.all_states:
        for group in each._fsdp_param_groups:
            group.post_backward()
    state._root_post_backward_final_callback()


@contextlib.contextmanager
def _phase(recorder, name: str, step: int):
    gc.collect()
    with recorder.phase(name, step):
        yield


class _PhasePeaks:
    """Peak allocated bytes per (step, phase), sampled after every op: each phase's peak grows
    linearly with depth even where the step's overall peak moves from one phase to another."""

    def __init__(self, replay, recorder):
        from torch.utils._python_dispatch import TorchDispatchMode

        peaks: dict = {}

        class Sample(TorchDispatchMode):
            supports_higher_order_operators = True

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                key = (recorder.current_step, recorder.current_phase)
                now = replay.allocator.stat("allocated_bytes")
                if now > peaks.get(key, -1):
                    peaks[key] = now
                return out

        self.peaks = peaks
        self._mode = Sample()

    def __enter__(self):
        return self._mode.__enter__()

    def __exit__(self, *exc):
        return self._mode.__exit__(*exc)

    def last_step(self) -> dict:
        last = max((s for s, _ in self.peaks), default=0)
        return {phase: int(v) for (s, phase), v in self.peaks.items() if s == last}


def _local(t):
    return getattr(t, "_local_tensor", t)


def _clip_grad_norm(model, parallel_dims) -> None:
    """TorchTitan's gradient clipping (its norm is all-reduced over the mesh)."""
    import torch

    from torchtitan.distributed.utils import clip_grad_norm_

    params = [p for p in model.parameters() if p.grad is not None]
    if params:
        pp_mesh = parallel_dims.get_optional_mesh("pp") if parallel_dims.pp > 1 else None
        with torch.no_grad():
            # with expert parallelism the experts' gradients live on another mesh than the
            # dense ones: TorchTitan's clipping norms each mesh's separately (ep_enabled)
            clip_grad_norm_(params, 1.0, foreach=True, pp_mesh=pp_mesh,
                            ep_enabled=bool(getattr(parallel_dims, "ep_enabled", False)))


def _titan_flops(model_config, model, seq: int, parallel_dims) -> tuple[int, int]:
    """(parameters, FLOPs per token) as TorchTitan's trainer counts them for its MFU: the model
    config's own ``get_nparams_and_flops`` (a mixture of experts counts the experts a token is
    routed to, not all of them), else 6 x the non-embedding parameters + 12 x layers x heads x
    head dim x sequence."""
    own = getattr(model_config, "get_nparams_and_flops", None)
    if callable(own):
        try:
            nparams, flops = own(model, seq)
            return int(nparams), int(flops)
        except (NotImplementedError, AttributeError, AssertionError, TypeError):
            pass                  # a config whose counting needs what this model lacks: the rule below
    layers = len(model_config.layers)
    attention = model_config.layers[0].attention if layers else None
    heads = int(getattr(attention, "n_heads", 0) or 0)
    dim = int(getattr(model_config, "dim", 0) or 0)
    head_dim = dim // heads if heads else 0
    nparams = sum(_global_numel(p) for p in model.parameters())
    embedding = sum(_global_numel(p) for n, p in model.named_parameters() if "embed" in n)
    return nparams, int(6 * (nparams - embedding) + 12 * layers * heads * head_dim * seq)


def model_size(config) -> tuple[int, int]:
    """(parameters, FLOPs per token) of the whole model a config describes (built on the meta
    device: nothing is allocated), counted as TorchTitan counts them for its MFU."""
    import torch

    model_config = copy.deepcopy(config.model_spec.model)
    model_config.update_from_config(config=config)
    with torch.device("meta"):
        model = model_config.build()
    return _titan_flops(model_config, model, int(config.training.seq_len), None)


def _global_numel(p) -> int:
    return int(math.prod(p.shape))
