"""The launch contract of a fake world: which logical rank this process plays, and which
logical ranks are backed by a real process.

Two modes (``FAKEGPU_DIST_MODE``):

``fake``
    One process, every distributed axis is fake.  ``NGPU`` is the logical world size.  The
    process plays logical rank ``FAKE_PP_RANK * (NGPU / P)`` when ``FAKE_PP_RANK`` is set
    (P = the pipeline degree, ``FAKEGPU_PP_DEGREE``), else ``RANK`` when set, else 0.

``real_pp_fake_spmd``
    One physical process per pipeline rank: ``WORLD_SIZE`` must equal P, the physical
    ``RANK`` is the PP coordinate and the process plays logical rank ``RANK * (NGPU / P)``.
    ``FAKE_PP_RANK`` is refused (the coordinate comes from ``RANK``).

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
        """
        ordered = sorted(self.physical_ranks)
        if len(ordered) <= 1:
            return 0, self.world_size
        i = ordered.index(logical_rank)
        lo = 0 if i == 0 else ordered[i]
        hi = ordered[i + 1] if i + 1 < len(ordered) else self.world_size
        return lo, hi

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


def _int_var(env: Mapping[str, str], name: str, *, minimum: int = 0) -> Optional[int]:
    raw = env.get(name)
    if raw is None or str(raw).strip() == "":
        return None
    try:
        value = int(str(raw).strip())
    except ValueError:
        raise LaunchContractError(f"{name}={raw!r} is not an integer") from None
    if value < minimum:
        raise LaunchContractError(f"{name}={value} must be at least {minimum}")
    return value


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


def launch_view(env: Mapping[str, str]) -> Mapping[str, str]:
    """``env`` with the launcher's WORLD_SIZE and RANK (undoing the fake world's rewrite)."""
    if not rewritten(env):
        return env
    view = dict(env)
    for name, kept in (("WORLD_SIZE", LAUNCH_WORLD_SIZE_VAR), ("RANK", LAUNCH_RANK_VAR)):
        value = env.get(kept, "")
        if value:
            view[name] = value
        else:
            view.pop(name, None)
    return view


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def resolve(env: Optional[Mapping[str, str]] = None, *, ngpu: Optional[int] = None,
            pp_degree: Optional[int] = None, mode: Optional[str] = None) -> LaunchContract:
    """Read the launch contract from ``env`` (default ``os.environ``); arguments override it."""
    env = launch_view(os.environ if env is None else env)
    mode = (mode or env.get("FAKEGPU_DIST_MODE") or MODE_FAKE).strip().lower()
    if mode not in MODES:
        raise LaunchContractError(f"FAKEGPU_DIST_MODE={mode!r} is not a fake-world mode; "
                                  f"use one of {', '.join(MODES)}")
    world = ngpu if ngpu is not None else _int_var(env, "NGPU", minimum=1)
    if world is None:
        raise LaunchContractError("NGPU is not set: set NGPU to the logical world size "
                                  "(the number of GPUs the job would use for real)")
    if world < 1:
        raise LaunchContractError(f"NGPU={world} must be at least 1")
    p = pp_degree if pp_degree is not None else _int_var(env, "FAKEGPU_PP_DEGREE", minimum=1)
    p = 1 if p is None else p
    if p < 1:
        raise LaunchContractError(f"the pipeline degree must be at least 1, got {p}")
    if world % p:
        multiples = f"{(world // p) * p or p} or {(world // p + 1) * p}"
        raise LaunchContractError(
            f"NGPU={world} is not divisible by the pipeline degree P={p}: every pipeline stage "
            f"needs NGPU/P whole logical ranks. Fix the logical topology: make NGPU a multiple "
            f"of {p} (e.g. {multiples}) or use a PP degree that divides {world} "
            f"({', '.join(map(str, _divisors(world)[:8]))}{', ...' if len(_divisors(world)) > 8 else ''})")
    spmd = world // p
    fake_pp = _int_var(env, "FAKE_PP_RANK")
    rank = _int_var(env, "RANK")
    phys_world = _int_var(env, "WORLD_SIZE", minimum=1)

    if mode == MODE_FAKE:
        if phys_world is not None and phys_world > 1:
            raise LaunchContractError(
                f"WORLD_SIZE={phys_world}: pure fake mode runs a single process. Launch one process "
                f"(torchrun --nproc-per-node 1), or use FAKEGPU_DIST_MODE={MODE_REAL_PP} for one "
                f"process per pipeline rank")
        if fake_pp is not None:
            if fake_pp >= p:
                raise LaunchContractError(
                    f"FAKE_PP_RANK={fake_pp} is out of range for PP degree P={p}: the PP coordinate "
                    f"must be in 0..{p - 1}. Choose an existing pipeline stage or raise FAKEGPU_PP_DEGREE")
            logical, pp_rank = fake_pp * spmd, fake_pp
        elif rank is not None:
            if rank >= world:
                raise LaunchContractError(
                    f"RANK={rank} is out of range for the logical world NGPU={world}: the logical rank "
                    f"must be in 0..{world - 1}. Lower RANK, raise NGPU, or set FAKE_PP_RANK instead")
            logical, pp_rank = rank, rank // spmd
        else:
            logical, pp_rank = 0, 0
        return LaunchContract(mode, world, p, pp_rank, logical, 0, (logical,))

    # Real pipeline, fake SPMD.
    if fake_pp is not None:
        raise LaunchContractError(
            f"FAKE_PP_RANK={fake_pp} is invalid in {MODE_REAL_PP} mode: the physical RANK is the PP "
            f"coordinate there. Unset FAKE_PP_RANK, or use FAKEGPU_DIST_MODE={MODE_FAKE} to fake "
            f"every axis")
    if rank is None or phys_world is None:
        raise LaunchContractError(
            f"{MODE_REAL_PP} mode needs the physical RANK and WORLD_SIZE of each process: launch it "
            f"with torchrun --nproc-per-node {p} (one process per PP rank)")
    explicit = env.get("FAKEGPU_PHYSICAL_RANKS", "").strip()
    if explicit:
        try:
            physical = tuple(int(x) for x in explicit.replace(" ", "").split(",") if x)
        except ValueError:
            raise LaunchContractError(f"FAKEGPU_PHYSICAL_RANKS={explicit!r} is not a comma-separated "
                                      f"list of logical ranks") from None
        bad = [g for g in physical if not 0 <= g < world]
        if bad:
            raise LaunchContractError(f"FAKEGPU_PHYSICAL_RANKS names logical ranks {bad} outside "
                                      f"the logical world 0..{world - 1} (NGPU={world})")
        if len(set(physical)) != len(physical):
            raise LaunchContractError(f"FAKEGPU_PHYSICAL_RANKS={explicit!r} repeats a logical rank")
        if phys_world != len(physical):
            raise LaunchContractError(
                f"WORLD_SIZE={phys_world} but FAKEGPU_PHYSICAL_RANKS lists {len(physical)} logical "
                f"ranks: the physical allocation must hold exactly one process per listed rank")
    else:
        if phys_world != p:
            raise LaunchContractError(
                f"WORLD_SIZE={phys_world} but the PP degree is P={p}: in {MODE_REAL_PP} mode the "
                f"physical allocation must hold exactly one process per PP rank. Launch {p} "
                f"processes (torchrun --nproc-per-node {p}) or set FAKEGPU_PP_DEGREE={phys_world} "
                f"if NGPU={world} allows it")
        physical = tuple(c * spmd for c in range(p))
    if rank >= phys_world:
        raise LaunchContractError(f"RANK={rank} is out of range for WORLD_SIZE={phys_world}: the "
                                  f"physical rank must be in 0..{phys_world - 1}")
    logical = physical[rank]
    return LaunchContract(mode, world, p, logical // spmd, logical, rank, physical)
