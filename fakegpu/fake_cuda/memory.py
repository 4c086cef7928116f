"""Which fake device each storage lives on, and the caching-allocator figures per device.

Every tensor of a fake CUDA program is a CPU tensor; what makes one "on cuda:k" here is how
it came to be: a factory or a ``.to`` / ``.cuda()`` aimed at ``cuda:k`` (the device
rewrite mode says so through :func:`placing_on`), or an operation whose inputs are on
``cuda:k`` (the result of an op stays on its inputs' device, as on a GPU).  The tracking mode
sees every aten operation's outputs; a storage it has not seen before is charged to that
device's :class:`CachingAllocatorModel` and released when the storage dies (a weakref on the
storage object, which torch keeps alive as long as the C++ storage lives — including
tensors autograd saved for backward).
"""
from __future__ import annotations

import ctypes
import threading
import weakref
from contextlib import contextmanager
from typing import Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .allocator import CachingAllocatorModel, OutOfMemory

_tls = threading.local()


class DeviceMemory:
    """The allocator models of this process's fake devices and which storage is on which.

    Two ways to know the latter: the C++ storage tracker (:meth:`use_native`,
    native/storage_tracker.cc), which watches every op from a dispatch key and keeps the
    storage -> block map itself, or the Python :class:`TrackingMode` with the map kept here
    (a weakref per storage releases its block).  The methods below answer for either."""

    def __init__(self, totals: list[int]):
        self.models = [CachingAllocatorModel(i, total) for i, total in enumerate(totals)]
        # id(storage) -> (device, block, weakref that releases the block when the storage dies)
        self._blocks: dict[int, tuple] = {}
        self._lock = threading.Lock()
        self.native = None      # the tracker's cffi lib once use_native() succeeded
        self._ffi = None
        # Native tracking: storages resized to 0 bytes (no memory, so the tracker forgot them)
        # -> (device, weakref), so that a later resize_ re-grows them on the same device.
        self._emptied: dict[int, tuple] = {}

    # -- the C++ tracker ----------------------------------------------------------------------
    def use_native(self, ffi, lib) -> None:
        """Hand the models to the C++ tracker; from here on it keeps the storage map."""
        global _native
        from .allocator import model_entry_points

        @ffi.callback("int(int, uint64_t, char*, int)")
        def out_of_memory_message(device, nbytes, buffer, capacity):
            text = self.models[device].out_of_memory_message(int(nbytes)).encode()[:capacity]
            ffi.memmove(buffer, text, len(text))
            return len(text)

        @ffi.callback("int(uintptr_t, uintptr_t*, int)", error=-1)
        def subclass_storages(address, out, capacity):
            # A wrapper subclass (DTensor...) that an op takes or returns, by its PyObject's
            # address (alive: the op's stack holds it): the storages of its inner tensors.
            storages: list = []
            try:
                _storages(ctypes.cast(address, ctypes.py_object).value, storages)
            except Exception:  # noqa: BLE001 - a tensor without storages (traced, sparse): none
                return 0
            for index, storage in enumerate(storages[:capacity]):
                out[index] = storage._cdata
            return min(len(storages), capacity)

        # kept alive: C++ calls them
        self._callbacks = (out_of_memory_message, subclass_storages)
        malloc, free = model_entry_points()
        lib.fakegpu_tracker_configure(malloc, free, int(ffi.cast("uintptr_t", out_of_memory_message)),
                                      int(ffi.cast("uintptr_t", subclass_storages)))
        for model in self.models:
            lib.fakegpu_tracker_add_device(ffi.cast("void*", model.address))
        self.native, self._ffi = lib, ffi
        _native = lib
        import atexit

        atexit.register(lib.fakegpu_tracker_stop)   # before the models are collected

    def _pointer(self, storage):
        return self._ffi.cast("void*", storage._cdata)

    def tracked_storages(self) -> int:
        return int(self.native.fakegpu_tracker_count()) if self.native is not None else len(self._blocks)

    # -- either way ---------------------------------------------------------------------------
    def device_of_storage(self, storage) -> Optional[int]:
        if self.native is not None:
            device = self.native.fakegpu_tracker_device_of(self._pointer(storage))
            return None if device < 0 else device
        entry = self._blocks.get(id(storage))
        return None if entry is None else entry[0]

    def charge(self, storage, device: int) -> None:
        """Account ``storage`` (not yet seen) on ``device``."""
        if self.native is not None:
            if self.native.fakegpu_tracker_charge(self._pointer(storage), device) == 2:
                raise torch.OutOfMemoryError(self.models[device].out_of_memory_message(storage.nbytes()))
            return
        key = id(storage)
        if key in self._blocks:
            return
        nbytes = storage.nbytes()
        if nbytes == 0:
            return
        with self._lock:
            try:
                block = self.models[device].malloc(nbytes)
            except OutOfMemory as exc:
                raise torch.OutOfMemoryError(str(exc)) from None
            self._blocks[key] = (device, block, weakref.ref(storage, lambda _ref, key=key: self._release(key)))

    def charge_tensor(self, tensor, device: int) -> None:
        """A tensor moved to ``device`` by ``.cuda()`` / ``.to()``: its storage is there now."""
        storages: list = []
        _storages(tensor, storages)
        for storage in storages:
            self.charge(storage, device)

    def _release(self, key: int) -> None:
        with self._lock:
            entry = self._blocks.pop(key, None)
            if entry is not None and entry[1] is not _EMPTY:
                self.models[entry[0]].free(entry[1])

    def resize(self, storage, new_nbytes: int, resize) -> None:
        """``resize(storage, new_nbytes)`` (torch's ``UntypedStorage.resize_``) on a storage,
        followed in the accounting: FSDP frees and re-grows unsharded parameters this way."""
        if self.native is None:
            resize(storage, new_nbytes)
            self.resized(storage, new_nbytes)
            return
        key = id(storage)
        device = self.device_of_storage(storage)
        if device is None and key in self._emptied:
            device = self._emptied[key][0]
        resize(storage, new_nbytes)   # a new allocation: the tracker freed the old block
        if device is None:
            return
        if new_nbytes:
            self._emptied.pop(key, None)
            self.charge(storage, device)
        elif key not in self._emptied:
            self._emptied[key] = (device, weakref.ref(storage, lambda _ref, key=key: self._emptied.pop(key, None)))

    def resized(self, storage, new_nbytes: int) -> None:
        """The Python map's side of :meth:`resize`, after the storage was resized."""
        key = id(storage)
        with self._lock:
            entry = self._blocks.get(key)
            if entry is None:
                return
            device, block, ref = entry
            if block is not _EMPTY:
                self.models[device].free(block)
            if new_nbytes:
                try:
                    self._blocks[key] = (device, self.models[device].malloc(new_nbytes), ref)
                except OutOfMemory as exc:
                    del self._blocks[key]
                    raise torch.OutOfMemoryError(str(exc)) from None
            else:
                # An empty storage holds no block; keep the key so a later resize re-grows it.
                self._blocks[key] = (device, _EMPTY, ref)


class _EmptyBlock:
    allocated = False


_EMPTY = _EmptyBlock()  # the block of a storage resized to 0 bytes


_native = None   # the C++ tracker's lib when it keeps the accounting


@contextmanager
def placing_on(device: int):
    """New storages created inside belong to fake device ``device``."""
    previous = getattr(_tls, "target", None)
    _tls.target = device
    native = _native
    if native is not None:
        native_previous = native.fakegpu_tracker_set_target(device)
    try:
        yield
    finally:
        _tls.target = previous
        if native is not None:
            native.fakegpu_tracker_set_target(native_previous)


class NativeTracking:
    """The C++ tracker's counterpart of entering :class:`TrackingMode`: the calling thread's
    ops pass through the tracker's dispatch key (torch keeps dispatch keys per thread)."""

    def __init__(self, lib):
        self._lib = lib

    def __enter__(self):
        self._lib.fakegpu_tracker_enable_thread(1)
        return self

    def __exit__(self, *exc_info):
        self._lib.fakegpu_tracker_enable_thread(0)
        return False


def higher_order_operators_pass_over(dispatch_key) -> None:
    """torch's higher-order operators (flex_attention, checkpointing's wrappers, cond, ...)
    dispatch in Python and refuse a key they have no rule for: the tracker's key is one they
    pass over (the ops they run inside are tracked as any others)."""
    from torch import _ops

    for operator in list(getattr(_ops, "_higher_order_ops", {}).values()):
        operator.fallthrough(dispatch_key)
    defaults = getattr(_ops, "_HIGHER_ORDER_OP_DEFAULT_FALLTHROUGH_DISPATCH_KEYS", None)
    if defaults is not None and dispatch_key not in defaults:
        defaults.append(dispatch_key)   # operators created later


def current_target() -> Optional[int]:
    return getattr(_tls, "target", None)


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _storages(value, out: list) -> None:
    kind = type(value)
    if kind in _PLAIN:
        if value.layout is torch.strided and not value.is_meta:
            out.append(value.untyped_storage())
        return
    if kind is tuple or kind is list:
        for item in value:
            _storages(item, out)
        return
    if isinstance(value, torch.Tensor):
        if type(value) is torch.Tensor or type(value) is torch.nn.Parameter:
            if value.layout is torch.strided and not value.is_meta:
                out.append(value.untyped_storage())
            return
        flatten = getattr(value, "__tensor_flatten__", None)
        if flatten is not None:  # DTensor and other wrapper subclasses: their inner tensors
            for name in flatten()[0]:
                _storages(getattr(value, name), out)
        return
    if isinstance(value, (list, tuple)):
        for item in value:
            _storages(item, out)


_CPU = torch.device("cpu")


def _current_device() -> int:
    from . import runtime

    return runtime.state().current


class UnsupportedOnFakeCuda(RuntimeError):
    """An operation torch (or an extension) implements only for real GPUs."""


def unsupported_message(op_name: str) -> str:
    return (f"fakegpu: {op_name} has no CPU implementation, so fakegpu's fake CUDA devices "
            "(host memory, torch's CPU kernels) cannot run it; run the job on real GPUs "
            "(fgpu --mode hybrid) or register a CPU kernel for it "
            "(torch.library.register_kernel(..., 'cpu'))")


def _returns_only_aliases(func) -> bool:
    """Every output of ``func`` aliases an input (views, in-place and ``out=`` ops): such an
    op never creates a storage, so the tracking mode has nothing to charge."""
    schema = getattr(func, "_schema", None)   # higher-order operators have none
    if schema is None:
        return False
    returns = schema.returns
    return bool(returns) and all(r.alias_info is not None for r in returns)


class TrackingMode(TorchDispatchMode):
    """Charges new storages to fake devices; turns 'no CPU kernel' into one clear line.

    It sits on every aten op, so its path is kept short: ops whose outputs all alias their
    inputs are recognised once per overload and returned at once."""

    # Higher-order operators (flex_attention, the checkpoint and control-flow ops) come here
    # too and run with this mode popped, as torch runs them without modes: their outputs are
    # charged, their internal temporaries are not (as for another subclass's dispatch).
    supports_higher_order_operators = True

    def __init__(self, memory: DeviceMemory):
        super().__init__()
        self.memory = memory
        self._aliasing: dict = {}   # OpOverload -> its outputs only alias inputs

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        target = None
        if kwargs:
            device = kwargs.get("device")
            if device is not None and device.type == "cuda":
                # A cuda device that reached aten without passing the Python API's rewrite (code
                # running under DisableTorchFunction, C++ callers): the CPU all the same.
                target = device.index if device.index is not None else _current_device()
                kwargs = dict(kwargs)
                kwargs["device"] = _CPU
        else:
            kwargs = {}
        try:
            out = func(*args, **kwargs)
        except NotImplementedError as exc:
            text = str(exc)
            if "with arguments from the 'CPU' backend" in text or "with arguments from the 'CPU'" in text:
                raise UnsupportedOnFakeCuda(unsupported_message(func.name())) from None
            raise
        aliasing = self._aliasing.get(func)
        if aliasing is None:
            aliasing = self._aliasing[func] = _returns_only_aliases(func)
        if aliasing:
            return out
        return self.charge_outputs(out, args, kwargs, target)

    def charge_outputs(self, out, args, kwargs, target=None):
        """Charge the new storages of ``out`` to ``target``, else to the device the placement
        context names, else to the first input's."""
        device = getattr(_tls, "target", None) if target is None else target
        blocks = self.memory._blocks
        if device is None:
            device = _first_device(args, blocks)
            if device is None and kwargs:
                device = _first_device(tuple(kwargs.values()), blocks)
            if device is None:
                return out
        if type(out) in _PLAIN:
            if out.layout is torch.strided and not out.is_meta:
                storage = out.untyped_storage()
                if id(storage) not in blocks:
                    self.memory.charge(storage, device)
            return out
        outputs: list = []
        _storages(out if isinstance(out, (list, tuple)) else [out], outputs)
        for storage in outputs:
            if id(storage) not in blocks:
                self.memory.charge(storage, device)
        return out


def _first_device(values, blocks) -> Optional[int]:
    """Fake device of the first input whose storage is on one (the device an op runs on)."""
    for value in values:
        kind = type(value)
        if kind in _PLAIN:
            if value.layout is torch.strided and not value.is_meta:
                entry = blocks.get(id(value.untyped_storage()))
                if entry is not None:
                    return entry[0]
        elif kind is list or kind is tuple:
            found = _first_device(value, blocks)
            if found is not None:
                return found
        elif isinstance(value, torch.Tensor):
            inner: list = []
            _storages(value, inner)
            for storage in inner:
                entry = blocks.get(id(storage))
                if entry is not None:
                    return entry[0]
    return None


def charge_compiled_graph_outputs(memory: DeviceMemory) -> None:
    """Outputs of inductor-compiled graphs, charged to the device of their first tracked input.

    With the C++ tracker torch.compile compiles (dynamo refuses only Python dispatch modes),
    and inductor's generated CPU code allocates its buffers itself, below the dispatcher, where
    no tracker sees them.  The graph's outputs are charged when it returns; the buffers it
    frees inside are not (a compiled step's peak is under-counted by them)."""
    from fakegpu.import_hooks import after_import

    def patch(module) -> None:
        graph = getattr(module, "CompiledFxGraph", None)
        original = getattr(graph, "__call__", None)
        if original is None or getattr(original, "__fakegpu__", False):
            return

        def __call__(self, inputs):
            device = None
            for value in inputs:   # before the call: the compiled code clears the list
                if isinstance(value, torch.Tensor):
                    storages: list = []
                    _storages(value, storages)
                    device = next((d for d in map(memory.device_of_storage, storages) if d is not None), None)
                    if device is not None:
                        break
            outputs = original(self, inputs)
            if device is not None:
                memory.charge_tensor([t for t in torch.utils._pytree.tree_leaves(outputs)
                                      if isinstance(t, torch.Tensor)], device)
            return outputs

        __call__.__fakegpu__ = True
        graph.__call__ = __call__

    after_import("torch._inductor.output_code", patch)
