"""Which process of a fake world accounts an operation, and the event lines that record it.

The rule and the lines are the shim's (native/src/fake/fake_accounting.cc, which the native
fake mode uses too), called through cffi, so a C program and a torch program in a fake
world account the same operations and write the same events (format: fakegpu.fake.events;
rule: docs/fake-worlds.md, "Accounting").
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Optional, Sequence

from fakegpu.shim_helpers import ShimHelpers

from . import contract as _contract

_CDEF = """
int fakegpu_fake_slice_of(const int* fields, const int* physical, int physical_count, int logical_rank,
                          int* slice);
long long fakegpu_fake_op_event(const int* fields, const int* physical, int physical_count,
                                const int* members, int member_count, int comm_id, const char* kind,
                                const char* dtype, int elem_size, unsigned long long count, const char* redop,
                                int root, int peer, int rank, int* placement, char* line, size_t capacity);
long long fakegpu_fake_world_line(const int* fields, const int* physical, int physical_count,
                                  const char* frontend, char* line, size_t capacity);
long long fakegpu_fake_comm_line(int id, const char* name, const int* members, int member_count,
                                 char* line, size_t capacity);
"""


class AccountingError(ValueError):
    """An argument the accounting rule cannot take (a bad contract or communicator)."""


_library = ShimHelpers(_CDEF, "fakegpu_fake_op_event", "the fake world's accounting rule", AccountingError)


@dataclass(frozen=True)
class Placement:
    """How one operation is accounted: ``account`` False when another process (or this
    rank's own send) accounts it; ``domain`` the [lo, hi) its replicas tile instead of the
    world; ``owned`` the [lo, hi) that keeps only the replicas whose lowest member lies in it;
    ``spread`` a send/recv standing for the group's same-offset transfers."""
    account: bool
    domain: Optional[tuple[int, int]] = None
    owned: Optional[tuple[int, int]] = None
    spread: bool = False


_cache_lock = threading.Lock()
_contracts: dict = {}   # LaunchContract -> (fields, physical) cffi arrays
_groups: dict = {}      # members tuple -> cffi int array
_MAX_GROUPS = 256


def _contract_arrays(lc: _contract.LaunchContract):
    with _cache_lock:
        arrays = _contracts.get(lc)
        if arrays is None:
            ffi, _ = _library()
            fields = ffi.new("int[6]", [_contract.MODES.index(lc.mode), lc.world_size, lc.pp_degree,
                                        lc.pp_rank, lc.logical_rank, lc.physical_rank])
            physical = ffi.new("int[]", list(lc.physical_ranks))
            arrays = _contracts[lc] = (fields, physical, len(lc.physical_ranks))
        return arrays


def _group_array(members: tuple[int, ...]):
    with _cache_lock:
        array = _groups.get(members)
        if array is None:
            ffi, _ = _library()
            if len(_groups) >= _MAX_GROUPS:
                _groups.clear()
            array = _groups[members] = ffi.new("int[]", list(members) or [0])
        return array


def _text(call, capacity: int = 512) -> str:
    """Runs ``call(buffer, capacity)`` (the shim's length-or-needed convention) to a string."""
    ffi, _ = _library()
    while True:
        buf = ffi.new("char[]", capacity)
        n = call(buf, capacity)
        if n >= 0:
            return ffi.string(buf, n).decode()
        if n == -1:
            raise AccountingError("the fake world's accounting rule refused its arguments")
        capacity = -n


def slice_of(lc: _contract.LaunchContract, logical_rank: int) -> tuple[int, int]:
    """[lo, hi) logical ranks the physical process playing ``logical_rank`` stands for."""
    ffi, lib = _library()
    fields, physical, count = _contract_arrays(lc)
    out = ffi.new("int[2]")
    if lib.fakegpu_fake_slice_of(fields, physical, count, int(logical_rank), out) != 0:
        raise ValueError(f"logical rank {logical_rank} is not played by a physical process")
    return int(out[0]), int(out[1])


def op_event(lc: _contract.LaunchContract, members: Sequence[int], comm_id: int, kind: str, dtype: str,
             elem_size: int, count: int, *, redop: Optional[str], root: int, peer: int,
             rank: int) -> tuple[Placement, Optional[str]]:
    """(placement, "op" line) of one operation issued by comm rank ``rank``; the line is
    None when this process does not account it.  For ``SendRecv`` ``root`` is the sender's
    comm rank and ``peer`` the receiver's."""
    ffi, lib = _library()
    fields, physical, pcount = _contract_arrays(lc)
    members = tuple(int(m) for m in members)
    group = _group_array(members)
    placement = ffi.new("int[8]")
    kind_b, dtype_b = kind.encode(), dtype.encode()
    redop_c = ffi.new("char[]", redop.encode()) if redop else ffi.NULL
    line = _text(lambda buf, cap: lib.fakegpu_fake_op_event(
        fields, physical, pcount, group, len(members), int(comm_id), kind_b, dtype_b, int(elem_size),
        int(count), redop_c, int(root), int(peer), int(rank), placement, buf, cap))
    p = [int(placement[i]) for i in range(8)]
    where = Placement(bool(p[0]), (p[2], p[3]) if p[1] else None, (p[5], p[6]) if p[4] else None, bool(p[7]))
    return where, (line if where.account else None)


def world_line(lc: _contract.LaunchContract, frontend: str) -> str:
    """The "world" line that starts one process's events."""
    _, lib = _library()
    fields, physical, count = _contract_arrays(lc)
    return _text(lambda buf, cap: lib.fakegpu_fake_world_line(fields, physical, count, frontend.encode(), buf, cap))


def comm_line(comm_id: int, name: str, members: Sequence[int]) -> str:
    """The "comm" line that names communicator ``comm_id`` and its members."""
    _, lib = _library()
    members = tuple(int(m) for m in members)
    group = _group_array(members)
    return _text(lambda buf, cap: lib.fakegpu_fake_comm_line(int(comm_id), name.encode(), group, len(members),
                                                             buf, cap))
