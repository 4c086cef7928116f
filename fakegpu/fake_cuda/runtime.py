"""The fake CUDA runtime: what ``torch.cuda`` / ``torch.accelerator`` answer, and the mode
that sends every ``cuda`` device argument to the CPU.

Design (docs/fake-cuda.md has the reasons): tensors on a fake device *are* CPU tensors.  A
torch-function mode rewrites ``device="cuda[:k]"`` / ``.cuda()`` / ``.to("cuda")`` to the
CPU, exactly as a hand port of the program would, and tells the tracking mode which fake
device the new storages belong to.  ``torch.cuda`` and ``torch.accelerator`` are patched
to describe N devices from the cluster profile, with streams and events that complete in
order, the CPU generator as every device's generator, and a caching-allocator model per
device for the memory API.
"""
from __future__ import annotations

import collections
import contextlib
import functools
import itertools
import time
from typing import Any, Optional

import torch
from torch.overrides import TorchFunctionMode

from . import devices as _devices
from .memory import DeviceMemory, placing_on

CPU = torch.device("cpu")


class _State:
    def __init__(self, count: int, profiles: list[str]):
        self.count = count
        self.properties = [_devices.properties_for(p, i) for i, p in enumerate(profiles)]
        self._current = 0
        self.current_listeners: list = []   # told each new current device (the C++ tracker)
        self.memory = DeviceMemory([p.total_memory for p in self.properties])
        self.streams: dict[int, "Stream"] = {}

    @property
    def current(self) -> int:
        return self._current

    @current.setter
    def current(self, index: int) -> None:
        self._current = index
        for listener in self.current_listeners:
            listener(index)


def on_current_device_change(listener) -> None:
    """``listener(index)`` on every change of the current device, and now."""
    state().current_listeners.append(listener)
    listener(state().current)


_state: Optional[_State] = None


def state() -> _State:
    if _state is None:
        raise RuntimeError("fakegpu fake CUDA devices are not active")
    return _state


# ---------------------------------------------------------------------------------------------
# Device indices


def _index(device: Any = None) -> int:
    """Index of a cuda device given as None / int / str / torch.device / torch.cuda.device."""
    st = state()
    if device is None:
        return st.current
    if isinstance(device, device_ctx):
        return st.current if device.idx is None else device.idx
    if isinstance(device, str):
        device = torch.device(device)
    if isinstance(device, torch.device):
        if device.type == "cpu":
            return -1
        if device.type != "cuda":
            raise ValueError(f"Expected a cuda device, but got: {device}")
        index = st.current if device.index is None else device.index
    else:
        index = int(device)
    if index < -1 or index >= st.count:
        error = getattr(torch, "AcceleratorError", RuntimeError)
        raise error(f"CUDA error: invalid device ordinal (device {index}; fakegpu exposes {st.count} "
                    f"fake device{'s' if st.count != 1 else ''}: see --device-count / FAKEGPU_DEVICE_COUNT)")
    return index if index >= 0 else st.current


def cuda_index_of(device: Any) -> Optional[int]:
    """The fake device index ``device`` names, or None when it is not a cuda device."""
    if isinstance(device, torch.device):
        if device.type != "cuda":
            return None
        return state().current if device.index is None else _index(device)
    if isinstance(device, str):
        if not device.startswith("cuda"):
            return None
        return _index(torch.device(device))
    return None


def set_device(device) -> None:
    index = _index(device)
    if index >= 0:
        state().current = index


def current_device() -> int:
    return state().current


def device_count() -> int:
    return state().count


class device_ctx:  # noqa: N801 - stands in for torch.cuda.device
    """``with torch.cuda.device(k):``"""

    def __init__(self, device):
        self.idx = None if device is None else _index(device)
        self.prev_idx = -1

    def __enter__(self):
        self.prev_idx = state().current
        if self.idx is not None and self.idx >= 0:
            state().current = self.idx
        return self

    def __exit__(self, *exc):
        state().current = self.prev_idx
        return False


class device_of(device_ctx):  # noqa: N801
    def __init__(self, obj):
        super().__init__(None)


def _exchange_device(device: int) -> int:
    previous = state().current
    if device >= 0:
        state().current = device
    return previous


def get_device_properties(device=None):
    return state().properties[_index(device)]


def get_device_name(device=None) -> str:
    return get_device_properties(device).name


def get_device_capability(device=None) -> tuple[int, int]:
    props = get_device_properties(device)
    return props.major, props.minor


def get_arch_list() -> list[str]:
    return sorted({f"sm_{p.major}{p.minor}" for p in state().properties})


def is_bf16_supported(including_emulation: bool = True) -> bool:  # noqa: ARG001
    return get_device_capability()[0] >= 8


def is_tf32_supported() -> bool:
    return get_device_capability()[0] >= 8


def synchronize(device=None) -> None:
    _index(device)  # validates


# ---------------------------------------------------------------------------------------------
# Streams and events: work runs in program order on the host, so every stream is always idle.

_stream_ids = itertools.count(1)


class Stream(torch.Stream):
    """``torch.cuda.Stream`` on a fake device; every operation on it is already complete.

    A ``torch.Stream`` underneath, so C++-bound APIs (``Tensor.record_stream``) accept it."""

    def __new__(cls, device=None, priority: int = 0, **kwargs):
        index = _index(device)
        stream_id = kwargs.get("stream_id")
        self = torch.Stream.__new__(cls, stream_id=next(_stream_ids) if stream_id is None else stream_id,
                                    device_index=index, device_type=1)  # 1: c10::DeviceType::CUDA
        self._priority = priority
        return self

    def __init__(self, device=None, priority: int = 0, **kwargs):
        pass

    @property
    def priority(self) -> int:
        return self._priority

    @property
    def cuda_stream(self) -> int:
        return self.stream_id

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def is_capturing(self) -> bool:
        return False  # no CUDA graphs on fake devices

    def wait_event(self, event) -> None:  # noqa: ARG002
        pass

    def wait_stream(self, stream) -> None:  # noqa: ARG002
        pass

    def record_event(self, event=None):
        event = event or Event()
        event.record(self)
        return event

    def __enter__(self):
        self._ctx = stream(self)
        return self._ctx.__enter__()

    def __exit__(self, *exc):
        return self._ctx.__exit__(*exc)

    def __repr__(self) -> str:
        return f"<torch.cuda.Stream device=cuda:{self.device_index} cuda_stream={self.stream_id:#x} (fakegpu)>"


class ExternalStream(Stream):
    def __new__(cls, stream_ptr, device=None, **kwargs):  # noqa: ARG003
        return super().__new__(cls, device, stream_id=int(stream_ptr))


class Event:
    """``torch.cuda.Event``: records the host time, so ``elapsed_time`` measures real work."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False,
                 external: bool = False):  # noqa: ARG002
        self.enable_timing = enable_timing
        self._time: Optional[float] = None

    def record(self, stream=None) -> None:  # noqa: ARG002
        self._time = time.perf_counter()

    def wait(self, stream=None) -> None:  # noqa: ARG002
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end_event: "Event") -> float:
        if not (self.enable_timing and end_event.enable_timing):
            raise ValueError("Both events must be created with argument 'enable_timing=True'")
        if self._time is None or end_event._time is None:
            raise ValueError("Both events must be recorded before calculating elapsed time")
        return (end_event._time - self._time) * 1000.0

    @property
    def cuda_event(self) -> int:
        return id(self)

    def ipc_handle(self):
        raise RuntimeError("fakegpu: CUDA IPC event handles do not exist on fake devices")

    def __repr__(self) -> str:
        return f"<torch.cuda.Event {'recorded' if self._time is not None else 'uninitialized'} (fakegpu)>"


def _default_stream(device=None) -> Stream:
    index = _index(device)
    st = state()
    if index not in st.streams:
        st.streams[index] = Stream(index, stream_id=0)
    return st.streams[index]


_current_streams: dict[int, Stream] = {}


def current_stream(device=None) -> Stream:
    index = _index(device)
    return _current_streams.get(index) or _default_stream(index)


def default_stream(device=None) -> Stream:
    return _default_stream(device)


def set_stream(stream_: Stream) -> None:
    if stream_ is not None:
        _current_streams[stream_.device_index] = stream_


@contextlib.contextmanager
def stream(stream_):
    if stream_ is None:
        yield None
        return
    previous = _current_streams.get(stream_.device_index)
    previous_device = state().current
    _current_streams[stream_.device_index] = stream_
    state().current = stream_.device_index
    try:
        yield stream_
    finally:
        state().current = previous_device
        if previous is None:
            _current_streams.pop(stream_.device_index, None)
        else:
            _current_streams[stream_.device_index] = previous


class StreamContext:
    def __init__(self, stream_):
        self._cm = stream(stream_)
        self.stream = stream_

    def __enter__(self):
        return self._cm.__enter__()

    def __exit__(self, *exc):
        return self._cm.__exit__(*exc)


# ---------------------------------------------------------------------------------------------
# Random numbers: every fake device draws from the CPU generator, like the CPU port.


def manual_seed(seed) -> None:
    # The generator itself: torch.manual_seed calls torch.cuda.manual_seed_all in turn.
    torch.default_generator.manual_seed(int(seed))


def seed() -> None:
    torch.default_generator.seed()


def initial_seed() -> int:
    return torch.default_generator.initial_seed()


def get_rng_state(device="cuda") -> torch.Tensor:  # noqa: ARG001
    return torch.get_rng_state()


def get_rng_state_all() -> list[torch.Tensor]:
    return [torch.get_rng_state() for _ in range(state().count)]


def set_rng_state(new_state, device="cuda") -> None:  # noqa: ARG001
    torch.set_rng_state(new_state)


def set_rng_state_all(new_states) -> None:
    for s in new_states[:1]:
        torch.set_rng_state(s)


# ---------------------------------------------------------------------------------------------
# Memory API, per fake device.


def _model(device=None):
    return state().memory.models[_index(device)]


def memory_stats(device=None) -> dict:
    return collections.OrderedDict(_model(device).memory_stats())


def memory_stats_as_nested_dict(device=None) -> dict:
    nested: dict = {}
    for key, value in memory_stats(device).items():
        node = nested
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = value
    return nested


def memory_allocated(device=None) -> int:
    return _model(device).allocated


def max_memory_allocated(device=None) -> int:
    return _model(device).stat("allocated_bytes", field="peak")


def memory_reserved(device=None) -> int:
    return _model(device).reserved


def max_memory_reserved(device=None) -> int:
    return _model(device).stat("reserved_bytes", field="peak")


def reset_peak_memory_stats(device=None) -> None:
    _model(device).reset_peak()


def reset_accumulated_memory_stats(device=None) -> None:
    _model(device).reset_accumulated()


def reset_max_memory_allocated(device=None) -> None:
    _model(device).reset_peak()


def empty_cache() -> None:
    for model in state().memory.models:
        model.release_cached()


def set_per_process_memory_fraction(fraction: float, device=None) -> None:
    _model(device).set_fraction(fraction)


def get_per_process_memory_fraction(device=None) -> float:
    fraction = _model(device).fraction
    return 1.0 if fraction is None else fraction


def ipc_collect() -> None:
    """No CUDA IPC handles exist on fake devices: nothing to release."""


def nccl_version() -> tuple:
    """``torch.cuda.nccl.version()``: the NCCL version the fakegpu shim implements."""
    from fakegpu.torch.process_group import library

    code = library().version()
    return code // 10000, code // 100 % 100, code % 100


def mem_get_info(device=None) -> tuple[int, int]:
    model = _model(device)
    return model.total_memory - model.reserved, model.total_memory


def memory_snapshot(mempool_id=None) -> list[dict]:  # noqa: ARG001
    return [seg for model in state().memory.models for seg in model.snapshot()]


def memory_summary(device=None, abbreviated: bool = False) -> str:  # noqa: ARG001
    stats = memory_stats(device)
    lines = [f"fakegpu fake CUDA device {_index(device)} ({get_device_name(device)}): caching allocator model"]
    for name in ("allocated_bytes", "reserved_bytes", "active_bytes", "requested_bytes"):
        lines.append(f"  {name:16s} current {stats[f'{name}.all.current']:>14,}  "
                     f"peak {stats[f'{name}.all.peak']:>14,}")
    return "\n".join(lines)


def _snapshot(device=None, **_kwargs) -> dict:
    return {"segments": memory_snapshot(), "device_traces": [[] for _ in range(state().count)]}


def _record_memory_history(*args, **kwargs) -> None:  # noqa: ARG001 - no frames to record
    pass


# ---------------------------------------------------------------------------------------------
# The device rewrite mode


def _cuda_target(value) -> Optional[int]:
    if isinstance(value, (torch.device, str)):
        return cuda_index_of(value)
    if type(value) is int:  # device=k: torch reads a bare index as the accelerator's
        return _index(value)
    return None


_PARSE_TO = torch._C._nn._parse_to


class DeviceRewriteMode(TorchFunctionMode):
    """Rewrites ``device="cuda[:k]"`` arguments to the CPU at the Python API, as a port to the
    CPU would, and charges what the call creates to fake device k.

    Tensor methods that move tensors (``to``, ``cuda``, ``pin_memory``, ``record_stream``)
    are patched on ``torch.Tensor`` instead (:func:`patch_tensor_methods`): autograd runs
    backward functions without the torch-function mode stack, and they must work there too.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.device and len(args) == 1 and type(args[0]) is int and not kwargs:
            return torch.device("cuda", _index(args[0]))   # torch.device(k): the accelerator's
        if func is _PARSE_TO and args and type(args[0]) is int:
            # Module.to(k): C++ would resolve the bare index against a missing accelerator.
            args = (torch.device("cuda", _index(args[0])), *args[1:])
        target = None
        if "device" in kwargs:
            target = _cuda_target(kwargs["device"])
            if target is not None:
                kwargs = dict(kwargs)
                kwargs["device"] = CPU
        if kwargs.get("pin_memory"):
            kwargs = dict(kwargs)
            kwargs["pin_memory"] = False
        if target is None or torch.compiler.is_compiling():
            # Traced by torch.compile: what the compiled graph creates is charged when it runs
            # (memory.charge_compiled_graph_outputs), not while dynamo traces this mode.
            return func(*args, **kwargs)
        with placing_on(target):
            return func(*args, **kwargs)


def is_traced(tensor) -> bool:
    """A fake or functional tensor of a tracer (torch.compile's): it owns no memory; the
    compiled graph's outputs are charged when it runs (memory.charge_compiled_graph_outputs)."""
    if torch.compiler.is_compiling():   # dynamo folds this to True and traces no further
        return True
    from torch._subclasses.fake_tensor import is_fake

    return is_fake(tensor) or torch._is_functional_tensor(tensor)


def patch_tensor_methods() -> None:
    """``Tensor.to("cuda")`` / ``.cuda()`` / ``.pin_memory()`` return the tensor itself (the
    CPU port's no-op) and charge it to the fake device; ``record_stream`` does nothing."""
    original_to = torch.Tensor.to

    def to(self, *args, **kwargs):
        target = None
        if args and (isinstance(args[0], (torch.device, str)) or type(args[0]) is int):
            target = _index(args[0]) if type(args[0]) is int else _cuda_target(args[0])
            if target is not None:
                args = (CPU, *args[1:])
        elif "device" in kwargs:
            target = _cuda_target(kwargs["device"])
            if target is not None:
                kwargs = dict(kwargs, device=CPU)
        if target is None or is_traced(self):
            return original_to(self, *args, **kwargs)
        with placing_on(target):
            out = original_to(self, *args, **kwargs)
        state().memory.charge_tensor(out, target)
        return out

    def cuda(self, device=None, non_blocking=False, memory_format=torch.preserve_format):  # noqa: ARG001
        index = _index(device)
        if not is_traced(self):
            state().memory.charge_tensor(self, index)
        return self

    def pin_memory(self, device=None):  # noqa: ARG001
        return self

    def is_pinned(self, device=None):  # noqa: ARG001
        return False

    def record_stream(self, stream):  # noqa: ARG001
        return None

    from .identity import replace

    for method in (to, cuda, pin_memory, is_pinned, record_stream):
        replace(torch.Tensor, method.__name__, method)


def patch_sdpa() -> None:
    from .identity import replace

    original = torch.nn.functional.scaled_dot_product_attention

    from .context_parallel import ring_sdpa

    def scaled_dot_product_attention(*args, **kwargs):
        routed = ring_sdpa(args, kwargs)   # context parallelism's DTensors: the GPU's fused kernel
        if routed is not None:
            return routed
        return _sdpa_with_fallback(original, args, kwargs)

    # Also torch._C._nn.scaled_dot_product_attention: the name torch's C code looks the
    # function up by when it hands it to a __torch_function__ override.
    replace(torch.nn.functional, "scaled_dot_product_attention", scaled_dot_product_attention)


def _sdpa_with_fallback(func, args, kwargs):
    """SDPA whose enabled backends have no CPU kernel (efficient / cuDNN only): run it on the
    math kernel, the exact reference every fused backend approximates."""
    try:
        return func(*args, **kwargs)
    except RuntimeError as exc:
        text = str(exc)
        if "No available kernel" not in text and "No viable backend" not in text:
            raise
    was = torch.backends.cuda.math_sdp_enabled()
    torch.backends.cuda.enable_math_sdp(True)
    try:
        return func(*args, **kwargs)
    finally:
        torch.backends.cuda.enable_math_sdp(was)
