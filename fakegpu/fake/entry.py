"""Unmodified programs enter the fake world: their own ``init_process_group()`` lands in it.

Under ``FAKEGPU_DIST_MODE=fake`` or ``real_pp_fake_spmd`` (``fgpu --dist-mode ...``) two steps
run in every Python process fgpu starts (its torch autoload hook):

- :func:`prepare_environment`, at interpreter start (before the program reads its
  environment): once the launch contract resolves, ``WORLD_SIZE`` becomes NGPU and ``RANK``
  the logical rank this process plays; ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT``
  get defaults when absent.  The launcher's values are kept (native/src/fake/fake_contract.cc
  reads them back), so
  the contract still sees the physical processes.  When the contract does not resolve
  (e.g. torchrun's agent, which has no RANK), nothing changes: the error surfaces at
  ``init_process_group``, where it belongs.
- :func:`install`, at the end of ``import torch``: ``torch.distributed.init_process_group``
  ignores the backend, ``init_method``, store and sizes the program asked for (``env://``,
  ``tcp://``, ``file://``, a store, torch's ``"fake"`` backend, ``"nccl"``) and starts the fake
  world (``fakegpu.fake.process_group.init_process_group``); every later group
  (``new_group``, DeviceMesh slices, ``split_group``) is a ``fakegpu_fake`` group whatever
  backend it names; the default backend of ``cpu`` and ``cuda`` is ``fakegpu_fake``.

A size or rank the program passes explicitly must be the logical one (NGPU, the contract's
rank) or absent: anything else is a launch mistake and raises ``LaunchContractError``.
``FAKEGPU_FAKE_WORLD_ENTRY=0`` turns both steps off.
"""
from __future__ import annotations

import functools
import os
from typing import MutableMapping, Optional

from . import contract as _contract

DISABLE_ENV = "FAKEGPU_FAKE_WORLD_ENTRY"

_installed = False


def requested(env=None) -> bool:
    env = os.environ if env is None else env
    mode = (env.get("FAKEGPU_DIST_MODE") or "").strip().lower()
    return mode in _contract.MODES and env.get(DISABLE_ENV, "1") != "0"


def prepare_environment(env: Optional[MutableMapping[str, str]] = None) -> Optional[_contract.LaunchContract]:
    """Rewrite WORLD_SIZE/RANK (and default LOCAL_RANK, MASTER_*) for the fake world.

    Returns the contract, or None when not in a fake-world mode or the contract does not
    resolve here (then ``env`` is left as it was)."""
    env = os.environ if env is None else env
    if not requested(env):
        return None
    try:
        lc = _contract.resolve(env)
    except _contract.LaunchContractError:
        return None
    if _contract.rewritten(env):
        return lc
    env[_contract.LAUNCH_WORLD_SIZE_VAR] = env.get("WORLD_SIZE", "")
    env[_contract.LAUNCH_RANK_VAR] = env.get("RANK", "")
    env["WORLD_SIZE"] = str(lc.world_size)
    env["RANK"] = str(lc.logical_rank)
    env[_contract.REWRITE_MARK_VAR] = _contract.rewrite_mark(env["WORLD_SIZE"], env["RANK"])
    # A single process is device 0 of its node; torchrun's own values stay.
    env.setdefault("LOCAL_RANK", "0")
    env.setdefault("MASTER_ADDR", "127.0.0.1")
    env.setdefault("MASTER_PORT", "29500")
    return lc


def _check_explicit(world_size, rank) -> None:
    lc = _contract.resolve()
    if world_size not in (None, -1) and int(world_size) != lc.world_size:
        raise _contract.LaunchContractError(
            f"init_process_group(world_size={world_size}) but NGPU={lc.world_size}: a fake world's "
            f"process group spans the logical world; pass world_size=NGPU or leave it out")
    if rank not in (None, -1) and int(rank) != lc.logical_rank:
        raise _contract.LaunchContractError(
            f"init_process_group(rank={rank}) but the launch contract makes this process logical "
            f"rank {lc.logical_rank}; pass rank={lc.logical_rank} (os.environ['RANK']) or leave it out")


def install() -> None:
    """Route torch.distributed's process-group creation into the fake world (idempotent)."""
    global _installed
    if _installed:
        return
    _installed = True
    prepare_environment()

    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    from . import process_group as fake_pg

    fake_pg.register()
    for device in ("cpu", "cuda"):
        c10d.Backend.default_device_backend_map[device] = fake_pg.BACKEND_NAME

    original_init = c10d.init_process_group

    @functools.wraps(original_init)
    def init_process_group(backend=None, init_method=None, timeout=None, world_size=-1, rank=-1,
                           store=None, group_name="", pg_options=None, device_id=None, **kwargs):
        if str(backend or "").lower() == fake_pg.BACKEND_NAME and store is not None:
            # fakegpu.fake.process_group.init_process_group itself, or a program that asks for
            # this backend by name with its own store: the backend checks sizes and rank.
            return original_init(backend, init_method, timeout, world_size, rank, store,
                                 group_name, pg_options, device_id, **kwargs)
        _check_explicit(world_size, rank)
        fake_pg.init_process_group(timeout=timeout)
        if os.environ.get("FAKEGPU_PLAN_RECORD"):   # fgpu plan on a script: record from here on
            from fakegpu.plan.generic import start_recording

            start_recording()

    dist.init_process_group = init_process_group
    c10d.init_process_group = init_process_group

    original_helper = c10d._new_process_group_helper

    @functools.wraps(original_helper)
    def new_process_group_helper(group_size, group_rank, global_ranks_in_group, backend, store,
                                 group_name, backend_options=None, timeout=None, pg_tag=None,
                                 device_id=None, group_desc=None, **newer):
        # newer: arguments later torch releases add (2.14: enable_reconfigure), passed on.
        # In a fake world every communicator is fake, whatever backend the program names
        # (the real pipeline transport of real_pp_fake_spmd is made inside the backend).
        return original_helper(group_size, group_rank, global_ranks_in_group,
                               c10d.Backend(fake_pg.BACKEND_NAME), store, group_name,
                               backend_options=None, timeout=timeout, pg_tag=pg_tag,
                               device_id=None, group_desc=group_desc, **newer)

    c10d._new_process_group_helper = new_process_group_helper

    if os.environ.get("FAKEGPU_MEMORY_CAPTURE_PATH"):
        from . import memory

        memory.install_global_hooks()

    # torch.distributed APIs newer than the installed torch (set_timeout, pipeline
    # step(arg_mbs=)), the same ones fake CUDA devices give; a fake group has no timeout to set:
    # in a fake world nothing waits for a peer.
    from fakegpu.fake_cuda import torch_compat

    torch_compat.install(skip_backend=fake_pg.BACKEND_NAME)
    mode = (os.environ.get("FAKEGPU_DIST_MODE") or "").strip().lower()
    if mode == _contract.MODE_FAKE:
        _explain_pipeline_failures()
    elif mode == _contract.MODE_REAL_PP:
        _check_pipeline_groups_are_physical()


PIPELINE_HINT = (
    "fakegpu: torch.distributed.pipelining schedules cannot run in pure fake mode: a stage "
    "receives its neighbours' activation and gradient shapes from their processes, and in one "
    "process those stages do not exist. Run one process per pipeline rank instead: "
    "NGPU=N FAKEGPU_PP_DEGREE=P fgpu --dist-mode real_pp_fake_spmd -- torchrun --nproc-per-node P ... "
    "(docs/fake-worlds.md, \"Why pipelining schedules do not run in pure fake mode\")")


def _wrap_schedule_steps(marker: str, wrap) -> None:
    """Replace ``step`` of torch's two pipeline-schedule bases with ``wrap(original_step)``,
    once per ``marker`` (a flag set on the wrapper; wrappers installed later keep it)."""
    try:
        from torch.distributed.pipelining import schedules
    except ImportError:
        return
    for cls in (schedules.PipelineScheduleSingle, schedules.PipelineScheduleMulti):
        original = cls.step
        if getattr(original, marker, False):
            continue
        step = wrap(original)
        functools.update_wrapper(step, original)
        setattr(step, marker, True)
        cls.step = step


def _explain_pipeline_failures() -> None:
    """A pipeline schedule that fails in pure fake mode on its peers' metadata fails with the
    reason and what to run instead, not only torch's "Expected _StageBackwardMeta" line."""
    try:
        from torch.distributed.pipelining import _utils
    except ImportError:
        return
    metadata_error = getattr(_utils, "PipeliningMetadataError", None)
    if metadata_error is None:
        return

    def wrap(original):
        def step(self, *args, **kwargs):
            try:
                return original(self, *args, **kwargs)
            except metadata_error as exc:
                raise RuntimeError(f"{PIPELINE_HINT}; torch said: {exc}") from exc
        return step

    _wrap_schedule_steps("_fakegpu_explained", wrap)


def _schedule_stages(schedule) -> list:
    stages = getattr(schedule, "_stages", None)      # PipelineScheduleMulti
    if stages is None:
        stage = getattr(schedule, "_stage", None)    # PipelineScheduleSingle
        stages = [] if stage is None else [stage]
    return list(stages)


def pipeline_group_problem(stage, lc: _contract.LaunchContract) -> Optional[str]:
    """Why ``stage``'s pipeline group cannot carry a real pipeline under ``lc``, or None.

    In real_pp_fake_spmd only a group whose members are all played by processes runs for real;
    a pipeline group with a fake member would have a stage exchange activations with a stage
    that does not exist (it would fail later on a metadata or shape mismatch, far from the cause)."""
    import torch.distributed as dist

    group = getattr(stage, "group", None)
    members = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
    absent = [m for m in members if not lc.is_physical(m)]
    if not absent:
        return None
    shown = ", ".join(map(str, absent[:8])) + (", ..." if len(absent) > 8 else "")
    # The pipeline group of logical rank 0, if groups are translates of each other (DeviceMesh's are).
    first_pipeline = [m - min(members) for m in members]
    return (f"fakegpu: pipeline stage {getattr(stage, 'stage_index', '?')} sends over the group of "
            f"logical ranks {members}, but no process plays rank(s) {shown}: in real_pp_fake_spmd "
            f"the {lc.physical_world_size} processes play logical ranks {list(lc.physical_ranks)} "
            f"(the first rank of each pipeline stage's NGPU/P = {lc.spmd_size} consecutive ranks, "
            f"i.e. the pipeline dimension outermost in the DeviceMesh). Make the pipeline dimension "
            f"the first mesh dimension, or make the processes play one pipeline group's ranks, in "
            f"stage order: e.g. FAKEGPU_PHYSICAL_RANKS={','.join(map(str, first_pipeline))}")


def _check_pipeline_groups_are_physical() -> None:
    """Before a schedule's first step in real_pp_fake_spmd mode, check that every stage it runs
    exchanges with processes that exist, and say what to change when not."""
    def wrap(original):
        def step(self, *args, **kwargs):
            if not getattr(self, "_fakegpu_groups_checked", False):
                lc = _contract.resolve()
                for stage in _schedule_stages(self):
                    problem = pipeline_group_problem(stage, lc)
                    if problem:
                        raise _contract.LaunchContractError(problem)
                self._fakegpu_groups_checked = True
            return original(self, *args, **kwargs)
        return step

    _wrap_schedule_steps("_fakegpu_checked", wrap)
