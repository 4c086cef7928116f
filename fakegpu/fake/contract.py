"""The launch contract of a fake world: which logical rank this process plays, and which
logical ranks are backed by a real process.

Two modes (``FAKEGPU_DIST_MODE``):

``fake``
    One process, every distributed axis is fake.  ``NGPU`` is the logical world size.  The
    process plays logical rank ``FAKE_PP_RANK * (NGPU / P)`` when ``FAKE_PP_RANK`` is set
    (P = the pipeline degree, ``FAKEGPU_PP_DEGREE``), else ``RANK`` when set, else 0.

``real_pp_fake_spmd``
    One physical process per pipeline rank: ``WORLD_SIZE`` must equal P (P defaults to
    ``WORLD_SIZE`` when ``FAKEGPU_PP_DEGREE`` is unset), the physical ``RANK`` is the PP
    coordinate and the process plays logical rank ``RANK * (NGPU / P)``.  ``FAKE_PP_RANK`` is
    refused (the coordinate comes from ``RANK``).

Generalisation: ``FAKEGPU_PHYSICAL_RANKS`` (comma-separated logical ranks, one per physical
process, in physical rank order) names any subset of logical ranks as physical in the second
mode; the physical ``RANK`` then selects its entry.

Every inconsistency raises :class:`LaunchContractError` with a message that says which
variable is wrong and how to fix the logical topology.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping, Optional

from fakegpu.shim_helpers import ShimHelpers

MODE_FAKE = "fake"
MODE_REAL_PP = "real_pp_fake_spmd"
MODES = (MODE_FAKE, MODE_REAL_PP)


class LaunchContractError(ValueError):
    """The logical/physical topology given at launch is inconsistent."""


@dataclass(frozen=True)
class LaunchContract:
    mode: str
    world_size: int                  # NGPU, the logical world size
    pp_degree: int                   # P
    pp_rank: int                     # this process's PP coordinate
    logical_rank: int                # the global logical rank this process plays
    physical_rank: int               # index of this process among the physical ones
    physical_ranks: tuple[int, ...]  # logical rank played by each physical process

    @property
    def spmd_size(self) -> int:
        """NGPU / P: the size of one pipeline stage's slice of the logical world."""
        return self.world_size // self.pp_degree

    @property
    def physical_world_size(self) -> int:
        return len(self.physical_ranks)

    def is_physical(self, logical_rank: int) -> bool:
        return logical_rank in self._physical_set

    @property
    def _physical_set(self) -> frozenset:
        return frozenset(self.physical_ranks)

    def physical_rank_of(self, logical_rank: int) -> int:
        """Physical rank of the process playing ``logical_rank`` (ValueError if none does)."""
        try:
            return self.physical_ranks.index(logical_rank)
        except ValueError:
            raise ValueError(f"logical rank {logical_rank} is not played by a physical process") from None

    def slice_of(self, logical_rank: int) -> tuple[int, int]:
        """[lo, hi) logical ranks a physical process stands for when accounting traffic.

        Each physical rank represents the logical ranks from itself up to the next physical
        rank (the first one also those below it): with the PP layout, its pipeline stage.
        The rule is the shim's (fakegpu.fake.accounting)."""
        from .accounting import slice_of

        return slice_of(self, logical_rank)

    def to_dict(self) -> dict:
        return {
            "mode": self.mode,
            "logical_world_size": self.world_size,
            "pp_degree": self.pp_degree,
            "pp_rank": self.pp_rank,
            "logical_rank": self.logical_rank,
            "physical_rank": self.physical_rank,
            "physical_world_size": self.physical_world_size,
            "physical_logical_ranks": list(self.physical_ranks),
        }


# Entering a fake world unmodified (fakegpu.fake.entry) rewrites WORLD_SIZE and RANK to the
# logical world the program must see; the launcher's values are kept in these variables, and
# the marker records what was written, so a child that inherits the rewrite reads the
# launcher's values back while a child that a launcher (torchrun) gave fresh ones uses those.
LAUNCH_WORLD_SIZE_VAR = "FAKEGPU_LAUNCH_WORLD_SIZE"
LAUNCH_RANK_VAR = "FAKEGPU_LAUNCH_RANK"
REWRITE_MARK_VAR = "FAKEGPU_FAKE_WORLD_ENV"


def rewrite_mark(world_size, rank) -> str:
    return f"WORLD_SIZE={world_size} RANK={rank}"


def rewritten(env: Mapping[str, str]) -> bool:
    """True when WORLD_SIZE/RANK in ``env`` are the fake world's rewrite, not the launcher's."""
    mark = env.get(REWRITE_MARK_VAR)
    return bool(mark) and mark == rewrite_mark(env.get("WORLD_SIZE"), env.get("RANK"))


_CDEF = """
int fakegpu_fake_contract(int count, const char* const* names, const char* const* values, int* fields,
                          int* physical, int physical_capacity, int* physical_count, char* error,
                          size_t error_capacity);
"""
_library = ShimHelpers(_CDEF, "fakegpu_fake_contract", "the fake-world launch contract's rules")

# The variables the contract reads (native/src/fake/fake_contract.cc).
_VARIABLES = ("FAKEGPU_DIST_MODE", "NGPU", "FAKEGPU_PP_DEGREE", "FAKE_PP_RANK", "RANK", "WORLD_SIZE",
              "FAKEGPU_PHYSICAL_RANKS", REWRITE_MARK_VAR, LAUNCH_WORLD_SIZE_VAR, LAUNCH_RANK_VAR)


def resolve(env: Optional[Mapping[str, str]] = None, *, ngpu: Optional[int] = None,
            pp_degree: Optional[int] = None, mode: Optional[str] = None) -> LaunchContract:
    """Read the launch contract from ``env`` (default ``os.environ``); arguments override it.

    The rules are the shim's (native/src/fake/fake_contract.cc), so a C program in the
    native fake mode and a torch program agree on who this process is and refuse the same
    launches with the same words."""
    env = os.environ if env is None else env
    view = {name: str(env[name]) for name in _VARIABLES if env.get(name) is not None}
    if ngpu is not None:
        view["NGPU"] = str(int(ngpu))
    if pp_degree is not None:
        if int(pp_degree) < 1:
            raise LaunchContractError(f"the pipeline degree must be at least 1, got {pp_degree}")
        view["FAKEGPU_PP_DEGREE"] = str(int(pp_degree))
    if mode is not None:
        view["FAKEGPU_DIST_MODE"] = mode
    ffi, lib = _library()
    keep = [ffi.new("char[]", text.encode()) for pair in view.items() for text in pair]
    names = ffi.new("const char*[]", keep[0::2])
    values = ffi.new("const char*[]", keep[1::2])
    fields = ffi.new("int[6]")
    count = ffi.new("int*")
    error = ffi.new("char[]", 1024)
    capacity = 64
    while True:
        physical = ffi.new("int[]", capacity)
        if lib.fakegpu_fake_contract(len(view), names, values, fields, physical, capacity, count, error, 1024):
            raise LaunchContractError(ffi.string(error).decode(errors="replace"))
        if count[0] <= capacity:
            break
        capacity = count[0]
    mode_code, world, p, pp_rank, logical, physical_rank = (int(fields[k]) for k in range(6))
    return LaunchContract(MODES[mode_code], world, p, pp_rank, logical, physical_rank,
                          tuple(int(physical[k]) for k in range(count[0])))
