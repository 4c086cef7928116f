"""Records what an unmodified training script computes, without touching the script.

``run_examples.py`` puts this directory on the ranks' ``PYTHONPATH`` (after fgpu's own
autoload directory, whose sitecustomize chains to this one) and sets
``FAKEGPU_OBSERVE_OUT``.  In each torchrun worker (``RANK`` set) it imports torch and
records, through torch's public hooks only:

- the value of every scalar tensor ``backward()`` is called on (the loss of each step);
- the wall time at the end of every ``optimizer.step()`` (a global post-step hook), from
  which the driver takes the median step time;
- at exit, the local values of every parameter of every optimizer (``DTensor.to_local()``
  for sharded ones), in parameter-group order.

It writes ``$FAKEGPU_OBSERVE_OUT/rank<RANK>.pt``.  Nothing is recorded in other processes.

torch 2.13 seeds its default generator from the OS at start-up, so a script that never calls
``manual_seed`` (most of these examples) would draw different numbers in every run.  The
observer seeds it with ``FAKEGPU_OBSERVE_SEED`` (default: 67280421310721, the fixed seed older
torch versions started with) in every rank of both runs, so fake and port draw alike.
"""
import os

_OUT = os.environ.get("FAKEGPU_OBSERVE_OUT")

if _OUT and os.environ.get("RANK") is not None:
    import atexit
    import threading
    import time

    import torch
    from torch.optim.optimizer import register_optimizer_step_post_hook

    _rank = int(os.environ["RANK"])
    torch.manual_seed(int(os.environ.get("FAKEGPU_OBSERVE_SEED", "67280421310721")))
    _losses: list = []
    _step_ends: list = []
    _optimizers: list = []

    _original_backward = torch.Tensor.backward

    _inside = threading.local()

    def _backward(self, *args, **kwargs):
        # Re-entered when a torch-function mode hands Tensor.backward back to it: count once.
        if getattr(_inside, "active", False):
            return _original_backward(self, *args, **kwargs)
        _inside.active = True
        try:
            if self.numel() == 1:
                _losses.append(float(self.detach().float().reshape(())))
            return _original_backward(self, *args, **kwargs)
        finally:
            _inside.active = False

    torch.Tensor.backward = _backward

    def _after_step(optimizer, args, kwargs):  # noqa: ARG001
        _step_ends.append(time.perf_counter())
        # Held to the end: a trainer object may be gone by exit time, its parameters are not.
        if not any(seen is optimizer for seen in _optimizers):
            _optimizers.append(optimizer)

    register_optimizer_step_post_hook(_after_step)

    def _local(tensor):
        to_local = getattr(tensor, "to_local", None)
        value = to_local() if to_local is not None else tensor
        return value.detach().clone()

    def _dump():
        params = []
        for optimizer in _optimizers:
            for group in optimizer.param_groups:
                params.extend(_local(p) for p in group["params"])
        os.makedirs(_OUT, exist_ok=True)
        torch.save({"losses": _losses, "step_ends": _step_ends, "params": params},
                   os.path.join(_OUT, f"rank{_rank}.pt"))

    atexit.register(_dump)
