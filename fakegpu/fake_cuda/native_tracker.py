"""The C++ storage tracker (native/storage_tracker.cc): built against the installed torch at
first use, cached, and loaded by path.

The tracker needs torch's C++ headers and the same compiler ABI as the installed torch, so
it cannot be part of fakegpu's own build (which does not depend on torch).  It is compiled
once per torch version and source revision into ``FAKEGPU_CACHE_DIR`` (default
``$XDG_CACHE_HOME/fakegpu``, else ``~/.cache/fakegpu``) under a file lock, so the ranks of a
job that start together compile it once.  :func:`load` returns None, with the reason, when
there is no compiler or the build fails; fake CUDA devices then use the Python dispatch mode
(fakegpu/fake_cuda/memory.py), which gives the same figures more slowly.
"""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import sysconfig
import threading
from pathlib import Path
from typing import Optional

SOURCE = Path(__file__).resolve().parent / "native" / "storage_tracker.cc"
CACHE_ENV = "FAKEGPU_CACHE_DIR"
BUILD_TIMEOUT_S = 300

_CDEF = """
int fakegpu_tracker_dispatch_key(void);
void fakegpu_tracker_configure(uintptr_t model_malloc, uintptr_t model_free, uintptr_t oom_message,
                               uintptr_t subclass_storages);
int fakegpu_tracker_add_device(void* model);
void fakegpu_tracker_enable_thread(int enabled);
int fakegpu_tracker_thread_enabled(void);
int fakegpu_tracker_set_target(int device);
int fakegpu_tracker_target(void);
void fakegpu_tracker_set_current(int device);
int fakegpu_tracker_charge(void* storage, int device);
int fakegpu_tracker_device_of(void* storage);
uint64_t fakegpu_tracker_count(void);
void fakegpu_tracker_stop(void);
"""

_lock = threading.Lock()
_loaded: Optional[tuple] = None
_failure: Optional[str] = None


def cache_dir() -> Path:
    configured = os.environ.get(CACHE_ENV, "").strip()
    if configured:
        return Path(configured)
    base = os.environ.get("XDG_CACHE_HOME", "").strip() or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "fakegpu"


def _build_key(torch) -> str:
    digest = hashlib.sha256(SOURCE.read_bytes())
    digest.update(f"{torch.__version__}|{torch._C._GLIBCXX_USE_CXX11_ABI}|{sys.version_info[:2]}".encode())
    return digest.hexdigest()[:16]


def _compile_command(torch, output: Path) -> list[str]:
    root = Path(torch.__file__).resolve().parent
    compiler = os.environ.get("CXX") or sysconfig.get_config_var("CXX") or "c++"
    return [*compiler.split(), "-O2", "-std=c++20", "-shared", "-fPIC", "-w",
            f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
            "-I", str(root / "include"), "-I", str(root / "include" / "torch" / "csrc" / "api" / "include"),
            str(SOURCE), "-o", str(output),
            "-L", str(root / "lib"), "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{root / 'lib'}"]


def _build(torch) -> Path:
    """The compiled library's path, compiling it under a lock when it is not cached yet."""
    import fcntl

    directory = cache_dir() / "torch-ext"
    directory.mkdir(parents=True, exist_ok=True)
    library = directory / f"storage_tracker-{_build_key(torch)}.so"
    if library.is_file():
        return library
    with open(directory / ".lock", "w") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)
        if library.is_file():   # another rank built it while this one waited
            return library
        partial = library.with_suffix(f".{os.getpid()}.tmp")
        try:
            done = subprocess.run(_compile_command(torch, partial), capture_output=True, text=True,
                                  timeout=BUILD_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise RuntimeError(f"cannot run the C++ compiler: {exc}") from None
        if done.returncode != 0:
            partial.unlink(missing_ok=True)
            lines = (done.stderr or done.stdout).strip().splitlines()
            raise RuntimeError("the C++ compiler failed: " + " | ".join(lines[:3])[:400])
        os.replace(partial, library)   # atomic: no rank loads a half-written file
    return library


def load():
    """``(ffi, lib)`` of the tracker, or None (see :func:`failure` for why)."""
    global _loaded, _failure
    if _loaded is not None or _failure is not None:
        return _loaded
    with _lock:
        if _loaded is not None or _failure is not None:
            return _loaded
        try:
            import torch
            from cffi import FFI

            library = _build(torch)
            ffi = FFI()
            ffi.cdef(_CDEF)
            _loaded = (ffi, ffi.dlopen(str(library)))
        except Exception as exc:  # noqa: BLE001 - any failure means: the Python mode instead
            _failure = str(exc) or type(exc).__name__
    return _loaded


def failure() -> Optional[str]:
    return _failure
