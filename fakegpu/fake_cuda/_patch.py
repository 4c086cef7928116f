"""Install the fake CUDA runtime into torch: ``torch.cuda``, ``torch.accelerator``,
``torch.load``, autocast, storage resizes, and the two modes."""
from __future__ import annotations

import functools
import os
import re
import sys

import torch

from . import runtime as rt
from .identity import replace
from .memory import TrackingMode, UnsupportedOnFakeCuda, unsupported_message

_CUDA_FUNCTIONS = {
    "is_available": lambda: True,
    "is_initialized": lambda: True,
    "_lazy_init": lambda: None,
    "init": lambda: None,
    "device_count": rt.device_count,
    "current_device": rt.current_device,
    "set_device": rt.set_device,
    "device": rt.device_ctx,
    "device_of": rt.device_of,
    "_exchange_device": rt._exchange_device,
    "_maybe_exchange_device": rt._exchange_device,
    "get_device_properties": rt.get_device_properties,
    "get_device_name": rt.get_device_name,
    "get_device_capability": rt.get_device_capability,
    "get_arch_list": rt.get_arch_list,
    "is_bf16_supported": rt.is_bf16_supported,
    "is_tf32_supported": rt.is_tf32_supported,
    "synchronize": rt.synchronize,
    "Stream": rt.Stream,
    "ExternalStream": rt.ExternalStream,
    "Event": rt.Event,
    "current_stream": rt.current_stream,
    "default_stream": rt.default_stream,
    "set_stream": rt.set_stream,
    "stream": rt.stream,
    "StreamContext": rt.StreamContext,
    "manual_seed": rt.manual_seed,
    "manual_seed_all": rt.manual_seed,
    "seed": rt.seed,
    "seed_all": rt.seed,
    "initial_seed": rt.initial_seed,
    "get_rng_state": rt.get_rng_state,
    "get_rng_state_all": rt.get_rng_state_all,
    "set_rng_state": rt.set_rng_state,
    "set_rng_state_all": rt.set_rng_state_all,
    "memory_stats": rt.memory_stats,
    "memory_stats_as_nested_dict": rt.memory_stats_as_nested_dict,
    "memory_allocated": rt.memory_allocated,
    "max_memory_allocated": rt.max_memory_allocated,
    "memory_reserved": rt.memory_reserved,
    "max_memory_reserved": rt.max_memory_reserved,
    "memory_cached": rt.memory_reserved,
    "max_memory_cached": rt.max_memory_reserved,
    "reset_peak_memory_stats": rt.reset_peak_memory_stats,
    "reset_accumulated_memory_stats": rt.reset_accumulated_memory_stats,
    "reset_max_memory_allocated": rt.reset_max_memory_allocated,
    "reset_max_memory_cached": rt.reset_max_memory_allocated,
    "empty_cache": rt.empty_cache,
    "mem_get_info": rt.mem_get_info,
    "memory_snapshot": rt.memory_snapshot,
    "memory_summary": rt.memory_summary,
    "set_per_process_memory_fraction": rt.set_per_process_memory_fraction,
    "get_per_process_memory_fraction": rt.get_per_process_memory_fraction,
    "ipc_collect": rt.ipc_collect,
}

# torch.cuda.FloatTensor and its kind (old scripts: ``Tensor = torch.cuda.FloatTensor if cuda
# else torch.FloatTensor``): on fake devices they are the CPU types, as in the port.
_LEGACY_TENSOR_TYPES = ("DoubleTensor", "FloatTensor", "HalfTensor", "BFloat16Tensor", "LongTensor",
                        "IntTensor", "ShortTensor", "CharTensor", "ByteTensor", "BoolTensor")

_MEMORY_MODULE_EXTRA = {
    "_snapshot": rt._snapshot,
    "_record_memory_history": rt._record_memory_history,
}


def _accelerator_functions() -> dict:
    cuda = torch.device("cuda")

    class device_index:  # noqa: N801 - torch.accelerator.device_index
        def __init__(self, device, /):
            self._ctx = rt.device_ctx(device)

        def __enter__(self):
            self._ctx.__enter__()

        def __exit__(self, *exc):
            return self._ctx.__exit__(*exc)

    def current_accelerator(check_available: bool = False):  # noqa: ARG001
        return cuda

    def get_device_capability(device=None, /):
        props = rt.get_device_properties(device)
        return {"major": props.major, "minor": props.minor,
                "supported_dtypes": [torch.float32, torch.float16, torch.bfloat16, torch.float64]}

    def get_memory_info(device=None, /):
        return rt.mem_get_info(device)

    return {name: _distinct(function) for name, function in {
        "is_available": lambda: True,
        "device_count": rt.device_count,
        "current_accelerator": current_accelerator,
        "current_device_index": rt.current_device,
        "current_device_idx": rt.current_device,
        "set_device_index": rt.set_device,
        "set_device_idx": rt.set_device,
        "device_index": device_index,
        "synchronize": rt.synchronize,
        "current_stream": rt.current_stream,
        "set_stream": rt.set_stream,
        "get_device_capability": get_device_capability,
        "empty_cache": rt.empty_cache,
        "memory_stats": rt.memory_stats,
        "memory_allocated": rt.memory_allocated,
        "max_memory_allocated": rt.max_memory_allocated,
        "memory_reserved": rt.memory_reserved,
        "max_memory_reserved": rt.max_memory_reserved,
        "reset_peak_memory_stats": rt.reset_peak_memory_stats,
        "reset_accumulated_memory_stats": rt.reset_accumulated_memory_stats,
        "get_memory_info": get_memory_info,
    }.items()}


def _one_object_per_name(functions: dict) -> dict:
    """Names that share one implementation (``manual_seed`` / ``manual_seed_all``, ...) get
    function objects of their own, as in torch (see :func:`_distinct`)."""
    seen: set = set()
    out = {}
    for name, function in functions.items():
        out[name] = _distinct(function) if id(function) in seen else function
        seen.add(id(function))
    return out


def _distinct(function):
    """A function object of its own for ``torch.accelerator``: torch.compile keys handlers
    by function object and refuses a second one for the same object (``torch.cuda``'s)."""
    if isinstance(function, type):
        return function

    @functools.wraps(function)
    def accelerator_function(*args, **kwargs):
        return function(*args, **kwargs)

    return accelerator_function


def _set_all(module, names: dict) -> None:
    for name, value in names.items():
        setattr(module, name, value)


def _patch_legacy_tensor_types() -> None:
    for name in _LEGACY_TENSOR_TYPES:
        setattr(torch.cuda, name, getattr(torch, name))
    original_type = torch.Tensor.type

    def type(self, dtype=None, non_blocking=False, **kwargs):
        if isinstance(dtype, str) and dtype.startswith("torch.cuda."):
            dtype = "torch." + dtype[len("torch.cuda."):]
        if dtype is None:
            return original_type(self)
        return original_type(self, dtype, non_blocking, **kwargs)

    replace(torch.Tensor, "type", type)


def _patch_nvtx() -> None:
    import torch.cuda.nvtx as nvtx

    depth = [0]

    def range_push(msg):  # noqa: ARG001
        depth[0] += 1
        return depth[0] - 1

    def range_pop():
        depth[0] = max(0, depth[0] - 1)
        return depth[0]

    _set_all(nvtx, {"range_push": range_push, "range_pop": range_pop,
                    "range_start": lambda msg: 0, "range_end": lambda range_id: None,
                    "mark": lambda msg: None})


def _patch_load() -> None:
    original = torch.load

    def to_cpu(location):
        if location is None:
            return "cpu", rt.current_device()
        if isinstance(location, (str, torch.device)):
            index = rt.cuda_index_of(location)
            return ("cpu", index) if index is not None else (location, None)
        if isinstance(location, dict):
            return {k: ("cpu" if rt.cuda_index_of(v) is not None else v) for k, v in location.items()}, None
        return location, None

    def load(f, map_location=None, *args, **kwargs):
        explicit = map_location is not None
        map_location, index = to_cpu(map_location)
        result = original(f, map_location, *args, **kwargs)
        if explicit and index is not None:
            _charge_tree(result, index)
        return result

    replace(torch, "load", load)   # also torch.serialization.load, the same object


def _charge_tree(obj, index: int, depth: int = 0) -> None:
    if depth > 20:
        return
    if isinstance(obj, torch.Tensor):
        rt.state().memory.charge_tensor(obj, index)
    elif isinstance(obj, dict):
        for value in obj.values():
            _charge_tree(value, index, depth + 1)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            _charge_tree(value, index, depth + 1)


def _patch_autocast() -> None:
    from torch.amp import autocast_mode

    cls = autocast_mode.autocast
    original = cls.__init__

    @functools.wraps(original)
    def __init__(self, device_type, dtype=None, enabled=True, cache_enabled=None):
        if device_type == "cuda":
            # Autocast on the CPU kernels, with the GPU's default dtype.
            device_type, dtype = "cpu", (torch.float16 if dtype is None else dtype)
        original(self, device_type, dtype=dtype, enabled=enabled, cache_enabled=cache_enabled)

    cls.__init__ = __init__


def _patch_storage_resize() -> None:
    from . import graphs

    original = torch.UntypedStorage.resize_

    def resize_(self, size):
        outcome = []
        rt.state().memory.resize(self, int(size), lambda storage, n: outcome.append(original(storage, n)))
        graphs.record_storage_resize(self, int(size))
        return outcome[0]

    replace(torch.UntypedStorage, "resize_", resize_, public_path="torch.UntypedStorage.resize_")


def _excepthook_for_unsupported() -> None:
    from . import extensions

    previous = sys.excepthook

    def hook(kind, value, tb):
        if isinstance(value, UnsupportedOnFakeCuda):
            print(str(value), file=sys.stderr)
            return
        line = extensions.describe_import_error(value)   # a prebuilt CUDA extension
        if line is not None:
            print(line, file=sys.stderr)
            return
        # Without the tracking mode (FAKEGPU_FAKE_CUDA_MEMORY=0) torch's own error arrives.
        match = _NO_CPU_KERNEL.search(str(value)) if isinstance(value, NotImplementedError) else None
        if match:
            print(unsupported_message(match.group(1)), file=sys.stderr)
            return
        previous(kind, value, tb)

    sys.excepthook = hook


_NO_CPU_KERNEL = re.compile(r"Could not run '([^']+)' with arguments from the 'CPU' backend")


def _patch_generator() -> None:
    """``torch.Generator(device="cuda")``: the CPU algorithm, as the port would draw."""
    base = torch.Generator

    class _GeneratorType(type(base)):
        # torch's own generators (torch.default_generator, a DataLoader's) are instances of
        # the C class: isinstance(g, torch.Generator) stays true for them.
        def __instancecheck__(cls, instance):
            return isinstance(instance, base)

        def __subclasscheck__(cls, subclass):
            return issubclass(subclass, base)

    class Generator(base, metaclass=_GeneratorType):
        def __new__(cls, device="cpu"):
            if rt.cuda_index_of(device) is not None or (type(device) is int):
                device = "cpu"
            return super().__new__(cls, device)

        def __init__(self, device="cpu"):
            pass

    Generator.__doc__ = base.__doc__
    replace(torch, "Generator", Generator, wrap=False)


def _patch_tensor_constructors() -> None:
    """``torch.tensor`` / ``torch.as_tensor`` with a cuda device: rewritten here as well as in
    the mode, because autograd runs backward functions without the torch-function mode."""
    for name in ("tensor", "as_tensor"):
        original = getattr(torch, name)

        def wrapper(*args, _original=original, **kwargs):
            device = kwargs.get("device")
            index = rt.cuda_index_of(device) if isinstance(device, (str, torch.device)) else None
            if index is None:
                return _original(*args, **kwargs)
            kwargs["device"] = rt.CPU
            out = _original(*args, **kwargs)
            if not rt.is_traced(out):
                rt.state().memory.charge_tensor(out, index)
            return out

        replace(torch, name, wrapper)



def _modes_in_new_threads() -> None:
    """torch keeps mode stacks per thread: threads the program starts get ours too."""
    import threading

    original = threading.Thread._bootstrap_inner

    def _bootstrap_inner(self):
        entered = []
        try:
            for mode in _modes:
                mode.__enter__()
                entered.append(mode)
            original(self)
        finally:
            # Leave the modes while this thread still holds the GIL.  Left in the thread's
            # C++ mode stacks, they would be released by its thread-local destructors after
            # the thread let go of Python; when that happens while the interpreter finalizes
            # (a thread ending as the program exits), taking the GIL there ends the thread
            # inside a noexcept destructor and the process aborts ("terminate called without
            # an active exception") after the program itself had finished.
            for mode in reversed(entered):
                try:
                    mode.__exit__(None, None, None)
                except Exception:  # noqa: BLE001 - the thread's own stack was left unbalanced
                    _clear_mode_stacks()
                    break

    threading.Thread._bootstrap_inner = _bootstrap_inner


def _clear_mode_stacks() -> None:
    """Empty this thread's torch-dispatch and torch-function mode stacks (a thread that left
    modes of its own above ours, so ours cannot be exited in order)."""
    import torch
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack, _pop_mode

    while _get_current_dispatch_mode_stack():
        _pop_mode()
    while torch._C._len_torch_function_stack():
        torch._C._pop_torch_function_stack()


_modes: list = []
MEMORY_ENV = "FAKEGPU_FAKE_CUDA_MEMORY"


def _tracking(memory, setting: str):
    """The C++ storage tracker when it builds (FAKEGPU_FAKE_CUDA_MEMORY=python asks for the
    Python dispatch mode), else :class:`TrackingMode`: the same accounting, the mode at
    about 20 us more per aten op."""
    if setting != "python":
        from . import native_tracker
        from .memory import NativeTracking, charge_compiled_graph_outputs, higher_order_operators_pass_over

        loaded = native_tracker.load()
        if loaded is not None:
            ffi, lib = loaded
            memory.use_native(ffi, lib)
            higher_order_operators_pass_over(torch._C.DispatchKey(lib.fakegpu_tracker_dispatch_key()))
            rt.on_current_device_change(lib.fakegpu_tracker_set_current)
            charge_compiled_graph_outputs(memory)
            return NativeTracking(lib)
        if os.environ.get("FAKEGPU_DEBUG"):
            print(f"fakegpu: the C++ storage tracker is not available ({native_tracker.failure()}); "
                  "fake CUDA memory accounting uses the Python dispatch mode", file=sys.stderr)
    return TrackingMode(memory)


def install() -> None:
    # torch.compile's inductor asks triton for a GPU when torch.cuda.is_available() (True
    # here); a triton installed beside the CPU torch then looks for libcuda and fails.
    # The fake devices' kernels are the CPU's: inductor must generate CPU code.
    os.environ.setdefault("TORCHINDUCTOR_TRITON_DISABLE_DEVICE_DETECTION", "1")
    import torch.cuda
    import torch.cuda.memory
    import torch.cuda.random
    import torch.cuda.streams

    cuda_functions = _one_object_per_name(_CUDA_FUNCTIONS)
    _set_all(torch.cuda, cuda_functions)
    _set_all(torch.cuda.memory, {k: v for k, v in cuda_functions.items() if hasattr(torch.cuda.memory, k)})
    _set_all(torch.cuda.memory, _MEMORY_MODULE_EXTRA)
    _set_all(torch.cuda.random, {k: v for k, v in cuda_functions.items() if hasattr(torch.cuda.random, k)})
    _set_all(torch.cuda.streams, {"Stream": rt.Stream, "ExternalStream": rt.ExternalStream, "Event": rt.Event})
    torch.cuda.default_generators = tuple(torch.default_generator for _ in range(rt.device_count()))
    _patch_nvtx()
    _patch_legacy_tensor_types()
    import torch.cuda.nccl

    torch.cuda.nccl.version = rt.nccl_version

    import torch.accelerator
    import torch.accelerator.memory

    functions = _accelerator_functions()
    _set_all(torch.accelerator, functions)
    _set_all(torch.accelerator.memory, {k: v for k, v in functions.items() if hasattr(torch.accelerator.memory, k)})
    cuda = torch.device("cuda")
    torch._C._get_accelerator = lambda: cuda
    torch._C._accelerator_getAccelerator = lambda: cuda

    _patch_load()
    _patch_generator()
    rt.patch_tensor_methods()
    rt.patch_sdpa()
    _patch_tensor_constructors()
    from . import data_parallel, kernels, sync_batchnorm

    kernels.register()
    kernels.patch_flex_attention()
    sync_batchnorm.register()
    data_parallel.install()
    _patch_autocast()
    _patch_storage_resize()
    from . import graphs

    graphs.install()   # after the storage resize patch: captures record resizes
    from . import extensions

    extensions.install()
    _excepthook_for_unsupported()

    from . import distributed

    distributed.install()

    # Last: from here on every torch call sees the modes.  The tracking mode (per-device
    # memory accounting) costs a Python call on every aten op; FAKEGPU_FAKE_CUDA_MEMORY=0
    # leaves it out for speed, and the memory API then reports nothing allocated.
    tracking_memory = os.environ.get(MEMORY_ENV, "1").strip().lower() not in ("0", "false", "no", "off")
    from . import optim_defaults

    optim_defaults.install(rt.state().memory if tracking_memory else None)
    if tracking_memory:
        tracking = _tracking(rt.state().memory, os.environ.get(MEMORY_ENV, "1").strip().lower())
        tracking.__enter__()
        _modes.append(tracking)
    rewrite = rt.DeviceRewriteMode()
    rewrite.__enter__()
    _modes.append(rewrite)
    _modes_in_new_threads()
