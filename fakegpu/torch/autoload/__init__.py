"""Automatic registration of the ``fakegpu`` torch backend.

Two routes, both safe to take together (registration is idempotent):

- installed package: torch (2.5+) calls every ``torch.backends`` entry point at the end of
  ``import torch``; fakegpu's points at :func:`entry_point`.
- source tree / ``fgpu``: the launcher puts :func:`pythonpath_entry` (this folder) first on
  ``PYTHONPATH``; its ``sitecustomize.py`` installs :class:`AfterTorchImport`, which registers
  the backend right after ``torch`` finishes importing, without importing torch itself.

Neither route may break ``import torch``: failures become a warning.
"""
from __future__ import annotations

import importlib.util
import os
import sys
import warnings

DISABLE_ENV = "FAKEGPU_TORCH_AUTOLOAD"


def pythonpath_entry() -> str:
    """The folder to put on ``PYTHONPATH`` so that child interpreters register the backend."""
    return os.path.dirname(os.path.abspath(__file__))


def _enabled() -> bool:
    return os.environ.get(DISABLE_ENV, "1") != "0"


def register_quietly() -> None:
    if not _enabled():
        return
    try:
        import fakegpu.torch  # noqa: F401 - importing registers the backend
    except Exception as exc:  # never let a plugin break `import torch`
        warnings.warn(f"fakegpu: could not register the 'fakegpu' torch backend: {exc!r}",
                      RuntimeWarning, stacklevel=2)


def entry_point() -> None:
    """The ``torch.backends`` entry point (called by torch at the end of ``import torch``)."""
    register_quietly()


class AfterTorchImport:
    """A meta-path finder that runs :func:`register_quietly` once ``torch`` has imported."""

    def find_spec(self, name, path=None, target=None):
        if name != "torch":
            return None
        sys.meta_path.remove(self)  # one shot; also keeps find_spec below from recursing
        spec = importlib.util.find_spec("torch")
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        original = spec.loader.exec_module

        def exec_module(module):
            original(module)
            register_quietly()

        spec.loader.exec_module = exec_module
        return spec


def install_import_hook() -> None:
    if not _enabled():
        return
    if "torch" in sys.modules:
        register_quietly()
    elif not any(isinstance(f, AfterTorchImport) for f in sys.meta_path):
        sys.meta_path.insert(0, AfterTorchImport())
