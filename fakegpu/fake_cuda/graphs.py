"""CUDA graphs on fake devices: capture records the aten ops, replay reruns them on the same
tensors.

A CUDA graph capture records the kernels a region launches, with their memory addresses, and
a replay launches them again on that memory, with none of the region's Python in between.
The fake devices' kernels are torch's CPU kernels, so the same thing is done one level up:

- **capture** runs the region eagerly under a dispatch mode that records each aten op with
  its arguments and outputs (the tensors themselves: the graph's memory pool), every storage
  resize (FSDP frees and re-grows its unsharded parameters that way) and every collective;
- a capture must not *do* the work (CUDA runs nothing until a replay), so each storage that
  existed before the capture and that an op writes gets its bytes saved before the first such
  write and put back when the capture ends; what the capture allocated keeps the values it
  computed (on a GPU they would be undefined until the first replay);
- **replay** reruns the recorded steps in order: ops that write their arguments (in-place,
  ``out=``, collectives) as they are, ops that make new tensors with the result copied into
  the tensors the capture made (the graph's fixed output addresses), views not at all (they
  alias what they did), ``empty*`` not at all (uninitialised memory); a collective's Work is
  waited before the next step, as the captured stream would order it.

What differs from a GPU: the region's ops run once more (during capture), so the report counts
the captured collectives once more; a capture is as permissive as eager mode (a GPU refuses a
synchronisation inside a capture).  See docs/fake-cuda.md, "CUDA graphs".
"""
from __future__ import annotations

import contextlib
import itertools
import threading
from typing import Any, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from .memory import UnsupportedOnFakeCuda

_local = threading.local()
_pool_ids = itertools.count(1)


def capturing() -> Optional["_Capture"]:
    """The capture under way on this thread (CUDA captures a stream; fake CUDA's streams all
    run on the calling thread)."""
    return getattr(_local, "capture", None)


def is_current_stream_capturing() -> bool:
    return capturing() is not None


def graph_pool_handle():
    """An opaque token naming a memory pool (torch's is a pair of integers)."""
    return (0, next(_pool_ids))


def record_storage_resize(storage, nbytes: int) -> None:
    """Called by fake CUDA's ``UntypedStorage.resize_`` after a resize."""
    capture = capturing()
    if capture is not None:
        capture.steps.append(_Resize(storage, nbytes))


# ---------------------------------------------------------------------------------------------
# Steps of a recorded graph


class _Resize:
    __slots__ = ("storage", "nbytes")

    def __init__(self, storage, nbytes: int):
        self.storage, self.nbytes = storage, nbytes

    def replay(self) -> None:
        from . import runtime as rt

        if self.storage.nbytes() != self.nbytes:
            rt.state().memory.resize(self.storage, self.nbytes, _ORIGINAL_RESIZE[0])


_ORIGINAL_RESIZE: list = [torch.UntypedStorage.resize_]


class _Op:
    __slots__ = ("func", "args", "kwargs", "outputs", "copy_outputs")

    def __init__(self, func, args, kwargs, outputs, copy_outputs: bool):
        self.func, self.args, self.kwargs = func, args, kwargs
        self.outputs = outputs          # the recorded outputs, flattened
        self.copy_outputs = copy_outputs

    def call(self):
        return self.func(*self.args, **self.kwargs)

    def replay(self) -> None:
        result = self.call()
        fresh, _ = tree_flatten(result)
        functional = _is_functional_collective(self.func)
        for recorded, new in zip(self.outputs, fresh):
            if isinstance(new, torch.ScriptObject) and hasattr(new, "wait"):
                new.wait()   # a collective's Work: the captured stream runs in order
            elif self.copy_outputs and isinstance(recorded, torch.Tensor) and recorded is not new:
                if functional:
                    # The graph's own wait_tensor step names the recorded tensor, which this
                    # replay's collective did not make: wait for the new one before copying.
                    torch.ops._c10d_functional.wait_tensor(new)
                recorded.copy_(new)


def _is_functional_collective(func) -> bool:
    namespace = getattr(func, "namespace", "")
    return namespace in ("_c10d_functional", "c10d_functional") and "wait_tensor" not in str(func)


class _Collective:
    __slots__ = ("method", "args", "kwargs")

    def __init__(self, method, args, kwargs):
        self.method, self.args, self.kwargs = method, args, kwargs

    def replay(self) -> None:
        work = self.method(*self.args, **self.kwargs)
        if work is not None and hasattr(work, "wait"):
            work.wait()   # the captured stream runs in order


class _HigherOrderOp(_Op):
    """A higher-order operator (flex attention, its backward) recorded whole: its outputs are
    what autograd saved, so rerunning it and copying them is what a replay of its kernels
    does.  It reruns as fake CUDA runs it eagerly, outside fakegpu's modes."""
    __slots__ = ()

    def call(self):
        from .kernels import _without_tracking_mode

        with _without_tracking_mode():
            return self.func(*self.args, **self.kwargs)


class _Opaque(_Op):
    """A Python call recorded whole (flex attention's entry point).  Autograd saved tensors
    made inside it for the backward the capture recorded (flex's logsumexp, which is not an
    output): a replay reruns the call with gradients, as the capture did, and copies both its
    outputs and its newly saved tensors into the recorded ones, so that the replayed backward
    reads this replay's values, not the capture's."""
    __slots__ = ("saved", "grad_enabled")

    def __init__(self, func, args, kwargs, outputs, saved: list, grad_enabled: bool):
        super().__init__(func, args, kwargs, outputs, True)
        self.saved, self.grad_enabled = saved, grad_enabled

    def call(self):
        if not self.saved:
            with torch.no_grad():
                return self.func(*self.args, **self.kwargs)
        fresh: list = []
        # Leaves over the recorded inputs' memory: autograd saves what it saved at capture
        # without checking the recorded tensors' history (replayed steps wrote into them).
        args, kwargs = tree_map(_fresh_leaf, (self.args, self.kwargs))
        with torch.enable_grad() if self.grad_enabled else contextlib.nullcontext(), \
                _saving_into(fresh, chain=False):
            result = self.func(*args, **kwargs)
        if len(fresh) != len(self.saved):
            raise RuntimeError(f"fakegpu: CUDA graph replay of {getattr(self.func, '__name__', self.func)}: "
                               f"it saved {len(fresh)} tensors for backward, the capture {len(self.saved)}")
        with torch.no_grad():
            for recorded, new in zip(self.saved, fresh):
                if recorded is not new and not _same_memory(recorded, new):
                    recorded.copy_(new)
        return tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, result)


def _fresh_leaf(value):
    if isinstance(value, torch.Tensor) and value.requires_grad:
        return value.detach().requires_grad_()
    return value


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()
            and a.dtype == b.dtype)


@contextlib.contextmanager
def _saving_into(saved: list, chain: bool):
    """Autograd's saved-tensor hooks that list every tensor saved for backward in ``saved``.
    With ``chain`` the hooks already in force (activation checkpointing's) still pack and unpack
    each tensor, so checkpointing saves and recomputes as it would without fakegpu."""
    outer = torch._C._autograd._top_saved_tensors_default_hooks(False) if chain else None
    outer_pack, outer_unpack = outer if outer else (None, None)

    def pack(tensor):
        saved.append(tensor)
        return outer_pack(tensor) if outer_pack is not None else tensor

    def unpack(packed):
        return outer_unpack(packed) if outer_unpack is not None else packed

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield


_EMPTY_FACTORIES = frozenset({"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided",
                              "empty_permuted"})


class _Kind:
    """What an op overload does to its arguments, from its schema (computed once per op)."""
    __slots__ = ("writes", "view_only", "uninitialised")

    def __init__(self, func):
        schema = func._schema
        self.writes = [i for i, a in enumerate(schema.arguments)
                       if a.alias_info is not None and a.alias_info.is_write]
        returns = schema.returns
        self.view_only = bool(returns) and not self.writes and all(r.alias_info is not None for r in returns)
        self.uninitialised = func._schema.name.split("::")[-1] in _EMPTY_FACTORIES


class _Capture:
    def __init__(self):
        self.steps: list = []
        self.created: set = set()      # storages the capture made (by StorageImpl)
        self.saved: dict = {}          # storage key -> (storage, nbytes, bytes before the capture)
        self.kinds: dict = {}
        self.in_collective = False

    def kind(self, func) -> _Kind:
        kind = self.kinds.get(func)
        if kind is None:
            kind = self.kinds[func] = _Kind(func)
        return kind

    def before(self, func, kind: _Kind, args, kwargs) -> None:
        if not kind.writes:
            return
        schema = func._schema
        for index in kind.writes:
            argument = schema.arguments[index]
            value = args[index] if index < len(args) else kwargs.get(argument.name)
            for tensor in tree_flatten(value)[0]:
                if isinstance(tensor, torch.Tensor):
                    self._save(tensor)

    def _save(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        key = storage._cdata
        if key in self.created or key in self.saved or storage.nbytes() == 0:
            return
        self.saved[key] = (storage, storage.nbytes(), storage.clone())

    def record(self, func, kind: _Kind, args, kwargs, out) -> None:
        outputs, _ = tree_flatten(out)
        if kind.view_only:
            return
        if not kind.writes:
            for tensor in outputs:
                if isinstance(tensor, torch.Tensor):
                    self.created.add(tensor.untyped_storage()._cdata)
            if kind.uninitialised:
                return
        # A writing op's own returns alias what it wrote, but some (batch norm's statistics)
        # are new tensors: copy only those.
        self.steps.append(_Op(func, args, kwargs, outputs, copy_outputs=True))

    def opaque(self, fn, args, kwargs):
        """``fn(*args, **kwargs)`` run outside the capture's mode and recorded as one step
        (fn steps out of the mode itself; see kernels.flex_attention).  Autograd state made
        by the call is made once, here; the tensors it saves for backward are listed, and a
        replay refreshes them and the outputs (_Opaque)."""
        saved: list = []
        with _saving_into(saved, chain=True):
            out = fn(*args, **kwargs)
        self.steps.append(_Opaque(fn, args, kwargs, tree_flatten(out)[0], saved, torch.is_grad_enabled()))
        return out

    def collective(self, method, args, kwargs):
        """A call of the fakegpu backend's ``method`` (it reads and writes the tensors among
        its arguments), run now and recorded as a step; a replay calls it again and waits."""
        if self.in_collective:   # one spelling of a collective calling another
            return method(*args, **kwargs)
        for tensor in tree_flatten((args, kwargs))[0]:
            if isinstance(tensor, torch.Tensor):
                self._save(tensor)
        self.in_collective = True
        try:
            work = method(*args, **kwargs)
        finally:
            self.in_collective = False
        self.steps.append(_Collective(method, args, kwargs))
        return work

    def restore(self) -> None:
        """Put back what the capture wrote into memory that existed before it."""
        with torch.no_grad():
            for storage, nbytes, before in self.saved.values():
                if storage.nbytes() == nbytes:
                    storage.copy_(before)
        self.saved.clear()


class _CaptureMode(TorchDispatchMode):
    supports_higher_order_operators = True

    def __init__(self, capture: _Capture):
        super().__init__()
        self.capture = capture

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if isinstance(func, torch._ops.HigherOrderOperator):
            out = func(*args, **kwargs)
            self.capture.steps.append(_HigherOrderOp(func, args, kwargs, tree_flatten(out)[0], True))
            return out
        capture = self.capture
        kind = capture.kind(func)
        capture.before(func, kind, args, kwargs)
        if getattr(func, "namespace", "") in _COLLECTIVE_NAMESPACES:
            # The op is the step; the backend call it makes is not another one.
            capture.in_collective = True
            try:
                out = func(*args, **kwargs)
            finally:
                capture.in_collective = False
        else:
            out = func(*args, **kwargs)
        capture.record(func, kind, args, kwargs, out)
        return out


_COLLECTIVE_NAMESPACES = frozenset({"c10d", "_c10d_functional", "c10d_functional"})


# ---------------------------------------------------------------------------------------------
# torch.cuda.CUDAGraph


class CUDAGraph:
    """``torch.cuda.CUDAGraph`` on fake devices (see the module docstring)."""

    def __new__(cls, keep_graph: bool = False):  # noqa: ARG003 - the GPU's instantiation choice
        return super().__new__(cls)

    def __init__(self, keep_graph: bool = False):
        self._keep_graph = keep_graph
        self._steps: Optional[list] = None
        self._capture: Optional[_Capture] = None
        self._mode: Optional[_CaptureMode] = None
        self._pool = None

    def capture_begin(self, pool=None, capture_error_mode: str = "global", **_options: Any) -> None:
        if capture_error_mode not in ("global", "thread_local", "relaxed"):
            raise ValueError(f"capture_error_mode={capture_error_mode!r}: expected 'global', "
                             "'thread_local' or 'relaxed'")
        if capturing() is not None:
            raise RuntimeError("fakegpu: a CUDA graph capture is already under way on this thread "
                               "(CUDA allows one capture per stream)")
        self._pool = pool if pool is not None else graph_pool_handle()
        self._capture = _Capture()
        self._mode = _CaptureMode(self._capture)
        self._mode.__enter__()
        _local.capture = self._capture

    def capture_end(self) -> None:
        capture = self._capture
        if capture is None or capturing() is not capture:
            raise RuntimeError("fakegpu: CUDAGraph.capture_end() without a capture_begin() on this thread")
        _local.capture = None
        self._mode.__exit__(None, None, None)
        self._mode = None
        capture.restore()
        self._steps, self._capture = capture.steps, None

    # torch 2.14 splits capture_end in two.
    def capture_end_pre(self) -> None:
        self.capture_end()

    def capture_end_post(self) -> None:
        pass

    def instantiate(self) -> None:
        self._require_graph("instantiate")

    def replay(self) -> None:
        steps = self._require_graph("replay")
        if capturing() is not None:
            raise RuntimeError("fakegpu: CUDAGraph.replay() inside another capture")
        with torch.no_grad():
            for step in steps:
                step.replay()

    def reset(self) -> None:
        self._steps = None

    def pool(self):
        if self._pool is None:
            raise RuntimeError("fakegpu: CUDAGraph.pool() before capture_begin()")
        return self._pool

    def pools(self) -> list:
        return [] if self._pool is None else [self._pool]

    def enable_debug_mode(self) -> None:
        pass

    def debug_dump(self, debug_path: str) -> None:
        """A text listing of the recorded steps (a GPU writes a DOT graph of kernels)."""
        steps = self._require_graph("debug_dump")
        with open(debug_path, "w") as out:
            for index, step in enumerate(steps):
                if isinstance(step, _Resize):
                    out.write(f"{index}: storage resize to {step.nbytes} bytes\n")
                elif isinstance(step, _Collective):
                    out.write(f"{index}: collective {step.method.__name__}\n")
                else:
                    out.write(f"{index}: {step.func}\n")

    def raw_cuda_graph(self) -> int:
        raise UnsupportedOnFakeCuda("fakegpu: CUDAGraph.raw_cuda_graph() has no cudaGraph_t on fake "
                                    "CUDA devices (a capture records torch ops, not kernels)")

    def raw_cuda_graph_exec(self) -> int:
        raise UnsupportedOnFakeCuda("fakegpu: CUDAGraph.raw_cuda_graph_exec() has no cudaGraphExec_t on "
                                    "fake CUDA devices (a capture records torch ops, not kernels)")

    @property
    def recorded_steps(self) -> int:
        """How many steps a replay runs (fakegpu's own; for tests and debugging)."""
        return len(self._steps or ())

    def _require_graph(self, what: str) -> list:
        if self._steps is None:
            raise RuntimeError(f"fakegpu: CUDAGraph.{what}() before a capture ended "
                               "(capture_begin ... capture_end, or torch.cuda.graph)")
        return self._steps


def install() -> None:
    """Put the emulation where torch's CUDA graph API reaches for the GPU: the class, and the
    two C functions torch.cuda.graphs calls (torch's own ``graph`` context manager,
    ``graph_pool_handle``, ``is_current_stream_capturing`` and ``make_graphed_callables``
    stay in place and work on top of them)."""
    import torch.cuda.graphs as graphs

    from .identity import replace

    _ORIGINAL_RESIZE[0] = getattr(torch.UntypedStorage.resize_, "__fakegpu_original__",
                                  torch.UntypedStorage.resize_)
    if not hasattr(torch._C, "_host_emptyCache"):
        # A CPU build has no pinned-host cache to empty (torch.cuda.graph empties it).
        torch._C._host_emptyCache = lambda: None
    graphs._graph_pool_handle = graph_pool_handle
    graphs._cuda_isCurrentStreamCapturing = is_current_stream_capturing
    CUDAGraph.__doc__ = graphs.CUDAGraph.__doc__
    replace(torch.cuda, "CUDAGraph", CUDAGraph, wrap=False)
