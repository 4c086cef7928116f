"""Two torch.distributed APIs newer than torch 2.13, for programs written against them.

Programs that follow torch's main branch (TorchTitan 0.3.0 among them) call
``torch.distributed.set_timeout`` and pass pre-split microbatches to a pipeline schedule
(``schedule.step(arg_mbs=..., kwarg_mbs=..., target_mbs=...)``).  torch 2.13 has the same
operations under an older interface; where the installed torch lacks the new one, these
give it, with the semantics of the torch that introduced it:

- ``set_timeout(timeout, group=None)`` is ``distributed_c10d._set_pg_timeout`` (torch
  renamed it and kept the old name as an alias); a group carried by the fakegpu backend has
  no timeout to set: its waits are bounded by the coordinator's (FAKEGPU_COORDINATOR_TIMEOUT_MS);
- ``step(arg_mbs=, kwarg_mbs=, target_mbs=)`` runs the schedule on the given microbatches:
  what ``step`` does after splitting a whole batch, without the split.

Installed under fake CUDA devices; the CPU reference ports in verification/ install the same
two, so both sides of a comparison run the same code.  On real GPUs with torch 2.13 such a
program fails at these calls.
"""
from __future__ import annotations

import functools
import inspect

import torch


# Backends whose groups have no timeout to set.  Fake CUDA devices and a fake world each add
# theirs (both are installed in a fake world on fake devices, in either order), so one
# set_timeout serves every caller.
_TIMEOUTLESS_BACKENDS: set[str] = set()


def provide_set_timeout(skip_backend: str | None = None) -> None:
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    if skip_backend is not None:
        _TIMEOUTLESS_BACKENDS.add(skip_backend)
    if hasattr(dist, "set_timeout") or not hasattr(c10d, "_set_pg_timeout"):
        return

    def set_timeout(timeout, group=None) -> None:
        if _backend_name(c10d, group) in _TIMEOUTLESS_BACKENDS:
            return
        c10d._set_pg_timeout(timeout, group)

    dist.set_timeout = set_timeout


def _backend_name(c10d, group) -> str:
    """The backend that carries ``group``.  ``get_backend`` answers the name the group was asked
    for (a DeviceMesh on cuda asks for nccl), which a backend that takes over every group
    (the fake worlds' fakegpu_fake) does not change; a Python process group names itself."""
    pg = group if group is not None else c10d._get_default_group()
    own = getattr(pg, "getBackendName", None)
    if callable(own):
        return str(own()).lower()
    return str(c10d.get_backend(pg))


def provide_microbatch_step() -> None:
    try:
        from torch.distributed.pipelining import schedules
    except ImportError:
        return
    for cls in (schedules.PipelineScheduleSingle, schedules.PipelineScheduleMulti):
        original = cls.step
        if "arg_mbs" in inspect.signature(original).parameters:
            continue
        cls.step = _microbatch_step(original)


def _microbatch_step(original):
    @functools.wraps(original)
    def step(self, *args, target=None, losses=None, return_outputs=True, loss_kwargs=None,
             arg_mbs=None, kwarg_mbs=None, target_mbs=None, **kwargs):
        if arg_mbs is None and kwarg_mbs is None and target_mbs is None:
            return original(self, *args, target=target, losses=losses,
                            return_outputs=return_outputs, loss_kwargs=loss_kwargs, **kwargs)
        if args or kwargs or target is not None:
            raise TypeError("step() takes a whole batch (args, kwargs, target) or its "
                            "microbatches (arg_mbs, kwarg_mbs, target_mbs), not both")
        if (self._has_backward and getattr(self, "_backward_requires_autograd", True)
                and not torch.is_grad_enabled()):
            raise RuntimeError("step() requires gradients to be enabled for backward "
                               "computation; call eval() instead under torch.no_grad()")
        stages = list(getattr(self, "_stages", None) or [self._stage])
        for stage in stages:
            stage.has_backward = self._has_backward
            stage.clear_runtime_states()
        self._step_microbatches(arg_mbs, kwarg_mbs, target_mbs, losses, return_outputs,
                                loss_kwargs=loss_kwargs)
        for stage in stages:
            if stage.is_last and return_outputs:
                return self._merge_outputs(stage.output_chunks)
        return None

    return step


def install(skip_backend: str | None = None) -> None:
    provide_set_timeout(skip_backend)
    provide_microbatch_step()
