"""The shim's reductions, called from Python: the one implementation of fakegpu's numerics.

The coordinator (fakegpu/coordinator/collectives), the host-local arenas (native/src/local) and
both fake modes (native/src/modes/mode_fake.cc and fakegpu/fake/semantics.py) reduce with the same C++
code: ``reduce_n`` folds n buffers in rank order (native/src/numerics/reduce_n.cc) and
``reduce_symmetric`` reduces n copies of one buffer (native/src/numerics/fake_numerics.cc). numpy stays
the tests' oracle (tests/helpers/numpy_reduce.py), not a second implementation.

cffi's ABI mode releases the GIL during each call, so the coordinator's worker threads reduce
in parallel.
"""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from fakegpu.shim_helpers import ShimHelpers

_CDEF = """
int fakegpu_reduce_n(int datatype, int redop, const void* const* inputs, int n, void* out, uint64_t count,
                     const uint8_t* scalars);
int fakegpu_reduce_n_planned(int datatype, int redop, int plan, const void* const* inputs, int n, void* out,
                             uint64_t count, const uint8_t* scalars, uint64_t first, uint64_t plan_count);
uint64_t fakegpu_gloo_chunk_elements(int plan, int n, uint64_t count, uint64_t elem_size);
int fakegpu_reduce_symmetric(int datatype, int redop, const void* in, void* out, uint64_t count, int n,
                             const uint8_t* scalar, uint64_t exact_limit);
"""


class NativeNumericsError(RuntimeError):
    """The shim's reductions cannot be used: the library is missing or refused the arguments."""


_library = ShimHelpers(_CDEF, "fakegpu_reduce_n_planned", "fakegpu's reductions", NativeNumericsError)


def _buffer(ffi, a: np.ndarray, writable: bool = False):
    if not a.flags.c_contiguous:
        raise NativeNumericsError("fakegpu's reductions take contiguous arrays")
    return ffi.from_buffer(a, require_writable=writable)


def _pointers(ffi, arrays: Sequence[np.ndarray]):
    """(C array of the arrays' data pointers, the buffer views behind them): the caller keeps
    both for the call. Built in one step; on a 4-byte reduction the binding's own work is what
    a call costs."""
    views = [_buffer(ffi, a) for a in arrays]
    return ffi.new("const void*[]", views), views


def reduce_n(datatype: int, redop: int, inputs: Sequence[np.ndarray], out: np.ndarray,
             scalars: Optional[bytes] = None) -> None:
    """out = the rank-order fold of ``inputs`` (n arrays of len(out) elements of ``datatype``).
    ``scalars``: n 8-byte PreMulSum scalars back to back, or None. ``out`` must not overlap an
    input."""
    ffi, lib = _library()
    ptrs, _views = _pointers(ffi, inputs)
    raw = ffi.from_buffer(scalars) if scalars is not None else ffi.NULL
    if lib.fakegpu_reduce_n(datatype, redop, ptrs, len(inputs), _buffer(ffi, out, True), len(out), raw) != 0:
        raise NativeNumericsError(f"cannot reduce datatype {datatype} with redop {redop} over {len(inputs)} ranks")


# Reduction plans (native/src/numerics/reduce_n.h, docs/numerics.md "Reduction order").
PLAN_RANK, PLAN_GLOO_ALLREDUCE, PLAN_GLOO_REDUCE = 0, 1, 2


def reduce_n_planned(datatype: int, redop: int, plan: int, inputs: Sequence[np.ndarray], out: np.ndarray,
                     scalars: Optional[bytes], first: int, plan_count: int) -> None:
    """reduce_n for elements [first, first + len(out)) of a ``plan_count``-element reduction
    folded in ``plan``'s order (PLAN_RANK is reduce_n itself); ``inputs`` hold those elements."""
    ffi, lib = _library()
    ptrs, _views = _pointers(ffi, inputs)
    raw = ffi.from_buffer(scalars) if scalars is not None else ffi.NULL
    if lib.fakegpu_reduce_n_planned(datatype, redop, plan, ptrs, len(inputs), _buffer(ffi, out, True), len(out),
                                    raw, first, plan_count) != 0:
        raise NativeNumericsError(f"cannot reduce datatype {datatype} with redop {redop} over {len(inputs)} ranks "
                                  f"in plan {plan} (elements {first}+{len(out)} of {plan_count})")


def gloo_chunk_elements(plan: int, n: int, count: int, elem_size: int) -> int:
    """Elements per chunk of gloo's ring (plan 1 all-reduce, 2 reduce) of ``count`` elements."""
    return int(_library()[1].fakegpu_gloo_chunk_elements(plan, n, count, elem_size))


def reduce_symmetric(datatype: int, redop: int, x: np.ndarray, out: np.ndarray, n: int,
                     scalar: Optional[bytes], exact_limit: int) -> None:
    """out = the reduction of n copies of ``x``: folded in rank order while n * len(x) <=
    ``exact_limit``, else the closed form (n*x, x**n, ...). ``out`` may be ``x`` itself."""
    ffi, lib = _library()
    raw = ffi.from_buffer(scalar.ljust(8, b"\0")) if scalar is not None else ffi.NULL
    if lib.fakegpu_reduce_symmetric(datatype, redop, _buffer(ffi, x), _buffer(ffi, out, True), len(x), n, raw,
                                    exact_limit) != 0:
        raise NativeNumericsError(f"cannot reduce datatype {datatype} with redop {redop} over {n} ranks")
