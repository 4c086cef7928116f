"""SPMD-symmetric local completion of collectives on numpy arrays.

In a fake world only one rank of each communicator exists.  We complete every operation as
if each member held exactly what this rank holds (the SPMD assumption), so results have the
right shapes, dtypes and plausible values:

- all-reduce: sum = n*x, avg = x, prod = x**n, max = min = x, premulsum = n*(s*x);
- broadcast: x (the root held what we hold); reduce: like all-reduce on the root, the
  non-root output untouched (NCCL does not write it);
- all-gather: x repeated n times; reduce-scatter: this rank's share, reduced n times;
- all-to-all: output block j is what rank j sends to us, i.e. its block r == our block r;
- gather: x repeated n times on the root; scatter: the root's block r (zeros on a
  non-root, which has no list to take it from);
- send/recv: see :class:`PeerExchange`.

Every kind NCCL has is the native fake mode's own code (native/src/fake/fake_results.cc, and
native/src/numerics/fake_numerics.cc for the reductions), called through cffi; only torch's
uneven all-to-all and the reductions of dtypes NCCL has no type for are computed here.

Reductions are dtype-exact like the real data path, and they are the shim's own code
(native/src/numerics/fake_numerics.cc, called through fakegpu/native_numerics.py): floats narrower than
float32 accumulate in float32 and round once, float64 in float64, n copies folded in rank order;
integer sums wrap and integer avg truncates. Above ``EXACT_ELEMENT_OPS`` element operations
(n x count) the closed forms above are used, computed in the accumulator type and rounded once,
which can differ from rank-ordered folding in the last bit for float sums.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from fakegpu import protocol as P
from fakegpu import native_numerics
from fakegpu.common.dtypes import DTYPE_BY_NAME, DType
from fakegpu.shim_helpers import ShimHelpers

# Above this many element operations (group size x element count) use the closed forms.
EXACT_ELEMENT_OPS = 1 << 24

REDOPS = {"sum": P.REDOP_SUM, "prod": P.REDOP_PROD, "max": P.REDOP_MAX, "min": P.REDOP_MIN,
          "avg": P.REDOP_AVG, "premulsum": P.REDOP_PREMULSUM}
_BY_NP = {d.np: d for d in DTYPE_BY_NAME.values() if d.ml_name is None}
_BY_ML_NAME = {d.ml_name: d for d in DTYPE_BY_NAME.values() if d.ml_name is not None}  # ml_dtypes's, by name


def dtype_of(array: np.ndarray) -> Optional[DType]:
    """The NCCL datatype of ``array`` (None for dtypes NCCL has no type for, e.g. int16). An array
    of ml_dtypes's types means ml_dtypes is loaded; otherwise it is not imported."""
    found = _BY_NP.get(array.dtype)
    if found is None:
        found = _BY_ML_NAME.get(array.dtype.name)
        if found is not None and array.dtype != found.np:
            found = None
    return found


def _redop_code(redop) -> int:
    if isinstance(redop, str):
        try:
            return REDOPS[redop.lower()]
        except KeyError:
            raise ValueError(f"unknown reduction {redop!r}; expected one of {', '.join(REDOPS)}") from None
    return int(redop)


def reduce_symmetric(x: np.ndarray, n: int, redop="sum", scale: Optional[float] = None,
                     *, exact_limit: int = EXACT_ELEMENT_OPS) -> np.ndarray:
    """The reduction of n copies of ``x`` (a new 1-D array of x's dtype): the shim's own
    fake-mode reduction (native/src/numerics/fake_numerics.cc through fakegpu/native_numerics.py), so the
    Python and the native fake modes compute the same bits by construction."""
    if n < 1:
        raise ValueError(f"group size must be at least 1, got {n}")
    code = _redop_code(redop)
    if code == P.REDOP_PREMULSUM and scale is None:
        raise ValueError("premulsum needs its scale factor")
    x = np.ascontiguousarray(x).reshape(-1)
    out = np.empty_like(x)
    if x.size == 0:
        return out
    if code in (P.REDOP_MAX, P.REDOP_MIN):
        np.copyto(out, x)
        return out
    dt = dtype_of(x)
    if dt is not None:
        # The scale is a value of the op's datatype (NCCL's scalar argument).
        scalar = np.array([scale]).astype(dt.np).tobytes() if code == P.REDOP_PREMULSUM else None
        native_numerics.reduce_symmetric(dt.code, code, x, out, n, scalar, exact_limit)
        return out
    return _untyped_closed_form(x, n, code, scale, out)


def _untyped_closed_form(x, n, code, scale, out):
    """Arrays of a dtype NCCL has no type for (torch's int16 and bool tensors): numpy, closed
    form. Their collectives exist only in the Python fake backend."""
    if x.dtype == np.bool_:
        np.copyto(out, x)   # logical or/and of identical values
        return out
    if np.issubdtype(x.dtype, np.floating):
        acc = x.astype(np.float64)
        if code == P.REDOP_PREMULSUM:
            acc = acc * float(np.array([scale]).astype(x.dtype)[0])
        if code in (P.REDOP_SUM, P.REDOP_PREMULSUM):
            acc = acc * n
        elif code == P.REDOP_PROD:
            acc = np.power(acc, n)
        np.copyto(out, acc, casting="unsafe")
        return out
    # Integers narrower than 32 bits: numpy arithmetic wraps modulo 2^bits, like NCCL.
    with np.errstate(over="ignore"):
        v = x.copy()
        if code == P.REDOP_PREMULSUM:
            v = v * np.array([scale]).astype(x.dtype)[0]
        if code in (P.REDOP_SUM, P.REDOP_PREMULSUM, P.REDOP_AVG):
            v = v * np.array(n, dtype=np.uint64).astype(x.dtype)   # n modulo 2^bits
        elif code == P.REDOP_PROD:
            v = _int_power(v, n)
        if code == P.REDOP_AVG:   # C's truncation toward zero; exact in float64 for these widths
            v = np.fix(v.astype(np.float64) / n).astype(x.dtype)
    np.copyto(out, v)
    return out


def _int_power(v: np.ndarray, n: int) -> np.ndarray:
    result = np.ones_like(v)
    base = v.copy()
    with np.errstate(over="ignore"):
        while n:
            if n & 1:
                result = result * base
            base = base * base
            n >>= 1
    return result


# The per-kind results and the send/recv mirror are the native fake mode's own code
# (native/src/fake/fake_results.cc), so a C program and a torch program in a fake world get
# the same bits by construction.
_CDEF = """
int fakegpu_fake_collective(int kind, int datatype, int redop, int n, int rank, int root, const void* in,
                            void* out, uint64_t count, uint64_t elem_size, const uint8_t* scalar,
                            uint64_t exact_limit);
void* fakegpu_peer_mirror_new(uint64_t max_pending);
void fakegpu_peer_mirror_free(void* mirror);
void fakegpu_peer_mirror_send(void* mirror, uint64_t group, int peer, int datatype, uint64_t count,
                              const void* data, uint64_t nbytes);
int fakegpu_peer_mirror_recv(void* mirror, uint64_t group, int rank, int n, int peer, int datatype,
                             uint64_t count, void* out, uint64_t nbytes);
"""


class FakeResultsError(RuntimeError):
    """The native fake results refused a call (bad arguments) or are not available."""


_library = ShimHelpers(_CDEF, "fakegpu_fake_collective", "the fake world's results", FakeResultsError)
_STATUS = {1: "unknown operation kind", 2: "cannot reduce this datatype with this operator",
           3: "bad arguments (group size or rank)"}


def _datatype_key(array: np.ndarray) -> int:
    """The wire datatype, or a negative stand-in for a dtype NCCL has none for (its data can
    still be moved and matched, never reduced)."""
    dt = dtype_of(array)
    return dt.code if dt is not None else -1 - array.dtype.num


def _collective(kind: int, x: np.ndarray, out: np.ndarray, n: int, rank: int = 0, root: int = 0,
                count: Optional[int] = None) -> np.ndarray:
    """A data-moving kind (broadcast, gathers, all-to-all, scatter) by fake_results.cc."""
    ffi, lib = _library()
    count = x.size if count is None else count
    dt = dtype_of(x)
    status = lib.fakegpu_fake_collective(kind, dt.code if dt is not None else -1, 0, n, rank, root,
                                         ffi.from_buffer(x), ffi.from_buffer(out, require_writable=True),
                                         count, x.dtype.itemsize, ffi.NULL, EXACT_ELEMENT_OPS)
    if status:
        raise FakeResultsError(f"fake {P.KIND_NAMES.get(kind, kind)} of {n} ranks: {_STATUS.get(status, status)}")
    return out


def all_reduce(x, n, redop="sum", scale=None, **kw) -> np.ndarray:
    return reduce_symmetric(x, n, redop, scale, **kw)


def broadcast(x: np.ndarray) -> np.ndarray:
    flat = np.ascontiguousarray(x).reshape(-1)
    return _collective(P.KIND_BROADCAST, flat, np.empty_like(flat), 1).reshape(np.shape(x))


def reduce(x, n, root: int, rank: int, redop="sum", scale=None, **kw) -> Optional[np.ndarray]:
    """The root's result; None on a non-root (its output is not written)."""
    return reduce_symmetric(x, n, redop, scale, **kw) if rank == root else None


def all_gather(x: np.ndarray, n: int) -> np.ndarray:
    flat = np.ascontiguousarray(x).reshape(-1)
    return _collective(P.KIND_ALLGATHER, flat, np.empty(n * flat.size, dtype=flat.dtype), n)


def reduce_scatter(inp: np.ndarray, n: int, rank: int, redop="sum", scale=None, **kw) -> np.ndarray:
    flat = np.ascontiguousarray(inp).reshape(-1)
    if flat.size % n:
        raise ValueError(f"reduce-scatter input of {flat.size} elements is not divisible by {n} ranks")
    c = flat.size // n
    return reduce_symmetric(flat[rank * c:(rank + 1) * c], n, redop, scale, **kw)


def all_to_all(inp: np.ndarray, n: int, rank: int,
               in_splits: Optional[list[int]] = None, out_splits: Optional[list[int]] = None,
               row: int = 1) -> np.ndarray:
    """Flat output.  Splits count rows of ``row`` elements (None: even split).

    Rank j sends us its block ``rank``, which by symmetry equals ours; if the output block
    for j is a different size (uneven splits), it is filled from our block and zero-padded.
    """
    flat = np.ascontiguousarray(inp).reshape(-1)
    if in_splits is None:
        if flat.size % n:
            raise ValueError(f"all-to-all input of {flat.size} elements is not divisible by {n} ranks")
        return _collective(P.KIND_ALLTOALL, flat, np.empty_like(flat), n, rank, count=flat.size // n)
    # Uneven splits exist only in torch (all_to_all_single); NCCL has no such collective.
    offsets = np.cumsum([0] + [s * row for s in in_splits])
    mine = flat[offsets[rank]:offsets[rank + 1]]
    out_splits = list(out_splits) if out_splits is not None else list(in_splits)
    blocks = []
    for j in range(n):
        size = out_splits[j] * row
        block = np.zeros(size, dtype=flat.dtype)
        k = min(size, mine.size)
        block[:k] = mine[:k]
        blocks.append(block)
    return np.concatenate(blocks) if blocks else np.empty(0, dtype=flat.dtype)


def gather(x: np.ndarray, n: int, root: int, rank: int) -> Optional[np.ndarray]:
    return all_gather(x, n) if rank == root else None


def scatter(blocks: Optional[np.ndarray], n: int, root: int, rank: int, count: int,
            dtype) -> np.ndarray:
    """This rank's block of the root's flat input (zeros on a non-root)."""
    out = np.empty(count, dtype=dtype)
    if rank == root and blocks is not None:
        flat = np.ascontiguousarray(blocks, dtype=dtype).reshape(-1)
        if flat.size < n * count:
            raise ValueError(f"scatter input of {flat.size} elements is less than {n} blocks of {count}")
        return _collective(P.KIND_SCATTER, flat, out, n, rank, root, count=count)
    out.fill(0)
    return out


class PeerExchange:
    """Send/recv between this rank and fake peers, by symmetry: the native fake mode's
    PeerMirror (native/src/fake/fake_results.h, which says how a receive is matched).

    Sent payloads are copied (the sender may reuse its buffer); at most ``max_pending``
    unmatched sends per group are kept, the oldest dropped first. An unmatched receive
    yields zeros: deterministic, unlike stale memory. Values are placeholders either way; a
    fake world checks shapes, ownership and memory, not numerics.
    """

    def __init__(self, max_pending: int = 64):
        self.max_pending = max_pending
        self._mirror = None
        self._group_ids: dict[object, int] = {}

    def _native(self):
        ffi, lib = _library()
        if self._mirror is None:
            mirror = lib.fakegpu_peer_mirror_new(self.max_pending)
            if mirror == ffi.NULL:
                raise MemoryError("fakegpu: cannot allocate the fake world's send/recv mirror")
            self._mirror = ffi.gc(mirror, lib.fakegpu_peer_mirror_free)
        return ffi, lib, self._mirror

    def _group(self, group_key) -> int:
        return self._group_ids.setdefault(group_key, len(self._group_ids) + 1)

    def send(self, group_key, rank: int, n: int, peer: int, data: np.ndarray) -> None:
        ffi, lib, mirror = self._native()
        flat = np.ascontiguousarray(data).reshape(-1)
        lib.fakegpu_peer_mirror_send(mirror, self._group(group_key), peer, _datatype_key(flat), flat.size,
                                     ffi.from_buffer(flat), flat.nbytes)

    def recv(self, group_key, rank: int, n: int, peer: int, count: int, dtype) -> tuple[np.ndarray, bool]:
        """(data, matched): the payload for a receive of ``count`` elements from ``peer``."""
        ffi, lib, mirror = self._native()
        out = np.empty(count, dtype=np.dtype(dtype))
        matched = lib.fakegpu_peer_mirror_recv(mirror, self._group(group_key), rank, n, peer, _datatype_key(out),
                                               count, ffi.from_buffer(out, require_writable=True), out.nbytes)
        return out, bool(matched)
