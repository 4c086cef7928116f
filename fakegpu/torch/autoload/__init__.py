"""Automatic registration of the ``fakegpu`` torch backend.

Two routes, both safe to take together (registration is idempotent):

- installed package: torch (2.5+) calls every ``torch.backends`` entry point at the end of
  ``import torch``; fakegpu's points at :func:`entry_point`.
- source tree / ``fgpu``: the launcher puts this folder (:func:`pythonpath_entry`) first on
  ``PYTHONPATH``; its ``sitecustomize.py`` registers the backend right after ``torch``
  finishes importing.  That file imports nothing from fakegpu up front, because importing
  this package imports ``fakegpu.torch`` and so torch itself.

Neither route may break ``import torch``: failures become a warning.
Set ``FAKEGPU_TORCH_AUTOLOAD=0`` to turn both off.
"""
from __future__ import annotations

import os
import sys
import warnings

DISABLE_ENV = "FAKEGPU_TORCH_AUTOLOAD"


def pythonpath_entry() -> str:
    """The folder to put on ``PYTHONPATH`` so that child interpreters register the backend."""
    return os.path.dirname(os.path.abspath(__file__))


def enabled() -> bool:
    return os.environ.get(DISABLE_ENV, "1") != "0"


def register_quietly() -> None:
    if not enabled():
        return
    package = sys.modules.get("fakegpu.torch")
    if package is not None and not hasattr(package, "register"):
        # fakegpu.torch is importing torch right now (e.g. `python -m fakegpu.torch.x`);
        # its own __init__ registers the backend once torch is there.
        return
    try:
        from fakegpu.torch import register

        register()
    except Exception as exc:  # never let a plugin break `import torch`
        warnings.warn(f"fakegpu: could not register the 'fakegpu' torch backend: {exc!r}",
                      RuntimeWarning, stacklevel=2)
        return
    start_fake_cuda_quietly()
    start_fake_world_quietly()


def start_fake_cuda_quietly() -> None:
    """Fake CUDA devices when fgpu asked for them (``FAKEGPU_FAKE_CUDA=1``) and no real GPU is
    usable; otherwise the one-line hints for NCCL / CUDA requests on a CPU-only torch."""
    try:
        import fakegpu.fake_cuda as fake_cuda

        if not fake_cuda.activate_from_environment():
            from fakegpu.fake_cuda.hints import install_hints

            install_hints()
    except Exception as exc:  # never let a plugin break `import torch`
        warnings.warn(f"fakegpu: could not start fake CUDA devices: {exc!r}", RuntimeWarning, stacklevel=2)


def start_fake_world_quietly() -> None:
    """Under ``FAKEGPU_DIST_MODE=fake`` / ``real_pp_fake_spmd``: the program's own
    ``init_process_group()`` enters the fake world (fakegpu.fake.entry).  Installed after the
    fake CUDA devices, so that its group creation wraps theirs."""
    try:
        from fakegpu.fake import entry

        if entry.requested():
            entry.install()
    except Exception as exc:  # never let a plugin break `import torch`
        warnings.warn(f"fakegpu: could not route init_process_group into the fake world: {exc!r}",
                      RuntimeWarning, stacklevel=2)


def entry_point() -> None:
    """The ``torch.backends`` entry point (called by torch at the end of ``import torch``)."""
    register_quietly()
