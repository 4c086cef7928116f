"""The shim's plain C helpers (reductions, the allocator model, the fake-world launch
contract), called from Python through cffi's ABI mode.

Each user declares its functions once and gets a loader that opens fakegpu's
``libnccl.so.2`` on first use (``fakegpu.nccl_library_path()``: FAKEGPU_NCCL_LIBRARY or the
installed build) and checks that the library really is this fakegpu's shim. ABI mode releases
the GIL during each call.
"""
from __future__ import annotations

import threading
from typing import Callable


class ShimHelpers:
    """``loader()`` -> ``(ffi, lib)`` for the functions in ``cdef``; ``probe`` is one of them
    whose absence means the library is not (this version of) fakegpu's shim."""

    def __init__(self, cdef: str, probe: str, purpose: str, error: Callable[[str], Exception] = RuntimeError):
        self._cdef = cdef
        self._probe = probe
        self._purpose = purpose
        self._error = error
        self._lock = threading.Lock()
        self._loaded = None

    def __call__(self):
        if self._loaded is None:
            with self._lock:
                if self._loaded is None:
                    self._loaded = self._load()
        return self._loaded

    def _load(self):
        from cffi import FFI

        import fakegpu

        try:
            path = fakegpu.nccl_library_path()
        except FileNotFoundError as exc:
            raise self._error(f"{self._purpose} live in fakegpu's native library: {exc}") from None
        ffi = FFI()
        ffi.cdef(self._cdef)
        lib = ffi.dlopen(path)
        try:
            getattr(lib, self._probe)
        except AttributeError:
            raise self._error(f"{path} has no {self._probe}: it is not this fakegpu's shim (unset "
                              "FAKEGPU_NCCL_LIBRARY or point it at fakegpu's rebuilt build/libnccl.so.2)") from None
        return ffi, lib
