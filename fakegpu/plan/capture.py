"""The aten ops a region runs, recorded on fake tensors (no memory), and their modeled time.

:class:`OpRecorder` is a TorchDispatchMode that records every aten op it sees as an
:class:`~fakegpu.plan.compute.OpRecord` (op, input and output shapes and dtypes, FLOPs, bytes,
geometry).  Enter it *inside* torch's ``FakeTensorMode`` (as fakegpu.fake.estimate_memory's
replay mode is) so the ops run on fake tensors::

    with FakeTensorMode(), OpRecorder() as recorder:
        model = build()                  # parameters are fake: a full-size model costs nothing
        model(x).sum().backward()
    recorder.records

Conventions shared with estimate_memory's replay: higher-order ops (flex attention) pass
through; an op on a tensor subclass that wraps others (DTensor, FSDP2's parameters) is not
recorded itself, the ops it runs on its inner tensors are (the mode hands the op on to the
subclass and stays active below it).  As torch's FlopCounterMode does, an op with no FLOP
formula that has a CompositeImplicitAutograd decomposition is recorded as its decomposition,
so both count the same FLOPs.  Likewise a ``torch.library.custom_op`` (opaque to the
dispatcher: only its fake implementation would run) is recorded as what its Python body runs:
context parallelism's ``cplib::flex_cp_allgather`` is two all-gathers, and a body that cannot
run on fake tensors (a Triton kernel) leaves the op recorded as itself.

:func:`estimate_compute` runs a function that way and costs its ops on one GPU.
"""
from __future__ import annotations

import contextlib
import dataclasses
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorMode
from torch.nn.utils.stateless import _reparametrize_module
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves, tree_map

from .collectives import describe_collective
from .compute import (_COMMUNICATION_NAMESPACES, OpCost, OpRecord, _mutated_tensors, describe_op, flop_formula,
                      model_op)
from .gpu_compute import GpuCompute, compute_of
from .host_values import HostValues


class HostValueUnknown(ValueError):
    """The program read a GPU value back to the host that fake tensors do not have."""


def _buffers(values) -> tuple:
    """(storage key, bytes) of each distinct tensor: what the timeline's dependencies are on."""
    seen, out = set(), []
    for t in tree_leaves(values):
        if not isinstance(t, torch.Tensor) or is_traceable_wrapper_subclass(t):
            continue
        try:
            key = t.untyped_storage()._cdata
        except (RuntimeError, NotImplementedError):
            continue      # a tensor without storage (sparse, nested): no dependency to track
        if key not in seen:
            seen.add(key)
            out.append((key, t.numel() * t.element_size()))
    return tuple(out)


_shape_inference_patches = 0


@contextlib.contextmanager
def _dtensor_shape_inference_unseen():
    """DTensor infers an op's global output shape by running the op once more at the global
    shape on fake tensors (``ShardingPropagator._propagate_tensor_meta_non_cached``) under the
    current modes; no GPU runs that op, so it runs outside them (a fresh fake mode) and is
    neither recorded nor charged.  The sharding cache keeps most calls from getting here;
    context parallelism's ring-attention handler gets here at every call."""
    global _shape_inference_patches
    try:
        from torch.distributed.tensor._sharding_prop import ShardingPropagator
        from torch.utils._python_dispatch import _disable_current_modes
    except ImportError:                  # a torch without distributed: no DTensor
        yield
        return
    original = ShardingPropagator._propagate_tensor_meta_non_cached

    def unseen(self, op_schema):
        with _disable_current_modes():
            return original(self, op_schema)

    if _shape_inference_patches == 0:
        ShardingPropagator._propagate_tensor_meta_non_cached = unseen
    _shape_inference_patches += 1
    try:
        yield
    finally:
        _shape_inference_patches -= 1
        if _shape_inference_patches == 0:
            ShardingPropagator._propagate_tensor_meta_non_cached = original


class OpRecorder(TorchDispatchMode):
    """Records each aten op run below it (see the module's docstring), with the buffers it
    reads and writes, the collective it runs, and the phase and step set by :meth:`phase`."""

    supports_higher_order_operators = True

    def __init__(self):
        super().__init__()
        self.records: list[OpRecord] = []
        # storage address -> buffer id: a storage freed and another allocated at the same
        # address are different buffers (an op's fresh output gets a new id), so a dependency
        # or a fused chain's "read later" never links two unrelated tensors
        self._ids: dict = {}
        self._next_id = 0
        self.current_phase = ""
        self.current_step = 0
        self.recomputing = 0          # depth of activation-checkpoint recomputations running
        self._unseen: list = []       # one per (re-)entry: the recorder re-enters itself
        # >0 while a functional collective (recorded as that op) runs: the process group call
        # it makes underneath is the same collective (fakegpu.plan.generic's observer skips it)
        self.running_functional_collective = 0
        # the values of small integer tensors that follow from the program (a balanced
        # router's token counts), for the .item() / .tolist() reads that need them
        self.host_values = HostValues()

    def __enter__(self):
        unseen = _dtensor_shape_inference_unseen()
        unseen.__enter__()
        self._unseen.append(unseen)
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._unseen.pop().__exit__(None, None, None)

    def buffer_ids(self, buffers, fresh: bool = False) -> tuple:
        """(buffer id, bytes) for (storage address, bytes) pairs; ``fresh``: newly allocated."""
        out = []
        for address, nbytes in buffers:
            if fresh or address not in self._ids:
                self._next_id += 1
                self._ids[address] = self._next_id
            out.append((self._ids[address], nbytes))
        return tuple(out)

    @contextlib.contextmanager
    def phase(self, name: str, step: Optional[int] = None):
        """Records made inside carry ``name`` (and ``step`` when given) as their phase."""
        before = (self.current_phase, self.current_step)
        self.current_phase = name
        if step is not None:
            self.current_step = step
        try:
            yield self
        finally:
            self.current_phase, self.current_step = before

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(is_traceable_wrapper_subclass(t) for t in tree_leaves((args, kwargs))
               if isinstance(t, torch.Tensor)):
            return NotImplemented     # the subclass runs it; its inner ops come back here
        value = self.host_values.scalar(func, args)
        if value is not None:
            return value              # a host read of a value the program's structure gives
        if (isinstance(func, torch._ops.OpOverload) and flop_formula(func) is None
                and func is not torch.ops.prim.device.default):
            with self:
                decomposed = func.decompose(*args, **kwargs)
            if decomposed is not NotImplemented:
                return decomposed
        body = _custom_op_body(func)
        if body is not None:
            recorded, ids = len(self.records), (dict(self._ids), self._next_id)
            try:
                with self:
                    return body(*args, **kwargs)
            except Exception:       # noqa: BLE001 - not runnable here: record the op itself
                del self.records[recorded:]
                self._ids, self._next_id = ids
        functional = getattr(func, "namespace", None) in _FUNCTIONAL_COLLECTIVES
        self.running_functional_collective += functional
        try:
            out = func(*args, **kwargs)
        except DataDependentOutputException:
            raise HostValueUnknown(
                f"the program reads a GPU value back to the host ({func}: .item(), .tolist() or a "
                "Python condition on a tensor) that fake tensors do not have; fgpu plan knows the "
                "values of counts a balanced top-k router gives and of constants, not of data or "
                "of results computed from activations") from None
        finally:
            self.running_functional_collective -= functional
        self.host_values.after(func, args, kwargs, out)
        if getattr(func, "namespace", None) != "prim":     # prim.device and the like: no GPU work
            record = describe_op(func, args, kwargs, out)
            if record.kind in ("view", "no_kernel"):
                reads = writes = ()     # nothing runs: nothing waits, nothing becomes ready
                # but an allocation (empty, new_empty) is a new buffer at its address
                inputs = {a for a, _ in _buffers((args, kwargs))}
                self.buffer_ids(tuple(b for b in _buffers(out) if b[0] not in inputs), fresh=True)
            else:
                raw_reads = _buffers((args, kwargs))
                reads = self.buffer_ids(raw_reads)
                mutated = _buffers(_mutated_tensors(func, args, kwargs))
                read_addresses = {a for a, _ in raw_reads}
                # outputs that are not inputs written in place are new buffers
                fresh = tuple(b for b in _buffers(out) if b[0] not in read_addresses and b not in mutated)
                writes = self.buffer_ids(mutated) + self.buffer_ids(fresh, fresh=True) + \
                    self.buffer_ids(tuple(b for b in _buffers(out) if b[0] in read_addresses and b not in mutated))
            collective = describe_collective(func, args, kwargs) if record.kind == "communication" else None
            self.records.append(dataclasses.replace(
                record, reads=reads, writes=writes, collective=collective,
                phase=self.current_phase, step=self.current_step, recomputed=self.recomputing > 0))
        return out

    @contextlib.contextmanager
    def marking_recomputation(self):
        """Ops that torch.utils.checkpoint reruns inside the backward are recorded with
        ``recomputed`` set: a tensor they read is a checkpoint's saved input (kept from the
        forward to the backward whatever compiles it), which the compile savings must not count.
        torch enters its ``_recomputation_hook`` around every recomputation (non-reentrant
        checkpoint, the one TorchTitan and FSDP2 programs use)."""
        import torch.utils.checkpoint as checkpoint

        original = checkpoint._recomputation_hook
        recorder = self

        class _Marked(original):
            def __enter__(self):
                recorder.recomputing += 1
                return super().__enter__()

            def __exit__(self, *exc):
                recorder.recomputing -= 1
                return super().__exit__(*exc)

        checkpoint._recomputation_hook = _Marked
        try:
            yield self
        finally:
            checkpoint._recomputation_hook = original


# torch's functional collectives (DTensor's, tensor and context parallelism's): recorded as the
# op, which runs its collective on the process group underneath.
_FUNCTIONAL_COLLECTIVES = {"_c10d_functional", "_c10d_functional_autograd", "c10d_functional"}

# Namespaces whose ops the recorder understands as they are (a custom op there is not unwrapped).
_OPAQUE_NAMESPACES = {"aten", "prim", "prims", "higher_order"} | _COMMUNICATION_NAMESPACES


def _custom_op_body(func) -> Optional[Callable]:
    """The Python function a ``torch.library.custom_op`` runs on a device, or None (an aten op,
    a C++ op, a custom op defined without a body)."""
    if not isinstance(func, torch._ops.OpOverload) or func.namespace in _OPAQUE_NAMESPACES:
        return None
    from torch._library.custom_ops import _maybe_get_opdef

    definition = _maybe_get_opdef(func)
    return getattr(definition, "_init_fn", None) if definition is not None else None


@dataclass
class ComputeEstimate:
    """The ops of a region and their modeled cost on one GPU."""
    gpu: GpuCompute
    records: list[OpRecord]
    costs: list[OpCost] = field(default_factory=list)

    @property
    def seconds(self) -> float:
        """Modeled GPU time of the region's ops run back to back on one stream."""
        return sum(c.seconds for c in self.costs)

    @property
    def flops(self) -> int:
        return sum(r.flops for r in self.records)

    @property
    def bytes(self) -> int:
        return sum(r.bytes for r in self.records)

    @property
    def kernels(self) -> int:
        return sum(1 for c in self.costs if c.seconds > 0)

    def by_op(self) -> dict[str, dict]:
        """Per op name: count, seconds, flops, bytes; the most expensive first."""
        rows: dict[str, dict] = defaultdict(lambda: {"count": 0, "seconds": 0.0, "flops": 0, "bytes": 0})
        for c in self.costs:
            row = rows[c.name]
            row["count"] += 1
            row["seconds"] += c.seconds
            row["flops"] += c.flops
            row["bytes"] += c.bytes
        return dict(sorted(rows.items(), key=lambda kv: -kv[1]["seconds"]))

    def on(self, gpu, allow_tf32: Optional[bool] = None) -> "ComputeEstimate":
        """The same ops costed on another GPU (nothing is re-run)."""
        return cost_records(self.records, gpu, allow_tf32)


def cost_records(records: list[OpRecord], gpu, allow_tf32: Optional[bool] = None) -> ComputeEstimate:
    gpu = compute_of(gpu)
    return ComputeEstimate(gpu, list(records), [model_op(r, gpu, allow_tf32) for r in records])


def estimate_compute(fn: Callable, *args: Any, profile="h100", allow_tf32: Optional[bool] = None,
                     **kwargs: Any) -> ComputeEstimate:
    """Run ``fn(*args, **kwargs)`` on fake tensors under :class:`OpRecorder` and cost its ops
    on ``profile`` (a catalogue name, a GpuProfile or a GpuCompute).

    Tensor arguments are turned into fake ones first, and a module argument runs with fake
    copies of its parameters and buffers in their place (its own are untouched: no gradients, no
    running statistics).  Such a model is in memory already; build a full-size one inside
    ``fn``, where it is fake from the start (an optimizer too: one made outside holds the real
    parameters).  ``allow_tf32``: None follows ``torch.backends.cuda.matmul.allow_tf32`` as ``fn`` leaves it
    when each op runs."""
    gpu = compute_of(profile)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode, contextlib.ExitStack() as swaps:
        fake_args, fake_kwargs = tree_map(
            lambda v: mode.from_tensor(v) if isinstance(v, torch.Tensor) else v, (args, kwargs))
        for module in {id(v): v for v in (*args, *kwargs.values()) if isinstance(v, torch.nn.Module)}.values():
            state = [*module.named_parameters(remove_duplicate=False),
                     *module.named_buffers(remove_duplicate=False)]
            swaps.enter_context(_reparametrize_module(module, {n: mode.from_tensor(t) for n, t in state}))
        with OpRecorder() as recorder:
            fn(*fake_args, **fake_kwargs)
    return cost_records(recorder.records, gpu, allow_tf32)
