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

import threading
import weakref
from contextlib import contextmanager
from typing import Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .allocator import CachingAllocatorModel, OutOfMemory

_tls = threading.local()


class DeviceMemory:
    """The allocator models of this process's fake devices and the storage -> block map."""

    def __init__(self, totals: list[int]):
        self.models = [CachingAllocatorModel(i, total) for i, total in enumerate(totals)]
        # id(storage) -> (device, block, weakref that releases the block when the storage dies)
        self._blocks: dict[int, tuple] = {}
        self._lock = threading.Lock()

    def device_of_storage(self, storage) -> Optional[int]:
        entry = self._blocks.get(id(storage))
        return None if entry is None else entry[0]

    def charge(self, storage, device: int) -> None:
        """Account ``storage`` (not yet seen) on ``device``."""
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

    def resized(self, storage, new_nbytes: int) -> None:
        """``UntypedStorage.resize_`` on a tracked storage (FSDP frees and re-grows this way)."""
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


@contextmanager
def placing_on(device: int):
    """New storages created inside belong to fake device ``device``."""
    previous = getattr(_tls, "target", None)
    _tls.target = device
    try:
        yield
    finally:
        _tls.target = previous


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
